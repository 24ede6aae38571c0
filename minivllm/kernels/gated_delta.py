"""The gated delta rule on the GPU (chunked prefill, recurrent decode and short steps) and its causal conv.
  decode (memory-bound): 2 * Hv * dk * dv * 4 bytes a sequence (its float32 state in and out), 8 * Hv * dk * dv FLOPs
  prefill (compute-bound): 4 C dk dv + 4 C^2 (dk + dv) + C^3 FLOPs per chunk of C tokens and head; q, k, v, W, U once

The torch reference (``minivllm.ops.gated_delta``) is the spec. Every recurrent kernel runs
one per-token update, ``_gated_delta_update``.

Per value head, the state S is [dk, dv] float32 and lives in a slot of the layer's pool.

Decode (one token per sequence): read S, update it, write it back, read one output; the
state is read and written once per token. One program per (sequence, value head, block of
dv columns).

Prefill, chunks of C = 64 tokens (``kernels.common.CHUNK_SIZE``), two kernels:
  1. ``_chunk_prepare_kernel``, all chunks in parallel: build the chunk's [C, C] lower-
     triangular system A (beta_i (k_i . k_j) exp(gamma_i - gamma_j), j < i), invert I + A by
     forward substitution, and store U = (I + A)^-1 beta V and W = (I + A)^-1 beta exp(gamma) K
     (and gamma). FLOPs ~ 2 C^2 (dk + dv) + C^3 per chunk and head.
  2. ``_chunk_scan_kernel``, sequential over the chunks of a sequence, parallel over
     sequences, value heads and dv blocks: with S the state at the chunk's start,
     corrections V' = U - W S, outputs exp(gamma) Q S + (Q K^T * decay) V', and the next
     state exp(gamma_C) S + (K exp(gamma_C - gamma))^T V'. FLOPs ~ 4 C dk dv + 2 C^2 (dk + dv)
     per chunk and head: compute-bound at long prompts, bytes ~ q, k, v, W, U once.
Queries and keys are L2-normalised inside the kernels (float32), as the reference does.

Short steps (every sequence at most ``SHORT_STEP_TOKENS`` tokens: speculative decoding's
verifying steps, short prompts), ``_recurrent_short_kernel`` and ``_conv_short_kernel``: the
decode step's recurrence run token by token over each sequence's few tokens, in one launch
per layer whatever the batch. A verifying sequence's state after each of its first d tokens
is stored on the way (into the spec pools, for the engine to roll back to). Everything they
read about the step is on the device (cu_seqlens, slots, counts), so a CUDA graph can hold
them: a verify graph replays a padded batch of short sequences.
  bytes ~ (2 + d) * Hv * dk * dv * 4 per sequence (its state in and out, d states kept)
  FLOPs ~ 8 * T * Hv * dk * dv for T tokens

Speculative decoding in a longer step, ``_record_states_kernel``: the same kept states,
beside the chunked pass that computes the step's outputs and final states (it runs first,
from the slot's state).
  bytes ~ (1 + d) * Hv * dk * dv * 4 per verifying sequence (its state in, d states out)
  FLOPs ~ 5 * d * Hv * dk * dv
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels.common import CHUNK_SIZE, dot_precision


# -- decode -----------------------------------------------------------------------------


@triton.jit
def _conv_update_kernel(
    x_ptr,  # [N, D]: one new input per sequence
    w_ptr,  # [D, K]
    state_ptr,  # [slots, D, K - 1]: each sequence's last K - 1 inputs, rolled in place
    slot_ptr,  # [N]: each row's state slot, -1 for padding
    init_ptr,  # [N]: 1 where the row continues from its slot's state, 0 to start from zeros
    out_ptr,  # [N, D]
    D, stride_x, stride_o, stride_w, stride_ss, stride_sd,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_K)  # state column j holds input t - (K - 1) + j
    slot = tl.load(slot_ptr + n)
    keep = tl.load(init_ptr + n) != 0
    dm = (d < D) & ((d * 0 + slot) >= 0)  # slot -1: a padding row
    slot = tl.maximum(slot, 0)
    x = tl.load(x_ptr + n * stride_x + d, mask=dm, other=0.0).to(tl.float32)
    in_state = dm[:, None] & (j[None, :] < K - 1)
    base = state_ptr + slot.to(tl.int64) * stride_ss + d[:, None] * stride_sd
    state = tl.load(base + j[None, :], mask=in_state, other=0.0).to(tl.float32)
    state = tl.where(keep, state, 0.0)  # a first token starts from zeros
    w = tl.load(w_ptr + d[:, None] * stride_w + j[None, :], mask=dm[:, None] & (j[None, :] < K - 1), other=0.0)
    w_last = tl.load(w_ptr + d * stride_w + (K - 1), mask=dm, other=0.0).to(tl.float32)
    acc = tl.sum(state * w.to(tl.float32), axis=1) + x * w_last
    # Roll: column j takes column j + 1, the last takes x.
    shifted = tl.load(base + j[None, :] + 1, mask=in_state & (j[None, :] + 1 < K - 1), other=0.0).to(tl.float32)
    shifted = tl.where(keep, shifted, 0.0)
    shifted = tl.where(j[None, :] == K - 2, x[:, None], shifted)
    tl.store(base + j[None, :], shifted.to(state_ptr.dtype.element_ty), mask=dm[:, None] & (j[None, :] < K - 1))
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + n * stride_o + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def _check_conv_shapes(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor) -> None:
    """The conv kernels' layout: x [rows, D] with contiguous channels, weight [D, K] and
    conv_states [slots, D, K - 1], both contiguous along the kernel width."""
    dim, width = x.shape[1], weight.shape[1]
    if weight.shape[0] != dim or conv_states.shape[1:] != (dim, width - 1) or x.stride(1) != 1:
        raise ValueError(f"conv shapes disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"states {tuple(conv_states.shape)} (x's channels must be contiguous)")
    if conv_states.stride(2) != 1 or weight.stride(1) != 1:
        raise ValueError("conv_states and weight must be contiguous along the kernel width")


def _check_per_sequence(slots: torch.Tensor, has_initial_state: torch.Tensor, num_seqs: int) -> None:
    """The short-step launchers take one slot and one has_initial_state entry per sequence."""
    if slots.shape[0] != num_seqs or has_initial_state.shape[0] != num_seqs:
        raise ValueError(f"slots and has_initial_state need one entry per sequence ({num_seqs}), got "
                         f"{slots.shape[0]} and {has_initial_state.shape[0]}")


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """SiLU(causal conv) of one new input per sequence, rolling each sequence's conv state
    in place. x: [N, D]; weight: [D, K]; conv_states: [slots, D, K - 1]; slot -1: padding row
    (output zeros, no state touched)."""
    num_rows, dim = x.shape
    width = weight.shape[1]
    _check_conv_shapes(x, weight, conv_states)
    out = torch.empty(num_rows, dim, dtype=x.dtype, device=x.device)
    block_d = 256 if x.is_cuda else 32
    grid = (num_rows, triton.cdiv(dim, block_d))
    _conv_update_kernel[grid](
        x, weight, conv_states, slots, has_initial_state, out,
        dim, x.stride(0), out.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1),
        K=width, BLOCK_K=triton.next_power_of_2(width), BLOCK_D=block_d,
    )
    return out


@triton.jit
def _l2_normalize(x):
    """A query or key row in float32, L2-normalised with eps inside the root, as the
    reference's ``l2_normalize``."""
    return x * tl.rsqrt(tl.sum(x * x) + 1e-6)


