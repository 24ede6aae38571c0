# Exercise copy of minivllm/layers/sampler.py, generated from it by scripts/make_exercises.py.
# Fill in: top_p_mask (ch08), gumbel_max_sample (ch08).
# Grade: make grade CH=08
# Running the generator again overwrites this file: commit or copy your work first.

"""From logits to the next token: greedy, temperature, top-k, top-p, min-p, seeds.

Each row of the batch has its own parameters. Filters set the logits of excluded tokens
to -inf; the draw itself uses the Gumbel-max trick in its exponential form:
argmax(p / E) with E ~ Exp(1) picks token i with probability p_i, needs no cumulative sum
and no host sync, and with a per-request generator gives the same draw whatever else is in
the batch.
"""
import logging
import sys
from dataclasses import dataclass, field

import torch

from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
MIN_FLOAT32 = torch.finfo(torch.float32).tiny


def top_k_mask(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (k = 0: keep all). Ties at the boundary are kept."""
    vocab = logits.shape[-1]
    k = torch.where(k <= 0, torch.full_like(k, vocab), k.clamp(max=vocab))
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least p."""
    raise NotImplementedError(
        "ch08: top_p_mask: sort logits descending, softmax, cumulative sum; a sorted token is "
        "dropped when the mass before it (cumsum - its prob) already reaches p; scatter the mask "
        "back to vocabulary order and fill dropped logits with -inf, see "
        "notebooks/08_sampling.ipynb"
    )


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def gumbel_max_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from probs, given Exp(1) noise of the same shape."""
    raise NotImplementedError(
        "ch08: gumbel_max_sample: return argmax over the last dim of probs / noise, see "
        "notebooks/08_sampling.ipynb"
    )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (log-prob of the chosen token, its rank (1 = most likely), top-n token ids,
    # their log-probs), or None.
    logprobs: list[tuple[float, int, list[int], list[float]] | None]
    # Rows whose own parameters made sampling fail: row -> what went wrong. Their token is
    # -1; the engine fails those requests alone.
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned: list[list[int]] | None = None,
    ) -> SamplerOutput:
        try:
            return self.sample(logits, params, generators, banned)
        except NotImplementedError:
            raise  # missing code (an exercise left blank) is nobody's request
        except Exception:
            if len(params) == 1:
                raise
            batch_error = sys.exc_info()
        # One row's values may have broken the batch (they passed validation, so this is a
        # bug, but a bug one request must not turn into a failure for everyone): sample each
        # row alone, and report the rows that fail by themselves. If every row fails, no
        # request is to blame: the batch's error is raised.
        out = SamplerOutput([], [])
        for row in range(len(params)):
            try:
                one = self.sample(logits[row : row + 1], params[row : row + 1], generators[row : row + 1],
                                  banned[row : row + 1] if banned else None)
                out.token_ids += one.token_ids
                out.logprobs += one.logprobs
            except NotImplementedError:
                raise
            except Exception as e:
                out.token_ids.append(-1)
                out.logprobs.append(None)
                out.errors[row] = (f"sampling failed: {type(e).__name__}", e)
        if len(out.errors) == len(params):
            raise batch_error[1]
        for row, (_, e) in out.errors.items():
            logger.error("sampling failed for batch row %d alone (%s)", row, params[row], exc_info=e)
        out.errors = {row: message for row, (message, _) in out.errors.items()}
        return out

    def sample(self, logits, params, generators, banned) -> SamplerOutput:
        logits = logits.float()
        # Log-probabilities are reported as the model gave them, before any processing.
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        if banned:  # e.g. EOS before min_tokens is reached
            for row, ids in enumerate(banned):
                if ids:
                    logits[row, ids] = float("-inf")
        device, vocab = logits.device, logits.shape[-1]
        # Per-row settings are decided on the host: no device round trip just to branch.
        greedy_rows = [p.greedy for p in params]
        tokens = logits.argmax(dim=-1)
        if not all(greedy_rows):
            greedy = torch.tensor(greedy_rows).to(device, non_blocking=True)
            temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params]).to(device, non_blocking=True)
            scaled = logits / temperature.unsqueeze(-1)
            if any(p.top_k for p in params):
                # A k past the vocabulary keeps everything (and would not fit an int64).
                scaled = top_k_mask(scaled, torch.tensor([min(p.top_k, vocab) for p in params], device=device))
            if any(p.top_p < 1 for p in params):
                # The most likely token's mass before it is exactly 0, so it survives any
                # p > 0; a p that float32 rounds to 0 (1e-50) is raised to the smallest
                # float32 above 0 to keep it so.
                top_p = [max(p.top_p, MIN_FLOAT32) for p in params]
                scaled = top_p_mask(scaled, torch.tensor(top_p, dtype=torch.float32, device=device))
            if any(p.min_p > 0 for p in params):
                scaled = min_p_mask(scaled, torch.tensor([p.min_p for p in params], device=device))
            probs = scaled.softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_()
            for row, gen in enumerate(generators):
                # A seeded request draws its own noise from its own generator, so its
                # tokens do not depend on its neighbours in the batch.
                if gen is not None:
                    noise[row].exponential_(generator=gen)
            sampled = gumbel_max_sample(probs, noise)
            tokens = torch.where(greedy, tokens, sampled)
        token_list = tokens.tolist()
        logprobs: list = []
        for row, p in enumerate(params):
            if p.logprobs is None:
                logprobs.append(None)
                continue
            top = raw_logprobs[row].topk(p.logprobs) if p.logprobs else None
            chosen = raw_logprobs[row, token_list[row]]
            logprobs.append((
                float(chosen),
                int((raw_logprobs[row] > chosen).sum()) + 1,
                top.indices.tolist() if top is not None else [],
                top.values.tolist() if top is not None else [],
            ))
        return SamplerOutput(token_list, logprobs)
