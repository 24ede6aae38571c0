"""Chapter 09 — Triton kernels: RMSNorm inside a kernel, the two-stage paged decode kernel,
and the tuned kernel's online softmax, key loop, split epilogue and merge (going further).

Your kernels run in Triton's interpreter on the CPU, whatever the machine, so that every
answer is graded the same way. The interpreter executes the kernel's Python body with numpy
arrays in place of registers: what passes here computes the same on a GPU.

The main exercise is exercises/minivllm/kernels/flash_decode.py: stage 1 (``_split_kernel``,
one program per sequence, K/V head and split of the context, walking its split's cache
blocks through the block table with the online softmax) and stage 2 (``_merge_kernel``,
which merges the splits). Its tests draw random caches whose blocks are scattered through
the pool, with NaN in the rows past each context (a tail that is read shows), an output
full of NaN (a row left unwritten shows), grouped-query heads, contexts that end inside a
block, a context of one key, scores far from zero (an exponential without the max
subtracted overflows), a peak in the first block (a max that drops back shows), and more
splits than some contexts have blocks (an empty split must still write its partials).

The warm-up is ``_rms_norm_kernel`` (exercises/minivllm/kernels/elementwise.py): rows whose
width is not a power of two, a residual, an eps that matters, float16 values whose squares
overflow float16, rounded where the reference rounds. Going further, in
exercises/minivllm/kernels/paged_attention.py (the engine's tuned kernels): the base-2
online softmax ``_online_softmax_update``, the key loop ``_attend_cached_keys``, the split
epilogue ``_store_split`` and the log-sum-exp merge ``_merge_kernel``, graded through the
decode, short-prefill and prefill kernels, with sliding windows and padding rows.
"""
import contextlib
import os
import sys


