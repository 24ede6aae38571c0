"""The record of one step between execute and update: what the step put on the device, and
what the host needs to take its tokens in. Built by ``LLMEngine.execute``, read by
``LLMEngine.update``; each feature beside the step adds its part in its ``prepare`` hook
(``minivllm.step_hooks``).
"""
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minivllm.engine.request_state import RequestState
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.layers.sampled_tokens import SampledTokens


@dataclass
class LaunchedStep:
    """A step on the device whose tokens the host has not taken in yet: built by execute,
    read by update. Features add to it in their ``prepare`` hook."""

    batch: ScheduledBatch
    rows: list[int]  # per sampling completion: its sequence's index in the batch
    requests: list[RequestState]  # the completions that sample, in the sampler's order
    num_prefill_tokens: int = 0
    trace: dict | None = None  # what its StepRecord needs from the batch (with record_trace)
    # Speculative decoding: the drafts each request verifies (most often none; then it has one
    # sampler row, else 1 + len(drafts) consecutive ones) and, once verified, how many it kept.
    drafts: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    first_rows: list[int] = field(default_factory=list)  # each request's first sampler row
    scoring: list[RequestState] = field(default_factory=list)  # the request of each batch.prompt_logprobs run
    bitmask: torch.Tensor | None = None  # the tokens each row may draw (structured output)
    # Set when the token mask needs a token still on the device: the forward pass runs now,
    # the sampling once that token is known (minivllm.engine.overlap).
    mask_later: Callable | None = None
    deferred: tuple | None = None  # (logits, SamplerInputs) waiting for mask_later
    sampled: SampledTokens | None = None  # None: nobody samples (every sequence mid-prefill)
    prompt_scores: SampledTokens | None = None
    run_seconds: float = 0.0  # the host's time putting it on the device
    wait_seconds: float = 0.0  # the host's time waiting for its tokens
    finished: list[int] = field(default_factory=list)  # seq ids that ended when it was taken in

    def lay_out_rows(self) -> None:
        """Each request's first sampler row, once the features have said who samples."""
        if not self.drafts:
            self.drafts = [[]] * len(self.requests)
        self.accepted = [0] * len(self.requests)
        sizes = [len(d) + 1 for d in self.drafts]
        self.first_rows = list(range(len(self.requests))) if len(sizes) == sum(sizes) else \
            [end - size for end, size in zip(itertools.accumulate(sizes), sizes)]

    def row_of(self) -> dict[int, int]:
        """seq_id -> the sampler row of its newest token (the next step reads it there)."""
        return {r.seq.seq_id: row + len(d) for r, row, d in zip(self.requests, self.first_rows, self.drafts)}
