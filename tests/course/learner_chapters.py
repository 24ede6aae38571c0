"""The learner switch at every chapter, in one process (``tests/course/test_learner.py`` runs it).

    python tests/course/learner_chapters.py done WORKDIR        # chapters 01..N answered
    python tests/course/learner_chapters.py untouched WORKDIR   # chapters 01..N-1 answered, N not

For each chapter N that has exercises, it writes a learner's folder of copies into WORKDIR:
the regions of chapters up to N (``done``) or before N (``untouched``) hold the reference
code, the later ones their untouched stubs. It then imports minivllm afresh with the switch
at N on that folder and generates on the bundled model: a greedy request, a sampled one and
the asynchronous loop, so the common path's exercises of many chapters run. ``done`` expects
the package's tokens; ``untouched`` expects the same tokens or chapter N's own
NotImplementedError, and checks where each exercise function's code comes from: chapter N's
from the learner's stub, later chapters' from the reference. One line per chapter, "ok" or
the problem; the exit status is the number of problems.
"""
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


def load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


learner = load_by_path("_learner_under_test", ROOT / "minivllm" / "learner.py")
gen = load_by_path("_make_exercises_under_test", ROOT / "scripts" / "make_exercises.py")
SOURCES = gen.scan(ROOT)
CHAPTERS = sorted({region.number for source in SOURCES for region in source.regions})


def write_tree(folder: Path, answered: int) -> Path:
    for source in SOURCES:
        path = folder / source.rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(gen.render(source, "exercises", ROOT, answered=answered), encoding="utf-8")
    return folder


def fresh_import(tree: Path | None, up_to: int | None):
    """minivllm imported anew: from the package (tree None) or through the switch."""
    for finder in [f for f in sys.meta_path if isinstance(f, learner.CopyFinder)]:
        sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n == "minivllm" or n.startswith("minivllm.")]:
        del sys.modules[name]
    learner.install(tree, up_to)
    return importlib.import_module("minivllm")


def generate(minivllm) -> list[list[int]]:
    llm = minivllm.LLM(seed=0, async_scheduling=True)
    params = [
        minivllm.SamplingParams(temperature=0, max_tokens=8),
        minivllm.SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8),
    ]
    prompts = ["The capital of France is the city of", "Once upon a time, in a land far away,"]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    return [output.outputs[0].token_ids for output in outputs]


def misplaced(tree: Path, chapter: int) -> list[str]:
    """Exercise functions whose code is not where the switch at ``chapter`` should take it from."""
    problems = []
    for source in SOURCES:
        try:
            module = importlib.import_module(source.module)
        except ImportError:
            continue  # needs what this machine lacks
        for qualname, of in learner.chapters_of(source.rel).items():
            function = module
            for part in qualname.split("."):
                function = vars(function)[part] if isinstance(function, type) else getattr(function, part)
            function = getattr(function, "fget", function)
            function = getattr(function, "__func__", function)
            function = getattr(function, "fn", function)
            function = inspect.unwrap(function)  # a decorated function (torch.inference_mode): its own code
            filename = Path(function.__code__.co_filename)
            stub = any(isinstance(c, str) and c.startswith(f"ch{of:02d}: ") for c in function.__code__.co_consts)
            if of == chapter and not (filename == tree / source.rel and stub):
                problems.append(f"{qualname} (ch{of:02d}) is not the learner's stub: {filename}")
            elif of > chapter and (filename == tree / source.rel or stub):
                problems.append(f"{qualname} (ch{of:02d}) runs the learner's copy at chapter {chapter:02d}")
    return problems


def check(mode: str, workdir: Path, chapter: int, expected) -> str:
    answered = chapter if mode == "done" else chapter - 1
    tree = write_tree(workdir / f"ch{chapter:02d}-{mode}", answered)
    minivllm = fresh_import(tree, chapter)
    stopped = ""
    try:
        tokens = generate(minivllm)
    except NotImplementedError as e:
        if mode == "done" or not str(e).startswith(f"ch{chapter:02d}: "):
            return f"NotImplementedError: {str(e)[:120]}"
        tokens, stopped = expected, " (the generation stops with its message)"
    if tokens != expected:
        return f"tokens {tokens}, the package's {expected}"
    problems = misplaced(tree, chapter) if mode == "untouched" else []
    return "; ".join(problems) or "ok" + stopped


def main(mode: str, workdir: str) -> int:
    os.environ.pop(learner.SWITCH, None)
    expected = generate(fresh_import(None, None))
    failures = 0
    for chapter in CHAPTERS:
        line = check(mode, Path(workdir), chapter, expected)
        failures += not line.startswith("ok")
        print(f"ch{chapter:02d}: {line}", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
