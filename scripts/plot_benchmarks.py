#!/usr/bin/env python
"""Draw the benchmark figure from the JSON files that ``minivllm bench`` writes.

Reads benchmarks/throughput.json, latency.json and kernels.json (any of them may be
missing: its panels are left out), and throughput_with_transformers.json for the
transformers baseline when throughput.json was run without it; writes
benchmarks/speed_of_light.png: every measured number next to its floor on the same GPU.

- throughput: output tokens per second of minivllm, its speed of light (output tokens over
  the summed floor of the engine's actual steps) and the transformers baselines;
- batch-1 decode: time per output token, eager and with CUDA graphs, against the floor of
  reading the weights once;
- time to first token by prompt length, against the floor of one prefill step;
- paged decode attention: achieved bandwidth of each kernel case against the copy bandwidth.

    python scripts/plot_benchmarks.py                    # benchmarks/ -> benchmarks/speed_of_light.png
    python scripts/plot_benchmarks.py --dir out --out out/sol.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minivllm.bench.roofline import QWEN3_0_6B  # noqa: E402
from minivllm.bench.throughput import speed_of_light  # noqa: E402
from minivllm.config import ModelConfig  # noqa: E402
from minivllm.engine.trace import StepRecord  # noqa: E402

OURS, FLOOR, BASELINE, EAGER = "#4c72b0", "gray", "#dd8452", "#dd8452"


def load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def prefill_floor(tokens: int, ceilings: dict, params: int) -> float:
    """The floor of one step that prefills a `tokens`-token prompt of Qwen3-0.6B's shapes."""
    config = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **QWEN3_0_6B})
    step = StepRecord(step=0, seqs=[(0, tokens, "prefill")], blocks_in_use=0, num_blocks=0, cache_hit_tokens=0,
                      preempted=[], finished=[], seconds=0.0, kv_tokens_read=tokens,
                      attention_pairs=tokens * (tokens + 1) // 2)
    return speed_of_light([step], config, params, ceilings)["floor_seconds"]


def label_bars(ax, xs, values, fmt):
    for x, v in zip(xs, values):
        ax.text(x, v * 1.12, fmt(v), ha="center", fontsize=8)


def throughput_panel(ax, t: dict, baseline: dict | None) -> None:
    """``baseline``: the run that holds the transformers numbers, when ``t`` has none."""
    m, w = t["minivllm"], t["workload"]
    bars = {"speed of light": w["total_output_tokens"] / m["speed_of_light"]["floor_seconds"],
            "minivllm": m["output_tokens_per_s"]}
    colors = [FLOOR, OURS]
    run = t if t.get("transformers") else baseline
    if run is not None and run is not t:
        bars["minivllm\n(baseline's run)"] = run["minivllm"]["output_tokens_per_s"]
        colors.append(OURS)
    for key, label in (("generate_batch", "transformers\ngenerate_batch"), ("padded_generate", "transformers\npadded")):
        result = ((run or {}).get("transformers") or {}).get(key, {})
        if "output_tokens_per_s" in result:
            bars[label] = result["output_tokens_per_s"]
            colors.append(BASELINE)
    ax.bar(list(bars), list(bars.values()), color=colors)
    label_bars(ax, range(len(bars)), list(bars.values()), lambda v: f"{v:,.0f}")
    ax.set_yscale("log")
    ax.set_ylim(top=5 * max(bars.values()))
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"throughput, {w['requests']} requests: {m['percent_of_speed_of_light']:.0f}% of the speed of light",
                 fontsize=10)
    ax.tick_params(axis="x", labelsize=8)


def decode_panel(ax, lat: dict) -> None:
    names = ["eager", "CUDA graphs", "floor"]
    values = [lat["eager"]["time_per_output_token_s"], lat["cuda_graphs"]["time_per_output_token_s"],
              lat["decode_floor_s_per_token"]]
    ax.bar(names, [v * 1e3 for v in values], color=[EAGER, OURS, FLOOR])
    label_bars(ax, range(3), [v * 1e3 for v in values], lambda v: f"{v:.2f} ms")
    ax.set_yscale("log")
    ax.set_ylim(top=5 * values[0] * 1e3)
    ax.set_ylabel("ms per output token")
    ax.set_title(f"batch-1 decode: {lat['percent_of_speed_of_light_with_graphs']:.0f}% of the speed of light",
                 fontsize=10)


def ttft_panel(ax, lat: dict) -> None:
    measured = lat["cuda_graphs"]["ttft_seconds"]
    params = lat["cuda_graphs"]["weight_bytes"] // 2
    lengths = list(measured)
    floors = [prefill_floor(int(n), lat["ceilings"], params) for n in lengths]
    xs = range(len(lengths))
    ax.bar([x - 0.2 for x in xs], [measured[n] * 1e3 for n in lengths], 0.4, color=OURS, label="measured")
    ax.bar([x + 0.2 for x in xs], [f * 1e3 for f in floors], 0.4, color=FLOOR, label="floor")
    ax.set_xticks(list(xs), [f"{int(n):,}" for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_yscale("log")
    ax.set_ylim(top=5 * max(measured.values()) * 1e3)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("time to first token", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncols=2)


def kernels_panel(ax, k: dict) -> None:
    cases = k["paged_decode_attention"]
    labels = [f"{c['batch']} x\n{c['context']:,}" for c in cases]
    ax.bar(labels, [c["bytes_per_s"] / 1e12 for c in cases], color=OURS)
    ax.axhline(k["ceilings"]["copy_bandwidth_bytes_per_s"] / 1e12, color=FLOOR, ls="--", label="copy bandwidth")
    ax.set_xlabel("sequences x context tokens")
    ax.set_ylabel("achieved bandwidth (TB/s)")
    ax.set_title("paged decode attention kernel", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(top=1.3 * k["ceilings"]["copy_bandwidth_bytes_per_s"] / 1e12)


def draw(folder: Path, out: Path) -> Path:
    t, lat, k = load(folder, "throughput"), load(folder, "latency"), load(folder, "kernels")
    baseline = load(folder, "throughput_with_transformers")
    panels = [(lambda ax, data: throughput_panel(ax, data, baseline), t)] if t else []
    if lat:
        panels += [(decode_panel, lat), (ttft_panel, lat)]
    if k:
        panels.append((kernels_panel, k))
    if not panels:
        raise FileNotFoundError(f"no throughput.json, latency.json or kernels.json in {folder}")
    cols = min(2, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 3.6 * rows), squeeze=False)
    for ax, (panel, data) in zip(axes.flat, panels):
        panel(ax, data)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    device = next(d["ceilings"]["device"] for d in (t, lat, k) if d)
    fig.suptitle(f"minivllm against the speed of light: random weights with Qwen3-0.6B's shapes, bf16, {device}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=ROOT / "benchmarks", help="folder with the JSON files")
    parser.add_argument("--out", type=Path, default=None, help="image to write (default: DIR/speed_of_light.png)")
    args = parser.parse_args(argv)
    out = draw(args.dir, args.out or args.dir / "speed_of_light.png")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
