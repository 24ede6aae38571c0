"""The exercises check themselves.

- exercises/ and solutions/ are what scripts/make_exercises.py writes from the package;
- the reference solutions pass every graded test;
- the untouched exercise copies fail every graded test, each with its own chapter's
  NotImplementedError (a test that a blank passes asserts nothing);
- every chapter with regions has a graded test file, and every graded test file a chapter;
- the generator rejects malformed markers, naming the file and line.

The two grading runs are separate pytest processes (the grader replaces modules of
minivllm, which must not leak into this process); they run side by side.
"""
import importlib.util
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "make_exercises.py"
TEST_FILE = re.compile(r"^test_(ch\d\d)_\w+\.py$")


def load_generator():
    spec = importlib.util.spec_from_file_location("make_exercises_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = load_generator()


def graded_test_files() -> dict[str, Path]:
    files = {}
    for path in sorted((ROOT / "exercises").glob("test_*.py")):
        match = TEST_FILE.match(path.name)
        assert match, f"exercises/{path.name}: graded test files are named test_chNN_<topic>.py"
        assert match.group(1) not in files, f"two graded test files for {match.group(1)}: {files[match.group(1)].name}, {path.name}"
        files[match.group(1)] = path
    return files


def test_generated_files_are_up_to_date():
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_chapter_with_regions_has_graded_tests_and_back():
    with_regions = {region.chapter for source in gen.scan(ROOT) for region in source.regions}
    with_tests = set(graded_test_files())
    assert not with_regions - with_tests, f"chapters with regions but no exercises/test_chNN_*.py: {sorted(with_regions - with_tests)}"
    assert not with_tests - with_regions, f"graded test files for chapters without regions: {sorted(with_tests - with_regions)}"


# --- grading runs ---------------------------------------------------------------------


def start_grading(tmp_path: Path, name: str, *args: str):
    """Start ``pytest exercises`` in a subprocess; return (process, its junit xml path)."""
    xml = tmp_path / f"{name}.xml"
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_GRADE"}
    select = [] if torch.cuda.is_available() else ["-m", "not gpu"]
    command = [
        sys.executable, "-m", "pytest", "exercises", *args, *select,
        "-q", "-p", "no:cacheprovider", "--junitxml", str(xml),
    ]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, xml


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """{file::test: (outcome, message)} from a junit xml report."""
    result = {}
    for case in ET.parse(xml).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = tag, f"{node.get('message', '')}\n{node.text or ''}"
        result[name] = outcome, message
    return result


@pytest.fixture(scope="module")
def grading_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grading")
    runs = {"solutions": start_grading(tmp, "solutions", "--solutions"), "exercises": start_grading(tmp, "exercises")}
    done = {}
    for name, (process, xml) in runs.items():
        output, _ = process.communicate(timeout=600)
        assert xml.exists(), f"pytest exercises ({name}) wrote no report:\n{output[-4000:]}"
        done[name] = (process.returncode, output, outcomes(xml))
    return done


def test_solutions_pass_every_graded_test(grading_runs):
    code, output, results = grading_runs["solutions"]
    assert results, "no graded tests were collected"
    not_passed = {name: outcome for name, (outcome, _) in results.items() if outcome != "passed"}
    assert not not_passed and code == 0, f"with --solutions, these did not pass: {not_passed}\n{output[-6000:]}"
    assert "graded: the reference copies in solutions/minivllm/" in output


def test_untouched_exercises_fail_every_graded_test(grading_runs):
    code, output, results = grading_runs["exercises"]
    assert results, "no graded tests were collected"
    assert set(results) == set(grading_runs["solutions"][2]), "the two runs collected different tests"
    assert "graded: your copies in exercises/minivllm/" in output
    wrong = []
    for name, (outcome, message) in sorted(results.items()):
        chapter = re.search(r"test_(ch\d\d)_", name).group(1)
        if outcome not in ("failure", "error"):
            wrong.append(f"{name}: {outcome} on a blank exercise")
        elif f"NotImplementedError: {chapter}:" not in message:
            wrong.append(f"{name}: failed, but not with the {chapter} NotImplementedError:\n{message[:1500]}")
    assert not wrong, "\n".join(wrong)


# --- the generator --------------------------------------------------------------------

GOOD = '''\
def f(x):
    """Doc."""
    # BEGIN SOLUTION ch04 "f: return x + 1"
    y = x + 1
    return y
    # END SOLUTION


class C:
    def g(self):
        # BEGIN SOLUTION ch05 "g: return 2"
        return 2
        # END SOLUTION
'''


def tree_with(tmp_path: Path, text: str) -> Path:
    (tmp_path / "minivllm" / "sub").mkdir(parents=True)
    (tmp_path / "minivllm" / "__init__.py").write_text("")
    (tmp_path / "minivllm" / "plain.py").write_text("X = 1\n")
    (tmp_path / "minivllm" / "sub" / "mod.py").write_text(text)
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "04_things.ipynb").write_text("{}")
    return tmp_path


