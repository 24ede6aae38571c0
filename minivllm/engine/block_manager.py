"""The block manager: a fixed pool of KV-cache blocks, handed out to sequences.

Each sequence owns a *block table*: the list of block ids that hold its keys and values,
``block_size`` tokens each. Token t of a sequence lives in slot
``block_table[t // block_size] * block_size + t % block_size`` of the pool.

Prefix caching: every full block gets a hash chained from the block before it, so equal
hashes mean equal *prefixes*, not just equal blocks. A new sequence whose leading blocks
hash to blocks already in the pool shares them (ref_count > 1) instead of recomputing them.
Blocks whose ref count drops to zero go back on the free list *with their contents and
hash kept*; they are only forgotten when the free list hands them out again (lazy eviction,
least recently freed first), so a finished request's prefix stays reusable until the
memory is actually needed.
"""
import struct
from collections import OrderedDict

import xxhash

from minivllm.engine.sequence import Sequence


def block_hash(token_ids: list[int], parent_hash: int | None) -> int:
    """The hash of a full block, chained to its parent's so it identifies the whole prefix."""
    # BEGIN SOLUTION ch06 block_hash
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))  # 4 little-endian bytes a token
    return h.intdigest()
    # END SOLUTION


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set once the block is full (and prefix caching is on)
        self.token_ids: list[int] = []  # kept to guard against hash collisions
        self.parent_id: int | None = None  # the block before it when it was hashed (same reason)

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={'-' if self.hash is None else hex(self.hash)[:8]})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # Free blocks, least recently freed first. An OrderedDict so a cached free block can
        # be taken out of the middle in O(1) when a new sequence hits it.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cache_hit_tokens = 0  # running total, for the step trace
        # Copy-on-write copies (source block, destination block) that the next step must make
        # on the device before it writes (see grow); the scheduler hands them to the step.
        self.block_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    # -- allocation at admission -------------------------------------------------------

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest run of seq's leading full blocks found in the cache."""
        # A request that asks for its prompt's logprobs needs the logits of every prompt
        # token, so it computes them all rather than reading cached blocks (as vLLM does).
        # Its blocks are still hashed once computed, for the requests after it.
        # BEGIN SOLUTION ch06 cached_prefix
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        hits, parent = [], None
        num_full = seq.num_tokens // self.block_size
        for i in range(num_full):
            tokens = seq.block_tokens(i, self.block_size)
            h = block_hash(tokens, parent)
            block_id = self.hash_to_block.get(h)
            # A miss, or a collision: the block must hold these tokens *after the blocks
            # already matched*, or it would hand out keys computed for another prefix.
            if block_id is None or self.blocks[block_id].token_ids != tokens or \
                    self.blocks[block_id].parent_id != (hits[-1] if hits else None):
                break
            hits.append(block_id)
            parent = h
        # At least one token must be computed to produce logits: if everything hit,
        # recompute the last block rather than write into a block others share.
        if hits and len(hits) * self.block_size == seq.num_tokens:
            hits.pop()
        return hits
        # END SOLUTION

    def can_allocate(self, seq: Sequence) -> bool:
        # BEGIN SOLUTION ch05 can_allocate
        hits = self._cached_prefix(seq)
        # Hits on blocks nobody holds still come out of the free list.
        needed = seq.num_blocks_needed(self.block_size) - len(hits)
        needed += sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return needed <= self.num_free_blocks
        # END SOLUTION

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, sharing cached prefix blocks."""
        # BEGIN SOLUTION ch05 allocate
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        hits = self._cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(seq.num_blocks_needed(self.block_size) - len(hits)):
            seq.block_table.append(self._take_free_block())
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.cache_hit_tokens += seq.num_cached_tokens
        # END SOLUTION

    def _take_free_block(self) -> int:
        # BEGIN SOLUTION ch05 take_free_block
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = None
            block.token_ids = []
        block.ref_count = 1
        return block_id
        # END SOLUTION

    # -- growth during decode ----------------------------------------------------------

    def blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """How many more blocks seq needs to compute num_new_tokens more tokens (a private
        copy of a shared block it is about to write included)."""
        # BEGIN SOLUTION ch05 blocks_to_grow
        total = seq.num_computed_tokens + num_new_tokens
        new = max(0, seq.num_blocks_needed(self.block_size, total) - len(seq.block_table))
        return new + (self._shared_block_to_write(seq) is not None)
        # END SOLUTION

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_to_grow(seq, num_new_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        # BEGIN SOLUTION ch05 grow
        shared = self._shared_block_to_write(seq)
        if shared is not None:
            # Copy on write: the partly filled block seq shares with its forks gets a copy of
            # its own, made on the device before the step writes into it.
            old, new = seq.block_table[shared], self._take_free_block()
            self.blocks[old].ref_count -= 1
            seq.block_table[shared] = new
            self.block_copies.append((old, new))
        for _ in range(self.blocks_to_grow(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())
        # END SOLUTION

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks at the end of seq's table that hold none of its first
        num_tokens positions (speculative decoding: blocks taken for drafts that were
        rejected). They were filled by this sequence alone and never hashed."""
        keep = seq.num_blocks_needed(self.block_size, num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block.block_id] = None

    def _shared_block_to_write(self, seq: Sequence) -> int | None:
        """Where in seq's table the block it writes next is, if another sequence holds it
        too: a partly filled block that forks of one prompt share (full blocks are never
        written again). None otherwise."""
        i, offset = divmod(seq.num_computed_tokens, self.block_size)
        if offset and i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child continues from parent's computed tokens, in parent's blocks (SamplingParams.n:
        the prompt is computed once for all n completions)."""
        assert not child.block_table, f"sequence {child.seq_id} already holds blocks"
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self.block_copies = self.block_copies, []
        return copies

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that computing tokens has just filled, so later requests can hit them."""
        # BEGIN SOLUTION ch06 commit_full_blocks
        if not self.enable_prefix_caching:
            return
        # (Only tokens the host knows: under asynchronous scheduling the newest computed one
        # may still be on its way from the device.)
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        # Hashed blocks form a prefix of the table: walk back to the first unhashed one, so
        # each step costs the blocks it filled, not the whole sequence.
        first = num_full
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash is None:
            first -= 1
        parent = self.blocks[seq.block_table[first - 1]].hash if first else None
        for i in range(first, num_full):
            block = self.blocks[seq.block_table[i]]
            tokens = seq.block_tokens(i, self.block_size)
            block.hash = block_hash(tokens, parent)
            block.token_ids = tokens
            block.parent_id = seq.block_table[i - 1] if i else None
            # First writer wins: an identical block computed twice stays a private copy.
            self.hash_to_block.setdefault(block.hash, block.block_id)
            parent = block.hash
        # END SOLUTION

    # -- release -----------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks. Cached contents stay until the block is reused."""
        # BEGIN SOLUTION ch05 free_blocks
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        # END SOLUTION

    def slot(self, seq: Sequence, position: int) -> int:
        """Where token ``position`` of seq lives in the pool, as a flat slot index."""
        block_id = seq.block_table[position // self.block_size]
        return block_id * self.block_size + position % self.block_size

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (used by tests)."""
        uses = [0] * self.num_blocks
        for seq in seqs:
            for b in seq.block_table:
                uses[b] += 1
        for block in self.blocks:
            assert block.ref_count == uses[block.block_id], f"{block}: ref_count != {uses[block.block_id]} uses"
            in_free = block.block_id in self.free_block_ids
            assert in_free == (block.ref_count == 0), f"{block}: free-list membership disagrees with ref_count"
        for h, b in self.hash_to_block.items():
            assert self.blocks[b].hash == h, f"hash table points at {self.blocks[b]} for a different hash"
