"""Chapter 07 — the scheduler: making room by preemption.

Your preemption loop (inside ``Scheduler.schedule``, exercises/minivllm/engine/scheduler.py)
is driven with a fake engine step that stands in for the model (it moves
``num_computed_tokens`` forward, commits full blocks, appends a token to every sequence
whose step completes and finishes it at ``max_tokens``): hand-built situations where the
pool runs dry (who is preempted, in which order, what happens when the sequence that needs
room is itself the newest, that one victim is not always enough, and that nobody is
preempted while the last block still has room), random workloads checked after every step,
and finally the real engine on a pool so small that it must preempt, against transformers'
greedy tokens on the same weights.

The engine adds one token per step, so a decode needs at most one new block and the first
victim always frees enough. The fake engine can also add several tokens in one step (as
speculative decoding does when it accepts draft tokens); then a sequence can need several
blocks at once, which tells ``while`` from ``if`` and ``can_grow(seq, n)`` from
``can_grow(seq, 1)``.

Graded: ``Scheduler._schedule_running`` (the preemption loop inside it), ``_admit_waiting``,
``_preempt`` and ``finish``.
"""
import random

import pytest
import torch
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.scheduler import ScheduledBatch, Scheduler
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams
from minivllm.testing import torch_threads


class FakeEngine:
    """The engine's bookkeeping around Scheduler.schedule, with a token generator instead of a model."""

    def __init__(self, num_blocks, block_size, max_num_seqs=8, max_num_batched_tokens=64, prefix_caching=False,
                 seed=0, max_burst=1):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens)
        self.rng = random.Random(seed)
        self.max_burst = max_burst  # most tokens a completing step appends (1: the engine)
        self.finished: list[Sequence] = []

    def add(self, prompt_len: int, max_tokens: int) -> Sequence:
        seq = Sequence([self.rng.randrange(1000) for _ in range(prompt_len)], SamplingParams(max_tokens=max_tokens))
        self.scheduler.add(seq)
        return seq

    def step(self) -> ScheduledBatch:
        running_before = list(self.scheduler.running)
        try:
            batch = self.scheduler.schedule()
        except KeyError as e:  # popping an empty free list in BlockManager._take_free_block
            pytest.fail(
                f"KeyError {e} inside schedule: most likely the free list ran dry while growing a sequence; keep "
                "preempting while the block manager cannot grow seq by all n of its new tokens", pytrace=False,
            )
        check_batch(self, batch, running_before)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            done = batch.samples(i)
            seq.num_computed_tokens += n
            self.bm.commit_full_blocks(seq)
            if done:
                burst = self.rng.randint(1, self.max_burst) if self.max_burst > 1 else 1
                burst = min(burst, seq.sampling_params.max_tokens - seq.num_output_tokens)
                seq.token_ids.extend(self.rng.randrange(1000) for _ in range(burst))
                if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                    self.scheduler.finish(seq, "length")
                    self.finished.append(seq)
        self.bm.check_invariants(self.scheduler.running)
        return batch


def check_batch(engine: FakeEngine, batch: ScheduledBatch, running_before: list[Sequence]) -> None:
    s = engine.scheduler
    ids = [seq.seq_id for seq in batch.seqs]
    assert len(ids) == len(set(ids)), "a sequence appears twice in one batch"
    for victim in batch.preempted:
        assert victim not in batch.seqs, f"sequence {victim.seq_id} was preempted but is still in the batch"
        assert victim.status == SequenceStatus.WAITING and victim in s.waiting and victim not in s.running
        assert victim.block_table == [] and victim.num_computed_tokens == 0
    # Victims are taken from the back of the running list (newest first), in that order.
    expected_victims = running_before[len(running_before) - len(batch.preempted):][::-1]
    assert batch.preempted == expected_victims, (
        f"preempted {[v.seq_id for v in batch.preempted]}, but the most recently admitted running sequences "
        f"(running was {[x.seq_id for x in running_before]}) are {[v.seq_id for v in expected_victims]}"
    )
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        assert len(seq.block_table) * engine.bm.block_size >= seq.num_computed_tokens + n, (
            f"sequence {seq.seq_id} was scheduled without the blocks for its new tokens"
        )