@triton.jit
def _gated_delta_update(state, k, v, g, beta):
    """One token of the gated delta rule on a [BK, BV] block of a state S (float32):
        S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T
    The one update every recurrent kernel runs (``ops.gated_delta.gated_delta_step`` is its
    spec). Returns the new block."""
    state = state * tl.exp(g)
    predicted = tl.sum(state * k[:, None], axis=0)  # S^T k
    delta = beta * (v - predicted)
    return state + k[:, None] * delta[None, :]


@triton.jit
def _recurrent_step_kernel(
    q_ptr,  # [N, Hk, dk] (raw: normalised here)
    k_ptr,  # [N, Hk, dk] (raw)
    v_ptr,  # [N, Hv, dv]
    g_ptr,  # [N, Hv] float32, log decay
    beta_ptr,  # [N, Hv] float32
    state_ptr,  # [slots, Hv, dk, dv] float32, updated in place
    slot_ptr,  # [N]: each row's state slot, -1 for padding
    init_ptr,  # [N]: 1 where the row continues from its slot's state, 0 to start from zeros
    out_ptr,  # [N, Hv, dv]
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BK)
    slot = tl.load(slot_ptr + n)
    keep = tl.load(init_ptr + n) != 0
    km, vm = rows < DK, (cols < DV) & ((cols * 0 + slot) >= 0)  # slot -1: a padding row
    slot = tl.maximum(slot, 0)
    hk = h // GROUP
    q = tl.load(q_ptr + n * stride_qt + hk * stride_qh + rows, mask=km, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + n * stride_kt + hk * stride_kh + rows, mask=km, other=0.0).to(tl.float32)
    q = _l2_normalize(q) * scale
    k = _l2_normalize(k)
    v = tl.load(v_ptr + n * stride_vt + h * stride_vh + cols, mask=vm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + n * stride_gt + h)
    beta = tl.load(beta_ptr + n * stride_bt + h)
    s_ptrs = state_ptr + slot.to(tl.int64) * stride_ss + h * stride_sh + rows[:, None] * stride_sk + cols[None, :]
    sm = km[:, None] & vm[None, :]
    state = tl.where(keep, tl.load(s_ptrs, mask=sm, other=0.0), 0.0)
    state = _gated_delta_update(state, k, v, g, beta)
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(s_ptrs, state, mask=sm)
    tl.store(out_ptr + n * stride_ot + h * stride_oh + cols, out.to(out_ptr.dtype.element_ty), mask=cols < DV)


