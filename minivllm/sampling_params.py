"""Per-request sampling parameters, validated when they are made.

The names and meanings follow vLLM's ``SamplingParams`` so code written for one runs on the
other. A bad value fails here, at the caller, with the field's name and its allowed range,
and never reaches the engine.
"""
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1 means no limit
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per request: the same seed gives the same tokens whatever the batch
    max_tokens: int | None = 16  # None: until the model's length limit
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many top log-probabilities per token
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 means greedy)")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "an int >= 1, or 0 / -1 for no limit")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        # A torch.Generator takes a 64-bit unsigned seed.
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**64),
               "seed", self.seed, "an int in [0, 2**64), or None")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens", self.max_tokens, "an int >= 1, or None",
        )
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "an int >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "ints >= 0")
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs", self.logprobs, "an int in [0, 20], or None",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class InvalidParameter(ValueError):
    """A bad sampling value. ``param`` names the field, so a server can point at it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise InvalidParameter(f"SamplingParams.{name}={value!r} is invalid: must be {allowed}", name)
