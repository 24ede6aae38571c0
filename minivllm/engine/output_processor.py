"""After the model: each sampled token goes back to its request — appended, detokenized,
checked against the stop conditions — and a request that finished (or streams) becomes a
``RequestOutput``.

Everything here is per request and on the host. What can be worked out once is worked out
when the request arrives (``new_request``): the ids that end it, the ids banned before
``min_tokens``, the automaton that finds its stop strings. So the cost per token does not
grow with how many stop strings or stop ids a request carries.
"""
from dataclasses import dataclass, field

import torch

from minivllm.engine.sequence import Sequence
from minivllm.engine.stop_strings import StopStrings, stop_strings
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams
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
    stop_reason: int | str | None = None
    stream: bool = False  # report every new token, not just the final output
    # Copied once at admission and shared by every output of the request (read-only for
    # callers): a streaming request gets an output per token, and copying a long prompt into
    # each would cost O(prompt length) per token.
    prompt_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    banned: list[int] = field(default_factory=list)  # ids that may not be drawn before min_tokens
    stop_strings: StopStrings | None = None
    stop_state: int = 0  # where the stop-string automaton stands
    error: str | None = None  # why the engine failed this request alone (finish_reason "error")


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def banned_ids(self, params: SamplingParams) -> list[int]:
        """The ids that would end a request with these params, which it may not draw before
        min_tokens. An id the model cannot produce needs no banning (and would index past
        the logits)."""
        if not params.min_tokens:
            return []
        eos = set() if params.ignore_eos else self.eos_token_ids
        return sorted({t for t in eos | set(params.stop_token_ids) if t < self.vocab_size})

    def new_request(self, seq: Sequence, prompt: str | None, generator: torch.Generator | None,
                    stream: bool) -> RequestState:
        params = seq.sampling_params
        detokenizer = (IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, seq.prompt_token_ids)
                       if self.tokenizer else None)
        return RequestState(
            seq, prompt, detokenizer, generator, stream=stream, prompt_token_ids=seq.prompt_token_ids,
            stop_token_ids=frozenset(params.stop_token_ids), banned=self.banned_ids(params),
            stop_strings=stop_strings(tuple(params.stop)) if params.stop else None)

    def banned(self, request: RequestState) -> list[int]:
        """What this request may not draw at this step."""
        seq = request.seq
        num_outputs = seq.num_scheduled_tokens - seq.num_prompt_tokens  # this step's token not counted yet
        return request.banned if num_outputs < seq.sampling_params.min_tokens else []

    def append_token(self, request: RequestState, token: int, logprobs) -> str | None:
        """Give the request its new token; return why it finishes ("stop", "length"), or None."""
        seq, params = request.seq, request.seq.sampling_params
        seq.token_ids.append(token)
        if logprobs is not None:
            chosen, rank, top_ids, top_values = logprobs
            request.cumulative_logprob += chosen
            entry = {tid: Logprob(v, rank=r + 1, decoded_token=self._decode_one(tid))
                     for r, (tid, v) in enumerate(zip(top_ids, top_values))}
            if token not in entry:
                entry[token] = Logprob(chosen, rank=rank, decoded_token=self._decode_one(token))
            request.logprobs.append(entry)
        # Stop conditions apply once min_tokens tokens exist (as in vLLM). EOS and stop ids
        # cannot be among the first min_tokens anyway: the sampler was not allowed them.
        past_min = seq.num_output_tokens >= params.min_tokens
        if not params.ignore_eos and token in self.eos_token_ids and past_min:
            request.stop_reason = None
            return "stop"
        if token in request.stop_token_ids and past_min:
            request.stop_reason = token
            return "stop"
        if request.detokenizer is not None:
            before = len(request.text)
            request.text += request.detokenizer.step(seq.output_token_ids)
            if request.stop_strings is not None:
                # The automaton reads every character, before min_tokens too, so that a stop
                # string straddling that point is still found once it counts.
                request.stop_state, at, stop = request.stop_strings.feed(
                    request.stop_state, request.text, before, report=past_min)
                if at is not None:
                    request.text = request.text[:at]
                    request.stop_reason = stop
                    return "stop"
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or (
                seq.num_tokens >= self.max_model_len):
            return "length"
        return None

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def make_output(self, request: RequestState) -> RequestOutput:
        seq = request.seq
        text = request.text
        if request.stop_strings is not None and not seq.is_finished:
            # The end of the text may be the start of a stop string that later tokens
            # complete, and then it is cut off: hold it back until that is ruled out, so a
            # stream never sends text it would have to take back.
            text = text[: max(0, len(text) - request.stop_strings.hold_back)]
        want_logprobs = seq.sampling_params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=seq.output_token_ids,  # a slice: already a copy
            cumulative_logprob=request.cumulative_logprob if want_logprobs else None,
            logprobs=list(request.logprobs) if want_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
            num_cached_tokens=seq.num_cached_tokens,
            error=request.error,
        )
