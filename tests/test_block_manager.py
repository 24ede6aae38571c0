"""The block manager on its own: allocation, growth, release, prefix caching, eviction.

No model is involved: a sequence is just token ids, and "computing" tokens means moving
``num_computed_tokens`` forward and committing the blocks that filled up, as the engine
does after a step.
"""
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.engine import block_manager as bm_module
from minivllm.engine.block_manager import BlockManager, block_hash
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """What a step does for a sequence's whole prompt: its tokens are now in the cache."""
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)


def test_allocate_grow_free():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = seq_of(range(10))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 7
    assert seq.num_cached_tokens == 0 and seq.num_computed_tokens == 0
    bm.check_invariants([seq])

    compute_all(bm, seq)
    # Tokens 10 and 11 still fit in the third block; the 13th token needs a fourth.
    for expected_blocks in (3, 3, 4):
        seq.token_ids.append(7)
        assert bm.blocks_to_grow(seq, 1) == expected_blocks - len(seq.block_table)
        bm.grow(seq, 1)
        seq.num_computed_tokens += 1
        assert len(seq.block_table) == expected_blocks
        bm.check_invariants([seq])
    assert bm.num_free_blocks == 6

    # Token t lives in slot block_table[t // 4] * 4 + t % 4.
    assert bm.slot(seq, 0) == seq.block_table[0] * 4
    assert bm.slot(seq, 9) == seq.block_table[2] * 4 + 1
    assert bm.slot(seq, 12) == seq.block_table[3] * 4

    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 10
    bm.check_invariants([seq])


def test_can_allocate_counts_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    big = seq_of(range(100, 113))  # 13 tokens: 4 blocks, the whole pool
    assert bm.can_allocate(big)
    small = seq_of(range(1))
    bm.allocate(small)
    assert not bm.can_allocate(big)
    # Growth counts from the computed tokens (none yet): 17 need 5 blocks, 16 fit in 4.
    assert not bm.can_grow(small, 17)
    assert bm.can_grow(small, 16)
    bm.free(small)
    assert bm.can_allocate(big)


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)


def test_prefix_hit_shares_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of(range(10))
    bm.allocate(a)
    compute_all(bm, a)
    # Same first 8 tokens (two full blocks), then a different tail.
    b = seq_of([0, 1, 2, 3, 4, 5, 6, 7, 50, 51, 52])
    assert bm.can_allocate(b)
    free_before = bm.num_free_blocks
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert bm.num_free_blocks == free_before - 1
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.check_invariants([a, b])

    # A prefix that differs in the first block shares nothing, even though block 2 matches.
    c = seq_of([9, 1, 2, 3, 4, 5, 6, 7])
    bm.allocate(c)
    assert c.num_cached_tokens == 0 and not set(c.block_table) & set(a.block_table)
    bm.check_invariants([a, b, c])


def test_partial_block_is_never_shared():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of(range(6))  # one full block, one half block
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.blocks[a.block_table[1]].hash is None
    b = seq_of(range(7))
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_lazy_eviction_keeps_freed_prefix_until_needed():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq_of(range(12))  # three full blocks
    bm.allocate(a)
    compute_all(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6  # freed blocks count as free ...
    assert all(bm.blocks[i].hash is not None for i in a_blocks)  # ... but keep their contents

    # A new request with the same prefix finds the freed blocks again.
    b = seq_of(list(range(12)) + [99])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:3] == a_blocks and b.num_cached_tokens == 12
    bm.check_invariants([b])
    bm.free(b)

    # The least recently freed blocks go first: the two never used, then b's own last
    # block, then the prefix from its end (free() returns a table's blocks last first).
    others = [seq_of([200 + i]) for i in range(4)]
    for s in others:
        bm.allocate(s)
    bm.check_invariants(others)
    taken = {s.block_table[0] for s in others}
    assert a_blocks[2] in taken and a_blocks[1] not in taken and a_blocks[0] not in taken
    assert bm.blocks[a_blocks[2]].hash is None  # evicted: forgotten when reused

    # The first two blocks of the prefix still hit; the third was evicted.
    bm.free(others.pop())
    c = seq_of(range(12))
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a_blocks[:2]
    bm.check_invariants(others + [c])


def test_evicted_when_pool_needs_it():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq_of(range(8))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    # A request that needs the whole pool evicts the cached prefix.
    big = seq_of(range(100, 116))
    assert bm.can_allocate(big)
    bm.allocate(big)
    assert bm.num_free_blocks == 0 and not bm.hash_to_block
    bm.free(big)
    again = seq_of(range(8))
    bm.allocate(again)
    assert again.num_cached_tokens == 0


