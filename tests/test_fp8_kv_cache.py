"""The float8 KV cache (chapter 20): the store, every attention kernel that reads it, the
scales, and the engine on an fp8 cache.

The kernels are checked against the torch reference on the *same* fp8 cache: both store the
step's keys and values (rounded to e4m3 after dividing by the layer's scale) and then attend
over what the cache holds, so on the CPU they agree to float32 rounding. Triton's interpreter
rounds float32 -> float8 half away from zero and drops the carry when the rounding overflows
the mantissa (124 -> 64); the GPU rounds to nearest even, as torch does. The fixture
``interpreter_rounds_like_torch`` gives the interpreter torch's conversion, so that the
comparison tests the kernels, not the interpreter. The engine tests of tiny CPU-sized pools
run on the CPU wherever the suite runs (a GPU sizes its pool from free memory, which an
earlier engine of the same test still holds); ``test_gpu_engine_fp8_cache`` is the GPU's.
"""
import numpy as np
import pytest
import torch

from minivllm.config import EngineConfig
from minivllm.context import Context
from minivllm.ops.attention import (FP8_MAX, dequantize_kv, quantize_kv, store_kvcache, value_cache_view,
                                    varlen_attention_reference)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
FP8 = torch.float8_e4m3fn
# Same fp8 cache on both sides: float32 rounding on the CPU; on a GPU the kernels attend in
# bf16 against a float32 reference, as tests/test_kernels.py's bounds.
TOL = dict(atol=2e-2, rtol=2e-2) if CUDA else dict(atol=1e-4, rtol=1e-4)
# (heads, kv_heads, head_dim, block_size): Qwen3-0.6B's on a GPU; GQA groups of 2 and 6 here.
SHAPES = [(16, 8, 128, 16), (32, 4, 64, 16)] if CUDA else [(4, 2, 16, 4), (6, 1, 32, 8)]
# Keys ~ 3 N(0, 1), values ~ N(0, 1): the largest few percent of either (past 3 sigma and 2.2
# sigma) saturate at 448, as with a scale set too small; the rest span e4m3's range.
K_SCALE, V_SCALE = 0.02, 0.005


@pytest.fixture(autouse=True)
def interpreter_rounds_like_torch(monkeypatch):
    if CUDA:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def to_fp8_like_torch(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype == tl.float32:
            rounded = torch.from_numpy(np.ascontiguousarray(input)).to(FP8).view(torch.uint8).numpy()
            return rounded.reshape(input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", to_fp8_like_torch)


def scales():
    return (torch.tensor(K_SCALE, device=DEVICE), torch.tensor(V_SCALE, device=DEVICE))


def random_fp8_cache(lens, kv_heads, head_dim, block_size, spare=3):
    """A float8 K/V pool of random contents (keys ~ 3 sigma, values ~ 1), and block tables
    that scatter each sequence."""
    blocks = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(blocks) + spare
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_scale, v_scale = scales()
    k_cache = quantize_kv(3 * torch.randn(shape, device=DEVICE), FP8, k_scale)
    v_cache = value_cache_view(torch.empty(shape, device=DEVICE, dtype=FP8))  # its values' layout
    v_cache.copy_(quantize_kv(torch.randn(shape, device=DEVICE), FP8, v_scale))
    perm = torch.randperm(num_blocks).tolist()
    tables, i = [], 0
    for b in blocks:
        tables.append(perm[i : i + b] + [-1] * (max(blocks) - b))
        i += b
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=DEVICE)


def step_slots(tables, lens, q_lens, block_size):
    """The slots of each sequence's last q_lens positions (the step's own keys)."""
    slots = []
    for table, n, m in zip(tables.tolist(), lens, q_lens):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n - m, n)]
    return torch.tensor(slots, device=DEVICE)


