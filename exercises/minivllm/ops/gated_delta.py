# Exercise copy of minivllm/ops/gated_delta.py, generated from it by scripts/make_exercises.py.
# Fill in: prepare_qk (ch13), gated_delta_step (ch13), _recurrence (ch13), gated_delta_chunk (ch13), chunk_gated_delta_rule (ch13), causal_conv1d (ch13).
# Grade: make grade CH=13
# Running the generator again overwrites this file: commit or copy your work first.

"""The gated delta rule and its causal convolution: the torch reference, and the dispatch.

A Gated DeltaNet layer keeps, per head, a state matrix S of shape [key_dim, value_dim]
instead of a KV cache. For each token t, with query q_t, key k_t (both L2-normalised, the
query also scaled by key_dim ** -0.5), value v_t, decay g_t <= 0 (log space) and write
strength beta_t in (0, 1):

    S     <- exp(g_t) * S                      forget a little of everything
    delta  = beta_t * (v_t - S^T k_t)          what S predicts for k_t, corrected towards v_t
    S     <- S + k_t delta^T                   write the correction at k_t
    o_t    = S^T q_t                           read

Three forms of the same computation live here:

- ``gated_delta_step``: one token for a batch of states (decode);
- ``gated_delta_chunk``: a whole chunk of tokens at once with a few matmuls and one small
  triangular solve (prefill), ``chunk_gated_delta_rule`` runs it chunk by chunk;
- ``recurrent_gated_delta_rule``: the step in a loop, the spec the other two must match.

Tensors are packed as everywhere in the engine: [num_tokens, heads, dim], sequences one
after another (``Context.cu_seqlens_q``). Each sequence's recurrent state and conv state
live in a *slot* of a per-layer pool; ``Context.state_slots`` says which, and
``Context.has_initial_state`` whether the sequence continues from it (a later chunk, a
decode) or starts from zeros (its first tokens).

Speculative decoding (chapter 19) verifies d drafts of a sequence in one (1 + d)-token
chunk, and the state runs over all of them; when the target rejects draft a + 1, the state
the sequence must continue from is the one after its first a + 1 tokens. So a verifying
sequence also keeps its states after each of its first d tokens, conv window and recurrent
state, in the layer's *spec pools* ([slots, k, ...], ``Context.spec_state_counts`` says how
many per sequence), and the engine copies the right one into the slot once it knows how
many drafts were accepted (``minivllm.engine.state_pool.keep_accepted_states``).
"""
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from minivllm.context import Context
from minivllm.kernels.common import CHUNK_SIZE, SHORT_STEP_TOKENS
from minivllm.ops.dispatch import use_triton


