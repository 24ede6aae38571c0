"""What the engine keeps for one request besides its ``Sequence``: built when the request
arrives (``engine.input_processor``), filled as its tokens come back
(``engine.output_processor``), read by the features beside the step.
"""
import time
from dataclasses import dataclass, field

import torch

from minivllm.engine.sequence import Sequence
from minivllm.engine.stop_strings import StopStrings
from minivllm.outputs import Logprob, RequestMetrics
from minivllm.tokenizer import IncrementalDetokenizer


@dataclass
class RequestState:
    """What the engine keeps for one request besides its Sequence."""

    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: an entry per prompt token scored so far, the first None.
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=lambda: [None])
    stop_reason: int | str | None = None
    stream: bool = False  # report every new token, not just the final output
    # Copied once at admission and shared by every output of the request (read-only for
    # callers): a streaming request gets an output per token, and copying a long prompt into
    # each would cost O(prompt length) per token.
    prompt_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    banned: list[int] = field(default_factory=list)  # ids that may not be drawn before min_tokens
    bad_words: list[list[int]] = field(default_factory=list)  # its bad words, tokenized
    # Does the sampler need the tokens it has seen (penalties, bad words)? Worked out once,
    # so a batch that uses neither pays one attribute read per row for them.
    needs_history: bool = False
    stop_strings: StopStrings | None = None
    stop_state: int = 0  # where the stop-string automaton stands
    error: str | None = None  # why the engine failed this request alone (finish_reason "error")
    # The request's completions, in index order (SamplingParams.n; one for n = 1): the same
    # list in each of them. The first computes the prompt, then forks into the others.
    group: list["RequestState"] = field(default_factory=list)
    # Speculative decoding: drafts verified, drafts accepted, steps that verified any.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    # RequestOutput.metrics: when it arrived, was first scheduled, got its first and latest token.
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))