def reference(q, k, v, k_cache, v_cache, tables, lens, q_lens, slots, scale, window):
    """The torch reference on its own copy of the cache: stores the step, then attends."""
    cu = torch.tensor([0] + q_lens).cumsum(0).to(device=DEVICE, dtype=torch.int32)
    ctx = Context(is_prefill=max(q_lens) > 1, cu_seqlens_q=cu, slot_mapping=slots, block_tables=tables,
                  context_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE))
    out = varlen_attention_reference(q.float(), k.float(), v.float(), k_cache, v_cache, ctx, scale, window, *scales())
    return out, k_cache, v_cache


def check_against_reference(kernel, heads, kv_heads, head_dim, block_size, lens, q_lens, window, seed=0):
    """Run ``kernel(q, k, v, k_cache, v_cache, tables, lens, cu, slots, scale)`` on a fresh
    fp8 cache and the reference on a copy: the same output (the kernel's poisoned with NaN
    first where it writes into a given one), and the same cache afterwards, the step's keys
    and values stored bit for bit."""
    torch.manual_seed(seed)
    k_cache, v_cache, tables = random_fp8_cache(lens, kv_heads, head_dim, block_size)
    tokens = sum(q_lens)
    q = torch.randn(tokens, heads, head_dim, device=DEVICE, dtype=DTYPE)
    k = 3 * torch.randn(tokens, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v = torch.randn(tokens, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    slots = step_slots(tables, lens, q_lens, block_size)
    scale = head_dim**-0.5
    cu = torch.tensor([0] + q_lens).cumsum(0).to(device=DEVICE, dtype=torch.int32)
    want, k_want, v_want = reference(q, k, v, k_cache.clone(), v_cache.clone(), tables, lens, q_lens, slots, scale,
                                     window)
    got = kernel(q, k, v, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE), cu, slots,
                 scale, window)
    assert not got.isnan().any(), "query rows left unwritten"
    torch.testing.assert_close(got.float(), want, **TOL)
    if not CUDA:  # the GPU's bf16 k may round differently before the division: compare outputs only
        assert torch.equal(k_cache.view(torch.uint8), k_want.view(torch.uint8)), "keys stored differently"
        assert torch.equal(v_cache.view(torch.uint8), v_want.view(torch.uint8)), "values stored differently"


# -- the store -------------------------------------------------------------------------------


def test_quantize_saturates_scales_and_round_trips():
    scale = torch.tensor(0.5)
    x = torch.tensor([0.0, 1.0, -3.0, 224.0, 225.0, 1e6, -1e6, 0.015625])
    q = quantize_kv(x, FP8, scale)
    assert q.dtype == FP8 and not q.float().isnan().any(), "a large value must saturate, not become NaN"
    assert q.float().tolist()[:7] == [0.0, 2.0, -6.0, 448.0, 448.0, FP8_MAX, -FP8_MAX]
    back = dequantize_kv(q, torch.float32, scale)
    assert back.tolist()[:4] == [0.0, 1.0, -3.0, 224.0]
    # e4m3 keeps 3 mantissa bits: within range, the round trip is off by at most 2^-4 relative.
    y = torch.randn(1000) * 50
    err = (dequantize_kv(quantize_kv(y, FP8, scale), torch.float32, scale) - y).abs()
    assert (err <= y.abs() * 2**-4 + 2**-10).all()
    # Any other cache dtype: stored as is.
    assert quantize_kv(x, torch.float32, None) is x


@pytest.mark.parametrize("triton_kernel", [False, True], ids=["torch", "triton"])
def test_store_kvcache_fp8(triton_kernel):
    """The step's keys and values land at their slots as x / scale in e4m3, saturated at
    448; slot -1 is skipped; every other row of the cache is left as it was."""
    from minivllm.kernels import kv_store

    torch.manual_seed(1)
    kv_heads, head_dim = 2, 16
    k = 3 * torch.randn(6, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 8.96, -8.97])  # past 448 * 0.02: saturate
    v = torch.randn(6, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    k_cache = quantize_kv(torch.randn(4, 4, kv_heads, head_dim, device=DEVICE), FP8, torch.tensor(0.1))
    v_cache = value_cache_view(torch.empty(4, 4, kv_heads, head_dim, device=DEVICE, dtype=FP8))
    v_cache.copy_(quantize_kv(torch.randn(4, 4, kv_heads, head_dim, device=DEVICE), FP8, torch.tensor(0.1)))
    before_k, before_v = k_cache.clone(), v_cache.reshape(-1, kv_heads, head_dim).clone()
    slots = torch.tensor([3, 0, -1, 15, 6, 9], device=DEVICE)
    store = kv_store.store_kvcache if triton_kernel else store_kvcache
    store(k, v, k_cache, v_cache, slots, *scales())
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.reshape(-1, kv_heads, head_dim)
    kept = slots >= 0
    torch.testing.assert_close(flat_k[slots[kept]].float(), quantize_kv(k[kept], FP8, scales()[0]).float(),
                               atol=0, rtol=0 if not CUDA else 2**-3)
    torch.testing.assert_close(flat_v[slots[kept]].float(), quantize_kv(v[kept], FP8, scales()[1]).float(),
                               atol=0, rtol=0 if not CUDA else 2**-3)
    assert flat_k[3, 0, :4].float().tolist() == [448.0, -448.0, 448.0, -448.0]
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots[kept].cpu()] = False
    assert torch.equal(before_k.view(-1, kv_heads, head_dim)[untouched].view(torch.uint8),
                       flat_k[untouched].view(torch.uint8))
    assert torch.equal(before_v[untouched].view(torch.uint8),
                       flat_v[untouched].view(torch.uint8))


