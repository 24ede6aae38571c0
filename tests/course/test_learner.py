"""The notebooks' switch: MINIVLLM_LEARNER makes minivllm import the learner's copies.

Each check runs in a fresh interpreter: the switch is read when minivllm is first imported.
(``make test`` also runs every notebook a second time with ``MINIVLLM_LEARNER=solutions``.)
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
    "switch, tree", [("1", "exercises"), ("exercises", "exercises"), ("solutions", "solutions"), ("0", None), (None, None)]
)
def test_the_switch_picks_the_copies(switch, tree):
    result = run_python(PROBE, switch)
    assert result.returncode == 0, result.stderr[-3000:]
    block_manager, norm, llm, answer = result.stdout.splitlines()
    where = ROOT / tree if tree else ROOT
    assert Path(block_manager) == where / "minivllm/engine/block_manager.py"
    assert Path(norm) == where / "minivllm/ops/norm.py"
    assert Path(llm) == ROOT / "minivllm/llm.py", "a module without exercises comes from the package"
    if tree == "exercises":
        assert answer.startswith("NotImplementedError: ch06: block_hash:")
    else:
        assert answer.isdigit()


def test_a_wrong_switch_says_what_it_takes():
    result = run_python("import minivllm", "mine")
    assert result.returncode != 0
    assert "MINIVLLM_LEARNER='mine': use 1 (or exercises)" in result.stderr
