"""Grading: the tests in this folder run against your copies of the exercise files.

``exercises/minivllm/`` holds a copy of each package file that has an exercise in it. While
these tests run, an import hook makes every such module load from that copy: when any part
of the engine does ``import minivllm.ops.norm``, it gets your ``rms_norm``. Every other
module of ``minivllm`` comes from the package itself. With ``--solutions`` (or the
environment variable ``MINIVLLM_GRADE=solutions``) the copies come from ``solutions/``
instead, the reference answers. The environment variable ``MINIVLLM_SOLUTIONS_DIR`` names
another folder to take the reference copies from (laid out as ``solutions/``: ``<dir>/minivllm/...``);
``scripts/check_mutations.py`` uses it to grade deliberately wrong answers without touching
``solutions/``.

Each chapter is graded on its own: while the tests of chapter NN run (``test_chNN_*.py``),
the functions that belong to other chapters' exercises are swapped for the reference ones,
so an unfinished chapter 03 cannot fail chapter 01's tests and a chapter 01 mistake cannot
fail chapter 03's.

    make grade                      # grade all your answers (pytest exercises)
    make grade CH=01                # one chapter (pytest exercises/test_ch01_*.py); CH=1 too
    make grade CH=01 SOLUTIONS=1    # the same tests against the reference answers (--solutions)
"""
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# Without a GPU the Triton kernels (chapter 09) run in Triton's interpreter; the switch must
# be set before anything imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PACKAGE = "minivllm"
TREES = {
    "exercises": HERE,
    "solutions": Path(os.environ.get("MINIVLLM_SOLUTIONS_DIR") or ROOT / "solutions").resolve(),
}
CHAPTER_FILE = re.compile(r"^test_(ch\d\d)_")
GRADING = pytest.StashKey[dict]()  # mode, finder, sources


def _load_by_path(name: str, path: Path):
    """A module from its file, without importing the package around it."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


# The import hook and the swap of a function's code, shared with the notebooks' switch
# (minivllm/learner.py).
learner = _load_by_path("_minivllm_learner", ROOT / PACKAGE / "learner.py")
GradedCopyFinder = learner.CopyFinder


def _generator():
    """scripts/make_exercises.py, which knows where the regions are."""
    return _load_by_path("_make_exercises", ROOT / "scripts" / "make_exercises.py")


def pytest_addoption(parser):
    parser.addoption(
        "--solutions",
        action="store_true",
        help="grade the reference copies in solutions/ instead of your copies in exercises/",
    )


def pytest_configure(config):
    mode = "solutions" if config.getoption("--solutions") else os.environ.get("MINIVLLM_GRADE", "exercises")
    if mode not in TREES:
        raise pytest.UsageError(f"MINIVLLM_GRADE={mode!r}: use 'exercises' or 'solutions'")
    for arg in config.args:
        path = (Path(config.invocation_params.dir) / arg.split("::")[0]).resolve()
        if path.exists() and path != HERE and HERE not in path.parents:
            # The grader swaps modules of minivllm for the whole process: other tests would
            # run against the exercise copies too.
            raise pytest.UsageError(f"grade exercises/ in a run of its own: {arg} is outside it")
    gen = _generator()
    try:
        sources = gen.scan(ROOT)
    except gen.MarkerError as e:
        raise pytest.UsageError(f"the solution markers in the package are malformed:\n{e}") from None
    missing = [f"{_shown(TREES[tree])}/{s.rel}" for s in sources for tree in TREES if not (TREES[tree] / s.rel).is_file()]
    if missing:
        raise pytest.UsageError(
            "missing generated files (run python scripts/make_exercises.py): " + ", ".join(missing)
        )
    # The grader picks the copies itself: the notebooks' switch must not add a hook of its own
    # when minivllm is imported again below.
    os.environ.pop("MINIVLLM_LEARNER", None)
    # Anything of minivllm imported before now came from the package; import it again.
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    finder = GradedCopyFinder(TREES[mode])
    sys.meta_path.insert(0, finder)
    config.stash[GRADING] = dict(mode=mode, finder=finder, sources=sources)


def pytest_unconfigure(config):
    grading = config.stash.get(GRADING, None)
    if grading and grading["finder"] in sys.meta_path:
        sys.meta_path.remove(grading["finder"])


def _shown(tree: Path) -> str:
    """A tree's folder as the reader knows it: relative to the repository when inside it."""
    return tree.relative_to(ROOT).as_posix() if tree.is_relative_to(ROOT) else str(tree)


def _graded_line(config) -> str:
    grading = config.stash[GRADING]
    tree = _shown(TREES[grading["mode"]])
    who = "your copies" if grading["mode"] == "exercises" else "the reference copies"
    return f"graded: {who} in {tree}/{PACKAGE}/ (the rest of {PACKAGE} from {PACKAGE}/)"


def pytest_report_header(config):
    grading = config.stash[GRADING]
    tree = _shown(TREES[grading["mode"]])
    files = ", ".join(f"{tree}/{s.rel}" for s in grading["sources"])
    return [_graded_line(config), f"graded files: {files}"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(_graded_line(config))


# --- one chapter at a time ------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _grade_one_chapter(request):
    """Your code for this file's chapter; the reference for every other chapter's regions."""
    grading = request.config.stash[GRADING]
    match = CHAPTER_FILE.match(Path(request.module.__file__).name)
    chapter = match.group(1) if match else None
    tree = TREES[grading["mode"]]
    undo = []
    try:
        for source in grading["sources"]:
            swaps = [] if grading["mode"] == "solutions" or chapter is None else [
                function for function, of in source.functions().items() if of != chapter
            ]
            if swaps:
                try:
                    importlib.import_module(source.module)
                except ImportError:
                    continue  # needs what this machine lacks (a GPU library): nothing here can call it
            module = sys.modules.get(source.module)
            if module is None:
                continue
            expected = tree / source.rel
            if Path(module.__file__).resolve() != expected:
                pytest.fail(
                    f"{source.module} was loaded from {module.__file__}, not from {expected}: "
                    f"something imported {PACKAGE} before the grader was set up",
                    pytrace=False,
                )
            for function in swaps:
                code = learner.reference_code(TREES["solutions"] / source.rel, function)
                undo.append(learner.swap_in(module, function, code))
        yield chapter
    finally:
        for step in reversed(undo):
            step()


# --- shared fixtures ------------------------------------------------------------------

# Fresh random examples every run (no example database), no per-example deadline: the
# first call into torch is slow and says nothing about the answer.
settings.register_profile(
    "grading", deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("grading")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny random-weight Qwen3 checkpoint, float32, written by transformers itself."""
    from minivllm.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3", seed=0)


@pytest.fixture(scope="session")
def hf_qwen3(tiny_qwen3):
    """transformers' own model on the same checkpoint: the reference for end-to-end tests."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
