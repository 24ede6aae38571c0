"""Nothing compiles in the user's run (chapter 17): the engine's start-up runs every kind of
eager step once (``ModelRunner.compile_kernels``), and the kernels do not specialise on what
changes from step to step, so a run launches only kernels that are already compiled."""
import numpy as np
import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.step_inputs import FIELD_ALIGN, StepInputs

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_field_of_the_flat_step_array_starts_aligned():
    """Triton specialises a pointer on its 16-byte alignment: a field whose offset moved with
    the step's sizes would give the kernels that read it a new variant to compile."""
    for sizes in ([1, 1, 1, 1, 0, 0], [7, 3, 5, 2, 1, 0], [250, 17, 33, 17, 9, 3]):
        fields = StepInputs.sizes(*sizes)
        starts, length = StepInputs.offsets(fields)
        assert all(start % FIELD_ALIGN == 0 for start in starts.values())
        assert FIELD_ALIGN * 8 % 16 == 0  # int64 fields: 16-byte aligned
        ends = sorted((starts[name], starts[name] + n) for name, n in fields.items())
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "fields must not overlap"
        assert length >= max(end for _, end in ends)


def test_pack_round_trips_every_field():
    step = StepInputs.pack(
        {"input_ids": [5, 6, 7], "positions": [0, 1, 9], "slot_mapping": [0, 1, 41], "context_lens": [2, 10],
         "cu_seqlens_q": [0, 2, 3], "logits_indices": [1, 2], "pending_dst": [2], "pending_src": [0],
         "copy_src": [], "copy_dst": []},
        [[0], [1, 2, 3]], is_prefill=True, max_seqlen_q=2)
    f = step.fields(step.host)
    assert f["input_ids"].tolist() == [5, 6, 7] and f["positions"].tolist() == [0, 1, 9]
    assert f["cu_seqlens_q"].tolist() == [0, 2, 3] and f["pending_src"].tolist() == [0]
    assert f["block_tables"].tolist() == [[0, -1, -1], [1, 2, 3]]
    assert (step.num_tokens, step.num_seqs, step.block_table_width, step.max_context_len) == (3, 2, 3, 10)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_startup_steps_leave_the_engine_as_it_was(tiny_qwen3, hybrid_checkpoint, family):
    """The start-up steps write into KV blocks and state slots that hold nothing yet: an
    engine that ran them (on the CPU they run only when called) gives the same tokens."""
    path = tiny_qwen3 if family == "qwen3" else hybrid_checkpoint(family)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, size=n).tolist() for n in (5, 40, 90)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(path), max_num_batched_tokens=64).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(path), max_num_batched_tokens=64)
    llm.engine.runner.compile_kernels()
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.runner.num_kv_blocks
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


@pytest.mark.parametrize("decode_graphs", [True, False])
def test_startup_samples_a_greedy_row_beside_a_tempered_one(tiny_qwen3, monkeypatch, decode_graphs):
    """The start-up's sampling reaches the sampling kernels, not only the argmax that a batch
    of greedy rows takes: with decode graphs the last start-up step is one prompt, whose one
    row of logits must still be sampled both ways (a user's first tempered run compiled the
    sampling kernels otherwise)."""
    llm = LLM(str(tiny_qwen3), max_num_batched_tokens=64)
    runner = llm.engine.runner
    sampled, launch = [], runner.sampler.launch

    def spy(logits, params, *args, **kwargs):
        sampled.append((logits.shape[0], [p.temperature for p in params]))
        return launch(logits, params, *args, **kwargs)

    monkeypatch.setattr(runner.sampler, "launch", spy)
    runner.compile_kernels(decode_graphs=decode_graphs)
    (rows, temperatures), = sampled
    assert rows >= 2 and 0.0 in temperatures and any(t > 0 for t in temperatures)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_a_run_compiles_nothing_after_startup(tiny_qwen3, enforce_eager):
    """On the GPU: a mixed workload (prompts of many lengths, a shared prefix, chunked
    prefill, decode) triggers no Triton compilation after the engine is built, with CUDA
    graphs and without (eager decode steps: contexts long enough to split, and short)."""
    from minivllm.bench.compiles import triton_compiles

    llm = LLM(str(tiny_qwen3), max_num_batched_tokens=512, max_num_seqs=64, enforce_eager=enforce_eager)
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 200, size=40).tolist()
    prompts = [(prefix if i % 2 else []) + rng.integers(3, 200, size=int(n)).tolist()
               for i, n in enumerate(rng.integers(1, 400, size=48))]  # prefix + prompt + output < max_model_len 512
    params = [SamplingParams(max_tokens=int(n), temperature=0.6, seed=i, ignore_eos=True)
              for i, n in enumerate(rng.integers(1, 60, size=48))]
    with triton_compiles() as compiled:
        llm.generate(prompts, params, use_tqdm=False)
    assert compiled == [], f"{len(compiled)} kernels compiled inside the run: {compiled[:5]}"


