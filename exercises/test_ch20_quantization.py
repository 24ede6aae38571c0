"""Chapter 20 — quantization: a row's fp8 scale, the FP8 KV cache's store and load, and the
block-scaled fp8 matmul kernel.

Your ``quantize_per_row`` (exercises/minivllm/ops/quant.py) is checked on rows whose
magnitudes span twelve orders, in float32 and bfloat16: the scale must put each row's largest
magnitude on 448 exactly, every value must come back within e4m3's rounding bound (half a
step: 2^-4 of the value in the normal range, 2^-10 of the scale below it), nothing may
saturate or turn NaN, and a row of zeros must stay zeros with a finite, positive scale.

Your ``quantize_kv`` and ``dequantize_kv`` (exercises/minivllm/ops/attention.py) store keys
past e4m3's range (they must saturate at +-448, never NaN), round trip random keys within
e4m3's bound at several scales, leave a bfloat16 cache's values untouched, and run the engine
with ``kv_cache_dtype="fp8"``: the bundled model's teacher-forced next tokens must stay those
of the bf16 cache at almost every position.

Your ``block_fp8_matmul`` kernel (exercises/minivllm/kernels/fp8_matmul.py) runs in Triton's
interpreter against the same product dequantized to float32: shapes that are not multiples
of the tiles or the scale blocks (a row tile, a column tile and a K step cut at the edge),
one row and many, 16 x 16 scale blocks whose scales differ by six orders of magnitude from
block to block (a scale read from the wrong block or the wrong K group shows at once), and a
bias.
"""
import os
import sys


def _interpret_triton() -> None:
    """Run every Triton kernel in the interpreter from here on (see chapter 09's tests)."""
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

from minivllm.kernels.fp8_matmul import block_fp8_matmul  # noqa: E402
from minivllm.ops.attention import dequantize_kv, quantize_kv  # noqa: E402
from minivllm.ops.quant import FP8_MAX, quantize_blocks, quantize_per_group, quantize_per_row  # noqa: E402

E4M3 = torch.float8_e4m3fn


