"""Run minivllm on the learner's copies of the exercise files, chapter by chapter: the import
hook that the grader (``exercises/conftest.py``) and the notebooks share.

``exercises/minivllm/`` (the learner's answers) and ``solutions/minivllm/`` (the reference)
hold a copy of each package file that has an exercise in it. With the hook installed,
``import minivllm.ops.norm`` loads that copy; every other module of ``minivllm`` comes from
the package itself. The notebooks switch it on with the environment variable
``MINIVLLM_LEARNER`` (read when ``minivllm`` is first imported; each notebook's first cell
sets it too):

    MINIVLLM_LEARNER=07 make lab           # chapters 01-07 on your answers, 08-19 on the reference
    MINIVLLM_LEARNER=7 ...                 # the same
    MINIVLLM_LEARNER=01 ...                # chapter 01 alone on your answers
    MINIVLLM_LEARNER=1 ...                 # every chapter on your answers (also: all, exercises)
    MINIVLLM_LEARNER=solutions ...         # every chapter on the reference copies (how CI checks it)
    MINIVLLM_LEARNER=0 ...                 # off: the package as it is (also: empty)

``1`` means every chapter, as it always has; chapter 01 alone is written ``01``.

How a chapter switch works. A module may hold exercises of several chapters (chapter 16's
``split_rows`` sits in a file every model uses), so the switch works function by function:
every solution region lies in one function, and all regions of a function belong to one
chapter (``scripts/make_exercises.py`` checks both and knows each region's chapter from its
``# BEGIN SOLUTION chNN key`` marker in the package). At chapter N, a module whose exercises
all belong to chapters after N is the package's own; any other exercise module is loaded
from your copy, and right after it runs, each function of a chapter after N gets the
reference's code from ``solutions/minivllm/`` (its ``__code__`` is swapped in place, so
every name bound to the function sees the change; a Triton kernel is told its new source).
Your functions of chapters 01..N keep your code, your file and your line numbers: an
exercise you have not done yet stops with its own chapter's ``NotImplementedError``, and a
later chapter's untouched stub never runs, whatever your copy holds for it.

This module imports nothing of the package, so the grader can load it by path before any
``minivllm`` module exists.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import re
import sys
import textwrap
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "minivllm"
TREES = {"exercises": ROOT / "exercises", "solutions": ROOT / "solutions"}
SWITCH = "MINIVLLM_LEARNER"
GENERATOR = ROOT / "scripts" / "make_exercises.py"
USAGE = (
    "use a chapter (07 or 7: chapters up to 07 on your copies, later ones on the reference), "
    "1 (or all, exercises) for every chapter on your copies, solutions for the reference, 0 for off"
)


def parse(value: str) -> tuple[Path | None, int | None]:
    """The switch's value as (the folder of copies, the last chapter that uses them).

    The chapter is None where every chapter does; the folder is None where the switch is off.
    """
    value = value.strip().lower()
    if value in ("", "0", "off"):
        return None, None
    if value in ("1", "all", "exercises"):
        return TREES["exercises"], None
    if value == "solutions":
        return TREES["solutions"], None
    if value.isdigit() and 1 <= int(value) <= 99:
        return TREES["exercises"], int(value)
    if value.isdigit() and int(value) == 0:
        return None, None
    raise ValueError(f"{SWITCH}={value!r}: {USAGE}")


@functools.cache
def _generator():
    """scripts/make_exercises.py, loaded by path: it knows where the regions are."""
    spec = importlib.util.spec_from_file_location("_minivllm_make_exercises", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


@functools.cache
def chapters_of(rel: str) -> dict[str, int]:
    """{function qualname: chapter} for the regions of package file ``rel`` (minivllm/x/y.py)."""
    path = ROOT / rel
    if not path.is_file():
        return {}
    gen = _generator()
    text = path.read_text(encoding="utf-8")
    regions, _ = gen.find_regions(rel, text)  # the markers' chapters; their hints are the generator's business
    errors = gen.attach_functions(rel, text, regions)
    if errors:
        raise ImportError(f"the solution markers of {rel} are malformed:\n" + "\n".join(errors))
    return {region.function: region.number for region in regions}


@functools.cache
def _compiled(path: Path) -> types.CodeType:
    return compile(path.read_text(encoding="utf-8"), str(path), "exec")


def reference_code(path: Path, qualname: str) -> types.CodeType:
    """The code object of function ``qualname`` in the file at ``path``, without running it."""

    def walk(code, prefix):
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                name = prefix + const.co_name
                if name == qualname:
                    return const
                found = walk(const, name + ".")
                if found is not None:
                    return found
        return None

    found = walk(_compiled(path), "")
    if found is None:
        raise LookupError(f"{qualname} is not in {path}; run python scripts/make_exercises.py")
    return found


def _tell_kernel(raw, function: types.FunctionType):
    """A Triton kernel reads its function's source once: give it the source of the new code."""
    interpreted = getattr(type(raw), "rewritten_fn", None)
    if isinstance(interpreted, dict):  # Triton's interpreter caches the rewritten function
        interpreted.pop(function, None)
    if hasattr(raw, "_unsafe_update_src"):  # a compiled kernel: its source, from def on
        source = textwrap.dedent("".join(inspect.getsourcelines(function)[0]))
        raw._unsafe_update_src(source[re.search(r"^def\s+\w+\s*\(", source, re.MULTILINE).start():])