def three_full_sequences() -> tuple[FakeEngine, Sequence, Sequence, Sequence]:
    # 4-token blocks, 6 in the pool. A, B and C have 7-token prompts: two blocks each, the
    # pool is full; after one token each, the next decode needs a third block each. Five
    # new tokens each: two sequences of 7 + 5 - 1 computed tokens fit in the pool.
    engine = FakeEngine(num_blocks=6, block_size=4)
    a, b, c = engine.add(7, 5), engine.add(7, 5), engine.add(7, 5)
    first = engine.step()  # admits and prefills all three
    assert first.seqs == [a, b, c] and engine.bm.num_free_blocks == 0
    second = engine.step()  # token 7 of each still fits in its second block
    assert second.seqs == [a, b, c] and not second.preempted
    return engine, a, b, c



# --- admission, chunking and the preemption itself ------------------------------------


def test_ch07_admission_in_order_up_to_max_num_seqs():
    engine = FakeEngine(num_blocks=20, block_size=4, max_num_seqs=2)
    a, b, c = engine.add(3, 2), engine.add(3, 2), engine.add(3, 2)
    batch = engine.scheduler.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [3, 3], (
        f"waiting sequences are admitted from the front of the queue, at most max_num_seqs running: "
        f"{[x.seq_id for x in batch.seqs]}")
    assert engine.scheduler.running == [a, b] and list(engine.scheduler.waiting) == [c]
    assert a.status == SequenceStatus.RUNNING and a.block_table, "an admitted sequence is RUNNING and holds blocks"


def test_ch07_a_long_prompt_is_chunked_by_the_budget():
    engine = FakeEngine(num_blocks=20, block_size=4, max_num_batched_tokens=8)
    a, b = engine.add(13, 2), engine.add(6, 2)
    sizes = []
    for _ in range(3):
        batch = engine.step()
        sizes.append([(seq.seq_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)])
    assert sizes == [[(a.seq_id, 8)], [(a.seq_id, 5), (b.seq_id, 3)], [(a.seq_id, 1), (b.seq_id, 3)]], (
        f"a 13-token prompt under an 8-token budget: 8 tokens, then its last 5 (running sequences first) and 3 "
        f"of the next prompt with what is left, then a decode and the prompt's last 3: {sizes}")


def test_ch07_admission_does_not_skip_a_sequence_that_does_not_fit():
    engine = FakeEngine(num_blocks=4, block_size=4)
    a = engine.add(10, 8)  # 3 blocks
    engine.step()
    big, small = engine.add(8, 2), engine.add(2, 2)  # big needs 2 blocks, 1 is free; small would fit
    batch = engine.step()
    assert big not in batch.seqs and small not in batch.seqs, (
        "the queue is served in order: a sequence that does not fit blocks those behind it (no overtaking)")
    assert list(engine.scheduler.waiting) == [big, small]


def test_ch07_admission_respects_the_forks_of_n_completions():
    engine = FakeEngine(num_blocks=20, block_size=4, max_num_seqs=3)
    a = engine.add(3, 2)
    engine.step()
    b = engine.add(3, 2)
    b.num_forks = 2  # b and its two forks would make four running sequences
    batch = engine.scheduler.schedule()
    assert b not in batch.seqs and list(engine.scheduler.waiting) == [b], (
        "a sequence that forks into n completions is admitted only with room for its forks under max_num_seqs")


def test_ch07_no_admission_after_a_preemption():
    engine, a, b, c = three_full_sequences()
    d = engine.add(1, 1)
    batch = engine.step()
    assert batch.preempted and d not in batch.seqs, (
        "after a preemption memory is short and the preempted sequence goes first: nothing is admitted this step")


