"""Where the throughput workload's time goes on the GPU, over the whole run.

Runs ``minivllm bench throughput``'s workload (nano-vllm's bench.py draw, fresh prompts) once
under torch.profiler, kernels only, on an engine built as the benchmark builds it, and prints:
  - the GPU's busy time (the union of kernel intervals) against the run's wall time;
  - kernel time by kernel name, the largest first;
  - the GPU's idle time, in gaps between kernels, by the size of the gap and by the kernel
    that ended it (the first kernel after an idle gap shows which step, or which part of a
    step, the GPU was waiting for).

With ``--host`` the host's side is recorded too (the engine's named ranges, and the model
runner's prepare / execute / sample), and each idle gap of the GPU is charged to what the
host was doing when it began: the host work the GPU waited for. It also splits the run by
step: each step's window on the GPU (from its first kernel to the next step's), the idle
time in it and the host's time in the step's launch and process, summed by the kind of step
(prefill only, mixed, decode by batch size), so that one can see which steps the host is
behind in.

    python scripts/profile_throughput.py [--top 20] [--host] [--out profile.json]    # needs a CUDA GPU
"""
import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.bench.throughput import WARMUP_PROMPT, fresh_prompts, make_workload, model_checkpoint

GAP_BINS = [(0, 5e3, "< 5 us"), (5e3, 20e3, "5-20 us"), (20e3, 100e3, "20-100 us"), (100e3, 1e6, "0.1-1 ms"),
            (1e6, float("inf"), "> 1 ms")]