def swap_in(module: types.ModuleType, qualname: str, code: types.CodeType):
    """Make ``module.<qualname>`` run ``code``; return a function that undoes it."""
    *outer, name = qualname.split(".")
    owner = module
    for part in outer:
        owner = getattr(owner, part)
    raw = vars(owner)[name]
    target = raw
    if isinstance(target, (staticmethod, classmethod)):
        target = target.__func__
    elif isinstance(target, property):
        target = target.fget
    target = inspect.unwrap(target)
    target = getattr(target, "fn", target)  # a kernel decorator keeps the function as .fn
    if isinstance(target, types.FunctionType) and target.__code__.co_freevars == code.co_freevars:
        # Swapping the code keeps every existing reference (``from ... import f``) in step.
        old = target.__code__
        target.__code__ = code
        _tell_kernel(raw, target)

        def undo():
            target.__code__ = old
            _tell_kernel(raw, target)

        return undo
    if isinstance(target, types.FunctionType) and set(code.co_freevars) <= {"__class__"}:
        cells = tuple(types.CellType(owner) for _ in code.co_freevars)
        new = types.FunctionType(code, target.__globals__, target.__name__, target.__defaults__, cells)
        new.__kwdefaults__ = target.__kwdefaults__
        wrapped = type(raw)(new) if isinstance(raw, (staticmethod, classmethod)) else new
        setattr(owner, name, wrapped)
        return lambda: setattr(owner, name, raw)
    raise TypeError(f"cannot swap the reference into {module.__name__}.{qualname} ({type(raw).__name__})")


class CopyLoader(importlib.machinery.SourceFileLoader):
    """Run the learner's copy of a module, then give its later chapters' functions the reference code."""

    def __init__(self, fullname: str, path: Path, reference: Path, later: list[str]):
        super().__init__(fullname, str(path))
        self.reference = reference
        self.later = later

    def exec_module(self, module):
        super().exec_module(module)
        for qualname in self.later:
            swap_in(module, qualname, reference_code(self.reference, qualname))


class CopyFinder(importlib.abc.MetaPathFinder):
    """Load ``minivllm.X.Y`` from ``<tree>/minivllm/X/Y.py`` when that copy exists.

    ``up_to``: the last chapter whose functions keep the copy's code; None: every chapter.
    """

    def __init__(self, tree: Path, up_to: int | None = None):
        self.tree = tree
        self.up_to = up_to

    def copy_of(self, fullname: str) -> Path | None:
        parts = fullname.split(".")
        as_module = self.tree.joinpath(*parts).with_suffix(".py")
        as_package = self.tree.joinpath(*parts, "__init__.py")
        for copy in (as_module, as_package):
            if copy.is_file():
                return copy
        return None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        copy = self.copy_of(fullname)
        if copy is None and fullname == PACKAGE:
            # The package next to the trees, never exercises/minivllm as a namespace package.
            return importlib.machinery.PathFinder.find_spec(fullname, [str(ROOT)])
        if copy is None:
            return None
        later = []
        if self.up_to is not None:
            rel = copy.relative_to(self.tree).as_posix()
            chapters = chapters_of(rel)
            later = [function for function, chapter in chapters.items() if chapter > self.up_to]
            if chapters and len(later) == len(chapters):
                return None  # nothing of this module is the learner's yet: the package's own
        loader = CopyLoader(fullname, copy, TREES["solutions"] / copy.relative_to(self.tree), later)
        if copy.name == "__init__.py":
            # A package's own code from the copy, its submodules from the real package.
            real = ROOT.joinpath(*fullname.split("."))
            return importlib.util.spec_from_file_location(
                fullname, copy, loader=loader, submodule_search_locations=[str(real)]
            )
        return importlib.util.spec_from_file_location(fullname, copy, loader=loader)


def install(tree: Path | None, up_to: int | None = None) -> CopyFinder | None:
    """Put the hook first on ``sys.meta_path``; the modules imported from then on use it."""
    if tree is None:
        return None
    finder = CopyFinder(tree, up_to)
    sys.meta_path.insert(0, finder)
    return finder


def active() -> Path | None:
    """The folder the running process takes its exercise modules from, if any."""
    for finder in sys.meta_path:
        if isinstance(finder, CopyFinder):
            return finder.tree
    return None
