"""FP8 weights (chapter 20): the per-channel and block scales, the W8A8 linear layer against
its float32 dequantized reference, the block-scaled Triton matmul against its torch
reference, the decode gemv reading e4m3 weights, and whole engines: a tiny fp8 checkpoint
(written by ``testing.make_fp8_checkpoint`` in the hub's layout) against the same weights
dequantized to float32, and ``quantization="fp8"`` on a float32 checkpoint against the
unquantized engine.

Quantizing to e4m3 rounds each value to 3 mantissa bits (relative error up to 2^-4); the
products here sum dozens to thousands of such errors of both signs, so the quantized layer
is compared with its own dequantized reference to float32 rounding, and with the exact
float32 product within a few percent of the output's scale. Engines are compared by
teacher-forced top-1 agreement (the rank of the reference's next token), since a near-tie
that the quantization flips sends two greedy runs apart from there on.
"""
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig, fp8_quantization_config
from minivllm.layers.linear import GateUpLinear, Linear, RowParallelLinear
from minivllm.layers.quantization import Fp8BlockLinearMethod, Fp8LinearMethod, set_linear_methods
from minivllm.ops.quant import (FP8_DTYPE, FP8_MAX, dequantize_blocks, dequantize_per_row,
                                fp8_block_linear_reference, fp8_linear_reference, quantize_blocks,
                                quantize_per_group, quantize_per_row)
from minivllm.testing import dequantize_fp8_checkpoint, make_fp8_checkpoint, make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
CUDA = torch.cuda.is_available()
# The Triton kernels run on the GPU where there is one, in the interpreter on a CPU (conftest).
DEVICE = "cuda" if CUDA else "cpu"


