"""Chapter 17 — asynchronous scheduling: the inputs still on the device, and the step not taken.

Your ``pending inputs`` (in ``ModelRunner.upload``, exercises/minivllm/engine/model_runner.py)
fill the input rows whose token the previous step sampled: the host has not seen those
tokens, they are on the device in ``previous_tokens``. Your ``Sequence.last_token_pending``
(exercises/minivllm/engine/sequence.py) tells the scheduler that a sequence's pending token
is its last (it reaches ``max_tokens``), so that no step is spent on it.

Both are checked on their own first: hand-built steps whose pending rows come in a scrambled
order, a previous step with more rows than this one, tokens that must never be read back
to the host, and sequences of every state for ``last_token_pending``. Then through the
engine, asynchronous scheduling forced on for the CPU: it must give the synchronous loop's
tokens, token for token, on a workload with chunked prefill, sequences that finish at
different times, seeded sampling, stop tokens and no ``max_tokens``; and where every length
is known in advance, it must run each request in exactly the steps the synchronous loop
runs it in (one step more means a step wasted on a token nobody wants; a gap means a
step skipped too early).
"""
import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from minivllm import LLM, SamplingParams
from minivllm.context import reset_context
from minivllm.engine.step_inputs import StepInputs
from minivllm.engine.sequence import Sequence
from minivllm.testing import torch_threads

MAX_STEPS = 2000  # far more than any workload here needs: past it, a sequence is never scheduled again


@pytest.fixture(scope="module")
def runner(tiny_qwen3):
    with torch_threads(1):
        return LLM(str(tiny_qwen3), device="cpu", num_kv_blocks=64, block_size=8, async_scheduling=True).engine.runner


def decode_step(input_ids: list[int], pending_dst: list[int], pending_src: list[int]) -> StepInputs:
    """A decode step of len(input_ids) sequences (one token each) whose rows pending_dst
    take their token from rows pending_src of the previous step's samples."""
    n = len(input_ids)
    fields = {"input_ids": input_ids, "positions": [5] * n, "slot_mapping": list(range(n)), "context_lens": [6] * n,
              "cu_seqlens_q": list(range(n + 1)), "logits_indices": list(range(n)),
              "pending_dst": pending_dst, "pending_src": pending_src}
    return StepInputs.pack(fields, [[i] for i in range(n)], is_prefill=False, max_seqlen_q=1,
                           logits_of_every_sequence=True)


def upload(runner, step: StepInputs, previous_tokens: torch.Tensor) -> list[int]:
    try:
        input_ids, _ = runner.upload(step, previous_tokens)
        return input_ids.tolist()
    except IndexError as e:
        pytest.fail(f"IndexError in upload ({e}): pending_src are rows of previous_tokens, pending_dst rows of "
                    "this step's input ids", pytrace=False)
    finally:
        reset_context()


def test_ch17_pending_rows_take_their_own_token(runner):
    # Rows 1, 3 and 4 were sampled by the previous step (placeholder 0 on the host), at
    # rows 2, 0 and 5 of its samples: the order differs, and that step had more rows.
    previous = torch.tensor([101, 102, 103, 104, 105, 106])
    got = upload(runner, decode_step([7, 0, 9, 0, 0], [1, 3, 4], [2, 0, 5]), previous)
    want = [7, 103, 9, 101, 106]
    assert [got[i] for i in (1, 3, 4)] != [0, 0, 0], "the pending rows kept their placeholder 0: fill them from previous_tokens"
    assert got == want, (
        f"input ids {got}, expected {want}: row pending_dst[i] takes previous_tokens[pending_src[i]] "
        "(not previous_tokens[i], not row pending_src[i]), and the other rows keep the host's ids")


