"""The loader: sharded files, tied and untied heads, packed projections, clear errors."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from minivllm.config import ModelConfig
from minivllm.loader import load_model
from minivllm.testing import make_tiny_checkpoint


def reference_logits(path, ids):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0, -1]


def our_logits(path, ids):
    model = load_model(path)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids))))[0]


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_heads(tmp_path, tie):
    path = make_tiny_checkpoint(tmp_path, tie_word_embeddings=tie, seed=3)
    model = load_model(path)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    ids = torch.randint(0, 512, (9,))
    torch.testing.assert_close(our_logits(path, ids), reference_logits(path, ids), atol=1e-4, rtol=0)


def test_sharded_checkpoint(tmp_path):
    path = make_tiny_checkpoint(tmp_path, tie_word_embeddings=False, max_shard_size="100KB", seed=4)
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 2
    ids = torch.randint(0, 512, (9,))
    torch.testing.assert_close(our_logits(path, ids), reference_logits(path, ids), atol=1e-4, rtol=0)


def test_packed_qkv_rows(tiny_qwen3):
    model = load_model(tiny_qwen3)
    weights = load_file(tiny_qwen3 / "model.safetensors")
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    q = weights["model.layers.1.self_attn.q_proj.weight"]
    k = weights["model.layers.1.self_attn.k_proj.weight"]
    v = weights["model.layers.1.self_attn.v_proj.weight"]
    torch.testing.assert_close(qkv, torch.cat([q, k, v]), atol=0, rtol=0)
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight
    gate = weights["model.layers.1.mlp.gate_proj.weight"]
    up = weights["model.layers.1.mlp.up_proj.weight"]
    torch.testing.assert_close(gate_up, torch.cat([gate, up]), atol=0, rtol=0)


def _rewrite(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        load_model(path)


def test_misshaped_tensor_is_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*expected shape"):
        load_model(path)


def test_misshaped_packed_shard_is_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(7, 64)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shard 1"):
        load_model(path)


def test_unexpected_tensor_is_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}))
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mystery\.weight"):
        load_model(path)


def test_unknown_architecture(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MysteryForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MysteryForCausalLM.*supported"):
        load_model(path)


def test_detects_bias_and_qk_norm_from_weights(tmp_path):
    """A config that says 'no attention bias' loses to weights that carry one."""
    path = make_tiny_checkpoint(tmp_path, attention_bias=True)
    config = json.loads((path / "config.json").read_text())
    config["attention_bias"] = False
    (path / "config.json").write_text(json.dumps(config))
    parsed = ModelConfig.from_pretrained(path)
    assert parsed.attention_bias and parsed.qk_norm
    model = load_model(path)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    ids = torch.randint(0, 512, (6,))
    hf_path = make_tiny_checkpoint(tmp_path / "ref", attention_bias=True)
    torch.testing.assert_close(our_logits(path, ids), reference_logits(hf_path, ids), atol=1e-4, rtol=0)


def test_config_rejects_bad_heads():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_dict(
            dict(architectures=["Qwen3ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=8,
                 num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=2)
        )