def test_compile_only_turns_this_threads_launches_into_compiles(monkeypatch):
    """``kernels.compile_ahead.compile_only``: inside it a Triton launch on the thread that
    entered it is a compile request (warmup, with Triton's compile mode active there);
    another thread's launch (an engine already stepping) runs as it would; on leaving, the
    launch is Triton's again."""
    import threading

    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    from minivllm.kernels import compile_ahead

    seen = []

    def launch(self, *args, grid, warmup, **kwargs):
        seen.append((threading.current_thread().name, warmup, _async_compile.active_mode.get() is not None))

    monkeypatch.setattr(JITFunction, "run", launch)
    with compile_ahead.compile_only(workers=2):
        JITFunction.run(None, grid=(1,), warmup=False)
        other = threading.Thread(target=lambda: JITFunction.run(None, grid=(1,), warmup=False), name="stepping")
        other.start()
        other.join()
    JITFunction.run(None, grid=(1,), warmup=False)
    this = threading.current_thread().name
    assert seen == [(this, True, True), ("stepping", False, False), (this, False, False)]
    assert JITFunction.run is launch


@pytest.mark.gpu
def test_compile_ahead_leaves_the_startup_passes_nothing_to_compile(tmp_path, monkeypatch):
    """On the GPU, start-up compiles the KV-sizing pass's, the graph passes' and the eager
    steps' kernels ahead, on many threads (kernels.compile_ahead): the sizing pass, the graph
    captures and the compiling steps after it compile nothing themselves, and the engine gives transformers-free greedy tokens identical to an
    engine started without it. A model shape no other test uses, so that its kernels are
    new to this process."""
    from minivllm.bench.compiles import triton_compiles
    from minivllm.engine import runner_startup
    from minivllm.engine.runner_startup import RunnerStartup, warmup
    from minivllm.kernels import sampling
    from minivllm.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", family="qwen3", seed=5, hidden_size=96, num_attention_heads=6,
                                num_key_value_heads=3, head_dim=32, intermediate_size=160)
    compiled_in = {}
    capture, compile_kernels = RunnerStartup.capture_cudagraphs, RunnerStartup.compile_kernels

    def recording(name, fn):
        def call(self, *args, **kwargs):
            dry = kwargs.get("dry") or kwargs.get("sample") is False
            with triton_compiles() as compiled:
                fn(self, *args, **kwargs)
            compiled_in.setdefault(f"{name} (ahead)" if dry else name, []).extend(compiled)
        return call

    warmups = []  # the KV-sizing pass's compiles: ahead, then the real pass

    def recording_warmup(*args):
        with triton_compiles() as compiled:
            warmup(*args)
        warmups.append(compiled)

    monkeypatch.setattr(RunnerStartup, "capture_cudagraphs", recording("graphs", capture))
    monkeypatch.setattr(RunnerStartup, "compile_kernels", recording("steps", compile_kernels))
    monkeypatch.setattr(runner_startup, "warmup", recording_warmup)
    llm = LLM(str(path), max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512)
    assert "compile_ahead" in llm.engine.runner.startup_seconds
    # The matmuls' warm-up ran inside it, beside the compiles: no phase of its own.
    assert "warm_matmuls" not in llm.engine.runner.startup_seconds
    assert compiled_in["graphs (ahead)"] and compiled_in["graphs"] == [], compiled_in
    assert len(warmups) == 2 and warmups[0] and warmups[1] == [], warmups
    # The compiling steps' own compiles are the sampler's kernels only (not run ahead).
    sampler_kernels = {name for name in dir(sampling) if name.endswith("_kernel")}
    assert {c.split("[")[0] for c in compiled_in["steps"]} <= sampler_kernels, compiled_in["steps"]
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 90)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    monkeypatch.setenv("MINIVLLM_COMPILE_AHEAD", "0")
    plain = LLM(str(path), max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512)
    assert "compile_ahead" not in plain.engine.runner.startup_seconds
    assert "warm_matmuls" in plain.engine.runner.startup_seconds
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)] == got
    plain.shutdown()


