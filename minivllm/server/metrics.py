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
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def observe(self, outputs, arrival: float):
        """Pass a request's outputs through, counting as they go. Closing this closes
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
                        if output.spec_decode is not None:
                            self.spec_draft_tokens.inc(output.spec_decode.num_draft_tokens)
                            self.spec_accepted_tokens.inc(output.spec_decode.num_accepted_tokens)
                    yield output
        except Exception:  # the engine failed the request (RequestFailedError) or died
            reason = "error"
            raise
        finally:
            self.finished.labels(model_name=self.model_name, finished_reason=reason).inc()
