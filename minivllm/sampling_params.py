"""Per-request sampling parameters, validated when they are made.

The names and meanings follow vLLM's ``SamplingParams`` so code written for one runs on the
other. A bad value fails here, at the caller, with the field's name and its allowed range,
and never reaches the engine: every number is checked for its type, for being finite and for
its range, because a value the sampler cannot take (an ``inf`` temperature, a ``top_k`` past
64 bits) would otherwise fail, or silently sample noise, inside a step that other requests
share.
"""
import copy
import difflib
import enum
import functools
import math
from dataclasses import dataclass, fields

from minivllm.errors import InvalidParameter
from minivllm.structured.params import StructuredOutputsParams

# A temperature below this is greedy. Dividing logits by a tiny temperature overflows to inf
# (and inf - inf is NaN in the softmax); long before that, the distribution is one token.
# vLLM raises such a temperature to 0.01 instead; at 0.01 the draw is greedy in practice.
MIN_TEMPERATURE = 1e-2
# Past this, every token the masks leave is equally likely already (logits divided by it are
# below 1e-25), and a larger temperature, or a repetition penalty beyond these bounds, would
# overflow float32 to inf or round to 0: inf / inf and 0 * inf are NaN, and a NaN row lets the
# sampler draw a token its mask had banned. So both are brought within the bounds, which
# changes no distribution float32 can tell apart.
MAX_TEMPERATURE = 1e30
REPETITION_PENALTY_BOUNDS = (1e-30, 1e30)
# The most top log-probabilities a request may ask for, per sampled or prompt token (vLLM's
# default max_logprobs): each costs a top-k over the vocabulary and an entry in the output.
# -1 asks for the whole vocabulary, which the engine allows only with max_logprobs=-1
# (``LLM(max_logprobs=-1)``, ``minivllm serve --max-logprobs -1``), as vLLM does.
MAX_LOGPROBS = 20
WHOLE_VOCABULARY = -1


class RequestOutputKind(enum.IntEnum):
    """vLLM's ``SamplingParams.output_kind``: what each output of a streamed request holds.
    minivllm's outputs are always cumulative (each holds the text and tokens so far), and
    ``LLM.generate`` returns only the final one whatever the kind, as vLLM's does."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def names_closest_on_typo(cls):
    """``cls(...)`` with a keyword it does not know raises TypeError naming the closest field
    (``SamplingParams(max_token=5)``: did you mean 'max_tokens'?), not Python's bare message."""
    init, known = cls.__init__, [f.name for f in fields(cls)]

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            parts = [f"{name!r}" + "".join(f" (did you mean {m!r}?)" for m in difflib.get_close_matches(name, known, 1))
                     for name in unknown]
            raise TypeError(f"{cls.__name__} has no field(s) {', '.join(parts)}")
        init(self, *args, **kwargs)

    cls.__init__ = checked_init
    return cls


