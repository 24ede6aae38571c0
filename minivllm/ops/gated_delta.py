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
    # BEGIN SOLUTION ch13 prepare_qk
    group = num_v_heads // q.shape[-2]
    q = l2_normalize(q.float().repeat_interleave(group, dim=-2))
    k = l2_normalize(k.float().repeat_interleave(group, dim=-2))
    return q * q.shape[-1] ** -0.5, k
    # END SOLUTION


def gated_delta_step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch of N states, in float32.

    state: [N, H, dk, dv]; q, k: [N, H, dk] (prepared: normalised, q scaled); v: [N, H, dv];
    g (log decay), beta: [N, H]. Returns (out [N, H, dv], new state [N, H, dk, dv]).
    """
    # BEGIN SOLUTION ch13 gated_delta_step
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., :, None]).sum(dim=-2)  # S^T k: [N, H, dv]
    delta = beta[..., None] * (v - predicted)
    state = state + k[..., :, None] * delta[..., None, :]
    out = (state * q[..., :, None]).sum(dim=-2)
    return out, state
    # END SOLUTION


def _recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The gated delta rule token by token over one sequence, from ``state`` (float32):
    yields (out_t, the state after token t) for each token t. Arguments as
    recurrent_gated_delta_rule."""
    # BEGIN SOLUTION ch13 recurrence
    state = state.float()
    for t in range(q.shape[0]):
        o, s = gated_delta_step(state[None], q[t : t + 1], k[t : t + 1], v[t : t + 1].float(), g[t : t + 1], beta[t : t + 1])
        state = s[0]
        yield o[0], state
    # END SOLUTION


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
    # BEGIN SOLUTION ch13 gated_delta_chunk
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))  # [H, C, d]
    g, beta = g.T.float(), beta.T.float()  # [H, C]
    size = q.shape[1]
    gamma = g.cumsum(dim=-1)
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    log_decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf"))
    decay = log_decay.exp()  # [H, C, C]: exp(gamma_i - gamma_j) on and below the diagonal
    a = (beta[:, :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = beta[..., None] * v - (beta * gamma.exp())[..., None] * (k @ state)
    u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # the diagonal is taken as 1
    out = gamma.exp()[..., None] * (q @ state) + ((q @ k.transpose(-1, -2)) * decay) @ u
    last = gamma[:, -1:]
    state = last.exp()[..., None] * state + (k * (last - gamma).exp()[..., None]).transpose(-1, -2) @ u
    return out.transpose(0, 1), state
    # END SOLUTION


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form over one sequence: chunks of ``chunk_size`` tokens, the state
    carried from one to the next. Same arguments and result as recurrent_gated_delta_rule."""
    # BEGIN SOLUTION ch13 chunked_rule
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    state = state.float()
    for start in range(0, q.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        out[part], state = gated_delta_chunk(q[part], k[part], v[part], g[part], beta[part], state)
    return out, state
    # END SOLUTION


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution of one sequence's new inputs, and its rolled state.

    x: [T, D] new inputs; weight: [D, K] (one filter of width K per channel); conv_state:
    [D, K - 1], the K - 1 inputs before x (zeros before the sequence's first token).
    Output t of channel c is sum_j weight[c, j] * input[t - (K - 1) + j], where inputs
    before x come from the state. Returns (out [T, D] before the activation, the new state:
    the last K - 1 inputs, some of them still the old state's when T < K - 1).
    """
    # BEGIN SOLUTION ch13 causal_conv1d
    window = torch.cat([conv_state.to(x.dtype), x.T], dim=-1)  # [D, K - 1 + T]
    out = F.conv1d(window[None], weight[:, None, :].to(x.dtype), groups=x.shape[1])[0]  # [D, T]
    return out.T, window[:, window.shape[1] - (weight.shape[1] - 1) :]
    # END SOLUTION


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
