"""Chapter 16 — tensor parallelism: the rows a rank keeps, and the vocabulary-parallel lookup.

Your ``split_rows`` (exercises/minivllm/layers/linear.py) says which rows of a split
dimension a rank keeps; every sharded layer's weight loader calls it. Your
``masked_embedding`` (exercises/minivllm/layers/embed_head.py) is one rank's part of an
embedding lookup. Both are graded in one process: ``as_rank(r, n)`` builds a layer as rank
r of n would, and the test adds up what the n ranks compute (which is what the all-reduce
does between real processes). Exact examples, then properties over random sizes:
the ranks' slices tile the dimension in rank order; a column-parallel then a row-parallel
layer give the full matmul; query heads and their KV head land on the same rank; each
token's embedding row comes from exactly one rank, padding rows included.

The main exercise is the sharded linear layers themselves (exercises/minivllm/layers/linear.py):
which KV heads a rank keeps (``kv_head_range``), the loaders that cut a checkpoint tensor
into this rank's rows (``PackedLinear.weight_loader``) or columns
(``RowParallelLinear.weight_loader``), and the row-parallel forward, whose all-reduce is
replaced here by one that hands back the sum of the ranks' partial products; and which
models split at all (``check_tensor_parallel`` in exercises/minivllm/engine/tp_worker.py).
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from minivllm.distributed.parallel_state import as_rank
from minivllm.layers.embed_head import VocabEmbedding, masked_embedding
from minivllm.layers.linear import ColumnParallelLinear, QKVLinear, RowParallelLinear, kv_head_range, split_rows


def test_ch16_split_rows_examples():
    got = [split_rows(12, r, 3) for r in range(3)]
    assert got == [(0, 4), (4, 4), (8, 4)], f"12 rows over 3 ranks: expected [(0, 4), (4, 4), (8, 4)], got {got}"
    assert split_rows(7, 0, 1) == (0, 7), "one rank keeps every row"
    assert split_rows(4096, 1, 2) == (2048, 2048)


@given(rows_per_rank=st.integers(1, 64), world_size=st.integers(1, 8))
def test_ch16_split_rows_tile_the_dimension(rows_per_rank, world_size):
    n = rows_per_rank * world_size
    slices = [split_rows(n, r, world_size) for r in range(world_size)]
    covered = [row for start, size in slices for row in range(start, start + size)]
    assert covered == list(range(n)), (
        f"{n} rows over {world_size} ranks: the slices {slices} must cover 0..{n - 1} once each, in rank order")


@given(world_size=st.sampled_from([1, 2, 4]), inner=st.sampled_from([8, 16, 24]), tokens=st.integers(1, 6))
def test_ch16_column_then_row_parallel_is_the_full_matmul(world_size, inner, tokens):
    w1, w2, x = torch.randn(inner, 8), torch.randn(8, inner), torch.randn(tokens, 8)
    partials = []
    for rank in range(world_size):
        with as_rank(rank, world_size):
            col, row = ColumnParallelLinear(8, inner), RowParallelLinear(inner, 8)
        col.weight_loader(col.weight, w1)
        row.weight_loader(row.weight, w2)
        partials.append(F.linear(col(x), row.weight))  # what each rank adds to the all-reduce
    torch.testing.assert_close(sum(partials), x @ w1.T @ w2.T, atol=1e-5, rtol=1e-5,
                               msg="the ranks' partial products must add up to the full two matmuls")


def test_ch16_qkv_heads_stay_with_their_kv_head():
    hidden, d, heads, kv = 8, 2, 8, 2
    q, k = torch.randn(heads * d, hidden), torch.randn(kv * d, hidden)
    for world_size in (2, 4):
        for rank in range(world_size):
            with as_rank(rank, world_size):
                qkv = QKVLinear(hidden, d, heads, kv)
            qkv.weight_loader(qkv.weight, q, "q")
            qkv.weight_loader(qkv.weight, k, "k")
            first = rank * heads // world_size
            q_rows = qkv.weight[: qkv.num_heads * d]
            assert torch.equal(q_rows, q[first * d : (first + heads // world_size) * d]), (
                f"rank {rank} of {world_size} must keep query heads {first}..{first + heads // world_size - 1}")
            kv_first, _ = kv_head_range(kv, rank, world_size)
            assert kv_first == first // (heads // kv), "a rank's query heads attend with the KV head it keeps"


def test_ch16_masked_embedding_examples():
    weight = torch.arange(12.0).view(4, 3)  # rows 4..7 of an 8-token vocabulary
    got = masked_embedding(torch.tensor([3, 4, 7, 8, 0]), weight, vocab_start=4)
    expected = torch.tensor([[0.0, 0, 0], [0, 1, 2], [9, 10, 11], [0, 0, 0], [0, 0, 0]])
    assert torch.equal(got, expected), f"ids 3, 4, 7, 8, 0 with rows 4..7 here: expected\n{expected}\ngot\n{got}"


@given(vocab=st.integers(2, 40), world_size=st.integers(1, 5), num_ids=st.integers(1, 12), data=st.data())
def test_ch16_every_token_comes_from_exactly_one_rank(vocab, world_size, num_ids, data):
    table = torch.randn(vocab, 4)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=num_ids, max_size=num_ids)))
    total = torch.zeros(num_ids, 4)
    for rank in range(world_size):
        with as_rank(rank, world_size):
            embed = VocabEmbedding(vocab, 4)  # the last rank's slice may run past the vocabulary
        embed.weight_loader(embed.weight, table)
        rows = masked_embedding(ids, embed.weight, embed.vocab_start)
        assert rows.shape == (num_ids, 4), f"one row per id, got shape {tuple(rows.shape)}"
        total += rows
    assert torch.equal(total, F.embedding(ids, table)), (
        f"vocabulary {vocab} over {world_size} ranks: the ranks' lookups must add up to the full embedding")


# --- the sharded layers ---------------------------------------------------------------


def test_ch16_kv_head_range_examples():
    assert [kv_head_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)], (
        "at least as many KV heads as ranks: split evenly, in rank order")
    assert [kv_head_range(2, r, 8) for r in range(8)] == [(0, 1)] * 4 + [(1, 1)] * 4, (
        "fewer KV heads than ranks: one each, neighbouring ranks sharing it")
    assert [kv_head_range(4, r, 4) for r in range(4)] == [(r, 1) for r in range(4)], "one KV head per rank"
    assert kv_head_range(1, 3, 4) == (0, 1), "a single KV head is copied on every rank"
    with pytest.raises(ValueError, match="3"):
        kv_head_range(3, 0, 4)


def test_ch16_packed_loader_keeps_this_ranks_rows_at_the_shards_offset():
    hidden, d, heads, kv = 4, 2, 4, 2
    q, k, v = torch.randn(heads * d, hidden), torch.randn(kv * d, hidden), torch.randn(kv * d, hidden)
    with as_rank(1, 2):
        qkv = QKVLinear(hidden, d, heads, kv, bias=True)
    for name, w in (("q", q), ("k", k), ("v", v)):
        qkv.weight_loader(qkv.weight, w, name)
        qkv.weight_loader(qkv.bias, w[:, 0], name)
    expected = torch.cat([q[4:8], k[2:4], v[2:4]])
    assert torch.equal(qkv.weight, expected), "rank 1 of 2 keeps q heads 2-3, kv head 1: [q rows | k rows | v rows]"
    assert torch.equal(qkv.bias, expected[:, 0]), "a bias is split by the same rows"
    with pytest.raises(ValueError, match="'x'"):
        qkv.weight_loader(qkv.weight, q, "x")
    with pytest.raises(ValueError, match="expected shape"):
        qkv.weight_loader(qkv.weight, q[:-1], "q")
    with pytest.raises(ValueError, match="expected shape"):
        qkv.weight_loader(qkv.weight, torch.randn(heads * d, hidden + 1), "q")


def test_ch16_row_parallel_loader_keeps_this_ranks_columns():
    w, b = torch.randn(3, 8), torch.randn(3)
    for rank in range(4):
        with as_rank(rank, 4):
            row = RowParallelLinear(8, 3, bias=True)
        row.weight_loader(row.weight, w)
        row.weight_loader(row.bias, b)
        assert torch.equal(row.weight, w[:, 2 * rank : 2 * rank + 2]), f"rank {rank} of 4 keeps input columns of its slice"
        assert torch.equal(row.bias, b), "every rank holds the whole bias"
    with pytest.raises(ValueError, match="expected shape"):
        row.weight_loader(row.weight, w[:, :6])


def test_ch16_row_parallel_forward_all_reduces_then_adds_the_bias(monkeypatch):
    import minivllm.layers.linear as linear_module

    w, b, x = torch.randn(3, 8), torch.randn(3), torch.randn(5, 8)
    layers = []
    for rank in range(2):
        with as_rank(rank, 2):
            row = RowParallelLinear(8, 3, bias=True)
        row.weight_loader(row.weight, w)
        row.weight_loader(row.bias, b)
        layers.append(row)
    partials = [F.linear(x[:, 4 * r : 4 * r + 4], layers[r].weight) for r in range(2)]
    reduced = []

    def fake_all_reduce(t):  # what the collective gives every rank: the sum of the partials
        reduced.append(t.clone())
        return sum(partials).clone()

    monkeypatch.setattr(linear_module, "all_reduce", fake_all_reduce)
    for r, row in enumerate(layers):
        y = row(x[:, 4 * r : 4 * r + 4])
        assert len(reduced) == r + 1, "a row-parallel layer of several ranks all-reduces its partial product"
        torch.testing.assert_close(reduced[-1], partials[r], msg="each rank all-reduces its own partial, without the bias")
        torch.testing.assert_close(y, x @ w.T + b, msg="after the sum, the bias is added once")
    with as_rank(0, 1):
        one = RowParallelLinear(8, 3, bias=True)
    one.weight_loader(one.weight, w)
    one.weight_loader(one.bias, b)
    torch.testing.assert_close(one(x), x @ w.T + b, msg="one rank: the plain linear layer")
    assert len(reduced) == 2, "one rank has nobody to all-reduce with"


# --- which models split: check_tensor_parallel -------------------------------------------


def _config(heads=16, kv=8, intermediate=3072, experts=0, moe_intermediate=0, layer_types=None):
    """The fields of a ModelConfig that tensor parallelism reads."""
    from types import SimpleNamespace

    hf = {} if layer_types is None else {"layer_types": layer_types}
    return SimpleNamespace(hf_config=hf, model_type="test", num_attention_heads=heads, num_key_value_heads=kv,
                           intermediate_size=intermediate, num_experts=experts,
                           moe_intermediate_size=moe_intermediate)


def _refused(config, world_size, device="cpu"):
    from minivllm.engine.tp_worker import check_tensor_parallel

    try:
        check_tensor_parallel(config, world_size, device)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_ch16_a_model_that_splits_is_accepted(world_size):
    assert _refused(_config(), world_size) is None, (
        f"16 query heads, 8 KV heads and 3,072 features split evenly over {world_size} ranks: nothing to refuse")
    assert _refused(_config(kv=2), world_size) is None, (
        f"2 KV heads over {world_size} ranks: split, or copied on whole groups of ranks")
    assert _refused(_config(experts=8, moe_intermediate=64), world_size) is None, (
        "experts of 64 features split over 1-8 ranks")
    assert _refused(_config(moe_intermediate=6), world_size) is None, (
        "a dense model (no experts) may carry moe_intermediate_size; it is not split, so it is not checked")


@pytest.mark.parametrize("config, world_size, field", [
    (_config(heads=12), 8, "num_attention_heads"),
    (_config(heads=6, kv=6), 4, "num_attention_heads"),
    (_config(kv=3, heads=12), 2, "num_key_value_heads"),
    (_config(kv=6, heads=24), 4, "num_key_value_heads"),
    (_config(kv=4, heads=24), 6, "num_key_value_heads"),
    (_config(intermediate=100), 8, "intermediate_size"),
    (_config(experts=8, moe_intermediate=6), 4, "moe_intermediate_size"),
])
def test_ch16_an_uneven_split_is_refused_naming_its_field(config, world_size, field):
    message = _refused(config, world_size)
    assert message is not None, f"{field} does not split over {world_size} ranks: a ValueError is expected"
    assert field in message and "tensor_parallel_size" in message, (
        f"the refusal must name {field} and tensor_parallel_size, got: {message!r}")


def test_ch16_hybrid_models_are_refused():
    hybrid = _config(layer_types=["linear_attention", "full_attention"])
    message = _refused(hybrid, 2)
    assert message is not None and "hybrid" in message, (
        f"a model with linear_attention layers cannot be split: a ValueError saying hybrid, got {message!r}")
    assert _refused(_config(layer_types=["full_attention", "sliding_attention"]), 2) is None, (
        "attention layers of any kind split; only linear_attention (Gated DeltaNet) layers are refused")


def test_ch16_each_rank_needs_its_own_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _refused(_config(), 2, "cuda") is None, "two ranks on a machine with two GPUs"
    message = _refused(_config(heads=12, kv=6), 3, "cuda")
    assert message is not None and "GPU" in message, f"three ranks, two GPUs: a ValueError naming the GPUs, got {message!r}"
    assert _refused(_config(heads=12, kv=6), 3, "cpu") is None, "on the CPU, ranks are processes: no GPU count applies"
