"""Draft-model speculation: a small model that shares the target's tokenizer guesses the
next k tokens, one cheap forward pass each; the target verifies them all in one.

A model a tenth of the target's size reads a tenth of its weights per token, so k draft
steps and one verifying step cost little more than one target step, and every accepted
draft is a target decode step saved. Where the n-gram proposer only guesses right when the
text repeats itself, a draft trained on the same text agrees with the target on the easy
tokens of any text (function words, the ends of words, punctuation).

Greedy drafts. The draft takes the argmax at each of its k steps, so its distribution q is
a point mass on the drafted token, and the engine's acceptance rule
(``minivllm.spec_decode.verify``: draw y ~ p from the target, accept the draft iff y equals
it) is exactly Leviathan et al.'s rejection sampling for such a q, for sampled requests as
well as greedy ones. vLLM v1's draft-model and EAGLE proposers draft greedily for the same
reason. (Sampling the drafts from q would need the rule with min(1, p/q) and q's
probabilities kept for the verifier; a point mass needs neither.)

The draft's own KV cache (``minivllm.spec_decode.draft_cache``). Each sequence the draft
has seen keeps a ``DraftState``: a block table into the draft's pool (blocks of the
engine's block size, one draft block per block of the target's pool, so the engine's KV
budget pays for both) and how many of its tokens are cached there. At each proposal the draft first catches up on what the sequence gained
since the last one: the tokens the target accepted and the one it sampled. The drafts fed
at the last proposal left their keys and values behind them; those the target accepted are
kept, and the cache is cut back at the first one it rejected (the rest of its contents are
overwritten later). A sequence that finishes, is aborted or is preempted gives its draft
blocks back (``forget``); one that comes back is prefilled again from its tokens. A
sequence whose draft blocks do not fit in the pool gets no drafts that step (a guess is not
worth taking memory from anyone).

Batched. One step's proposals run as one catch-up forward pass over every sequence's new
tokens (chunked at max_num_batched_tokens, as a prefill is), then k - 1 decode passes of
one token per sequence; the drafts stay on the device until all k are made, so a step costs
two waits for the device whatever k. The passes run on the same attention ops as the
target's, through the Context.

One copy, one graph. When every sequence feeds at most k + 1 tokens at the catch-up (what
it gained in a step: its accepted drafts and the target's token), the whole proposal runs
from one copy of its metadata (``minivllm.spec_decode.proposal``), and where the target
replays CUDA graphs, as one graph per decode batch size. A catch-up with more (a sequence
seen for the first time) runs pass by pass, eagerly. A draft this small is all launches:
on the H200 the bundled draft's three eager passes for k = 3 took 4.9 ms of a 6.0 ms step
at batch 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from minivllm.config import SpeculativeConfig
from minivllm.context import reset_context
from minivllm.layers.attention import attention_layers
from minivllm.layers.gated_deltanet import GatedDeltaNet
from minivllm.loader import load_model
from minivllm.spec_decode.draft_cache import CacheState, DraftCache, hand_out_drafts
from minivllm.spec_decode.proposal import ProposalGraphs, ProposalLayout, fill_host, run_passes

if TYPE_CHECKING:
    from minivllm.config import EngineConfig
    from minivllm.spec_decode.sequence import Sequence

# The draft trained for the bundled model (scripts/train_tiny_model.py), where it is shipped.
BUNDLED_DRAFT = Path(__file__).resolve().parents[1] / "assets" / "draft"


@dataclass
class DraftState(CacheState):
    """What the draft model holds for one sequence: the keys and values of the sequence's
    first ``num_cached`` tokens, and after them those of ``fed_drafts``, the drafts it fed
    itself at its last proposal (valid as far as the target accepted them)."""

    fed_drafts: list[int] = field(default_factory=list)

    def resume_at(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` (the sequence now) the cache already holds: the cached
        ones and the fed drafts up to the first the sequence did not keep. At least one
        token is left to feed: its logits give the first draft."""
        n = self.num_cached
        for t in self.fed_drafts:
            if n >= len(token_ids) or token_ids[n] != t:
                break
            n += 1
        return min(n, len(token_ids) - 1)