def test_store_needs_scales_for_fp8():
    from minivllm.kernels import kv_store

    k = torch.randn(2, 1, 16, device=DEVICE)
    cache = torch.zeros(2, 4, 1, 16, device=DEVICE, dtype=FP8)
    values = value_cache_view(torch.zeros_like(cache))
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        kv_store.store_kvcache(k, k, cache, values, torch.tensor([0, 1], device=DEVICE))


def test_fp8_values_are_stored_key_contiguous():
    """A float8 cache's values lie key-contiguous in memory ([blocks, kv_heads, head_dim,
    block_size]), as the engine's pool gives them and as the Triton store writes them; a
    cache in the keys' layout is refused, naming the layout; a NaN is stored as 0 (the pool
    holds finite values only: the attention reads rows past a sequence's keys unmasked)."""
    from minivllm.kernels import kv_store

    blocks, block_size, kv_heads, head_dim = 3, 4, 2, 8
    memory = torch.zeros(blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=FP8)
    k_cache, v_cache = torch.zeros_like(memory), value_cache_view(memory)
    v = torch.randn(2, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v[0, 1, 3] = float("nan")
    kv_store.store_kvcache(v, v, k_cache, v_cache, torch.tensor([5, 11], device=DEVICE), *scales())
    # slot 5: block 1, row 1; slot 11: block 2, row 3; memory as [blocks, kv_heads, head_dim, block_size].
    raw = memory.view(blocks, kv_heads, head_dim, block_size).float()
    want = quantize_kv(v, FP8, scales()[1]).float().nan_to_num(0.0)
    torch.testing.assert_close(raw[1, :, :, 1], want[0], atol=0, rtol=0 if not CUDA else 2**-3)
    torch.testing.assert_close(raw[2, :, :, 3], want[1], atol=0, rtol=0 if not CUDA else 2**-3)
    assert raw[1, 1, 3, 1].item() == 0.0 and not raw.isnan().any()
    assert raw.count_nonzero() == want.count_nonzero()  # nothing written anywhere else
    with pytest.raises(ValueError, match="v_cache must be .*value_cache_view"):
        kv_store.store_kvcache(v, v, k_cache, memory, torch.tensor([5, 11], device=DEVICE), *scales())


# -- the attention kernels on an fp8 cache -----------------------------------------------------


def decode(q, k, v, k_cache, v_cache, tables, lens, cu, slots, scale, window, num_splits=None):
    from minivllm.kernels.paged_attention import paged_decode_attention

    return paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, int(lens.max()), num_splits=num_splits,
                                  sliding_window=window, k=k, v=v, slot_mapping=slots, k_scale=scales()[0],
                                  v_scale=scales()[1])


