# Exercise copy of minivllm/layers/sampler.py, generated from it by scripts/make_exercises.py.
# Fill in: top_k_mask (ch08), top_p_mask (ch08), min_p_mask (ch08), gumbel_max_sample (ch08), Sampler._draw_filtered (ch08).
# Grade: make grade CH=08
# Running the generator again overwrites this file: commit or copy your work first.

"""From logits to the next token: greedy, temperature, top-k, top-p, min-p, seeds (and,
first, each request's own changes to its logits: ``minivllm.layers.logits_processors``).

Each row of the batch has its own parameters. Filters set the logits of excluded tokens
to -inf; the draw itself uses the Gumbel-max trick in its exponential form:
argmax(p / E) with E ~ Exp(1) picks token i with probability p_i, needs no cumulative sum
and no host sync, and with a per-request generator gives the same draw whatever else is in
the batch. On the GPU, a batch that asks for nothing but temperatures and greedy rows takes
the trick's other form in one kernel: argmax(logits / T + Gumbel noise) (``ops.sampling``);
an all-greedy batch takes one argmax."""
import torch

from minivllm.layers.logits_processors import TokenHistory, needs_processing, process_logits
from minivllm.layers.sampled_tokens import SampledTokens, SamplerOutput, rows_to_device
from minivllm.layers.sampling_rescue import sample_rows_alone
from minivllm.ops.dispatch import use_triton
from minivllm.ops.sampling import gumbel_argmax
from minivllm.ops.token_bitmask import apply_token_bitmask
from minivllm.sampling_params import SamplingParams

MIN_FLOAT32 = torch.finfo(torch.float32).tiny