def short(name: str) -> str:
    """A kernel's name without its template arguments and launch details."""
    return name.split("<")[0].split("(")[0][:70]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out", help="write the tables as JSON here too")
    parser.add_argument("--host", action="store_true", help="charge the GPU's idle gaps to the host's work")
    parser.add_argument("--engine", type=json.loads, default={}, help="EngineConfig fields, as a JSON object")
    args = parser.parse_args()
    prompts, output_lens = make_workload()
    llm = LLM(str(model_checkpoint()), dtype="bfloat16", max_model_len=4096, **args.engine)
    llm.generate(WARMUP_PROMPT, SamplingParams(), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
    if args.host:
        from torch.profiler import record_function

        from minivllm.engine.model_runner import ModelRunner

        def ranged(name, fn):
            def wrapper(*a, **k):
                with record_function(name):
                    return fn(*a, **k)
            return wrapper

        for name in ("prepare", "execute", "sample"):
            setattr(ModelRunner, name, ranged(f"runner.{name}", getattr(ModelRunner, name)))
        # Finer host calls, named in the gaps' listing only (not ranges of the tables above).
        from minivllm.engine.block_manager import BlockManager
        from minivllm.engine.llm_engine import LLMEngine
        from minivllm.engine.step_inputs import StepInputs
        from minivllm.layers.sampled_tokens import SampledTokens

        for owner, name in ((ModelRunner, "upload"), (ModelRunner, "_to_device"), (SampledTokens, "to_host"),
                            (LLMEngine, "_account"), (LLMEngine, "_prompt_logprob_rows"),
                            (BlockManager, "allocate")):
            setattr(owner, name, ranged(f"host.{owner.__name__}.{name}", getattr(owner, name)))
        StepInputs.pack = classmethod(ranged("host.StepInputs.pack", StepInputs.pack.__func__))
        batches = []  # (sequences, tokens, decode rows) of each step, in order
        prepare = ModelRunner.prepare

        def recorded(self, batch, *a, **k):
            batches.append((len(batch.seqs), sum(batch.num_new_tokens), sum(n == 1 for n in batch.num_new_tokens)))
            return prepare(self, batch, *a, **k)

        ModelRunner.prepare = recorded
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.host else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(fresh_prompts(prompts, seed=3), params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.profiler.kineto_results.events()
    # (The host's ranges show on the GPU's timeline too, as annotations: not kernels.)
    kernels = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events
                     if e.device_type().name == "CUDA" and e.name() and not e.name().startswith(("Memcpy", "runner.", "minivllm.")))
    # The host's ranges, innermost last when they nest (sorted by start, longest first).
    ranges = sorted(((e.start_ns(), e.end_ns(), e.name()) for e in events if e.device_type().name == "CPU"
                     and (e.name().startswith("minivllm.") or e.name().startswith("runner."))),
                    key=lambda r: (r[0], -r[1]))
    gaps = []  # (start, end) of each idle gap over 20 us
    by_name = defaultdict(lambda: [0, 0.0])
    gaps_by_next = defaultdict(lambda: [0, 0.0])
    gaps_by_size = {label: [0, 0.0] for *_, label in GAP_BINS}
    busy, end = 0, kernels[0][0]
    previous = ""
    for s0, s1, name in kernels:
        entry = by_name[short(name)]
        entry[0] += 1
        entry[1] += (s1 - s0) / 1e9
        if s0 > end:  # an idle gap, ended by this kernel
            gap = s0 - end
            if gap > 20e3:
                gaps.append((end, s0, previous, name))
            gaps_by_next[short(name)][0] += 1
            gaps_by_next[short(name)][1] += gap / 1e9
            for lo, hi, label in GAP_BINS:
                if lo <= gap < hi:
                    gaps_by_size[label][0] += 1
                    gaps_by_size[label][1] += gap / 1e9
        if s1 > end:
            busy += s1 - max(s0, end)
            end = s1
        previous = name
    span = (end - kernels[0][0]) / 1e9
    idle = span - busy / 1e9
    print(f"wall {wall:.3f} s under the profiler; first to last kernel {span:.3f} s; GPU busy {busy / 1e9:.3f} s "
          f"({100 * busy / 1e9 / span:.1f}%), idle {idle:.3f} s; {len(kernels)} kernels")
    print(f"\nkernel time by name (top {args.top}):")
    for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"  {t:8.3f} s {100 * t / (busy / 1e9):5.1f}%  {n:7d}x  {name}")
    print("\nidle gaps by size:")
    for label, (n, t) in gaps_by_size.items():
        print(f"  {label:>10s}: {n:7d} gaps, {t:.3f} s")
    print(f"\nidle gaps by the kernel that ended them (top {args.top}):")
    for name, (n, t) in sorted(gaps_by_next.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"  {t:8.3f} s  {n:7d} gaps  {name}")
    by_host = defaultdict(lambda: [0, 0.0])
    if ranges:
        import bisect

        starts = [r[0] for r in ranges]
        steps = [r[0] for r in ranges if r[2] == "runner.execute"]
        largest = []
        for g0, g1, before, after in gaps:
            # The innermost host range open when the gap began (the latest-starting one that
            # contains g0), else "between ranges".
            i = bisect.bisect_right(starts, g0)
            inside = [r for r in ranges[max(0, i - 64):i] if r[1] > g0]
            name = inside[-1][2] if inside else "(outside the engine's ranges)"
            by_host[name][0] += 1
            by_host[name][1] += (g1 - g0) / 1e9
            largest.append(((g1 - g0) / 1e3, bisect.bisect_right(steps, g0), name, short(before), short(after)))
        print("\nthe largest idle gaps: us, engine step, host range at its start, kernel before, kernel after")
        for row in sorted(largest, reverse=True)[: args.top]:
            print(f"  {row[0]:8.0f}  {row[1]:5d}  {row[2]:20s} {row[3][:40]:40s} {row[4][:40]}")
        # What the host was inside of (any recorded call, innermost first) as the largest gaps began.
        calls = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events if e.device_type().name == "CPU")
        call_starts = [c[0] for c in calls]
        for g0, g1, *_ in sorted(gaps, key=lambda g: g[0] - g[1])[:5]:
            i = bisect.bisect_right(call_starts, g0)
            open_calls = sorted((c for c in calls[max(0, i - 2000):i] if c[1] > g0), key=lambda c: -c[0])[:6]
            print(f"  gap of {(g1 - g0) / 1e3:.0f} us: " + " < ".join(
                f"{c[2][:40]} ({(c[1] - c[0]) / 1e3:.0f} us, ends {(c[1] - g0) / 1e3:+.0f})" for c in open_calls))
        # And what the host did during the largest gaps: the calls of 0.3 ms or more inside each.
        for g0, g1, *_ in sorted(gaps, key=lambda g: g[0] - g[1])[:8]:
            i = bisect.bisect_left(call_starts, g0)
            j = bisect.bisect_right(call_starts, g1)
            long = [c for c in calls[i:j] if c[1] - c[0] >= 3e5]
            print(f"  inside the gap of {(g1 - g0) / 1e3:.0f} us: " + ", ".join(
                f"{c[2][:32]} at +{(c[0] - g0) / 1e3:.0f} for {(c[1] - c[0]) / 1e3:.0f} us" for c in long[:14]))
        print("\nidle gaps over 20 us by what the host was doing when they began:")
        for name, (n, t) in sorted(by_host.items(), key=lambda kv: -kv[1][1]):
            print(f"  {t:8.3f} s  {n:7d} gaps  {name}")
        for name in sorted({r[2] for r in ranges}):
            spans = [(r[1] - r[0]) / 1e9 for r in ranges if r[2] == name]
            print(f"  host range {name:22s} {len(spans):6d}x  {sum(spans):7.3f} s in all, mean {1e3 * sum(spans) / len(spans):.3f} ms")
    by_step = step_table(events, batches) if ranges else {}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"wall_seconds": wall, "span_seconds": span, "busy_seconds": busy / 1e9, "kernels": len(kernels),
                       "by_name": dict(by_name), "gaps_by_size": gaps_by_size, "gaps_by_next": dict(gaps_by_next),
                       "gaps_by_host": dict(by_host), "by_step_kind": by_step},
                      f, indent=1)


