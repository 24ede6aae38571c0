"""CUDA graphs of a pass over a padded batch of short sequences (chapter 19).

A graph replays fixed kernels on fixed addresses, so a pass that is captured once per batch
size must read everything about the step from static buffers. This is the shape of the
model runner's verifying steps under speculative decoding (each sequence its last token and
up to k drafts): up to ``batch size`` sequences, each computing at most ``query_len``
tokens. (A draft model captures its whole proposal instead: ``spec_decode.proposal``.)

Replaying, the step's tokens are packed as an eager step's are (``cu_seqlens_q``) and
padded to batch size x query_len rows. The sequences past the real batch have no queries
and no keys (their ``cu_seqlens_q`` entries repeat the last one, their context length is
0); the padding rows store nothing (slot -1) and what is computed for them is dropped. The
buffers have the dtypes of an eager step's fields (int64), so a graph runs the kernels an
eager pass would.

A hybrid model's Gated DeltaNet layers also read each sequence's state slot, whether it
continues from it, and how many states it keeps for a rollback (``Context.state_slots``,
``has_initial_state``, ``spec_state_counts``): with ``state_slots=True`` those are static
buffers too, and the padding sequences have slot -1, which the short-step kernels that such
a step runs (``minivllm.kernels.gated_delta``) neither read nor write.
"""
from __future__ import annotations

from typing import Callable

import torch

from minivllm.context import Context, get_context, reset_context, set_context


# The Context's fields of a hybrid model's state slots, static under ``state_slots=True``.
STATE_FIELDS = ("state_slots", "has_initial_state", "spec_state_counts")


class PaddedGraphs:
    """One captured ``forward(input_ids, positions)`` per size in ``sizes`` (ascending), for
    steps in which each sequence computes at most ``query_len`` tokens (1: a decode pass,
    on the decode kernels; more: a prefill pass, on the prefill kernels)."""

    def __init__(self, sizes: list[int], query_len: int, max_blocks: int, device: torch.device,
                 state_slots: bool = False):
        self.sizes, self.query_len, self.state_slots = sizes, query_len, state_slots
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = dict.fromkeys(sizes, 0)  # how often each graph ran
        rows, top, i64 = sizes[-1] * query_len, sizes[-1], torch.int64
        self.static = {
            "input_ids": torch.zeros(rows, dtype=i64, device=device),
            "positions": torch.zeros(rows, dtype=i64, device=device),
            "slot_mapping": torch.full((rows,), -1, dtype=i64, device=device),
            "context_lens": torch.zeros(top, dtype=i64, device=device),
            "block_tables": torch.zeros(top, max_blocks, dtype=i64, device=device),
            "cu_seqlens_q": torch.zeros(top + 1, dtype=i64, device=device),
        }
        if state_slots:  # (padding sequences: slot -1, from zeros, nothing kept)
            self.static |= {"state_slots": torch.full((top,), -1, dtype=i64, device=device),
                            "has_initial_state": torch.zeros(top, dtype=i64, device=device),
                            "spec_state_counts": torch.zeros(top, dtype=i64, device=device)}
        self.out: torch.Tensor | None = None  # what forward returns, for the largest size

    def capture(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], max_context_len: int,
                pool=None):
        """Capture every size, largest first, in the memory ``pool`` (None: a new one);
        return the pool. Each pass runs once before its capture (Triton compiles there).
        ``max_context_len``: the longest context a replay may see (a decode pass sizes
        its attention grid for it)."""
        s, q = self.static, self.query_len
        for bs in reversed(self.sizes):
            s["cu_seqlens_q"][: bs + 1] = torch.arange(bs + 1, device=s["cu_seqlens_q"].device) * q
            s["context_lens"][:bs] = q
            rows = bs * q
            states = {name: s[name][:bs] for name in STATE_FIELDS} if self.state_slots else {}
            set_context(is_prefill=q > 1, cu_seqlens_q=s["cu_seqlens_q"][: bs + 1], slot_mapping=s["slot_mapping"][:rows],
                        context_lens=s["context_lens"][:bs], block_tables=s["block_tables"][:bs], max_seqlen_q=q,
                        max_context_len=max_context_len, **states)
            try:
                out = forward(s["input_ids"][:rows], s["positions"][:rows])
                if self.out is None:
                    self.out = torch.empty_like(out)
                self.out[: out.shape[0]] = out
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.out[: out.shape[0]] = forward(s["input_ids"][:rows], s["positions"][:rows])
                torch.cuda.synchronize()
            finally:
                reset_context()
            self.graphs[bs] = graph
            pool = pool or graph.pool()
        return pool

    def serves(self, ctx: Context) -> bool:
        """Does the step whose Context is ``ctx`` fit one of the graphs?"""
        return (bool(self.graphs) and ctx.is_prefill == (self.query_len > 1) and ctx.max_seqlen_q <= self.query_len
                and ctx.cu_seqlens_q.shape[0] - 1 <= self.sizes[-1])

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the step whose Context is set (``serves`` said yes) in the smallest graph
        that holds it; return forward's output for the padded batch (the caller keeps the
        rows it needs; the next replay overwrites them)."""
        ctx, s, q = get_context(), self.static, self.query_len
        n, num_seqs = input_ids.shape[0], ctx.cu_seqlens_q.shape[0] - 1
        bs = next(size for size in self.sizes if size >= num_seqs)
        s["input_ids"][:n] = input_ids
        s["positions"][:n] = positions
        s["slot_mapping"][:n] = ctx.slot_mapping
        s["slot_mapping"][n : bs * q].fill_(-1)  # padding rows store nothing
        s["context_lens"][:num_seqs] = ctx.context_lens
        s["context_lens"][num_seqs:bs].fill_(0)
        s["cu_seqlens_q"][: num_seqs + 1] = ctx.cu_seqlens_q
        s["cu_seqlens_q"][num_seqs + 1 : bs + 1] = ctx.cu_seqlens_q[-1]  # padding sequences: no queries
        s["block_tables"][:num_seqs, : ctx.block_tables.shape[1]] = ctx.block_tables
        if self.state_slots:
            for name, pad in zip(STATE_FIELDS, (-1, 0, 0)):
                src = getattr(ctx, name)
                if src is None:  # spec_state_counts in a step that verifies nothing
                    s[name][:num_seqs].fill_(pad)
                else:
                    s[name][:num_seqs] = src
                s[name][num_seqs:bs].fill_(pad)
        self.graphs[bs].replay()
        self.replays[bs] += 1
        return self.out

    def clear(self) -> None:
        self.graphs.clear()
        self.static, self.out = {}, None
