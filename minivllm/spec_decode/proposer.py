"""Proposers: what drafts the tokens that the target model verifies.

The engine asks one object for every step's drafts, whatever the method:
``propose(seqs, ks)`` gives each sequence at most ``ks[i]`` draft tokens to follow its
tokens (the engine calls it before every step, with no sequences when none decodes), and
``forget(seq)`` drops whatever the proposer keeps for a sequence that has finished, been
aborted or been preempted. The n-gram proposer keeps nothing; a draft model keeps a KV
cache per sequence (``minivllm.spec_decode.draft``), and so does an MTP head
(``minivllm.spec_decode.mtp``), whose bytes per block (``block_bytes``) the engine's KV
budget pays for beside the target's, and whose pool it gets once the target's is sized
(``allocate``, with the target's model runner: the MTP head reads its model and its hidden
states).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from minivllm.config import SpeculativeConfig
from minivllm.spec_decode.ngram import propose_ngram

if TYPE_CHECKING:
    from minivllm.config import EngineConfig
    from minivllm.spec_decode.sequence import Sequence


class Proposer(Protocol):
    block_bytes: int  # bytes of the proposer's own cache per block of the target's pool

    def allocate(self, num_blocks: int, runner=None) -> None: ...

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]: ...

    def forget(self, seq: Sequence) -> None: ...


class NgramProposer:
    """Prompt lookup (``propose_ngram``) on each sequence's own tokens: no model, no cache."""

    block_bytes = 0

    def __init__(self, spec: SpeculativeConfig):
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max

    def allocate(self, num_blocks: int, runner=None) -> None:
        pass

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [propose_ngram(seq.token_ids, k, self.min_n, self.max_n) for seq, k in zip(seqs, ks)]

    def forget(self, seq: Sequence) -> None:
        pass


def make_proposer(spec: SpeculativeConfig, config: EngineConfig) -> Proposer:
    """The proposer ``spec.method`` names, for an engine of ``config``."""
    if spec.method == "ngram":
        return NgramProposer(spec)
    if spec.method == "draft_model":
        from minivllm.spec_decode.draft import DraftModelProposer

        return DraftModelProposer(spec, config)
    if spec.method == "mtp":
        from minivllm.spec_decode.mtp import MTPProposer

        return MTPProposer(spec, config)
    raise ValueError(f"speculative_config method={spec.method!r} has no proposer")
