"""Chapter 10 — CUDA graphs: which batch sizes get a graph, and which graph a batch replays in.

Your ``graph_batch_sizes`` and ``padded_batch_size`` (exercises/minivllm/engine/cuda_graphs.py)
are pure functions of integers, so they are graded on the CPU: exact lists for the
configurations a reader meets (1, 3, 8, 20, 256, 1000 sequences), then properties over every
max_num_seqs from 1 to 600 (ascending, no duplicates, the largest is max_num_seqs capped at
512, every power of two up to 8 and every multiple of 16 present), and for the padding:
the smallest captured size that holds the batch, for every batch size, and a clear error
for a batch larger than every graph.

The main exercise is the dispatcher itself: ``CudaGraphDispatcher.plan`` (which graphs an
engine captures, for its limits, its drafts, a hybrid model, a tensor-parallel group) and
``CudaGraphDispatcher.dispatch`` (which graph a step replays in, padded to what size, or None
to run it eagerly). Both know only the steps' shapes, so they too are graded on the CPU. And
the replay's copy of a step into the graph's static buffers (``StaticInputs.fill``): the real
rows, then each field's padding up to the graph's size.
"""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minivllm.engine.cuda_graphs import (DECODE, PREFILL, PREFILL_GRAPH_TOKENS, SCRATCH, VERIFY, BatchDescriptor,
                                         CudaGraphDispatcher, GraphKey, graph_batch_sizes, padded_batch_size)
from minivllm.ops.gated_delta import SHORT_STEP_TOKENS

DECODE_256 = [1, 2, 4, 8, *range(16, 257, 16)]


@pytest.mark.parametrize(
    "max_num_seqs, expected",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
        (256, [1, 2, 4, 8, *range(16, 257, 16)]),
        (1000, [1, 2, 4, 8, *range(16, 513, 16)]),
    ],
)
def test_ch10_graph_batch_sizes_examples(max_num_seqs, expected):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == expected, f"graph_batch_sizes({max_num_seqs}) should be {expected}, got {sizes}"


@given(max_num_seqs=st.integers(1, 600))
def test_ch10_graph_batch_sizes_properties(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert isinstance(sizes, list) and all(isinstance(b, int) for b in sizes), "return a list of ints"
    assert sizes == sorted(set(sizes)), f"sizes must be ascending without duplicates (capture goes largest first from the end), got {sizes}"
    top = min(max_num_seqs, 512)
    assert sizes[-1] == top, (
        f"the largest graph must hold max_num_seqs={max_num_seqs} sequences (capped at 512): expected {top}, got {sizes[-1]}")
    assert sizes[0] == 1, "a single running sequence needs a graph of size 1"
    expected = {b for b in (1, 2, 4, 8) if b <= top} | set(range(16, top + 1, 16)) | {top}
    assert set(sizes) == expected, f"missing {sorted(expected - set(sizes))}, extra {sorted(set(sizes) - expected)}"


def test_ch10_padded_batch_size_examples():
    sizes = [1, 2, 4, 8, 16, 32, 48, 64]
    cases = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 32, 33: 48, 48: 48, 49: 64, 64: 64}
    got = {n: padded_batch_size(n, sizes) for n in cases}
    assert got == cases, f"with sizes {sizes}: expected {cases}, got {got}"


@given(sizes=st.lists(st.integers(1, 600), min_size=1, max_size=12, unique=True).map(sorted), data=st.data())
def test_ch10_padded_batch_size_is_the_smallest_that_holds_the_batch(sizes, data):
    n = data.draw(st.integers(1, sizes[-1]), label="batch size")
    bs = padded_batch_size(n, sizes)
    assert bs in sizes, f"{bs} is not a captured size: there is no graph to replay"
    assert bs >= n, f"a batch of {n} cannot replay in a graph of {bs} rows"
    smaller = [b for b in sizes if n <= b < bs]
    assert not smaller, f"a batch of {n} should replay in the graph of {min(smaller)}, not {bs}: {bs - n} rows of padding wasted"


def test_ch10_padded_batch_size_rejects_a_batch_larger_than_every_graph():
    sizes = [1, 2, 4, 8, 16, 20]
    assert padded_batch_size(20, sizes) == 20
    with pytest.raises(ValueError, match="21"):
        padded_batch_size(21, sizes)


# --- the dispatcher: plan --------------------------------------------------------------


def plan(max_num_seqs=256, budget=8192, max_model_len=4096, k=None, hybrid=False, tp=False) -> CudaGraphDispatcher:
    return CudaGraphDispatcher.plan(max_num_seqs, budget, max_model_len, k, hybrid=hybrid, tensor_parallel=tp)