def test_ch07_an_admitted_prompt_computes_after_its_cached_prefix():
    engine = FakeEngine(num_blocks=20, block_size=4, prefix_caching=True)
    first = engine.add(9, 1)
    engine.step()
    again = Sequence(list(first.token_ids[:8]) + [5, 6, 7], SamplingParams(max_tokens=2))
    engine.scheduler.add(again)
    batch = engine.scheduler.schedule()
    n = batch.num_new_tokens[batch.seqs.index(again)]
    assert n == 3, f"8 of the 11 prompt tokens are cached: the step computes the other 3, got {n}"


def test_ch07_preempt_puts_the_sequence_back_first():
    engine, a, b, c = three_full_sequences()
    d = engine.add(4, 1)
    c.draft_token_ids = [1, 2]
    engine.scheduler._preempt(c)
    assert c not in engine.scheduler.running and engine.scheduler.waiting[0] is c, \
        "a preempted sequence leaves running and goes to the front of the waiting queue"
    assert list(engine.scheduler.waiting) == [c, d]
    assert c.status == SequenceStatus.WAITING and c.num_preemptions == 1, "it is WAITING, with one more preemption"
    assert c.block_table == [] and c.num_computed_tokens == 0, "its blocks go back: it will be recomputed"
    assert c.draft_token_ids == [], "its draft tokens go too"
    engine.bm.check_invariants(engine.scheduler.running)


def test_ch07_a_sequence_whose_last_token_is_pending_is_skipped():
    engine = FakeEngine(num_blocks=20, block_size=4)
    a, b = engine.add(3, 1), engine.add(3, 3)
    engine.scheduler.schedule()  # both prompts computed; each one's first token is still on the device
    a.num_computed_tokens = b.num_computed_tokens = 3
    a.num_pending = 1  # its one output token is still on the device: nothing more to compute
    b.num_pending = 1
    batch = engine.scheduler.schedule()
    assert batch.seqs == [b] and batch.num_new_tokens == [1], (
        "a running sequence whose pending token is its last is left out; the others still run: "
        f"{[x.seq_id for x in batch.seqs]}")

def test_ch07_preempts_the_most_recently_admitted_sequence():
    engine, a, b, c = three_full_sequences()
    batch = engine.step()  # each needs a third block; none is free
    assert batch.preempted == [c], (
        f"the pool is empty and A (the oldest) needs a block: preempt the most recently admitted running sequence "
        f"(C, seq {c.seq_id}); preempted: {[v.seq_id for v in batch.preempted]}"
    )
    assert batch.seqs == [a, b], "with C's blocks freed, A and B both fit and both run"
    assert engine.scheduler.waiting[0] is c and c.num_preemptions == 1
    assert engine.scheduler.running == [a, b]


def test_ch07_preempting_only_as_much_as_needed():
    # After C is preempted, A and B grow into its two blocks: nobody else is preempted, and
    # C waits until one of them finishes.
    engine, a, b, c = three_full_sequences()
    engine.step()
    for _ in range(6):
        batch = engine.step()
        assert not batch.preempted, "A and B fit in the pool on their own: no further preemption"
        if a.is_finished:
            break
    assert a.is_finished and b.is_finished
    while engine.scheduler.has_unfinished():
        engine.step()
    assert c.is_finished and c.num_output_tokens == 5


def test_ch07_the_sequence_that_needs_room_can_be_the_victim():
    # A and B need a third block each and one is free: A (older) takes it; B is then itself
    # the most recently admitted running sequence, so B is preempted and the loop stops.
    engine = FakeEngine(num_blocks=5, block_size=4)
    a, b = engine.add(7, 10), engine.add(7, 10)
    engine.step()
    engine.step()
    assert engine.bm.num_free_blocks == 1
    batch = engine.step()
    assert batch.preempted == [b], f"B must preempt itself; preempted: {[v.seq_id for v in batch.preempted]}"
    assert batch.seqs == [a], (
        f"after preempting itself B must not be scheduled (set seq = None and stop); batch: {[s.seq_id for s in batch.seqs]}"
    )
    assert engine.scheduler.running == [a] and engine.scheduler.waiting[0] is b
    assert len(a.block_table) == 3 and b.block_table == []