def step_kind(seqs: int, tokens: int, decodes: int) -> str:
    if decodes == 0:
        return "prefill only"
    if decodes < seqs:
        return "mixed"
    for low in (256, 128, 32, 8, 1):
        if seqs >= low:
            return f"decode, {low}+ rows"
    return "decode"


def step_table(events, batches) -> dict:
    """Each step's share of the GPU's timeline and of the host's, summed by kind of step.
    A kernel belongs to the step whose launch range was open on the host when it was
    launched (matched by the profiler's correlation id); a step's window on the GPU runs from
    its first kernel to the next step's, and the GPU's idle time before each of its kernels
    is what the step's work waited for."""
    import bisect

    def spans(name: str):
        return sorted((e.start_ns(), e.end_ns()) for e in events if e.device_type().name == "CPU" and e.name() == name)

    launches = spans("minivllm.launch")
    if len(launches) != len(batches) + 1 and len(launches) != len(batches):
        print(f"\nno table by step: {len(launches)} launch ranges on the host, {len(batches)} steps")
        return {}
    # (A kernel names the host call that launched it by its linked correlation id.)
    kernels = sorted((e.start_ns(), e.end_ns(), e.linked_correlation_id() or e.correlation_id()) for e in events
                     if e.device_type().name == "CUDA" and e.name() and not e.name().startswith(("Memcpy", "runner.", "minivllm.")))
    ids = {k[2] for k in kernels}
    launched_at = {e.correlation_id(): e.start_ns() for e in events
                   if e.device_type().name == "CPU" and e.correlation_id() in ids}
    print(f"\n{sum(k[2] in launched_at for k in kernels)} of {len(kernels)} kernels matched to their launch on the host")
    starts = [l[0] for l in launches]
    first = [None] * len(launches)  # each step's first kernel on the GPU
    idle = [0] * len(launches)
    end = kernels[0][0]
    for s0, s1, cid in kernels:
        i = max(0, bisect.bisect_right(starts, launched_at.get(cid, s0)) - 1)
        if first[i] is None:
            first[i] = s0
        if s0 > end:
            idle[i] += s0 - end
        end = max(end, s1)
    inside = {}  # host time of each named call inside each launch range
    for name in ("runner.execute", "runner.sample"):
        times = [0] * len(launches)
        for s0, s1 in spans(name):
            i = bisect.bisect_right(starts, s0) - 1
            if i >= 0 and s1 <= launches[i][1]:
                times[i] += s1 - s0
        inside[name] = times
    process = spans("minivllm.process")
    following = [end] * len(first)  # the next step's first kernel
    for i in range(len(first) - 2, -1, -1):
        following[i] = first[i + 1] if first[i + 1] is not None else following[i + 1]
    table = {}
    for i, (seqs, tokens, decodes) in enumerate(batches):
        if first[i] is None:
            continue
        window = following[i] - first[i]
        row = table.setdefault(step_kind(seqs, tokens, decodes), [0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += window / 1e9
        row[2] += idle[i] / 1e9
        row[3] += (launches[i][1] - launches[i][0]) / 1e9
        row[4] += inside["runner.execute"][i] / 1e9
        row[5] += inside["runner.sample"][i] / 1e9
        row[6] += (process[i][1] - process[i][0]) / 1e9 if i < len(process) else 0.0
    # The host calls inside the mixed steps' launches, by total time (nested calls counted in
    # each of their callers too): where an eager step's host time goes.
    mixed = [launches[i] for i, b in enumerate(batches) if step_kind(*b) == "mixed"]
    if mixed:
        mixed_starts = [m[0] for m in mixed]
        calls = defaultdict(lambda: [0, 0.0])
        for e in events:
            if e.device_type().name != "CPU" or e.name().startswith("minivllm.launch"):
                continue
            i = bisect.bisect_right(mixed_starts, e.start_ns()) - 1
            if i >= 0 and e.end_ns() <= mixed[i][1]:
                calls[e.name()[:48]][0] += 1
                calls[e.name()[:48]][1] += (e.end_ns() - e.start_ns()) / 1e9
        print(f"\nhost calls inside the {len(mixed)} mixed steps' launches ({sum(m[1] - m[0] for m in mixed) / 1e9:.3f} s), "
              "by total time:")
        for name, (n, t) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"  {t:7.3f} s {n:7d}x  {name}")
    print("\nby kind of step: steps, GPU window s, GPU idle s; host s in launch (of it execute, sample), in process")
    for kind, (n, w, idle_s, launch, execute, sample, proc) in table.items():
        print(f"  {kind:20s} {n:5d}  {w:7.3f}  {idle_s:6.3f}   {launch:6.3f} ({execute:6.3f}, {sample:6.3f})  {proc:6.3f}")
    return {kind: dict(zip(("steps", "gpu_window_s", "gpu_idle_s", "host_launch_s", "host_execute_s", "host_sample_s",
                            "host_process_s"), row)) for kind, row in table.items()}


if __name__ == "__main__":
    main()