def decode(n: int) -> BatchDescriptor:
    return BatchDescriptor(num_tokens=n, num_seqs=n, max_query_len=1, is_prefill=False)


def prefill(lengths: list[int], from_scratch: bool = False) -> BatchDescriptor:
    return BatchDescriptor(num_tokens=sum(lengths), num_seqs=len(lengths), max_query_len=max(lengths),
                           is_prefill=max(lengths) > 1, from_scratch=from_scratch)


def test_ch10_plan_captures_decode_prefill_and_scratch_graphs():
    d = plan()
    assert d.sizes.get(DECODE) == DECODE_256, "the decode graphs are graph_batch_sizes(max_num_seqs)"
    assert d.sizes.get(PREFILL) == list(PREFILL_GRAPH_TOKENS), (
        f"every prefill token count up to 4096 fits a budget of 8192: expected {list(PREFILL_GRAPH_TOKENS)}, "
        f"got {d.sizes.get(PREFILL)}")
    assert d.sizes.get(SCRATCH) == [512, 768, 1024, 1536, 2048, 3072, 4096], (
        "a scratch twin for each prefill size from SCRATCH_GRAPH_TOKENS up")
    assert VERIFY not in d.sizes and d.verify_query_len == 0, "no drafts (k None): no verify graphs, no verify length"


def test_ch10_plan_bounds_prefill_graphs_by_the_budget_and_the_model_length():
    small = plan(budget=1024)
    assert small.sizes.get(PREFILL, [None])[-1] == 1024, "the step budget bounds the prefill graphs (1024 fits, 1536 not)"
    assert small.sizes.get(SCRATCH) == [512, 768, 1024], "the twins follow the prefill graphs that are captured"
    short = plan(budget=8192, max_model_len=300)
    assert short.sizes.get(PREFILL, [None])[-1] == 256, "max_model_len bounds the prefill graphs too"
    assert SCRATCH not in plan(budget=384).sizes, "no prefill graph of 512 tokens or more: no twin, and no empty list"
    assert plan(max_num_seqs=1000).sizes[DECODE][-1] == 512, "decode graphs stop at MAX_GRAPH_BATCH_SIZE"
    assert plan(max_num_seqs=20).sizes[DECODE] == [1, 2, 4, 8, 16, 20], "decode sizes from graph_batch_sizes"


def test_ch10_plan_verify_graphs_per_decode_size_within_the_budget():
    d = plan(k=4)
    assert d.verify_query_len == 5, "a verifying sequence brings its last token and k drafts: 1 + k"
    assert d.sizes.get(VERIFY) == DECODE_256, "one verify graph per decode size whose step fits the budget"
    assert plan(k=4, budget=64).sizes.get(VERIFY) == [1, 2, 4, 8], (
        "a verify graph of 16 sequences x 5 tokens = 80 tokens exceeds a budget of 64; 8 x 5 = 40 fits")
    assert plan(k=4, budget=40).sizes.get(VERIFY) == [1, 2, 4, 8], "a step of exactly the budget fits"
    assert VERIFY not in plan(k=4, budget=4).sizes, "not even one sequence of 5 tokens fits 4: no verify graphs"
    assert plan(k=0).verify_query_len == 1 and plan(k=0).sizes.get(VERIFY) == DECODE_256, (
        "k = 0 drafts is not None: verify graphs of one token per sequence")


def test_ch10_plan_hybrid_and_tensor_parallel():
    hybrid = plan(k=SHORT_STEP_TOKENS - 1, hybrid=True)
    assert set(hybrid.sizes) == {DECODE, VERIFY}, "a hybrid model prefills eagerly but verifies short steps in graphs"
    assert hybrid.verify_query_len == SHORT_STEP_TOKENS
    too_long = plan(k=SHORT_STEP_TOKENS, hybrid=True)
    assert set(too_long.sizes) == {DECODE} and too_long.verify_query_len == 0, (
        "a hybrid model's verifying step longer than SHORT_STEP_TOKENS per sequence runs eagerly (verify length 0)")
    assert set(plan(hybrid=True).sizes) == {DECODE}, "a hybrid model without drafts: decode graphs only"
    tp = plan(k=4, tp=True)
    assert set(tp.sizes) == {DECODE} and tp.verify_query_len == 0, (
        "a tensor-parallel group captures decode graphs only: it prefills and verifies eagerly")


# --- the dispatcher: dispatch ----------------------------------------------------------


