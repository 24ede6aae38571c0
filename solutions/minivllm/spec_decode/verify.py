# Reference copy of minivllm/spec_decode/verify.py, generated from it by scripts/make_exercises.py.
# Reference answers for: num_accepted (ch19), rejection_sample (ch19).
# Do not edit: change minivllm/spec_decode/verify.py and run scripts/make_exercises.py again.

"""Verifying drafts: which of a sequence's proposed tokens does the target model accept?

A sequence whose last token is t and whose proposer drafted x_1..x_d runs one forward pass
over [t, x_1, .., x_d] (a (1 + d)-token chunk, as a prefill chunk runs), which gives the
target's distribution p_j at every position j = 0..d: p_0 predicts the token after t, p_j
the token after x_j. The engine samples one token y_j from each p_j with the ordinary
sampler (temperature, top-k/p, seeds, logprobs as for any token), then accepts x_1..x_a for
the longest prefix where y_{j-1} == x_j and appends y_a: the target's own token at the
first mismatch, or the "bonus" token after d accepted drafts. A step thus yields 1..d + 1
tokens.

Greedy rows: y_j is the argmax, so the output is token for token the one without
speculation.

Sampled rows: this is Leviathan et al.'s rejection sampling for a draft distribution q that
is a point mass on x (as an n-gram proposer's is). Their rule accepts x with probability
min(1, p(x) / q(x)) = p(x) and otherwise draws from the residual max(p - q, 0), normalised,
which is p with x removed. Drawing y ~ p and accepting iff y == x does exactly that: it
accepts with probability p(x), and given a rejection y is distributed as p conditioned on
y != x, the residual. Why it preserves the target distribution: the emitted token z has
P(z = x) = p(x) (accepted) and, for z != x, P(z) = (1 - p(x)) * p(z) / (1 - p(x)) = p(z);
so every emitted token is distributed as p given the tokens before it, which by induction
over positions are distributed as the target's. Draws made after the first mismatch are
thrown away; they were independent of what was kept.

``rejection_sample`` is the rule for a general draft distribution q (a draft model that
samples): the engine does not use it, since its proposers draft point masses.
"""
import torch


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many of ``drafts`` are accepted, given the target's token ``sampled[j]`` at each
    of the 1 + len(drafts) positions (sampled[j] follows drafts[j - 1]): the length of the
    longest prefix with drafts[j] == sampled[j]. The tokens emitted are then
    ``sampled[: num_accepted + 1]`` (the accepted drafts and the target's next token)."""
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return a


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     uniforms: torch.Tensor, generator: torch.Generator | None = None) -> list[int]:
    """Leviathan et al.'s rule for drafts drawn from any draft distribution: the tokens a
    verifying step emits, the accepted drafts and one token more (1 to d + 1 of them).

    ``target_probs`` [d + 1, V]: p_j, the target's distribution at position j (p_0 follows
    the sequence's last token, p_j follows draft j - 1); ``draft_probs`` [d, V]: q_j, the
    distribution draft j was drawn from; ``draft_ids`` [d]: the drafts x_j; ``uniforms`` [d]:
    one draw of U[0, 1) per draft; ``generator``: the residual and bonus draws.

    Position by position, x_j is accepted iff u_j < min(1, p_j(x_j) / q_j(x_j)). At the first
    rejection the token is drawn from the residual normalize(max(p_j - q_j, 0)) and the step
    ends; after d acceptances the bonus token is drawn from p_d.

    Why the emitted token is distributed as p (one position; write p, q for p_j, q_j). With
    x ~ q, the token z is emitted by acceptance with probability q(z) min(1, p(z) / q(z)) =
    min(p(z), q(z)). A rejection happens with probability beta = sum_x (q(x) - min(p(x),
    q(x))) = 1 - sum_x min(p(x), q(x)) = sum_x max(p(x) - q(x), 0), which is the residual's
    total mass; then z is drawn from max(p - q, 0) / beta. In all,
    P(z) = min(p(z), q(z)) + max(p(z) - q(z), 0) = p(z). After an acceptance the next
    position is the same problem with p_{j+1}, the target's distribution given the tokens
    accepted so far, so by induction every emitted token is distributed as the target's
    next token given those before it: the output is the target's, whatever q is. The draft
    only sets how often drafts are accepted: 1 - beta = 1 - TV(p, q) per position.

    A draft that is a point mass (q = one-hot at x, as an n-gram proposer's guess, or a
    draft model decoding greedily) makes this the engine's rule (``num_accepted``):
    min(1, p(x) / 1) = p(x) is the probability of acceptance, and the residual max(p - onehot(x),
    0) is p with x removed, renormalised. Drawing y ~ p and accepting iff y == x has exactly
    that law, which is why the engine samples each position with its ordinary sampler and
    compares."""
    d = draft_ids.shape[0] if draft_ids.dim() == 1 else -1
    if d < 0 or target_probs.dim() != 2 or target_probs.shape[0] != d + 1:
        raise ValueError(f"draft_ids must be [d] and target_probs [d + 1, V]; got {tuple(draft_ids.shape)} and "
                         f"{tuple(target_probs.shape)}")
    if tuple(draft_probs.shape) != (d, target_probs.shape[1]) or tuple(uniforms.shape) != (d,):
        raise ValueError(f"draft_probs must be [d, V] = [{d}, {target_probs.shape[1]}] and uniforms [d]; got "
                         f"{tuple(draft_probs.shape)} and {tuple(uniforms.shape)}")
    emitted = []
    for j in range(d):
        p, q, x = target_probs[j], draft_probs[j], int(draft_ids[j])
        if uniforms[j] * q[x] < p[x]:  # u < min(1, p(x) / q(x)), as u < 1; no division by q(x)
            emitted.append(x)
            continue
        residual = torch.clamp(p - q, min=0)
        emitted.append(_draw(residual, p, generator))
        return emitted
    emitted.append(_draw(target_probs[d], target_probs[d], generator))  # every draft accepted: the bonus
    return emitted


def _draw(weights: torch.Tensor, target: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn in proportion to ``weights`` (torch.multinomial normalises them).
    A rejection leaves a residual of zero mass only by rounding (when p and q agree to
    within float error, where a rejection itself has rounding-level probability); the
    target's distribution is then drawn from instead."""
    if not weights.sum() > 0:
        weights = target
    return int(torch.multinomial(weights, 1, generator=generator))
