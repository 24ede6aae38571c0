"""What ``GET /metrics`` says, in Prometheus' text format (through ``prometheus_client``).

The names are vLLM's (``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``...),
so that the dashboards and alerts people already keep for vLLM read this server unchanged;
each carries the served model's name as the ``model_name`` label, as vLLM's do.

Two kinds of figure, measured in two places:

- **per request** (counters and histograms): every request's outputs go through
  ``observe``, which sees each output as the client does, so time to first token and the
  time between tokens are what a client waits, queueing included;
- **the engine's state** (gauges): read when scraped (``engine.state()``): the scheduler's
  queues and the block manager's free list, read directly from an engine in this process,
  and as the last step reported them from an engine core in a process of its own. Either
  way at worst one step stale, which is all a gauge promises.

Each app has a registry of its own (not prometheus_client's global one), so that several
servers in one process (tests, notebooks) count separately.
"""
import time
from contextlib import aclosing

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minivllm.server.async_engine import AsyncLLMEngine

# vLLM's buckets, so that its dashboards' quantiles mean the same here.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(largest: int) -> list[int]:
    """1, 2, 5, 10, 20, 50... up to ``largest`` (vLLM's buckets for counts of tokens)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > largest:
                return out
            out.append(m * scale)
        scale *= 10


class RequestHistograms:
    """vLLM's per-request histograms, each observed once, when the request finishes: how long
    it took end to end and in each phase (from ``RequestOutput.metrics``: waiting in the
    queue, prefill up to the first token, decode after it; inference is prefill and decode),
    its time per output token, its token counts and its parameters n and max_tokens."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int):
        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=registry).labels(model_name)

        self.e2e = histogram("vllm:e2e_request_latency_seconds", "From the request's arrival to its last output",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Waiting in the queue, before its first step",
                               REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "From its first step to its last token (prefill and decode)",
                                   REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "From its first step to its first token",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "From its first token to its last",
                                REQUEST_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Decode time over the tokens after the first, per request", ITL_BUCKETS)
        counts = buckets_1_2_5(max_model_len)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request", counts)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Tokens generated per request", counts)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens request parameter", counts)
        self.n = histogram("vllm:request_params_n", "The n request parameter", N_BUCKETS)

    def observe(self, output, params, e2e: float) -> None:
        """A finished request's figures (``params``: its SamplingParams, or None)."""
        self.e2e.observe(e2e)
        generated = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(generated)
        if params is not None:
            self.n.observe(params.n)
            if params.max_tokens is not None:
                self.max_tokens.observe(params.max_tokens)
        m = output.metrics
        if m is None or None in (m.first_scheduled_time, m.first_token_time, m.last_token_time):
            return  # (it finished before a token: nothing to time in its phases)
        self.queue.observe(m.first_scheduled_time - m.arrival_time)
        self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        self.decode.observe(m.last_token_time - m.first_token_time)
        self.inference.observe(m.last_token_time - m.first_scheduled_time)
        longest = max(len(c.token_ids) for c in output.outputs)
        if longest > 1:  # (one token has no time between tokens)
            self.tpot.observe((m.last_token_time - m.first_token_time) / (longest - 1))


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str):  # or an EngineCoreClient: the same reads
        self.registry = registry = CollectorRegistry()
        label = {"model_name": model_name}
        self.finished = Counter("vllm:request_success", "Requests finished, by why they finished",
                                ["model_name", "finished_reason"], registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests started",
                                     ["model_name"], registry=registry).labels(**label)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", ["model_name"],
                                         registry=registry).labels(**label)
        # Prefix caching: of the prompt tokens looked up, how many were found in the cache
        # (vLLM's two counters; a rate of one over the other is the hit rate over a window).
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                     ["model_name"], registry=registry).labels(**label)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  ["model_name"], registry=registry).labels(**label)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "From the request's arrival to its first token",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=registry).labels(**label)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Between two outputs of one request",
                             ["model_name"], buckets=ITL_BUCKETS, registry=registry).labels(**label)
        # Speculative decoding (vLLM's names): drafts verified and accepted, counted as each
        # request finishes.
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified",
                                         ["model_name"], registry=registry).labels(**label)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            ["model_name"], registry=registry).labels(**label)
        self.requests = RequestHistograms(registry, model_name, engine.max_model_len)
        # Counted by the scheduler; brought up to its total at each scrape.
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted (sent back to the queue to be "
                                   "recomputed, for want of KV blocks)", ["model_name"],
                                   registry=registry).labels(**label)
        self.num_preemptions = 0
        self.engine = engine
        self.model_name = model_name
        self.num_cache_queries = self.num_cache_hits = 0  # the counters' totals, for the hit rate

        def gauge(name: str, doc: str, read) -> None:
            Gauge(name, doc, ["model_name"], registry=registry).labels(**label).set_function(read)

        gauge("vllm:num_requests_running", "Requests in the running batch", lambda: engine.state().num_running)
        gauge("vllm:num_requests_waiting", "Requests waiting to be admitted", lambda: engine.state().num_waiting)

        def kv_cache_usage() -> float:
            state = engine.state()
            return 1 - state.num_free_blocks / max(state.num_blocks, 1)

        gauge("vllm:kv_cache_usage_perc", "Share of the KV pool's blocks in use (1 = full)", kv_cache_usage)
        gauge("vllm:prefix_cache_hit_rate", "Share of the prompt tokens looked up that hit, since the start",
              lambda: self.num_cache_hits / max(self.num_cache_queries, 1))

    def render(self) -> tuple[bytes, str]:
        """The text a scrape gets, and its content type."""
        total = self.engine.state().num_preemptions
        self.preemptions.inc(total - self.num_preemptions)
        self.num_preemptions = total
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def observe(self, outputs, arrival: float, params=None):
        """Pass a request's outputs through, counting as they go (``params``: the request's
        SamplingParams, for its histograms of n and max_tokens). Closing this closes
        ``outputs`` (which aborts the request), and the request counts as aborted."""
        last, num_tokens, output, reason = arrival, 0, None, "abort"
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    now = time.perf_counter()
                    n = len(output.outputs[0].token_ids)
                    if last == arrival:  # the first output: the prompt is in
                        self.ttft.observe(now - arrival)
                        self.prompt_tokens.inc(len(output.prompt_token_ids))
                        self.cache_queries.inc(len(output.prompt_token_ids))
                        self.cache_hits.inc(output.num_cached_tokens)
                        self.num_cache_queries += len(output.prompt_token_ids)
                        self.num_cache_hits += output.num_cached_tokens
                    else:
                        self.itl.observe(now - last)
                    self.generation_tokens.inc(n - num_tokens)
                    last, num_tokens = now, n
                    if output.finished:
                        reason = output.outputs[0].finish_reason or "stop"
                        self.requests.observe(output, params, now - arrival)
                        if output.spec_decode is not None:
                            self.spec_draft_tokens.inc(output.spec_decode.num_draft_tokens)
                            self.spec_accepted_tokens.inc(output.spec_decode.num_accepted_tokens)
                    yield output
        except Exception:  # the engine failed the request (RequestFailedError) or died
            reason = "error"
            raise
        finally:
            self.finished.labels(model_name=self.model_name, finished_reason=reason).inc()
