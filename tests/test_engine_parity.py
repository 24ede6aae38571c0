"""The engine's greedy tokens equal transformers' under every scheduling regime.

Paging, prefix caching, chunked prefill and preemption change *how* the keys and values
get into the cache, never *what* is computed, so every configuration below must give the
tokens of ``AutoModelForCausalLM.generate(do_sample=False)`` on the same float32 weights
exactly. Each test also checks, from the engine's step trace, that the regime it names
really happened (a preemption test in which nothing was preempted would prove nothing).
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.engine import block_manager as bm_module

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(0, 512, (n,), generator=g).tolist()  # noqa: E731
    shared = rand(24)  # a whole number of blocks for block sizes 1, 2, 4, 8 (and one of 16)
    block = rand(16)
    prompts = [rand(n) for n in (1, 2, 5, 9, 16, 17, 31, 32, 33, 48)]
    # Requests that share a prefix, spread through the batch so that with a small
    # max_num_seqs some are admitted after the first has filled (and hashed) its blocks.
    for i, tail in zip((0, 4, 8, 11, 13), (0, 3, 8, 17, 1)):
        prompts.insert(i, shared + rand(tail))
    prompts.append(block + block + rand(5))  # the same block twice in a row
    prompts.append(shared[:8] + shared[:8] + block[:3])  # ... and the first block of the batch twice
    return prompts


PROMPTS = make_prompts()
LONGEST = max(len(p) for p in PROMPTS)  # 48


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(tiny_qwen3) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False)
            out.append(ids[0, len(prompt):].tolist())
    return out


def run(tiny_qwen3, **engine_args):
    llm = LLM(model=str(tiny_qwen3), record_trace=True, **engine_args)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    return llm, outputs


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def check_trace(llm) -> None:
    """What every step must respect, whatever the regime."""
    config = llm.engine.config
    for record in llm.engine.trace:
        assert sum(n for _, n, _ in record.seqs) <= config.max_num_batched_tokens
        assert len(record.seqs) <= config.max_num_seqs
        assert 0 < record.host_seconds < record.seconds  # the runner's share is the rest
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # everything given back


def was_preempted(llm) -> bool:
    return any(record.preempted for record in llm.engine.trace)


def was_chunked(llm) -> bool:
    """Did some sequence prefill in two consecutive steps (a prompt split over steps)?"""
    trace = llm.engine.trace
    for before, after in zip(trace, trace[1:]):
        prefilling = {sid for sid, _, kind in before.seqs if kind == "prefill"}
        if prefilling & {sid for sid, _, kind in after.seqs if kind == "prefill"}:
            return True
    return False


def cache_hits(llm) -> int:
    return sum(record.cache_hit_tokens for record in llm.engine.trace)


def test_ample_blocks(tiny_qwen3, reference):
    llm, outputs = run(tiny_qwen3, num_kv_blocks=256, block_size=16)
    assert tokens(outputs) == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert not was_preempted(llm)
    # Everything was admitted at once, before any block was hashed.
    assert len(llm.engine.trace[0].seqs) == len(PROMPTS)
    check_trace(llm)


def test_preemption(tiny_qwen3, reference):
    # 8 blocks of 8 = 64 slots: the longest request (48 + 10 tokens) fits alone, the batch does not.
    llm, outputs = run(tiny_qwen3, num_kv_blocks=8, block_size=8)
    assert LONGEST + MAX_TOKENS <= llm.engine.max_model_len == 64
    assert was_preempted(llm)
    assert tokens(outputs) == reference
    check_trace(llm)


def test_chunked_prefill(tiny_qwen3, reference):
    llm, outputs = run(tiny_qwen3, num_kv_blocks=256, block_size=16, max_num_batched_tokens=16)
    assert was_chunked(llm) and not was_preempted(llm)
    assert tokens(outputs) == reference
    check_trace(llm)


def test_prefix_caching(tiny_qwen3, reference):
    llm, outputs = run(tiny_qwen3, num_kv_blocks=256, block_size=8, max_num_seqs=4)
    assert tokens(outputs) == reference
    # Later requests with the shared prefix found it in the cache.
    assert any(o.num_cached_tokens > 0 for o in outputs)
    assert cache_hits(llm) == sum(o.num_cached_tokens for o in outputs) > 0
    check_trace(llm)
    # The same prompts again: every prompt of a full block or more hits its own finished run.
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(again) == reference
    for prompt, o in zip(PROMPTS, again):
        assert o.num_cached_tokens == (len(prompt) - 1) // 8 * 8
    check_trace(llm)


def test_no_prefix_caching(tiny_qwen3, reference):
    llm, outputs = run(tiny_qwen3, num_kv_blocks=256, block_size=8, max_num_seqs=4, enable_prefix_caching=False)
    assert tokens(outputs) == reference
    assert all(o.num_cached_tokens == 0 for o in outputs) and cache_hits(llm) == 0
    check_trace(llm)


@pytest.mark.parametrize("block_size", [1, 2, 32])
def test_block_sizes(tiny_qwen3, reference, block_size):
    llm, outputs = run(tiny_qwen3, num_kv_blocks=4096 // block_size, block_size=block_size, max_num_seqs=6)
    assert tokens(outputs) == reference
    # The shared prefix is 24 tokens: whole blocks of 1 or 2 are shared, blocks of 32 never fill.
    assert (cache_hits(llm) > 0) == (block_size < 24)
    check_trace(llm)


def test_everything_at_once(tiny_qwen3, reference):
    """A small pool, a small token budget and prefix caching together."""
    llm, outputs = run(tiny_qwen3, num_kv_blocks=16, block_size=4, max_num_batched_tokens=12, max_num_seqs=6)
    assert was_preempted(llm) and was_chunked(llm) and cache_hits(llm) > 0
    assert tokens(outputs) == reference
    check_trace(llm)


def test_colliding_hashes_do_not_change_outputs(tiny_qwen3, reference, monkeypatch):
    """Every block hashing alike makes every lookup a collision; outputs must not change."""
    monkeypatch.setattr(bm_module, "block_hash", lambda token_ids, parent_hash: 1)
    llm, outputs = run(tiny_qwen3, num_kv_blocks=64, block_size=8, max_num_seqs=4)
    assert tokens(outputs) == reference
    assert cache_hits(llm) > 0  # some lookups were real hits
    check_trace(llm)


def test_from_scratch_names_exactly_the_steps_without_cached_keys(tiny_qwen3, monkeypatch):
    """Context.from_scratch lets the prefill kernel skip its loads of cached keys (the
    FROM_SCRATCH variant): it must be set exactly when every sequence of the step starts at
    position 0, i.e. each sequence's context is its query. Chunked prefill, prefix hits and
    decode rows all make steps where it is not."""
    from minivllm.context import get_context
    from minivllm.engine.model_runner import ModelRunner

    seen = []
    execute = ModelRunner.execute

    def recording(self, input_ids, positions):
        ctx = get_context()
        q_lens = (ctx.cu_seqlens_q[1:] - ctx.cu_seqlens_q[:-1]).tolist()
        seen.append((ctx.from_scratch, ctx.context_lens.tolist() == q_lens))
        return execute(self, input_ids, positions)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    llm, outputs = run(tiny_qwen3, num_kv_blocks=256, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    assert was_chunked(llm) and any(o.num_cached_tokens for o in outputs)
    assert all(flag == truth for flag, truth in seen), seen
    assert {flag for flag, _ in seen} == {True, False}
