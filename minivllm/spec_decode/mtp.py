"""MTP speculation: the target's own multi-token-prediction head drafts the next tokens.

Qwen3.5 and Qwen3-Next checkpoints carry, beside the decoder, a head trained to predict the
token after next (``mtp.*``; the module is ``models.qwen3_5.Qwen3_5MultiTokenPredictor``):
from the target's last hidden state at position j and the embedding of token j + 1, one
full-attention decoder layer and the target's LM head predict token j + 2. It costs about
one decoder layer of the target's dozens per drafted token, and it reads the target's own
hidden states, so it agrees with the target far more often than a small separate model.

What it is checked against. transformers does not implement the MTP forward (it skips
``mtp.*`` when it loads these checkpoints), so the reference (tests/test_spec_mtp.py) is a
plain torch statement of the head as vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``
define it: the two RMSNorms, the concatenation [embedding | hidden] and ``fc`` written out,
and for the decoder layer and the final norm transformers' own text model of one
full-attention layer, on the target's hidden states from transformers too, recomputed from
scratch for every draft (no cache).

Per step. Drafting token N (a sequence of N tokens, of which the target has computed N - 1)
needs the head's keys and values at positions 0..N - 2, each computed from the target's
hidden state there. So after every target step the head takes in the positions that step
computed (prefill chunks included), with the tokens that follow them, the accepted drafts
and the token the step sampled: the target's hidden states of a step are kept by the model
runner until the next one (``ModelRunner.keep_hidden_states``), and the head's catch-up at
the next proposal is one pass over them. The last position's output gives draft 1.

k > 1 drafts, as vLLM does: the head runs again on its own output, at position N - 1 with
the embedding of draft 1 and its own hidden state in place of the target's, and so on. Those
positions' keys and values come from the head's guesses, so they are never kept: the next
catch-up computes the same positions again from the target's hidden states, and the blocks
past the caught-up positions are given back after each proposal. Greedy drafts, for the
reason ``minivllm.spec_decode.draft`` gives (a point mass makes the engine's acceptance rule
exact for sampled requests too).

The head's keys and values live in its own paged pool (``draft_cache``), one block beside
each block of the target's. A sequence the head first sees part-way (it missed the hidden
states of its earlier positions) gets no drafts until it is computed again from its first
token (after a preemption); so does a sequence that was not in the target's last step.
Only heads of one layer (``mtp_num_hidden_layers`` 1, every published checkpoint's) and
with the target's embedding are supported.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minivllm.config import ModelConfig, SpeculativeConfig
from minivllm.context import reset_context
from minivllm.layers.attention import attention_layers
from minivllm.loader import MTP_PREFIX, load_weights
from minivllm.models.registry import get_model_class
from minivllm.spec_decode.draft_cache import CacheState, DraftCache, hand_out_drafts

if TYPE_CHECKING:
    from minivllm.config import EngineConfig
    from minivllm.spec_decode.sequence import Sequence


def mtp_num_layers(config: ModelConfig) -> int:
    """How many MTP layers the checkpoint's config says it has (Qwen3.5 names the count
    ``mtp_num_hidden_layers``; vLLM reads Qwen3-Next's as ``num_nextn_predict_layers``,
    1 where neither is given)."""
    hf = config.hf_config
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if hf.get(key) is not None:
            return int(hf[key])
    return 1


class MTPProposer(DraftCache):
    """Greedy drafts from the target checkpoint's MTP head (see the module)."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig):
        target = ModelConfig.from_pretrained(config.model)
        model_class = get_model_class(target.architecture)
        where = f'speculative_config method "mtp" (model {config.model!r})'
        if not hasattr(model_class, "make_mtp"):
            raise ValueError(f"{where}: {target.architecture} has no multi-token-prediction head; the method is "
                             "for Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints")
        num_layers = mtp_num_layers(target)
        if num_layers != 1:
            raise ValueError(f"{where}: the config says mtp_num_hidden_layers={num_layers}; "
                             + ("the checkpoint has no MTP head" if num_layers == 0 else
                                "only a head of 1 layer is supported"))
        if target.hf_config.get("mtp_use_dedicated_embeddings"):
            raise ValueError(f"{where}: mtp_use_dedicated_embeddings=true is not supported (the head must share "
                             "the target's embedding)")
        device = torch.device(config.device)
        with torch.device(device):
            head = model_class.make_mtp(target)
        head.to(config.dtype)
        try:
            load_weights(head, config.model, prefix=MTP_PREFIX)
        except KeyError as e:
            raise ValueError(f"{where}: the checkpoint's MTP head is incomplete or absent: {e.args[0]}") from None
        self.head = head.eval()
        super().__init__(attention_layers(head), config.block_size, config.dtype, device)
        self.runner = None  # the target's model runner: its model and last step (allocate)

    def allocate(self, num_blocks: int, runner=None) -> None:
        """The head's pool, and the target it drafts for: its model runner, which from now
        on keeps each step's hidden states for the head to take in."""
        if runner is None:
            raise ValueError("the MTP proposer reads the target model: allocate(num_blocks, runner)")
        super().allocate(num_blocks)
        self.runner = runner
        runner.keep_hidden_states = True
        runner.last_step = None

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """At most ``ks[i]`` greedy drafts to follow each sequence's tokens. First takes in
        the target's last step, for every sequence it computed (not only these)."""
        out, rows_of = self._catch_up()
        drafts: list[list[int]] = [[] for _ in seqs]
        rows = []  # (index in seqs, state, k, row of its last position in out)
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            row = rows_of.get(seq.seq_id)
            if row is None or k < 1:
                continue  # not caught up to its last token this time: nothing to draft from
            state = self.states[seq.seq_id]
            # Drafts 2..k are fed at positions N - 1 .. N + k - 3: their blocks, if they fit.
            if k > 1 and not self._fit(state, seq.num_tokens + k - 2):
                k = 1
            rows.append((i, state, k, row))
        if rows:
            rows.sort(key=lambda r: -r[2])  # largest k first: each later pass runs a prefix of the rows
            hidden = out[torch.tensor([r[3] for r in rows], device=self.device)]
            tokens = [self._argmax(hidden)]  # tokens[j][r]: draft j + 1 of row r (rows with k > j)
            for j in range(1, rows[0][2]):
                n = sum(1 for r in rows if r[2] > j)
                positions = self.pass_context([r[1] for r in rows[:n]],
                                              [seqs[r[0]].num_tokens + j - 2 for r in rows[:n]], [1] * n)[0]
                try:
                    hidden = self.head(self._embed(tokens[-1][:n]), hidden[:n], positions)
                finally:
                    reset_context()
                tokens.append(self._argmax(hidden))
            hand_out_drafts(tokens, rows, drafts)
            for _, state, _, _ in rows:  # the drafts' keys and values are never read: their blocks go back
                self._fit(state, state.num_cached)
        return drafts

    def _catch_up(self) -> tuple[torch.Tensor | None, dict[int, int]]:
        """Feed the head every position the target's last step computed and kept (accepted),
        from the target's hidden states there and the tokens that follow them. Returns the
        head's output rows and, for each sequence caught up to its last token (position
        N - 2, whose output predicts token N), its row there."""
        runner = self.runner
        step, runner.last_step = runner.last_step, None  # a step is taken in once
        if step is None:
            return None, {}
        rows = []  # (seq, state, first position, end, row of the first in the target's hidden states)
        offset = 0
        for seq, start, n in zip(*step):
            first_row, offset = offset, offset + n
            if seq.is_finished or not seq.num_computed_tokens:
                continue  # finished, aborted or preempted since (forgotten)
            state = self.states.get(seq.seq_id)
            if state is None:
                if start:
                    continue  # first seen part-way: the hidden states of its earlier positions are gone
                state = self.states[seq.seq_id] = CacheState()
            # Position p is fed with token p + 1, so the last one the sequence knows is not.
            end = min(seq.num_computed_tokens, seq.num_tokens - 1, start + n)
            begin = state.num_cached
            if begin >= end:
                continue
            if begin < start or not self._fit(state, end):
                self.forget(seq)  # a gap (or no room): it cannot be caught up any more
                continue
            rows.append((seq, state, begin, end, first_row + begin - start))
        if not rows:
            return None, {}
        ids = [t for seq, _, begin, end, _ in rows for t in seq.token_ids[begin + 1 : end + 1]]
        index = [r0 + j for _, _, begin, end, r0 in rows for j in range(end - begin)]
        positions, ids, index = self.pass_context([r[1] for r in rows], [r[2] for r in rows],
                                                  [r[3] - r[2] for r in rows], ids, index)
        try:
            out = self.head(self._embed(ids), runner.last_hidden[index], positions)
        finally:
            reset_context()
        rows_of, row = {}, 0
        for seq, state, begin, end, _ in rows:
            row += end - begin
            state.num_cached = end
            if end == seq.num_tokens - 1:
                rows_of[seq.seq_id] = row - 1
        return out, rows_of

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.runner.model.model.embed_tokens(ids)

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.model.compute_logits(hidden, all_tokens=True).argmax(dim=-1)
