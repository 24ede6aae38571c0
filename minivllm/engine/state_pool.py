"""State slots for hybrid models: one fixed-size slot per running sequence.

A Gated DeltaNet layer does not cache keys and values; it carries a conv state and a
recurrent state per sequence, the same size at token 10 as at token 100,000. The pools
hold ``num_slots`` of each per layer (allocated once by the model runner); a sequence takes
a slot when it is admitted and gives it back when it finishes or is preempted. A preempted
sequence is recomputed from its first token, so it needs nothing saved: its next admission
takes any free slot and starts from zeros (``Context.has_initial_state`` is 0 for a
sequence with nothing computed).

The full-attention layers of the same model keep the paged KV cache, so a hybrid model's
cache manager is the block manager plus a slot pool. Prefix caching is off for hybrid
models: a cached block holds the attention layers' keys and values for its tokens, but the
linear-attention layers' state after those tokens is not kept anywhere, so a request that
hit the block could not resume the recurrence from it.

Speculative decoding: a verifying step runs the recurrence over a sequence's last token
and its d drafts, so the slot ends up holding the state after all of them. Each layer also
has spec pools of k states per slot (k = num_speculative_tokens), where the step keeps the
state after each of the sequence's first d tokens; when the target accepts a < d drafts,
``keep_accepted_states`` copies entry a (the state after the last token it kept) into the
slot. Nothing is recomputed, and the cost is k more states per slot of memory.
"""
import math
from collections import deque

import numpy as np
import torch

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence
from minivllm.layers.gated_deltanet import GatedDeltaNet


def state_slot_bytes(layers: list[GatedDeltaNet], dtype: torch.dtype, num_spec_states: int = 0) -> int:
    """The bytes one slot takes in every layer's pools (allocate_state_pools' layout)."""
    per_state = 0
    for layer in layers:
        conv_shape, recurrent_shape = layer.state_shapes()
        per_state += math.prod(conv_shape) * dtype.itemsize + math.prod(recurrent_shape) * 4  # float32
    return per_state * (1 + num_spec_states)


def check_state_pools_fit(slot_bytes: int, num_slots: int, free_bytes: int, num_spec_states: int = 0) -> None:
    """A clear error, before any allocation, when the state pools alone would not fit in the
    device's free memory (a large hybrid model at a large max_num_seqs, more so with
    speculation's k extra states per slot), instead of the allocator's out-of-memory error."""
    need = slot_bytes * num_slots
    if need > free_bytes:
        spec = f" x (1 + num_speculative_tokens={num_spec_states}) states each" if num_spec_states else ""
        lower = "max_num_seqs or num_speculative_tokens" if num_spec_states else "max_num_seqs"
        raise ValueError(f"the recurrent-state pools need {need / 2**30:.2f} GiB (max_num_seqs={num_slots} slots"
                         f"{spec}, {slot_bytes / 2**20:.1f} MiB a slot) but {free_bytes / 2**30:.2f} GiB of device "
                         f"memory is free: lower {lower}")


def allocate_state_pools(layers: list[GatedDeltaNet], num_slots: int, dtype: torch.dtype, device,
                         num_spec_states: int = 0) -> int:
    """Give each layer its pools of ``num_slots`` conv states (model dtype) and recurrent
    states (float32: the state sums thousands of updates), and with ``num_spec_states`` = k
    (speculative decoding) its spec pools of k of each per slot. Returns the bytes of one
    slot."""
    slot_bytes = 0
    for layer in layers:
        conv_shape, recurrent_shape = layer.state_shapes()
        layer.conv_states = torch.zeros(num_slots, *conv_shape, dtype=dtype, device=device)
        layer.recurrent_states = torch.zeros(num_slots, *recurrent_shape, dtype=torch.float32, device=device)
        layer.spec_conv_states = layer.spec_recurrent_states = None
        if num_spec_states:
            layer.spec_conv_states = torch.zeros(num_slots, num_spec_states, *conv_shape, dtype=dtype, device=device)
            layer.spec_recurrent_states = torch.zeros(num_slots, num_spec_states, *recurrent_shape,
                                                      dtype=torch.float32, device=device)
        for pool in (layer.conv_states, layer.recurrent_states, layer.spec_conv_states, layer.spec_recurrent_states):
            if pool is not None:
                slot_bytes += pool[0].numel() * pool.element_size()
    return slot_bytes


def state_metadata(seqs: list[Sequence], num_drafts: list[int] | None = None) -> np.ndarray:
    """The step's rows for the Context: each sequence's slot, and whether it continues from
    that slot's state (something computed already) or starts from zeros; with ``num_drafts``
    (speculative decoding: the drafts each verifies, not all zero) a third row of them."""
    rows = [[seq.state_slot for seq in seqs], [int(seq.num_computed_tokens > 0) for seq in seqs]]
    if num_drafts and any(num_drafts):
        rows.append(num_drafts)
    return np.array(rows, dtype=np.int64)


def keep_accepted_states(layers: list[GatedDeltaNet], slots: torch.Tensor, accepted: torch.Tensor) -> None:
    """After a verifying step: sequence i, in slot ``slots[i]``, accepted ``accepted[i]``
    of its drafts and rejected the next, so its state is the one the step kept after its
    token ``accepted[i]`` (its last token is token 0, the drafts follow), not the one after
    all of them that the slot holds. [n] int64 tensors on the layers' device."""
    for layer in layers:
        layer.conv_states[slots] = layer.spec_conv_states[slots, accepted]
        layer.recurrent_states[slots] = layer.spec_recurrent_states[slots, accepted]


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots ({num_slots}) must be >= 1")
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def allocate(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            raise RuntimeError(f"sequence {seq.seq_id} already holds state slot {seq.state_slot}")
        if not self.free_slots:
            raise RuntimeError("no free state slot: admit at most num_slots sequences")
        seq.state_slot = self.free_slots.popleft()

    def free(self, seq: Sequence) -> None:
        """Give seq's slot back (nothing to do for a sequence that holds none)."""
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None


class HybridCacheManager(BlockManager):
    """KV blocks for the full-attention layers and a state slot for the linear-attention
    layers, taken and given back together: at admission, and at finish or preemption."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.states = StatePool(num_state_slots)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.states.num_free_slots > 0 and super().can_allocate(seq)

    def allocate(self, seq: Sequence) -> None:
        if self.states.num_free_slots == 0:
            raise RuntimeError("no free state slot: check can_allocate first")
        super().allocate(seq)
        self.states.allocate(seq)

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self.states.free(seq)

    def check_invariants(self, seqs: list[Sequence]) -> None:
        super().check_invariants(seqs)
        held = [seq.state_slot for seq in seqs if seq.state_slot is not None]
        assert len(held) == len(set(held)), f"two sequences share a state slot: {sorted(held)}"
        assert sorted(held + list(self.states.free_slots)) == list(range(self.states.num_slots)), \
            "a state slot is lost or both held and free"