def test_ch17_pending_rows_random(runner):
    rng = random.Random(17)
    for _ in range(20):
        n, extra = rng.randint(1, 12), rng.randint(0, 5)
        dst = sorted(rng.sample(range(n), rng.randint(1, n)))
        src = rng.sample(range(len(dst) + extra), len(dst))  # any rows of a previous step that may be larger
        previous = torch.tensor([rng.randrange(1000, 2000) for _ in range(len(dst) + extra)])
        host = [rng.randrange(1, 1000) for _ in range(n)]
        want = list(host)
        for d, s in zip(dst, src):
            host[d] = 0  # the placeholder prepare writes
            want[d] = previous[s].item()
        got = upload(runner, decode_step(host, dst, src), previous)
        assert got == want, f"pending_dst={dst}, pending_src={src}, previous_tokens={previous.tolist()}: got {got}, expected {want}"


class NoHostReads(TorchFunctionMode):
    """Fails on any read of the previous step's tokens back to the host: on a GPU each of these
    waits for that step to finish, which is what asynchronous scheduling must not do."""

    READS = {"tolist", "item", "numpy", "__int__", "__index__", "__float__", "__bool__"}
    MOVES = {"cpu", "to", "unbind"}

    def __init__(self, previous: torch.Tensor):
        super().__init__()
        self.previous = previous

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if name in self.READS or (name in self.MOVES and first is self.previous):
            raise AssertionError(
                f"upload called Tensor.{name}: the previous step's tokens are read back to the host, which on a GPU "
                "waits for that step to finish. Index previous_tokens on the device: one indexed assignment")
        return func(*args, **(kwargs or {}))


def test_ch17_pending_tokens_stay_on_the_device(runner):
    previous = torch.tensor([11, 12, 13, 14])
    step = decode_step([5, 0, 0, 6], [1, 2], [3, 0])
    with NoHostReads(previous):
        try:
            input_ids, _ = runner.upload(step, previous)
        finally:
            reset_context()
    assert input_ids.tolist() == [5, 14, 11, 6], f"input ids {input_ids.tolist()}, expected [5, 14, 11, 6]"


# --- last_token_pending ---------------------------------------------------------------


def sequence(prompt_len: int, num_output: int, num_pending: int, max_tokens: int | None) -> Sequence:
    seq = Sequence(list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens))
    seq.token_ids += [9] * num_output  # on the host
    seq.num_pending = num_pending  # still on the device
    return seq


@pytest.mark.parametrize("prompt_len, num_output, num_pending, max_tokens, want", [
    (5, 2, 1, 3, True),  # 2 on the host + 1 on the device = max_tokens: that one is the last
    (5, 1, 1, 3, False),  # 2 of 3: one more step to go
    (5, 0, 1, 1, True),  # the prefill's token is the only one
    (5, 0, 1, 2, False),
    (40, 2, 1, 3, True),  # a long prompt: only the output tokens count
    (40, 1, 1, 30, False),  # ... so 41 tokens in all is not past max_tokens=30
    (5, 7, 1, None, False),  # no max_tokens: it never ends this way
])
def test_ch17_last_token_pending_examples(prompt_len, num_output, num_pending, max_tokens, want):
    seq = sequence(prompt_len, num_output, num_pending, max_tokens)
    got = seq.last_token_pending
    assert got is want or got == want, (
        f"prompt {prompt_len} tokens, {num_output} output tokens on the host, {num_pending} pending, "
        f"max_tokens={max_tokens}: last_token_pending is {got!r}, expected {want}")


# --- through the engine -------------------------------------------------------------------


def engines(checkpoint, **args):
    """The same engine twice: synchronous and asynchronous (forced on: on a CPU it is off by default)."""
    with torch_threads(1):
        return [LLM(str(checkpoint), device="cpu", async_scheduling=a, record_trace=True, **args).engine
                for a in (False, True)]


def run(engine, requests):
    """Each request's output and the steps its sequence ran in."""
    ids = [engine.add_request(prompt, params, request_id=f"r{i}") for i, (prompt, params) in enumerate(requests)]
    seq_of = {rid: engine.requests[rid].seq.seq_id for rid in ids}
    outputs = {}
    with torch_threads(1):
        for _ in range(MAX_STEPS):
            if not engine.has_unfinished_requests():
                break
            outputs.update((o.request_id, o) for o in engine.step())
        else:
            pending = [rid for rid in ids if rid not in outputs]
            pytest.fail(f"after {MAX_STEPS} steps requests {pending[:5]} are still unfinished: a sequence whose "
                        "last_token_pending is wrongly True is never scheduled again", pytrace=False)
    steps = {rid: [r.step for r in engine.trace if any(s == seq_of[rid] for s, _, _ in r.seqs)] for rid in ids}
    return [outputs[rid] for rid in ids], [steps[rid] for rid in ids]


