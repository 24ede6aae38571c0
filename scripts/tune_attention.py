"""Sweep the paged prefill attention kernel's tile shapes and switches on a GPU, check each
against a float32 reference, and time it against the bf16 matmul rate measured in the same
run; check the decode kernel too (and sweep it with ``--decode-sweep``). The defaults in
``kernels.paged_attention.prefill_config`` and ``decode_config`` come from this sweep on an
H200.

    python scripts/tune_attention.py --out FILE [--baseline OLD_paged_attention.py]
                                     [--budget-s 200] [--jobs 8] [--decode-sweep] [--decode-only]
                                     [--decode-splits]

Workloads, Qwen3-0.6B's attention (16 query heads, 8 KV heads, head_dim 128, bf16, blocks of
the engine's KV block size): 8 causal prompts of 1,000 tokens; 8 chunks of 512 tokens after
3,000 cached tokens each (chunked prefill over a cached prefix); 64 prompts of 600 tokens;
one prompt of 4,096 (the longest time to first token that ``minivllm bench latency`` times).
The kernel gets the step's own keys and values too, as the engine passes them (NEW_KV).
FLOPs count only the visible (query, key) pairs: 4 * head_dim * heads per pair.

Two phases, each compiled first in ``--jobs`` processes at once (Triton's cache is shared, so
the timing process then only loads the binaries): the tile shapes (query rows = BLOCK_M x
the group's heads, BLOCK_N, warps, stages) with the default switches; then, on the three
best shapes, every other combination of the switches (PREFETCH, K_T, PER_BLOCK, NEW_KV). A config
that does not compile or fit is listed under "skipped"; one that computes a wrong answer
stops the run. Past ``--budget-s`` seconds no new config is started (the JSON says how many
were left). ``--baseline`` times another version of the kernel module (e.g. an older
commit's ``minivllm/kernels/paged_attention.py``) on the same inputs.

The JSON: "sweep" (every config measured, fastest first on the first workload),
"best_per_workload", and "choice": the fastest config on the first workload among those no
slower than the reference (the baseline if given, else the default) on the cached-prefix
workload; the decode check (or sweep) under "decode".
"""
import argparse
import concurrent.futures
import importlib.util
import inspect
import itertools
import json
import multiprocessing
import time

import torch
import triton

