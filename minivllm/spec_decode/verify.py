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
"""


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many of ``drafts`` are accepted, given the target's token ``sampled[j]`` at each
    of the 1 + len(drafts) positions (sampled[j] follows drafts[j - 1]): the length of the
    longest prefix with drafts[j] == sampled[j]. The tokens emitted are then
    ``sampled[: num_accepted + 1]`` (the accepted drafts and the target's next token)."""
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return a