def prefill(q, k, v, k_cache, v_cache, tables, lens, cu, slots, scale, window, config=None):
    """The engine's prefill: the Triton store, then the kernel, given the step's k and v."""
    from minivllm.kernels import kv_store
    from minivllm.kernels.paged_attention import paged_prefill_attention

    kv_store.store_kvcache(k, v, k_cache, v_cache, slots, *scales())
    out = torch.full_like(q, float("nan"))
    return paged_prefill_attention(q, k_cache, v_cache, tables, lens, cu, int((cu[1:] - cu[:-1]).max()), scale,
                                   sliding_window=window, config=config, out=out, k=k, v=v, k_scale=scales()[0],
                                   v_scale=scales()[1])


def short_prefill(q, k, v, k_cache, v_cache, tables, lens, cu, slots, scale, window, num_splits=None):
    from minivllm.kernels.paged_attention import paged_short_prefill_attention

    return paged_short_prefill_attention(q, k_cache, v_cache, tables, lens, cu, int((cu[1:] - cu[:-1]).max()), scale,
                                         int(lens.max()), k, v, slots, sliding_window=window, num_splits=num_splits,
                                         k_scale=scales()[0], v_scale=scales()[1])


# Lengths on and off block boundaries (block 4 or 8 here, 16 on the GPU).
DECODE_LENS = [17, 1, 33, 8, 64] if not CUDA else [1000, 1, 129, 16, 4097]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 7 if not CUDA else 100])
def test_decode_kernel_fp8(heads, kv_heads, head_dim, block_size, num_splits, window):
    kernel = lambda *a: decode(*a, num_splits=num_splits)  # noqa: E731
    check_against_reference(kernel, heads, kv_heads, head_dim, block_size, DECODE_LENS, [1] * len(DECODE_LENS),
                            window)


# Fresh prompts, a chunk after a cached prefix, a decode row, lengths on and off tiles and blocks.
PREFILL = ([23, 40, 8, 5, 17], [23, 9, 8, 1, 16]) if not CUDA else ([700, 1030, 64, 5, 257], [700, 30, 64, 1, 200])


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("window", [None, 5 if not CUDA else 100])
def test_prefill_kernel_fp8(heads, kv_heads, head_dim, block_size, window):
    check_against_reference(prefill, heads, kv_heads, head_dim, block_size, *PREFILL, window)


@pytest.mark.parametrize("switches", [dict(NEW_KV=False), dict(FROM_SCRATCH=True), dict(K_T=True, PREFETCH=False)],
                         ids=["gathered", "from-scratch", "k-transposed"])
def test_prefill_kernel_fp8_variants(switches):
    """FROM_SCRATCH reads every key from the step's own k and v, rounded to float8 in
    registers; the gathered variant reads every key from the cache: the same attention."""
    heads, kv_heads, head_dim, block_size = SHAPES[0]
    lens = [23, 8, 17] if not CUDA else [700, 64, 257]
    q_lens = lens if switches.get("FROM_SCRATCH") else [23, 3, 16] if not CUDA else [700, 30, 200]
    kernel = lambda *a: prefill(*a, config=switches)  # noqa: E731
    check_against_reference(kernel, heads, kv_heads, head_dim, block_size, lens, q_lens, None)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 6 if not CUDA else 100])
