"""The CUDA-graph dispatcher's choices, on the CPU (no graph is captured here): which graphs an
engine captures, which one a step replays in and padded to what size, which steps run
eagerly, and how a replay fills the static inputs' padding rows."""
import pytest
import torch

from minivllm.context import get_context, reset_context, set_context
from minivllm.engine.cuda_graphs import (DECODE, PREFILL, PREFILL_GRAPH_TOKENS, SCRATCH, VERIFY, BatchDescriptor,
                                         CudaGraphDispatcher, CudaGraphs, GraphKey, StaticInputs)
from minivllm.ops.gated_delta import SHORT_STEP_TOKENS

DECODE_256 = [1, 2, 4, 8, *range(16, 257, 16)]


def plan(max_num_seqs=256, budget=8192, max_model_len=4096, k=None, hybrid=False, tp=False) -> CudaGraphDispatcher:
    return CudaGraphDispatcher.plan(max_num_seqs, budget, max_model_len, k, hybrid=hybrid, tensor_parallel=tp)


def decode(n: int) -> BatchDescriptor:
    return BatchDescriptor(num_tokens=n, num_seqs=n, max_query_len=1, is_prefill=False)


def prefill(lengths: list[int], from_scratch: bool = False) -> BatchDescriptor:
    return BatchDescriptor(num_tokens=sum(lengths), num_seqs=len(lengths), max_query_len=max(lengths),
                           is_prefill=max(lengths) > 1, from_scratch=from_scratch)


def test_plan_captures_decode_prefill_and_scratch_graphs():
    d = plan()
    assert d.sizes[DECODE] == DECODE_256
    assert d.sizes[PREFILL] == list(PREFILL_GRAPH_TOKENS)  # every count up to 4,096 fits
    assert d.sizes[SCRATCH] == [512, 768, 1024, 1536, 2048, 3072, 4096]
    assert VERIFY not in d.sizes
    small = plan(budget=1024)  # the step budget bounds the prefill graphs
    assert small.sizes[PREFILL][-1] == 1024 and small.sizes[SCRATCH] == [512, 768, 1024]
    assert plan(budget=8192, max_model_len=300).sizes[PREFILL][-1] == 256  # and so does max_model_len
    assert SCRATCH not in plan(budget=384).sizes  # no prefill graph of 512 tokens or more: no twin
    assert plan(max_num_seqs=1000).sizes[DECODE][-1] == 512
    assert plan(max_num_seqs=20).sizes[DECODE] == [1, 2, 4, 8, 16, 20]


def test_plan_verify_graphs_per_decode_size_within_the_budget():
    d = plan(k=4)
    assert d.verify_query_len == 5 and d.sizes[VERIFY] == DECODE_256
    assert plan(k=4, budget=64).sizes[VERIFY] == [1, 2, 4, 8]  # 16 sequences x 5 tokens > 64
    assert VERIFY not in plan(k=4, budget=4).sizes


def test_plan_hybrid_and_tensor_parallel():
    hybrid = plan(k=SHORT_STEP_TOKENS - 1, hybrid=True)
    assert set(hybrid.sizes) == {DECODE, VERIFY}  # prefill eagerly; verifying steps are short steps
    assert set(plan(k=SHORT_STEP_TOKENS, hybrid=True).sizes) == {DECODE}  # too long a step for the short kernels
    assert set(plan(k=4, tp=True).sizes) == {DECODE}


@pytest.mark.parametrize("n, size", [(1, 1), (3, 4), (5, 8), (9, 16), (17, 32), (200, 208), (256, 256)])
def test_a_decode_batch_replays_the_next_captured_size(n, size):
    assert plan().dispatch(decode(n)) == GraphKey(DECODE, size)
    assert plan(k=4).dispatch(decode(n)) == GraphKey(DECODE, size)  # decode first, verify graphs or not


def test_a_decode_batch_past_the_largest_graph_runs_eagerly():
    assert plan().dispatch(decode(257)) is None
    assert CudaGraphDispatcher().dispatch(decode(1)) is None  # nothing captured (CPU, enforce_eager)


@pytest.mark.parametrize("tokens, size", [(2, 16), (15, 16), (16, 16), (17, 32), (100, 128), (700, 768),
                                          (4096, 4096)])
def test_one_sequence_prefill_replays_the_next_token_count(tokens, size):
    d = plan()
    assert d.dispatch(prefill([tokens])) == GraphKey(PREFILL, size)
    twin = SCRATCH if size >= 512 else PREFILL  # a prompt from scratch: its twin, where there is one
    assert d.dispatch(prefill([tokens], from_scratch=True)) == GraphKey(twin, size)