def test_quantize_per_row_scales_saturates_and_survives_a_zero_row():
    x = torch.randn(6, 100) * torch.tensor([1e-3, 1.0, 10.0, 1e3, 0.0, 1.0])[:, None]
    x[5, 7] = 5e4  # one outlier: its row's other values lose precision, no other row does
    q, scale = quantize_per_row(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (6, 1)
    assert torch.isfinite(scale).all() and (scale > 0).all()  # the zero row's scale too
    assert not q.float().isnan().any()
    assert q.float().abs().amax(dim=1)[[0, 1, 2, 3, 5]].eq(FP8_MAX).all()  # each row's amax lands on 448
    deq = dequantize_per_row(q, scale)
    assert deq[4].eq(0).all()
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 for normal values.
    normal = x.abs() >= scale * 2.0**-6
    assert ((deq - x).abs() <= 2.0**-4 * x.abs() + 1e-12)[normal].all()


def test_quantize_blocks_and_groups_have_one_scale_per_block():
    w = torch.randn(200, 300)
    q, scale = quantize_blocks(w, (128, 128))
    assert q.shape == (200, 300) and scale.shape == (2, 3)  # ceil(200 / 128), ceil(300 / 128)
    # 2^-4 relative, and e4m3's subnormal step (2^-9 of the scale) near zero.
    torch.testing.assert_close(dequantize_blocks(q, scale, (128, 128)), w, atol=scale.max().item() * 2.0**-9,
                               rtol=2.0**-4)
    assert scale[1, 2] == w[128:, 256:].abs().max() / FP8_MAX  # the corner block's own amax
    x = torch.randn(5, 300)
    xq, xs = quantize_per_group(x, 128)
    assert xs.shape == (5, 3)
    torch.testing.assert_close(dequantize_blocks(xq, xs, (1, 128)), x, atol=xs.max().item() * 2.0**-9, rtol=2.0**-4)


def representable(m: int, k: int, group: int) -> torch.Tensor:
    """[m, k] bf16 values that are e4m3 values times a power of two per row, each group's
    amax exactly 448 times it (and one group all zeros): quantizing them rounds nothing."""
    q = torch.randn(m, k).mul(50).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    q[:, ::group] = FP8_MAX
    q[-1, :group] = 0.0
    return (q * torch.tensor([2.0**i for i in range(-3, m - 3)])[:, None]).to(torch.bfloat16)


@pytest.mark.parametrize("m,k,group", [(3, 300, 128), (5, 300, 300), (2, 2500, 2500), (4, 70, 16)])
def test_quantize_groups_kernel_matches_its_spec(m, k, group, poisoned_empty):
    """The activations' quantization kernel (scales, saturation, groups cut at the row's end,
    a zero group) against ops.quant.quantize_per_group, on values it quantizes exactly: the
    Triton interpreter rounds float32 to e4m3 wrongly where rounding carries into the
    exponent (124.3 -> 64, not 128), so rounding itself is checked on the GPU."""
    from minivllm.kernels.fp8_matmul import quantize_groups
    from minivllm.ops.quant import MIN_SCALE

    x = representable(m, k, group).to(DEVICE)
    q, scale = quantize_groups(x, group, FP8_MAX, MIN_SCALE)
    q_ref, scale_ref = quantize_per_group(x, group)
    assert torch.equal(scale, scale_ref) and scale.shape == (m, -(-k // group))
    assert torch.equal(q.float(), q_ref.float())


def loaded_layer(layer: Linear, weight: torch.Tensor, method, shards=None) -> Linear:
    """``layer`` with ``method``, its weight loaded (whole, or by shards) and processed."""
    set_linear_methods([layer], method)
    for shard_id, rows in (shards or {None: slice(None)}).items():
        layer.weight.weight_loader(layer.weight, weight[rows].to(layer.weight.dtype), shard_id)
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_fp8_linear_matches_its_dequantized_reference(rows):
    n, k = 96, 80
    w, b = torch.randn(2 * n, k) / k**0.5, torch.randn(n)
    layer = loaded_layer(GateUpLinear(k, n), w, Fp8LinearMethod(), {0: slice(0, n), 1: slice(n, 2 * n)})
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (2 * n, 1)
    x = torch.randn(rows, k)
    out = layer(x)
    # The oracle, from scratch: activations per token, weights per row, both dequantized.
    x_q, x_s = quantize_per_row(x)
    w_q, w_s = quantize_per_row(w)
    ref = (x_q.float() * x_s) @ (w_q.float() * w_s).t()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    exact = x @ w.t()
    assert (out - exact).abs().max() <= 0.05 * exact.abs().max()
    # The fused gate/up-and-SiLU entry gives what the two steps give.
    torch.testing.assert_close(layer.forward_gated(x, "silu"), torch.nn.functional.silu(out[:, :n]) * out[:, n:])
    # With a bias, through the row-parallel layer (one rank).
    down = loaded_layer(RowParallelLinear(k, n, bias=True), w[:n], Fp8LinearMethod())
    down.bias.data.copy_(b)
    torch.testing.assert_close(down(x), fp8_linear_reference(x, w_q[:n], w_s[:n], b), atol=1e-5, rtol=1e-5)


def test_scaled_mm_takes_our_scale_shapes():
    """torch._scaled_mm (the GPU path) with row-wise scales: x's [M, 1], the weight's [1, N],
    computes the same product as the reference (on this CPU torch too)."""
    x, w = torch.randn(8, 64, dtype=torch.bfloat16, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    x_q, x_s = quantize_per_row(x)
    w_q, w_s = quantize_per_row(w)
    out = torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s.t(), out_dtype=torch.bfloat16)
    torch.testing.assert_close(out, fp8_linear_reference(x, w_q, w_s), atol=2e-2, rtol=2e-2)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty filled with NaN: a kernel output element left unwritten shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() and t.element_size() > 1 else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("m,n,k,block", [(5, 200, 300, (128, 128)), (33, 64, 48, (16, 16)), (2, 50, 70, (16, 32))])
@pytest.mark.parametrize("with_bias", [False, True])
def test_block_fp8_matmul_matches_its_torch_reference(m, n, k, block, with_bias, poisoned_empty):
    from minivllm.kernels.fp8_matmul import block_fp8_matmul

    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
    w_q, w_s = quantize_blocks(torch.randn(n, k, device=DEVICE) / k**0.5, block)
    bias = torch.randn(n, dtype=torch.bfloat16, device=DEVICE) if with_bias else None
    x_q, x_s = quantize_per_group(x, block[1])
    out = block_fp8_matmul(x_q, x_s, w_q, w_s, block, bias, out_dtype=torch.bfloat16)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16 and not out.isnan().any()
    ref = fp8_block_linear_reference(x.float(), w_q, w_s, block, bias)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)  # the output's bf16 rounding


def test_block_fp8_matmul_refuses_what_it_cannot_tile():
    from minivllm.kernels.fp8_matmul import block_fp8_matmul

    a_q, a_s = quantize_per_group(torch.randn(4, 96, device=DEVICE), 48)
    w_q, w_s = quantize_blocks(torch.randn(32, 96, device=DEVICE), (16, 48))
    with pytest.raises(ValueError, match="power of two"):
        block_fp8_matmul(a_q, a_s, w_q, w_s, (16, 48))
    with pytest.raises(ValueError, match="do not agree"):
        block_fp8_matmul(a_q, a_s, w_q, w_s[:1], (16, 48))


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_gemv_reads_fp8_weights(rows):
    """The decode gemv with an e4m3 weight and its row scales (W8A16), plain and ending in
    SwiGLU, against the dequantized weight times the unquantized activations."""
    from minivllm.kernels.gemv import gemv, gemv_silu_and_mul

    n, k = 70, 300
    dtype = torch.bfloat16 if CUDA else torch.float32
    w_q, w_s = quantize_per_row(torch.randn(2 * n, k, device=DEVICE) / k**0.5)
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    w = dequantize_per_row(w_q, w_s)
    ref = x.float() @ w.t()
    torch.testing.assert_close(gemv(x, w_q, weight_scale=w_s).float(), ref, atol=2e-2, rtol=2e-2)
    gated = gemv_silu_and_mul(x, w_q, weight_scale=w_s).float()
    torch.testing.assert_close(gated, torch.nn.functional.silu(ref[:, :n]) * ref[:, n:], atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="weight_scale"):
        gemv(x, w_q)


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    """A tiny Qwen3 checkpoint (float32), the same in fp8 as the hub publishes it, and the
    fp8 one dequantized back to float32."""
    folder = tmp_path_factory.mktemp("fp8")
    source = make_tiny_checkpoint(folder / "source", family="qwen3", seed=0, with_tokenizer=True)
    fp8 = make_fp8_checkpoint(source, folder / "fp8")
    return source, fp8, dequantize_fp8_checkpoint(fp8, folder / "dequantized", dtype=torch.float32)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 200, 300, 400], [42] * 6]