def workload(seed: int, n: int, known_lengths: bool):
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
        if known_lengths:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 25), ignore_eos=True)
        elif i % 4 == 0:
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(1, 20), ignore_eos=True)
        elif i % 4 == 1:
            params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[rng.randrange(3, 500) for _ in range(40)])
        elif i % 4 == 2:
            params = SamplingParams(temperature=0, max_tokens=None)  # to the end of the context
        else:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=True)
        requests.append((prompt, params))
    return requests


def test_ch17_asynchronous_gives_the_synchronous_tokens(tiny_qwen3):
    # A small token budget: prompts are chunked, and decodes share steps with prefills.
    sync, asyn = engines(tiny_qwen3, num_kv_blocks=400, block_size=8, max_num_batched_tokens=48, max_model_len=96)
    requests = workload(0, 16, known_lengths=False)
    want, _ = run(sync, requests)
    got, _ = run(asyn, requests)
    for i, (w, g) in enumerate(zip(want, got)):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids, (
            f"request {i} ({requests[i][1]}): asynchronous tokens {g.token_ids} differ from the synchronous "
            f"{w.token_ids}: an input row got the wrong token (check the pending rows)")
        assert g.finish_reason == w.finish_reason
    assert {o.outputs[0].finish_reason for o in want} == {"stop", "length"}, "a weak workload: every request ended the same way"


def test_ch17_no_step_is_wasted_when_max_tokens_is_known(tiny_qwen3):
    # Room for everyone and no prefix caching: both loops schedule the same batches.
    sync, asyn = engines(tiny_qwen3, num_kv_blocks=400, block_size=8, max_num_batched_tokens=64,
                         enable_prefix_caching=False)
    requests = workload(1, 12, known_lengths=True)
    want, want_steps = run(sync, requests)
    got, got_steps = run(asyn, requests)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"request {i}: the tokens differ from the synchronous loop's"
        extra, missing = sorted(set(got_steps[i]) - set(want_steps[i])), sorted(set(want_steps[i]) - set(got_steps[i]))
        assert not extra and not missing, (
            f"request {i} (max_tokens={requests[i][1].max_tokens}) ran in steps {got_steps[i]}, the synchronous loop "
            f"in {want_steps[i]}: " + ("a step after its last token was spent on it (last_token_pending was False "
            "when the pending token is its last)" if extra and not missing else "it was left out of a step it needed "
            "(last_token_pending was True too early)"))
    assert asyn.num_steps == sync.num_steps


# --- the overlapped step, on a fake engine ---------------------------------------------


class _Sampled:
    def __init__(self, name):
        self.token_ids = f"tokens of {name}"


class _Launched:
    def __init__(self, name, deferred=False):
        self.name = name
        self.sampled = None if deferred else _Sampled(name)
        self.deferred = (f"logits of {name}", _Inputs()) if deferred else None
        self.requests = [f"request of {name}"]
        self.finished = [f"finished in {name}"]

    def row_of(self):
        return {7: self.name}

    def mask_later(self, requests):
        return f"masks for {requests}"


class _Inputs:
    params, generators, banned, history = "params", "generators", "banned", "history"


class _FakeEngine:
    """Records the order of the engine's calls; batches are names, launched steps _Launched."""

    def __init__(self, batches, deferred=()):
        self.batches = list(batches)
        self.deferred = set(deferred)
        self.calls = []
        self.runner = self
        self.tracer = self  # the step trace: the drained step's finished sequences (note_finished)

    def note_finished(self, finished):
        self.calls.append(("note_finished", finished))

    def before_schedule(self):
        self.calls.append("before_schedule")
        return ["early output"]

    def schedule(self):
        batch = self.batches.pop(0) if self.batches else None
        self.calls.append(("schedule", batch))
        return batch

    def execute(self, batch, previous):
        self.calls.append(("execute", batch, previous))
        return _Launched(batch, deferred=batch in self.deferred)

    def update(self, step):
        self.calls.append(("update", step.name))
        return [f"output of {step.name}"]

    def account(self, launched, processed, start):
        self.calls.append(("account", launched.name, processed and processed.name, isinstance(start, float)))

    def sample(self, logits, params, generators, banned, history, masks):
        self.calls.append(("sample", logits, params, generators, banned, history, masks))
        return _Sampled("deferred")


