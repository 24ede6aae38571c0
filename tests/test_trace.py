"""The step trace: records only while ``record_trace`` is on, read at every step, so a run can
turn it on for a stretch (the throughput benchmark records its second run only, and computes
the speed of light from those records)."""
import torch

from minivllm import LLM, SamplingParams
from minivllm.bench.throughput import speed_of_light


def test_record_trace_turned_on_mid_life_records_the_steps_after(tiny_qwen3):
    llm = LLM(model=tiny_qwen3, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    prompts = [torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.trace == [] and llm.engine.num_steps > 0, "record_trace off: steps counted, none recorded"
    llm.engine.config.record_trace = True
    llm.generate(prompts, params, use_tqdm=False)
    recorded = len(llm.engine.trace)
    assert recorded > 0, "turning record_trace on must record the steps that follow"
    model = llm.engine.runner.model
    sol = speed_of_light(llm.engine.trace, model.config, sum(p.numel() for p in model.parameters()),
                         {"copy_bandwidth_bytes_per_s": 1e9, "bf16_matmul_flops_per_s": 1e9}, 4)
    assert sol["bytes"] > 0 and sol["floor_seconds"] > 0
    llm.engine.config.record_trace = False
    llm.generate(prompts, params, use_tqdm=False)
    assert len(llm.engine.trace) == recorded, "turned off again, it records nothing more"
