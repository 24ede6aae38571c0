"""What a request gives back: vLLM's RequestOutput / CompletionOutput shape."""
import time
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # The sum of the sampled tokens' log-probabilities (under the model's distribution, before
    # temperature and filters) when SamplingParams.logprobs was given (0 is enough); else
    # None, as in vLLM's V1 engine: a batch where no request wants log-probabilities pays no
    # pass over the vocabulary for them.
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request reached each stage, vLLM's names, in seconds of ``time.monotonic()`` (vLLM
    uses the wall clock: these are for differences, such as the time to the first token,
    ``first_token_time - arrival_time``, and do not jump when the clock is set). None: not yet."""

    arrival_time: float  # the engine took the request
    first_scheduled_time: float | None = None  # its first step was scheduled (after its wait in the queue)
    first_token_time: float | None = None  # its first token reached the host
    last_token_time: float | None = None  # its latest token reached the host

    def token_arrived(self) -> None:
        self.last_token_time = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # the same list in every output of one request: read it, don't modify it
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it), else its log-probability given the tokens before it and the top-k
    # alternatives. The same list in every output of one request: read it, don't modify it.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set when the engine failed this request alone (finish_reason "error"): what went wrong.
    # The other requests of its batch are unaffected.
    error: str | None = None
    # Speculative decoding: how its drafts fared (None when it verified none).
    spec_decode: "SpecDecodeMetrics | None" = None
    metrics: RequestMetrics | None = None


@dataclass
class SpecDecodeMetrics:
    num_draft_tokens: int  # drafts the target verified
    num_accepted_tokens: int  # of those, accepted
    num_steps: int  # steps that verified drafts

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying step: accepted drafts + the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0
