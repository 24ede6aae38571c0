#!/usr/bin/env python
"""Draw the book's architecture figure from the code: the hooks of
``minivllm.step_hooks.StepFeature`` in the order the step calls them, which part of the step
calls each, and the hooks each feature of ``minivllm.engine.llm_engine.FEATURES`` overrides
(read from the classes, not written by hand).

    python scripts/plot_architecture.py   # writes book/images/step_features.png
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minivllm.engine.llm_engine import FEATURES  # noqa: E402
from minivllm.step_hooks import hook_names, overridden_hooks  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "book" / "images" / "step_features.png"
# Which method of LLMEngine calls each hook: the step's three parts, and the calls around it.
CALLER = {"before_schedule": "step", "after_schedule": "schedule", "prepare": "execute",
          "after_execute": "execute", "after_sample": "update", "on_finish": "update / abort_request",
          "on_abort": "abort_request", "has_unfinished": "has_unfinished_requests", "shutdown": "shutdown"}
COLORS = {"step": "#4c72b0", "schedule": "#4c72b0", "execute": "#dd8452", "update": "#55a868"}


def main() -> None:
    hooks = hook_names()
    fig, ax = plt.subplots(figsize=(10, 5))
    for x, feature in enumerate(FEATURES, start=1):
        module = feature.__module__.removeprefix("minivllm.").replace(".", ".\n", 1)
        ax.text(x, len(hooks) - 0.4, f"{feature.__name__}\n{module}", ha="center", va="bottom", fontsize=8)
        overrides = overridden_hooks(feature)
        for y, hook in enumerate(reversed(hooks)):
            color = COLORS.get(CALLER[hook].split()[0], "#777777")
            ax.plot(x, y, "o" if hook in overrides else ".", color=color if hook in overrides else "#cccccc",
                    markersize=11 if hook in overrides else 6)
    for y, hook in enumerate(reversed(hooks)):
        ax.text(0.45, y, f"{hook}   (in LLMEngine.{CALLER[hook]})", ha="right", va="center", fontsize=9,
                color=COLORS.get(CALLER[hook].split()[0], "#777777"))
    ax.set_xlim(-3.4, len(FEATURES) + 0.7)
    ax.set_ylim(-0.7, len(hooks) + 0.9)
    ax.axis("off")
    ax.set_title("Each feature beside the step, and the hooks of minivllm.step_hooks.StepFeature it overrides\n"
                 "(blue: schedule, orange: execute, green: update; grey: outside the step)", fontsize=10)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=120, bbox_inches="tight")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
