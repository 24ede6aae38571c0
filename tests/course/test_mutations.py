"""The graded tests catch plausible wrong answers (scripts/check_mutations.py).

Every chapter's mutations (tests/course/mutations/chNN.toml) must apply: each ``old`` occurs
exactly once inside its region, and every region of a chapter with a mutation file has at
least two. Grading all of them takes far longer than a test may (a pytest process per
mutation, about 15 s each on one core, over 350 mutations), so here each chapter grades one:
the first of its file, which must be caught. ``make mutations`` grades the full set. (That the tests pass on the unchanged reference is
tests/course/test_exercises.py's check.) ``make mutations`` grades the full set, where each
chapter must catch at least 95%.
"""
import importlib.util
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_mutations_under_test", ROOT / "scripts" / "check_mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


checker = _checker()
CHAPTERS = sorted(p.stem for p in checker.MUTATIONS.glob("ch*.toml"))


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_mutation_applies(chapter):
    sources = checker.gen.scan(ROOT)
    mutations = checker.load(chapter)
    for mutation in mutations:
        checker.mutated_copy(mutation, sources)  # raises MutationError, saying why
    regions = {r.key for source in sources for r in source.regions if r.chapter == chapter}
    counts = {key: sum(m.region == key for m in mutations) for key in regions}
    thin = {key: n for key, n in counts.items() if n < 2}
    assert not thin, f"{chapter}: regions with fewer than two mutations: {thin}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_first_mutation_of_each_chapter_is_caught(chapter):
    log = io.StringIO()
    first = checker.load(chapter)[0].index
    caught, total = checker.check([chapter], only={first}, out=log, baseline=False, workers=1)[chapter]
    assert caught == total, f"{chapter}: {total - caught} of {total} mutations missed:\n{log.getvalue()}"