def test_ch07_keeps_preempting_until_the_sequence_fits():
    # 2-token blocks, 5 in the pool: A (3-token prompt) holds two, B, C and D (1 token) one
    # each. Then A is handed 4 more tokens at once: computing its 5 new tokens needs two
    # more blocks. D's one block is not enough; C must go too, and B still runs.
    engine = FakeEngine(num_blocks=5, block_size=2)
    a = engine.add(3, 7)
    b, c, d = engine.add(1, 4), engine.add(1, 4), engine.add(1, 4)
    first = engine.step()
    assert first.seqs == [a, b, c, d] and engine.bm.num_free_blocks == 0
    a.token_ids.extend([11, 12, 13, 14])  # 8 tokens, 3 computed: 4 blocks, A holds 2
    batch = engine.step()
    assert batch.preempted == [d, c], (
        f"A needs two blocks: preempt D, then C (newest first); preempted: {[v.seq_id for v in batch.preempted]}"
    )
    assert batch.seqs == [a, b] and batch.num_new_tokens == [5, 1]
    assert len(a.block_table) == 4
    for _ in range(50):
        if not engine.scheduler.has_unfinished():
            break
        engine.step()
    assert all(s.is_finished for s in (a, b, c, d)) and engine.bm.num_free_blocks == 5


def test_ch07_no_preemption_while_the_last_block_has_room():
    # The pool is full but every decode fits in its sequence's last block.
    engine = FakeEngine(num_blocks=4, block_size=4)
    a, b = engine.add(5, 3), engine.add(5, 3)
    engine.step()
    assert engine.bm.num_free_blocks == 0
    for _ in range(2):
        batch = engine.step()
        assert not batch.preempted and batch.seqs == [a, b], (
            "no free block, but nobody needs one: nobody may be preempted (ask the block manager can_grow(seq, n))"
        )
    assert a.is_finished and b.is_finished


def test_ch07_chunked_prefill_is_not_preempted_without_need():
    # A long prompt computed in chunks already holds all its blocks: its later chunks never
    # need room, even with an empty free list.
    engine = FakeEngine(num_blocks=6, block_size=4, max_num_batched_tokens=8)
    a = engine.add(23, 2)  # 6 blocks: the whole pool
    chunks = []
    while not a.is_finished:
        batch = engine.step()
        assert not batch.preempted
        chunks.append(batch.num_new_tokens[0])
    assert chunks[:3] == [8, 8, 7]


@settings(max_examples=40)
@given(
    requests=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 30), st.integers(1, 20)), min_size=1, max_size=10),
    num_blocks=st.integers(8, 20),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.sampled_from([4, 16, 64]),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_ch07_random_workloads(requests, num_blocks, block_size, budget, max_num_seqs, prefix_caching, seed):
    # Requests arrive at random steps; every step is checked (victims newest first, nobody
    # preempted twice in one step, bookkeeping consistent); everything finishes.
    run_workload(FakeEngine(num_blocks, block_size, max_num_seqs, budget, prefix_caching, seed), requests)


@settings(max_examples=30)
@given(
    # Short prompts and long bursts: victims holding fewer blocks than a burst needs.
    requests=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6), st.integers(1, 20)), min_size=2, max_size=10),
    num_blocks=st.integers(6, 16),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.sampled_from([8, 16, 64]),
    max_num_seqs=st.integers(2, 6),
    prefix_caching=st.booleans(),
    max_burst=st.integers(2, 8),
    seed=st.integers(0, 1000),
)
def test_ch07_random_workloads_with_several_tokens_per_step(requests, num_blocks, block_size, budget, max_num_seqs,
                                                           prefix_caching, max_burst, seed):
    # The same, with steps that append up to max_burst tokens: a sequence may need several
    # blocks at once, and making room for it may take several victims.
    run_workload(FakeEngine(num_blocks, block_size, max_num_seqs, budget, prefix_caching, seed, max_burst), requests)