@triton.jit
def _record_states_kernel(
    k_ptr,  # [T, Hk, dk] (raw: normalised here)
    v_ptr,  # [T, Hv, dv]
    g_ptr,  # [T, Hv] float32, log decay
    beta_ptr,  # [T, Hv] float32
    state_ptr,  # [slots, Hv, dk, dv] float32, read only: each sequence's state before the step
    slot_ptr,  # [num_seqs]: each sequence's state slot, -1 for padding
    init_ptr,  # [num_seqs]: 1 to continue from the slot's state, 0 to start from zeros
    cu_ptr,  # [num_seqs + 1]: where each sequence starts
    count_ptr,  # [num_seqs]: how many states to keep (its drafts; 0: none)
    spec_ptr,  # [slots, k, Hv, dk, dv] float32, written: entry j the state after the sequence's token j
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ss, stride_sh, stride_sk, stride_ps, stride_pj, stride_ph, stride_pk,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BK)
    count = tl.load(count_ptr + n)
    slot = tl.load(slot_ptr + n)
    if (count > 0) & (slot >= 0):
        keep = tl.load(init_ptr + n) != 0
        bos = tl.load(cu_ptr + n)
        km, vm = rows < DK, cols < DV
        sm = km[:, None] & vm[None, :]
        hk = h // GROUP
        slot = slot.to(tl.int64)
        s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + rows[:, None] * stride_sk + cols[None, :]
        state = tl.where(keep, tl.load(s_ptrs, mask=sm, other=0.0), 0.0)
        p_ptrs = spec_ptr + slot * stride_ps + h * stride_ph + rows[:, None] * stride_pk + cols[None, :]
        for j in range(0, count):
            t = bos + j
            k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + rows, mask=km, other=0.0).to(tl.float32)
            k = _l2_normalize(k)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + cols, mask=vm, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + t * stride_gt + h)
            beta = tl.load(beta_ptr + t * stride_bt + h)
            state = _gated_delta_update(state, k, v, g, beta)
            tl.store(p_ptrs + j * stride_pj, state, mask=sm)


def _check_rule_shapes(q, k, v, g, beta, states):
    num_tokens, num_k_heads, dk = q.shape
    _, num_v_heads, dv = v.shape
    if k.shape != q.shape or v.shape[0] != num_tokens or num_v_heads % num_k_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need equal q/k shapes, "
                         "the same tokens, and value heads a multiple of key heads")
    if g.shape != (num_tokens, num_v_heads) or beta.shape != g.shape or g.dtype != torch.float32 or beta.dtype != torch.float32:
        raise ValueError(f"g and beta must be float32 [{num_tokens}, {num_v_heads}], got {tuple(g.shape)} {g.dtype}, "
                         f"{tuple(beta.shape)} {beta.dtype}")
    if states is not None and (states.shape[1:] != (num_v_heads, dk, dv) or states.dtype != torch.float32
                               or not states.is_contiguous()):
        raise ValueError(f"states must be contiguous float32 [slots, {num_v_heads}, {dk}, {dv}], "
                         f"got {tuple(states.shape)} {states.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {x.stride()}")
    return num_tokens, num_k_heads, num_v_heads, dk, dv


def _check_spec_states(spec_states: torch.Tensor | None, states: torch.Tensor) -> None:
    """The spec pool beside ``states`` ([slots, Hv, dk, dv]): contiguous float32 [slots, k,
    Hv, dk, dv], entry j the state after a sequence's token j."""
    if (spec_states is None or spec_states.dim() != 5 or spec_states.shape[0] != states.shape[0]
            or spec_states.shape[2:] != states.shape[1:] or spec_states.dtype != torch.float32
            or not spec_states.is_contiguous()):
        num_slots, num_v_heads, dk, dv = states.shape
        raise ValueError(f"spec_states must be contiguous float32 [{num_slots}, k, {num_v_heads}, {dk}, {dv}], "
                         f"got {None if spec_states is None else f'{tuple(spec_states.shape)} {spec_states.dtype}'}")


