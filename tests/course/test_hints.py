"""The hints teach the idea, never the line: no hint holds the code it asks for.

A hint (``exercises/hints.toml``, or the text of a marker) fails when it contains 20
characters or more of a line of its region's answer, spaces aside and comments cut: enough
to catch a line copied whole or in part (``cat(x1*cos - x2*sin, x2*cos + x1*sin)``). A hint
may still name what the unit works with (``hash_to_block``, ``sampling_params.max_tokens``):
a run that is only a name does not count.
"""
import importlib.util
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPAN = 20


def load_generator():
    spec = importlib.util.spec_from_file_location("make_exercises_for_hints", ROOT / "scripts" / "make_exercises.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


gen = load_generator()


def squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def code_lines(body: str) -> list[str]:
    """The lines of a region's code, comments cut off, spaces removed."""
    text = textwrap.dedent(body)
    lines = text.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            lines[row - 1] = lines[row - 1][:col]
    return [squeezed(line) for line in lines if squeezed(line)]


def copied(hint: str, line: str) -> str | None:
    """The first run of SPAN characters or more of ``line`` that ``hint`` holds (both squeezed),
    unless it is only a name (``num_scheduled_tokens``, ``sampling_params.max_tokens``)."""
    for start in range(len(line) - SPAN + 1):
        end = start + SPAN
        if line[start:end] not in hint:
            continue
        while end < len(line) and line[start : end + 1] in hint:
            end += 1
        if not re.fullmatch(r"[^\w.]*[\w.]+[^\w.]*", line[start:end]):
            return line[start:end]
    return None


def answers_in_hints() -> list[str]:
    found = []
    for source in gen.scan(ROOT):
        for region in source.regions:
            hint = squeezed(region.hint)
            for line in code_lines("\n".join(source.lines[region.begin : region.end - 1])):
                fragment = copied(hint, line)
                if fragment:
                    found.append(f"[{region.chapter}] {region.key or region.function}: the hint holds {fragment!r}")
    return found


def test_no_hint_holds_its_answer():
    found = answers_in_hints()
    assert not found, "rewrite these hints as what to do, not the code:\n" + "\n".join(found)


def test_the_check_sees_a_copied_line():
    line = code_lines("return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # halves")[0]
    assert copied(squeezed("apply_rotary: return cat(x1*cos - x2*sin, x2*cos + x1*sin)"), line)
    assert not copied(squeezed("apply_rotary: rotate each pair of features by its angle"), line)
    assert not copied(squeezed("true when num_scheduled_tokens reaches the end"), "returnself.num_scheduled_tokens>=n")
    assert code_lines("x = 1  # a comment with code(x1 * cos - x2 * sin, x2)\n") == ["x=1"]
