"""The learner's make targets pick one chapter, however it is written (``make -n``: nothing runs)."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def planned(*args: str) -> subprocess.CompletedProcess:
    # VENV points at a folder with no stamp: make -n then only prints the set-up's commands.
    return subprocess.run(["make", "--no-print-directory", "-n", "VENV=/nonexistent-venv", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("chapter, expected", [("7", "test_ch07_"), ("07", "test_ch07_"), ("1", "test_ch01_"), ("19", "test_ch19_")])
def test_grade_takes_one_chapter(chapter, expected):
    result = planned("grade", f"CH={chapter}")
    assert result.returncode == 0, result.stderr
    command = result.stdout.splitlines()[-1]
    graded = [word for word in command.split() if word.startswith("exercises")]
    assert len(graded) == 1 and Path(graded[0]).name.startswith(expected), command


def test_grade_without_a_chapter_grades_all():
    command = planned("grade").stdout.splitlines()[-1]
    assert " exercises " in command and "--solutions" not in command
    assert "--solutions" in planned("grade", "SOLUTIONS=1").stdout.splitlines()[-1]


def test_a_chapter_without_tests_says_so():
    result = planned("grade", "CH=42")
    assert result.returncode != 0 and "CH=42: no graded tests" in result.stderr


@pytest.mark.parametrize("chapter", ["7", "07"])
def test_chapter_runs_one_notebook_into_build(chapter):
    result = planned("chapter", f"CH={chapter}")
    assert result.returncode == 0, result.stderr
    assert "07_scheduler.ipynb" in result.stdout and "_build/chapters/07_scheduler.ipynb" in result.stdout
    assert "say which chapter" in planned("chapter").stderr