def top1_agreement(llm: LLM, reference: LLM, tokens: int = 24) -> float:
    """Teacher-forced: the share of the reference's greedy tokens that ``llm`` ranks first
    when it reads the reference's own text."""
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    runs = reference.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    texts = [list(r.prompt_token_ids) + list(r.outputs[0].token_ids) for r in runs]
    scored = llm.generate([{"prompt_token_ids": t} for t in texts],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    ranks = [out.prompt_logprobs[p][ids[p]].rank for out, ids, prompt in zip(scored, texts, PROMPTS)
             for p in range(len(prompt), len(ids))]
    return sum(rank == 1 for rank in ranks) / len(ranks)


def test_tiny_fp8_checkpoint_loads_as_published(fp8_checkpoints):
    _, fp8, dequantized = fp8_checkpoints
    llm = LLM(model=str(fp8), num_kv_blocks=64, block_size=8)
    params = dict(llm.engine.runner.model.named_parameters())
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert params[f"{qkv}.weight"].dtype == FP8_DTYPE
    assert params[f"{qkv}.weight_scale_inv"].shape == (128 // 16, 64 // 16)  # (q + k + v rows, hidden) / 16
    # The embedding is not quantized: it keeps the engine's dtype (float32 on a CPU, bf16 on a GPU).
    assert params["model.embed_tokens.weight"].dtype == llm.engine.config.dtype
    assert isinstance(llm.engine.runner.model.model.layers[0].mlp.down_proj.quant_method, Fp8BlockLinearMethod)
    # The keyword changes nothing for a checkpoint already in fp8.
    same = LLM(model=str(fp8), num_kv_blocks=64, block_size=8, quantization="fp8")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in same.generate(prompts, greedy, use_tqdm=False)])
    # Against the same weights dequantized: only the activations' per-token-group rounding differs.
    reference = LLM(model=str(dequantized), num_kv_blocks=64, block_size=8)
    assert top1_agreement(llm, reference) >= 0.95


