#!/usr/bin/env python
"""How much engine code the learner writes: the lines of code (not blank, not comments) inside
the package's solution regions, per chapter, with each chapter's largest region.

    python scripts/count_learner_lines.py        # a table per chapter and the total
    python scripts/count_learner_lines.py -v     # every region too
"""
import importlib.util
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("make_exercises_for_count", ROOT / "scripts" / "make_exercises.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def regions(root: Path = ROOT) -> list[tuple[str, str, str, int]]:
    """(chapter, function, file, lines of code) for every solution region of the package."""
    out = []
    for source in load_generator().scan(root):
        for region in source.regions:
            body = source.lines[region.begin : region.end - 1]
            code = [line for line in body if line.strip() and not line.strip().startswith("#")]
            out.append((region.chapter, region.function, source.rel, len(code)))
    return out


def main() -> None:
    found = regions()
    by_chapter = defaultdict(list)
    for chapter, function, rel, lines in found:
        by_chapter[chapter].append(lines)
        if "-v" in sys.argv:
            print(f"{chapter} {lines:3d}  {function}  ({rel})")
    for chapter in sorted(by_chapter):
        print(f"{chapter}: {sum(by_chapter[chapter]):4d} lines, largest region {max(by_chapter[chapter])}")
    print(f"total: {sum(lines for *_, lines in found)} lines in {len(found)} regions")


if __name__ == "__main__":
    main()
