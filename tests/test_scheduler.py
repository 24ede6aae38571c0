"""The scheduler with a fake model: continuous batching, chunked prefill, preemption, aborts.

A fake step stands in for the model runner and the engine's post-processing: it "computes"
the scheduled tokens (recording in a fake KV store, for every slot, the whole prefix its
token was computed after), appends a random token to each sequence whose step completes,
and finishes sequences at max_tokens or at the pool's length limit, as the engine does.
"""
import random
from unittest import mock

from hypothesis import event, given, settings
from hypothesis import strategies as st

from minivllm.engine import block_manager as bm_module
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.scheduler import ScheduledBatch, Scheduler
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams


class FakeEngine:
    def __init__(self, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, prefix_caching=True, seed=0):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens)
        self.max_model_len = num_blocks * block_size
        self.kv: dict[int, tuple] = {}
        self.rng = random.Random(seed)
        self.finished: list[Sequence] = []
        self.batches: list[ScheduledBatch] = []
        self.chunked = False  # did a prompt take more than one step?

    def add(self, prompt, max_tokens, request_id=None) -> Sequence:
        assert len(prompt) < self.max_model_len
        seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens), request_id)
        self.scheduler.add(seq)
        return seq

    def step(self) -> ScheduledBatch:
        s = self.scheduler
        batch = s.schedule()
        self.batches.append(batch)
        if not batch.seqs:
            assert not s.waiting or s.running, f"stuck: {s.waiting[0]} cannot be admitted into an idle engine"
        self.check_batch(batch)
        completes = [batch.samples(i) for i in range(len(batch))]
        self.chunked |= not all(completes)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            # The "attention" reads every cached token before this step's: each must hold
            # exactly this sequence's prefix (a wrongly shared block would not).
            for p in range(seq.num_computed_tokens):
                assert self.kv.get(self.bm.slot(seq, p)) == tuple(seq.token_ids[: p + 1]), (seq, p)
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.kv[self.bm.slot(seq, p)] = tuple(seq.token_ids[: p + 1])
            seq.num_computed_tokens += n
            self.bm.commit_full_blocks(seq)
        for seq, done in zip(batch.seqs, completes):
            if not done:
                continue
            seq.token_ids.append(self.rng.randrange(4))
            if seq.num_output_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= self.max_model_len:
                s.finish(seq, "length")
                self.finished.append(seq)
        self.check_state()
        return batch

    def check_batch(self, batch: ScheduledBatch) -> None:
        s = self.scheduler
        assert batch.num_tokens <= s.max_num_batched_tokens
        assert len(batch) <= s.max_num_seqs
        assert len({seq.seq_id for seq in batch.seqs}) == len(batch), "a sequence scheduled twice"
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status == SequenceStatus.RUNNING and seq in s.running
            assert 1 <= n <= seq.num_tokens - seq.num_computed_tokens
            # It holds blocks for every token it will have computed after this step.
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens + n
        for seq in batch.preempted:
            assert seq.status == SequenceStatus.WAITING and seq.block_table == []
            assert seq not in batch.seqs

    def check_state(self) -> None:
        s = self.scheduler
        self.bm.check_invariants(list(s.running) + list(s.waiting))
        assert len(s.running) <= s.max_num_seqs
        for seq in s.running:
            assert seq.status == SequenceStatus.RUNNING
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens
        for seq in s.waiting:
            assert seq.status == SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0

    def run_to_completion(self, max_steps=10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError("no progress")

    def check_all_free(self) -> None:
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 8))
    num_blocks = draw(st.integers(2, 24))
    pool = num_blocks * block_size
    requests = draw(st.lists(
        st.tuples(
            st.integers(1, pool - 1),  # prompt length: every request fits in the pool alone
            st.integers(1, 12),  # max_tokens
            st.integers(0, 3),  # arrives after this many steps of the previous one
            st.lists(st.integers(0, 3), min_size=1, max_size=4),  # prompt pattern (repeats: prefix hits)
        ),
        min_size=1, max_size=12,
    ))
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 11)), max_size=3))
    return dict(
        block_size=block_size, num_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        prefix_caching=draw(st.booleans()),
        collide=draw(st.booleans()),
        requests=requests, aborts=aborts, seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_random_request_streams(w):
    """After every step the books balance; at the end every block is free again."""
    if w["collide"]:  # every block hashes alike: only the collision guard prevents wrong sharing
        with mock.patch.object(bm_module, "block_hash", lambda token_ids, parent_hash: 7):
            run_workload(w)
    else:
        run_workload(w)


def run_workload(w):
    eng = FakeEngine(w["num_blocks"], w["block_size"], w["max_num_seqs"], w["max_num_batched_tokens"],
                     w["prefix_caching"], w["seed"])
    arrivals = []  # (step, prompt, max_tokens)
    t = 0
    for length, max_tokens, gap, pattern in w["requests"]:
        t += gap
        arrivals.append((t, [pattern[i % len(pattern)] for i in range(length)], max_tokens))
    aborts = dict(w["aborts"])  # step -> index of the request to abort
    added: list[Sequence] = []
    step = 0
    while arrivals or eng.scheduler.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            _, prompt, max_tokens = arrivals.pop(0)
            added.append(eng.add(prompt, max_tokens, request_id=f"r{len(added)}"))
        if step in aborts and added:
            seq = added[aborts[step] % len(added)]
            was_finished = seq.is_finished
            aborted = eng.scheduler.abort(seq.request_id)
            if was_finished:
                assert aborted is None  # already done: a no-op
            else:
                assert aborted is seq and seq.finish_reason == "abort" and seq.block_table == []
            eng.check_state()
        eng.step()
        step += 1
        assert step < 5_000, "no progress"
    eng.check_all_free()
    # What the example exercised (see pytest --hypothesis-show-statistics).
    event(f"preempted: {any(b.preempted for b in eng.batches)}")
    event(f"prefix hit: {any(seq.num_cached_tokens for seq in added)}")
    event(f"chunked prefill: {eng.chunked}")
    for seq in added:
        assert seq.is_finished
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.sampling_params.max_tokens or seq.num_tokens == eng.max_model_len


# -- direct unit tests ----------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt():
    eng = FakeEngine(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    seq = eng.add(list(range(40)), max_tokens=2)
    chunks = [eng.step().num_new_tokens for _ in range(3)]
    assert chunks == [[16], [16], [8]]
    assert seq.num_output_tokens == 1  # sampled only when the last chunk completed
    assert eng.step().num_new_tokens == [1]
    assert seq.is_finished
    eng.check_all_free()


def test_decodes_go_before_new_prefills():
    eng = FakeEngine(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=10)
    a = eng.add([1] * 5, max_tokens=5)
    eng.step()  # a's whole prompt
    b = eng.add([2] * 30, max_tokens=1)
    batch = eng.step()
    # a decodes first; b's prefill gets the 9 tokens of budget that are left.
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 9]
    batch = eng.step()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 9]
    eng.run_to_completion()
    eng.check_all_free()


