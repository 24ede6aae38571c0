"""The notebooks' switch: MINIVLLM_LEARNER makes minivllm import the learner's copies.

Each check runs in a fresh interpreter: the switch is read when minivllm is first imported.
(``make test`` also runs every notebook a second time with ``MINIVLLM_LEARNER=solutions``.)
At every chapter N (``learner_chapters.py``, one process per case): with chapters 01..N
answered, the engine generates the package's tokens; with chapter N untouched, it stops with
chapter N's message or not at all, chapter N's functions are the learner's stubs and later
chapters' functions the reference.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import minivllm.engine.block_manager as bm, minivllm.ops.norm as norm, minivllm.llm as llm
print(bm.__file__); print(norm.__file__); print(llm.__file__)
try:
    print(bm.block_hash([1, 2], None))
except NotImplementedError as e:
    print("NotImplementedError:", e)
"""


def run_python(code: str, switch: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_LEARNER"}
    if switch is not None:
        env["MINIVLLM_LEARNER"] = switch
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "switch, tree, norm_tree",
    [("1", "exercises", "exercises"), ("exercises", "exercises", "exercises"), ("all", "exercises", "exercises"),
     ("06", "exercises", "exercises"), ("6", "exercises", "exercises"), ("01", "minivllm", "exercises"),
     ("solutions", "solutions", "solutions"), ("0", None, None), (None, None, None)],
)
def test_the_switch_picks_the_copies(switch, tree, norm_tree):
    """block_manager.py holds exercises of chapters 05 and 06, norm.py of 01 and 11."""
    result = run_python(PROBE, switch)
    assert result.returncode == 0, result.stderr[-3000:]
    block_manager, norm, llm, answer = result.stdout.splitlines()
    where = {None: ROOT, "minivllm": ROOT}.get(tree) or ROOT / tree
    assert Path(block_manager) == where / "minivllm/engine/block_manager.py"
    assert Path(norm) == (ROOT / norm_tree if norm_tree else ROOT) / "minivllm/ops/norm.py"
    assert Path(llm) == ROOT / "minivllm/llm.py", "a module without exercises comes from the package"
    if tree == "exercises":
        assert answer.startswith("NotImplementedError: ch06: block_hash:")
    else:
        assert answer.isdigit(), "before chapter 06, block_hash is the reference's"


def test_a_wrong_switch_says_what_it_takes():
    result = run_python("import minivllm", "mine")
    assert result.returncode != 0
    assert "MINIVLLM_LEARNER='mine': use a chapter (07 or 7" in result.stderr


@pytest.mark.parametrize("mode", ["done", "untouched"])
def test_the_switch_at_every_chapter(mode, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_LEARNER"}
    env["OMP_NUM_THREADS"] = "1"
    script = Path(__file__).with_name("learner_chapters.py")
    result = subprocess.run(
        [sys.executable, str(script), mode, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    lines = result.stdout.splitlines()
    failed = [line for line in lines if not line.split(": ", 1)[-1].startswith("ok")]
    assert result.returncode == 0 and lines and not failed, "\n".join(failed) or result.stderr[-3000:]
