"""The HTTP server's own cost per token, on any machine (the CPU included).

With every request at once, the serving benchmark (``minivllm bench serving --rates inf``)
streams tens of thousands of tokens a second through one Python process, the server's: the
HTTP side, the engine core's socket, the JSON of every event. What that costs does not
depend on the model, so a stand-in core measures it: a process that speaks the engine
core's protocol (``minivllm.server.engine_core``: the real ``EngineCore`` loop, its delta
outputs, its socket) around a paced engine with no model, which gives every running
request one token every ``--step-ms`` (about what the H200 does at batch 256). Prompts are
admitted as the real scheduler admits them (``--max-num-batched-tokens`` of prefill a
step), so the first tokens come as they would.

The server is the real stack, ``minivllm.server.api.serve`` (FastAPI, uvicorn) over an
``EngineCoreClient``, in a process of its own; the load is the benchmark's own client
(``minivllm.bench.serving.run_load``, httpx) in ``--client-processes`` processes. Reported:
each process's CPU time per token and per event (from /proc: every thread counted), the
tokens per second the clients saw, time to first token; with ``--profile``, a second run
under cProfile in the server's process, its top functions.

    python scripts/profile_server.py [--num-requests 256] [--step-ms 6] [--profile]
"""
import argparse
import asyncio
import cProfile
import gc
import math
import os
import pstats
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import httpx

from minivllm.bench.serving import percentiles, run_load, run_load_processes, serving_workload
from minivllm.testing import cpu_seconds, free_port

MODEL_NAME = "bench"


# -- the stand-in core (in the core's process) -------------------------------------------


class PacedEngine:
    """What ``EngineCore`` drives of an ``LLMEngine`` (add, abort, step, the load figures),
    with no model: a step admits waiting prompts within the prefill budget, gives each
    request whose prompt is in one token (seeded draws from the vocabulary; a request ends
    at its max_tokens), and returns when ``step_s`` has passed since the last one. The tokens
    go through the real output processor (``EngineCore`` puts its delta one in
    ``output_processor``); their text is each token's own piece, looked up, not decoded:
    the core's detokenizer is not what is measured, and on a small CPU it would hold up
    the pace."""

    def __init__(self, tokenizer, eos_token_ids: set[int], limits, step_s: float, max_num_batched_tokens: int):
        from minivllm.engine.input_processor import InputProcessor
        from minivllm.engine.output_processor import OutputProcessor

        self.input_processor = InputProcessor(tokenizer, eos_token_ids, limits.vocab_size)
        self.output_processor = OutputProcessor(tokenizer, eos_token_ids, limits.max_model_len)
        self.limits, self.step_s, self.budget = limits, step_s, max_num_batched_tokens
        specials = set(tokenizer.all_special_ids)
        self.vocab = [t for t in range(min(limits.vocab_size, len(tokenizer))) if t not in specials]
        self.piece = {t: tokenizer.decode([t]) for t in self.vocab}
        self.rng = random.Random(0)
        self.requests: dict[str, object] = {}
        self.prefilled: dict[str, int] = {}  # request id -> prompt tokens computed
        self.scheduler = SimpleNamespace(waiting=deque(), running=[])
        self.block_manager = SimpleNamespace(num_free_blocks=limits.num_kv_blocks, num_blocks=limits.num_kv_blocks)
        self.num_compiling = 0
        self.next_step = 0.0

    def add_request(self, prompt_token_ids, params, request_id, prompt=None, stream=False):
        from minivllm.engine.sequence import Sequence

        if params.n != 1:
            raise ValueError("the paced engine gives one completion per request")
        seq = Sequence(prompt_token_ids, params, request_id)
        request = self.input_processor.new_request(seq, prompt, None, stream)
        request.detokenizer = None  # the text is looked up per token (see the class's docstring)
        request.group = [request]
        self.requests[request_id] = request
        self.prefilled[request_id] = 0
        self.scheduler.waiting.append(request)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for queue in (self.scheduler.waiting, self.scheduler.running):
            if request in queue:
                queue.remove(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def step(self) -> list:
        from minivllm.engine.sequence import SequenceStatus

        now = time.perf_counter()
        if now < self.next_step:
            time.sleep(self.next_step - now)
        self.next_step = max(now, self.next_step) + self.step_s
        waiting, running = self.scheduler.waiting, self.scheduler.running
        budget = self.budget - len(running)  # a decode costs one token of the step's budget
        while waiting and len(running) < self.limits.max_num_seqs and budget > 0:
            request = waiting[0]
            rid = request.seq.request_id
            take = min(budget, request.seq.num_prompt_tokens - self.prefilled[rid])
            self.prefilled[rid] += take
            budget -= take
            if self.prefilled[rid] < request.seq.num_prompt_tokens:
                break  # chunked: the rest of its prompt next step
            running.append(waiting.popleft())
            request.just_admitted = True
        outputs, still = [], []
        for request in running:
            seq = request.seq
            token = self.rng.choice(self.vocab)
            reason = self.output_processor.append_token(request, token, None)
            request.text += self.piece[token]
            if reason is not None:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
                del self.requests[seq.request_id], self.prefilled[seq.request_id]
            else:
                still.append(request)
            outputs.append(self.output_processor.make_output(request))
        running[:] = still
        return outputs

    def shutdown(self) -> None:
        pass


def paced_core(sock, model, llm_args: dict, num_threads: int, log_level: int) -> None:
    """The stand-in core process's main (``EngineCoreClient(core_main=...)``): the real
    ``EngineCore`` loop around a ``PacedEngine``."""
    import logging

    from minivllm.config import EngineConfig
    from minivllm.engine.request_limits import RequestLimits
    from minivllm.server.engine_core import Channel, CoreInfo, EngineCore
    from minivllm.tokenizer import load_tokenizer

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level)
    tokenizer = load_tokenizer(model)
    config = EngineConfig(model=str(model), max_num_seqs=llm_args["max_num_seqs"],
                          max_num_batched_tokens=llm_args["max_num_batched_tokens"])
    limits = RequestLimits(vocab_size=len(tokenizer), max_model_len=llm_args["max_model_len"],
                           num_kv_blocks=1 << 20, block_size=16, max_num_seqs=llm_args["max_num_seqs"], hybrid=False)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    engine = PacedEngine(tokenizer, eos, limits, llm_args["step_ms"] / 1e3, llm_args["max_num_batched_tokens"])
    channel = Channel(sock)
    core = EngineCore(engine, channel)
    channel.send(("ready", CoreInfo(config, limits, eos, core.state())))
    try:
        core.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass


