"""Online serving: requests arrive at a given rate; how long until the first token, and
between tokens?

Offline throughput (``bench throughput``) hands the engine every request at once and
times the lot. A server sees requests arrive one by one, and its users feel two numbers:
**TTFT**, the time from sending a request to its first token (queueing + prefill), and
**ITL**, the inter-token latency, the gap between consecutive tokens of one stream (one
engine step, longer when prefills of newcomers share the step). Both grow with the
request rate: more requests in flight make every step bigger, until the engine cannot keep
up and the queue, and with it TTFT, grows without bound.

The load: ``num_requests`` requests whose arrival times are a Poisson process of the given
rate (exponential gaps, seeded; ``inf`` sends all at once), each a streaming
``/v1/completions`` call with random token ids as the prompt, ``ignore_eos`` and a fixed
``max_tokens``, so every request produces exactly its planned tokens. An SSE chunk
carries the tokens of one engine step for that request (one, for a decode), or of several
when the server was behind that stream; ITL is the gap between chunks, TPOT the time per
token after the first. The server runs as ``minivllm serve`` in its own process, on the
same workload that is also run offline for comparison; its engine core in a process of its
own or in a thread of the server's (``engine_process``; by default as ``minivllm serve``
decides: a process on a GPU). The load comes from ``client_processes`` processes, so that
reading the streams is not itself the bottleneck (each run reports how busy the clients
were, beside the server and the core).
"""
import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minivllm.bench.roofline import release_memory, save_report, timed
from minivllm.testing import ServeProcess, cpu_seconds


@dataclass
class RequestResult:
    prompt_tokens: int
    planned_tokens: int
    sent: float  # seconds after the start of the run
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with a token
    output_tokens: int = 0  # as the server's usage reports it
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT): what ITL is when a chunk
        carries several tokens."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def arrival_times(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Send times of a Poisson process of ``rate`` requests per second (all 0 for inf)."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def send_one(client, url: str, model: str, prompt: list[int], max_tokens: int, sent: float,
                   start: float, temperature: float = 0.0) -> RequestResult:
    """One streaming completion; the time of every chunk that carried a token. The events
    are cut out of the bytes as they arrive (a read can hold several: each gets the read's
    time), which costs the client a fraction of what a line-by-line text decoder would."""
    result = RequestResult(len(prompt), max_tokens, sent)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            pending = b""
            async for data in response.aiter_bytes():
                now = time.perf_counter() - start
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    chunk = json.loads(event[len(b"data: "):])
                    if chunk["choices"]:
                        result.chunk_times.append(now)
                    if chunk.get("usage"):
                        result.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # recorded per request, not hidden: the summary counts them
        result.error = f"{type(e).__name__}: {e}"
    # A chunk carries at least one token, and more when the server was behind the stream.
    if result.error is None and (result.output_tokens != max_tokens or not 0 < len(result.chunk_times) <= max_tokens):
        result.error = (f"expected {max_tokens} tokens in 1 to {max_tokens} chunks, got {result.output_tokens} in "
                        f"{len(result.chunk_times)}")
    return result


async def run_load(base_url: str, model: str, prompts: list[list[int]], output_lens: list[int], rate: float,
                   seed: int = 0, temperature: float = 0.0, api_key: str | None = None, start: float | None = None,
                   times: list[float] | None = None) -> tuple[list[RequestResult], float]:
    """Send the requests at ``rate`` per second; return their results and the run's seconds.
    ``start``: the run's time zero (``time.perf_counter``), when several processes share one;
    ``times``: each request's send time after it, instead of drawing them for ``rate``."""
    import httpx

    times = arrival_times(len(prompts), rate, seed) if times is None else times
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:
        start = time.perf_counter() if start is None else start

        async def later(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, times[i] - (time.perf_counter() - start)))
            return await send_one(client, base_url, model, prompts[i], output_lens[i], time.perf_counter() - start,
                                  start, temperature)

        results = await asyncio.gather(*(later(i) for i in range(len(prompts))))
        return list(results), time.perf_counter() - start


def _client_process(k: int, ready, go, start_at, results, args: tuple, kwargs: dict) -> None:
    """Client process ``k`` of ``run_load_processes``: its share of the requests, from the
    common start."""
    ready.put(k)
    go.wait()
    cpu = time.process_time()
    got, seconds = asyncio.run(run_load(*args, **kwargs, start=start_at.value))
    results.put((k, got, seconds, time.process_time() - cpu))


