"""Run minivllm on the learner's copies of the exercise files: the import hook that the grader
(``exercises/conftest.py``) and the notebooks share.

``exercises/minivllm/`` (the learner's answers) and ``solutions/minivllm/`` (the reference)
hold a copy of each package file that has an exercise in it. With the hook installed,
``import minivllm.ops.norm`` loads that copy; every other module of ``minivllm`` comes from
the package itself. The notebooks switch it on with the environment variable
``MINIVLLM_LEARNER`` (read when ``minivllm`` is first imported):

    MINIVLLM_LEARNER=1 make lab            # the chapters run on your answers in exercises/
    MINIVLLM_LEARNER=solutions ...         # on the reference copies (how CI checks the switch)

This module imports nothing of the package, so the grader can load it by path before any
``minivllm`` module exists.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "minivllm"
TREES = {"exercises": ROOT / "exercises", "solutions": ROOT / "solutions"}
SWITCH = "MINIVLLM_LEARNER"


class CopyFinder(importlib.abc.MetaPathFinder):
    """Load ``minivllm.X.Y`` from ``<tree>/minivllm/X/Y.py`` when that copy exists."""

    def __init__(self, tree: Path):
        self.tree = tree

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
        if copy is not None and copy.name == "__init__.py":
            # A package's own code from the copy, its submodules from the real package.
            real = ROOT.joinpath(*fullname.split("."))
            return importlib.util.spec_from_file_location(fullname, copy, submodule_search_locations=[str(real)])
        if copy is not None:
            return importlib.util.spec_from_file_location(fullname, copy)
        if fullname == PACKAGE:
            # The package next to the trees, never exercises/minivllm as a namespace package.
            return importlib.machinery.PathFinder.find_spec(fullname, [str(ROOT)])
        return None


def tree_of(value: str) -> Path | None:
    """The folder a value of the switch names: "1" or "exercises", "solutions"; "" or "0": none."""
    value = value.strip().lower()
    if value in ("", "0"):
        return None
    name = "exercises" if value == "1" else value
    if name not in TREES:
        raise ValueError(f"{SWITCH}={value!r}: use 1 (or exercises) for your copies, solutions for the reference")
    return TREES[name]


def install(tree: Path) -> CopyFinder:
    """Put the hook first on ``sys.meta_path``; the modules imported from then on use it."""
    finder = CopyFinder(tree)
    sys.meta_path.insert(0, finder)
    return finder


def active() -> Path | None:
    """The folder the running process takes its exercise modules from, if any."""
    for finder in sys.meta_path:
        if isinstance(finder, CopyFinder):
            return finder.tree
    return None