def _overlapped(engine):
    from minivllm.engine.overlap import OverlappedStep

    return OverlappedStep(engine)


def test_ch17_overlapped_step_launches_the_next_step_before_taking_in_the_last():
    engine = _FakeEngine(["A", "B"])
    step = _overlapped(engine)
    assert step.step() == ["early output"], "the first step launches A and has nothing to take in yet"
    assert ("execute", "A", None) in engine.calls, "nothing in flight: the first step reads no previous tokens"
    assert step.in_flight is not None and step.in_flight.name == "A", "A is now the step in flight"
    engine.calls.clear()
    out = step.step()
    assert out == ["early output", "output of A"], f"the second step returns A's outputs (taken in), got {out}"
    kinds = [c if isinstance(c, str) else c[0] for c in engine.calls]
    assert kinds.index("execute") < kinds.index("update"), (
        "B must be launched before A is taken in: that is the overlap (updating first gives the same tokens, "
        "but the device waits for the host)")
    assert ("execute", "B", ("tokens of A", {7: "A"})) in engine.calls, (
        "B's pending inputs read the step in flight's sampled tokens and each sequence's row (row_of)")
    assert ("account", "B", "A", True) in engine.calls, "the engine accounts for the launched and the processed step"
    assert step.in_flight.name == "B", "B is in flight after the step"


def test_ch17_overlapped_step_drains_when_nothing_is_scheduled():
    engine = _FakeEngine(["A"])
    step = _overlapped(engine)
    step.step()
    engine.calls.clear()
    out = step.step()
    assert out == ["early output", "output of A"], "with nothing to schedule, the step still takes in A"
    assert not any(c[0] == "execute" for c in engine.calls if isinstance(c, tuple)), "no batch: nothing to execute"
    assert not any(c[0] == "account" for c in engine.calls if isinstance(c, tuple)), "nothing launched: nothing to account"
    assert step.in_flight is None, "nothing is in flight once the last step is taken in"
    assert step.previous_tokens() is None, "nothing in flight: no previous tokens"
    assert step.step() == ["early output"], "an idle engine returns only the early outputs"


def test_ch17_a_deferred_step_is_sampled_after_the_update():
    engine = _FakeEngine(["A", "B", "C"], deferred={"B"})
    step = _overlapped(engine)
    step.step()
    engine.calls.clear()
    step.step()
    kinds = [c if isinstance(c, str) else c[0] for c in engine.calls]
    assert "sample" in kinds and kinds.index("update") < kinds.index("sample"), (
        "a step whose grammar waits for the tokens in flight is sampled only after they are taken in")
    assert engine.calls[kinds.index("sample")] == ("sample", "logits of B", "params", "generators", "banned", "history",
                                                   "masks for ['request of B']"), (
        "sample the deferred logits with the step's inputs and the masks its requests give now")
    assert step.in_flight.deferred is None, "the deferred step's inputs are cleared: it is sampled once"
    assert step.in_flight.sampled.token_ids == "tokens of deferred", "its sampled tokens are stored on the step"
    engine.calls.clear()
    step.step()
    assert ("execute", "C", ("tokens of deferred", {7: "B"})) in engine.calls, (
        "the next step reads the deferred step's tokens")


def test_ch17_previous_tokens_of_a_step_not_yet_sampled():
    step = _overlapped(_FakeEngine([]))
    step.in_flight = _Launched("X", deferred=True)
    assert step.previous_tokens() is None, "a step in flight that sampled nothing yet has no tokens to read"
    step.in_flight = _Launched("Y")
    assert step.previous_tokens() == ("tokens of Y", {7: "Y"})