def _interpret_triton() -> None:
    """Run every Triton kernel in the interpreter from here on.

    The switch is read when a kernel is decorated, and triton's own library functions
    (tl.sum, tl.max, ...) are decorated when triton is first imported. Another chapter's
    tests may have imported triton already (transformers does); its Python modules are then
    imported again, this time interpreted.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    language = sys.modules.get("triton.language")
    if language is not None and type(language.sum).__name__ != "InterpretedFunction":
        for name in [n for n in sys.modules if n.split(".")[0] == "triton" and not n.startswith("triton._C")]:
            del sys.modules[name]
        for name in [n for n in sys.modules if n.startswith("minivllm.kernels")]:
            del sys.modules[name]


_interpret_triton()

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minivllm.kernels.elementwise import rms_norm  # noqa: E402
from minivllm.kernels.flash_decode import flash_decode  # noqa: E402
from minivllm.kernels.paged_attention import paged_decode_attention, paged_prefill_attention  # noqa: E402

TOL = dict(atol=1e-4, rtol=1e-4)  # the interpreter computes in numpy float32


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    from minivllm.kernels import elementwise, flash_decode, paged_attention

    for kernel in (elementwise._rms_norm_kernel, flash_decode._split_kernel, flash_decode._merge_kernel,
                   paged_attention._decode_kernel, paged_attention._prefill_kernel):
        if type(kernel).__name__ != "InterpretedFunction":
            pytest.fail("the kernels were imported before TRITON_INTERPRET=1 was set", pytrace=False)


@contextlib.contextmanager
def kernel_errors():
    """The interpreter wraps an exception raised inside a kernel, once per @triton.jit
    function it passes through (a kernel calling a helper: twice); show the original."""
    try:
        yield
    except Exception as e:
        original = e
        while type(original).__name__ == "InterpreterError" and original.__cause__ is not None:
            original = original.__cause__
        if original is not e:
            raise original from None
        raise


# --- RMSNorm --------------------------------------------------------------------------


def rms_norm_spec(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


@pytest.mark.parametrize("hidden", [48, 100, 64])
def test_ch09_rms_norm_matches_the_spec(hidden):
    x = torch.randn(7, hidden)
    w = torch.randn(hidden)
    with kernel_errors():
        out = rms_norm(x, w, 1e-6)
    assert not out.isnan().any(), "NaN in the output"
    torch.testing.assert_close(out, rms_norm_spec(x, w, 1e-6), **TOL, msg=lambda m: (
        f"hidden size {hidden} (the kernel's block is {1 << (hidden - 1).bit_length()} lanes; "
        f"the mean is over the {hidden} real columns): {m}"))


def test_ch09_rms_norm_with_the_residual_fused_in():
    x, r = torch.randn(5, 40), torch.randn(5, 40)
    w = torch.randn(40)
    with kernel_errors():
        out, res = rms_norm(x, w, 1e-6, r)
    torch.testing.assert_close(res, x + r, atol=0, rtol=0)
    torch.testing.assert_close(out, rms_norm_spec(x + r, w, 1e-6), **TOL,
                               msg=lambda m: f"norm(x + residual) is wrong: {m}")


def test_ch09_rms_norm_eps_counts():
    # Activations of size ~0.01 have a mean square of ~1e-4: an eps of 1e-3 changes the
    # result by a factor of about 3, and leaving it out shows.
    x = 0.01 * torch.randn(4, 24)
    w = torch.randn(24)
    with kernel_errors():
        out = rms_norm(x, w, 1e-3)
    torch.testing.assert_close(out, rms_norm_spec(x, w, 1e-3), **TOL,
                               msg=lambda m: f"with eps=1e-3 on small activations: {m}")


def test_ch09_rms_norm_statistics_in_float32():
    # float16 tops out at 65504: values of a few hundred square to infinity in float16,
    # so the mean of squares must be taken in float32 (x32), as in the reference.
    x = (300 * torch.randn(3, 48)).half()
    w = torch.randn(48).half()
    with kernel_errors():
        out = rms_norm(x, w, 1e-6)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all() and out.abs().max() > 0, (
        "float16 rows with values of a few hundred came out zero, inf or NaN: square them in float32 (x32)")
    torch.testing.assert_close(out.float(), rms_norm_spec(x, w, 1e-6).float(), atol=1e-2, rtol=1e-2)


def test_ch09_rms_norm_rounds_like_the_reference():
    # The reference (transformers' Qwen3RMSNorm, chapter 01's rms_norm) rounds the
    # normalised row to the activations' dtype *before* the weight multiplies it. A kernel
    # that multiplies the float32 row by the weight rounds once instead: each value is off
    # by at most one float16 ulp, within any tolerance, but about a quarter of them are,
    # and the kernel path then disagrees with the torch path. Summing the squares in
    # another order than torch flips a rounding only a few times in 100,000, hence the
    # 1% allowance.
    x = (4 * torch.randn(64, 96)).half()
    w = torch.randn(96).half()
    with kernel_errors():
        out = rms_norm(x, w, 1e-6)
    ref = rms_norm_spec(x, w, 1e-6)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    differ = (out != ref).float().mean().item()
    assert differ < 0.01, (
        f"{differ:.0%} of the float16 outputs differ from the reference by a rounding: cast y back to x.dtype "
        "before multiplying by the weight, as the reference does")


@settings(max_examples=12)
@given(rows=st.integers(1, 4), hidden=st.integers(1, 130), scale=st.sampled_from([0.05, 1.0, 20.0]),
       seed=st.integers(0, 2**16))
def test_ch09_rms_norm_any_width(rows, hidden, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(rows, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    with kernel_errors():
        out = rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, rms_norm_spec(x, w, 1e-5), **TOL)


# --- paged decode attention: a random paged cache and the spec -----------------------


def paged_cache(lens, kv_heads, head_dim, block_size, g):
    """A pool of random keys and values, each sequence's blocks scattered through it."""
    blocks = [max(1, -(-n // block_size)) for n in lens]
    num_blocks = sum(blocks) + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width, tables, i = max(blocks), [], 0
    for b in blocks:
        tables.append(perm[i : i + b] + [-1] * (width - b))
        i += b
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32)


def decode_spec(q, k_cache, v_cache, tables, lens, scale):
    """softmax(q k^T * scale) v over each sequence's cached tokens, in float64; each group
    of heads // kv_heads query heads reads one K/V head; a sequence of length 0 gives 0."""
    heads, kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        rows = tables[b, : -(-n // block_size)].long()
        k = k_cache[rows].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[rows].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out.float()


@contextlib.contextmanager
def poisoned_partials():
    """The split-context kernel's partial outputs start as NaN, as memory nobody wrote may
    be: a split with no keys stores none (only its lse, -inf), and a merge that reads one
    shows it (0 * NaN is NaN)."""
    module = sys.modules[paged_decode_attention.__module__]
    package_split_buffers = module.split_buffers

    def split_buffers(out, num_splits):
        part_out, part_lse = package_split_buffers(out, num_splits)
        if num_splits > 1:
            part_out.fill_(float("nan"))
        return part_out, part_lse

    module.split_buffers = split_buffers
    try:
        yield
    finally:
        module.split_buffers = package_split_buffers


def run_decode(lens, heads, kv_heads, head_dim=16, block_size=4, num_splits=1, q_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = paged_cache(lens, kv_heads, head_dim, block_size, g)
    q = q_scale * torch.randn(len(lens), heads, head_dim, generator=g)
    scale = head_dim**-0.5
    with kernel_errors(), poisoned_partials():
        out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), scale,
                                     max(lens), num_splits)
    return out, decode_spec(q, k_cache, v_cache, tables, lens, scale)


# --- the two-stage kernel (kernels/flash_decode.py): the main exercise ------------------


def poison_tails(k_cache, v_cache, tables, lens):
    """NaN in the rows of each sequence's last block past its context: rows no key owns,
    which a kernel must neither weigh nor load (0 * NaN is NaN)."""
    block_size = k_cache.shape[1]
    for b, n in enumerate(lens):
        if n % block_size:
            last = tables[b, (n - 1) // block_size].item()
            k_cache[last, n % block_size :] = float("nan")
            v_cache[last, n % block_size :] = float("nan")


def run_two_stage(lens, heads, kv_heads, head_dim=16, block_size=4, num_splits=1, q_scale=1.0, seed=0, caches=None):
    """flash_decode over a random scattered cache with NaN tails, into an output full of
    NaN; returns (out, spec)."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = caches or paged_cache(lens, kv_heads, head_dim, block_size, g)
    poison_tails(k_cache, v_cache, tables, lens)
    q = q_scale * torch.randn(len(lens), heads, head_dim, generator=g)
    out = torch.full_like(q, float("nan"))
    with kernel_errors():
        flash_decode(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), head_dim**-0.5, num_splits,
                     out=out)
    return out, decode_spec(q, k_cache, v_cache, tables, lens, head_dim**-0.5)


def test_ch09_two_stage_walks_the_block_table():
    # Whole blocks only, one split: each sequence's blocks lie scattered through the pool, in
    # no order; block i of sequence b is entry i of row b of the block table.
    lens = [16, 8, 32, 4]
    out, ref = run_two_stage(lens, 8, 2, seed=1)
    for b, n in enumerate(lens):
        torch.testing.assert_close(out[b], ref[b], **TOL, msg=lambda m: (
            f"sequence {b} ({n} keys in {n // 4} blocks): each key must be read from the physical block that "
            f"this sequence's row of the block table names: {m}"))


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (8, 1), (6, 2)], ids=["gqa-4", "mha", "mqa-8", "gqa-3"])
def test_ch09_two_stage_gqa_groups(heads, kv_heads):
    lens = [12, 20]
    out, ref = run_two_stage(lens, heads, kv_heads, seed=2)
    group = heads // kv_heads
    for h in range(heads):
        torch.testing.assert_close(out[:, h], ref[:, h], **TOL, msg=lambda m: (
            f"query head {h} must attend with K/V head {h // group} (groups of {group}): {m}"))


@pytest.mark.parametrize("block_size", [4, 8])
def test_ch09_two_stage_context_ends_mid_block(block_size):
    # The last block of each sequence is partly filled; its other rows hold NaN here.
    lens = [13, 6, 31, 2]
    out, ref = run_two_stage(lens, 8, 2, block_size=block_size, num_splits=2, seed=block_size)
    assert not out.isnan().any(), (
        "NaN in the output: a context that ends mid-block must ignore the block's tail, neither weighing "
        "its rows nor loading them (0 * NaN is NaN)")
    torch.testing.assert_close(out, ref, **TOL, msg=lambda m: (
        f"a context that ends mid-block must ignore the block's tail (blocks of {block_size}): {m}"))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_ch09_two_stage_a_context_of_one_key(num_splits):
    # One key: the softmax over it is 1, so every head of the group gets that key's value.
    g = torch.Generator().manual_seed(5)
    lens = [1, 1, 9]
    caches = paged_cache(lens, 2, 16, 4, g)
    out, ref = run_two_stage(lens, 8, 2, num_splits=num_splits, seed=5, caches=caches)
    v_cache, tables = caches[1], caches[2]
    for b in (0, 1):
        value = v_cache[tables[b, 0].item(), 0].repeat_interleave(4, dim=0)  # [heads, head_dim]
        torch.testing.assert_close(out[b], value, **TOL, msg=lambda m: (
            f"a context of one key must give exactly that key's value ({num_splits} split(s)): {m}"))
    torch.testing.assert_close(out, ref, **TOL)


def test_ch09_two_stage_rescales_when_the_max_grows():
    # Keys grow along the context, so nearly every block raises the max: what was summed
    # under the old max must be carried over, in l and in acc alike.
    lens = [60, 37]
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache, tables = paged_cache(lens, 2, 16, 4, g)
    for b, n in enumerate(lens):
        for i in range(-(-n // 4)):
            k_cache[tables[b, i].item()] *= 1.0 + 0.15 * i
    out, ref = run_two_stage(lens, 8, 2, seed=7, caches=(k_cache, v_cache, tables))
    torch.testing.assert_close(out, ref, **TOL, msg=lambda m: (
        f"when a later block raises the max, the running sum and the accumulator must be rescaled: {m}"))


def test_ch09_two_stage_a_peak_in_the_first_block():
    # The first block's keys are 60x longer: scores near 150 there, near 0 after. A max that
    # drops back to a later block's own carries the sums over by e^(+150), which overflows.
    lens = [40, 21]
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache, tables = paged_cache(lens, 2, 16, 4, g)
    for b in range(len(lens)):
        k_cache[tables[b, 0].item()] *= 60.0
    out, ref = run_two_stage(lens, 8, 2, seed=11, caches=(k_cache, v_cache, tables))
    assert torch.isfinite(out).all(), "inf or NaN after a block of large scores: the max must only ever grow"
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_ch09_two_stage_scores_far_from_zero(num_splits):
    # Queries 30x larger: scores of several hundred; e^s overflows float32 past e^88.
    out, ref = run_two_stage([50, 23], 8, 2, num_splits=num_splits, q_scale=30.0, seed=3)
    assert torch.isfinite(out).all(), (
        f"inf or NaN with scores in the hundreds ({num_splits} split(s)): every exponential, in the blocks and in "
        "the merge's weights, must have the largest score subtracted first")
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("num_splits", [2, 3, 5, 8])
def test_ch09_two_stage_splits_merged(num_splits):
    # The sequence of 3 keys has one block: with several splits, the others get none.
    lens = [70, 3, 45, 64]
    out, ref = run_two_stage(lens, 8, 2, num_splits=num_splits, seed=num_splits)
    assert not out.isnan().any(), f"NaN with {num_splits} splits: a split without keys must weigh nothing"
    torch.testing.assert_close(out, ref, **TOL, msg=lambda m: (
        f"{num_splits} splits merged must give the softmax over all the keys: {m}"))


def test_ch09_two_stage_every_split_writes_its_partials(monkeypatch):
    # The partial buffers start full of NaN: a split that stores nothing (it has no
    # blocks) leaves NaN for the merge to read.
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned)
    out, ref = run_two_stage([5, 2, 30], 8, 2, num_splits=6, seed=13)
    assert not out.isnan().any(), (
        "a split with no blocks must still store its partials (a max of -inf, sums of 0): the merge reads every split")
    torch.testing.assert_close(out, ref, **TOL)


def test_ch09_two_stage_in_float16():
    # A half-precision cache, as on a GPU; the output comes back in q's dtype.
    lens = [30, 9]
    g = torch.Generator().manual_seed(17)
    k_cache, v_cache, tables = paged_cache(lens, 2, 16, 4, g)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    q = torch.randn(len(lens), 8, 16, generator=g).half()
    with kernel_errors():
        out = flash_decode(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.25, 2)
    assert out.dtype == torch.float16, f"the output must be in q's dtype, got {out.dtype}"
    torch.testing.assert_close(out.float(), decode_spec(q, k_cache, v_cache, tables, lens, 0.25), atol=1e-2, rtol=1e-2)


@settings(max_examples=8)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=3), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 3, 4]), block_size=st.sampled_from([2, 4, 8]), num_splits=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_ch09_two_stage_any_shape(lens, kv_heads, group, block_size, num_splits, seed):
    out, ref = run_two_stage(lens, kv_heads * group, kv_heads, block_size=block_size, num_splits=num_splits,
                             seed=seed)
    torch.testing.assert_close(out, ref, **TOL, msg=lambda m: (
        f"contexts {lens}, {kv_heads} K/V heads in groups of {group}, blocks of {block_size}, {num_splits} splits: {m}"))


# --- going further: the tuned decode kernel (paged_attention.py) ---------------------


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (8, 1)], ids=["gqa-4", "mha", "mqa-8"])
def test_ch09_decode_one_program_walks_many_tiles(heads, kv_heads):
    # One split: each program walks its sequence's whole context, 64 keys a tile. A
    # running sum or accumulator that is not rescaled when the max grows is wrong from
    # the second tile on.
    lens = [200, 65, 1, 130]
    out, ref = run_decode(lens, heads, kv_heads, num_splits=1)
    assert not out.isnan().any(), "NaN in the output"
    for b, n in enumerate(lens):
        torch.testing.assert_close(out[b], ref[b], **TOL, msg=lambda m: (
            f"sequence {b} ({n} keys, {-(-n // 64)} tiles of 64, heads={heads}, kv_heads={kv_heads}): {m}"))


def test_ch09_decode_scores_far_from_zero():
    # Queries 30x larger: scores of several hundred. exp() of them overflows float32 (it
    # tops out near exp(88)) unless each tile subtracts the running max first.
    lens = [150, 90]
    out, ref = run_decode(lens, 8, 2, q_scale=30.0, seed=3)
    assert torch.isfinite(out).all(), "inf or NaN with large scores: subtract the running max before exp"
    torch.testing.assert_close(out, ref, **TOL)


def test_ch09_decode_a_peak_in_the_first_tile():
    # The first 64 keys are 60x longer than the rest: the scores of the first tile reach
    # ~150, those of later tiles stay near 0. A running max that drops back to a later
    # tile's own max rescales the sums by exp(+150), which overflows float32; the max
    # must only ever grow.
    lens = [200, 130]
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache, tables = paged_cache(lens, 2, 16, 4, g)
    for b in range(len(lens)):
        first = tables[b, :16].long()  # the blocks of tokens 0..63
        k_cache[first] *= 60.0
    q = torch.randn(len(lens), 8, 16, generator=g)
    with kernel_errors():
        out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.25,
                                     max(lens), 1)
    assert torch.isfinite(out).all(), "inf or NaN after a tile of large scores: m must be the max over all tiles so far"
    torch.testing.assert_close(out, decode_spec(q, k_cache, v_cache, tables, lens, 0.25), **TOL)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_ch09_decode_split_across_programs_and_merged(num_splits):
    # Several programs per sequence, each over its slice of the context, merged by their
    # log-sum-exp (m + log l): both m and l must be right, not just their ratio.
    lens = [250, 3, 90, 180]
    out, ref = run_decode(lens, 8, 2, num_splits=num_splits, seed=num_splits)
    assert not out.isnan().any(), "NaN in the output"
    torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"{num_splits} splits: {m}")


def test_ch09_decode_splits_with_scores_far_from_zero():
    # Queries 30x larger: each split's log-sum-exp is in the hundreds, and e^lse overflows
    # float32 past e^88; the merge's weights must have the largest lse subtracted first.
    out, ref = run_decode([250, 90, 180], 8, 2, num_splits=3, q_scale=30.0, seed=5)
    assert torch.isfinite(out).all(), (
        "inf or NaN when splits with scores in the hundreds are merged: weigh each partial by "
        "exp(lse - the largest lse)")
    torch.testing.assert_close(out, ref, **TOL)


def test_ch09_decode_in_float16():
    # A half-precision cache, as the engine keeps it on a GPU: tl.dot takes two operands of
    # one dtype, so the float32 probabilities p meet the float16 values v only cast to
    # v's dtype. Rounding p and the inputs to float16 moves outputs of order 1 by ~1e-3.
    lens = [150, 40]
    g = torch.Generator().manual_seed(13)
    k_cache, v_cache, tables = paged_cache(lens, 2, 16, 4, g)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    q = torch.randn(len(lens), 8, 16, generator=g).half()
    with kernel_errors():
        out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.25,
                                     max(lens), 2)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), decode_spec(q, k_cache, v_cache, tables, lens, 0.25), atol=1e-2, rtol=1e-2)


def test_ch09_decode_padding_rows_beside_real_ones():
    # A CUDA-graph batch padded to a captured size: rows of context length 0 attend to
    # nothing and must give exact zeros, while the real rows are unaffected.
    lens = [0, 77, 0, 140]
    out, ref = run_decode(lens, 8, 2, num_splits=2, seed=7)
    assert not out.isnan().any(), "NaN in the output"
    assert out[0].abs().max() == 0 and out[2].abs().max() == 0, "a row with no keys must give zeros"
    torch.testing.assert_close(out, ref, **TOL)


# --- paged prefill attention with a sliding window ------------------------------------


def prefill_spec(q, k_cache, v_cache, tables, lens, q_lens, scale, window):
    """Each sequence's queries (the last q_len of its len positions) over its cached keys,
    in float64: the query at position p sees the keys j with p - window < j <= p."""
    heads, kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out, start = torch.zeros(q.shape, dtype=torch.float64), 0
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        rows = tables[b, : -(-n // block_size)].long()
        k = k_cache[rows].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[rows].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + m].double(), k) * scale
        p = torch.arange(n - m, n)[:, None]
        j = torch.arange(n)[None, :]
        scores = scores.masked_fill(~((j <= p) & (j > p - window)), float("-inf"))
        out[start : start + m] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += m
    return out.float()


@pytest.mark.parametrize("window", [8, 20])
def test_ch09_prefill_sliding_window_hides_whole_tiles(window):
    # The prefill kernel folds its tiles of keys with the same update. A tile of queries
    # (16 in the interpreter) starts at the 64-key tile holding its first query's window; a
    # later query of the same tile may see none of those 64 keys (with a window of 8, the
    # tile of queries 64..79 walks keys 0..63 first, and query 79 sees only keys 72..79).
    # For that row every score of the key tile is -inf and so is m: exp(-inf - (-inf)) is
    # NaN unless such a row is shifted by 0 instead.
    lens, q_lens = [100, 90], [100, 40]  # a fresh prompt; a chunk continuing 50 cached tokens
    g = torch.Generator().manual_seed(window)
    k_cache, v_cache, tables = paged_cache(lens, 2, 16, 4, g)
    q = torch.randn(sum(q_lens), 4, 16, generator=g)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    with kernel_errors():
        out = paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), cu,
                                      max(q_lens), 0.25, sliding_window=window)
    assert not out.isnan().any(), (
        "NaN with a sliding window: a row that sees nothing in a tile has m = -inf; shift it by 0, not by m")
    torch.testing.assert_close(out, prefill_spec(q, k_cache, v_cache, tables, lens, q_lens, 0.25, window), **TOL)


def test_ch09_the_value_product_keeps_the_precision_it_is_given():
    """``tl.dot(p, v)`` must pass ``input_precision=PRECISION``: on a GPU a float32 dot
    without it multiplies in tf32 (about 3e-4 relative error), and float32 would no longer
    match transformers token for token. The interpreter computes every dot exactly whatever
    the argument says, so this one check reads your code instead of running it."""
    import ast
    import inspect
    import textwrap

    from minivllm.kernels import paged_attention

    out, ref = run_decode([40, 7], 4, 2, seed=5)  # your kernel runs first: a blank raises here
    torch.testing.assert_close(out, ref, **TOL)
    tree = ast.parse(textwrap.dedent(inspect.getsource(paged_attention._online_softmax_update.fn)))
    dots = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "dot"]
    assert dots, "the value product is a tl.dot"
    for dot in dots:
        given = {kw.arg: ast.unparse(kw.value) for kw in dot.keywords}
        assert given.get("input_precision") == "PRECISION", \
            f"tl.dot must take input_precision=PRECISION, got {ast.unparse(dot)}"


# --- the paged key loop with a window, and a short prefill ------------------------------


@pytest.mark.parametrize("window, num_splits", [(5, 1), (70, 2), (1, 3)])
def test_ch09_decode_with_a_sliding_window(window, num_splits):
    # The query (at position n - 1) sees only keys n - window .. n - 1; the splits share those.
    lens = [150, 9, 64]
    g = torch.Generator().manual_seed(window)
    k_cache, v_cache, tables = paged_cache(lens, 2, 16, 4, g)
    q = torch.randn(len(lens), 8, 16, generator=g)
    with kernel_errors():
        out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.25,
                                     max(lens), num_splits, sliding_window=window)
    expected = prefill_spec(q, k_cache, v_cache, tables, lens, [1] * len(lens), 0.25, window)
    torch.testing.assert_close(out, expected, **TOL, msg=lambda m: (
        f"a window of {window} over {num_splits} split(s): the query sees only the last {window} keys: {m}"))


def short_prefill_case(lens, q_lens, window, num_splits, seed):
    """A short prefill: each sequence's last q_len tokens are this step's (in k, v, stored by
    the kernel at their slots), the others already cached. Returns (out, spec)."""
    from minivllm.kernels.paged_attention import paged_short_prefill_attention

    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = paged_cache(lens, 2, 16, 4, g)
    full_k, full_v = k_cache.clone(), v_cache.clone()  # every key, the step's own included
    slots, ks, vs = [], [], []
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        for t in range(n - m, n):
            block, row = tables[b, t // 4].item(), t % 4
            slots.append(block * 4 + row)
            ks.append(full_k[block, row].clone())
            vs.append(full_v[block, row].clone())
            k_cache[block, row] = 0.0  # not in the cache before the step
            v_cache[block, row] = 0.0
    q = torch.randn(sum(q_lens), 4, 16, generator=g)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    with kernel_errors():
        out = paged_short_prefill_attention(
            q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), cu, max(q_lens), 0.25, max(lens),
            torch.stack(ks), torch.stack(vs), torch.tensor(slots), sliding_window=window, num_splits=num_splits)
    return out, prefill_spec(q, full_k, full_v, tables, lens, q_lens, 0.25, window or 10**9)


@pytest.mark.parametrize("window, num_splits", [(None, 1), (None, 2), (3, 1), (6, 2)])
def test_ch09_short_prefill_over_cached_keys(window, num_splits):
    # A few queries per sequence, causal among themselves, over cached keys walked in tiles
    # (each query with its own window), split and merged.
    out, expected = short_prefill_case([90, 11, 40], [3, 2, 4], window, num_splits, seed=num_splits)
    torch.testing.assert_close(out, expected, **TOL, msg=lambda m: (
        f"short prefill, window {window}, {num_splits} split(s): each query sees the cached keys and the step's "
        f"own up to its position: {m}"))
