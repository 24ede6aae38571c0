# Reference copy of minivllm/engine/trace.py, generated from it by scripts/make_exercises.py.
# Reference answers for: attention_work (ch15).
# Do not edit: change minivllm/engine/trace.py and run scripts/make_exercises.py again.

"""What each step did, for the book's plots and the engine's throughput figures: a
``StepRecord`` per step (with ``record_trace``), running totals of tokens and seconds, and
when each request was first scheduled (its ``RequestOutput.metrics``). Beside the step: the step hands its launched batch here once it is done, and nothing here
changes what the step computes."""
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence


@dataclass
class StepRecord:
    """What one engine step did, for plots of the scheduler at work."""

    step: int
    seqs: list[tuple[int, int, str]]  # (seq_id, tokens computed, "prefill" | "decode")
    blocks_in_use: int
    num_blocks: int
    cache_hit_tokens: int  # prefix-cache hits at admissions this step
    preempted: list[int]
    finished: list[int]
    seconds: float
    kv_tokens_read: int = 0  # cached tokens the step's attention reads (its K/V traffic)
    attention_pairs: int = 0  # (query, visible key) pairs: the attention FLOPs / (4 * heads * dim)
    # Of `seconds`, the part outside the model runner: scheduling before, bookkeeping after.
    # The device has nothing queued then (the runner returns once the tokens are sampled).
    host_seconds: float = 0.0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n, kind in self.seqs if kind == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(n for _, n, kind in self.seqs if kind == "decode")


class StepTrace:
    """The engine's running totals (``stats``) and, with ``record_trace``, a record per step.
    The switch is read at every step from the engine's config, so it can be turned on for a
    stretch of a run (the throughput benchmark records its second run only)."""

    def __init__(self, config):
        self.config = config  # the EngineConfig whose record_trace turns the records on
        self.records: list[StepRecord] = []
        self.num_steps = 0
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0}

    def before(self, batch: ScheduledBatch) -> dict | None:
        """What the record needs from the batch before the step changes it (only with
        record_trace: at batch 256 it is a noticeable share of the host's time)."""
        if not self.config.record_trace:
            return None
        return dict(
            seqs=[(s.seq_id, n, "decode" if is_decode(s, n - batch.drafts(i)) else "prefill")
                  for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))],
            preempted=[s.seq_id for s in batch.preempted],
            **attention_work(batch),
        )

    @staticmethod
    def note_first_scheduled(batch: ScheduledBatch, requests: dict) -> None:
        """RequestOutput.metrics.first_scheduled_time, for the requests in their first batch
        (nothing computed past their cached prefix, never preempted): two integer compares a
        sequence, the clock read once a step at most."""
        now = None
        for seq in batch.seqs:
            if seq.num_computed_tokens == seq.num_cached_tokens and not seq.num_preemptions and not seq.index:
                request = requests.get(seq.request_id)
                if request is not None and request.metrics.first_scheduled_time is None:
                    now = now or time.monotonic()
                    request.metrics.first_scheduled_time = now

    def account(self, step, elapsed: float, finished: list[int], host_seconds: float, block_manager) -> None:
        """The step's share of the totals, and its record (with record_trace)."""
        phase = "prefill" if step.num_prefill_tokens else "decode"
        # (A decode step emits a token per sequence, and one per accepted draft.)
        self.stats[f"{phase}_tokens"] += step.num_prefill_tokens or len(step.batch) + sum(step.accepted)
        self.stats[f"{phase}_seconds"] += elapsed
        if step.trace is not None:
            self.records.append(StepRecord(
                step=self.num_steps, **step.trace,
                blocks_in_use=block_manager.num_blocks - block_manager.num_free_blocks,
                num_blocks=block_manager.num_blocks, cache_hit_tokens=step.batch.cache_hit_tokens,
                finished=finished, seconds=elapsed, host_seconds=host_seconds,
            ))
        self.num_steps += 1


    def note_finished(self, finished: list[int]) -> None:
        """Sequences finished by taking in a step when no step was launched with it (the
        overlapped step's last call): the last record, if any, takes them."""
        if self.records and finished:
            self.records[-1].finished = self.records[-1].finished + finished


def attention_work(batch: ScheduledBatch) -> dict[str, int]:
    """What the step's attention must read and compute, for its speed of light (chapter 15):
    ``kv_tokens_read``, the tokens whose keys and values it reads (each sequence's cached
    ones and its new ones, once each), and ``attention_pairs``, the (query, visible key)
    pairs it scores (causal: a new token sees the cached tokens, the new ones before it and
    itself)."""
    kv_tokens_read = attention_pairs = 0
    for seq, new in zip(batch.seqs, batch.num_new_tokens):
        cached = seq.num_computed_tokens
        kv_tokens_read += cached + new
        attention_pairs += new * cached + new * (new + 1) // 2
    return {"kv_tokens_read": kv_tokens_read, "attention_pairs": attention_pairs}


def num_prefill_tokens(batch: ScheduledBatch) -> int:
    """The batch's prompt tokens (a decode verifying drafts is a decode: its drafts are not
    prompt tokens)."""
    return sum(n for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
               if not is_decode(seq, n - batch.drafts(i)))


def is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    """Does seq compute just the token it sampled last (a decode), not part of a prompt?"""
    total = seq.num_scheduled_tokens
    return num_new_tokens == 1 and seq.num_computed_tokens == total - 1 and total > seq.num_prompt_tokens


def profiler_range(name: str):
    """A named range of the step in a torch.profiler trace (chapter 17 draws the step's
    timeline from them: launch, with schedule inside it; process, with wait inside it). Only
    while a profiler records: an idle ``record_function`` still costs microseconds, at every
    step."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()