class DraftModelProposer(DraftCache):
    """Greedy drafts from a small model with its own paged KV cache (see the module)."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig):
        device = torch.device(config.device)
        self.model = load_model(spec.model, dtype=config.dtype, device=device)
        if any(isinstance(m, GatedDeltaNet) for m in self.model.modules()):
            raise ValueError(f"speculative_config model={spec.model!r} is a hybrid model: its recurrent state "
                             "cannot be cut back past rejected drafts; use a draft with attention layers only")
        super().__init__(attention_layers(self.model), config.block_size, next(self.model.parameters()).dtype, device)
        self.max_tokens_per_forward = config.max_num_batched_tokens
        self.max_positions = self.model.config.max_position_embeddings
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.graphs: ProposalGraphs | None = None  # whole proposals, where the target has graphs

    def allocate(self, num_blocks: int, runner=None) -> None:
        """The pool (DraftCache.allocate), then, where the target ``runner`` replays CUDA
        graphs, a captured proposal per decode batch size (see the module)."""
        super().allocate(num_blocks, runner)
        self.graphs = None
        if runner is None or not runner.graphs:
            return
        k = self.num_speculative_tokens
        sizes = [bs for bs in runner.graph_sizes if bs * (k + 1) <= self.max_tokens_per_forward]
        if sizes:
            self.graphs = ProposalGraphs(sizes, k, -(-runner.max_model_len // self.block_size), self.device)
            with torch.inference_mode():
                self.graphs.capture(self._next_tokens, runner.max_model_len, self.block_size)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """At most ``ks[i]`` greedy drafts to follow each sequence's tokens."""
        drafts: list[list[int]] = [[] for _ in seqs]
        rows = []  # (index in seqs, state, first position to feed, k)
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            length = seq.num_tokens
            # The draft feeds itself drafts 1 .. k - 1, at positions length .. length + k - 2.
            k = min(k, self.max_positions - length + 1)
            if k < 1:
                continue
            state = self.states.setdefault(seq.seq_id, DraftState())
            start = state.resume_at(seq.token_ids)
            state.num_cached, state.fed_drafts = start, []  # what follows is stale: cut back
            if not self._fit(state, length + k - 1):
                continue
            rows.append((i, state, start, k))
        if not rows:
            return drafts
        rows.sort(key=lambda r: -r[3])  # largest k first: each decode pass runs a prefix of the rows
        feeds = [seqs[i].num_tokens - start for i, _, start, _ in rows]
        if max(feeds) <= 1 + self.num_speculative_tokens and sum(feeds) <= self.max_tokens_per_forward:
            tokens = self._propose_at_once(seqs, rows)
        else:
            first = self._catch_up(seqs, rows)
            tokens = [first]  # tokens[j][r]: draft j + 1 of row r (rows with k > j)
            for j in range(1, rows[0][3]):
                n = sum(1 for r in rows if r[3] > j)
                states = [r[1] for r in rows[:n]]
                positions = [seqs[i].num_tokens + j - 1 for i, _, _, _ in rows[:n]]
                tokens.append(self._forward(states, positions, [1] * n, tokens[-1][:n]))
        hand_out_drafts(tokens, rows, drafts)
        for i, state, _, k in rows:
            state.num_cached = seqs[i].num_tokens
            state.fed_drafts = drafts[i][: k - 1]
        return drafts

    def _propose_at_once(self, seqs: list[Sequence], rows: list[tuple]) -> list[torch.Tensor]:
        """Every row's drafts from one copy of metadata (minivllm.spec_decode.proposal): in
        a captured graph where one holds the rows, else pass by pass. Returns round j's
        tokens for the rows still drafting in it, as ``hand_out_drafts`` takes them."""
        k = rows[0][3]
        feeds = [(seqs[i].token_ids[start:], start, state.block_table, rk) for i, state, start, rk in rows]
        active = [sum(1 for r in rows if r[3] > j) for j in range(k)]
        bs = self.graphs.size_for(len(rows)) if self.graphs is not None else None
        if bs is not None:
            out = self.graphs.replay(bs, fill_host(self.graphs.layouts[bs], feeds, self.block_size))
        else:
            layout = ProposalLayout(len(rows), sum(len(f[0]) for f in feeds), max(len(f[2]) for f in feeds), k)
            views = layout.views(torch.from_numpy(fill_host(layout, feeds, self.block_size)).to(self.device))
            out = torch.empty(k, len(rows), dtype=torch.long, device=self.device)
            run_passes(self._next_tokens, views, layout, out, max(len(f[0]) for f in feeds),
                       max(seqs[i].num_tokens for i, _, _, _ in rows) + k, active)
        return [out[j, : active[j]] for j in range(k)]

    def _catch_up(self, seqs: list[Sequence], rows: list[tuple]) -> torch.Tensor:
        """Feed each row's sequence its tokens from the row's start; return the first draft
        of each row (on the device). A pass takes at most max_num_batched_tokens tokens, so
        long catch-ups (a sequence seen for the first time) take several."""
        first = torch.empty(len(rows), dtype=torch.long, device=self.device)
        done = [r[2] for r in rows]  # each row's next position to feed
        while True:
            budget, batch = self.max_tokens_per_forward, []
            for r, (i, _, _, _) in enumerate(rows):
                n = min(seqs[i].num_tokens - done[r], budget)
                if n > 0:
                    batch.append((r, n))
                    budget -= n
                if budget == 0:
                    break
            if not batch:
                return first
            ids = [t for r, n in batch for t in seqs[rows[r][0]].token_ids[done[r] : done[r] + n]]
            out = self._forward([rows[r][1] for r, _ in batch], [done[r] for r, _ in batch], [n for _, n in batch],
                                torch.tensor(ids, dtype=torch.long, device=self.device))
            for r, n in batch:
                done[r] += n
            # The rows whose last token this pass fed: their first draft is its argmax.
            ended = [(b, r) for b, (r, _) in enumerate(batch) if done[r] == seqs[rows[r][0]].num_tokens]
            if ended:
                where = torch.tensor(ended, device=self.device).T
                first[where[1]] = out[where[0]]

    def _forward(self, states: list[DraftState], starts: list[int], lengths: list[int],
                 input_ids: torch.Tensor) -> torch.Tensor:
        """One pass of the draft: row i computes ``lengths[i]`` tokens (of the flat
        ``input_ids``) at positions ``starts[i]``.. of its sequence, storing their keys and
        values in its blocks. Returns the argmax token after each row's last (device)."""
        positions = self.pass_context(states, starts, lengths)[0]
        try:
            return self._next_tokens(input_ids, positions)
        finally:
            reset_context()

    def _next_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The draft's forward pass (its Context set): the argmax after each row's last token."""
        return self.model.compute_logits(self.model(input_ids, positions)).argmax(dim=-1)