@names_closest_on_typo
@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE) means greedy
    top_k: int = 0  # 0 or -1 means no limit; a k past the vocabulary keeps every token
    top_p: float = 1.0  # the most likely token is always kept, however small top_p is
    min_p: float = 0.0
    seed: int | None = None  # per request: the same seed gives the same tokens whatever the batch
    max_tokens: int | None = 16  # None: until the model's length limit
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many top log-probabilities per token
    # Score the prompt too: for each prompt token after the first, its log-probability given
    # the tokens before it, and the top-k alternatives (RequestOutput.prompt_logprobs).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1  # completions of the prompt; the prompt is computed once and its KV blocks shared
    # Penalties on tokens already seen. presence / frequency (OpenAI's): subtract the penalty
    # once / once per occurrence for each token the request has generated. repetition (the
    # CTRL paper's, as in Hugging Face): a token in the prompt or the output has its logit
    # divided by the penalty when positive, multiplied when negative (1 = off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be drawn
    bad_words: list[str] | None = None  # never generate these words
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    # Constrained decoding (chapter 18): the output follows a JSON schema, a regex, a choice
    # or a grammar. (A dict is taken as StructuredOutputsParams' fields.)
    structured_outputs: StructuredOutputsParams | None = None
    # Turn the output tokens into text (False: the outputs' text stays "", and stop strings,
    # which are found in the text, are refused).
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # see RequestOutputKind
    # Anything a caller wants carried with the request (vLLM's custom logits processors read
    # it); minivllm's engine reads none of it.
    extra_args: dict | None = None
    # vLLM's slow tokenizers put spaces between special tokens when decoding; the fast
    # tokenizers minivllm uses never add them, so either value gives the same text.
    spaces_between_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.stop is None or isinstance(self.stop, (list, tuple)), "stop", self.stop,
               "a string or a list of strings")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
               self.stop_token_ids, "a list of ints")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(_real(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               f"a finite number >= 0 (0, or below {MIN_TEMPERATURE}, means greedy)")
        self.temperature = min(self.temperature, MAX_TEMPERATURE)
        _check(_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k, "an int >= 1, or 0 / -1 for no limit")
        if self.top_k == -1:
            self.top_k = 0
        _check(_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        # A torch.Generator takes a 64-bit unsigned seed.
        _check(self.seed is None or (_int(self.seed) and 0 <= self.seed < 2**64),
               "seed", self.seed, "an int in [0, 2**64), or None")
        _check(self.max_tokens is None or (_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an int >= 1, or None")
        _check(_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "an int >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(all(_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "ints >= 0")
        _check(_int(self.n) and self.n >= 1, "n", self.n, "an int >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_int(value) and WHOLE_VOCABULARY <= value <= MAX_LOGPROBS), name, value,
                   f"an int in [0, {MAX_LOGPROBS}], -1 for the whole vocabulary, or None")
        self._check_vllm_fields()
        self._check_penalties_and_masks()
        self._check_structured_outputs()

    def _check_penalties_and_masks(self) -> None:
        """The ranges are vLLM's. Token ids are checked against the vocabulary where it is
        known, when the engine takes the request (LLMEngine.validate_request)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_real(value) and -2 <= value <= 2, name, value, "a number in [-2, 2]")
        _check(_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               self.repetition_penalty, "a finite number > 0 (1 means no penalty)")
        low, high = REPETITION_PENALTY_BOUNDS
        self.repetition_penalty = min(max(self.repetition_penalty, low), high)
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias, "a dict of token id -> bias")
            _check(all(_int(t) and t >= 0 for t in self.logit_bias), "logit_bias", self.logit_bias,
                   "keyed by token ids (ints >= 0)")
            _check(all(_real(b) and -100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias",
                   self.logit_bias, "biases in [-100, 100]")
            self.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, (list, tuple)) and len(self.allowed_token_ids) > 0,
                   "allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids, or None")
            _check(all(_int(t) and t >= 0 for t in self.allowed_token_ids), "allowed_token_ids",
                   self.allowed_token_ids, "ints >= 0")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) and w.strip()
                                                                      for w in self.bad_words),
                   "bad_words", self.bad_words, "a list of non-blank strings, or None")
            self.bad_words = list(self.bad_words)
        _check(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output",
               self.include_stop_str_in_output, "a bool")
        _check(self.truncate_prompt_tokens is None or (_int(self.truncate_prompt_tokens)
                                                       and self.truncate_prompt_tokens >= 1),
               "truncate_prompt_tokens", self.truncate_prompt_tokens, "an int >= 1, or None")

    def _check_vllm_fields(self) -> None:
        for name in ("detokenize", "spaces_between_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")
        _check(self.detokenize or not self.stop, "stop", self.stop,
               "empty with detokenize=False (stop strings are looked for in the text)")
        _check(self.output_kind in tuple(RequestOutputKind), "output_kind", self.output_kind,
               "a RequestOutputKind (0 cumulative, 1 delta, 2 final only)")
        self.output_kind = RequestOutputKind(self.output_kind)
        _check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args", self.extra_args,
               "a dict, or None")

    def _check_structured_outputs(self) -> None:
        if isinstance(self.structured_outputs, dict):
            unknown = sorted(set(self.structured_outputs) - set(StructuredOutputsParams.__dataclass_fields__))
            _check(not unknown, "structured_outputs", unknown, "fields of StructuredOutputsParams "
                   f"({', '.join(StructuredOutputsParams.__dataclass_fields__)})")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "a StructuredOutputsParams (or its fields as a dict)")
        if self.structured_outputs is not None:
            # The grammar ends the output with the stop token once it is complete.
            _check(not self.ignore_eos, "ignore_eos", self.ignore_eos, "False with structured_outputs (the grammar "
                   "ends the output with EOS)")
            _check(not self.min_tokens, "min_tokens", self.min_tokens, "0 with structured_outputs (the grammar "
                   "decides where the output ends)")

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def resolve_logprobs(params: SamplingParams, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
    """``params`` as the engine runs them: a logprobs or prompt_logprobs of -1 (the whole
    vocabulary, vLLM's meaning) becomes the vocabulary's size. Either past ``max_logprobs``
    (-1: no limit) is refused by name, as vLLM's engine refuses it."""
    changes = {}
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is None:
            continue
        if max_logprobs != WHOLE_VOCABULARY and (value == WHOLE_VOCABULARY or value > max_logprobs):
            raise InvalidParameter(f"SamplingParams.{name}={value} is invalid: this engine returns at most "
                                   f"{max_logprobs} log-probabilities per token (max_logprobs; -1 there allows -1 "
                                   f"here, the whole vocabulary)", name)
        if value == WHOLE_VOCABULARY:
            changes[name] = vocab_size
    if not changes:
        return params
    resolved = copy.copy(params)  # not dataclasses.replace: the vocabulary's size is past MAX_LOGPROBS
    for name, value in changes.items():
        setattr(resolved, name, value)
    return resolved


def check_max_logprobs(max_logprobs) -> int:
    """vLLM's ``max_logprobs`` setting, checked: -1 (no limit) or an int in [0, MAX_LOGPROBS]
    (minivllm's SamplingParams take at most MAX_LOGPROBS top entries, or the whole vocabulary)."""
    if not (_int(max_logprobs) and (max_logprobs == WHOLE_VOCABULARY or 0 <= max_logprobs <= MAX_LOGPROBS)):
        raise ValueError(f"max_logprobs={max_logprobs!r}: must be an int in [0, {MAX_LOGPROBS}], or -1 to allow the "
                         f"whole vocabulary (logprobs=-1)")
    return max_logprobs


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value) -> bool:
    """A finite int or float (not a bool, not NaN, not +-inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        shown = repr(value)
        if len(shown) > 80:  # a 200,000-item list does not belong in an error message
            shown = shown[:77] + "..."
        raise InvalidParameter(f"SamplingParams.{name}={shown} is invalid: must be {allowed}", name)
