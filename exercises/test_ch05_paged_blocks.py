"""Chapter 05 — paged KV blocks: taking and freeing blocks, and the slot mapping.

Your ``BlockManager._take_free_block`` and ``BlockManager.free``
(exercises/minivllm/engine/block_manager.py) are driven through the block manager's own
``allocate`` / ``grow`` / ``commit_full_blocks``, with and without shared (prefix-cached)
blocks, and the pool's bookkeeping is checked after every operation
(``check_invariants``: reference counts equal uses, the free list holds exactly the
unreferenced blocks, the hash table points only at blocks carrying that hash). Your slot
mapping (``token_fields`` in exercises/minivllm/engine/step_inputs.py) is compared
with ``block_table[p // block_size] * block_size + p % block_size`` on batches that mix
prefills, prefill chunks that start mid-sequence and decodes, over scattered block tables.
Finally the whole engine, on 4-token blocks in a pool small enough to be reused, must
produce exactly the greedy tokens of transformers on the same float32 weights.

Also graded: ``can_allocate``, ``allocate`` with cached hits, ``blocks_to_grow`` and ``grow``
with copy on write, and the KV store and its read-back (``store_kvcache``, ``gather_kv``).
"""
import pytest
import torch
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from minivllm.context import get_context, reset_context
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams
from minivllm.testing import torch_threads


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """What an engine step does after computing a sequence's remaining tokens."""
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)


def free_list(bm: BlockManager) -> list[int]:
    return list(bm.free_block_ids)


# --- _take_free_block -----------------------------------------------------------------


def test_ch05_allocate_takes_blocks_from_the_front_of_the_free_list():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = seq_of(range(10))  # 10 tokens: 3 blocks of 4
    bm.allocate(seq)
    assert seq.block_table == [0, 1, 2], (
        f"a fresh pool hands out blocks 0, 1, 2 in order (the front of free_block_ids), got {seq.block_table}"
    )
    assert [bm.blocks[b].ref_count for b in seq.block_table] == [1, 1, 1], "a block taken for one sequence has ref_count 1"
    assert free_list(bm) == [3, 4, 5, 6, 7], f"the taken blocks must leave the free list, it is {free_list(bm)}"
    bm.check_invariants([seq])


