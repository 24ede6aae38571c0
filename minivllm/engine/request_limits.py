"""The fixed sizes a request is checked against, and the checks: a bad request gets a clear
error naming the parameter before it is queued, and never reaches the step. The sizes are
known once the KV pool is sized and never change, so a server whose engine runs in another
process (``minivllm.server.engine_core``) keeps a copy and checks each request with this same
code before sending it."""
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minivllm.sampling_params import InvalidParameter, SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.input_processor import InputProcessor


@dataclass(frozen=True)
class RequestLimits:
    """The fixed sizes of one engine (see the module's docstring)."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    hybrid: bool  # a recurrent state slot per sequence (Gated DeltaNet layers)
    speculative: bool = False  # speculative decoding is on (EngineConfig.speculative_config)

    def check_prompt(self, token_ids: list[int]) -> None:
        vocab = self.vocab_size
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        if len(token_ids) >= self.max_model_len:  # first: it is O(1), the check below is not
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; this engine allows at most {self.max_model_len - 1} "
                f"(max_model_len={self.max_model_len}, limited by the model and by a KV pool of "
                f"{self.num_kv_blocks} blocks x {self.block_size} tokens)"
            )
        # The types, then the range: two passes in C (set, min, max) where one Python test
        # per token cost half a millisecond of a 4,096-token prompt's time to first token.
        if not all(issubclass(t, int) for t in set(map(type, token_ids))) or min(token_ids) < 0 \
                or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")

    def check_request(self, token_ids: list[int], params: SamplingParams, inputs: "InputProcessor") -> None:
        """Raise ValueError (InvalidParameter for a sampling field) for a request the engine
        would refuse."""
        self.check_prompt(token_ids)
        vocab = self.vocab_size
        banned = inputs.banned_ids(params)
        if len(banned) == vocab:
            raise InvalidParameter("SamplingParams.stop_token_ids with min_tokens bans every token of the "
                                   "vocabulary: nothing could be sampled", "stop_token_ids")
        if params.n > self.max_num_seqs:
            raise InvalidParameter(f"SamplingParams.n={params.n} is invalid: the n completions run together, so at "
                                   f"most max_num_seqs ({self.max_num_seqs})", "n")
        if params.n > 1 and self.hybrid:
            raise InvalidParameter("SamplingParams.n > 1 is not supported for hybrid models: their completions "
                                   "would have to fork the recurrent state too", "n")
        # Token ids the sampler indexes the logits with must be in the vocabulary.
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidParameter(f"SamplingParams.logit_bias has token id {max(params.logit_bias)}: "
                                   f"must be in [0, {vocab})", "logit_bias")
        if params.allowed_token_ids is not None:
            if max(params.allowed_token_ids) >= vocab:
                raise InvalidParameter(f"SamplingParams.allowed_token_ids has token id "
                                       f"{max(params.allowed_token_ids)}: must be in [0, {vocab})", "allowed_token_ids")
            if not set(params.allowed_token_ids) - set(banned):
                raise InvalidParameter("SamplingParams.allowed_token_ids are all stop or EOS ids banned before "
                                       "min_tokens: nothing could be sampled", "allowed_token_ids")
        if self.speculative:
            for name, unsupported in (("n", params.n > 1), ("prompt_logprobs", params.prompt_logprobs is not None),
                                      ("structured_outputs", params.structured_outputs is not None)):
                if unsupported:
                    raise InvalidParameter(f"SamplingParams.{name} is not supported with speculative_config "
                                           "(speculative decoding) yet", name)
        bad = [t for ids in inputs.bad_word_ids(params) for t in ids if t >= vocab]
        if bad:
            raise InvalidParameter(f"SamplingParams.bad_words tokenize to ids {sorted(set(bad))[:5]} outside the "
                                   f"model's vocabulary [0, {vocab})", "bad_words")


def truncated(prompt_token_ids, params: SamplingParams):
    """The prompt the engine runs: with truncate_prompt_tokens, its last k ids, as in vLLM."""
    if params.truncate_prompt_tokens is not None and isinstance(prompt_token_ids, (list, tuple)):
        return prompt_token_ids[-params.truncate_prompt_tokens :]
    return prompt_token_ids
