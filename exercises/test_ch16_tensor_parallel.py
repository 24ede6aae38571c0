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
"""
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
