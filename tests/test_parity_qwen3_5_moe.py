"""Qwen3.5-MoE (hybrid layers, each with routed experts and a gated shared expert) against
transformers, float32, CPU; and the text part of Qwen3.5 vision-language checkpoints, the
form in which the hub publishes both models.

The tiny MoE model has Qwen3.5's four layers (three Gated DeltaNet, one full attention),
each feed-forward eight experts of width 32 (two per token) and a shared expert of width
48 (its greedy tokens through the engine: test_parity_hybrid). Logits: 1e-4 on O(1) logits, as test_parity_qwen3_5
(the same float32 math in another order). The fused MoE kernel runs in Triton's
interpreter (numpy float32), held to the same bound.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from minivllm import LLM, SamplingParams
from minivllm.context import reset_context
from minivllm.engine.tp_worker import check_tensor_parallel
from minivllm.layers.moe import SparseMoeBlock
from minivllm.loader import load_model
from minivllm.ops import moe as moe_ops
from minivllm.testing import make_tiny_checkpoint

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(hybrid_checkpoint):
    return hybrid_checkpoint("qwen3_5_moe")


@pytest.fixture(scope="module")
def hf(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def greedy_reference(hf, prompts):
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False)
            out.append(ref[0, len(prompt):].tolist())
    return out


def random_prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


# -- the MoE model ------------------------------------------------------------------------


def test_config_and_blocks(checkpoint, hf):
    ours = load_model(checkpoint)
    config = ours.config
    assert config.model_type == "qwen3_5_moe_text" and "intermediate_size" not in config.hf_config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert config.shared_expert_intermediate_size == 48 and not config.vision_language
    assert [layer.layer_type for layer in ours.model.layers] == [layer.block_type for layer in hf.model.layers]
    for layer in ours.model.layers:
        # Every layer sparse, renormalised top-k (transformers' router always renormalises).
        assert isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.renormalize and layer.mlp.top_k == 2
        assert layer.mlp.shared_expert.gate_up_proj.weight.shape == (2 * 48, 64)


def test_weights_land_where_transformers_has_them(checkpoint, hf):
    ours = load_model(checkpoint)
    for mine, theirs in zip(ours.model.layers, hf.model.layers):
        exact = dict(atol=0, rtol=0)
        torch.testing.assert_close(mine.mlp.gate.weight, theirs.mlp.gate.weight, **exact)
        torch.testing.assert_close(mine.mlp.experts.gate_up_proj, theirs.mlp.experts.gate_up_proj, **exact)
        torch.testing.assert_close(mine.mlp.experts.down_proj, theirs.mlp.experts.down_proj, **exact)
        shared = theirs.mlp.shared_expert
        torch.testing.assert_close(mine.mlp.shared_expert.gate_up_proj.weight,
                                   torch.cat([shared.gate_proj.weight, shared.up_proj.weight]), **exact)
        torch.testing.assert_close(mine.mlp.shared_expert.down_proj.weight, shared.down_proj.weight, **exact)
        torch.testing.assert_close(mine.mlp.shared_expert_gate.weight, theirs.mlp.shared_expert_gate.weight, **exact)


def test_moe_block_matches_transformers(checkpoint, hf):
    """One layer's feed-forward alone: routed experts plus the gated shared expert. The
    shared expert's gate is read: zeroing it (sigmoid(0) = 1/2 for every token) moves the output."""
    ours = load_model(checkpoint)
    x = torch.randn(33, 64)
    with torch.no_grad():
        ref = hf.model.layers[1].mlp(x[None])[0]
        out = ours.model.layers[1].mlp(x)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        ours.model.layers[1].mlp.shared_expert_gate.weight.zero_()
        assert (ours.model.layers[1].mlp(x) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("length", [5, 64, 150])
def test_logits_match(checkpoint, hf, length):
    ours = load_model(checkpoint)
    ids = torch.randint(0, 512, (length,))
    reset_context()
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(length)), all_tokens=True)
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_logits_match_through_the_fused_kernel(checkpoint, hf, monkeypatch):
    """The experts in the fused Triton kernels (interpreter) instead of the loop: one call
    per layer, every layer being sparse."""
    import minivllm.kernels.fused_moe as kernels

    ours = load_model(checkpoint)
    monkeypatch.setattr(moe_ops, "use_triton", lambda x: True)
    calls = []
    real = kernels.fused_moe
    monkeypatch.setattr(kernels, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(0, 512, (70,))
    reset_context()
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(70)), all_tokens=True)
        ref = hf(ids[None]).logits[0]
    assert len(calls) == len(ours.model.layers)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


# -- vision-language checkpoints (the hub's form of Qwen3.5) --------------------------------


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def vision_language(request, tmp_path_factory):
    """A tiny vision-language checkpoint written by transformers' ConditionalGeneration
    class, with untied embeddings (the top level says so; text_config's default says the
    opposite), and transformers' text model loaded from the same folder."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"{request.param}-vl"), family=request.param, seed=6,
                                vision_language=True, tie_word_embeddings=False)
    return request.param, path


def test_vision_language_config_is_flattened(vision_language):
    family, path = vision_language
    on_disk = json.loads((path / "config.json").read_text())
    assert on_disk["architectures"][0].endswith("ForConditionalGeneration") and "text_config" in on_disk
    names = load_file(path / "model.safetensors").keys()
    assert any(n.startswith("model.visual.") for n in names), "the folder must hold a vision tower to skip"
    model = load_model(path)
    config = model.config
    assert config.vision_language and config.model_type == on_disk["text_config"]["model_type"]
    assert config.architecture == ("Qwen3_5MoeForCausalLM" if family == "qwen3_5_moe" else "Qwen3_5ForCausalLM")
    assert config.hidden_size == 64 and config.num_hidden_layers == 4
    assert not config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="hybrid models"):
        check_tensor_parallel(config, 2, "cpu")


def test_vision_language_text_matches_transformers(vision_language):
    """Logits against transformers' vision-language model on text only, and greedy tokens
    through the engine against transformers' text model loaded from the same folder."""
    _, path = vision_language
    ours = load_model(path)
    hf_vl = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (70,))
    reset_context()
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(70)), all_tokens=True)
        ref = hf_vl(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    hf_text = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts((3, 70), seed=5)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=48)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference(hf_text, prompts)


def test_vision_language_skips_only_what_it_names(vision_language, tmp_path):
    """A multi-token-prediction head is skipped like the vision tower; a tensor of neither
    part, with no place in the text model, is still an error that names it."""
    _, path = vision_language
    shutil.copy(path / "config.json", tmp_path / "config.json")
    state = load_file(path / "model.safetensors")
    state["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(state, tmp_path / "model.safetensors")
    load_model(tmp_path)
    state["model.language_model.layers.0.extra.weight"] = torch.randn(4)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"model\.language_model\.layers\.0\.extra\.weight"):
        load_model(tmp_path)
    del state["model.language_model.layers.0.extra.weight"]
    del state["model.language_model.norm.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"missing tensors for: model\.norm\.weight"):
        load_model(tmp_path)