def test_ch05_grow_takes_a_block_only_when_the_last_one_is_full():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    seq = seq_of(range(5))
    bm.allocate(seq)
    compute_all(bm, seq)
    for step in range(8):  # decode 8 tokens: 5 -> 13 tokens, 2 -> 4 blocks
        seq.token_ids.append(100 + step)
        bm.grow(seq, 1)
        seq.num_computed_tokens += 1
        assert len(seq.block_table) == -(-seq.num_tokens // 4)
        bm.check_invariants([seq])
    assert seq.block_table == [0, 1, 2, 3]


def test_ch05_freed_blocks_are_reused_least_recently_freed_first():
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    a, b = seq_of(range(12)), seq_of(range(50, 58))
    bm.allocate(a)  # blocks 0, 1, 2
    bm.allocate(b)  # blocks 3, 4
    bm.free(a)
    bm.free(b)
    assert free_list(bm) == [2, 1, 0, 4, 3], (
        f"free_block_ids after freeing a=[0, 1, 2] then b=[3, 4] should be [2, 1, 0, 4, 3] "
        f"(each table last block first, appended at the end), got {free_list(bm)}"
    )
    c = seq_of(range(100, 108))
    bm.allocate(c)
    assert c.block_table == [2, 1], f"the least recently freed blocks go first: expected [2, 1], got {c.block_table}"
    bm.check_invariants([c])


def test_ch05_lazy_eviction_forgets_the_old_hash():
    # A's two full blocks are hashed and kept after A finishes. When B needs the memory,
    # the blocks must lose their old identity: no entry in hash_to_block, no hash, no tokens.
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = seq_of(range(1, 13))  # 3 full blocks
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    assert len(bm.hash_to_block) == 3, "freed blocks keep their contents and hash until reused (lazy eviction)"
    b = seq_of(range(101, 113))  # needs the whole pool: every block of A is evicted
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    for block_id in b.block_table:
        block = bm.blocks[block_id]
        assert block.hash is None, f"block {block_id} was handed out again but still carries its old hash"
        assert block.token_ids == [], f"block {block_id} was handed out again but still carries its old token ids"
    assert bm.hash_to_block == {}, (
        f"the evicted blocks are still in hash_to_block: {bm.hash_to_block}; a request with A's prompt would "
        "'hit' blocks that now hold B's keys and values"
    )
    bm.check_invariants([b])
    # B's own blocks become hashable (and hittable) once computed.
    compute_all(bm, b)
    bm.free(b)
    again = seq_of(list(range(101, 109)) + [7])
    bm.allocate(again)
    assert again.num_cached_tokens == 8, "once computed, B's blocks must be cached under B's hashes"
    bm.check_invariants([again])
    bm.free(again)
    stale = seq_of(range(1, 10))
    bm.allocate(stale)
    assert stale.num_cached_tokens == 0, "A's prefix must no longer hit: its blocks were evicted and overwritten"
    bm.check_invariants([stale])


def test_ch05_evicting_a_private_copy_keeps_the_cached_original():
    # A and A2 have the same prompt and are computed in the same step, so both hash their
    # blocks; the first to commit (A) owns the hash_to_block entries and A2's blocks are
    # private copies with the same hashes. Evicting a private copy must not delete the
    # entry that points at A's block.
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    a, a2 = seq_of(prompt), seq_of(prompt)
    bm.allocate(a)
    bm.allocate(a2)  # before A commits: no hits, its own blocks
    compute_all(bm, a)
    compute_all(bm, a2)
    assert set(bm.hash_to_block.values()) == set(a.block_table)
    a2_blocks = list(a2.block_table)
    bm.free(a2)
    c = seq_of([20, 21, 22])
    bm.allocate(c)  # takes A2's last block, whose hash equals A's last block's hash
    assert c.block_table == [a2_blocks[-1]], f"c should take A2's last block {a2_blocks[-1]}, got {c.block_table}"
    bm.check_invariants([a, c])
    d = seq_of(prompt + [9])
    bm.allocate(d)
    assert d.num_cached_tokens == 8, (
        f"a new request with A's prompt should hit both of A's blocks, hit {d.num_cached_tokens} tokens: evicting a "
        "private copy deleted the hash_to_block entry of the block that owns that hash"
    )
    bm.check_invariants([a, c, d])


# --- free -----------------------------------------------------------------------------


def test_ch05_free_returns_every_block_last_first_and_resets_the_sequence():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    seq = seq_of(range(14))
    bm.allocate(seq)
    compute_all(bm, seq)
    bm.free(seq)
    assert free_list(bm) == [4, 5, 3, 2, 1, 0], (
        f"after freeing blocks [0, 1, 2, 3] the free list should be [4, 5, 3, 2, 1, 0] (the table's last block "
        f"first, at the end of the list), got {free_list(bm)}"
    )
    assert seq.block_table == [], "free must empty the sequence's block table"
    assert seq.num_computed_tokens == 0, "free must reset num_computed_tokens: nothing of it is in the cache any more"
    bm.check_invariants([])


def test_ch05_free_keeps_blocks_another_sequence_shares():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq_of(range(12))  # 3 full blocks
    bm.allocate(a)
    compute_all(bm, a)
    b = seq_of(list(range(8)) + [50, 51, 52])  # shares A's first two blocks
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    shared = a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    bm.free(a)
    for i in shared:
        assert bm.blocks[i].ref_count == 1, f"block {i} is still used by b: its ref_count must drop to 1, not reach 0"
        assert i not in bm.free_block_ids, f"block {i} went on the free list while b still uses it"
    bm.check_invariants([b])
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


@settings(max_examples=40)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 7), st.integers(1, 20)),
                    min_size=1, max_size=40),
       prefix_caching=st.booleans())
