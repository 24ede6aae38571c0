#!/usr/bin/env python
"""How much of the package one engine step runs, outside the model's forward pass: the
functions a reader follows to understand a step (LLMEngine.step down to the sampler and the
outputs), found by running steps under a profiler hook, not by listing them by hand.

    python scripts/count_step_path.py                 # the synchronous step, features off
    python scripts/count_step_path.py --async         # the overlapped step (chapter 17)

Counted: every function of minivllm that a step calls, outside the model (models/, layers/
other than the sampler, ops/, kernels/), by its whole length (def to end), each once.
"""
import argparse
import inspect
import sys
from pathlib import Path

from minivllm import LLM, SamplingParams

PACKAGE = Path(__file__).resolve().parents[1] / "minivllm"
MODEL_PARTS = ("models", "ops", "kernels", "layers")
KEEP = {"layers/sampler.py"}  # the sampler is the step's, not the model's


def on_the_path(filename: str) -> bool:
    path = Path(filename)
    if PACKAGE not in path.parents:
        return False
    rel = path.relative_to(PACKAGE).as_posix()
    return rel in KEEP or not rel.startswith(MODEL_PARTS)


def step_path(async_scheduling: bool = False) -> dict[str, tuple[str, int]]:
    """{"file:line": (function, its lines)} of every function the steps of two sampled
    requests run on the bundled model, on the path (see the module's docstring)."""
    engine = LLM(async_scheduling=async_scheduling, num_kv_blocks=64, device="cpu").engine
    for i in range(2):
        engine.add_request(list(range(10, 40)), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6), f"r{i}")
    seen = {}

    def hook(frame, event, arg):
        # (A comprehension or lambda is a code object of its own, inside a function counted whole.)
        if event == "call" and on_the_path(frame.f_code.co_filename) and "<" not in frame.f_code.co_qualname:
            seen[frame.f_code] = None

    sys.setprofile(hook)
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        sys.setprofile(None)
    functions = {}
    for code in seen:
        try:
            lines, _ = inspect.getsourcelines(code)
        except (OSError, TypeError):
            continue
        where = f"{Path(code.co_filename).relative_to(PACKAGE).as_posix()}:{code.co_firstlineno}"
        functions[where] = (code.co_qualname, len(lines))
    engine.shutdown()
    return functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--async", dest="async_scheduling", action="store_true")
    functions = step_path(parser.parse_args().async_scheduling)
    by_file = {}
    for where, (name, n) in sorted(functions.items()):
        by_file.setdefault(where.split(":")[0], []).append((name, n))
    for file, items in by_file.items():
        print(f"{file}: {sum(n for _, n in items)} lines in {len(items)} functions")
        for name, n in items:
            print(f"    {name} ({n})")
    total = sum(n for _, n in functions.values())
    longest = max(functions.values(), key=lambda f: f[1])
    print(f"\n{len(functions)} functions, {total} lines; the longest is {longest[0]} ({longest[1]} lines)")


if __name__ == "__main__":
    main()