def test_short_prefill_kernel_fp8(heads, kv_heads, head_dim, block_size, num_splits, window):
    lens, q_lens = ([20, 5, 33, 9], [4, 1, 3, 4]) if not CUDA else ([1000, 5, 129, 4097], [4, 1, 3, 4])
    kernel = lambda *a: short_prefill(*a, num_splits=num_splits)  # noqa: E731
    check_against_reference(kernel, heads, kv_heads, head_dim, block_size, lens, q_lens, window)


@pytest.mark.parametrize("kernel", [decode, prefill, short_prefill], ids=["decode", "prefill", "short-prefill"])
def test_fp8_kernels_with_tiles_inside_one_block(kernel):
    """Blocks at least a key tile long: each tile's values lie in one block and are read by
    their rows (``_load_values``' second way), not a block's run at a time as above."""
    heads, kv_heads, head_dim, _ = SHAPES[0]
    block_size = 128 if not CUDA else 256  # the decode tile: 128 keys either way
    if kernel is decode:
        lens, q_lens = ([200, 1, 129, 8] if not CUDA else [1000, 1, 257, 16]), [1] * 4
    elif kernel is short_prefill:  # at most SHORT_QUERY queries a sequence
        lens, q_lens = ([150, 5, 140] if not CUDA else [1000, 5, 600]), [4, 1, 3]
    else:
        lens, q_lens = ([150, 5, 140], [4, 1, 3]) if not CUDA else ([1000, 5, 600], [4, 1, 300])
    check_against_reference(kernel, heads, kv_heads, head_dim, block_size, lens, q_lens, None)


# Compiles every kernel that reads or writes the cache for sm_90 with a float8 cache and bf16
# queries, the step's keys and values bf16 (read through tensor descriptors by the prefill
# kernel): the interpreter checks the arithmetic, not that the conversions and dots compile
# for Hopper. Run without the interpreter, in a process of its own: the compiler needs no GPU.
FP8_COMPILE_PROBE = """
import json
import triton
from triton.backends.compiler import GPUTarget
from minivllm.kernels.paged_attention import _prefill_kernel, _decode_kernel, prefill_config, decode_config
from minivllm.kernels.kv_store import _store_kv_kernel
target = GPUTarget("cuda", 90, 32)
def build(fn, signature, constexprs, opts):
    # Pointers and strides 16-divisible, as the launcher specialises them on a real cache.
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
             if kind[0] == "*" or name.startswith("stride_") and name != "stride_bt"}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    kernel = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=target, options=opts)
    # Byte-wise loads from shared memory: a float8 tile gathered element by element.
    return kernel.metadata.shared, kernel.asm["ptx"].count("ld.shared.b8")
out = []
head_dim, group = 128, 2
# prefill: the default (NEW_KV: the bf16 step through tensor descriptors), FROM_SCRATCH, all gathered
for extra in ({}, {"FROM_SCRATCH": True}, {"NEW_KV": False, "K_T": True}):
    config = {**prefill_config(head_dim, group, True, None, 2), **extra}
    sig = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "out_ptr": "*bf16",
           "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
           "cu_seqlens_ptr": "*i32", "scale": "fp32"}
    sig.update({n: f"tensordesc<bf16[{config['BLOCK_N']},{head_dim}]>" for n in ("k_new", "v_new")})
    sig.update({n: "i32" for n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs",
                                   "stride_ch", "stride_bt", "window")})
    ce = {"GROUP": group, "BLOCK_G": group, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16, "PRECISION": "tf32",
          **{k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}}
    launch = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    out.append(["prefill", extra, build(_prefill_kernel, sig, ce, launch)])
# decode and short prefill
for decode, direct in ((True, True), (True, False), (False, False)):
    config = decode_config(head_dim, 1)
    sig = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "block_tables_ptr": "*i32",
           "context_lens_ptr": "*i32", "cu_seqlens_ptr": "*i32", "part_out_ptr": "*bf16" if direct else "*fp32",
           "part_lse_ptr": "*fp32", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "slot_ptr": "*i64",
           "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "scale": "fp32"}
    sig.update({n: "i32" for n in ("stride_qt", "stride_qh", "stride_cb", "stride_cs", "stride_ch", "stride_bt",
                                   "stride_pt", "stride_ph", "stride_ps", "stride_lt", "stride_lh", "stride_knt",
                                   "stride_knh", "stride_vnt", "stride_vnh", "window")})
    ce = {"GROUP": group, "BLOCK_G": 16 if decode else group, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16,
          "BLOCK_N": config["BLOCK_N"], "PRECISION": "tf32", "USE_PDL": False, "DIRECT": direct, "NEW_KV": True,
          "DECODE": decode, "BLOCK_Q": 1 if decode else 8, "BLOCK_QK": 16}
    launch = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    out.append(["decode" if decode else "short", direct, build(_decode_kernel, sig, ce, launch)])
sig = {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "slot_ptr": "*i64",
       "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "stride_k": "i32", "stride_v": "i32"}
out.append(["store", None, build(_store_kv_kernel, sig, {"ROW": 1024, "BLOCK": 1024, "HEAD_DIM": 128, "BLOCK_SIZE": 16,
                                                  "USE_PDL": False}, {})])
print(json.dumps(out))
"""