def test_ch05_pool_bookkeeping_under_random_operations(ops, prefix_caching):
    # Admissions (some sharing a prefix), decode growth and frees in random order; the
    # pool must stay consistent after every single operation.
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=prefix_caching)
    shared = list(range(200, 208))
    running: list[Sequence] = []
    for op, which, n in ops:
        if op == "admit":
            tokens = (shared if which % 2 else []) + [300 + which * 20 + i for i in range(n)]
            seq = seq_of(tokens)
            if not bm.can_allocate(seq):
                continue
            bm.allocate(seq)
            compute_all(bm, seq)
            running.append(seq)
        elif op == "grow" and running:
            seq = running[which % len(running)]
            k = min(n, 6)
            if not bm.can_grow(seq, k):
                continue
            seq.token_ids.extend(range(k))
            bm.grow(seq, k)
            compute_all(bm, seq)
        elif op == "free" and running:
            bm.free(running.pop(which % len(running)))
        bm.check_invariants(running)
        held = {b for s in running for b in s.block_table}
        assert len(held) + bm.num_free_blocks == bm.num_blocks, "a block is neither held nor free (leaked)"


# --- allocate with cached prefix blocks, can_allocate, grow and copy on write -----------


def test_ch05_allocate_shares_cached_prefix_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(10))  # blocks 0, 1 full, block 2 partial
    bm.allocate(a)
    compute_all(bm, a)
    b = seq_of(list(range(8)) + [70, 71, 72])  # the same two full blocks, then its own
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2], (
        f"the cached prefix hits come first in the table: {b.block_table}, a's blocks {a.block_table}")
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 1], \
        "every hit gains an owner; the fresh block has one"
    assert b.block_table[2] == 3, f"then fresh blocks from the front of the free list: {b.block_table}"
    assert (b.num_cached_tokens, b.num_computed_tokens) == (8, 8), (
        f"the hits' tokens are computed already: num_cached_tokens and num_computed_tokens count them in tokens, "
        f"got {b.num_cached_tokens}, {b.num_computed_tokens}")
    assert bm.cache_hit_tokens == 8, f"cache_hit_tokens adds the hit tokens: {bm.cache_hit_tokens}"
    bm.check_invariants([a, b])


