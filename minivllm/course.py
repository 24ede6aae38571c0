"""Listings for the course's notebooks: package code as the learner's copy holds it.

A function with an exercise in it is shown from ``exercises/minivllm/``, where each solution
region is the stub the learner fills in (``raise NotImplementedError("chNN: ...")``), so a
chapter never prints the answer above its task. ``answers=True`` shows the reference copy in
``solutions/minivllm/`` instead. Everything else is shown from the package as it is.

    from minivllm.course import show
    show(BlockManager.free)                  # the learner's copy: the stub in place of the answer
    show(BlockManager.free, answers=True)    # the reference answer
    file_text("minivllm/engine/block_manager.py")  # a whole file, as the learner's copy holds it
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "minivllm"
TREES = {False: ROOT / "exercises", True: ROOT / "solutions"}


def _unwrap(obj):
    """The Python function under a decorator: a Triton kernel keeps it as ``.fn``."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj)) and hasattr(obj, "fn"):
        obj = obj.fn
    return obj


def _package_path(path: Path) -> str | None:
    """``minivllm/x/y.py`` for a file of the package or of one of its two generated copies."""
    for base in (ROOT, *TREES.values()):
        try:
            rel = path.resolve().relative_to(base)
        except ValueError:
            continue
        if rel.parts and rel.parts[0] == PACKAGE:
            return rel.as_posix()
    return None


def _segment(path: Path, qualname: str) -> str:
    """The source of ``qualname`` (decorators included) in the file at ``path``."""
    text = path.read_text(encoding="utf-8")
    if not qualname:
        return text
    lines = text.splitlines(keepends=True)
    body = ast.parse(text, filename=str(path)).body
    node = None
    for part in qualname.split("."):
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        found = [n for n in body if isinstance(n, kinds) and n.name == part]
        if not found:
            raise LookupError(f"{qualname} is not in {path}")
        node = found[-1]  # as at run time, a later definition wins
        body = node.body
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return "".join(lines[first - 1 : node.end_lineno])


def listing(obj, answers: bool = False, start: str | None = None) -> str:
    """The source of ``obj`` as the learner's copy holds it (``answers``: the reference's).

    ``start`` keeps the listing from the first line that begins (after its indentation)
    with that text, for a long function whose second half is the point.
    """
    obj = _unwrap(obj)
    path = Path(inspect.getsourcefile(obj))
    rel = _package_path(path)
    qualname = "" if inspect.ismodule(obj) else obj.__qualname__
    copy = TREES[answers] / rel if rel else None
    if copy is not None and copy.is_file():
        text = _segment(copy, qualname)
    else:  # no exercise in this file: the package's code is what everyone has
        text = inspect.getsource(obj)
    if start is not None:
        lines = text.splitlines(keepends=True)
        at = [i for i, line in enumerate(lines) if line.lstrip().startswith(start)]
        if not at:
            raise ValueError(f"no line of {qualname or rel} starts with {start!r}")
        text = "".join(lines[at[0] :])
    return text


def file_text(path: str | Path, answers: bool = False) -> str:
    """The text of a package file (``minivllm/x/y.py``, or its path) as the learner's copy holds
    it: from ``exercises/`` where the file has exercises, with the stubs in place of the answers
    (``answers``: from ``solutions/``), else the package's own."""
    rel = _package_path(ROOT / path) if not Path(path).is_absolute() else _package_path(Path(path))
    if rel is None:
        raise ValueError(f"{path} is not a file of {PACKAGE}/")
    copy = TREES[answers] / rel
    return (copy if copy.is_file() else ROOT / rel).read_text(encoding="utf-8")


def answer(rel: str, qualname: str) -> str:
    """The reference answer: function ``qualname`` of package file ``rel`` as ``solutions/`` has it."""
    return _segment(TREES[True] / rel, qualname)


def show(obj, answers: bool = False, start: str | None = None) -> None:
    """Print :func:`listing`: the notebooks' way to show package code."""
    print(listing(obj, answers=answers, start=start))
