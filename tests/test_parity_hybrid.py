"""The engine on every hybrid family (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) against
transformers, float32, CPU; what is particular to one family is in its own test file.

One batch of prompts from 1 to 200 tokens, around one and two chunks of the chunked form
(64 tokens); a budget of 48 tokens per step splits the long ones over several steps, so the
engine's chunk boundaries (48) and the rule's (64) fall in different places, and prefills
run beside decodes. Greedy tokens must be transformers' exactly.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.engine.state_pool import HybridCacheManager
from minivllm.engine.tp_worker import check_tensor_parallel
from minivllm.loader import load_model

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LENGTHS = (1, 5, 63, 64, 65, 130, 200, 7)  # around one and two chunks of 64
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]

pytestmark = pytest.mark.usefixtures("one_thread")


def greedy_reference(checkpoint, prompts):
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False)
            out.append(ref[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_matches_batched_and_chunked(hybrid_checkpoint, family):
    checkpoint = hybrid_checkpoint(family)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in LENGTHS]
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=200, block_size=8, max_num_batched_tokens=48,
              record_trace=True)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference(checkpoint, prompts)
    trace = llm.engine.trace
    assert any({"prefill", "decode"} <= {kind for *_, kind in r.seqs} for r in trace), "no mixed step"
    prefill_steps = {}
    for r in trace:
        for seq_id, _, kind in r.seqs:
            prefill_steps[seq_id] = prefill_steps.get(seq_id, 0) + (kind == "prefill")
    assert max(prefill_steps.values()) >= 4, "the 200-token prompt must be prefilled over several steps"
    # Everything given back: every slot free, every block free, prefix caching off.
    manager = llm.engine.block_manager
    assert isinstance(manager, HybridCacheManager) and not manager.enable_prefix_caching
    assert manager.states.num_free_slots == manager.states.num_slots
    assert manager.num_free_blocks == manager.num_blocks
    assert all(o.num_cached_tokens == 0 for o in outputs)


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_refused(hybrid_checkpoint, family):
    config = load_model(hybrid_checkpoint(family)).config
    with pytest.raises(ValueError, match="tensor_parallel_size=2: hybrid models"):
        check_tensor_parallel(config, 2, "cpu")
