# Reference copy of minivllm/layers/sampler.py, generated from it by scripts/make_exercises.py.
# Reference answers for: top_k_mask (ch08), top_p_mask (ch08), min_p_mask (ch08), gumbel_max_sample (ch08), Sampler._draw_filtered (ch08).
# Do not edit: change minivllm/layers/sampler.py and run scripts/make_exercises.py again.

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
    vocab = logits.shape[-1]
    k = torch.where(k <= 0, torch.full_like(k, vocab), k.clamp(max=vocab))
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p.unsqueeze(-1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def gumbel_max_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from probs, given Exp(1) noise of the same shape."""
    return (probs / noise).argmax(dim=-1)


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
        device, vocab = logits.device, logits.shape[-1]
        # One copy for every per-row setting: greedy, temperature, top-k (a k past the
        # vocabulary keeps everything, and would not fit an int64), top-p (a p that float32
        # rounds to 0, like 1e-50, is raised to its smallest positive value: the most likely
        # token's mass before it is exactly 0, so it survives any p > 0) and min-p.
        greedy, temperature, top_k, top_p, min_p = rows_to_device(
            [[float(p.greedy) for p in params], [1.0 if p.greedy else p.temperature for p in params],
             [min(p.top_k, vocab) for p in params], [max(p.top_p, MIN_FLOAT32) for p in params],
             [p.min_p for p in params]], torch.float32, device)
        scaled = logits / temperature.unsqueeze(-1)
        if any(p.top_k for p in params):
            scaled = top_k_mask(scaled, top_k.long())
        if any(p.top_p < 1 for p in params):
            scaled = top_p_mask(scaled, top_p)
        if any(p.min_p > 0 for p in params):
            scaled = min_p_mask(scaled, min_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, gen in enumerate(generators):
            # A seeded request draws its own noise from its own generator, so its tokens do
            # not depend on its neighbours in the batch.
            if gen is not None:
                noise[row].exponential_(generator=gen)
        return torch.where(greedy.bool(), greedy_tokens, gumbel_max_sample(probs, noise))
