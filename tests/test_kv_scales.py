"""calculate_kv_scales (chapter 20): an fp8 cache's per-layer scales measured from the first
step that stores keys and values, instead of given by the checkpoint or left at 1.0.

Each attention layer's k_scale becomes the largest |key| of that step over 448 (e4m3's
largest value), and v_scale the same for values; once, before that step's keys are stored;
never from the start-up's passes of dummy tokens; under tensor parallelism the largest over
the ranks. The point of the feature is a model whose keys or values pass 448: with a scale
of 1.0 they saturate, with measured scales they fit.
"""
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.context import get_context
from minivllm.distributed.launch import run_on_ranks
from minivllm.engine.runner_startup import warmup
from minivllm.layers.attention import MIN_KV_SCALE, kv_scale
from minivllm.ops.attention import FP8_MAX
from minivllm.testing import make_tiny_checkpoint, torch_threads

FP8 = dict(kv_cache_dtype="fp8", calculate_kv_scales=True)
# Teacher-forced top-1 agreement with the float32 cache (tests/test_fp8_kv_cache.py's bound
# and why): 94% measured for the tiny models here, bounded at 90%.
MIN_AGREEMENT = 0.90
# The bundled model, a trained one with no near-ties to speak of: 98% measured (54 of 55).
BUNDLED_MIN_AGREEMENT = 0.95