from minivllm.bench.roofline import measure_ceilings, time_cuda_graph
from minivllm.config import EngineConfig
from minivllm.kernels import paged_attention

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
DEVICE = "cuda"
BLOCK_G = triton.next_power_of_2(HEADS // KV_HEADS)
WORKLOADS = {"8x1000 causal": ([1000] * 8, [1000] * 8),
             "8x512 after 3000 cached": ([3512] * 8, [512] * 8),
             "64x600 causal": ([600] * 64, [600] * 64),
             "1x4096 causal": ([4096], [4096])}
CACHED = "8x512 after 3000 cached"  # the workload that must not get slower
SWITCH_NAMES = ("PREFETCH", "K_T", "PER_BLOCK", "NEW_KV")


def make_inputs(lens, q_lens, block_size, generator):
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 8
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16,
                          generator=generator)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=generator)  # blocks scattered, as in a real pool
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device=DEVICE)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start : start + n]
        start += n
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    cu = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    # The step's own keys and values (each sequence's last q_lens cached rows), as the model
    # hands them over: strided views of one [tokens, q + k + v] projection.
    qkv = torch.empty(sum(q_lens), HEADS + 2 * KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    row = 0
    for b, (n, qn) in enumerate(zip(lens, q_lens)):
        rows = tables[b, : -(-n // block_size)].long()
        for cache, first in ((k_cache, HEADS), (v_cache, HEADS + KV_HEADS)):
            qkv[row : row + qn, first : first + KV_HEADS] = cache[rows].reshape(-1, KV_HEADS, HEAD_DIM)[n - qn : n]
        row += qn
    k, v = qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE), cu, k, v


def reference(q, k_cache, v_cache, tables, lens, q_lens):
    """Causal attention per sequence in float32 on gathered keys and values."""
    block_size = k_cache.shape[1]
    out, start = [], 0
    for b, (n, qn) in enumerate(zip(lens, q_lens)):
        rows = tables[b, : -(-n // block_size)].long()
        k = k_cache[rows].reshape(-1, KV_HEADS, HEAD_DIM)[:n].float().repeat_interleave(HEADS // KV_HEADS, 1)
        v = v_cache[rows].reshape(-1, KV_HEADS, HEAD_DIM)[:n].float().repeat_interleave(HEADS // KV_HEADS, 1)
        qq = q[start : start + qn].float()
        s = torch.einsum("qhd,khd->hqk", qq, k) * HEAD_DIM**-0.5
        visible = torch.arange(n, device=DEVICE)[None, :] <= (n - qn + torch.arange(qn, device=DEVICE))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        start += qn
    return torch.cat(out)


def pairs(lens, q_lens):
    return sum(qn * (n - qn) + qn * (qn + 1) // 2 for n, qn in zip(lens, q_lens))


def run(module, inputs, max_q, config=None):
    q, k_cache, v_cache, tables, lens, cu, k, v = inputs
    kwargs = {"config": config} if config else {}
    if "k" in inspect.signature(module.paged_prefill_attention).parameters:  # a baseline may predate NEW_KV
        kwargs.update(k=k, v=v)
    return module.paged_prefill_attention(q, k_cache, v_cache, tables, lens, cu, max_q, HEAD_DIM**-0.5, **kwargs)


def tile_configs() -> list[dict]:
    """Phase 1: the tile shapes, in query rows (positions x the group's heads). 8 warps only
    for tiles of 128 rows or more, 4 only up to 128 (the pairings Triton's attention tutorial
    keeps on Hopper); 256-row tiles only with up to 64 keys (more spills registers); 128 keys
    with at most 3 stages (4 need more than the 227 KiB of shared memory a program may have).
    The default and the shapes measured best before come first, in case the budget runs out."""
    shapes = []
    for rows, bn, warps, stages in itertools.product((64, 128, 256), (64, 32, 128), (4, 8), (2, 3, 4)):
        if (warps == 8 and rows < 128) or (warps == 4 and rows > 128) or (rows == 256 and bn > 64) or \
                (bn == 128 and stages == 4):
            continue
        shapes.append({"BLOCK_M": rows // BLOCK_G, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages})
    first = [{"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
             {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
             {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
             {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}]
    return first + [s for s in shapes if s not in first]


def switch_variants(shape: dict, defaults: dict) -> list[dict]:
    """Phase 2: every combination of the switches other than the defaults, on one shape."""
    out = []
    for values in itertools.product((True, False), repeat=len(SWITCH_NAMES)):
        switches = dict(zip(SWITCH_NAMES, values))
        if any(switches[k] != defaults[k] for k in SWITCH_NAMES):
            out.append({**shape, **switches})
    return out


def _compile_worker(configs: list[dict], block_size: int, device: str) -> list[str | None]:
    """In a fresh process: run the kernel once per config on a small input of the workloads'
    shapes and strides, so that Triton compiles the same specialisation into its on-disk
    cache. Returns, per config, None or the error that config raised."""
    global DEVICE
    DEVICE = device
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    inputs = make_inputs([40, 200], [40, 20], block_size, generator)
    errors = []
    for config in configs:
        try:
            run(paged_attention, inputs, 40, config)
            if DEVICE == "cuda":
                torch.cuda.synchronize()  # a launch error shows here, against this config
            errors.append(None)
        except Exception as e:  # reported by the caller, which skips that config
            errors.append(f"{type(e).__name__}: {str(e)[:200]}")
    return errors


def precompile(configs: list[dict], block_size: int, jobs: int) -> dict[str, str]:
    """Compile ``configs`` in ``jobs`` processes at once; returns {config key: error} for
    the ones that failed. A pool that cannot start is reported, and the timing process then
    compiles each config itself (slower, same results)."""
    if jobs <= 1 or not configs:
        return {}
    start = time.perf_counter()
    failed = {}
    try:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            chunks = [configs[i::jobs] for i in range(jobs)]
            for chunk, errors in zip(chunks, pool.map(_compile_worker, chunks, [block_size] * jobs, [DEVICE] * jobs)):
                for config, error in zip(chunk, errors):
                    if error is not None:
                        failed[key(config)] = error
    except Exception as e:  # the sweep still runs, compiling in this process
        print(f"  parallel compile failed ({type(e).__name__}: {str(e)[:120]}); compiling one by one")
        return {}
    print(f"  compiled {len(configs)} configs in {jobs} processes: {time.perf_counter() - start:.1f} s"
          + (f", {len(failed)} failed" if failed else ""))
    return failed


def key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def shape_of(result: dict) -> dict:
    return {k: result["config"][k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}


def label(config: dict) -> str:
    """A config in one short line: rows (BLOCK_M x the group's heads), keys, warps, stages, the
    switches that are on."""
    on = "".join(f" +{k}" for k in SWITCH_NAMES + ("FROM_SCRATCH",) if config.get(k))
    return (f"rows {config['BLOCK_M'] * BLOCK_G:3d} keys {config['BLOCK_N']:3d} w{config['num_warps']} "
            f"s{config['num_stages']}{on}")


# (batch, context lengths drawn from [100, 2048] by this seed, or all 2048 where None)
DECODE_WORKLOADS = {"256 x [100, 2048]": (256, 1), "128 x [100, 2048]": (128, 2), "64 x [100, 2048]": (64, 3),
                    "64 x 2048": (64, None), "32 x [100, 2048]": (32, 4), "8 x [100, 2048]": (8, 5)}
DECODE_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def decode_results(baseline, bandwidth, block_size, full_sweep, deadline, splits=False):
    """The decode kernel on its workloads: the default config (and the baseline's), with
    ``full_sweep`` its tile shapes too, and with ``splits`` the default tile and the sweep's
    best at each number of splits of DECODE_SPLITS (max_context_len 4,096, as a CUDA graph
    of the engine has it)."""
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    cases = {}
    for name, (batch, seed) in DECODE_WORKLOADS.items():
        lens = ([2048] * batch if seed is None else
                torch.randint(100, 2049, (batch,), generator=torch.Generator().manual_seed(seed)).tolist())
        q, k_cache, v_cache, tables, lens_t, *_ = make_inputs(lens, [1] * len(lens), block_size, generator)
        ref = reference(q, k_cache, v_cache, tables, lens, [1] * len(lens))
        cases[name] = (q, k_cache, v_cache, tables, lens_t, ref, 2 * sum(lens) * KV_HEADS * HEAD_DIM * 2)

    def measure(module, config=None, num_splits=None):
        row = {}
        for name, (q, k_cache, v_cache, tables, lens_t, ref, nbytes) in cases.items():
            kwargs = {"config": config} if config else {}
            if num_splits:
                kwargs["num_splits"] = num_splits
            fn = lambda: module.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, HEAD_DIM**-0.5, 4096, **kwargs)
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise AssertionError(f"decode {name}: relative error {err:.2e}")
            t = time_cuda_graph(fn, calls=10, repeat=10)
            row[name] = {"seconds": t, "percent_of_copy_bandwidth": 100 * nbytes / t / bandwidth, "relative_error": err}
        return row

    result = {"default": {"config": paged_attention.decode_config(HEAD_DIM), **measure(paged_attention)}}
    if baseline is not None:
        result["baseline"] = measure(baseline)
    if full_sweep:
        sweep, left = [], 0
        for bn, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
            if time.perf_counter() > deadline:
                left += 1
                continue
            config = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            try:
                sweep.append({"config": config, **measure(paged_attention, config)})
            except AssertionError:
                raise
            except Exception as e:  # a tile that does not fit: say so, go on
                print(f"  skip decode {config}: {type(e).__name__}: {str(e)[:80]}")
        sweep.sort(key=lambda r: r["256 x [100, 2048]"]["seconds"])
        result["sweep"] = sweep
        result["not_measured_budget"] = left
    if splits:
        tiles = [paged_attention.decode_config(HEAD_DIM)]
        tiles += [r["config"] for r in result.get("sweep", [])[:1] if r["config"] != tiles[0]]
        result["splits"] = [{"config": config, "num_splits": n, **measure(paged_attention, config, n)}
                            for config in tiles for n in DECODE_SPLITS]
        print("decode by number of splits, % of copy bandwidth (" + ", ".join(cases) + ")")
        for r in result["splits"]:
            print(f"  {str(r['config']):56s} {r['num_splits']:3d} "
                  + "  ".join(f"{r[w]['percent_of_copy_bandwidth']:5.1f}%" for w in cases))
    print("decode, % of copy bandwidth per workload (" + ", ".join(cases) + ")")
    for label, row in [("baseline", result.get("baseline")), ("default", result["default"])] + \
            [(str(r["config"]), r) for r in result.get("sweep", [])[:6]]:
        if row:
            print(f"  {label:70s} " + "  ".join(f"{row[w]['percent_of_copy_bandwidth']:5.1f}%" for w in cases))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="write the results as JSON here")
    parser.add_argument("--baseline", help="another paged_attention.py to time on the same inputs")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="start no new prefill config after this many seconds (default 200)")
    parser.add_argument("--jobs", type=int, default=8, help="processes compiling at once (default 8; 1: none)")
    parser.add_argument("--from-scratch", action="store_true",
                        help="only the FROM_SCRATCH variants of the best shapes (steps without cached keys)")
    parser.add_argument("--decode-sweep", action="store_true", help="sweep the decode kernel's tiles too")
    parser.add_argument("--decode-only", action="store_true", help="only the decode kernel (its sweep with --decode-sweep)")
    parser.add_argument("--decode-splits", action="store_true",
                        help="time the decode kernel's default tile and the sweep's best at each number of splits")
    parser.add_argument("--block-size", type=int, default=EngineConfig.__dataclass_fields__["block_size"].default,
                        help="KV cache block size (default: the engine's)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    ceilings = measure_ceilings()
    rate = ceilings["bf16_matmul_flops_per_s"]
    print(f"{ceilings['device']}: bf16 matmul {rate / 1e12:.0f} TFLOP/s, copy "
          f"{ceilings['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; block size {args.block_size}")
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    data = {name: make_inputs(lens, q_lens, args.block_size, generator) for name, (lens, q_lens) in WORKLOADS.items()}
    refs = {name: reference(*data[name][:4], *WORKLOADS[name]) for name in WORKLOADS}
    flops = {name: 4 * HEAD_DIM * HEADS * pairs(*WORKLOADS[name]) for name in WORKLOADS}

    def measure(module, config=None):
        row = {}
        for name, (lens, q_lens) in WORKLOADS.items():
            if (config or {}).get("FROM_SCRATCH") and name == CACHED:
                continue  # FROM_SCRATCH is for steps without cached keys only
            out = run(module, data[name], max(q_lens), config)
            err = ((out.float() - refs[name]).norm() / refs[name].norm()).item()
            if not err < 1e-2:  # bf16 operands: about 3e-3
                raise AssertionError(f"{name}, config {config}: relative error {err:.2e}")
            # Ten calls back to back in one CUDA graph, as the engine's layers run them: the
            # launch's host work (a few tens of microseconds) is hidden there, not timed here.
            t = time_cuda_graph(lambda: run(module, data[name], max(q_lens), config), calls=10, repeat=10)
            row[name] = {"seconds": t, "tflops": flops[name] / t / 1e12, "percent_of_matmul": 100 * flops[name] / t / rate,
                         "relative_error": err}
        return row

    def line(name, row):
        return f"  {name:58s} " + "  ".join(f"{row[w]['percent_of_matmul']:5.1f}%" if w in row else "    - "
                                             for w in WORKLOADS)

    report = {"ceilings": ceilings, "torch": torch.__version__, "triton": triton.__version__,
              "block_size": args.block_size,
              "workloads": {k: {"lens": v[0][:1], "q_lens": v[1][:1], "seqs": len(v[0])} for k, v in WORKLOADS.items()}}
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_attention", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    if args.decode_only:
        report["decode"] = decode_results(baseline, ceilings["copy_bandwidth_bytes_per_s"], args.block_size,
                                          args.decode_sweep, deadline, args.decode_splits)
        report["seconds"] = time.perf_counter() - t0
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"{report['seconds']:.0f} s in all; written to {args.out}")
        return
    print("% of the matmul rate per workload: " + ", ".join(WORKLOADS))
    if baseline is not None:
        report["baseline"] = measure(baseline)
        print(line("baseline " + args.baseline, report["baseline"]))
    defaults = paged_attention.prefill_config(HEAD_DIM, HEADS // KV_HEADS)
    report["default"] = {"config": defaults, **measure(paged_attention)}
    print(line("default " + label(defaults), report["default"]))

    results, skipped, left = {}, [], 0

    def sweep(configs, phase):
        nonlocal left
        configs = [c for c in configs if key(c) not in results]
        if time.perf_counter() > deadline:
            left += len(configs)
            print(f"  budget of {args.budget_s:.0f} s spent: the {len(configs)} configs of phase {phase} not measured")
            return
        failed = precompile(configs, args.block_size, args.jobs)
        for i, config in enumerate(configs):
            if time.perf_counter() > deadline:
                left += len(configs) - i
                print(f"  budget of {args.budget_s:.0f} s spent: {len(configs) - i} configs of phase {phase} not measured")
                return
            if key(config) in failed:
                skipped.append({"config": config, "error": failed[key(config)]})
                print(f"  skip {config}: {failed[key(config)][:100]}")
                continue
            full = {**defaults, **config}
            try:
                row = measure(paged_attention, full)
            except AssertionError:
                raise
            except Exception as e:  # a tile that does not fit in shared memory or registers: say so, go on
                skipped.append({"config": full, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(f"  skip {full}: {type(e).__name__}: {str(e)[:80]}")
                continue
            results[key(full)] = {"config": full, "rows": full["BLOCK_M"] * BLOCK_G, "phase": phase, **row}
            print(line(f"[{phase}: {i + 1:2d}/{len(configs)}, {time.perf_counter() - t0:4.0f} s] {label(full)}", row))

    if args.from_scratch:
        # Phase 3 alone: the kernel compiled without its gathered loops (FROM_SCRATCH), for
        # steps in which no sequence has cached keys, on the shapes measured best before.
        shapes = [shape_of(report["default"])] + [s for s in tile_configs()[:4] if s != shape_of(report["default"])]
        configs = [{**defaults, **shape, "FROM_SCRATCH": True, "PER_BLOCK": per_block}
                   for shape in shapes for per_block in (False, True)]
        print("phase 3: FROM_SCRATCH (the cached workload left out)")
        sweep(configs, 3)
        report["from_scratch"] = sorted(results.values(), key=lambda r: r[list(WORKLOADS)[0]]["seconds"])
        report["seconds"] = time.perf_counter() - t0
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"{report['seconds']:.0f} s in all; written to {args.out}")
        return

    print("phase 1: tile shapes, default switches")
    sweep([{**shape, **{k: defaults[k] for k in SWITCH_NAMES}} for shape in tile_configs()], 1)
    first = list(WORKLOADS)[0]
    # The three fastest shapes on the first workload, and the fastest on the cached one.
    shapes = [shape_of(r) for r in sorted(results.values(), key=lambda r: r[first]["seconds"])[:3]]
    if results:
        cached_best = shape_of(min(results.values(), key=lambda r: r[CACHED]["seconds"]))
        shapes += [cached_best] if cached_best not in shapes else []
    print(f"phase 2: the switches on {len(shapes)} shapes")
    sweep([v for shape in shapes for v in switch_variants(shape, defaults)], 2)

    rows = sorted(results.values(), key=lambda r: r[first]["seconds"])
    report["sweep"] = rows
    report["skipped"] = skipped
    report["not_measured_budget"] = left
    report["best_per_workload"] = {
        w: {"config": best["config"], "seconds": best[w]["seconds"], "percent_of_matmul": best[w]["percent_of_matmul"]}
        for w in WORKLOADS for best in [min(rows, key=lambda r: r[w]["seconds"])]} if rows else {}
    reference_row = report.get("baseline", report["default"])
    allowed = [r for r in rows if r[CACHED]["seconds"] <= reference_row[CACHED]["seconds"]]
    if allowed:
        pick = allowed[0]
        report["choice"] = {
            "config": pick["config"],
            "rule": f"fastest on {first!r} among the configs no slower than the "
                    f"{'baseline' if 'baseline' in report else 'default'} on {CACHED!r}",
            **{w: {"percent_of_matmul": pick[w]["percent_of_matmul"],
                   "speedup": reference_row[w]["seconds"] / pick[w]["seconds"]} for w in WORKLOADS}}
    else:
        report["choice"] = None
    report["decode"] = decode_results(baseline, ceilings["copy_bandwidth_bytes_per_s"], args.block_size,
                                      args.decode_sweep, t0 + args.budget_s + 30)
    report["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

    print(f"\nbest of {len(rows)} configs measured ({len(skipped)} skipped, {left} not measured), "
          f"% of the matmul rate ({rate / 1e12:.0f} TFLOP/s): " + ", ".join(WORKLOADS))
    for name, row in [("baseline", report.get("baseline")), ("default", report["default"])] + \
            [(label(r["config"]), r) for r in rows[:8]]:
        if row:
            print(line(name, row))
    for w, best in report["best_per_workload"].items():
        print(f"  best on {w}: {best['percent_of_matmul']:.1f}% with {label(best['config'])}")
    if report["choice"]:
        print(f"choice ({report['choice']['rule']}): {report['choice']['config']}")
    else:
        print(f"no config is as fast as the reference on {CACHED}")
    print(f"{report['seconds']:.0f} s in all; written to {args.out}")


if __name__ == "__main__":
    main()
