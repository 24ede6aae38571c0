"""A proposer's own paged KV cache: what a draft model and an MTP head keep per sequence.

A proposer with attention layers of its own (a draft model, ``minivllm.spec_decode.draft``;
an MTP head, ``minivllm.spec_decode.mtp``) caches their keys and values as the target does:
in blocks of the engine's block size, one block of the proposer's pool beside each block of
the target's (so the engine's KV budget pays for both), a block table per sequence. Its
passes run on the same attention ops as the target's, through the Context, with their own
block tables and slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from minivllm.context import set_context
from minivllm.layers.attention import Attention

if TYPE_CHECKING:
    from minivllm.spec_decode.sequence import Sequence

def hand_out_drafts(tokens: list[torch.Tensor], rows: list[tuple], drafts: list[list[int]]) -> None:
    """Append each drafting round's tokens to the drafts of the rows it ran, in one copy to
    the host for all rounds: round j's tensor holds a token for the first len(tokens[j]) of
    ``rows`` (those still drafting), and a row's first field is its index in ``drafts``."""
    host = torch.cat(tokens).tolist()
    offset = 0
    for t in tokens:
        for row, token in zip(rows, host[offset : offset + len(t)]):
            drafts[row[0]].append(token)
        offset += len(t)


# Each field of a pass's metadata starts at a multiple of this many int64s (128 bytes).
FIELD_ALIGN = 16


@dataclass
class CacheState:
    """What the proposer holds for one sequence: its blocks, and how many of its first
    positions have their keys and values there."""

    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0


class DraftCache:
    """The pool, the free list and the block tables; ``pass_context`` sets the Context of a
    pass over some sequences' positions."""

    def __init__(self, layers: list[Attention], block_size: int, dtype: torch.dtype, device: torch.device):
        self.layers, self.block_size, self.dtype, self.device = layers, block_size, dtype, device
        first = layers[0]
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = 2 * len(layers) * block_size * first.num_kv_heads * first.head_dim * itemsize
        self.states: dict[int, CacheState] = {}  # seq_id -> its cache
        self.free_blocks: list[int] = []
        self.num_blocks = 0
        self.kv: torch.Tensor | None = None

    def allocate(self, num_blocks: int, runner=None) -> None:
        """The pool: [2 (k, v), layers, num_blocks, block_size, kv_heads, head_dim], every
        block free (what a previous pool held is forgotten). (``runner``, the target's model
        runner, is for proposers that read the target's model.)"""
        first = self.layers[0]
        self.kv = torch.empty(2, len(self.layers), num_blocks, self.block_size, first.num_kv_heads, first.head_dim,
                              dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = self.kv[0, i], self.kv[1, i]
        self.num_blocks, self.states = num_blocks, {}
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0 first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def forget(self, seq: Sequence) -> None:
        state = self.states.pop(seq.seq_id, None)
        if state is not None:
            self.free_blocks.extend(reversed(state.block_table))

    def _fit(self, state: CacheState, num_positions: int) -> bool:
        """Give ``state`` exactly the blocks for ``num_positions`` positions; False (and no
        change) if the pool has too few free."""
        need = -(-num_positions // self.block_size)
        if need - len(state.block_table) > len(self.free_blocks):
            return False
        while len(state.block_table) > need:
            self.free_blocks.append(state.block_table.pop())
        while len(state.block_table) < need:
            state.block_table.append(self.free_blocks.pop())
        return True

    def pass_context(self, states: list[CacheState], starts: list[int], lengths: list[int],
                     *extra: list[int]) -> list[torch.Tensor]:
        """Set the Context of a pass in which row i computes ``lengths[i]`` positions from
        ``starts[i]`` of its sequence, storing their keys and values in its blocks. Returns
        the positions (device), one per token of the flat batch, and each of ``extra`` (more
        int lists the pass needs) on the device, all in one copy."""
        bs = self.block_size
        positions, slots, cu = [], [], [0]
        for state, start, n in zip(states, starts, lengths):
            for p in range(start, start + n):
                positions.append(p)
                slots.append(state.block_table[p // bs] * bs + p % bs)
            cu.append(cu[-1] + n)
        context_lens = [s + n for s, n in zip(starts, lengths)]
        width = max(len(s.block_table) for s in states)
        tables = [b for s in states for b in s.block_table + [-1] * (width - len(s.block_table))]
        positions, slots, context_lens_d, cu_d, tables_d, *extra = self._upload(
            [positions, slots, context_lens, cu, tables, *extra])
        set_context(is_prefill=max(lengths) > 1, cu_seqlens_q=cu_d, slot_mapping=slots, context_lens=context_lens_d,
                    block_tables=tables_d.view(len(states), width), max_seqlen_q=max(lengths),
                    max_context_len=max(context_lens))
        return [positions, *extra]

    def _upload(self, fields: list[list[int]]) -> list[torch.Tensor]:
        """A pass's metadata in one host-to-device copy, cut into views, each starting on a
        FIELD_ALIGN boundary as the model runner's do (Triton compiles a kernel again for a
        pointer whose 16-byte alignment changed)."""
        starts, end = [], 0
        for f in fields:
            starts.append(end)
            end += -(-len(f) // FIELD_ALIGN) * FIELD_ALIGN
        host = np.zeros(end, dtype=np.int64)
        for f, start in zip(fields, starts):
            host[start : start + len(f)] = f
        flat = torch.from_numpy(host).to(self.device)
        return [flat[start : start + len(f)] for f, start in zip(fields, starts)]
