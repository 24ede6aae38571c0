"""The attention metadata of one forward step, shared by every attention layer.

The model runner fills it before a forward pass and clears it after, so a model's
``forward(input_ids, positions)`` never has to thread batch bookkeeping through its
signature. Tokens of all sequences in a step are packed into one flat batch; these
fields say where each sequence starts and where its keys and values live.
"""
from dataclasses import dataclass

import torch


@dataclass
class Context:
    # Is this step a prefill (many tokens per sequence) or a decode (one per sequence)?
    is_prefill: bool = True
    # Cumulative query lengths, shape [num_seqs + 1]: sequence i owns tokens
    # cu_seqlens_q[i]:cu_seqlens_q[i+1] of the flat batch. None means one sequence.
    cu_seqlens_q: torch.Tensor | None = None
    # Where each new token's K/V is written in the cache (flat slot index), shape [num_tokens].
    # None means there is no cache: attend over this step's tokens only.
    slot_mapping: torch.Tensor | None = None
    # Tokens each sequence has in the cache after this step, shape [num_seqs].
    context_lens: torch.Tensor | None = None
    # Which cache blocks each sequence owns, shape [num_seqs, max_blocks], padded with -1.
    block_tables: torch.Tensor | None = None
    # Which rows of the flat batch get next-token logits, shape [num_logits]: the last token
    # of each sequence that samples this step. None: every sequence's last token.
    logits_indices: torch.Tensor | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs): rows of the flat batch whose logits
    # score the prompt token that follows them, and those tokens, shape [num_prompt_logits]
    # each (None: no such row); how many most likely alternatives to report for each.
    prompt_logits_indices: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    prompt_top_k: int = 0
    # Host-side bounds that size kernel launch grids without a device sync.
    max_seqlen_q: int = 0
    max_context_len: int = 0
    # Does every sequence of the step start at position 0 (prompts from scratch: no cached
    # keys, no decode rows)? The prefill kernel then reads only the step's own keys.
    from_scratch: bool = False
    # Hybrid models (Gated DeltaNet layers keep a fixed-size state per sequence instead of
    # K/V): each sequence's state slot, shape [num_seqs] (-1 marks a padding row), and
    # whether it continues from that slot's state (1) or starts from zeros (0, first chunk).
    state_slots: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    # Speculative decoding on a hybrid model: how many drafts each sequence verifies, shape
    # [num_seqs] (None: nobody verifies). A linear-attention layer keeps its state after each
    # of a verifying sequence's first that-many tokens (``GatedDeltaNet.spec_*_states``), so
    # that the engine can take the one after the last accepted token.
    spec_state_counts: torch.Tensor | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(**fields) -> Context:
    global _CONTEXT
    _CONTEXT = Context(**fields)
    return _CONTEXT


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()
