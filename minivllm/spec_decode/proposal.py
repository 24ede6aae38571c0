"""A draft model's whole proposal as one sequence of passes, from one copy of metadata, and
on a GPU one CUDA graph (chapter 19).

A proposal for k drafts is a catch-up pass (each sequence feeds what it gained since its
last proposal: its accepted drafts and the target's token, at most k + 1 tokens; the
argmax after its last is draft 1) then k - 1 decode passes (pass j feeds draft j at its
position; the argmax is draft j + 1). Everything those passes read about the sequences is
known before the first runs: every pass's positions, slots and context lengths follow from
the sequence's length and block table. So it all goes to the device in one copy, and the
passes feed each other on the device. A draft this small is all launches and host work:
run pass by pass, the bundled draft's proposal took 1.5 ms of a 3.0 ms step at batch 1 on
the H200, with each pass's own metadata copy, Context and graph replay.

``ProposalLayout`` is where each field sits in the one int64 array; ``run_passes`` runs the
passes on the views of it (eagerly, or while a graph is captured); ``ProposalGraphs``
captures them per decode batch size, padded: the rows past the real batch feed nothing,
store nothing and attend to nothing, and so do a real row's decode passes past its own k
(its slot -1, its context 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from minivllm.context import reset_context, set_context

# Each field of the array starts at a multiple of this many int64s (128 bytes), as the model
# runner's do: Triton compiles a kernel again for a pointer whose 16-byte alignment changed.
FIELD_ALIGN = 16


@dataclass(frozen=True)
class ProposalLayout:
    """The fields of a proposal over ``rows`` sequences that feed ``tokens`` tokens in all
    at the catch-up, with block tables ``width`` wide, for ``k`` drafts each at most."""

    rows: int
    tokens: int
    width: int
    k: int

    def sizes(self) -> dict[str, tuple[int, ...]]:
        r, d = self.rows, self.k - 1
        return {"ids": (self.tokens,), "positions": (self.tokens,), "slots": (self.tokens,),
                "cu_seqlens_q": (r + 1,), "context_lens": (r,), "block_tables": (r, self.width),
                "decode_positions": (d, r), "decode_slots": (d, r), "decode_context_lens": (d, r),
                "decode_cu_seqlens_q": (r + 1,)}

    def offsets(self) -> tuple[dict[str, int], int]:
        starts, end = {}, 0
        for name, shape in self.sizes().items():
            starts[name] = end
            end += -(-int(np.prod(shape)) // FIELD_ALIGN) * FIELD_ALIGN
        return starts, end

    def views(self, flat):
        """Each field as a view of ``flat`` (a numpy array or a tensor), in its shape."""
        starts, _ = self.offsets()
        return {name: flat[starts[name] : starts[name] + int(np.prod(shape))].reshape(shape)
                for name, shape in self.sizes().items()}


def fill_host(layout: ProposalLayout, rows: list[tuple[list[int], int, list[int], int]], block_size: int) -> np.ndarray:
    """The proposal's metadata on the host. Each of ``rows`` is (the tokens the row feeds at
    the catch-up, the position of the first, its block table, its k), the first
    ``len(rows)`` rows of the layout; the layout's other rows are padding."""
    host = np.zeros(layout.offsets()[1], dtype=np.int64)
    v = layout.views(host)
    v["slots"][:] = -1
    v["decode_slots"][:] = -1
    v["decode_cu_seqlens_q"][:] = np.arange(layout.rows + 1)
    v["block_tables"][:] = -1
    end = 0
    for r, (ids, start, table, k) in enumerate(rows):
        n = len(ids)
        positions = np.arange(start, start + n)
        blocks = np.asarray(table, dtype=np.int64)
        v["ids"][end : end + n] = ids
        v["positions"][end : end + n] = positions
        v["slots"][end : end + n] = blocks[positions // block_size] * block_size + positions % block_size
        end += n
        v["cu_seqlens_q"][r + 1] = end
        v["context_lens"][r] = start + n
        v["block_tables"][r, : len(table)] = table
        for j in range(1, k):  # decode pass j feeds draft j at position start + n + j - 1
            p = start + n + j - 1
            v["decode_positions"][j - 1, r] = p
            v["decode_slots"][j - 1, r] = table[p // block_size] * block_size + p % block_size
            v["decode_context_lens"][j - 1, r] = p + 1
    v["cu_seqlens_q"][len(rows) + 1 :] = end  # padding rows: no queries
    v["block_tables"][len(rows) :] = 0  # (read by nobody: their context is 0)
    return host


def run_passes(next_tokens: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], v: dict, layout: ProposalLayout,
               out: torch.Tensor, max_seqlen_q: int, max_context_len: int, active: list[int] | None = None) -> None:
    """The proposal's passes on the device views ``v``: out[j, r] is draft j + 1 of row r.
    ``max_seqlen_q``: the most tokens a row feeds at the catch-up; ``max_context_len``: the
    longest context. ``active[j]``: how many rows (a prefix) decode pass j runs, eagerly
    (None: all, as a graph runs them, the rest masked by their metadata)."""
    k = layout.k
    set_context(is_prefill=True, cu_seqlens_q=v["cu_seqlens_q"], slot_mapping=v["slots"],
                context_lens=v["context_lens"], block_tables=v["block_tables"],
                max_seqlen_q=max_seqlen_q, max_context_len=max_context_len)
    try:
        out[0] = next_tokens(v["ids"], v["positions"])
    finally:
        reset_context()
    for j in range(1, k):
        n = layout.rows if active is None else active[j]
        if n == 0:
            break
        set_context(is_prefill=False, cu_seqlens_q=v["decode_cu_seqlens_q"][: n + 1],
                    slot_mapping=v["decode_slots"][j - 1, :n], context_lens=v["decode_context_lens"][j - 1, :n],
                    block_tables=v["block_tables"][:n], max_seqlen_q=1, max_context_len=max_context_len)
        try:
            out[j, :n] = next_tokens(out[j - 1, :n], v["decode_positions"][j - 1, :n])
        finally:
            reset_context()


class ProposalGraphs:
    """A captured proposal per batch size in ``sizes`` (ascending), each row feeding at most
    k + 1 tokens at the catch-up."""

    def __init__(self, sizes: list[int], k: int, width: int, device: torch.device):
        self.sizes, self.k, self.width = sizes, k, width
        self.layouts = {bs: ProposalLayout(bs, bs * (k + 1), width, k) for bs in sizes}
        self.static = {bs: torch.zeros(layout.offsets()[1], dtype=torch.int64, device=device)
                       for bs, layout in self.layouts.items()}
        self.out = {bs: torch.zeros(k, bs, dtype=torch.int64, device=device) for bs in sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = dict.fromkeys(sizes, 0)

    def capture(self, next_tokens, max_context_len: int, block_size: int) -> None:
        """Capture every size, largest first, in one memory pool. Each runs once first
        (Triton compiles there), on metadata that stores nothing."""
        pool = None
        for bs in reversed(self.sizes):
            layout = self.layouts[bs]
            dummy = [([0] * (self.k + 1), 0, [0] * self.width, self.k)] * bs
            host = fill_host(layout, dummy, block_size)
            v = layout.views(host)
            v["slots"][:], v["decode_slots"][:] = -1, -1  # store nothing
            self.static[bs].copy_(torch.from_numpy(host))
            views = layout.views(self.static[bs])
            run_passes(next_tokens, views, layout, self.out[bs], self.k + 1, max_context_len)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                run_passes(next_tokens, views, layout, self.out[bs], self.k + 1, max_context_len)
            torch.cuda.synchronize()
            self.graphs[bs] = graph
            pool = pool or graph.pool()

    def size_for(self, num_rows: int) -> int | None:
        return next((bs for bs in self.sizes if bs >= num_rows), None)

    def replay(self, bs: int, host: np.ndarray) -> torch.Tensor:
        """Run the proposal of size ``bs`` on ``host`` (fill_host's, for this size's
        layout); return its drafts [k, bs] (the next replay writes over them)."""
        self.static[bs].copy_(torch.from_numpy(host))
        self.graphs[bs].replay()
        self.replays[bs] += 1
        return self.out[bs]