@pytest.mark.parametrize("n, size", [(1, 1), (3, 4), (5, 8), (9, 16), (17, 32), (200, 208), (256, 256)])
def test_ch10_a_decode_batch_replays_the_next_captured_size(n, size):
    got = plan().dispatch(decode(n))
    assert got == GraphKey(DECODE, size), f"a decode batch of {n} replays the decode graph of {size}, got {got}"
    got = plan(k=4).dispatch(decode(n))
    assert got == GraphKey(DECODE, size), f"decode graphs come first, verify graphs or not: got {got} for {n}"


def test_ch10_a_step_that_no_graph_holds_runs_eagerly():
    assert plan().dispatch(decode(257)) is None, "a decode batch past the largest graph runs eagerly (None)"
    assert CudaGraphDispatcher().dispatch(decode(1)) is None, "nothing captured (CPU, enforce_eager): None"
    assert CudaGraphDispatcher().dispatch(prefill([5])) is None, "nothing captured: a prefill runs eagerly too"
    d = plan(budget=512)
    assert d.dispatch(prefill([513])) is None, "a prompt past the largest prefill graph runs eagerly"
    assert d.dispatch(prefill([10, 20])) is None, "two prompts in one step: no graph holds several sequences"
    assert d.dispatch(prefill([10, 1])) is None, "a prompt beside a decode row runs eagerly"
    assert plan(hybrid=True).dispatch(prefill([20])) is None, "a hybrid model prefills eagerly"


@pytest.mark.parametrize("tokens, size", [(2, 16), (15, 16), (16, 16), (17, 32), (100, 128), (700, 768),
                                          (4096, 4096)])
def test_ch10_one_sequence_prefill_replays_the_next_token_count(tokens, size):
    d = plan()
    got = d.dispatch(prefill([tokens]))
    assert got == GraphKey(PREFILL, size), f"a prompt of {tokens} tokens pads to the prefill graph of {size}, got {got}"
    twin = SCRATCH if size >= 512 else PREFILL
    got = d.dispatch(prefill([tokens], from_scratch=True))
    assert got == GraphKey(twin, size), (
        f"a prompt from scratch of {tokens} tokens replays the {twin} graph of {size} (a twin only where captured), got {got}")


def test_ch10_verifying_steps_replay_a_verify_graph_by_sequences():
    d = plan(k=4)
    got = d.dispatch(prefill([5, 5, 3]))
    assert got == GraphKey(VERIFY, 4), f"3 sequences of at most 1 + k tokens pad to the verify graph of 4 sequences, got {got}"
    assert d.dispatch(prefill([5] * 17)) == GraphKey(VERIFY, 32), "a verify graph's size counts sequences, not tokens"
    got = d.dispatch(prefill([3]))
    assert got == GraphKey(VERIFY, 1), f"a short step of one sequence is a verifying step before it is a prefill, got {got}"
    got = d.dispatch(prefill([6]))
    assert got == GraphKey(PREFILL, 16), f"one sequence longer than 1 + k tokens is a prefill, got {got}"
    assert d.dispatch(prefill([6, 2])) is None, "several sequences, one longer than 1 + k: eagerly"
    assert d.dispatch(prefill([2] * 257)) is None, "more sequences than the largest verify graph: eagerly"
    hybrid = plan(k=3, hybrid=True)
    assert hybrid.dispatch(prefill([4, 2])) == GraphKey(VERIFY, 2), "a hybrid model verifies in graphs"
    assert hybrid.dispatch(prefill([5])) is None, "a hybrid model's prefill runs eagerly"


def test_ch10_verify_graphs_of_one_token_per_sequence_take_decode_steps_only_past_decode():
    d = CudaGraphDispatcher({VERIFY: [1, 2, 4]}, verify_query_len=1)
    assert d.dispatch(decode(3)) == GraphKey(VERIFY, 4), (
        "with k = 0 a verifying step is not a prefill: a decode-shaped step without decode graphs replays a verify graph")
    assert d.dispatch(prefill([2])) is None, "with k = 0 a step of 2 tokens per sequence is no verifying step"
    d = CudaGraphDispatcher({VERIFY: [1, 2, 4]}, verify_query_len=3)
    assert d.dispatch(decode(2)) is None, "with k > 0 a verifying step is a prefill: a decode step is not one"


# --- the replay's copy into the static buffers: StaticInputs.fill ------------------------

STALE = 77  # what an earlier, bigger replay left in the buffers