# -- the server (in its own process) -----------------------------------------------------


def serve(port: int, step_ms: float, max_num_seqs: int, max_num_batched_tokens: int, profile: str | None,
          pid_file: str) -> None:
    """``minivllm serve``'s stack over the stand-in core. With ``profile``: cProfile from
    SIGUSR1 to SIGUSR2 (the timed run only), written to that file."""
    import logging

    from minivllm.llm import BUNDLED_MODEL
    from minivllm.server.api import serve as run_server
    from minivllm.server.engine_client import EngineCoreClient

    logging.basicConfig(level=logging.WARNING)
    client = EngineCoreClient(BUNDLED_MODEL, core_main=paced_core, step_ms=step_ms, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, max_model_len=4096)
    Path(pid_file).write_text(str(client.process.pid))
    gc_seconds = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}  # generation -> collections, CPU seconds
    gc_start = [0.0]

    def gc_timer(phase, info):  # (the main thread's CPU time: the collector runs on it)
        if phase == "start":
            gc_start[0] = time.thread_time()
        else:
            gc_seconds[info["generation"]][0] += 1
            gc_seconds[info["generation"]][1] += time.thread_time() - gc_start[0]

    gc.callbacks.append(gc_timer)
    signal.signal(signal.SIGHUP, lambda *_: print("gc: " + ", ".join(
        f"generation {g}: {n} in {t * 1e3:.0f} ms" for g, (n, t) in gc_seconds.items()), file=sys.stderr, flush=True))
    if profile:
        profiler = cProfile.Profile()
        signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())

        def stop(*_):
            profiler.disable()
            profiler.dump_stats(profile)

        signal.signal(signal.SIGUSR2, stop)
    run_server(client, MODEL_NAME, port=port)


# -- the load ----------------------------------------------------------------------------