def rows_of_many_magnitudes(rows: int, cols: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** (torch.rand(rows, 1, generator=g) * 12 - 6)  # 1e-6 .. 1e6 a row
    return (torch.randn(rows, cols, generator=g) * magnitudes).to(dtype)


def within_e4m3_rounding(x: torch.Tensor, back: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Is each value of ``back`` within half an e4m3 step of ``x`` (plus float32 slack)?"""
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-5) + 1e-30
    return (back - x).abs() <= bound


# -- quantize_per_row -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_lands_on_448_and_rounds_within_e4m3s_bound(dtype):
    x = rows_of_many_magnitudes(64, 200, seed=1, dtype=dtype)
    q, scale = quantize_per_row(x)
    assert q.dtype == E4M3, f"the values must be stored as float8_e4m3fn, got {q.dtype}"
    assert scale.dtype == torch.float32 and scale.shape == (64, 1), \
        f"one float32 scale per row, shape [rows, 1]; got {scale.dtype} {tuple(scale.shape)}"
    x32 = x.float()
    amax = x32.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(scale, amax / FP8_MAX, rtol=1e-6, atol=0,
                               msg="the scale must put each row's largest magnitude on 448 (amax / 448)")
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), FP8_MAX)), \
        "each row's largest magnitude must be stored as 448 exactly"
    back = q.float() * scale
    assert not back.isnan().any(), "a value became NaN: saturate before the cast"
    ok = within_e4m3_rounding(x32, back, scale)
    assert ok.all(), f"{int((~ok).sum())} values came back further than half an e4m3 step"


def test_a_row_of_zeros_stays_zero_with_a_finite_scale():
    x = torch.randn(3, 32)
    x[1] = 0
    q, scale = quantize_per_row(x)
    assert torch.isfinite(scale).all() and (scale > 0).all(), f"every scale finite and positive, got {scale.ravel()}"
    assert not q.float().isnan().any() and (q[1].float() == 0).all(), "a row of zeros must be stored as zeros"


def test_values_rounding_past_the_range_saturate():
    # 447.9 / (amax / 448) can round to a float32 just past 448; a cast there is NaN.
    x = torch.tensor([[447.99, -447.99, 448.0, 1.0], [1e30, -1e30, 3.0, 0.5]])
    q, scale = quantize_per_row(x)
    assert not q.float().isnan().any(), "a value past e4m3's range became NaN: clamp to +-448 before the cast"


# -- quantize_kv / dequantize_kv --------------------------------------------------------------


def test_a_bf16_cache_stores_and_reads_values_as_they_are():
    """Whatever the scale: only a float8 cache has any use for one."""
    x = torch.randn(5, 2, 16, dtype=torch.bfloat16) * 1000
    scale = torch.tensor(2.0)
    stored = quantize_kv(x, torch.bfloat16, scale)
    assert stored.dtype == torch.bfloat16 and torch.equal(stored, x), "a bf16 cache stores its input unchanged"
    read = dequantize_kv(x, torch.bfloat16, scale)
    assert read.dtype == torch.bfloat16 and torch.equal(read, x), "a bf16 cache's values are read unchanged"


@pytest.mark.parametrize("scale", [1.0, 0.05, 8.0])
def test_fp8_keys_round_trip_within_e4m3s_bound(scale):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(40, 2, 64, generator=g) * 10.0 ** (torch.rand(40, 1, 1, generator=g) * 4 - 2)).to(torch.bfloat16)
    s = torch.tensor(scale)
    q = quantize_kv(x, E4M3, s)
    assert q.dtype == E4M3, f"a float8 cache holds float8_e4m3fn values, got {q.dtype}"
    expected = (x.float() * (1.0 / s)).clamp(-FP8_MAX, FP8_MAX)
    ok = within_e4m3_rounding(expected, q.float(), torch.tensor(1.0))
    assert ok.all(), f"{int((~ok).sum())} stored values are not x / scale rounded to e4m3"
    for dtype in (torch.float32, torch.bfloat16):
        back = dequantize_kv(q, dtype, s)
        assert back.dtype == dtype, f"read back in the dtype asked for ({dtype}), got {back.dtype}"
        torch.testing.assert_close(back, (q.float() * s).to(dtype), rtol=2 ** -8 if dtype == torch.bfloat16 else 1e-6,
                                   atol=0, msg="read back as stored value times the scale")


def test_keys_past_the_range_saturate_at_448():
    x = torch.tensor([[1000.0, -1000.0, 460.0, 100.0, 1e6]])
    q = quantize_kv(x, E4M3, torch.tensor(1.0)).float()
    assert not q.isnan().any(), f"a key past e4m3's range became NaN: {q.tolist()}"
    assert q.tolist() == [[448.0, -448.0, 448.0, 96.0, 448.0]], f"saturate at +-448 and round to e4m3: {q.tolist()}"
    q = quantize_kv(x, E4M3, torch.tensor(4.0)).float()
    assert q.tolist() == [[256.0, -256.0, 112.0, 24.0, 448.0]], \
        f"divide by the scale, then saturate and round: {q.tolist()}"


def test_the_engine_on_an_fp8_cache_keeps_its_next_tokens():
    """The bundled model, teacher-forced on a passage: the most likely next token at each
    position with the fp8 cache against the bf16 cache."""
    from minivllm import LLM, SamplingParams

    text = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
            "must be in want of a wife. However little known the feelings or views of such a man may be "
            "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
            "surrounding families, that he is considered the rightful property of some one or other of "
            "their daughters.")
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    tops = {}
    for kv in ("auto", "fp8"):
        llm = LLM(dtype="bfloat16", num_kv_blocks=64, kv_cache_dtype=kv)
        ids = llm.get_tokenizer().encode(text)
        [out] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        tops[kv] = [next(t for t, lp in entry.items() if lp.rank == 1) for entry in out.prompt_logprobs[1:]]
        if kv == "fp8":
            cache = llm.engine.runner.kv_cache
            assert cache.dtype == E4M3, f"kv_cache_dtype='fp8' must give a float8_e4m3fn pool, got {cache.dtype}"
    agree = sum(a == b for a, b in zip(tops["auto"], tops["fp8"])) / len(tops["auto"])
    assert agree >= 0.9, f"the fp8 cache changed the model's next token at {1 - agree:.0%} of the positions"


# -- block_fp8_matmul -------------------------------------------------------------------------


def reference(a_q, a_s, w_q, w_s, block, bias=None):
    """(a_q * a_s) @ (w_q * w_s)^T in float32, each scale repeated over its block."""
    bn, bk = block
    m, k = a_q.shape
    n = w_q.shape[0]
    a = a_q.float() * a_s.repeat_interleave(bk, 1)[:, :k]
    w = w_q.float() * w_s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    y = a @ w.t()
    return y if bias is None else y + bias.float()


def with_junk_past_k(x: torch.Tensor, pad: int = 64) -> torch.Tensor:
    """x [rows, K] as the first K columns of a wider matrix whose other columns hold 448."""
    wide = torch.full((x.shape[0], x.shape[1] + pad), 448.0).to(x.dtype)
    wide[:, : x.shape[1]] = x
    return wide[:, : x.shape[1]]


@pytest.mark.parametrize("m, n, k, block", [
    (1, 256, 256, (128, 128)),  # one row (a decode step)
    (5, 200, 384, (128, 128)),  # a column tile cut at the edge
    (70, 130, 200, (128, 128)),  # rows, columns and the last K step all cut
    (20, 144, 96, (16, 16)),  # many scale blocks inside one tile
])
def test_block_scaled_product_matches_the_dequantized_one(m, n, k, block):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    a = torch.randn(m, k, generator=g)
    # Blocks of the weight six orders of magnitude apart: a scale from the wrong block shows.
    rows, cols = -(-n // block[0]), -(-k // block[1])
    spread = 10.0 ** (torch.randint(-3, 4, (rows, cols), generator=g).float())
    w = torch.randn(n, k, generator=g) * spread.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    a_q, a_s = quantize_per_group(a, block[1])
    w_q, w_s = quantize_blocks(w, block)
    want = reference(a_q, a_s, w_q, w_s, block)
    # Each row followed by junk past its K columns (the kernel reads rows by their stride): a
    # load past the last K step that is not masked brings it into the sums.
    a_q, w_q = with_junk_past_k(a_q), with_junk_past_k(w_q)
    got = block_fp8_matmul(a_q, a_s, w_q, w_s, block, out_dtype=torch.float32)
    assert got.shape == (m, n)
    assert not got.isnan().any(), "NaN in the output: a load past an edge read garbage, or a tile was never stored"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3 * want.abs().max().item(),
                               msg="the block-scaled product differs from (a_q * a_s) @ (w_q * w_s)^T")


def test_block_scaled_product_adds_the_bias_and_stores_the_outputs_dtype():
    g = torch.Generator().manual_seed(7)
    a, w, bias = torch.randn(9, 160, generator=g), torch.randn(48, 160, generator=g), torch.randn(48, generator=g)
    a_q, a_s = quantize_per_group(a, 32)
    w_q, w_s = quantize_blocks(w, (16, 32))
    got = block_fp8_matmul(a_q, a_s, w_q, w_s, (16, 32), bias=bias, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(a_q, a_s, w_q, w_s, (16, 32), bias), rtol=2 ** -7, atol=2e-2,
                               msg="y = (a_q * a_s) @ (w_q * w_s)^T + bias, stored in the output's dtype")
