#!/usr/bin/env python
"""Rewrite the saved listings of every notebook from the current code, without running it.

A *listing cell* holds only imports and calls of ``show(...)`` (``minivllm.course``); its
saved output is exactly what those calls print: package code with each exercise region as
the learner's stub. The notebooks' other outputs come from a GPU run and are kept, so when
the package changes, this script brings the listings in step instead of re-executing:

- each listing cell's stdout is recomputed by calling ``show`` here, on the names the
  notebook imports from ``minivllm``;
- the chapter's reference answers, folded away in a ``<details>`` block, are the last cell,
  a markdown cell tagged ``reference-answers`` (added after the exercises where missing),
  written from ``solutions/minivllm/`` for every exercise region of the chapter.

A cell that calls ``show`` and also does something else is an error: split it, so that
what this script writes is the whole of the cell's output.

    python scripts/refresh_listings.py           # rewrite the notebooks that are stale
    python scripts/refresh_listings.py --check   # write nothing; exit 1 naming them
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import os
import sys
import textwrap
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ANSWERS_TAG = "reference-answers"

# The Triton kernels must import on a machine without a GPU; the switch is read when triton
# is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("MINIVLLM_LEARNER", None)  # the listings come from the copies on disk, whatever a shell set
sys.path.insert(0, str(ROOT))
from minivllm import course  # noqa: E402  (after the switch above)


class ListingError(Exception):
    pass


def _generator():
    spec = importlib.util.spec_from_file_location("_make_exercises", ROOT / "scripts" / "make_exercises.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def _is_show(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "show"
    )


def _package_imports(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "minivllm"
    if isinstance(node, ast.Import):
        return all(alias.name.split(".")[0] == "minivllm" for alias in node.names)
    return False


def listing_cells(nb, name: str) -> list[int]:
    """Indices of the listing cells; an error for a cell that mixes show() with other code."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "show(" not in cell.source:
            continue
        body = ast.parse(cell.source).body
        if not any(_is_show(node) for node in body):
            continue
        other = [node for node in body if not (_is_show(node) or _package_imports(node))]
        if other:
            raise ListingError(
                f"{name}, cell {index}: a listing cell holds only imports from minivllm and show() "
                f"calls; line {other[0].lineno} is something else: move it to a cell of its own"
            )
        found.append(index)
    return found


def namespace(nb) -> dict:
    """What the notebook imports from minivllm, imported here (nothing else of it runs)."""
    scope: dict = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for node in ast.parse(cell.source).body:
            if _package_imports(node):
                exec(compile(ast.Module([node], []), "<notebook imports>", "exec"), scope)
    return scope


def listing_text(cell, scope: dict) -> str:
    """What the cell prints: its show() calls, run against the current code."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(cell.source, "<listing cell>", "exec"), {**scope, "show": course.show})
    return out.getvalue()


def set_stdout(cell, text: str, where: str) -> None:
    streams = [o for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"]
    others = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stdout")]
    if others or len(streams) > 1:
        raise ListingError(f"{where}: a listing cell's only output is its stdout; found {[o.output_type for o in others]}")
    if streams:
        streams[0].text = text
    else:
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]


def answers_markdown(chapter: str, regions_by_function: list[tuple[str, str]]) -> str:
    """The folded block of the chapter's reference answers, one listing per exercise function."""
    parts = [
        "<details>",
        f"<summary>Reference answers for chapter {chapter[2:]} (open them once you have tried the exercises)</summary>",
        "",
    ]
    for rel, qualname in regions_by_function:
        code = textwrap.dedent(course.answer(rel, qualname)).rstrip("\n")
        parts += [f"`{qualname}`, from `solutions/{rel}`:", "", "```python", code, "```", ""]
    parts.append("</details>")
    return "\n".join(parts)


def refresh(path: Path, exercises: dict[str, list[tuple[str, str]]]) -> str:
    """The notebook's text with its listings and its answers cell rewritten."""
    name = path.relative_to(ROOT).as_posix()
    nb = nbformat.read(path, as_version=4)
    scope = namespace(nb)
    for index in listing_cells(nb, name):
        cell = nb.cells[index]
        try:
            text = listing_text(cell, scope)
        except Exception as e:  # a name the notebook does not import from minivllm, a moved function
            raise ListingError(f"{name}, cell {index}: {type(e).__name__}: {e}") from e
        set_stdout(cell, text, f"{name}, cell {index}")
    chapter = "ch" + path.name[:2]
    tagged = [c for c in nb.cells if ANSWERS_TAG in c.metadata.get("tags", [])]
    if chapter in exercises:
        source = answers_markdown(chapter, exercises[chapter])
        if tagged:
            tagged[0].source = source
        else:
            nb.cells.append(nbformat.v4.new_markdown_cell(source, metadata={"tags": [ANSWERS_TAG]}))
    return nbformat.writes(nb) + "\n"


def chapter_exercises() -> dict[str, list[tuple[str, str]]]:
    """{chapter: [(package file, function), ...]} for every exercise region, in file order."""
    found: dict[str, list[tuple[str, str]]] = {}
    for source in _generator().scan(ROOT):
        for function, chapter in source.functions().items():
            found.setdefault(chapter, []).append((source.rel, function))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a notebook's listings are stale")
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or sorted(NOTEBOOKS.glob("*.ipynb"))
    exercises = chapter_exercises()
    stale = []
    try:
        for path in paths:
            text = refresh(path, exercises)
            if text != path.read_text(encoding="utf-8"):
                stale.append(path.relative_to(ROOT).as_posix())
                if not args.check:
                    path.write_text(text, encoding="utf-8")
    except ListingError as e:
        print(f"refresh_listings: {e}", file=sys.stderr)
        return 2
    if args.check:
        if stale:
            print("stale listings (run python scripts/refresh_listings.py): " + ", ".join(stale), file=sys.stderr)
            return 1
        print(f"the listings of {len(paths)} notebooks are up to date")
        return 0
    for rel in stale:
        print(f"updated: {rel}")
    print(f"{len(paths)} notebooks; {len(stale)} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
