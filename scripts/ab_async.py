"""Asynchronous scheduling against the synchronous loop on the throughput workload, on a
CUDA GPU: the engine built and timed with async scheduling on, off, and on again (the first
run on a fresh machine also pays for Triton's compiling). Prints one line a run.

    python scripts/ab_async.py
"""
import json

from minivllm.bench.throughput import make_workload, measure_ceilings, model_checkpoint, run_minivllm, speed_of_light


def main() -> None:
    ceilings = measure_ceilings()
    prompts, output_lens = make_workload(256)
    path = model_checkpoint()
    rows = []
    for async_scheduling in (True, False, True):
        run = run_minivllm(path, prompts, output_lens, async_scheduling=async_scheduling)
        sol = speed_of_light(run.pop("_trace"), run.pop("_config"), run.pop("_params"), ceilings)
        row = {"async_scheduling": async_scheduling, "output_tokens_per_s": round(run["output_tokens_per_s"]),
               "seconds": round(run["seconds"], 2), "percent_of_speed_of_light": round(100 * sol["floor_seconds"] / run["seconds"], 1),
               "decode_step_seconds": round(run["decode_step_seconds"], 2),
               "decode_step_host_seconds": round(run["decode_step_host_seconds"], 2),
               "prefill_step_seconds": round(run["prefill_step_seconds"], 2), "steps": run["steps"]}
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