def test_max_num_seqs_limits_admission():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [eng.add([i] * 3, max_tokens=4) for i in range(5)]
    batch = eng.step()
    assert batch.seqs == seqs[:2]
    assert list(eng.scheduler.waiting) == seqs[2:]
    eng.run_to_completion()
    assert all(len(b) <= 2 for b in eng.batches)
    eng.check_all_free()


def test_preemption_takes_the_newest_and_requeues_it_first():
    # 4 blocks of 4 tokens. Two 7-token prompts take 2 blocks each; the first one to need a
    # third block forces the newest out.
    eng = FakeEngine(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    old = eng.add([1] * 7, max_tokens=6)
    new = eng.add([2] * 7, max_tokens=6)
    late = eng.add([3] * 2, max_tokens=1)  # queued behind them
    batch = eng.step()
    assert batch.seqs == [old, new]
    batch = eng.step()  # both at 8 tokens: decoding the 8th token still fits
    assert batch.seqs == [old, new] and not batch.preempted
    batch = eng.step()  # old's 9th token needs a third block: new goes
    assert batch.preempted == [new] and batch.seqs == [old]
    assert new.num_preemptions == 1 and new.status == SequenceStatus.WAITING
    assert list(eng.scheduler.waiting) == [new, late]  # back at the front of the queue
    tokens_so_far = list(new.token_ids)
    eng.run_to_completion()
    # It resumed from its own tokens (prompt and what it had generated), recomputed.
    assert new.token_ids[: len(tokens_so_far)] == tokens_so_far
    assert old.num_output_tokens == new.num_output_tokens == 6
    eng.check_all_free()


def test_abort_frees_blocks_at_once():
    eng = FakeEngine(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a = eng.add([1] * 9, max_tokens=8, request_id="a")
    b = eng.add([2] * 9, max_tokens=8, request_id="b")
    eng.step()
    free_before = eng.bm.num_free_blocks
    assert eng.scheduler.abort("a") is a
    assert a.finish_reason == "abort" and a.block_table == []
    assert eng.bm.num_free_blocks == free_before + 3
    assert eng.scheduler.abort("a") is None  # gone already
    eng.check_state()
    waiting = eng.add([3] * 3, max_tokens=2, request_id="w")
    assert eng.scheduler.abort("w") is waiting and waiting.is_finished
    eng.run_to_completion()
    assert b.num_output_tokens == 8
    eng.check_all_free()


def test_a_prompt_as_long_as_the_pool_allows_runs_alone():
    # 15 tokens in a 16-slot pool: it runs once the others are gone and ends at the limit.
    eng = FakeEngine(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    small = [eng.add([i] * 5, max_tokens=3) for i in range(2)]
    big = eng.add(list(range(15)), max_tokens=10)
    eng.run_to_completion()
    assert all(s.num_output_tokens == 3 for s in small)
    assert big.num_tokens == 16 and big.finish_reason == "length"
    eng.check_all_free()
