"""The bundled model (minivllm/assets/bundled): a real trained checkpoint, shipped with the
package, loadable by transformers and by minivllm, and identical greedy text from both.

Both sides run in float32 on the CPU: the checkpoint is stored in bfloat16, and greedy text
computed in bfloat16 differs from float32's after a few tokens, so the comparison holds
the precision fixed on both sides.
"""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.llm import BUNDLED_MODEL

PROMPTS = ["It is a truth universally acknowledged", "ROMEO:", "Elizabeth", "HAMLET:\nTo be, or not to be"]


@pytest.fixture(scope="module")
def reference():
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    return tokenizer, model


def test_folder_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in BUNDLED_MODEL.iterdir()}
    assert set(files) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                          "generation_config.json"}
    assert sum(files.values()) <= 25 * 2**20
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]


def test_greedy_text_identical_to_transformers(reference):
    tokenizer, model = reference
    llm = LLM(dtype="float32", num_kv_blocks=256)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        ref = model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == ref.tolist(), prompt
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    # Readable English, not byte soup: mostly letters and spaces, and real words.
    text = "".join(o.outputs[0].text for o in outputs)
    assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.85
    assert sum(w in text.split() for w in ("the", "I", "and", "of", "to", "a")) >= 3


def test_chat_template_applies(reference):
    tokenizer, _ = reference
    llm = LLM(dtype="float32", num_kv_blocks=128)
    [out] = llm.chat([{"role": "user", "content": "Who is Mr. Darcy?"}],
                     SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out.prompt.endswith(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who is Mr. Darcy?"}], tokenize=False, add_generation_prompt=True))
    assert len(out.outputs[0].token_ids) == 8 or out.outputs[0].finish_reason == "stop"