def recurrent_gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """One decode token per sequence. q, k: [N, Hk, dk] (raw); v: [N, Hv, dv]; g, beta:
    [N, Hv] float32; states: [slots, Hv, dk, dv] float32, updated in place at ``slots``
    (-1: a padding row, whose output is zeros). Returns [N, Hv, dv] in v's dtype."""
    num_rows, num_k_heads, num_v_heads, dk, dv = _check_rule_shapes(q, k, v, g, beta, states)
    out = torch.empty_like(v)
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), 32 if q.is_cuda else 16)
    grid = (num_rows, num_v_heads, triton.cdiv(dv, bv))
    _recurrent_step_kernel[grid](
        q, k, v, g, beta, states, slots, has_initial_state, out, dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), states.stride(0), states.stride(1), states.stride(2),
        DK=dk, DV=dv, GROUP=num_v_heads // num_k_heads, BK=bk, BV=bv,
    )
    return out


def record_gated_delta_states(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor, counts: torch.Tensor, spec_states: torch.Tensor,
) -> None:
    """Speculative decoding: for each packed sequence i (cu_seqlens), its state after each
    of its first counts[i] tokens, from its slot's state (zeros where has_initial_state is
    0), into spec_states[slots[i], :counts[i]]. q, k: [T, Hk, dk] (raw; q only checks the
    shapes, the state does not depend on it); v: [T, Hv, dv]; g, beta: [T, Hv] float32;
    states: [slots, Hv, dk, dv] float32, not written; spec_states: [slots, k, Hv, dk, dv]
    float32. ``minivllm.ops.gated_delta.gated_delta_states`` is the spec."""
    _, _, num_v_heads, dk, dv = _check_rule_shapes(q, k, v, g, beta, states)
    _check_spec_states(spec_states, states)
    num_seqs = counts.shape[0]
    if slots.shape[0] != num_seqs or has_initial_state.shape[0] != num_seqs or cu_seqlens.shape[0] != num_seqs + 1:
        raise ValueError(f"counts, slots and has_initial_state need one entry per sequence and cu_seqlens one more: "
                         f"{num_seqs}, {slots.shape[0]}, {has_initial_state.shape[0]}, {cu_seqlens.shape[0]}")
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), 32 if k.is_cuda else 16)
    _record_states_kernel[(num_seqs, num_v_heads, triton.cdiv(dv, bv))](
        k, v, g, beta, states, slots, has_initial_state, cu_seqlens, counts, spec_states,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        states.stride(0), states.stride(1), states.stride(2),
        spec_states.stride(0), spec_states.stride(1), spec_states.stride(2), spec_states.stride(3),
        DK=dk, DV=dv, GROUP=num_v_heads // q.shape[1], BK=bk, BV=bv,
    )


# -- short steps --------------------------------------------------------------------------