def test_kernels_compile_for_hopper_with_fp8_cache():
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", FP8_COMPILE_PROBE], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert [r[0] for r in results] == ["prefill"] * 3 + ["decode", "decode", "short", "store"]
    assert all(shared <= 232448 for *_, (shared, _) in results), results  # the H200's shared memory per block
    # The split-context kernel takes its key and value tiles into the tensor cores without a
    # byte-wise gather (its values key-contiguous, kv_store.py): at a decode step's rate a
    # gather costs more than the halved bytes save. (A decode step's newest key, one row once
    # a program, takes 8 such loads; the value tiles in the keys' layout took 136.)
    assert all(byte_loads <= 8 for name, _, (_, byte_loads) in results if name in ("decode", "short")), results


def test_bf16_cache_never_reads_the_scales():
    """A cache in the model's dtype ignores the scales: the output is the same with any."""
    from minivllm.kernels.paged_attention import paged_decode_attention

    torch.manual_seed(2)
    k_cache = torch.randn(4, 4, 2, 16, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(2, 4, 16, device=DEVICE, dtype=DTYPE)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([7, 8], dtype=torch.int32, device=DEVICE)
    plain = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 8)
    scaled = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 8, k_scale=torch.tensor(3.0),
                                    v_scale=torch.tensor(5.0))
    assert torch.equal(plain, scaled)


# -- the engine --------------------------------------------------------------------------------


def test_bad_kv_cache_dtype_names_the_parameter():
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'.*'auto', 'fp8', 'fp8_e4m3'"):
        EngineConfig(model="unused", kv_cache_dtype="int4")
    assert EngineConfig(model="unused", kv_cache_dtype="fp8_e4m3").cache_dtype == FP8
    assert EngineConfig(model="unused", dtype=torch.bfloat16).cache_dtype == torch.bfloat16


# Teacher-forced top-1 agreement with the model's own cache dtype (issue 37's measure):
# 95% measured on this 2-layer random model, whose near-ties (random weights, 512 tokens) a
# 2^-4 relative rounding of keys and values flips; bounded at 90%. Free-running greedy text
# would part at the first flip and never meet again, so it is not what is compared.
MIN_AGREEMENT = 0.90


