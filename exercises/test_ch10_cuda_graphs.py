"""Chapter 10 — CUDA graphs: which batch sizes get a graph, and which graph a batch replays in.

Your ``graph_batch_sizes`` and ``padded_batch_size`` (exercises/minivllm/engine/cuda_graphs.py)
are pure functions of integers, so they are graded on the CPU: exact lists for the
configurations a reader meets (1, 3, 8, 20, 256, 1000 sequences), then properties over every
max_num_seqs from 1 to 600 (ascending, no duplicates, the largest is max_num_seqs capped at
512, every power of two up to 8 and every multiple of 16 present), and for the padding:
the smallest captured size that holds the batch, for every batch size, and a clear error
for a batch larger than every graph. ``CudaGraphDispatcher.plan`` and ``dispatch`` call
exactly these functions on a GPU.
"""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minivllm.engine.cuda_graphs import graph_batch_sizes, padded_batch_size


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
