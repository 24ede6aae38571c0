"""The notebooks show the learner's code, never the answer above the task.

- every listing cell's saved output is what ``show`` prints from the current code
  (``scripts/refresh_listings.py --check``), and the chapter's reference answers sit folded
  in its last cell;
- no notebook carries an exercise marker, and no cell output holds the body of a solution
  region, nor any line of one (20 characters or more, spaces aside) that the learner's copy
  does not show anyway.
"""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def load_generator():
    spec = importlib.util.spec_from_file_location("make_exercises_for_listings", ROOT / "scripts" / "make_exercises.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


gen = load_generator()


def output_texts(nb):
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if "text" in output:
                yield index, output["text"]
            for value in output.get("data", {}).values():
                if isinstance(value, str):
                    yield index, value


def test_listings_are_up_to_date():
    script = ROOT / "scripts" / "refresh_listings.py"
    result = subprocess.run([sys.executable, str(script), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def answer_lines(source) -> list[tuple[str, str]]:
    """(where, line) for each line of code of the file's regions that its exercise copy lacks.

    Lines are squeezed (no spaces) and cut at their comment; lines under 20 characters, and
    lines the learner's copy holds anyway (outside the regions), say nothing of the answer.
    """
    visible = {squeezed(line) for line in gen.render(source, "exercises", ROOT).splitlines()}
    found = []
    for region in source.regions:
        for number in range(region.begin + 1, region.end):
            line = source.lines[number - 1]
            code = squeezed(line.split("  #")[0] if not line.lstrip().startswith("#") else "")
            if len(code) >= 20 and code not in visible:
                found.append((f"{source.rel}:{number} ({region.function})", code))
    return found


def notebook_chapter(path: Path) -> int:
    """The chapter a notebook teaches: 7 for 07_scheduler.ipynb."""
    return int(path.name[:2])


def test_no_notebook_prints_an_answer():
    """A notebook may show the answers of chapters before its own (the reader has done them),
    never its own chapter's or a later one's."""
    bodies, lines = [], []
    for source in gen.scan(ROOT):
        chapter_of = {region.function: region.number for region in source.regions}
        lines += [(where, line, chapter_of[where.split("(")[1][:-1]]) for where, line in answer_lines(source)]
        for region in source.regions:
            body = "\n".join(source.lines[region.begin : region.end - 1])
            bodies.append((f"{source.rel}:{region.begin} ({region.function})", body, region.number))
    found = []
    for path in NOTEBOOKS:
        text = path.read_text(encoding="utf-8")
        if "BEGIN SOLUTION" in text or "END SOLUTION" in text:
            found.append(f"{path.name}: an exercise marker")
        shown = notebook_chapter(path)
        for index, output in output_texts(nbformat.reads(text, as_version=4)):
            for where, body, chapter in bodies:
                if chapter >= shown and body in output:
                    found.append(f"{path.name}, cell {index}: the answer of {where}")
            printed = squeezed(output)
            for where, line, chapter in lines:
                if chapter >= shown and line in printed:
                    found.append(f"{path.name}, cell {index}: the line {where} of an answer")
    assert not found, "\n".join(found)