def test_ch05_allocate_takes_a_freed_hit_off_the_free_list():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq_of(range(9))
    bm.allocate(a)
    compute_all(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    b = seq_of(list(range(8)) + [50])
    bm.allocate(b)
    assert b.block_table[:2] == cached, "a freed block that still holds the prefix is a hit"
    for block in cached:
        assert block not in bm.free_block_ids, f"hit block {block}, free before, must leave the free list"
        assert bm.blocks[block].ref_count == 1, "a hit nobody held gets one owner"
    bm.check_invariants([b])
    with pytest.raises(AssertionError):
        bm.allocate(b)  # a sequence that holds blocks already


@pytest.mark.parametrize("taken", [2, 3])
def test_ch05_can_allocate_counts_hits_on_free_blocks(taken):
    # a's two full blocks stay cached on the free list; another sequence then takes `taken`
    # of the six blocks. b needs a's two blocks (hits, but free: they leave the free list)
    # and two fresh ones: four free blocks are just enough, three are not.
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq_of(range(8))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    other = seq_of(range(100, 100 + 4 * taken))
    bm.allocate(other)
    b = seq_of(list(range(8)) + list(range(60, 68)))
    free = bm.num_free_blocks
    answer = bm.can_allocate(b)
    assert answer == (free >= 4), (
        f"{free} free blocks; b needs 2 fresh blocks and its 2 cached hits, which are free blocks and leave the "
        f"free list too: can_allocate must say {free >= 4}, said {answer}")


def test_ch05_can_allocate_without_room():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    assert bm.can_allocate(seq_of(range(12))), "three blocks' worth of tokens fit in three free blocks"
    assert not bm.can_allocate(seq_of(range(13))), "thirteen tokens need a fourth block"
    assert bm.can_allocate(seq_of(range(1))), "one token needs one block"


@pytest.mark.parametrize("computed, new, expected", [(4, 1, 1), (3, 1, 0), (5, 3, 0), (5, 4, 1), (8, 9, 3), (0, 4, 0)])
def test_ch05_blocks_to_grow_at_block_boundaries(computed, new, expected):
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    seq = seq_of(range(max(computed, 1)))
    bm.allocate(seq)
    seq.num_computed_tokens = computed
    got = bm.blocks_to_grow(seq, new)
    assert got == expected, (
        f"{computed} tokens computed in {len(seq.block_table)} blocks of 4, {new} more: {expected} more blocks, "
        f"got {got}")


def test_ch05_a_chunk_inside_the_allocated_table_needs_no_block():
    # A long prompt is allocated whole at admission, then computed in chunks: no chunk needs a block.
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    seq = seq_of(range(12))
    bm.allocate(seq)
    seq.num_computed_tokens = 4
    assert bm.blocks_to_grow(seq, 4) == 0, "the table already holds blocks for every prompt token: none to grow"
    assert bm.can_grow(seq, 4) and bm.num_free_blocks == 7


def test_ch05_grow_copies_a_shared_block_before_writing_it():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq_of(range(6))  # block 0 full, block 1 holds 2 tokens
    bm.allocate(parent)
    compute_all(bm, parent)
    child = seq_of(range(6))
    bm.fork(parent, child)
    shared = child.block_table[1]
    assert bm.blocks_to_grow(child, 1) == 1, "writing into a shared partial block takes a private copy: one block"
    child.token_ids.append(99)
    bm.grow(child, 1)
    assert child.block_table[0] == parent.block_table[0], "the full block stays shared"
    assert child.block_table[1] != shared, "the child writes into a copy of its own"
    assert bm.blocks[shared].ref_count == 1, "the shared block loses the child's reference"
    assert bm.take_block_copies() == [(shared, child.block_table[1])], \
        "the copy (source, destination) is recorded for the device"
    assert len(child.block_table) == 2, "no block beyond the copy: the token fits in it"
    bm.check_invariants([parent, child])
    child.num_computed_tokens = 7
    child.token_ids += [1, 2]
    bm.grow(child, 2)  # 7 + 2 = 9 tokens: a third block, the copy not made again
    assert len(child.block_table) == 3 and bm.take_block_copies() == [], \
        "a block of its own is written without a copy; one more block for the ninth token"
    bm.check_invariants([parent, child])


# --- the KV store and the read-back ---------------------------------------------------


def test_ch05_store_kvcache_writes_each_token_at_its_slot():
    from minivllm.ops.attention import store_kvcache

    k_cache = torch.zeros(5, 4, 2, 3)
    v_cache = torch.zeros(5, 4, 2, 3)
    k = torch.arange(1, 4 * 6 + 1, dtype=torch.float32).reshape(4, 2, 3)
    v = -k
    slots = torch.tensor([13, -1, 0, 7])  # block 3 row 1, padding, block 0 row 0, block 1 row 3
    store_kvcache(k, v, k_cache, v_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, 4)
        assert torch.equal(k_cache[block, row], k[token]) and torch.equal(v_cache[block, row], v[token]), (
            f"token {token}'s key and value go to slot {slot}: block {block}, row {row}")
    assert (k_cache != 0).sum() == 3 * 6, "a padding token (slot -1) is stored nowhere, and nothing else is touched"


@pytest.mark.parametrize("length", [1, 4, 5, 11])
def test_ch05_gather_kv_reads_through_the_block_table(length):
    from minivllm.ops.attention import gather_kv

    cache = torch.arange(6 * 4 * 2, dtype=torch.float32).reshape(6, 4, 2, 1)
    table = torch.tensor([4, 1, 5, 0])
    out = gather_kv(cache, table, length)
    expected = torch.stack([cache[table[t // 4], t % 4] for t in range(length)])
    assert out.shape == expected.shape, f"the first {length} tokens: shape {tuple(out.shape)}"
    assert torch.equal(out, expected), f"token t is row t % 4 of block table[t // 4], in order, for t < {length}"


# --- the slot mapping -----------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_on_small_blocks(tiny_qwen3):
    from minivllm import LLM

    return LLM(model=tiny_qwen3, dtype="float32", device="cpu", num_kv_blocks=24, block_size=4,
               enable_prefix_caching=False)


def test_ch05_slot_mapping_of_a_mixed_batch(llm_on_small_blocks):
    runner = llm_on_small_blocks.engine.runner
    bm = BlockManager(num_blocks=15, block_size=4, enable_prefix_caching=False)
    # Scatter the pool: admit and free some sequences first.
    fillers = [seq_of(range(n)) for n in (7, 5, 9)]
    for f in fillers:
        bm.allocate(f)
    bm.free(fillers[1])
    bm.free(fillers[0])
    prefill = seq_of(range(1, 11))          # a whole prompt: positions 0..9
    chunk = seq_of(range(20, 38))           # second chunk of a prompt: positions 8..17
    decode = seq_of(range(40, 53))          # a decode: position 12
    for s in (prefill, chunk, decode):
        bm.allocate(s)
    chunk.num_computed_tokens = 8
    decode.num_computed_tokens = 12
    batch = ScheduledBatch(seqs=[prefill, chunk, decode], num_new_tokens=[10, 10, 1])
    try:
        input_ids, positions = runner.prepare(batch)
        slots = get_context().slot_mapping.cpu().tolist()
    finally:
        reset_context()
    expected = []
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        start = s.num_computed_tokens
        expected += [s.block_table[p // 4] * 4 + p % 4 for p in range(start, start + n)]
    tables = {"prefill": prefill.block_table, "chunk": chunk.block_table, "decode": decode.block_table}
    assert len(slots) == 21, f"one slot per new token: expected 21, got {len(slots)}"
    assert slots == expected, (
        f"slot_mapping {slots}\n expected {expected}\n(block tables {tables}, block_size 4; the chunk starts at "
        "position 8 and the decode at position 12)"
    )
    assert positions.tolist() == list(range(10)) + list(range(8, 18)) + [12]


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_ch05_slot_mapping_matches_block_manager(llm_on_small_blocks, block_size):
    runner = llm_on_small_blocks.engine.runner
    saved = runner.block_size
    runner.block_size = block_size
    bm = BlockManager(num_blocks=64, block_size=block_size, enable_prefix_caching=False)
    junk = [seq_of(range(n)) for n in (block_size * 3, block_size * 2 + 1)]
    for j in junk:
        bm.allocate(j)
    bm.free(junk[0])
    seqs = [seq_of(range(n)) for n in (2 * block_size + 3, 5, 3 * block_size)]
    for s in seqs:
        bm.allocate(s)
    seqs[2].num_computed_tokens = block_size + 1
    batch = ScheduledBatch(seqs=seqs, num_new_tokens=[seqs[0].num_tokens, 5, 2 * block_size - 1])
    try:
        runner.prepare(batch)
        slots = get_context().slot_mapping.cpu().tolist()
    finally:
        reset_context()
        runner.block_size = saved
    expected = [bm.slot(s, p) for s, n in zip(seqs, batch.num_new_tokens)
                for p in range(s.num_computed_tokens, s.num_computed_tokens + n)]
    assert slots == expected, f"block_size {block_size}: slot_mapping {slots}, expected {expected}"


# --- the whole engine -----------------------------------------------------------------


def test_ch05_engine_on_small_blocks_matches_transformers(tiny_qwen3, hf_qwen3):
    # 4-token blocks, a pool that must be reused as requests finish, and a token budget
    # small enough to split prompts into chunks: every path through the blocks is taken.
    from minivllm import LLM

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 14, 27, 6, 19, 9)]
    max_tokens = [12, 8, 10, 16, 6, 11]
    with torch_threads(1):
        llm = LLM(model=tiny_qwen3, dtype="float32", device="cpu", num_kv_blocks=24, block_size=4,
                  max_num_batched_tokens=16, max_num_seqs=3, enable_prefix_caching=False, record_trace=True)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        blocks_used = max(r.blocks_in_use for r in llm.engine.trace)
        expected = []
        with torch.no_grad():
            for prompt, m in zip(prompts, max_tokens):
                out = hf_qwen3.generate(torch.tensor([prompt]), max_new_tokens=m, min_new_tokens=m, do_sample=False)
                expected.append(out[0, len(prompt):].tolist())
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g_, e) in enumerate(zip(got, expected)):
        assert g_ == e, f"prompt {i} ({len(prompts[i])} tokens): engine {g_}\n transformers {e}"
    total_blocks = sum(-(-(len(p) + m) // 4) for p, m in zip(prompts, max_tokens))
    assert total_blocks > 24 >= blocks_used, "the test needs block reuse: the pool is smaller than all requests together"
    assert llm.engine.block_manager.num_free_blocks == 24, "every block must be free again after the run"
