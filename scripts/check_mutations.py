#!/usr/bin/env python
"""Grade deliberately wrong answers: the graded tests must catch the mistakes a learner makes.

Each chapter keeps its plausible wrong answers in ``tests/course/mutations/chNN.toml``:

    [[mutation]]
    region = "schedule_running"   # the key of one of the chapter's solution regions
    why = "preempts the oldest running sequence instead of the newest"
    old = "victim = self.running[-1]"   # occurs exactly once inside that region
    new = "victim = self.running[0]"

For every mutation the reference copy of the region's file is written again with ``old``
replaced by ``new`` inside the region, into a temporary copy of ``solutions/``; the
chapter's graded tests (``exercises/test_chNN_*.py``) then run against that copy
(``MINIVLLM_SOLUTIONS_DIR``, read by ``exercises/conftest.py``). A mutation is *caught*
when some graded test fails (or the tests run past the time limit: a learner would see
them hang), *missed* when they all pass. A chapter whose tests catch fewer than 95% of its
mutations fails the check, and so does a mutation that does not apply.

    python scripts/check_mutations.py             # every chapter with a mutation file
    python scripts/check_mutations.py 07 ch08     # chapters 07 and 08
    python scripts/check_mutations.py 07 --only 0,3   # mutations 0 and 3 of chapter 07
    python scripts/check_mutations.py --subset    # the first mutation of each region (the CI test's set)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTATIONS = ROOT / "tests" / "course" / "mutations"
THRESHOLD = 0.95
TIMEOUT_S = 240  # one mutation's grading; the slowest chapters take well under a minute
WORKERS = 2  # the tests of one mutation use a core; two at a time at most


def _generator():
    spec = importlib.util.spec_from_file_location("_make_exercises_for_mutations", ROOT / "scripts" / "make_exercises.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _generator()


class MutationError(Exception):
    """A mutation that cannot be applied: the message says which and why."""


@dataclass
class Mutation:
    chapter: str  # "ch07"
    index: int  # its place in the chapter's file, from 0
    region: str
    why: str
    old: str
    new: str

    @property
    def name(self) -> str:
        return f"{self.chapter}[{self.index}] {self.region}"


@dataclass
class Outcome:
    mutation: Mutation
    caught: bool
    detail: str  # the first failing test, "timeout", or "" when missed
    seconds: float


def chapter_tag(text: str) -> str:
    """'7', '07' and 'ch07' all name chapter ch07."""
    match = re.fullmatch(r"(?:ch)?(\d{1,2})", text.strip().lower())
    if not match:
        raise SystemExit(f"{text!r} is not a chapter: use 07, 7 or ch07")
    return f"ch{int(match.group(1)):02d}"


def load(chapter: str, root: Path = ROOT) -> list[Mutation]:
    path = root / "tests" / "course" / "mutations" / f"{chapter}.toml"
    table = tomllib.loads(path.read_text(encoding="utf-8"))
    mutations = []
    for index, entry in enumerate(table.get("mutation", [])):
        missing = {"region", "why", "old", "new"} - set(entry)
        if missing:
            raise MutationError(f"{path.name} mutation {index}: missing {sorted(missing)}")
        mutations.append(Mutation(chapter, index, entry["region"], entry["why"], entry["old"], entry["new"]))
    return mutations


def subset(mutations: list[Mutation]) -> list[Mutation]:
    """The first mutation of each region, in file order: every region graded once, quickly."""
    seen, first = set(), []
    for mutation in mutations:
        if (mutation.chapter, mutation.region) not in seen:
            seen.add((mutation.chapter, mutation.region))
            first.append(mutation)
    return first


def mutated_copy(mutation: Mutation, sources) -> tuple[str, str]:
    """(relative path, text) of the reference copy with the mutation applied inside its region."""
    holders = [
        (source, region)
        for source in sources
        for region in source.regions
        if region.chapter == mutation.chapter and region.key == mutation.region
    ]
    if not holders:
        raise MutationError(f"{mutation.name}: no region {mutation.region!r} in chapter {mutation.chapter}")
    if mutation.old == mutation.new:
        raise MutationError(f"{mutation.name}: old and new are the same text")
    found = [
        (source, region)
        for source, region in holders
        for _ in range("\n".join(source.lines[region.begin : region.end - 1]).count(mutation.old))
    ]
    if len(found) != 1:
        raise MutationError(
            f"{mutation.name}: {mutation.old!r} occurs {len(found)} times inside the region, not exactly once"
        )
    source, region = found[0]
    body = "\n".join(source.lines[region.begin : region.end - 1]).replace(mutation.old, mutation.new)
    lines = source.lines[: region.begin] + body.split("\n") + source.lines[region.end - 1 :]
    shift = len(lines) - len(source.lines)
    regions = []
    for other in source.regions:  # the regions at and after this one move by the lines it gained
        if other is region:
            other = replace(other, end=other.end + shift)
        elif other.begin > region.begin:
            other = replace(other, begin=other.begin + shift, end=other.end + shift)
        regions.append(other)
    mutated = gen.SourceFile(source.rel, lines, regions)
    try:
        return source.rel, gen.render(mutated, "solutions", ROOT)
    except gen.MarkerError as e:
        raise MutationError(f"{mutation.name}: the mutated copy is not valid Python: {e}") from None


def graded_tests(chapter: str) -> list[str]:
    tests = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "exercises").glob(f"test_{chapter}_*.py"))
    if not tests:
        raise MutationError(f"{chapter}: no graded tests exercises/test_{chapter}_*.py")
    return tests


def grade(mutation: Mutation, sources, timeout_s: float) -> Outcome:
    """Grade the chapter's tests against a copy of solutions/ holding this one mistake."""
    rel, text = mutated_copy(mutation, sources)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.chapter}-{mutation.index}-") as tmp:
        tree = Path(tmp) / "solutions"
        shutil.copytree(ROOT / "solutions", tree, ignore=shutil.ignore_patterns("__pycache__"))
        (tree / rel).write_text(text, encoding="utf-8")
        env = {**os.environ, "MINIVLLM_GRADE": "solutions", "MINIVLLM_SOLUTIONS_DIR": str(tree), "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "pytest", *graded_tests(mutation.chapter), "-x", "-q", "-p", "no:cacheprovider"]
        try:
            result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Outcome(mutation, True, "timeout", time.monotonic() - start)
    seconds = time.monotonic() - start
    if result.returncode == 0:
        return Outcome(mutation, False, "", seconds)
    if result.returncode not in (1, 2):  # 1: a test failed, 2: one did not even import; 3-5: the run itself broke
        raise MutationError(f"{mutation.name}: pytest exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-2000:]}")
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", result.stdout, re.MULTILINE)
    return Outcome(mutation, True, failed.group(1) if failed else "failed", seconds)


def check_baseline(chapter: str, timeout_s: float) -> None:
    """The chapter's tests pass on the reference: otherwise every mutation would look caught."""
    env = {**os.environ, "MINIVLLM_GRADE": "solutions", "PYTHONPATH": str(ROOT)}
    env.pop("MINIVLLM_SOLUTIONS_DIR", None)
    command = [sys.executable, "-m", "pytest", *graded_tests(chapter), "-x", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise MutationError(f"{chapter}: the graded tests fail on the reference itself:\n{result.stdout[-3000:]}")


def check(chapters: list[str], only: set[int] | None = None, first_per_region: bool = False,
          timeout_s: float = TIMEOUT_S, workers: int = WORKERS, out=sys.stdout,
          baseline: bool = True) -> dict[str, tuple[int, int]]:
    """Grade the chosen mutations; return {chapter: (caught, total)}. Raises MutationError.
    ``baseline``: first check that each chapter's tests pass on the unchanged reference."""
    sources = gen.scan(ROOT)
    chosen = [m for chapter in chapters for m in load(chapter) if only is None or m.index in only]
    if first_per_region:
        chosen = subset(chosen)
    for mutation in chosen:
        mutated_copy(mutation, sources)  # every mutation applies before anything runs
    if baseline:
        for chapter in chapters:
            check_baseline(chapter, timeout_s)
    outcomes: list[Outcome] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for outcome in pool.map(lambda m: grade(m, sources, timeout_s), chosen):
            verdict = "caught" if outcome.caught else "MISSED"
            detail = f" by {outcome.detail}" if outcome.caught else f": {outcome.mutation.why}"
            print(f"{verdict:6} {outcome.mutation.name} ({outcome.seconds:.1f}s){detail}", file=out, flush=True)
            outcomes.append(outcome)
    figures = {}
    for chapter in chapters:
        mine = [o for o in outcomes if o.mutation.chapter == chapter]
        figures[chapter] = (sum(o.caught for o in mine), len(mine))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapters to check (07, 7 or ch07); default: every mutation file")
    parser.add_argument("--only", help="comma-separated indices of mutations to run (within each chosen chapter)")
    parser.add_argument("--subset", action="store_true", help="only the first mutation of each region")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the check that the tests pass on the unchanged reference")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds for one mutation's grading")
    parser.add_argument("--workers", type=int, default=WORKERS, help="mutations graded at once (at most 2)")
    args = parser.parse_args(argv)
    chapters = sorted({chapter_tag(c) for c in args.chapters}) or sorted(p.stem for p in MUTATIONS.glob("ch*.toml"))
    absent = [c for c in chapters if not (MUTATIONS / f"{c}.toml").is_file()]
    if absent:
        print(f"no mutation file for {', '.join(absent)} in {MUTATIONS.relative_to(ROOT)}", file=sys.stderr)
        return 2
    only = {int(i) for i in args.only.split(",")} if args.only else None
    start = time.monotonic()
    try:
        figures = check(chapters, only, args.subset, args.timeout, max(1, min(args.workers, WORKERS)),
                        baseline=not args.no_baseline)
    except (MutationError, tomllib.TOMLDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    low = []
    for chapter, (caught, total) in figures.items():
        share = caught / total if total else 1.0
        print(f"{chapter}: {caught}/{total} caught ({share:.0%})")
        if share < THRESHOLD:
            low.append(chapter)
    print(f"{sum(c for c, _ in figures.values())}/{sum(t for _, t in figures.values())} caught in {time.monotonic() - start:.0f}s")
    if low:
        print(f"below {THRESHOLD:.0%}: {', '.join(low)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
