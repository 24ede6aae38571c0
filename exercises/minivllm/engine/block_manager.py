# Exercise copy of minivllm/engine/block_manager.py, generated from it by scripts/make_exercises.py.
# Fill in: block_hash (ch06), BlockManager._cached_prefix (ch06), BlockManager.can_allocate (ch05), BlockManager.allocate (ch05), BlockManager._take_free_block (ch05), BlockManager.blocks_to_grow (ch05), BlockManager.grow (ch05), BlockManager.commit_full_blocks (ch06), BlockManager.free (ch05).
# Grade: make grade CH=05; make grade CH=06
# Running the generator again overwrites this file: commit or copy your work first.

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
    raise NotImplementedError(
        "ch06: block_hash: a full block's identity is its tokens and everything before them, so "
        "the hashes chain: one xxh64 digest over the parent block's hash (when there is one) "
        "followed by the block's token ids, returned as an integer. The bytes must not depend on "
        "the machine: the parent hash as 8 little-endian bytes, each token id as 4 little-endian "
        "bytes (struct packs a list at once). Pitfall: without the parent, two prompts share a "
        "block whose tokens match by chance, see notebooks/06_prefix_caching.ipynb"
    )


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
        raise NotImplementedError(
            "ch06: _cached_prefix: the longest run of the sequence's leading full blocks found in "
            "the cache. Nothing when prefix caching is off or the request wants its prompt "
            "logprobs (those need every prompt token's logits). Walk its full blocks in order, "
            "chaining each block's hash to the previous one's; stop at the first miss, and at a "
            "collision: the cached block must hold these very tokens and its parent must be the "
            "block matched just before (none for the first). Pitfall: when every token hits, "
            "nothing is left to compute the next token's logits from: give back the last hit so it "
            "is recomputed, see notebooks/06_prefix_caching.ipynb"
        )

    def can_allocate(self, seq: Sequence) -> bool:
        raise NotImplementedError(
            "ch05: can_allocate: does the free list hold what allocate will take? The sequence "
            "needs a block for every block of its tokens except its cached prefix hits; but a hit "
            "on a block that nobody holds (ref_count 0) is itself on the free list and leaves it. "
            "Pitfall: counting such a hit as free memory admits a sequence that then runs dry, see "
            "notebooks/05_paged_blocks.ipynb"
        )

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, sharing cached prefix blocks."""
        raise NotImplementedError(
            "ch05: allocate: a waiting sequence holds no blocks yet (assert it). Its cached prefix "
            "hits come first in its table: a hit nobody held leaves the free list, and every hit "
            "gains an owner. Then a fresh block (_take_free_block) for each further block its "
            "tokens need. The hits' tokens are computed already: set num_cached_tokens and "
            "num_computed_tokens to their count, and add it to cache_hit_tokens. Pitfall: the hits "
            "count in blocks, tokens in tokens, see notebooks/05_paged_blocks.ipynb"
        )

    def _take_free_block(self) -> int:
        raise NotImplementedError(
            "ch05: _take_free_block: hand out the block freed longest ago (free_block_ids is "
            "ordered, oldest first), so recently freed blocks, whose cached contents are the "
            "likeliest to be asked for again, are evicted last. A block that still carries a hash "
            "loses its cached contents here (lazy eviction): forget its hash in hash_to_block, but "
            "only if that entry still names this block (another block may have registered the same "
            "hash since), and clear the block's hash and tokens. The block leaves with one owner; "
            "return its id, see notebooks/05_paged_blocks.ipynb"
        )

    # -- growth during decode ----------------------------------------------------------

    def blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """How many more blocks seq needs to compute num_new_tokens more tokens (a private
        copy of a shared block it is about to write included)."""
        raise NotImplementedError(
            "ch05: blocks_to_grow: after the step the sequence has computed num_computed_tokens "
            "plus num_new_tokens tokens; it needs the blocks for that many beyond those in its "
            "table (never fewer than none), plus one when the block it writes next is shared (its "
            "private copy, _shared_block_to_write), see notebooks/05_paged_blocks.ipynb"
        )

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_to_grow(seq, num_new_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        raise NotImplementedError(
            "ch05: grow: first copy on write: when the block the sequence writes next is shared, "
            "take a free block for it, drop one reference to the shared one, put the new block in "
            "the table in its place and record the copy (source, destination) in block_copies for "
            "the device. Then append a fresh block for each block still missing. Pitfall: counting "
            "the missing blocks before the copy counts the copy twice, see "
            "notebooks/05_paged_blocks.ipynb"
        )

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
        raise NotImplementedError(
            "ch06: commit_full_blocks: hash the blocks that computing has just filled (only when "
            "prefix caching is on). The full blocks are those of the computed tokens the host "
            "knows (at most num_tokens). Hashed blocks form a prefix of the table: walk back from "
            "the last full block to the first one without a hash, start the chain from the hash "
            "before it, and for each block from there: its hash, its tokens and its parent block's "
            "id (none for the first block), and an entry in hash_to_block unless that hash is "
            "registered already (the first writer wins). Pitfall: hashing a block that is not full "
            "yet caches a prefix that will change, see notebooks/06_prefix_caching.ipynb"
        )

    # -- release -----------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks. Cached contents stay until the block is reused."""
        raise NotImplementedError(
            "ch05: free: give a sequence's blocks back. A block may be shared (prefix caching): "
            "drop one reference, and only a block nobody references any more goes on the free "
            "list, its hash kept so that a later request can still find it. The order sets the "
            "eviction order: free the table from its last block to its first, so a prefix's first "
            "blocks, the most shared, are evicted last. Afterwards the sequence owns nothing: an "
            "empty block table, no computed tokens, see notebooks/05_paged_blocks.ipynb"
        )

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