def test_prefill_steps_that_no_graph_holds_run_eagerly():
    d = plan(budget=512)
    assert d.dispatch(prefill([512], from_scratch=True)) == GraphKey(SCRATCH, 512)
    assert d.dispatch(prefill([513])) is None  # past the largest token count
    assert d.dispatch(prefill([10, 20])) is None  # two sequences
    assert d.dispatch(prefill([10, 1])) is None  # a prompt beside a decode row
    assert plan(hybrid=True).dispatch(prefill([20])) is None  # hybrid models prefill eagerly


def test_verifying_steps_replay_a_verify_graph_by_sequences():
    d = plan(k=4)
    assert d.dispatch(prefill([5, 5, 3])) == GraphKey(VERIFY, 4)  # 3 sequences, at most 1 + k tokens each
    assert d.dispatch(prefill([5] * 17)) == GraphKey(VERIFY, 32)
    assert d.dispatch(prefill([3])) == GraphKey(VERIFY, 1)  # short enough: before the prefill graphs
    assert d.dispatch(prefill([6])) == GraphKey(PREFILL, 16)  # one sequence past 1 + k: a prefill graph
    assert d.dispatch(prefill([6, 2])) is None
    assert d.dispatch(prefill([2] * 257)) is None  # more sequences than the largest verify graph
    hybrid = plan(k=3, hybrid=True)
    assert hybrid.dispatch(prefill([4, 2])) == GraphKey(VERIFY, 2)
    assert hybrid.dispatch(prefill([5])) is None


def test_shapes_and_capture_order():
    d = plan(max_num_seqs=16, budget=600, k=4)
    assert d.shape(GraphKey(DECODE, 8)) == (8, 8, 1)
    assert d.shape(GraphKey(VERIFY, 8)) == (8, 40, 5)
    assert d.shape(GraphKey(PREFILL, 64)) == (1, 64, 64) == d.shape(GraphKey(SCRATCH, 64))
    order = d.capture_order()
    assert [phase for phase, _ in order] == ["decode_graphs", "prefill_graphs", "verify_graphs"]
    assert order[0][1] == [GraphKey(DECODE, s) for s in (16, 8, 4, 2, 1)]  # largest first: it sizes the pool
    assert order[1][1] == [GraphKey(PREFILL, 512), GraphKey(SCRATCH, 512)] + [
        GraphKey(PREFILL, t) for t in (256, 128, 64, 32, 16)]
    assert order[2][1] == [GraphKey(VERIFY, s) for s in (16, 8, 4, 2, 1)]


def test_batch_descriptor_reads_the_context():
    set_context(is_prefill=True, cu_seqlens_q=torch.tensor([0, 3, 5]), max_seqlen_q=3, from_scratch=True)
    try:
        assert BatchDescriptor.of(get_context(), 5) == prefill([3, 2], from_scratch=True)
    finally:
        reset_context()


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def graphs_with_buffers(d: CudaGraphDispatcher, kind: str, hybrid: bool = False) -> CudaGraphs:
    """A CudaGraphs whose graphs of ``kind`` only count their replays, over real static buffers."""
    graphs = CudaGraphs(d, hybrid=hybrid)
    kinds = (PREFILL, SCRATCH) if kind == PREFILL else (kind,)
    keys = [key for _, keys in d.capture_order() for key in keys if key.kind in kinds]
    seqs, tokens, _ = d.shape(keys[0])
    graphs.static[kind] = StaticInputs(graphs._fields(kind), seqs, tokens, max_blocks=4,
                                       hidden=torch.arange(tokens * 2.0).view(tokens, 2),
                                       constant=("cu_seqlens_q",) if kind == DECODE else ())
    for key in keys:
        graphs.graphs[key], graphs.replays[key] = FakeGraph(), 0
    return graphs


def replay(graphs: CudaGraphs, input_ids, **fields):
    set_context(**fields)
    try:
        key = graphs.dispatcher.dispatch(BatchDescriptor.of(get_context(), len(input_ids)))
        ids = torch.tensor(input_ids)
        return key, graphs.replay(key, ids, ids + 100)
    finally:
        reset_context()


