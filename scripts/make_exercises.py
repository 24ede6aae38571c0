#!/usr/bin/env python
"""Write the exercise copies and the reference copies of the package from its marked regions.

A solution region sits inside a function body of any ``minivllm/**/*.py`` file:

    def rms_norm(x, weight, eps):
        # BEGIN SOLUTION ch01 rms_norm
        ...reference code...
        # END SOLUTION

The word after the chapter tag is a key into ``exercises/hints.toml``, which holds the hint
(what the unit must do, never its code) under the chapter's table: ``[ch01]`` then
``rms_norm = "rms_norm: divide each row by its root mean square ..."``.
Keeping the hints there keeps the package readable; a short hint may also be written in the
marker itself, in double quotes (``# BEGIN SOLUTION ch01 "rms_norm: divide ..."``).

For every file that has regions, two copies are written, at the same relative path:

- ``exercises/minivllm/...``: each region becomes
  ``raise NotImplementedError("ch01: <the hint>, see notebooks/01_....ipynb")``
  at the region's indentation, its message wrapped over several lines when it is long
  (the student fills it in);
- ``solutions/minivllm/...``: the region's code is kept (the reference answer).

Marker lines are dropped from both. Nothing else under ``exercises/`` (the grading
``conftest.py``, ``hints.toml``, the ``test_chNN_*.py`` files) is touched.

Rules the markers must follow (a violation is an error naming the file and line): BEGIN and
END pair up, without nesting, at the same indentation; the tag is ``chNN`` (01-99), followed
by a key of ``hints.toml``'s table for that chapter or by a non-empty double-quoted hint; a
hint has no ``"`` or ``\\``; every key of ``hints.toml`` is used by a region; a region holds code and lies
inside a function (or method) body; and all regions of one function belong to one chapter,
because the grader swaps whole functions between your copy and the reference.

    python scripts/make_exercises.py           # write exercises/ and solutions/
    python scripts/make_exercises.py --check   # exit 1, listing the files, if they are stale
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "minivllm"
TREES = ("exercises", "solutions")
SCRIPT = "scripts/make_exercises.py"
HINTS = "exercises/hints.toml"
WIDTH = 100  # a stub longer than this is wrapped, so the copies and the book's listings stay readable

BEGIN = re.compile(
    r'^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<chapter>ch(?P<num>\d\d)) '
    r'(?:"(?P<hint>[^"\\]+)"|(?P<key>[A-Za-z_][A-Za-z0-9_]*))[ \t]*$'
)
END = re.compile(r"^(?P<indent>[ \t]*)# END SOLUTION[ \t]*$")
# Anything a reader would take for a marker; it must then match BEGIN or END exactly.
MARKER_LIKE = re.compile(r"^\s*#\s*(BEGIN|END)\s*SOLUTION", re.IGNORECASE)
BEGIN_FORM = '# BEGIN SOLUTION chNN key (of hints.toml) or # BEGIN SOLUTION chNN "what to write"'


class MarkerError(Exception):
    """One or more malformed regions; the message has one ``path:line: problem`` per line."""


@dataclass
class Region:
    chapter: str  # "ch01"
    hint: str
    begin: int  # 1-based line of the BEGIN marker
    end: int  # 1-based line of the END marker
    indent: str
    function: str = ""  # qualified name of the outermost function holding the region
    key: str = ""  # the hints.toml key, when the hint is not written in the marker

    @property
    def number(self) -> int:
        return int(self.chapter[2:])


@dataclass
class SourceFile:
    rel: str  # "minivllm/layers/norm.py"
    lines: list[str]
    regions: list[Region] = field(default_factory=list)

    @property
    def module(self) -> str:
        """The dotted module name: minivllm.layers.norm (minivllm.layers for an __init__.py)."""
        parts = self.rel[: -len(".py")].split("/")
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def functions(self) -> dict[str, str]:
        """Function qualname -> chapter, in file order."""
        return {r.function: r.chapter for r in self.regions}


def load_hints(root: Path) -> dict[str, dict[str, str]]:
    """hints.toml as {chapter: {key: hint}}; empty where there is no such file."""
    path = root / HINTS
    if not path.is_file():
        return {}
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise MarkerError(f"{HINTS}: not valid TOML: {e}") from None
    errors = []
    for chapter, hints in table.items():
        if not re.fullmatch(r"ch\d\d", chapter) or not isinstance(hints, dict):
            errors.append(f"{HINTS}: [{chapter}] is not a chapter table; use [ch01] to [ch99]")
            continue
        for key, hint in hints.items():
            if not isinstance(hint, str) or not hint.strip() or '"' in hint or "\\" in hint:
                errors.append(f'{HINTS}: [{chapter}] {key}: the hint must be a non-empty string without " or \\')
    if errors:
        raise MarkerError("\n".join(errors))
    return table


def find_regions(rel: str, text: str, hints: dict[str, dict[str, str]] | None = None) -> tuple[list[Region], list[str]]:
    """The regions of one file, and the errors found in its markers (keys looked up in ``hints``)."""
    hints = hints or {}
    regions: list[Region] = []
    errors: list[str] = []
    lines = text.splitlines()
    open_region: Region | None = None
    for number, line in enumerate(lines, start=1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if open_region is not None:
                errors.append(f"{rel}:{number}: BEGIN SOLUTION inside the region opened at line {open_region.begin}")
                continue
            open_region = Region(begin["chapter"], (begin["hint"] or "").strip(), number, 0, begin["indent"])
            if begin["key"]:
                open_region.key = begin["key"]
                open_region.hint = hints.get(begin["chapter"], {}).get(begin["key"], "").strip()
                if not open_region.hint:
                    errors.append(f"{rel}:{number}: the hint key {begin['key']!r} is not in {HINTS} under [{begin['chapter']}]")
            elif not open_region.hint:
                errors.append(f"{rel}:{number}: the hint is empty; say what to write")
            if begin["num"] == "00":
                errors.append(f"{rel}:{number}: chapter tag ch00 is not a chapter; use ch01 to ch99")
        elif end:
            if open_region is None:
                errors.append(f"{rel}:{number}: END SOLUTION without a BEGIN SOLUTION before it")
                continue
            if end["indent"] != open_region.indent:
                errors.append(
                    f"{rel}:{number}: END SOLUTION is indented differently from its BEGIN SOLUTION "
                    f"at line {open_region.begin}"
                )
            open_region.end = number
            body = lines[open_region.begin : number - 1]
            code = [b for b in body if b.strip() and not b.strip().startswith("#")]
            if not code:
                errors.append(f"{rel}:{open_region.begin}: the region holds no code")
            for offset, b in enumerate(body, start=open_region.begin + 1):
                if b.strip() and not b.startswith(open_region.indent):
                    errors.append(f"{rel}:{offset}: line is indented less than the BEGIN SOLUTION at line {open_region.begin}")
            regions.append(open_region)
            open_region = None
        elif MARKER_LIKE.match(line):
            errors.append(f"{rel}:{number}: malformed marker {line.strip()!r}; expected {BEGIN_FORM} or '# END SOLUTION'")
    if open_region is not None:
        errors.append(f"{rel}:{open_region.begin}: BEGIN SOLUTION is never closed by an END SOLUTION")
    return regions, errors


def _function_spans(tree: ast.AST):
    """(qualname, first line, last line) of each outermost function, including methods."""

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child.lineno, child.end_lineno
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def attach_functions(rel: str, text: str, regions: list[Region]) -> list[str]:
    """Name the function that holds each region; errors for regions outside any function."""
    try:
        tree = ast.parse(text, filename=rel)
    except SyntaxError as e:
        return [f"{rel}:{e.lineno}: not valid Python: {e.msg}"]
    spans = list(_function_spans(tree))
    errors = []
    chapters: dict[str, Region] = {}
    for region in regions:
        holders = [name for name, first, last in spans if first < region.begin <= last]
        if not holders:
            errors.append(f"{rel}:{region.begin}: the region is not inside a function body")
            continue
        region.function = holders[0]
        first = chapters.setdefault(region.function, region)
        if first.chapter != region.chapter:
            errors.append(
                f"{rel}:{region.begin}: {region.function} already has a {first.chapter} region (line "
                f"{first.begin}); all regions of one function must belong to one chapter"
            )
    return errors


def scan(root: Path = ROOT) -> list[SourceFile]:
    """Every package file that has regions, in path order. Raises MarkerError on bad markers."""
    files, errors = [], []
    hints = load_hints(root)
    for path in sorted((root / PACKAGE).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        if "SOLUTION" not in text.upper():
            continue
        regions, found = find_regions(rel, text, hints)
        if regions and not found:
            found = attach_functions(rel, text, regions)
        errors += found
        if regions:
            files.append(SourceFile(rel, text.splitlines(), regions))
    used = {(r.chapter, r.key) for source in files for r in source.regions if r.key}
    for chapter, table in hints.items():
        for key in table:
            if (chapter, key) not in used:
                errors.append(f"{HINTS}: [{chapter}] {key} is the key of no region; delete it or mark its region")
    if errors:
        raise MarkerError("\n".join(errors))
    return files


def stub(indent: str, message: str) -> list[str]:
    """``raise NotImplementedError(message)`` at ``indent``, the message wrapped when long."""
    one_line = f'{indent}raise NotImplementedError("{message}")'
    if len(one_line) <= WIDTH:
        return [one_line]
    inner = indent + "    "
    room = WIDTH - len(inner) - 3  # the two quotes, and the space a piece may end with
    pieces, line = [], ""
    for word in re.findall(r"\S+\s*", message):  # words keep their spaces: the pieces join back to message
        if line and len(line) + len(word.rstrip()) > room:
            pieces.append(line)
            line = ""
        line += word
    pieces.append(line)
    return [f"{indent}raise NotImplementedError("] + [f'{inner}"{piece}"' for piece in pieces] + [f"{indent})"]


def notebook_reference(root: Path, number: int) -> str:
    """Where the hint sends the reader: the chapter's notebook, once it exists."""
    found = sorted((root / "notebooks").glob(f"{number:02d}_*.ipynb"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise MarkerError(f"notebooks/: more than one notebook for chapter {number:02d} ({names})")
    if found:
        return f"see notebooks/{found[0].name}"
    return f"see the chapter {number:02d} notebook"


def _summary(source: SourceFile) -> str:
    return ", ".join(f"{name} ({chapter})" for name, chapter in source.functions().items())


def render(source: SourceFile, tree: str, root: Path = ROOT, answered: int = 0) -> str:
    """The text of one generated copy: ``tree`` is "exercises" or "solutions".

    ``answered``: the exercise copy keeps the code of the regions of chapters up to this one,
    as a learner who has done them would have it (the course's tests build such copies).
    """
    chapters = sorted({r.chapter for r in source.regions})
    if tree == "exercises":
        header = [
            f"# Exercise copy of {source.rel}, generated from it by {SCRIPT}.",
            f"# Fill in: {_summary(source)}.",
            "# Grade: " + "; ".join(f"make grade CH={c[2:]}" for c in chapters),
            "# Running the generator again overwrites this file: commit or copy your work first.",
        ]
    else:
        header = [
            f"# Reference copy of {source.rel}, generated from it by {SCRIPT}.",
            f"# Reference answers for: {_summary(source)}.",
            f"# Do not edit: change {source.rel} and run {SCRIPT} again.",
        ]
    out = header + [""]
    starts = {r.begin: r for r in source.regions}
    ends = {r.end for r in source.regions}
    skipping = False
    for number, line in enumerate(source.lines, start=1):
        if number in starts:
            region = starts[number]
            if tree == "exercises" and region.number > answered:
                see = notebook_reference(root, region.number)
                out.extend(stub(region.indent, f"{region.chapter}: {region.hint}, {see}"))
                skipping = True
            continue
        if number in ends:
            skipping = False
            continue
        if not skipping:
            out.append(line)
    text = "\n".join(out) + "\n"
    target = f"{tree}/{source.rel}"
    try:
        compile(text, target, "exec")
    except SyntaxError as e:
        raise MarkerError(f"{source.rel}: the generated {target} is not valid Python (line {e.lineno}: {e.msg})")
    return text


def build(root: Path = ROOT) -> dict[str, str]:
    """Every generated file, as {path relative to root: text}."""
    outputs = {}
    for source in scan(root):
        for tree in TREES:
            outputs[f"{tree}/{source.rel}"] = render(source, tree, root)
    return outputs


def on_disk(root: Path = ROOT) -> set[str]:
    """The generated-tree files that exist now (caches aside)."""
    found = set()
    for tree in TREES:
        base = root / tree / PACKAGE
        if base.is_dir():
            found |= {
                p.relative_to(root).as_posix() for p in base.rglob("*.py") if "__pycache__" not in p.parts
            }
    return found


def differences(root: Path, outputs: dict[str, str]) -> dict[str, list[str]]:
    existing = on_disk(root)
    report = {"stale": [], "missing": [], "extra": sorted(existing - set(outputs))}
    for rel, text in sorted(outputs.items()):
        if rel not in existing:
            report["missing"].append(rel)
        elif (root / rel).read_text(encoding="utf-8") != text:
            report["stale"].append(rel)
    return report


def write(root: Path, outputs: dict[str, str]) -> list[str]:
    """Bring the trees in line with ``outputs``; return what changed."""
    report = differences(root, outputs)
    for rel in report["stale"] + report["missing"]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(outputs[rel], encoding="utf-8", newline="\n")
    for rel in report["extra"]:
        (root / rel).unlink()
    for tree in TREES:  # drop folders the removals emptied (their caches with them)
        base = root / tree / PACKAGE
        if not base.is_dir():
            continue
        for folder in sorted((p for p in base.rglob("*") if p.is_dir() and p.name != "__pycache__"), reverse=True):
            if not any(folder.rglob("*.py")):
                for cache in folder.glob("__pycache__/*"):
                    cache.unlink()
                for sub in (folder / "__pycache__", folder):
                    if sub.is_dir() and not any(sub.iterdir()):
                        sub.rmdir()
    return [f"{kind}: {rel}" for kind, rels in report.items() for rel in rels]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if exercises/ or solutions/ are stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this script's)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        outputs = build(root)
    except MarkerError as e:
        print(f"solution markers are malformed:\n{e}", file=sys.stderr)
        return 2
    if args.check:
        report = differences(root, outputs)
        problems = [f"  {kind}: {rel}" for kind, rels in report.items() for rel in rels]
        if problems:
            print(
                "exercises/ and solutions/ are out of date with the package "
                f"(run python {SCRIPT}):\n" + "\n".join(problems),
                file=sys.stderr,
            )
            return 1
        print(f"exercises/ and solutions/ are up to date ({len(outputs) // 2} files with regions)")
        return 0
    changes = write(root, outputs)
    for line in changes:
        print(line.replace("stale:", "updated:").replace("missing:", "written:").replace("extra:", "removed:"))
    print(f"{len(outputs) // 2} files with regions; {len(changes)} generated files changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
