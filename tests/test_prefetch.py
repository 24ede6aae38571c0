"""The decode gemvs' L2 prefetch plan (layers.linear.chain_prefetches, kernels.prefetch).

Each linear layer names the weights of the layer a few places after it in the order its
model runs them; the gemv asks L2 for them on the way. A prefetch is a hint: on the GPU the
greedy tokens are the same with it and without (MINIVLLM_PREFETCH=0). The kernel side (the
instruction compiled in, outputs equal bit for bit) is in test_kernels.py.
"""
import pytest
import torch

from minivllm.layers.linear import chain_prefetches, linear_layers
from minivllm.loader import load_model


def test_chain_prefetches_names_the_weights_distance_layers_on(tiny_qwen3):
    model = load_model(tiny_qwen3)
    layers = linear_layers(model)
    names = [name for name, module in model.named_modules() if module in layers]
    # The order a decoder layer runs them in: attention's q/k/v, o, then gate/up and down.
    assert [n.rsplit(".", 1)[-1] for n in names[:4]] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert names[4].startswith("model.layers.1.")
    chain_prefetches(model, 2)
    for i, layer in enumerate(layers):
        if i + 2 < len(layers):
            later = layers[i + 2].weight
            assert layer.prefetch.data_ptr() == later.data_ptr() and layer.prefetch.shape == later.shape
            assert not isinstance(layer.prefetch, torch.nn.Parameter)  # not registered as the layer's own
        else:
            assert layer.prefetch is None
    # The model's parameters are what they were: nothing registered twice.
    assert sum(1 for _ in model.parameters()) == len(list(load_model(tiny_qwen3).parameters()))
    chain_prefetches(model, 0)
    assert all(layer.prefetch is None for layer in layers)


def test_a_cpu_engine_prefetches_nothing(tiny_qwen3):
    """The plan is the GPU start-up's: on the CPU (the interpreter) no layer names any."""
    from minivllm import LLM

    llm = LLM(str(tiny_qwen3), device="cpu", num_kv_blocks=32)
    try:
        assert all(layer.prefetch is None for layer in linear_layers(llm.engine.runner.model))
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_greedy_tokens_are_the_same_without_the_prefetch(tiny_qwen3, monkeypatch):
    """Decode graphs captured with and without the prefetches give the same greedy tokens
    (float32: no near-ties), at batch 1 and 8."""
    from minivllm import LLM, SamplingParams

    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("MINIVLLM_PREFETCH", setting)
        llm = LLM(str(tiny_qwen3), dtype="float32", gpu_memory_utilization=0.3, max_model_len=256)
        try:
            assert any(layer.prefetch is not None for layer in linear_layers(llm.engine.runner.model))
            outputs[setting] = [[o.outputs[0].token_ids for o in llm.generate(p, params, use_tqdm=False)]
                                for p in (prompts[:1], prompts)]
        finally:
            llm.shutdown()
    assert outputs["1"] == outputs["0"]