def test_a_decode_replay_pads_its_rows_to_store_and_attend_to_nothing():
    graphs = graphs_with_buffers(plan(max_num_seqs=8), DECODE, hybrid=True)
    b = graphs.static[DECODE].buffers
    b["cu_seqlens_q"][:] = torch.arange(9)  # as capture leaves it
    key, hidden = replay(graphs, [7, 8, 9], is_prefill=False, max_seqlen_q=1, cu_seqlens_q=torch.arange(4),
                         slot_mapping=torch.tensor([10, 20, 30]), context_lens=torch.tensor([3, 4, 5]),
                         block_tables=torch.tensor([[0], [1], [2]]), state_slots=torch.tensor([2, 0, 1]),
                         has_initial_state=torch.tensor([1, 1, 0]))
    assert key == GraphKey(DECODE, 4) and graphs.replays_of(DECODE) == {8: 0, 4: 1, 2: 0, 1: 0}
    assert graphs.graphs[key].replays == 1 and graphs.graphs[GraphKey(DECODE, 8)].replays == 0
    assert hidden.shape == (3, 2) and hidden.data_ptr() == graphs.static[DECODE].hidden.data_ptr()
    assert b["input_ids"][:3].tolist() == [7, 8, 9] and b["positions"][:3].tolist() == [107, 108, 109]
    assert b["slot_mapping"][:5].tolist() == [10, 20, 30, -1, -1]  # row 3 pads; row 4 is past the graph
    assert b["context_lens"][:4].tolist() == [3, 4, 5, 0]
    assert b["state_slots"][:4].tolist() == [2, 0, 1, -1]
    assert b["cu_seqlens_q"].tolist() == list(range(9))  # one token per sequence: never rewritten
    assert "spec_state_counts" not in b


def test_a_verify_replay_pads_whole_sequences():
    graphs = graphs_with_buffers(plan(max_num_seqs=8, k=2), VERIFY, hybrid=True)
    b = graphs.static[VERIFY].buffers
    key, hidden = replay(graphs, [1, 2, 3, 4, 5], is_prefill=True, max_seqlen_q=3, cu_seqlens_q=torch.tensor([0, 3, 5]),
                         slot_mapping=torch.arange(5), context_lens=torch.tensor([9, 6]),
                         block_tables=torch.tensor([[0, 1, 2], [3, -1, -1]]), state_slots=torch.tensor([4, 5]),
                         has_initial_state=torch.tensor([1, 1]))  # spec_state_counts: none (nothing verified)
    assert key == GraphKey(VERIFY, 2) and graphs.replays_of(VERIFY)[2] == 1 and hidden.shape == (5, 2)
    assert b["slot_mapping"][:6].tolist() == [0, 1, 2, 3, 4, -1]  # 2 sequences x 3 rows
    assert b["cu_seqlens_q"][:3].tolist() == [0, 3, 5] and b["block_tables"][1, :3].tolist() == [3, -1, -1]
    assert b["spec_state_counts"][:2].tolist() == [0, 0]
    replay(graphs, [1, 2, 3], is_prefill=True, max_seqlen_q=2, cu_seqlens_q=torch.tensor([0, 2, 3, 3]),
           slot_mapping=torch.arange(3), context_lens=torch.tensor([5, 5, 0]),
           block_tables=torch.zeros(3, 1, dtype=torch.long),
           state_slots=torch.tensor([1, 2, 3]), has_initial_state=torch.tensor([1, 1, 1]),
           spec_state_counts=torch.tensor([1, 0, 0]))
    assert b["cu_seqlens_q"][:5].tolist() == [0, 2, 3, 3, 3]  # the padding sequence has no queries
    assert b["context_lens"][:4].tolist() == [5, 5, 0, 0] and b["state_slots"][:4].tolist() == [1, 2, 3, -1]
    assert b["spec_state_counts"][:4].tolist() == [1, 0, 0, 0]
    assert graphs.replays_of(VERIFY) == {8: 0, 4: 1, 2: 1, 1: 0}


def test_a_prefill_replay_counts_its_graph_and_twin_apart():
    graphs = graphs_with_buffers(plan(budget=512), PREFILL)
    b = graphs.static[PREFILL].buffers
    one = dict(is_prefill=True, slot_mapping=torch.arange(20), block_tables=torch.tensor([[0, 1]]))
    key, _ = replay(graphs, list(range(20)), max_seqlen_q=20, cu_seqlens_q=torch.tensor([0, 20]),
                    context_lens=torch.tensor([30]), **one)
    assert key == GraphKey(PREFILL, 32)
    assert b["slot_mapping"][:33].tolist() == list(range(20)) + [-1] * 12 + [-1]
    assert b["cu_seqlens_q"].tolist() == [0, 20] and b["context_lens"].tolist() == [30]
    key, _ = replay(graphs, list(range(300)), max_seqlen_q=300, cu_seqlens_q=torch.tensor([0, 300]),
                    context_lens=torch.tensor([300]), from_scratch=True, **one | {"slot_mapping": torch.arange(300)})
    assert key == GraphKey(SCRATCH, 512)
    assert graphs.replays_of(SCRATCH) == {512: 1}
    assert graphs.replays_of(PREFILL, SCRATCH)[512] == 1 and graphs.replays_of(PREFILL, SCRATCH)[32] == 1