def run_load_processes(base_url: str, model: str, prompts: list[list[int]], output_lens: list[int], rate: float,
                       seed: int = 0, api_key: str | None = None, processes: int = 1
                       ) -> tuple[list[RequestResult], float, float]:
    """``run_load`` from ``processes`` client processes: the same requests at the same send
    times (one Poisson draw, dealt round robin), timed from one start (``perf_counter`` is
    the same clock in every process). One Python process reading hundreds of streams at tens
    of thousands of events a second is itself busy, and its own delays would count as the
    server's. Returns the results (in the requests' order), the run's seconds and the
    clients' CPU seconds."""
    times = arrival_times(len(prompts), rate, seed)
    if processes <= 1:
        cpu = time.process_time()
        got, seconds = asyncio.run(run_load(base_url, model, prompts, output_lens, rate, seed, api_key=api_key,
                                            times=times))
        return got, seconds, time.process_time() - cpu
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # (not fork: this process may hold CUDA)
    ready, results, go, start_at = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    shares = [list(range(k, len(prompts), processes)) for k in range(processes)]
    procs = [ctx.Process(target=_client_process, daemon=True, args=(
        k, ready, go, start_at, results,
        (base_url, model, [prompts[i] for i in share], [output_lens[i] for i in share], rate),
        {"api_key": api_key, "times": [times[i] for i in share]})) for k, share in enumerate(shares)]
    for p in procs:
        p.start()

    def take(queue):
        while True:  # (a client that died says so here, instead of leaving this waiting forever)
            try:
                return queue.get(timeout=1.0)
            except Exception:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a client process of the serving benchmark exited with {failed[0]}") from None

    for _ in procs:
        take(ready)
    # Time zero a little ahead: the clients wake, start their event loops and open their
    # connections before it, so that the first sends are not late (on a busy machine
    # 0.05 s was not enough: they went 0.3 s late).
    start_at.value = time.perf_counter() + 0.5
    go.set()
    got: list = [None] * len(prompts)
    seconds = cpu = 0.0
    for _ in procs:
        k, part, part_seconds, part_cpu = take(results)
        seconds, cpu = max(seconds, part_seconds), cpu + part_cpu
        for i, r in zip(shares[k], part):
            got[i] = r
    for p in procs:
        p.join()
    return got, seconds, cpu


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict:
    """As numpy's default (and so vLLM's benchmark) computes them: linear interpolation
    between the two nearest ranks, so the numbers compare with published ones."""
    if not values:
        return {f"p{p}": None for p in ps}
    ordered = sorted(values)
    out = {}
    for p in ps:
        at = p / 100 * (len(ordered) - 1)
        low = math.floor(at)
        high = min(low + 1, len(ordered) - 1)
        out[f"p{p}"] = ordered[low] + (ordered[high] - ordered[low]) * (at - low)
    return out


def summarize(results: list[RequestResult], seconds: float, rate: float) -> dict:
    ok = [r for r in results if r.error is None]
    itls = [x for r in ok for x in r.itls]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "rate": "inf" if math.isinf(rate) else rate,
        "requests": len(results),
        "errors": [r.error for r in results if r.error is not None][:5],
        "num_errors": len(results) - len(ok),
        "seconds": seconds,
        "request_throughput": len(ok) / seconds,
        "output_tokens_per_s": tokens / seconds,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "itl_s": percentiles(itls),
        "latency_s": percentiles([r.latency for r in ok]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "tokens_per_chunk": tokens / max(sum(len(r.chunk_times) for r in ok), 1),
        "mean_ttft_s": sum(r.ttft for r in ok) / max(len(ok), 1),
        "mean_itl_s": sum(itls) / max(len(itls), 1),
    }


# -- the whole benchmark ---------------------------------------------------------------


def serving_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                     seed: int) -> tuple[list[list[int]], list[int], dict]:
    """Random token-id prompts and output lengths, each uniform in its range, and their
    description for the report."""
    from minivllm.bench.throughput import make_workload

    prompts, lens = make_workload(num_requests, *prompt_len, max_token_id=vocab - 1, seed=seed)
    rng = random.Random(seed + 1)
    output_lens = [rng.randint(*output_len) for _ in lens]
    described = {"requests_per_rate": num_requests, "prompt_len": list(prompt_len), "output_len": list(output_len),
                 "temperature": 0, "ignore_eos": True, "arrivals": "Poisson", "seed": seed,
                 "total_output_tokens": sum(output_lens)}
    return prompts, output_lens, described


def run_rates(url: str, model: str, prompts, output_lens, rates: list[float], seed: int, warmup: int,
              api_key: str | None = None, processes: dict[str, int] | None = None,
              client_processes: int = 1) -> list[dict]:
    """A warm-up at the workload's prompt lengths (kernel specialisations compile there, not
    in the timed runs), then the workload at each rate, summarised. ``processes`` (name ->
    pid, on this machine): the share of each run that each kept a core busy, which says
    which process is the bottleneck; the clients' share is reported too (``client``: the
    sum over the ``client_processes``, so above 1 when they use more than one core)."""
    processes = processes or {}
    warm = [p[::-1] for p in prompts[:warmup]]
    asyncio.run(run_load(url, model, warm, [4] * len(warm), math.inf, seed, api_key=api_key))
    runs = []
    for rate in rates:
        before = {k: cpu_seconds(pid) for k, pid in processes.items()}
        results, seconds, client_cpu = run_load_processes(url, model, prompts, output_lens, rate, seed, api_key,
                                                          client_processes)
        runs.append(summarize(results, seconds, rate))
        runs[-1]["client_processes"] = client_processes
        busy = {k: (cpu_seconds(pid) - before[k]) / seconds for k, pid in processes.items()}
        runs[-1]["cpu_busy"] = {**busy, "client": client_cpu / seconds}
        print(f"rate {rate}: TTFT p50 {runs[-1]['ttft_s']['p50']}, ITL p50 {runs[-1]['itl_s']['p50']}, "
              f"{runs[-1]['output_tokens_per_s']:.0f} tok/s, {runs[-1]['num_errors']} errors; CPU busy: "
              + ", ".join(f"{k} {v:.0%}" for k, v in runs[-1]["cpu_busy"].items()), flush=True)
    return runs