def test_engine_fp8_cache_agrees_with_auto(tiny_qwen3):
    """The tiny random model on an fp8 cache, prompts in chunks of 16 tokens (so later
    chunks read the earlier ones back from the cache), then a few decode steps: the top-1
    token at every prompt position agrees with the float32 cache's on at least 90% of them;
    the pool holds 4x the blocks of a float32 one (2x a bf16 one's) in the same memory."""
    from minivllm import LLM, SamplingParams
    from minivllm.engine.runner_startup import kv_block_bytes

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (40, 57, 33, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    top1, runners = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(model=str(tiny_qwen3), device="cpu", kv_cache_dtype=kv_cache_dtype, block_size=4,
                  cpu_kv_cache_space=0.001,
                  max_num_batched_tokens=16)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
        top1[kv_cache_dtype] = [next(t for t, lp in d.items() if lp.rank == 1)
                                for o in outputs for d in o.prompt_logprobs[1:]]
        runners[kv_cache_dtype] = llm.engine.runner
    auto, fp8 = runners["auto"], runners["fp8"]
    assert fp8.kv_cache.dtype == FP8 and auto.kv_cache.dtype == torch.float32
    assert auto.block_bytes == 4 * fp8.block_bytes and fp8.num_kv_blocks >= 4 * auto.num_kv_blocks
    assert kv_block_bytes(auto.layers, 16, torch.bfloat16) == 2 * kv_block_bytes(auto.layers, 16, FP8)
    same = sum(a == b for a, b in zip(top1["auto"], top1["fp8"], strict=True))
    assert same >= MIN_AGREEMENT * len(top1["auto"]), f"top-1 agreement {same}/{len(top1['auto'])}"


def feature_workload(forks: bool):
    """Prompts sharing a 12-token prefix (prefix-cache hits), ones that repeat themselves
    (n-gram drafts accepted), and with ``forks`` a two-sample request (copy-on-write forks
    of the cache; speculation takes none)."""
    from minivllm import SamplingParams

    g = torch.Generator().manual_seed(3)
    shared = torch.randint(1, 512, (12,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 512, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    prompts += [(torch.randint(1, 512, (u,), generator=g).tolist() * 12)[:m] for u, m in ((3, 20), (5, 41))]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts)
    if forks:
        params[1] = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)
    return prompts, params


FEATURES = {
    "prefix-caching+preemption": dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=32, max_num_seqs=8),
    "ngram-speculation": dict(num_kv_blocks=256, block_size=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_engine_features_keep_working_on_fp8_cache(tiny_qwen3, feature):
    """Prefix caching with preemption (a tight pool), copy-on-write forks, and speculation
    (its verifying steps, its rollback rewriting slots) on an fp8 cache: the greedy tokens of
    a roomy fp8 engine with none of them, and every block back in the pool at the end."""
    from minivllm import LLM

    prompts, params = feature_workload(forks="speculative_config" not in FEATURES[feature])
    plain = LLM(model=str(tiny_qwen3), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=512, block_size=4,
                enable_prefix_caching=False)
    with_feature = LLM(model=str(tiny_qwen3), device="cpu", kv_cache_dtype="fp8", record_trace=True,
                       **FEATURES[feature])
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in with_feature.generate(prompts, params, use_tqdm=False)]
    assert got == want
    engine = with_feature.engine
    if feature.startswith("prefix"):
        assert any(r.preempted for r in engine.trace), "the tight pool never preempted"
    else:
        assert engine.stats["spec_accepted_tokens"] > 0, "no draft was accepted"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_hybrid_model_attention_layers_on_fp8_cache(hybrid_checkpoint):
    """A hybrid model (Qwen3.5: Gated DeltaNet layers and attention layers) keeps its
    recurrent states in the model's dtype and its attention layers' keys and values in fp8."""
    from minivllm import LLM, SamplingParams

    prompts = [[5 + (3 * i + j) % 90 for j in range(9 + 4 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    top1 = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(model=str(hybrid_checkpoint("qwen3_5")), device="cpu", kv_cache_dtype=kv_cache_dtype,
                  num_kv_blocks=64, block_size=4)
        top1[kv_cache_dtype] = [next(t for t, lp in d.items() if lp.rank == 1)
                                for o in llm.generate(prompts, params, use_tqdm=False) for d in o.prompt_logprobs[1:]]
        assert all(layer.k_cache.dtype == (FP8 if kv_cache_dtype == "fp8" else torch.float32)
                   for layer in llm.engine.runner.layers)
    same = sum(a == b for a, b in zip(top1["auto"], top1["fp8"], strict=True))
    assert same >= MIN_AGREEMENT * len(top1["auto"]), f"top-1 agreement {same}/{len(top1['auto'])}"


def test_checkpoint_kv_scales_load(tiny_qwen3, tmp_path):
    """A checkpoint's ``self_attn.k_scale`` / ``v_scale`` land on the layer's buffers,
    float32 whatever the model's dtype; without them the scales stay 1.0."""
    import shutil

    from safetensors.torch import load_file, save_file

    from minivllm.layers.attention import attention_layers
    from minivllm.loader import load_model

    model = load_model(tiny_qwen3, dtype=torch.bfloat16)
    assert all(layer.k_scale.item() == 1.0 and layer.k_scale.dtype == torch.float32 for layer in attention_layers(model))
    folder = tmp_path / "scaled"
    shutil.copytree(tiny_qwen3, folder)
    file = next(folder.glob("*.safetensors"))
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.125])
    save_file(tensors, file, metadata={"format": "pt"})
    layers = attention_layers(load_model(folder, dtype=torch.bfloat16))
    assert (layers[0].k_scale.item(), layers[0].v_scale.item()) == (0.25, 0.125)
    assert layers[0].k_scale.dtype == torch.float32 and layers[1].k_scale.item() == 1.0


@pytest.mark.gpu
def test_gpu_engine_fp8_cache(tmp_path):
    """On the GPU at Qwen3-0.6B's attention shapes (heads 16/8, head_dim 128, block 16), with
    CUDA graphs, asynchronous scheduling, chunked prefill, prefix caching and copy-on-write
    forks: an fp8 cache
    holds twice the blocks of bf16 in the same memory share, and its teacher-forced top-1
    tokens agree with bf16's on at least 90% of the prompt positions."""
    from minivllm import LLM, SamplingParams
    from minivllm.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, seed=6, dtype=torch.bfloat16, hidden_size=256, intermediate_size=768,
                                num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_hidden_layers=4,
                                max_position_embeddings=2048)
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 512, (40,), generator=g).tolist()
    prompts = [shared * (i % 2) + torch.randint(0, 512, (int(n),), generator=g).tolist()
               for i, n in enumerate(torch.randint(2, 300, (16,), generator=g))]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, prompt_logprobs=1)
    top1, blocks, block_bytes = {}, {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(str(path), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, gpu_memory_utilization=0.2,
                  block_size=16, max_num_batched_tokens=512)
        runner = llm.engine.runner
        assert runner.graphs and runner.kv_cache.dtype == (FP8 if kv_cache_dtype == "fp8" else torch.bfloat16)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 32 for o in outputs)
        top1[kv_cache_dtype] = [next(t for t, lp in d.items() if lp.rank == 1)
                                for o in outputs for d in o.prompt_logprobs[1:]]
        blocks[kv_cache_dtype], block_bytes[kv_cache_dtype] = runner.num_kv_blocks, runner.block_bytes
        # Two greedy samples of one prompt: forks of its blocks, copied on write in the device's pool.
        forks = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, n=2, ignore_eos=True),
                             use_tqdm=False)[0].outputs
        assert forks[0].token_ids == forks[1].token_ids
        llm.shutdown()
        del llm, runner
        torch.cuda.empty_cache()
    assert block_bytes["auto"] == 2 * block_bytes["fp8"]
    assert 1.8 < blocks["fp8"] / blocks["auto"] < 2.2, blocks
    same = sum(a == b for a, b in zip(top1["auto"], top1["fp8"], strict=True))
    assert same >= MIN_AGREEMENT * len(top1["auto"]), f"top-1 agreement {same}/{len(top1['auto'])}"
