# Reference copy of minivllm/engine/scheduler.py, generated from it by scripts/make_exercises.py.
# Reference answers for: Scheduler._schedule_running (ch07), Scheduler._admit_waiting (ch07), Scheduler._preempt (ch07), Scheduler.finish (ch07).
# Do not edit: change minivllm/engine/scheduler.py and run scripts/make_exercises.py again.

"""The scheduler: which sequences run this step, and how many tokens each computes.

One rule covers prefill and decode alike. A sequence has ``num_tokens`` tokens of which
``num_computed_tokens`` are in the KV cache; a step computes some of the rest. A decode is
a sequence with exactly one token left (the one it just sampled); a prefill has many, and
a prompt longer than the step's token budget is computed over several steps (chunked
prefill). Running sequences are served first, so decodes are never starved by a long
prompt; waiting ones are admitted with what budget is left. When the KV pool runs dry the
most recently admitted running sequence is preempted: its blocks are freed and it goes
back to the front of the queue, to be recomputed later.
"""
from collections import deque
from dataclasses import dataclass, field

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each computes this step
    preempted: list[Sequence] = field(default_factory=list)
    # Copy-on-write: blocks to copy (source, destination) on the device before the step runs.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Prompt logprobs (SamplingParams.prompt_logprobs), chosen by the engine: (sequence i,
    # first position, count) for each run of positions whose logits score the prompt token
    # after them this step.
    prompt_logprobs: list[tuple[int, int, int]] = field(default_factory=list)
    # Speculative decoding (set by its feature once the batch is scheduled): of
    # num_new_tokens[i], how many are draft tokens (computed after the sequence's last known
    # token, to be verified). Empty: none this step.
    num_drafts: list[int] = field(default_factory=list)
    cache_hit_tokens: int = 0  # prompt tokens found in the prefix cache at this step's admissions

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Does sequence i get a new token sampled this step (it reaches its last token)?"""
        seq = self.seqs[i]
        drafts = self.num_drafts[i] if self.num_drafts else 0
        return seq.num_computed_tokens + self.num_new_tokens[i] - drafts == seq.num_scheduled_tokens

    def drafts(self, i: int) -> int:
        """How many draft tokens sequence i verifies this step."""
        return self.num_drafts[i] if self.num_drafts else 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0  # since the start, for the server's vllm:num_preemptions

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        hits_before = self.block_manager.cache_hit_tokens
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        self._admit_waiting(batch, budget)
        self.num_preemptions += len(batch.preempted)
        batch.block_copies = self.block_manager.take_block_copies()
        batch.cache_hit_tokens = self.block_manager.cache_hit_tokens - hits_before
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        """Running sequences first: decodes and unfinished chunked prefills. Returns the
        budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.last_token_pending:
                # Its last token (max_tokens) is still on the device, sampled by the step in
                # flight: nothing more to compute (asynchronous scheduling, chapter 17).
                i += 1
                continue
            n = min(seq.num_scheduled_tokens - seq.num_computed_tokens, budget)
            if seq.draft_token_ids:
                n += self._fit_drafts(seq, n, budget)
            while not self.block_manager.can_grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    seq = None
                    break
            if seq is None:
                break
            self.block_manager.grow(seq, n)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        return budget

    def _fit_drafts(self, seq: Sequence, n: int, budget: int) -> int:
        """A decode with drafts (speculative decoding): its last token and as many drafts as
        the budget allows, and none if their blocks do not fit (a guess is not worth a
        preemption). Returns how many it keeps."""
        seq.draft_token_ids = seq.draft_token_ids[: budget - n]
        if not self.block_manager.can_grow(seq, n + len(seq.draft_token_ids)):
            seq.draft_token_ids = []
        return len(seq.draft_token_ids)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit waiting sequences with the budget that is left (none after a preemption:
        memory is short, and the preempted sequence must go first)."""
        while self.waiting and budget > 0 and not batch.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending or not self.block_manager.can_allocate(seq):
                break  # (a preempted sequence is recomputed once its last token is on the host)
            if len(self.running) + 1 + seq.num_forks > self.max_num_seqs:
                break  # room for its n - 1 forks too (SamplingParams.n)
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished and give its blocks back at once."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted while its last token was still on the device
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """End every sequence of the request (one, or n with SamplingParams.n); return the
        first of them, or None if it holds none."""
        aborted = [seq for queue in (self.waiting, self.running) for seq in queue if seq.request_id == request_id]
        for seq in aborted:
            if seq.status == SequenceStatus.WAITING:
                self.waiting.remove(seq)
                self.block_manager.free(seq)  # a preempted one holds none; harmless
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
            else:
                self.finish(seq, "abort")
        return aborted[0] if aborted else None
