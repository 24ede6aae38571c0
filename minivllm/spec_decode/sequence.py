"""What a proposer reads of a sequence."""
from typing import Protocol


class Sequence(Protocol):
    """What a proposer reads of the engine's sequences (``minivllm.engine.sequence.Sequence``):
    written here, so that this folder, which the engine imports, imports nothing of the engine."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]

    @property
    def num_tokens(self) -> int: ...

    @property
    def is_finished(self) -> bool: ...
