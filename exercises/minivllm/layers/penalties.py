# Exercise copy of minivllm/layers/penalties.py, generated from it by scripts/make_exercises.py.
# Fill in: repetition_penalty (ch08).
# Grade: make grade CH=08
# Running the generator again overwrites this file: commit or copy your work first.

"""Penalties on tokens a request has already seen, as vLLM applies them.

A small model left to itself repeats: the same phrase, then the same phrase again. Three
knobs push the logits of tokens already seen down (or, negative, up):

- ``presence_penalty`` (OpenAI's): subtract it once from every token the request has
  *generated*, however often;
- ``frequency_penalty`` (OpenAI's): subtract it once per occurrence in the generated text;
- ``repetition_penalty`` (the CTRL paper's, as in Hugging Face and vLLM): every token seen in
  the prompt *or* the output has its logit divided by the penalty when positive, multiplied
  when negative, so a penalty > 1 always makes the token less likely (dividing a negative
  logit would make it more likely).

Every function here is the whole batch at once: one row per request, with per-row values
(1 or 0 where a row uses no penalty), so there is no Python loop over requests.
"""
import torch


def token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per row, how often each token of the vocabulary occurs in ``ids`` ([rows, length],
    padded with -1): an int [rows, vocab] tensor. (The padding is counted in one extra column,
    which is then dropped: that keeps the scatter free of masks.)"""
    rows = ids.shape[0]
    index = torch.where(ids < 0, vocab, ids)
    counts = torch.zeros(rows, vocab + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.int32))
    return counts[:, :vocab]


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Divide the positive logits of the tokens in ``seen`` ([rows, vocab] bool: in the
    prompt or the output) by the row's ``penalty`` ([rows]), multiply the negative ones."""
    raise NotImplementedError(
        "ch08: repetition_penalty: make the tokens already seen (in the prompt or the output: the "
        "seen mask) less likely, whatever the sign of their logit: a positive logit shrinks when "
        "divided by the row's penalty, a negative one moves away from zero when multiplied by it. "
        "Tokens not seen keep their logit exactly. Pitfalls: dividing a negative logit makes its "
        "token more likely; penalty holds one value per row, to broadcast over the vocabulary, see "
        "notebooks/08_sampling.ipynb"
    )


def presence_frequency_penalty(logits: torch.Tensor, output_counts: torch.Tensor, presence: torch.Tensor,
                               frequency: torch.Tensor) -> torch.Tensor:
    """Subtract ``frequency`` per occurrence and ``presence`` once from the logit of each
    token the row has generated (``output_counts``: [rows, vocab])."""
    counts = output_counts.to(logits.dtype)
    return logits - frequency.unsqueeze(-1) * counts - presence.unsqueeze(-1) * (counts > 0).to(logits.dtype)