def measure(args, profile: str | None = None, py_spy: str | None = None) -> dict:
    """One timed run against a fresh server. ``profile``: cProfile in the server over the
    timed run, to that file; ``py_spy``: py-spy's samples of it instead (collapsed stacks)."""
    port = free_port()
    pid_file = Path(tempfile.mkdtemp()) / "core.pid"
    cmd = [sys.executable, __file__, "--serve", "--port", str(port), "--step-ms", str(args.step_ms),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--pid-file", str(pid_file)]
    if profile:
        cmd += ["--profile-to", profile]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # (uvicorn's access log goes to stdout: formatted, as by minivllm serve, then dropped)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
    sampler = None
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not come up")
            time.sleep(0.2)
        core_pid = int(pid_file.read_text())
        prompts, output_lens, _ = serving_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                                                    1000, seed=0)
        warm = [p[::-1] for p in prompts[:16]]
        asyncio.run(run_load(url, MODEL_NAME, warm, [4] * len(warm), math.inf))
        before = cpu_seconds(server.pid), cpu_seconds(core_pid)
        os.kill(server.pid, signal.SIGHUP)
        if profile:
            os.kill(server.pid, signal.SIGUSR1)
        if py_spy:
            sampler = subprocess.Popen([args.py_spy, "record", "-p", str(server.pid), "-f", "raw", "-r", "500",
                                        "-o", py_spy, "--nonblocking"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # (attached before the clients start)
        got, seconds, client_cpu = run_load_processes(url, MODEL_NAME, prompts, output_lens, math.inf,
                                                      processes=args.client_processes)
        if profile:
            os.kill(server.pid, signal.SIGUSR2)
        os.kill(server.pid, signal.SIGHUP)  # (the garbage collector's time so far, to stderr)
        if sampler is not None:
            sampler.send_signal(signal.SIGINT)
            sampler.wait(30)
        server_cpu, core_cpu = cpu_seconds(server.pid) - before[0], cpu_seconds(core_pid) - before[1]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    ok = [r for r in got if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    events = chunks + 2 * len(got)  # and each stream's usage chunk and [DONE]
    return {"seconds": seconds, "tokens": tokens, "chunks": chunks, "errors": len(got) - len(ok),
            "first_error": [r.error for r in got if r.error is not None][:1],
            "tokens_per_s": tokens / seconds, "ttft_p50_ms": percentiles([r.ttft for r in ok])["p50"] * 1e3,
            "server_cpu_s": server_cpu, "core_cpu_s": core_cpu, "client_cpu_s": client_cpu,
            "server_us_per_token": server_cpu / tokens * 1e6, "server_us_per_event": server_cpu / events * 1e6,
            "server_busy": server_cpu / seconds, "core_busy": core_cpu / seconds,
            "client_busy": client_cpu / seconds, "client_us_per_token": client_cpu / tokens * 1e6}


def report(m: dict) -> None:
    print(f"{m['tokens']} tokens in {m['chunks']} chunks ({m['tokens'] / max(m['chunks'], 1):.2f} tokens a chunk), "
          f"{m['errors']} errors {m['first_error']}, {m['seconds']:.2f} s: {m['tokens_per_s']:.0f} tok/s, "
          f"TTFT p50 {m['ttft_p50_ms']:.0f} ms")
    print(f"  server: {m['server_cpu_s']:.2f} CPU s, {m['server_us_per_token']:.1f} us a token, "
          f"{m['server_us_per_event']:.1f} us an event, {m['server_busy']:.0%} busy")
    print(f"  core (stand-in): {m['core_busy']:.0%} busy; clients: {m['client_us_per_token']:.1f} us a token, "
          f"{m['client_busy']:.0%} of a core")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[100, 1024])
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    parser.add_argument("--step-ms", type=float, default=6.0, help="the stand-in core's time per step")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs without the profiler")
    parser.add_argument("--profile", action="store_true", help="then one more run under cProfile: its top functions")
    parser.add_argument("--py-spy", metavar="PATH", help="then one more run sampled by this py-spy binary (no "
                        "slow-down): the functions the server's samples were in, and under")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # (the server's process)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", help=argparse.SUPPRESS)
    parser.add_argument("--pid-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        try:
            serve(args.port, args.step_ms, args.max_num_seqs, args.max_num_batched_tokens, args.profile_to,
                  args.pid_file)
        except KeyboardInterrupt:  # how the measuring process stops it
            pass
        return
    for _ in range(args.repeats):
        report(measure(args, None))
    if args.profile:
        path = Path(tempfile.mkdtemp()) / "server.prof"
        print("under cProfile (slower):")
        report(measure(args, str(path)))
        stats = pstats.Stats(str(path))
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
    if args.py_spy:
        path = Path(tempfile.mkdtemp()) / "server.txt"
        print("sampled by py-spy:")
        report(measure(args, py_spy=str(path)))
        summarize_samples(path, args.top)


def summarize_samples(path: Path, top: int) -> None:
    """py-spy's collapsed stacks (``frame;frame;... count``, the main thread's): the share
    of the samples in each function itself, and in it or below it."""
    own, under, total = {}, {}, 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.rsplit(" (", 1)[0] + " " + f.rsplit("/", 1)[-1].split(":")[0].rstrip(")") for f in stack.split(";")]
        n = int(count)
        total += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            under[f] = under.get(f, 0) + n
    for title, table in (("in the function itself", own), ("in it or below", under)):
        print(f"-- {title} ({total} samples) --")
        for name, n in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {n / total:6.1%}  {name}")


if __name__ == "__main__":
    main()
