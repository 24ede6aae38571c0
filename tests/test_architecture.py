"""The engine's shape, checked: the step names no feature, a feature nobody asked for runs
none of its code, the package's imports run one way, and the book's architecture page
describes the hooks and features the code has."""
import ast
import re
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import FEATURES, LLMEngine
from minivllm.step_hooks import StepFeature, hook_names, overridden_hooks

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minivllm"


def imports_of(path: Path) -> set[str]:
    """The minivllm modules a file imports, anywhere in it (inside functions and
    TYPE_CHECKING blocks too: an import there is still an arrow between the files)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minivllm"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("minivllm"))
    return found


def module_graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_two_files_import_each_other():
    graph = module_graph()
    pairs = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets
                    if a in graph.get(b, ()) and not b.endswith("__init__") and a != "minivllm" and b != "minivllm"})
    assert not pairs, f"these files import each other: {pairs}"


def test_kernels_import_nothing_above_them_and_models_no_kernels():
    graph = module_graph()
    for name, targets in graph.items():
        if name.startswith("minivllm.kernels"):
            assert all(t.startswith("minivllm.kernels") for t in targets), (name, targets)
        if name.startswith(("minivllm.models", "minivllm.layers")):
            assert not any(t.startswith("minivllm.kernels") for t in targets), f"{name} imports a kernel: use ops/"


def test_the_step_names_no_feature():
    """LLMEngine.step, schedule, execute and update call the features' hooks, never a feature
    by name."""
    import inspect

    names = {"parallel_sampling", "prompt_logprobs", "structured", "speculation", "grammar", "draft", "fork"}
    for method in (LLMEngine.step, LLMEngine.schedule, LLMEngine.execute, LLMEngine.update):
        code = "\n".join(line.split("#")[0] for line in inspect.getsource(method).splitlines()[1:]
                         if not line.strip().startswith(('"', "'")))
        used = {n for n in names if re.search(rf"\b{n}\b", code)}
        assert not used, f"{method.__qualname__} names {used}"


@pytest.fixture(scope="module")
def llm(tiny_qwen3_with_tokenizer):
    return LLM(model=str(tiny_qwen3_with_tokenizer), num_kv_blocks=64, block_size=8)


def test_a_feature_nobody_asked_for_runs_none_of_its_code(llm, monkeypatch):
    calls = []

    def spy(name, original):
        def hook(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        return hook

    for feature in FEATURES:
        for hook in overridden_hooks(feature):
            if hook != "shutdown":
                monkeypatch.setattr(feature, hook, spy(f"{feature.__name__}.{hook}", getattr(feature, hook)))
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.features == [] and calls == []
    llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=2, n=2), use_tqdm=False)
    assert [type(f) for f in llm.engine.features] == [FEATURES[0]]
    assert "ParallelSampling.prepare" in calls and not any(c.startswith(("Structured", "Prompt")) for c in calls)


def test_the_architecture_page_names_every_hook_and_feature():
    page = (ROOT / "book" / "architecture.md").read_text()
    hooks_table = page.split("The hooks, in the order the step calls them:")[1].split("\n\n")[1]
    table = re.findall(r"^\| `(\w+)` \|", hooks_table, flags=re.M)
    assert table == hook_names(), "the page's hook table must list StepFeature's hooks in the step's order"
    for feature in FEATURES:
        assert feature.__name__ in page or feature.__module__.split(".")[-1] in page
        assert issubclass(feature, StepFeature)
    assert ":pyobject: LLMEngine.step" in page
    assert (ROOT / "book" / "images" / "step_features.png").is_file()


def test_one_step_reads_in_under_1400_lines_and_40_per_function():
    """The functions a plain step runs outside the model (scripts/count_step_path.py): what a
    reader of one step has to read."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("count_step_path", ROOT / "scripts" / "count_step_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for async_scheduling in (False, True):
        functions = module.step_path(async_scheduling)
        total = sum(n for _, n in functions.values())
        assert total <= 1400, f"one step runs {total} lines of the package outside the model"
        long = {name: n for name, n in functions.values() if n > 40}
        assert not long, f"functions on the step's path over 40 lines: {long}"


# The files a reader opens to follow one step (the book's architecture page names them).
STEP_FILES = ("engine/llm_engine.py", "engine/scheduler.py", "engine/block_manager.py", "engine/sequence.py",
              "engine/model_runner.py", "engine/output_processor.py", "context.py", "layers/sampler.py")


def test_the_files_of_one_step_hold_at_most_1400_lines():
    lines = {name: len((PACKAGE / name).read_text().splitlines()) for name in STEP_FILES}
    assert sum(lines.values()) <= 1400, f"the one-step files hold {sum(lines.values())} lines: {lines}"
    page = (ROOT / "book" / "architecture.md").read_text()
    assert f"hold {sum(lines.values()):,} lines" in page, "the architecture page gives another count"
