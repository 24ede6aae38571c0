"""Plot the bundled model's loss curve from its training log.

Train loss is noisy step to step (each step sees 32 random windows), so it is drawn
faintly as recorded and boldly as a moving average; validation loss is exact (every
held-out window, every --eval-every steps). The gap between them is over-fitting, and
the marked step is the checkpoint that ships.

    python scripts/plot_training.py benchmarks/bundled_model_training.json \
        --out benchmarks/bundled_model_loss.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    return np.convolve(x, np.ones(window) / window, mode="valid")


def plot(log: dict, out: Path, window: int) -> None:
    train = np.asarray(log["train_loss"])
    steps = np.arange(1, len(train) + 1)
    val_steps = [e["step"] for e in log["evals"]]
    val = [e["val_loss"] for e in log["evals"]]
    tokens_per_step = log["hyperparameters"]["batch_size"] * log["hyperparameters"]["seq_len"]

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=130)
    ax.plot(steps, train, color="tab:blue", alpha=0.2, linewidth=0.6)
    ax.plot(steps[window - 1 :], moving_average(train, window), color="tab:blue",
            label=f"train (mean of {window} steps)")
    ax.plot(val_steps, val, color="tab:orange", marker="o", markersize=2.5, label="validation (held-out 5%)")
    best = log["best_step"]
    ax.axvline(best, color="grey", linestyle="--", linewidth=0.8)
    ax.annotate(f"shipped: step {best}\nval {log['best_val_loss']:.3f}", xy=(best, log["best_val_loss"]),
                xytext=(8, 30), textcoords="offset points", fontsize=8,
                arrowprops={"arrowstyle": "->", "color": "grey"})
    ax.set_xlabel(f"optimizer step ({tokens_per_step:,} tokens each)")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_ylim(2.0, 7.5)
    ax.set_xlim(0, len(train))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    ax.set_title("Bundled model: training and validation loss")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path, nargs="?", default=Path("benchmarks/bundled_model_training.json"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/bundled_model_loss.png"))
    p.add_argument("--window", type=int, default=50, help="moving-average window for the train loss, in steps")
    args = p.parse_args()
    plot(json.loads(args.log.read_text()), args.out, args.window)


if __name__ == "__main__":
    main()