@triton.jit
def _conv_short_kernel(
    x_ptr,  # [T, D]: the step's inputs, packed by sequence
    w_ptr,  # [D, K]
    state_ptr,  # [slots, D, K - 1]: each sequence's last K - 1 inputs, replaced by the new last ones
    slot_ptr,  # [num_seqs]: each sequence's state slot, -1 for padding
    init_ptr,  # [num_seqs]: 1 to continue from the slot's state, 0 to start from zeros
    cu_ptr,  # [num_seqs + 1]: where each sequence starts
    count_ptr,  # [num_seqs]: how many windows to keep (with HAS_SPEC)
    spec_ptr,  # [slots, k, D, K - 1]: entry j the window after the sequence's input j (with HAS_SPEC)
    out_ptr,  # [T, D]
    D, stride_x, stride_o, stride_w, stride_ss, stride_sd, stride_ps, stride_pj, stride_pd,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SPEC: tl.constexpr,
):
    n = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.arange(0, BLOCK_K)
    slot = tl.load(slot_ptr + n)
    bos = tl.load(cu_ptr + n)
    length = tl.load(cu_ptr + n + 1) - bos
    count = tl.load(count_ptr + n)  # (without HAS_SPEC: any valid pointer, unused)
    dm = d < D
    real = (d * 0 + slot) >= 0  # [BLOCK_D]: slot -1, a padding sequence
    keep = real & ((d * 0 + tl.load(init_ptr + n)) != 0)  # [BLOCK_D]: continue from the slot's window
    slot = tl.maximum(slot, 0).to(tl.int64)
    base = state_ptr + slot * stride_ss + d[:, None] * stride_sd
    w = tl.load(w_ptr + d[:, None] * stride_w + i[None, :], mask=dm[:, None] & (i[None, :] < K), other=0.0)
    # Input m of the sequence: x[bos + m] for m >= 0, state column K - 1 + m before it.
    for j in range(0, length):
        m = j - (K - 1) + i  # [BLOCK_K]: the inputs tap i sees at input j
        taps = dm[:, None] & (i[None, :] < K)
        from_x = tl.load(x_ptr + (bos + tl.maximum(m, 0))[None, :] * stride_x + d[:, None],
                         mask=taps & (m[None, :] >= 0), other=0.0).to(tl.float32)
        from_state = tl.load(base + tl.maximum(K - 1 + m, 0)[None, :], mask=taps & (m[None, :] < 0) & keep[:, None],
                             other=0.0).to(tl.float32)
        acc = tl.sum((from_x + from_state) * w.to(tl.float32), axis=1)
        out = tl.where(real, acc * tl.sigmoid(acc), 0.0)
        tl.store(out_ptr + (bos + j) * stride_o + d, out.to(out_ptr.dtype.element_ty), mask=dm)
        if HAS_SPEC:
            # The window after input j: inputs j - (K - 2) .. j, column c holding j - (K - 2) + c.
            m = j - (K - 2) + i
            cols = dm[:, None] & (i[None, :] < K - 1)
            window = tl.load(x_ptr + (bos + tl.maximum(m, 0))[None, :] * stride_x + d[:, None],
                             mask=cols & (m[None, :] >= 0), other=0.0)
            window += tl.load(base + tl.maximum(K - 1 + m, 0)[None, :], mask=cols & (m[None, :] < 0) & keep[:, None],
                              other=0.0).to(window.dtype)
            tl.store(spec_ptr + slot * stride_ps + j * stride_pj + d[:, None] * stride_pd + i[None, :],
                     window.to(spec_ptr.dtype.element_ty), mask=cols & (real & ((d * 0 + j) < count))[:, None])
    # The new state: the last K - 1 inputs, all read before any is written.
    m = length - (K - 1) + i
    cols = dm[:, None] & (i[None, :] < K - 1)
    last = tl.load(x_ptr + (bos + tl.maximum(m, 0))[None, :] * stride_x + d[:, None],
                   mask=cols & (m[None, :] >= 0), other=0.0)
    last += tl.load(base + tl.maximum(K - 1 + m, 0)[None, :], mask=cols & (m[None, :] < 0) & keep[:, None],
                    other=0.0).to(last.dtype)
    tl.store(base + i[None, :], last.to(state_ptr.dtype.element_ty), mask=cols & (real & ((d * 0 + length) > 0))[:, None])


def causal_conv1d_short(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
    has_initial_state: torch.Tensor, cu_seqlens: torch.Tensor, counts: torch.Tensor | None = None,
    spec_conv_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU(causal conv) of a few new inputs per packed sequence (cu_seqlens), each sequence
    continuing from its conv state (zeros where has_initial_state is 0) and leaving its last
    K - 1 inputs there. With ``counts``, sequence i also leaves its window after each of its
    first counts[i] inputs in spec_conv_states[slots[i], :counts[i]] ([slots, k, D, K - 1]).
    x: [T, D]; weight: [D, K]; conv_states: [slots, D, K - 1]; slot -1: a padding sequence
    (output zeros, nothing written). One program per (sequence, block of channels), a loop
    over the sequence's inputs: for steps of a few tokens per sequence."""
    num_tokens, dim = x.shape
    width = weight.shape[1]
    _check_conv_shapes(x, weight, conv_states)
    num_seqs = cu_seqlens.shape[0] - 1
    _check_per_sequence(slots, has_initial_state, num_seqs)
    has_spec = counts is not None
    if has_spec and (spec_conv_states is None or spec_conv_states.shape[0] != conv_states.shape[0]
                     or spec_conv_states.shape[2:] != conv_states.shape[1:] or spec_conv_states.stride(3) != 1):
        raise ValueError(f"spec_conv_states must be [{conv_states.shape[0]}, k, {dim}, {width - 1}], contiguous along "
                         f"the kernel width, got {None if spec_conv_states is None else tuple(spec_conv_states.shape)}")
    out = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device)
    spec = spec_conv_states if has_spec else conv_states  # (never read without HAS_SPEC)
    block_d = 256 if x.is_cuda else 32
    _conv_short_kernel[(num_seqs, triton.cdiv(dim, block_d))](
        x, weight, conv_states, slots, has_initial_state, cu_seqlens, counts if has_spec else slots, spec, out,
        dim, x.stride(0), out.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1),
        spec.stride(0), spec.stride(1) if has_spec else 0, spec.stride(2) if has_spec else 0,
        K=width, BLOCK_K=triton.next_power_of_2(width), BLOCK_D=block_d, HAS_SPEC=has_spec,
    )
    return out