# -- one sequence (and one step), the math ---------------------------------------------


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x**2) + eps) over the last dimension (eps inside the root, as transformers)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 queries and keys as the rule uses them: one per value head (grouped heads:
    value head h reads key head h // (num_v_heads // num_k_heads)), L2-normalised, and the
    queries scaled by key_dim ** -0.5."""
    raise NotImplementedError(
        "ch13: prepare_qk: the queries and keys as the rule reads them. Several value heads may "
        "share one key head (grouped heads, as in grouped-query attention): repeat each key head "
        "for its group of value heads, neighbours together. Then, in float32, normalise every "
        "query and key vector to unit length (l2_normalize), and scale the queries by one over the "
        "square root of the key size. Pitfall: scaling before normalising undoes the scale, see "
        "notebooks/13_hybrid_attention.ipynb"
    )


def gated_delta_step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch of N states, in float32.

    state: [N, H, dk, dv]; q, k: [N, H, dk] (prepared: normalised, q scaled); v: [N, H, dv];
    g (log decay), beta: [N, H]. Returns (out [N, H, dv], new state [N, H, dk, dv]).
    """
    raise NotImplementedError(
        "ch13: gated_delta_step: one token of the gated delta rule, per head. The state S, [dk, "
        "dv], maps keys to values. First it decays by the factor exp(g). Then the delta rule "
        "corrects what S predicts for k: the prediction is S transposed times k, the error is v "
        "minus the prediction, scaled by the learning rate beta, and S gains the outer product of "
        "k and the scaled error. The output reads the updated state with q (S transposed times q). "
        "Return the output and the new state. Pitfall: predicting before the decay, or reading "
        "before the update, see notebooks/13_hybrid_attention.ipynb"
    )


def _recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The gated delta rule token by token over one sequence, from ``state`` (float32):
    yields (out_t, the state after token t) for each token t. Arguments as
    recurrent_gated_delta_rule."""
    raise NotImplementedError(
        "ch13: _recurrence (a generator): the rule token by token over one sequence, from the "
        "given state in float32. Each token is one gated_delta_step on a batch of one state (the "
        "step wants a leading batch dimension: add it to the state and to the token's inputs, the "
        "values in float32, and drop it from the results). Yield, for every token in order, its "
        "output and the state after it; carry that state to the next token, see "
        "notebooks/13_hybrid_attention.ipynb"
    )


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive recurrence over one sequence: the spec. q, k: [T, H, dk] (prepared);
    v: [T, H, dv]; g, beta: [T, H]; state: [H, dk, dv]. Returns (out [T, H, dv], final state)."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    state = state.float()
    for t, (o, state) in enumerate(_recurrence(q, k, v, g, beta, state)):
        out[t] = o
    return out, state


def gated_delta_states(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """The state after each token of one sequence, by the recurrence: what a verifying step
    keeps for the engine to roll back to. Arguments as recurrent_gated_delta_rule; returns
    [T, H, dk, dv] float32, entry t the state after token t."""
    states = torch.empty(q.shape[0], *state.shape, dtype=torch.float32, device=q.device)
    for t, (_, after) in enumerate(_recurrence(q, k, v, g, beta, state)):
        states[t] = after
    return states


def gated_delta_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """C tokens of one sequence at once, starting from ``state``: what C calls of
    gated_delta_step compute, in matmuls.

    Arguments as recurrent_gated_delta_rule, tokens first: q, k: [C, H, dk]; v: [C, H, dv];
    g, beta: [C, H]; state: [H, dk, dv]. The first lines move the heads first, in float32:
    q, k, v become [H, C, d] and g, beta [H, C], so every product below is a matmul batched
    over heads (gamma, decay and A are [H, C] and [H, C, C]). Returns (out [C, H, dv], tokens
    first again, and the new state [H, dk, dv]).

    With gamma_i = g_1 + ... + g_i (the decay from the chunk's start to token i) and
    u_i the correction written at token i, unrolling the recurrence gives
        u_i = beta_i (v_i - exp(gamma_i) S^T k_i - sum_{j<i} exp(gamma_i - gamma_j) (k_i . k_j) u_j)
    a lower-triangular system (I + A) U = beta V - diag(beta exp(gamma)) K S, solved once for
    the chunk. Then every output and the final state are sums over the chunk:
        o_i  = exp(gamma_i) S^T q_i + sum_{j<=i} exp(gamma_i - gamma_j) (q_i . k_j) u_j
        S'   = exp(gamma_C) S + sum_j exp(gamma_C - gamma_j) k_j u_j^T
    Above the diagonal (j > i) gamma_i - gamma_j is positive and exp of it can overflow to
    inf (and inf * 0 is nan), so the log-decay is masked to -inf there *before* exp.
    """
    raise NotImplementedError(
        "ch13: gated_delta_chunk: the same recurrence over a chunk of C tokens at once, equal up "
        "to rounding to C single steps. With gamma the running sum of g over the chunk, the decay "
        "from token j to token i (j at or before i) is exp(gamma_i - gamma_j), and zero above the "
        "diagonal: mask in log space, then exponentiate (the other order overflows). The "
        "corrections U solve a unit lower-triangular system (I + A) U = beta v - beta exp(gamma) k "
        "S, where A is the strictly lower part of beta_i (k_i . k_j) times the decay: use a "
        "triangular solver, not an inverse. The output is the decayed state read by q, exp(gamma) "
        "q S, plus the chunk's own part, (q k^T times the decay) U. The new state is S decayed "
        "over the whole chunk plus the keys, each decayed from its position to the chunk's end, "
        "transposed, times U. Pitfall: out goes back as [C, H, dv]; the arguments come tokens "
        "first, [C, H, d], and every product is a matmul batched over heads once they are moved "
        "first, in float32, see notebooks/13_hybrid_attention.ipynb"
    )


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form over one sequence: chunks of ``chunk_size`` tokens, the state
    carried from one to the next. Same arguments and result as recurrent_gated_delta_rule."""
    raise NotImplementedError(
        "ch13: chunk_gated_delta_rule: the whole sequence in chunks of chunk_size tokens (the last "
        "one possibly shorter), each chunk one gated_delta_chunk from the state the previous chunk "
        "left, the first from the given state in float32. The outputs fill a float32 tensor shaped "
        "like v, chunk by chunk. Return the outputs and the final state, see "
        "notebooks/13_hybrid_attention.ipynb"
    )


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution of one sequence's new inputs, and its rolled state.

    x: [T, D] new inputs; weight: [D, K] (one filter of width K per channel); conv_state:
    [D, K - 1], the K - 1 inputs before x (zeros before the sequence's first token).
    Output t of channel c is sum_j weight[c, j] * input[t - (K - 1) + j], where inputs
    before x come from the state. Returns (out [T, D] before the activation, the new state:
    the last K - 1 inputs, some of them still the old state's when T < K - 1).
    """
    raise NotImplementedError(
        "ch13: causal_conv1d: a depthwise causal convolution over time, D channels with K taps "
        "each, carried from call to call by a state holding the last K - 1 inputs. Join the state "
        "and the new inputs along time (time as the last dimension), so that output t sees exactly "
        "the K inputs ending at its own; every channel is convolved with its own taps only (one "
        "group per channel). Return the T outputs as [T, D] and the new state, the last K - 1 "
        "columns of the joined window. Pitfall: without the state each call starts from zeros, "
        "wrong for a decode step, see notebooks/13_hybrid_attention.ipynb"
    )


# -- a packed batch, with the state pool ----------------------------------------------


def _sequences(ctx: Context, num_tokens: int) -> list[tuple[int, int]]:
    cu = [0, num_tokens] if ctx.cu_seqlens_q is None else ctx.cu_seqlens_q.tolist()
    return list(zip(cu[:-1], cu[1:]))


def _initial(pool: torch.Tensor | None, ctx: Context, i: int, shape, dtype, device) -> torch.Tensor:
    """Sequence i's state before this step: its slot's, or zeros for a first chunk (or no pool)."""
    if pool is None or ctx.state_slots is None or not bool(ctx.has_initial_state[i]):
        return torch.zeros(shape, dtype=dtype, device=device)
    return pool[int(ctx.state_slots[i])]


def _spec_counts(ctx: Context, num_seqs: int, spec_pool: torch.Tensor | None) -> list[int]:
    """How many states each sequence keeps for a rollback (0 for all without a spec pool)."""
    if spec_pool is None or ctx.spec_state_counts is None or ctx.state_slots is None:
        return [0] * num_seqs
    return ctx.spec_state_counts.tolist()


def short_step(ctx: Context) -> bool:
    """Does this prefill step run the short-step kernels (each sequence at most
    SHORT_STEP_TOKENS tokens, the bound known on the host)?"""
    return ctx.is_prefill and ctx.cu_seqlens_q is not None and 0 < ctx.max_seqlen_q <= SHORT_STEP_TOKENS


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor | None, ctx: Context,
                         spec_conv_states: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(causal conv) of a packed batch; each sequence continues from its conv state and
    leaves its last K - 1 inputs in it. x: [num_tokens, D]; conv_states: [slots, D, K - 1]
    or None (no pool: every sequence starts from zeros, nothing is kept). A verifying
    sequence also leaves its window after each of its first ``ctx.spec_state_counts[i]``
    inputs in ``spec_conv_states`` [slots, k, D, K - 1]."""
    if conv_states is not None and ctx.state_slots is not None and use_triton(x):
        from minivllm.kernels import gated_delta as kernels

        if not ctx.is_prefill:
            return kernels.causal_conv1d_update(x, weight, conv_states, ctx.state_slots, ctx.has_initial_state)
        if short_step(ctx):
            keep = spec_conv_states is not None and ctx.spec_state_counts is not None
            return kernels.causal_conv1d_short(x, weight, conv_states, ctx.state_slots, ctx.has_initial_state,
                                               ctx.cu_seqlens_q, ctx.spec_state_counts if keep else None,
                                               spec_conv_states if keep else None)
    out = torch.empty_like(x)
    sequences = _sequences(ctx, x.shape[0])
    counts = _spec_counts(ctx, len(sequences), spec_conv_states)
    width = weight.shape[1]
    for i, (start, end) in enumerate(sequences):
        state = _initial(conv_states, ctx, i, (x.shape[1], width - 1), x.dtype, x.device)
        if counts[i]:  # (before the slot is written: ``state`` may be a view of it)
            window = torch.cat([state.to(x.dtype), x[start:end].T], dim=-1)  # [D, K - 1 + T]
            # After input j the last K - 1 inputs are window columns j + 1 .. j + K - 1.
            kept = window.unfold(1, width - 1, 1)[:, 1 : counts[i] + 1]  # [D, r, K - 1]
            spec_conv_states[int(ctx.state_slots[i]), : counts[i]] = kept.transpose(0, 1)
        out[start:end], state = causal_conv1d(x[start:end], weight, state)
        if conv_states is not None and ctx.state_slots is not None:
            conv_states[int(ctx.state_slots[i])] = state
    return F.silu(out)


def gated_delta_rule_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor | None, ctx: Context, spec_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule over a packed batch: the Triton kernels on a GPU, the torch
    reference elsewhere. q, k: [num_tokens, Hk, dk] raw (normalised here); v: [num_tokens,
    Hv, dv]; g, beta: [num_tokens, Hv] float32; states: [slots, Hv, dk, dv] float32 or None.
    A prefill step runs the chunked form per sequence, a decode step one batched recurrent
    step, and on the GPU a short step (``short_step``) the recurrence token by token. A verifying sequence also leaves its state after each of its first
    ``ctx.spec_state_counts[i]`` tokens in ``spec_states`` [slots, k, Hv, dk, dv]. Returns
    [num_tokens, Hv, dv] in v's dtype."""
    with_pool = states is not None and ctx.state_slots is not None
    keep_spec = with_pool and spec_states is not None and ctx.spec_state_counts is not None
    if use_triton(q):
        from minivllm.kernels import gated_delta as kernels

        if with_pool and short_step(ctx):  # keeps the spec states itself
            return kernels.recurrent_gated_delta_short(
                q, k, v, g, beta, states, ctx.state_slots, ctx.has_initial_state, ctx.cu_seqlens_q,
                ctx.spec_state_counts if keep_spec else None, spec_states if keep_spec else None)
        if keep_spec:  # first: it starts from the slots' states, which the pass below overwrites
            kernels.record_gated_delta_states(q, k, v, g, beta, states, ctx.state_slots, ctx.has_initial_state,
                                              ctx.cu_seqlens_q, ctx.spec_state_counts, spec_states)
        if with_pool and not ctx.is_prefill:
            return kernels.recurrent_gated_delta_step(q, k, v, g, beta, states, ctx.state_slots, ctx.has_initial_state)
        cu, longest = ctx.cu_seqlens_q, ctx.max_seqlen_q
        if cu is None:
            cu, longest = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device), q.shape[0]
        elif not longest:  # a context without the host-side bound (a warm-up pass): ask the device
            longest = int((cu[1:] - cu[:-1]).max())
        pool = (states, ctx.state_slots, ctx.has_initial_state) if with_pool else (None, None, None)
        return kernels.chunk_gated_delta_varlen(q, k, v, g, beta, *pool, cu, longest)
    qp, kp = prepare_qk(q, k, v.shape[1])
    if with_pool and not ctx.is_prefill:
        # Decode: one token per sequence, all sequences in one batched step.
        slots = ctx.state_slots.long()
        keep = ctx.has_initial_state.bool()[:, None, None, None]
        state = torch.where(keep, states[slots], torch.zeros((), device=states.device))
        out, state = gated_delta_step(state, qp, kp, v.float(), g, beta)
        states[slots] = state
        return out.to(v.dtype)
    out = torch.empty_like(v)
    shape = (v.shape[1], q.shape[2], v.shape[2])
    sequences = _sequences(ctx, q.shape[0])
    counts = _spec_counts(ctx, len(sequences), spec_states if keep_spec else None)
    for i, (start, end) in enumerate(sequences):
        part = slice(start, end)
        state = _initial(states, ctx, i, shape, torch.float32, q.device)
        if counts[i]:
            r = slice(start, start + counts[i])
            spec_states[int(ctx.state_slots[i]), : counts[i]] = gated_delta_states(
                qp[r], kp[r], v[r], g[r], beta[r], state)
        o, state = chunk_gated_delta_rule(qp[part], kp[part], v[part], g[part], beta[part], state)
        out[part] = o.to(v.dtype)
        if with_pool:
            states[int(ctx.state_slots[i])] = state
    return out