def test_quantization_fp8_runs_end_to_end(fp8_checkpoints):
    source, _, _ = fp8_checkpoints
    llm = LLM(model=str(source), num_kv_blocks=64, block_size=8, quantization="fp8")
    model = llm.engine.runner.model
    layer = model.model.layers[1].self_attn.qkv_proj
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (layer.output_size, 1)
    assert all(p.dtype != FP8_DTYPE for n, p in model.named_parameters() if "norm" in n or "embed" in n)
    assert llm.generate("The quick brown fox", SamplingParams(max_tokens=8, temperature=0)
                        )[0].outputs[0].text is not None
    reference = LLM(model=str(source), num_kv_blocks=64, block_size=8)
    assert top1_agreement(llm, reference) >= 0.9


def test_quantization_fp8_leaves_gated_deltanet_layers_in_bf16(tmp_path):
    """A hybrid's linear-attention projections keep the model's dtype (their input projection
    carries most of fp8's error there); its attention and feed-forward go to fp8."""
    path = make_tiny_checkpoint(tmp_path / "hybrid", family="qwen3_5", seed=3)
    model = LLM(model=str(path), num_kv_blocks=32, quantization="fp8").engine.runner.model
    dtypes = {name: module.weight.dtype for name, module in model.named_modules() if isinstance(module, Linear)}
    hybrid = [n for n in dtypes if ".linear_attn." in n]
    assert hybrid and all(dtypes[n] != FP8_DTYPE for n in hybrid), {n: dtypes[n] for n in hybrid}
    for kind in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        named = [n for n in dtypes if n.endswith(kind)]
        assert named and all(dtypes[n] == FP8_DTYPE for n in named), (kind, {n: dtypes[n] for n in named})


def _fp8_logits(paths, ids):
    from minivllm.context import reset_context
    from minivllm.loader import load_model

    out = {}
    for name, path in paths.items():
        model = load_model(path)
        reset_context()
        with torch.inference_mode():
            out[name] = model.compute_logits(model(ids, torch.arange(len(ids))), all_tokens=True)
    return out