@triton.jit
def _recurrent_short_kernel(
    q_ptr,  # [T, Hk, dk] (raw: normalised here)
    k_ptr,  # [T, Hk, dk] (raw)
    v_ptr,  # [T, Hv, dv]
    g_ptr,  # [T, Hv] float32, log decay
    beta_ptr,  # [T, Hv] float32
    state_ptr,  # [slots, Hv, dk, dv] float32: each sequence's state, replaced by the one after its tokens
    slot_ptr,  # [num_seqs]: each sequence's state slot, -1 for padding
    init_ptr,  # [num_seqs]: 1 to continue from the slot's state, 0 to start from zeros
    cu_ptr,  # [num_seqs + 1]: where each sequence starts
    count_ptr,  # [num_seqs]: how many states to keep (with HAS_SPEC)
    spec_ptr,  # [slots, k, Hv, dk, dv] float32: entry j the state after the sequence's token j (with HAS_SPEC)
    out_ptr,  # [T, Hv, dv]
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ot, stride_oh, stride_ss, stride_sh, stride_sk, stride_ps, stride_pj, stride_ph, stride_pk,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_SPEC: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BK)
    slot = tl.load(slot_ptr + n)
    keep = tl.load(init_ptr + n) != 0
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    count = tl.load(count_ptr + n)  # (without HAS_SPEC: any valid pointer, unused)
    km, vm = rows < DK, cols < DV
    real = (cols * 0 + slot) >= 0  # [BV]: slot -1, a padding sequence
    sm = km[:, None] & (vm & real)[None, :]  # what this program may read and write of a state
    slot = tl.maximum(slot, 0).to(tl.int64)
    hk = h // GROUP
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + rows[:, None] * stride_sk + cols[None, :]
    p_ptrs = spec_ptr + slot * stride_ps + h * stride_ph + rows[:, None] * stride_pk + cols[None, :]
    state = tl.where(keep, tl.load(s_ptrs, mask=sm, other=0.0), 0.0)
    for t in range(bos, eos):  # the decode step's update, one token at a time
        q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + rows, mask=km, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + rows, mask=km, other=0.0).to(tl.float32)
        q = _l2_normalize(q) * scale
        k = _l2_normalize(k)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + cols, mask=vm, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + h)
        beta = tl.load(beta_ptr + t * stride_bt + h)
        state = _gated_delta_update(state, k, v, g, beta)
        out = tl.where(real, tl.sum(state * q[:, None], axis=0), 0.0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, out.to(out_ptr.dtype.element_ty), mask=vm)
        if HAS_SPEC:
            tl.store(p_ptrs + (t - bos) * stride_pj, state, mask=sm & ((rows * 0 + (t - bos)) < count)[:, None])
    tl.store(s_ptrs, state, mask=sm & ((rows * 0 + eos) > bos)[:, None])