def run_offline(model: Path, prompts, output_lens, llm_args: dict) -> dict:
    """The same requests through ``LLM.generate``, all at once: the throughput ceiling."""
    from minivllm import LLM, SamplingParams

    llm = LLM(str(model), **llm_args)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([p[::-1] for p in prompts[:16]], warm, use_tqdm=False)  # compile/warm on other prompts
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    outputs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm, outputs
    release_memory()
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "request_throughput": len(prompts) / seconds}


def describe_server(base_url: str, api_key: str | None) -> tuple[str, int]:
    """The model a running OpenAI-compatible server serves, and its context length (when it
    says; else 4096), from its /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    served = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).raise_for_status().json()
    first = served["data"][0]
    return first["id"], int(first.get("max_model_len") or 4096)


def run_against(base_url: str, api_key: str | None, out_dir: str, rates: list[float] | None,
                num_requests: int | None, seed: int, vocab: int, client_processes: int = 1) -> dict:
    """The serving benchmark against any running server (``--base-url``): the same
    arrivals and request shapes, token-id prompts drawn below ``vocab``."""
    name, max_model_len = describe_server(base_url, api_key)
    prompt_len = (min(100, max_model_len // 4), min(1024, max_model_len // 2))
    output_len = (min(32, max_model_len // 8), min(256, max_model_len // 4))
    prompts, output_lens, workload = serving_workload(num_requests or 64, prompt_len, output_len, vocab, seed)
    runs = run_rates(base_url.rstrip("/"), name, prompts, output_lens, rates or [1, 2, 4, math.inf], seed,
                     warmup=8, api_key=api_key, client_processes=client_processes)
    report = {"server": base_url, "model": name, "workload": workload, "online": runs}
    return save_report(report, out_dir, "serving_external.json")


def main(out_dir: str = "benchmarks", model: str | None = None, rates: list[float] | None = None,
         num_requests: int | None = None, seed: int = 0, base_url: str | None = None,
         api_key: str | None = None, vocab: int = 1000, engine_process: bool | None = None,
         client_processes: int | None = None) -> dict:
    """``client_processes``: the load's client processes (default: 4 on a GPU, where the
    server streams tens of thousands of tokens a second and one client process would be the
    bottleneck, and 1 on a CPU, where the model wants the cores)."""
    if client_processes is None:
        client_processes = 4 if torch.cuda.is_available() else 1
    if base_url is not None:
        return run_against(base_url, api_key, out_dir, rates, num_requests, seed, vocab, client_processes)
    from minivllm.bench.throughput import model_checkpoint
    from minivllm.config import ModelConfig
    from minivllm.engine.engine_args import BUNDLED_MODEL, resolve_model

    cuda = torch.cuda.is_available()
    if cuda:
        path = resolve_model(model) if model else model_checkpoint()
        rates = rates or [2, 4, 8, 16, 32, 64, math.inf]
        num_requests = num_requests or 200
        prompt_len, output_len = (100, 1024), (32, 256)
        llm_args = {"dtype": "bfloat16", "max_num_seqs": 256, "max_num_batched_tokens": 16384}
    else:
        path = resolve_model(model) if model else BUNDLED_MODEL
        rates = rates or [1, 2, 4, math.inf]
        num_requests = num_requests or 24
        prompt_len, output_len = (16, 64), (16, 32)
        llm_args = {"max_num_seqs": 64}
    vocab = ModelConfig.from_pretrained(path).vocab_size
    prompts, output_lens, workload = serving_workload(num_requests, prompt_len, output_len, vocab, seed)

    offline = run_offline(path, prompts, output_lens, llm_args)

    name = "bench"
    args = ["--model", str(path), "--served-model-name", name, *(f"--{k.replace('_', '-')}={v}" for k, v in llm_args.items())]
    if engine_process is not None:  # else serve's default: the core in its own process on a GPU only
        args.append("--engine-process" if engine_process else "--no-engine-process")
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    with ServeProcess(args, env=env, startup_s=900) as server:
        # The engine in the core's process, or in the server's with no core process.
        processes = {"server": server.proc.pid}
        core = server.engine_core_pid(timeout=0)
        if core is not None:
            processes["engine_core"] = core
        runs = run_rates(server.url, name, prompts, output_lens, rates, seed, warmup=16, processes=processes,
                         client_processes=client_processes)
    report = {
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "model": str(model) if model else ("random weights, Qwen3-0.6B shapes, bfloat16" if cuda else "bundled model"),
        "workload": workload,
        "engine": llm_args,
        "engine_process": "engine_core" in processes,  # the engine core in a process of its own
        "offline": offline,
        "online": runs,
        "torch": torch.__version__,
    }
    return save_report(report, out_dir, "serving.json")