def run_workload(engine: FakeEngine, requests) -> None:
    """Add requests (arrival step, prompt length, max tokens) as they arrive; run to the end."""
    num_blocks, block_size = engine.bm.num_blocks, engine.bm.block_size
    capacity = num_blocks * block_size
    arrivals = {}
    for at, prompt_len, max_tokens in requests:
        prompt_len = min(prompt_len, capacity - 1)
        max_tokens = min(max_tokens, capacity - prompt_len)
        arrivals.setdefault(at, []).append((prompt_len, max_tokens))
    total = sum(len(v) for v in arrivals.values())
    step = 0
    while step <= max(arrivals) or engine.scheduler.has_unfinished():
        for prompt_len, max_tokens in arrivals.get(step, []):
            engine.add(prompt_len, max_tokens)
        batch = engine.step()
        if engine.scheduler.has_unfinished() and not batch.seqs:
            assert engine.scheduler.running, "nothing runs and nothing can be admitted: the scheduler is stuck"
        step += 1
        assert step < 5000, "the workload did not finish in 5000 steps (sequences preempting each other forever?)"
    assert len(engine.finished) == total
    assert engine.bm.num_free_blocks == num_blocks


def test_ch07_engine_that_preempts_matches_transformers(tiny_qwen3, hf_qwen3):
    from minivllm import LLM

    g = torch.Generator().manual_seed(7)
    lens, max_tokens = [9, 14, 5, 20, 11, 7], [20, 12, 24, 10, 16, 18]
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
    with torch_threads(1):
        llm = LLM(model=tiny_qwen3, dtype="float32", device="cpu", num_kv_blocks=14, block_size=4,
                  max_num_batched_tokens=16, max_num_seqs=4, record_trace=True)
        engine = llm.engine
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), request_id=str(i))
        outputs = {}
        for _ in range(2000):
            for out in engine.step():
                if out.finished:
                    outputs[int(out.request_id)] = out.outputs[0].token_ids
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests(), "the engine did not finish 6 small requests in 2000 steps"
        expected = []
        with torch.no_grad():
            for p, m in zip(prompts, max_tokens):
                out = hf_qwen3.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False)
                expected.append(out[0, len(p):].tolist())
    preempted = [s for r in engine.trace for s in r.preempted]
    assert preempted, "the test needs preemption: 14 blocks of 4 tokens cannot hold four of these requests"
    for i, e in enumerate(expected):
        assert outputs[i] == e, f"request {i}: engine {outputs[i]}\n transformers {e}"
    assert engine.block_manager.num_free_blocks == 14


def test_ch07_finish_gives_the_blocks_back_at_once():
    engine = FakeEngine(num_blocks=20, block_size=4)
    a, b = engine.add(6, 5), engine.add(5, 5)
    engine.step()
    free_before = engine.bm.num_free_blocks
    engine.scheduler.finish(a, "stop")
    assert a.status == SequenceStatus.FINISHED and a.finish_reason == "stop", "finished, with its reason"
    assert a not in engine.scheduler.running and engine.scheduler.running == [b], "it leaves running"
    assert engine.bm.num_free_blocks == free_before + 2 and a.block_table == [], "its blocks go back at once"
    engine.bm.check_invariants(engine.scheduler.running)


def test_ch07_finish_a_preempted_sequence():
    # Preempted while its last token was on the device, then finished by that token.
    engine, a, b, c = three_full_sequences()
    engine.scheduler._preempt(c)
    engine.scheduler.finish(c, "length")
    assert c not in engine.scheduler.waiting and c.status == SequenceStatus.FINISHED, \
        "a finished sequence leaves the waiting queue too, or it would be admitted again"