def test_generator_writes_both_copies(tmp_path):
    root = tree_with(tmp_path, GOOD)
    assert gen.main(["--root", str(root)]) == 0
    assert (root / "exercises/minivllm/sub/mod.py").is_file() and (root / "solutions/minivllm/sub/mod.py").is_file()
    assert not (root / "exercises/minivllm/plain.py").exists(), "files without regions are not copied"
    student = (root / "exercises/minivllm/sub/mod.py").read_text()
    assert 'raise NotImplementedError("ch04: f: return x + 1, see notebooks/04_things.ipynb")' in student
    assert '        raise NotImplementedError("ch05: g: return 2, see the chapter 05 notebook")' in student
    assert "generated from it by scripts/make_exercises.py" in student and "f (ch04), C.g (ch05)" in student
    assert "SOLUTION" not in student and "y = x + 1" not in student
    reference = (root / "solutions/minivllm/sub/mod.py").read_text()
    assert "SOLUTION" not in reference and "    y = x + 1\n    return y\n" in reference
    assert gen.main(["--root", str(root), "--check"]) == 0


def test_check_lists_stale_missing_and_extra_files(tmp_path, capsys):
    root = tree_with(tmp_path, GOOD)
    gen.main(["--root", str(root)])
    (root / "exercises/minivllm/sub/mod.py").write_text("edited\n")
    (root / "solutions/minivllm/sub/mod.py").unlink()
    (root / "solutions/minivllm/old.py").write_text("")
    before = sorted(p.as_posix() for p in root.rglob("*"))
    assert gen.main(["--root", str(root), "--check"]) == 1
    assert sorted(p.as_posix() for p in root.rglob("*")) == before, "--check must not write"
    err = capsys.readouterr().err
    for line in ("stale: exercises/minivllm/sub/mod.py", "missing: solutions/minivllm/sub/mod.py", "extra: solutions/minivllm/old.py"):
        assert line in err
    assert gen.main(["--root", str(root)]) == 0
    assert not (root / "solutions/minivllm/old.py").exists()
    assert gen.main(["--root", str(root), "--check"]) == 0


@pytest.mark.parametrize(
    "text, line, problem",
    [
        ('def f():\n    # BEGIN SOLUTION ch01 "x"\n    return 1\n', 2, "never closed"),
        ("def f():\n    return 1\n    # END SOLUTION\n", 3, "without a BEGIN"),
        ('def f():\n    # BEGIN SOLUTION ch1 "x"\n    return 1\n    # END SOLUTION\n', 2, "malformed marker"),
        ("def f():\n    # BEGIN SOLUTION ch01 two words\n    return 1\n    # END SOLUTION\n", 2, "malformed marker"),
        ("def f():\n    # BEGIN SOLUTION ch01 nokey\n    return 1\n    # END SOLUTION\n", 2, "'nokey' is not in exercises/hints.toml"),
        ('def f():\n    # BEGIN SOLUTION ch01 "a"\n    # BEGIN SOLUTION ch01 "b"\n    return 1\n    # END SOLUTION\n', 3, "inside the region"),
        ('# BEGIN SOLUTION ch01 "x"\nX = 1\n# END SOLUTION\n', 1, "not inside a function"),
        ('def f():\n    # BEGIN SOLUTION ch01 "x"\n    pass\n  # END SOLUTION\n', 4, "indented differently"),
        ('def f():\n    # BEGIN SOLUTION ch01 "x"\n    # nothing\n    # END SOLUTION\n    return 1\n', 2, "no code"),
        ('def f(a):\n    # BEGIN SOLUTION ch01 "x"\n    a += 1\n    # END SOLUTION\n    # BEGIN SOLUTION ch02 "y"\n    return a\n    # END SOLUTION\n', 5, "one chapter"),
    ],
    ids=["unclosed", "stray-end", "short-tag", "unquoted-hint", "unknown-key", "nested", "module-level", "indent", "empty", "two-chapters"],
)
def test_malformed_markers_name_file_and_line(tmp_path, capsys, text, line, problem):
    root = tree_with(tmp_path, text)
    with pytest.raises(gen.MarkerError, match=rf"minivllm/sub/mod.py:{line}: .*{problem}"):
        gen.scan(root)
    assert gen.main(["--root", str(root), "--check"]) == 2
    assert f"minivllm/sub/mod.py:{line}:" in capsys.readouterr().err


KEYED = '''\
def f(x):
    # BEGIN SOLUTION ch04 f_body
    return x + 1
    # END SOLUTION
'''
LONG_HINT = "f: " + " ".join(f"step {i} of a long recipe;" for i in range(30))


def test_hint_keys_read_the_hints_table_and_long_stubs_wrap(tmp_path):
    root = tree_with(tmp_path, KEYED)
    (root / "exercises").mkdir()
    (root / "exercises/hints.toml").write_text(f'[ch04]\nf_body = "{LONG_HINT}"\n')
    assert gen.main(["--root", str(root)]) == 0
    student = (root / "exercises/minivllm/sub/mod.py").read_text()
    assert "f_body" not in student
    lines = student.splitlines()
    start = lines.index("    raise NotImplementedError(")
    end = lines.index("    )", start)
    assert all(len(line) <= gen.WIDTH for line in lines[start:end + 1])
    message = eval("(" + "\n".join(lines[start + 1 : end]) + ")")  # the wrapped string literals, joined
    assert message == f"ch04: {LONG_HINT}, see notebooks/04_things.ipynb"


def test_unused_hint_keys_are_errors(tmp_path):
    root = tree_with(tmp_path, KEYED)
    (root / "exercises").mkdir()
    (root / "exercises/hints.toml").write_text('[ch04]\nf_body = "f: add one"\nstale = "g: gone"\n')
    with pytest.raises(gen.MarkerError, match=r"exercises/hints.toml: \[ch04\] stale is the key of no region"):
        gen.scan(root)