def recurrent_gated_delta_short(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
    counts: torch.Tensor | None = None, spec_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule over a few tokens per packed sequence (cu_seqlens), token by
    token as a decode step computes it: each sequence starts from its slot's state (zeros
    where has_initial_state is 0) and leaves its final state there. With ``counts``,
    sequence i also leaves its state after each of its first counts[i] tokens in
    spec_states[slots[i], :counts[i]] ([slots, k, Hv, dk, dv] float32). q, k: [T, Hk, dk]
    (raw); v: [T, Hv, dv]; g, beta: [T, Hv] float32; states: [slots, Hv, dk, dv] float32;
    slot -1: a padding sequence (output zeros, nothing written). Returns [T, Hv, dv] in v's
    dtype."""
    _, num_k_heads, num_v_heads, dk, dv = _check_rule_shapes(q, k, v, g, beta, states)
    num_seqs = cu_seqlens.shape[0] - 1
    _check_per_sequence(slots, has_initial_state, num_seqs)
    has_spec = counts is not None
    if has_spec:
        _check_spec_states(spec_states, states)
    out = torch.empty_like(v)
    spec = spec_states if has_spec else states  # (never read without HAS_SPEC)
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), 32 if q.is_cuda else 16)
    _recurrent_short_kernel[(num_seqs, num_v_heads, triton.cdiv(dv, bv))](
        q, k, v, g, beta, states, slots, has_initial_state, cu_seqlens, counts if has_spec else slots, spec, out,
        dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), states.stride(0), states.stride(1), states.stride(2),
        spec.stride(0), spec.stride(1) if has_spec else 0, spec.stride(2) if has_spec else 0,
        spec.stride(3) if has_spec else 0,
        DK=dk, DV=dv, GROUP=num_v_heads // num_k_heads, BK=bk, BV=bv, HAS_SPEC=has_spec,
    )
    return out


# -- prefill ----------------------------------------------------------------------------


@triton.jit(do_not_specialize=["MAX_CHUNKS"])
def _chunk_prepare_kernel(
    k_ptr,  # [T, Hk, dk] (raw)
    v_ptr,  # [T, Hv, dv]
    g_ptr,  # [T, Hv] float32, log decay
    beta_ptr,  # [T, Hv] float32
    cu_ptr,  # [num_seqs + 1]: where each sequence starts
    w_ptr,  # [T, Hv, dk] float32, written
    u_ptr,  # [T, Hv, dv] float32, written
    gamma_ptr,  # [T, Hv] float32, written: cumulative log decay within the chunk
    MAX_CHUNKS,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_wt, stride_wh, stride_ut, stride_uh, stride_gmt,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0) // MAX_CHUNKS
    chunk = tl.program_id(0) % MAX_CHUNKS
    h = tl.program_id(1)
    bos = tl.load(cu_ptr + seq)
    eos = tl.load(cu_ptr + seq + 1)
    start = bos + chunk * C
    if start < eos:
        t = start + tl.arange(0, C)
        tm = t < eos
        i = tl.arange(0, C)
        dk = tl.arange(0, BK)
        dv = tl.arange(0, BV)
        hk = h // GROUP
        k = tl.load(k_ptr + t[:, None] * stride_kt + hk * stride_kh + dk[None, :],
                    mask=tm[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float32)
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        g = tl.load(g_ptr + t * stride_gt + h, mask=tm, other=0.0)
        beta = tl.load(beta_ptr + t * stride_bt + h, mask=tm, other=0.0)
        gamma = tl.cumsum(g, axis=0)
        below = i[:, None] > i[None, :]
        decay = tl.exp(tl.where(below, gamma[:, None] - gamma[None, :], float("-inf")))
        a = tl.dot(k, tl.trans(k), input_precision=PRECISION) * decay * beta[:, None]
        # (I + A)^-1 by forward substitution: row i of the inverse is e_i minus A's row i
        # times the rows above it, which are final by then.
        inv = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
        for r in range(1, C):
            a_r = tl.sum(tl.where(i[:, None] == r, a, 0.0), axis=0)  # A[r, :], zero from r on
            row = tl.sum(a_r[:, None] * inv, axis=0)
            inv = tl.where(i[:, None] == r, tl.where(i[None, :] == r, 1.0, 0.0) - row[None, :], inv)
        kb = k * (beta * tl.exp(gamma))[:, None]
        w = tl.dot(inv, kb, input_precision=PRECISION)
        tl.store(w_ptr + t[:, None] * stride_wt + h * stride_wh + dk[None, :], w, mask=tm[:, None] & (dk[None, :] < DK))
        vm = tm[:, None] & (dv[None, :] < DV)
        v = tl.load(v_ptr + t[:, None] * stride_vt + h * stride_vh + dv[None, :], mask=vm, other=0.0).to(tl.float32)
        u = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)
        tl.store(u_ptr + t[:, None] * stride_ut + h * stride_uh + dv[None, :], u, mask=vm)
        tl.store(gamma_ptr + t * stride_gmt + h, gamma, mask=tm)


@triton.jit
def _chunk_scan_kernel(
    q_ptr,  # [T, Hk, dk] (raw)
    k_ptr,  # [T, Hk, dk] (raw)
    w_ptr,  # [T, Hv, dk] float32, from _chunk_prepare_kernel
    u_ptr,  # [T, Hv, dv] float32, from _chunk_prepare_kernel
    gamma_ptr,  # [T, Hv] float32, from _chunk_prepare_kernel
    cu_ptr,  # [num_seqs + 1]: where each sequence starts
    state_ptr,  # [slots, Hv, dk, dv] float32 (read only with HAS_POOL)
    slot_ptr,  # [num_seqs]: each sequence's state slot (with HAS_POOL)
    init_ptr,  # [num_seqs]: 1 to continue from the slot's state, 0 to start from zeros (with HAS_POOL)
    out_ptr,  # [T, Hv, dv]
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_wt, stride_wh, stride_ut, stride_uh, stride_gmt,
    stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_POOL: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    dk = tl.arange(0, BK)
    i = tl.arange(0, C)
    hk = h // GROUP
    bos = tl.load(cu_ptr + seq)
    eos = tl.load(cu_ptr + seq + 1)
    sm = (dk[:, None] < DK) & (cols[None, :] < DV)
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_POOL:
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * stride_sk + cols[None, :]
        if tl.load(init_ptr + seq) != 0:
            state = tl.load(s_ptrs, mask=sm, other=0.0)
    causal = i[:, None] >= i[None, :]
    for start in range(bos, eos, C):
        t = start + i
        tm = t < eos
        km = tm[:, None] & (dk[None, :] < DK)
        vm = tm[:, None] & (cols[None, :] < DV)
        q = tl.load(q_ptr + t[:, None] * stride_qt + hk * stride_qh + dk[None, :], mask=km, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t[:, None] * stride_kt + hk * stride_kh + dk[None, :], mask=km, other=0.0).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * scale)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        gamma = tl.load(gamma_ptr + t * stride_gmt + h, mask=tm, other=0.0)
        w = tl.load(w_ptr + t[:, None] * stride_wt + h * stride_wh + dk[None, :], mask=km, other=0.0)
        u = tl.load(u_ptr + t[:, None] * stride_ut + h * stride_uh + cols[None, :], mask=vm, other=0.0)
        v_new = u - tl.dot(w, state, input_precision=PRECISION)
        # Rows past the sequence's end (gamma 0 there) would overflow: mask them too.
        decay = tl.exp(tl.where(causal & tm[:, None], gamma[:, None] - gamma[None, :], float("-inf")))
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        out = tl.dot(q * tl.exp(gamma)[:, None], state, input_precision=PRECISION)
        out += tl.dot(scores, v_new, input_precision=PRECISION)
        tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=vm)
        last = tl.sum(tl.where(i == tl.minimum(eos - start, C) - 1, gamma, 0.0))
        k_to_end = tl.where(tm[:, None], k * tl.exp(last - gamma)[:, None], 0.0)
        state = state * tl.exp(last) + tl.dot(tl.trans(k_to_end), v_new, input_precision=PRECISION)
    if HAS_POOL:
        tl.store(s_ptrs, state, mask=sm)


def chunk_gated_delta_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor | None, slots: torch.Tensor | None, has_initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor, max_seqlen: int,
) -> torch.Tensor:
    """The chunked form over packed sequences (cu_seqlens, [num_seqs + 1]). q, k: [T, Hk, dk]
    (raw); v: [T, Hv, dv]; g, beta: [T, Hv] float32. With ``states`` each sequence starts
    from its slot's state where has_initial_state says so (zeros otherwise) and leaves its
    final state there; without, every sequence starts from zeros and nothing is kept.
    Returns [T, Hv, dv] in v's dtype."""
    num_tokens, num_k_heads, num_v_heads, dk, dv = _check_rule_shapes(q, k, v, g, beta, states)
    num_seqs = cu_seqlens.shape[0] - 1
    if dk & (dk - 1) or dk < 16 or dv < 16:
        raise ValueError(f"the chunked kernel needs a power-of-two key dim >= 16 and a value dim >= 16, got {dk}, {dv}")
    dev, f32 = q.device, torch.float32
    w = torch.empty(num_tokens, num_v_heads, dk, device=dev, dtype=f32)
    u = torch.empty(num_tokens, num_v_heads, dv, device=dev, dtype=f32)
    gamma = torch.empty(num_tokens, num_v_heads, device=dev, dtype=f32)
    out = torch.empty_like(v)
    precision = dot_precision(v.dtype)
    group = num_v_heads // num_k_heads
    max_chunks = triton.cdiv(max_seqlen, CHUNK_SIZE)
    bv_all = triton.next_power_of_2(dv)
    _chunk_prepare_kernel[(num_seqs * max_chunks, num_v_heads)](
        k, v, g, beta, cu_seqlens, w, u, gamma, max_chunks,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), gamma.stride(0),
        DK=dk, DV=dv, GROUP=group, C=CHUNK_SIZE, BK=dk, BV=bv_all, PRECISION=precision,
        num_stages=1,  # nothing to pipeline, and [64 x 128] float32 tiles fill shared memory
    )
    bv = min(bv_all, 32 if q.is_cuda else 16)
    has_pool = states is not None and slots is not None
    dummy = gamma  # any tensor: never read without a pool
    _chunk_scan_kernel[(num_seqs, num_v_heads, triton.cdiv(dv, bv))](
        q, k, w, u, gamma, cu_seqlens, states if has_pool else dummy, slots if has_pool else dummy,
        has_initial_state if has_pool else dummy, out, dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        gamma.stride(0), out.stride(0), out.stride(1),
        states.stride(0) if has_pool else 0, states.stride(1) if has_pool else 0, states.stride(2) if has_pool else 0,
        DK=dk, DV=dv, GROUP=group, C=CHUNK_SIZE, BK=dk, BV=bv, HAS_POOL=has_pool, PRECISION=precision,
        num_stages=1,  # pipelining the chunk loop's loads would need more than 228 KB of shared memory
    )
    return out