def top_k_mask(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (k = 0: keep all). Ties at the boundary are kept."""
    raise NotImplementedError(
        "ch08: top_k_mask: keep each row's k largest logits; k of 0 or less keeps all, and k past "
        "the vocabulary is the whole vocabulary. Find each row's k-th largest value and mask every "
        "logit strictly below it, so ties at the boundary stay. Pitfall: k counts from one, "
        "indices from zero, see notebooks/08_sampling.ipynb"
    )


def top_p_mask(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least p."""
    raise NotImplementedError(
        "ch08: top_p_mask (nucleus sampling): keep the smallest set of most probable tokens whose "
        "probabilities add up to p, and set the other logits to minus infinity. Per row, in order "
        "of decreasing probability, a token stays when the mass of the tokens strictly before it "
        "is still below p: the token that crosses p stays, and so does the most probable one "
        "always. The result is in vocabulary order. Pitfalls: a mask computed in sorted order must "
        "go back to each token's own column; p holds one value per row, see "
        "notebooks/08_sampling.ipynb"
    )


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the most likely token's."""
    raise NotImplementedError(
        "ch08: min_p_mask: a token stays when its probability is at least min_p times the row's "
        "largest probability; the others get minus infinity. min_p holds one value per row. "
        "Pitfall: comparing logits with a probability threshold, see notebooks/08_sampling.ipynb"
    )


def gumbel_max_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from probs, given Exp(1) noise of the same shape."""
    raise NotImplementedError(
        "ch08: gumbel_max_sample: draw one token per row from probs without a multinomial call, "
        "from the Exp(1) noise given (one draw per token, from the request's own generator): the "
        "token whose probability divided by its noise is largest is distributed exactly as probs "
        "(the exponential race: independent clocks ringing at rates probs, the first to ring "
        "wins). Pitfall: multiplying by the noise runs the race backwards, see "
        "notebooks/08_sampling.ipynb"
    )


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 banned: list[list[int]] | None = None, history: TokenHistory | None = None,
                 bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Sample a token for each row of logits; the tokens (and log-probs) on the host."""
        return self.launch(logits, params, generators, banned, history, bitmask).to_host()

    def launch(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned: list[list[int]] | None = None,
        history: TokenHistory | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> SampledTokens:
        """The same, leaving the tokens on the device (their copy to the host under way).
        ``history``: what each row has seen, for the penalties and bad words (None when no
        row uses them). ``bitmask``: the tokens each row's grammar allows, on the host
        ([rows, ceil(vocab / 32)] int32, chapter 18), or None when no row has a grammar."""
        try:
            return self.sample(logits, params, generators, banned, history, bitmask)
        except NotImplementedError:
            raise  # missing code (an exercise left blank) is nobody's request
        except Exception as e:
            if len(params) == 1:
                raise
            # One row's values may have broken the batch: that row fails alone.
            return sample_rows_alone(self.sample, e, logits, params, generators, banned, history, bitmask)

    @staticmethod
    def _only_temperature(params, banned, history, bitmask) -> bool:
        """Does every row just take the argmax or draw with a temperature (no top-k, top-p
        or min-p, no logprobs, no bans, masks, biases or penalties)?"""
        return (bitmask is None and not (banned and any(banned)) and not needs_processing(params, history)
                and all(p.logprobs is None and not p.top_k and p.top_p >= 1 and p.min_p <= 0 for p in params))

    def _draw(self, logits, params, generators) -> SampledTokens:
        """The GPU's path for temperatures (and greedy rows beside them): one pass over the
        logits (ops.sampling.gumbel_argmax), not a float32 copy, a softmax, a tensor of noise
        and two argmaxes. A seeded row's noise comes from its own generator: its tokens do
        not depend on its neighbours in the batch."""
        device = logits.device
        rows = [[float(p.greedy) for p in params], [1.0 if p.greedy else p.temperature for p in params]]
        greedy, temperature = rows_to_device(rows, torch.float32, device)
        seeds = torch.randint(0, 2**62, (len(params),), device=device)
        for row, gen in enumerate(generators):
            if gen is not None:
                seeds[row] = torch.randint(0, 2**62, (1,), generator=gen, device=device)
        return SampledTokens(gumbel_argmax(logits, temperature, greedy, seeds), None, [None] * len(params))

    def sample(self, logits, params, generators, banned, history=None, bitmask=None) -> SampledTokens:
        if use_triton(logits) and self._only_temperature(params, banned, history, bitmask):
            if all(p.greedy for p in params):  # one launch: no noise, no per-row settings to copy
                return SampledTokens(logits.argmax(dim=-1), None, [None] * len(params))
            return self._draw(logits, params, generators)
        logits = logits.float()
        ks = [p.logprobs for p in params]
        # Log-probabilities are reported as the model gave them, before any processing.
        raw_logprobs = logits.log_softmax(dim=-1) if any(k is not None for k in ks) else None
        logits = self._restrict(logits, params, banned, history, bitmask)
        tokens = logits.argmax(dim=-1)
        if not all(p.greedy for p in params):
            tokens = self._draw_filtered(logits, tokens, params, generators)
        logprobs = None
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            rank = (raw_logprobs > chosen.unsqueeze(-1)).sum(dim=-1) + 1
            top = raw_logprobs.topk(max(k or 0 for k in ks), dim=-1)
            logprobs = (chosen, rank, top.indices, top.values)
        return SampledTokens(tokens, logprobs, ks)

    @staticmethod
    def _restrict(logits, params, banned, history, bitmask) -> torch.Tensor:
        """Each row's own changes to its logits: the grammar's mask, penalties, biases and bad
        words, and the ids it may not draw yet (e.g. EOS before min_tokens)."""
        device = logits.device
        if bitmask is not None:  # first, as in vLLM: the grammar decides what may be drawn at all
            # (In place, like the bans below: masking a row twice, as the rescue path may, is once.)
            apply_token_bitmask(logits, bitmask.pin_memory().to(device, non_blocking=True)
                                if device.type == "cuda" else bitmask)
        logits = process_logits(logits, params, history)  # returns logits itself when no row asks
        if banned and any(banned):
            cells = [[row, token] for row, ids in enumerate(banned) for token in ids]
            where = rows_to_device(cells, torch.long, device)
            logits[where[:, 0], where[:, 1]] = float("-inf")
        return logits

    @staticmethod
    def _draw_filtered(logits, greedy_tokens, params, generators) -> torch.Tensor:
        """Temperature, then top-k, top-p and min-p, then a draw; greedy rows keep their argmax."""
        raise NotImplementedError(
            "ch08: _draw_filtered: the per-row settings in one copy to the device (rows_to_device, "
            "float32): greedy, temperature (1 for a greedy row), top-k (capped at the vocabulary), "
            "top-p (raised to the smallest positive float32, MIN_FLOAT32, so that a p too small "
            "for float32 keeps the most likely token) and min-p. Divide the logits by the "
            "temperatures, then apply top-k, top-p and min-p, each only when some row asks for it. "
            "Softmax, Exp(1) noise for every row, drawn again from its own generator for a seeded "
            "row, then the Gumbel-max draw; greedy rows keep the argmax they were given. Pitfall: "
            "filtering before the temperature changes what top-p keeps, see "
            "notebooks/08_sampling.ipynb"
        )
