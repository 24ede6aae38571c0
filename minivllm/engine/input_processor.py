"""Before the step: what a request needs is worked out once, when it arrives, so that the
step's cost per token does not grow with what a request carries: its detokenizer, the ids
that end it, the ids it may not draw before ``min_tokens``, its bad words as token ids, and
the automaton that finds its stop strings (a ``RequestState``). ``RequestLimits`` checks a
request against the engine's sizes with these same answers."""
import torch

from minivllm.engine.request_state import RequestState
from minivllm.engine.sequence import Sequence
from minivllm.engine.stop_strings import stop_strings
from minivllm.sampling_params import InvalidParameter, SamplingParams
from minivllm.tokenizer import IncrementalDetokenizer


class InputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size

    def banned_ids(self, params: SamplingParams) -> list[int]:
        """The ids that would end a request with these params, which it may not draw before
        min_tokens. An id the model cannot produce needs no banning (and would index past
        the logits)."""
        if not params.min_tokens:
            return []
        eos = set() if params.ignore_eos else self.eos_token_ids
        return sorted({t for t in eos | set(params.stop_token_ids) if t < self.vocab_size})

    def bad_word_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as token ids, as vLLM tokenizes them: as written (with its leading
        spaces removed), and, where the tokenizer gives a different first token and the same
        length, after a space too (a word in the middle of a text usually starts with one)."""
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise InvalidParameter("SamplingParams.bad_words needs a tokenizer: this model ships none",
                                   "bad_words")
        words = []
        for word in params.bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            words += [ids for ids in (plain,) if ids]
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                words.append(spaced)
        return words

    def new_request(self, seq: Sequence, prompt: str | None, generator: torch.Generator | None,
                    stream: bool) -> RequestState:
        params = seq.sampling_params
        detokenizer = (IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, seq.prompt_token_ids)
                       if self.tokenizer and params.detokenize else None)
        bad_words = self.bad_word_ids(params)
        return RequestState(
            seq, prompt, detokenizer, generator, stream=stream, prompt_token_ids=seq.prompt_token_ids,
            stop_token_ids=frozenset(params.stop_token_ids), banned=self.banned_ids(params),
            stop_strings=stop_strings(tuple(params.stop)) if params.stop else None,
            bad_words=bad_words, needs_history=params.uses_penalties or bool(bad_words))

    def banned(self, request: RequestState, position: int = 0) -> list[int]:
        """What this request may not draw at this step (``position``: at its draft position
        ``position``, speculative decoding, where that many more tokens precede the draw)."""
        seq = request.seq
        num_outputs = seq.num_scheduled_tokens - seq.num_prompt_tokens + position  # this step's token not counted yet
        return request.banned if num_outputs < seq.sampling_params.min_tokens else []