def random_prompts(seed: int, lengths, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def first_stored(llm) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each attention layer's keys and values of the next pass that stores any, recorded
    by a forward pre-hook of our own (the reference the scales are checked against)."""
    seen: list = [None] * len(llm.engine.runner.layers)

    def record(i):
        def hook(layer, args):
            if seen[i] is None and layer.k_cache is not None and get_context().slot_mapping is not None:
                seen[i] = (args[1].detach().clone(), args[2].detach().clone())
        return hook

    for i, layer in enumerate(llm.engine.runner.layers):
        layer.register_forward_pre_hook(record(i))
    return seen


def scales(llm) -> list[tuple[float, float]]:
    return [(layer.k_scale.item(), layer.v_scale.item()) for layer in llm.engine.runner.layers]


def teacher_forced_top1(llm, prompts) -> list[int]:
    """The top-1 token at every prompt position after the first (the prompt is the teacher)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    return [next(t for t, lp in d.items() if lp.rank == 1)
            for o in llm.generate(prompts, params, use_tqdm=False) for d in o.prompt_logprobs[1:]]


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def test_kv_scale_is_the_largest_magnitude_over_448():
    x = torch.tensor([[0.5, -896.0], [3.0, 1.0]])
    assert kv_scale(x).item() == 2.0 and kv_scale(x).dtype == torch.float32
    assert kv_scale(torch.zeros(4, 2)).item() == pytest.approx(MIN_KV_SCALE)  # never 0: the cache divides by it
    assert kv_scale(x.bfloat16()).dtype == torch.float32


def test_scales_come_from_the_first_step_and_stay(tiny_qwen3):
    """Two prompts in the first step (the budget holds both): every layer's scales are the
    largest |key| and |value| that step computed, over 448; the first store already used
    them (the largest key is stored as 448 exactly); later requests, with larger inputs, do
    not move them; the hooks are gone and ``execute`` is the class's method again."""
    llm = LLM(model=str(tiny_qwen3), num_kv_blocks=128, block_size=4, **FP8)
    runner = llm.engine.runner
    assert scales(llm) == [(1.0, 1.0)] * len(runner.layers)
    assert all(layer.kv_scales_hook is not None for layer in runner.layers) and "execute" in vars(runner)
    seen = first_stored(llm)
    runner.kv_cache.zero_()  # torch.empty's bytes: no NaN left where nothing is stored
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate(random_prompts(0, (23, 41)), params, use_tqdm=False)
    for layer, (k, v) in zip(runner.layers, seen, strict=True):
        assert layer.k_scale.item() == pytest.approx(k.abs().max().item() / FP8_MAX, rel=1e-6)
        assert layer.v_scale.item() == pytest.approx(v.abs().max().item() / FP8_MAX, rel=1e-6)
        assert layer.k_cache.float().abs().max().item() == FP8_MAX
        assert layer.v_cache.float().abs().max().item() == FP8_MAX
        assert layer.kv_scales_hook is None
    assert "execute" not in vars(runner)
    measured = scales(llm)
    llm.generate(random_prompts(1, (60, 5, 90)), params, use_tqdm=False)
    assert scales(llm) == measured


def test_passes_without_a_cache_do_not_set_them(tiny_qwen3):
    """A warm-up pass (no cache, dummy tokens, the GPU start-up's first pass) after arming
    leaves the scales at 1.0 and the hooks waiting; the first real step then sets them."""
    llm = LLM(model=str(tiny_qwen3), num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, **FP8)
    runner = llm.engine.runner
    warmup(runner.model, runner.config, runner.device)
    assert scales(llm) == [(1.0, 1.0)] * len(runner.layers)
    assert all(layer.kv_scales_hook is not None for layer in runner.layers)
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert all(k != 1.0 and v != 1.0 for k, v in scales(llm))


def test_top1_agrees_with_the_float32_cache(tiny_qwen3):
    """Prompts in chunks of 16 tokens (later chunks read earlier ones back from the cache):
    the teacher-forced top-1 with measured scales agrees with the float32 cache's."""
    prompts = random_prompts(0, (40, 57, 33, 64))
    top1 = {}
    for name, kwargs in {"auto": {}, "calculated": FP8}.items():
        llm = LLM(model=str(tiny_qwen3), num_kv_blocks=256, block_size=4, max_num_batched_tokens=16, **kwargs)
        top1[name] = teacher_forced_top1(llm, prompts)
    assert agreement(top1["auto"], top1["calculated"]) >= MIN_AGREEMENT


def large_kv_checkpoint(source, path, key_factor: float = 800.0, value_factor: float = 400.0):
    """``source`` (a Llama: no norm on the keys) with k_proj times ``key_factor`` and q_proj
    divided by it, v_proj times ``value_factor`` and o_proj divided by it: the same function
    in exact arithmetic (q.k and the attention output do not change), its keys now reaching
    about 2,000 and its values about 1,000, far past e4m3's 448."""
    shutil.copytree(source, path)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    factors = {"k_proj": key_factor, "q_proj": 1 / key_factor, "v_proj": value_factor, "o_proj": 1 / value_factor}
    for name in tensors:
        for proj, factor in factors.items():
            if name.endswith(f"{proj}.weight"):
                tensors[name] = tensors[name] * factor
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_keys_past_448_saturate_at_scale_one_but_fit_measured(tmp_path):
    """The feature's point. Keys up to ~2,000 and values up to ~1,000 stored at scale 1.0
    clamp at 448: the teacher-forced top-1 agrees with the float32 cache on 66% of the
    positions (measured; bounded at 80%). With measured scales they fit e4m3's range, and
    agreement is that of the unscaled model (94%; bounded at 90%)."""
    source = make_tiny_checkpoint(tmp_path / "llama", family="llama", seed=0)
    path = large_kv_checkpoint(source, tmp_path / "large_kv")
    prompts = random_prompts(0, (40, 57, 33, 64))
    top1, largest = {}, None
    for name, kwargs in {"auto": {}, "scale 1.0": dict(kv_cache_dtype="fp8"), "calculated": FP8}.items():
        llm = LLM(model=str(path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=16, **kwargs)
        if name == "auto":
            seen = first_stored(llm)
        top1[name] = teacher_forced_top1(llm, prompts)
        if name == "auto":
            largest = max(k.abs().max().item() for k, _ in seen), max(v.abs().max().item() for _, v in seen)
        if name == "calculated":
            assert all(k > 1.0 and v > 1.0 for k, v in scales(llm))
    assert largest[0] > 3 * FP8_MAX and largest[1] > FP8_MAX, f"keys and values should pass 448: {largest}"
    assert agreement(top1["auto"], top1["scale 1.0"]) <= 0.80
    assert agreement(top1["auto"], top1["calculated"]) >= MIN_AGREEMENT


def test_bundled_model():
    """The bundled model (a trained Qwen3) in float32: the scales are the first step's largest
    key and value over 448, and the teacher-forced top-1 on its own corpus's kind of text
    agrees with the float32 cache's."""
    prompts = ["It is a truth universally acknowledged, that a single man in possession of a good fortune, "
               "must be in want of a wife.", "ROMEO:\nBut, soft! what light through yonder window breaks?",
               "HAMLET:\nTo be, or not to be, that is the question:"]
    top1 = {}
    for name, kwargs in {"auto": {}, "calculated": FP8}.items():
        llm = LLM(dtype="float32", num_kv_blocks=64, **kwargs)
        ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        seen = first_stored(llm)
        top1[name] = teacher_forced_top1(llm, ids)
        if name == "calculated":
            for layer, (k, v) in zip(llm.engine.runner.layers, seen, strict=True):
                assert layer.k_scale.item() == pytest.approx(k.abs().max().item() / FP8_MAX, rel=1e-6)
                assert layer.v_scale.item() == pytest.approx(v.abs().max().item() / FP8_MAX, rel=1e-6)
    print("BUNDLED", agreement(top1["auto"], top1["calculated"]), len(top1["auto"]))
    assert agreement(top1["auto"], top1["calculated"]) >= BUNDLED_MIN_AGREEMENT


def test_auto_cache_accepts_it_with_a_warning(tiny_qwen3, caplog):
    """With kv_cache_dtype='auto' it changes nothing (a cache in the model's dtype never
    reads a scale), as in vLLM, whose command lines must start unchanged: a warning says so."""
    with caplog.at_level(logging.WARNING, logger="minivllm.config"):
        llm = LLM(model=str(tiny_qwen3), num_kv_blocks=32, block_size=4, calculate_kv_scales=True)
    assert "calculate_kv_scales=True changes nothing with kv_cache_dtype='auto'" in caplog.text
    runner = llm.engine.runner
    assert all(layer.kv_scales_hook is None for layer in runner.layers) and "execute" not in vars(runner)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert scales(llm) == [(1.0, 1.0)] * len(runner.layers)


def test_serve_flag():
    from minivllm.cli import build_parser, engine_args, parse_args

    args = parse_args(build_parser(), ["serve", "m", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    assert engine_args(args) == {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}


def _rank_scale(parts: list[torch.Tensor]) -> float:
    from minivllm.distributed.parallel_state import get_tp_rank

    return kv_scale(parts[get_tp_rank()]).item()


def test_scale_is_the_largest_over_the_ranks():
    """Each rank holds some of the heads: every rank gets the largest over all of them."""
    parts = [torch.tensor([1.0, -2.0]), torch.tensor([448.0 * 3, 0.5])]
    assert run_on_ranks(_rank_scale, 2, parts, num_threads=1) == [3.0, 3.0]


def test_tensor_parallel_engine_matches_one_process(tmp_path):
    """LLM(tensor_parallel_size=2) with measured scales: rank 0's scales and the greedy tokens
    are those of one process (a rank that scaled by its own heads only would round its keys
    differently)."""
    path = str(make_tiny_checkpoint(tmp_path, family="qwen3", seed=3))
    prompts = random_prompts(5, (30, 9, 50))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    # On the CPU (two gloo processes) wherever the suite runs: a one-GPU machine has no
    # second device for rank 1 (the two-GPU engine is tests/test_tensor_parallel.py's).
    engine_args = dict(dtype="float32", device="cpu", num_kv_blocks=120, block_size=8, max_num_batched_tokens=128,
                       **FP8)
    with torch_threads(1):
        one = LLM(path, **engine_args)
        want, want_scales = one.generate(prompts, params, use_tqdm=False), scales(one)
        one.shutdown()
        llm = LLM(path, tensor_parallel_size=2, **engine_args)
        try:
            got, got_scales = llm.generate(prompts, params, use_tqdm=False), scales(llm)
        finally:
            llm.shutdown()
    torch.testing.assert_close(torch.tensor(got_scales), torch.tensor(want_scales), rtol=1e-5, atol=0)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-4)


@pytest.mark.gpu
def test_gpu_scales_skip_the_start_up_and_the_graphs(tmp_path):
    """On the GPU, where construction runs a warm-up, captures the graphs and compiles the
    eager steps (all on dummy tokens): the scales are still 1.0 after it; the first request
    (a short prompt, which would replay a prefill graph) runs eagerly and sets them to its
    largest key and value over 448; the top-1 agrees with bf16's."""
    path = make_tiny_checkpoint(tmp_path, seed=6, dtype=torch.bfloat16, hidden_size=256, intermediate_size=768,
                                num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_hidden_layers=4,
                                max_position_embeddings=2048)
    prompts = random_prompts(7, (40, 200, 90, 13))
    top1 = {}
    for name, kwargs in {"auto": {}, "calculated": FP8}.items():
        llm = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.2, max_num_batched_tokens=512, **kwargs)
        runner = llm.engine.runner
        assert runner.graphs and scales(llm) == [(1.0, 1.0)] * len(runner.layers)
        seen = first_stored(llm)
        llm.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        if name == "calculated":
            for layer, (k, v) in zip(runner.layers, seen, strict=True):
                assert layer.k_scale.item() == pytest.approx(k.abs().max().float().item() / FP8_MAX, rel=1e-6)
                assert layer.v_scale.item() == pytest.approx(v.abs().max().float().item() / FP8_MAX, rel=1e-6)
        top1[name] = teacher_forced_top1(llm, prompts)
        llm.shutdown()
    assert agreement(top1["auto"], top1["calculated"]) >= MIN_AGREEMENT