def test_triton_hashes_itself_in_the_background():
    """``hash_triton_in_background`` starts Triton's hash of its installation (the key of its
    cache, which the first compile or launch needs) on a thread of its own; with this
    Triton the function exists, so the start-up's half second is really moved."""
    import threading

    from triton.runtime import cache

    from minivllm.kernels.compile_ahead import hash_triton_in_background

    assert hasattr(cache, "triton_key")
    hash_triton_in_background()
    threads = [t for t in threading.enumerate() if t.name == "triton-key"]
    for t in threads:
        t.join(timeout=120)
    assert cache.triton_key.cache_info().currsize == 1
    assert cache.triton_key() == cache.triton_key.__wrapped__()


def test_startup_is_timed_by_phase(tiny_qwen3):
    """``minivllm bench throughput`` reports where construction's time goes: on the CPU the
    weights and the KV pool (no graphs to capture, nothing compiled ahead)."""
    phases = LLM(str(tiny_qwen3)).engine.runner.startup_seconds
    assert set(phases) == {"load_weights", "kv_cache"}
    assert all(seconds > 0 for seconds in phases.values())


def test_matmuls_are_warmed_at_every_row_count_a_run_reaches(tiny_qwen3, monkeypatch):
    """The GEMM library picks (and first loads) a kernel by the row count, so start-up runs
    every linear layer at each count up to max_num_seqs and at a stride up to the step budget,
    and the LM head at each count of sampled rows (``ModelRunner.warm_matmuls``)."""
    import torch

    import minivllm.ops.linear
    from minivllm.engine.runner_startup import MATMUL_WARM_STEP

    llm = LLM(str(tiny_qwen3), max_num_batched_tokens=300, max_num_seqs=40)
    runner = llm.engine.runner
    seen = {}
    op, head = minivllm.ops.linear.linear, torch.nn.functional.linear

    def recording(fn):
        def call(x, weight, *args):
            seen.setdefault(tuple(weight.shape), set()).add(x.shape[0])
            return fn(x, weight, *args)
        return call

    monkeypatch.setattr(minivllm.ops.linear, "linear", recording(op))
    monkeypatch.setattr(torch.nn.functional, "linear", recording(head))
    runner.warm_matmuls()
    config = runner.model_config
    shapes = {tuple(p.shape) for name, p in runner.model.named_parameters() if p.dim() == 2 and "embed" not in name}
    assert shapes <= set(seen), f"not warmed: {shapes - set(seen)}"
    expected = set(range(1, 41)) | set(range(MATMUL_WARM_STEP, 301, MATMUL_WARM_STEP)) | {300}
    lm_head = (config.vocab_size, config.hidden_size)
    for shape, counts in seen.items():
        assert counts == (set(range(1, 41)) if shape == lm_head else expected), shape
    assert lm_head in seen