def test_fp8_checkpoint_under_tensor_parallelism(fp8_checkpoints, tmp_path):
    """Two ranks each load their blocks of the weights and of the scales (q, k, v and gate,
    up by rows, o and down by columns) and give one process's logits: the block split is the
    activations' group split, so both quantize the same numbers."""
    from minivllm.distributed.launch import run_on_ranks
    from minivllm.testing import torch_threads

    _, fp8, _ = fp8_checkpoints
    one_kv_head = make_fp8_checkpoint(make_tiny_checkpoint(tmp_path / "source", family="qwen3", seed=3,
                                                           num_key_value_heads=1), tmp_path / "fp8")
    paths = {"fp8": fp8, "one-kv-head": one_kv_head}  # KV heads split, or one replicated
    ids = torch.randint(0, 512, (21,))
    with torch_threads(1):
        reference = _fp8_logits(paths, ids)
    for per_rank in run_on_ranks(_fp8_logits, 2, paths, ids, num_threads=1):
        for name, logits in per_rank.items():
            torch.testing.assert_close(logits, reference[name], atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("bad", ["int4", "awq", "FP8"])
def test_a_bad_quantization_is_refused_by_name(bad, tiny_qwen3):
    with pytest.raises(ValueError, match="quantization="):
        EngineConfig(model=str(tiny_qwen3), quantization=bad)
    with pytest.raises(ValueError, match="quantization"):
        LLM(model=str(tiny_qwen3), num_kv_blocks=16, quantization=bad)


def test_a_checkpoints_quantization_config_is_checked():
    block = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    assert fp8_quantization_config(block)["weight_block_size"] == [128, 128]
    with pytest.raises(ValueError, match="quant_method='awq'"):
        fp8_quantization_config({**block, "quant_method": "awq"})
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8_quantization_config({**block, "weight_block_size": None})
    with pytest.raises(ValueError, match="activation_scheme='static'"):
        fp8_quantization_config({**block, "activation_scheme": "static"})


@pytest.mark.gpu
def test_scaled_mm_at_real_shapes():
    """The FP8 tensor-core path at Qwen3-0.6B's shapes (a prefill's 512 tokens) against the
    float32 reference, and a width _scaled_mm cannot take falling back to the reference."""
    from minivllm.ops.quant import fp8_linear, scaled_mm_fits

    for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]:
        x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
        w_q, w_s = quantize_per_row(torch.randn(n, k, device="cuda") / k**0.5)
        assert scaled_mm_fits(x, w_q)
        out = fp8_linear(x, w_q, w_s)
        torch.testing.assert_close(out.float(), fp8_linear_reference(x.float(), w_q, w_s), atol=3e-2, rtol=2e-2)
    x = torch.randn(64, 72, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = quantize_per_row(torch.randn(40, 72, device="cuda"))
    assert not scaled_mm_fits(x, w_q[:-1])
    torch.testing.assert_close(fp8_linear(x, w_q[:-1], w_s[:-1]), fp8_linear_reference(x, w_q[:-1], w_s[:-1]))


@pytest.mark.gpu
def test_quantize_activations_on_the_gpu_rounds_as_the_spec():
    """The Triton kernel against the torch spec on random bf16 activations: the same scales,
    and each value within one e4m3 step (the kernel's float32 division may round a value on
    a rounding boundary the other way)."""
    from minivllm.ops.quant import quantize_activations

    for m, k, group in [(512, 1024, None), (300, 3072, 128), (7, 1000, 128)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * torch.rand(m, 1, device="cuda") * 10
        q, scale = quantize_activations(x, group)
        q_ref, scale_ref = quantize_per_row(x) if group is None else quantize_per_group(x, group)
        torch.testing.assert_close(scale, scale_ref, atol=0, rtol=1e-6)
        torch.testing.assert_close(q.float(), q_ref.float(), atol=2.0**-9, rtol=2.0**-3)


@pytest.mark.gpu
def test_block_fp8_matmul_at_real_shapes():
    """The block-scaled kernel through its op (the activations quantized on the GPU too)."""
    from minivllm.ops.quant import fp8_block_linear

    for m, n, k in [(1, 4096, 1024), (16, 6144, 1024), (512, 1024, 3072), (300, 1000, 1000)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w_q, w_s = quantize_blocks(torch.randn(n, k, device="cuda") / k**0.5, (128, 128))
        out = fp8_block_linear(x, w_q, w_s, (128, 128))
        ref = fp8_block_linear_reference(x.float(), w_q, w_s, (128, 128))
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
def test_fp8_gemv_reads_half_the_bytes_faster():
    """Batch-1 decode's matrix-vector product is bound by reading W: e4m3 weights (one byte)
    must take clearly less time than bf16 (two) on a matrix far larger than the L2."""
    from minivllm.bench.roofline import time_cuda_graph
    from minivllm.kernels.gemv import gemv

    n, k = 16384, 4096  # 128 MiB in bf16
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    w_q, w_s = quantize_per_row(w)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    bf16 = time_cuda_graph(lambda: gemv(x, w))
    fp8 = time_cuda_graph(lambda: gemv(x, w_q, weight_scale=w_s))
    assert fp8 < 0.75 * bf16, (fp8, bf16)