def _filled(names, max_seqs, max_tokens, constant, input_ids, padded_seqs, padded_tokens, **fields):
    """Static buffers holding stale values, after one fill of a step whose Context has ``fields``."""
    import torch

    from minivllm.context import reset_context, set_context
    from minivllm.engine.cuda_graphs import StaticInputs

    static = StaticInputs(names, max_seqs, max_tokens, max_blocks=4, hidden=torch.zeros(max_tokens, 2),
                          constant=constant)
    for buf in static.buffers.values():
        buf.fill_(STALE)
    ids = torch.tensor(input_ids)
    ctx = set_context(**fields)
    try:
        static.fill(ctx, ids, ids + 100, padded_seqs, padded_tokens)
    finally:
        reset_context()
    return static.buffers


def test_ch10_a_decode_replay_pads_rows_that_store_and_attend_to_nothing():
    import torch

    names = ["input_ids", "positions", "slot_mapping", "context_lens", "cu_seqlens_q", "block_tables",
             "state_slots", "has_initial_state"]
    b = _filled(names, 8, 8, ("cu_seqlens_q",), [7, 8, 9], 4, 4, is_prefill=False, max_seqlen_q=1,
                cu_seqlens_q=torch.arange(4), slot_mapping=torch.tensor([10, 20, 30]),
                context_lens=torch.tensor([3, 4, 5]), block_tables=torch.tensor([[0], [1], [2]]),
                state_slots=torch.tensor([2, 0, 1]), has_initial_state=torch.tensor([1, 1, 0]))
    assert b["input_ids"][:3].tolist() == [7, 8, 9] and b["positions"][:3].tolist() == [107, 108, 109], (
        "the real rows of input_ids and positions come from the arguments")
    assert b["slot_mapping"][:5].tolist() == [10, 20, 30, -1, STALE], (
        "3 tokens in the graph of 4: the padding row stores nowhere (slot -1), and the row past the graph "
        f"is left alone; got {b['slot_mapping'][:5].tolist()}")
    assert b["context_lens"][:5].tolist() == [3, 4, 5, 0, STALE], (
        f"a padding sequence attends to nothing (context length 0); got {b['context_lens'][:5].tolist()}")
    assert b["state_slots"][:5].tolist() == [2, 0, 1, -1, STALE], "a padding sequence keeps no recurrent state"
    assert b["block_tables"][:3, 0].tolist() == [0, 1, 2], "each real sequence's block table, in its row"
    assert b["has_initial_state"][:3].tolist() == [1, 1, 0], "every field of the step is copied, state flags too"
    assert b["cu_seqlens_q"].tolist() == [STALE] * 9, (
        "a constant buffer (a decode graph's cu_seqlens_q, written at capture) is never written by a replay")


def test_ch10_a_verify_replay_pads_whole_sequences_and_fills_missing_fields():
    import torch

    names = ["input_ids", "positions", "slot_mapping", "context_lens", "cu_seqlens_q", "block_tables",
             "spec_state_counts"]
    b = _filled(names, 8, 24, (), [1, 2, 3, 4, 5], 4, 12, is_prefill=True, max_seqlen_q=3,
                cu_seqlens_q=torch.tensor([0, 3, 5]), slot_mapping=torch.arange(5), context_lens=torch.tensor([9, 6]),
                block_tables=torch.tensor([[0, 1, 2], [3, -1, -1]]))
    assert b["slot_mapping"][:13].tolist() == [0, 1, 2, 3, 4] + [-1] * 7 + [STALE], (
        "5 tokens in a graph of 4 sequences x 3 tokens: 7 padding rows store nowhere, the row past the graph "
        f"is left alone; got {b['slot_mapping'][:13].tolist()}")
    assert b["cu_seqlens_q"][:6].tolist() == [0, 3, 5, 5, 5, STALE], (
        "cu_seqlens_q has one row more than the sequences; a padding sequence repeats the last offset (no "
        f"queries); got {b['cu_seqlens_q'][:6].tolist()}")
    assert b["block_tables"][0, :3].tolist() == [0, 1, 2] and b["block_tables"][1, :3].tolist() == [3, -1, -1], (
        "a step's block table may be narrower than the buffer: its columns go into the first ones")
    assert b["context_lens"][:5].tolist() == [9, 6, 0, 0, STALE], "padding sequences attend to nothing"
    assert b["spec_state_counts"][:5].tolist() == [0, 0, 0, 0, STALE], (
        "a field the step does not have (no drafts verified) gets its pad value in the real rows too; "
        f"got {b['spec_state_counts'][:5].tolist()}")