def test_fully_cached_prompt_recomputes_its_last_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of(range(8))
    bm.allocate(a)
    compute_all(bm, a)
    b = seq_of(range(8))  # identical, and a whole number of blocks
    bm.allocate(b)
    # At least one token must be computed to get logits: the last block is recomputed in a
    # block of b's own, never written into the block a still uses.
    assert b.num_cached_tokens == 4 and b.num_computed_tokens == 4
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    bm.check_invariants([a, b])
    # One token more than a whole number of blocks: every full block hits.
    c = seq_of(range(9))
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table


def test_hash_chain_depends_on_the_prefix():
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    assert block_hash(x, None) == block_hash(list(x), None)
    assert block_hash(x, block_hash(y, None)) != block_hash(x, block_hash(z, None))
    assert block_hash(x, block_hash(y, None)) != block_hash(x, None)
    assert block_hash(x, None) != block_hash(y, None)

    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of(y + x)
    bm.allocate(a)
    compute_all(bm, a)
    b = seq_of(z + x + [0])  # the same second block after a different first one
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert not set(b.block_table) & set(a.block_table)


def test_no_prefix_caching_shares_nothing():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = seq_of(range(9))
    bm.allocate(a)
    compute_all(bm, a)
    assert not bm.hash_to_block
    b = seq_of(range(9))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    bm.check_invariants([a, b])


def test_collision_guard(monkeypatch):
    """With every block hashing alike, only blocks with the same prefix may be shared."""
    monkeypatch.setattr(bm_module, "block_hash", lambda token_ids, parent_hash: 42)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq_of(x + y + [0])
    bm.allocate(a)
    compute_all(bm, a)
    held = [a]
    for tokens, expect_cached in [
        (y + x + [0], 0),  # a different first block
        (x + x + [0], 4),  # block 2 has the tokens of a's block 1, after another prefix
        (x + [0, 0, 0, 0, 0], 4),
        (x + y + [1], 4),  # one hash value holds one block: only a's first block is findable
    ]:
        s = seq_of(tokens)
        bm.allocate(s)
        held.append(s)
        assert s.num_cached_tokens == expect_cached, tokens
        # Every shared block holds exactly the tokens s has at that place, after the
        # same prefix: the blocks before it in both tables are the same blocks.
        for i, b in enumerate(s.block_table[: s.num_cached_tokens // 4]):
            owner = a.block_table
            assert owner.index(b) == i and owner[:i] == s.block_table[:i]
        bm.check_invariants(held)


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(4, 24),
    block_size=st.integers(1, 4),
    prefix_caching=st.booleans(),
    collide=st.booleans(),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "free", "step"]), st.lists(st.integers(0, 2), min_size=1, max_size=14),
                  st.integers(0, 100)),
        max_size=40,
    ),
)
def test_random_allocate_and_free(num_blocks, block_size, prefix_caching, collide, ops):
    """Random admissions, partial computes, growth and releases keep the books straight.

    Prompts come from a three-token alphabet, so prefixes repeat a lot; with ``collide``
    every block hashes alike. A fake KV store records, for every slot, the whole prefix its
    token was computed after; every block a sequence reads must hold exactly its own prefix.
    """
    if collide:
        with mock.patch.object(bm_module, "block_hash", lambda token_ids, parent_hash: 42):
            run_random_ops(num_blocks, block_size, prefix_caching, ops)
    else:
        run_random_ops(num_blocks, block_size, prefix_caching, ops)


def run_random_ops(num_blocks, block_size, prefix_caching, ops):
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    kv: dict[int, tuple] = {}
    live: list[Sequence] = []

    def write(seq, upto):
        for p in range(seq.num_computed_tokens, upto):
            kv[bm.slot(seq, p)] = tuple(seq.token_ids[: p + 1])
        seq.num_computed_tokens = upto
        bm.commit_full_blocks(seq)

    def check_reads(seq):
        for p in range(seq.num_computed_tokens):
            assert kv.get(bm.slot(seq, p)) == tuple(seq.token_ids[: p + 1]), f"{seq} reads a wrong slot at {p}"

    for op, tokens, pick in ops:
        if op == "add":
            seq = seq_of(tokens)
            if bm.can_allocate(seq):
                free_before = bm.num_free_blocks
                bm.allocate(seq)
                assert bm.num_free_blocks <= free_before
                assert len(seq.block_table) == seq.num_blocks_needed(block_size)
                check_reads(seq)  # cached blocks hold this sequence's prefix
                live.append(seq)
        elif live and op == "free":
            bm.free(live.pop(pick % len(live)))
        elif live and op == "step":
            seq = live[pick % len(live)]
            if seq.num_computed_tokens < seq.num_tokens:  # compute part of what is left
                write(seq, seq.num_computed_tokens + 1 + pick % (seq.num_tokens - seq.num_computed_tokens))
            elif bm.can_grow(seq, 1):  # a decode: append a token and compute it
                seq.token_ids.append(pick % 3)
                bm.grow(seq, 1)
                write(seq, seq.num_tokens)
            check_reads(seq)
        bm.check_invariants(live)
        for seq in live:
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks
