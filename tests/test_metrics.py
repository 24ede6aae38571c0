"""/metrics carries vLLM's per-request families under vLLM's names and buckets: end-to-end
latency, queue, prefill, decode and inference time, time per output token, prompt and
generation token counts (and the longest completion's), the n and max_tokens parameters, and
preemptions."""
import asyncio

import httpx
import pytest

from minivllm.server.metrics import REQUEST_LATENCY_BUCKETS, buckets_1_2_5
from shared import SERVED_KEY, SERVED_MODEL, served_checkpoint, threaded_server

AUTH = {"Authorization": f"Bearer {SERVED_KEY}"}
LABEL = f'model_name="{SERVED_MODEL}"'


def test_buckets_1_2_5():
    assert buckets_1_2_5(1) == [1]
    assert buckets_1_2_5(256) == [1, 2, 5, 10, 20, 50, 100, 200]
    assert buckets_1_2_5(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def sample(text: str, name: str, le: str | None = None) -> float:
    """The value of ``name``'s line for the served model (and bucket ``le``), 0 if absent."""
    for line in text.splitlines():
        if line.startswith(name + "{") and LABEL in line and (le is None or f'le="{le}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with threaded_server(served_checkpoint(tmp_path_factory, "metrics")) as running:
        yield running


def test_a_finished_request_is_in_every_family(server):
    before = httpx.get(server.url + "/metrics").text
    body = {"model": SERVED_MODEL, "prompt": "Hello there", "max_tokens": 6, "n": 2, "temperature": 0.5, "seed": 1,
            "ignore_eos": True}
    answer = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
    prompt_tokens = answer["usage"]["prompt_tokens"]
    after = httpx.get(server.url + "/metrics").text
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_params_n", "request_params_max_tokens", "request_max_num_generation_tokens"):
        assert sample(after, f"vllm:{name}_count") - sample(before, f"vllm:{name}_count") == 1, name
    grew = lambda name: sample(after, name) - sample(before, name)  # noqa: E731
    assert grew("vllm:request_generation_tokens_sum") == 12  # n=2 completions of 6 tokens
    assert grew("vllm:request_max_num_generation_tokens_sum") == 6
    assert grew("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert grew("vllm:request_params_n_sum") == 2 and grew("vllm:request_params_max_tokens_sum") == 6
    # The phases add up: inference is prefill then decode, and all of it within the end to end.
    inference = grew("vllm:request_inference_time_seconds_sum")
    assert inference == pytest.approx(grew("vllm:request_prefill_time_seconds_sum")
                                      + grew("vllm:request_decode_time_seconds_sum"), abs=1e-6)
    assert inference + grew("vllm:request_queue_time_seconds_sum") <= grew("vllm:e2e_request_latency_seconds_sum")
    # vLLM's buckets: the latency ones, and 1-2-5 up to max_model_len for the counts.
    for le in REQUEST_LATENCY_BUCKETS:
        assert f'vllm:e2e_request_latency_seconds_bucket{{le="{le}",{LABEL}}}' in after
    assert f'vllm:request_prompt_tokens_bucket{{le="5.0",{LABEL}}}' in after
    assert sample(after, "vllm:request_params_n_bucket", "2.0") - sample(before, "vllm:request_params_n_bucket",
                                                                          "2.0") == 1


def test_preemptions_are_counted(tmp_path_factory):
    """Four long requests in a pool that holds about two: the scheduler preempts, and the
    counter says how often."""
    from minivllm import LLM
    from minivllm.server import AsyncLLMEngine
    from minivllm.testing import torch_threads

    checkpoint = served_checkpoint(tmp_path_factory, "preempt")
    with torch_threads(1):
        engine = AsyncLLMEngine(LLM(str(checkpoint), num_kv_blocks=12, block_size=8, max_num_seqs=4).engine)
    with threaded_server(checkpoint, engine=engine) as running:
        async def four():
            async with httpx.AsyncClient(base_url=running.url, headers=AUTH, timeout=120) as client:
                body = {"model": SERVED_MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 36, "temperature": 0,
                        "ignore_eos": True}
                return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(4)))

        answers = asyncio.run(four())
        assert all(a.status_code == 200 for a in answers)
        page = httpx.get(running.url + "/metrics").text
        assert sample(page, "vllm:num_preemptions_total") == engine.state().num_preemptions > 0
