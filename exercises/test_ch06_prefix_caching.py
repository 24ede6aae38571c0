"""Chapter 06 — prefix caching: the chained block hash.

Your ``block_hash`` (exercises/minivllm/engine/block_manager.py) is compared with xxHash's
64-bit digest of the specified bytes (the parent hash as 8 little-endian bytes when there
is a parent, then each token id as 4 little-endian bytes) on random blocks; checked for
what any correct chained hash must do (depend on the parent, on every token and on their
order, give the same value in every process); and then used by the block manager and the
engine, which must share exactly the blocks of a common prefix, and still produce the
greedy tokens of transformers on the same float32 weights.

Also graded: the lookup (``BlockManager._cached_prefix``: misses, partial blocks, forged
collisions, a fully cached prompt) and the commit (``commit_full_blocks``: chained, only what
is computed and on the host, the first writer keeping a hash).
"""
import os
import subprocess
import sys

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from minivllm.engine import block_manager as bm_module
from minivllm.engine.block_manager import BlockManager, block_hash
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams
from minivllm.testing import torch_threads

TOKENS = st.lists(st.integers(0, 2**20), min_size=1, max_size=32)
PARENTS = st.one_of(st.none(), st.integers(0, 2**64 - 1))


def reference_hash(tokens, parent):
    h = xxhash.xxh64()
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    for t in tokens:
        h.update(t.to_bytes(4, "little"))
    return h.intdigest()


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)


# --- the hash itself ------------------------------------------------------------------


@settings(max_examples=60)
@given(tokens=TOKENS, parent=PARENTS)
def test_ch06_block_hash_is_xxh64_of_parent_then_tokens(tokens, parent):
    got = block_hash(list(tokens), parent)
    assert isinstance(got, int) and not isinstance(got, bool), f"block_hash must return an int, got {type(got).__name__}"
    assert 0 <= got < 2**64, f"block_hash must be a 64-bit unsigned value (intdigest()), got {got}"
    assert got == reference_hash(tokens, parent), (
        f"block_hash({tokens}, {parent}) = {got:#x}, expected {reference_hash(tokens, parent):#x}: xxh64 over the "
        "parent's 8 little-endian bytes (only if there is a parent), then each token id's 4 little-endian bytes"
    )


@settings(max_examples=40)
@given(tokens=TOKENS, a=st.integers(0, 2**64 - 1), b=st.integers(0, 2**64 - 1))
def test_ch06_block_hash_depends_on_the_parent(tokens, a, b):
    # The same tokens after another prefix have other keys and values: another hash.
    if a != b:
        assert block_hash(tokens, a) != block_hash(tokens, b), "block_hash ignores the parent hash"
    assert block_hash(tokens, a) != block_hash(tokens, None), "a block with a parent must not hash like a first block"


@pytest.mark.parametrize("tokens", [[1, 2, 3, 4], [7] * 16, [0, 65536, 2**24, 151_000], list(range(100, 132))])
def test_ch06_block_hash_depends_on_every_token_and_their_order(tokens):
    base = block_hash(tokens, 12345)
    for i in range(len(tokens)):
        for delta in (1, 256, 65536):  # a change in any of the 4 bytes of any token
            changed = list(tokens)
            changed[i] = tokens[i] + delta
            assert block_hash(changed, 12345) != base, f"changing token {i} by {delta} left the hash unchanged"
    if len(set(tokens)) > 1:
        rotated = tokens[1:] + tokens[:1]
        assert block_hash(rotated, 12345) != base, "the hash must depend on the order of the tokens"


def test_ch06_block_hash_is_the_same_in_every_process():
    # Cache hits must not depend on the process: no Python hash() of strings or bytes
    # (randomised per process), no id(). Compute the same hashes in two fresh interpreters.
    path = bm_module.__file__
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('graded_block_manager', {path!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "h = m.block_hash([5, 6, 7, 8], None)\n"
        "print(h, m.block_hash([9, 10, 11, 12], h))\n"
    )
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, f"block_hash failed in a fresh process:\n{result.stderr[-2000:]}"
        outputs.append(result.stdout.split())
    here = block_hash([5, 6, 7, 8], None)
    assert outputs[0] == outputs[1] == [str(here), str(block_hash([9, 10, 11, 12], here))], (
        f"block_hash differs between processes: {outputs[0]} vs {outputs[1]}"
    )


# --- the hash in the block manager ----------------------------------------------------


def test_ch06_block_manager_shares_exactly_the_common_prefix():
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    X, Y, Z, W = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    a = seq_of(X + Y + Z + [99])
    bm.allocate(a)
    compute_all(bm, a)
    assert len(bm.hash_to_block) == 3, "A's three full blocks must be in the cache after it computed them"

    b = seq_of(X + Y + W + [98])  # shares two blocks
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2], (
        f"B shares A's first two blocks: expected 8 cached tokens, got {b.num_cached_tokens}"
    )
    c = seq_of(W + Y + Z + [97])  # Y and Z again, after another first block: nothing to share
    bm.allocate(c)
    assert c.num_cached_tokens == 0, "C's blocks 1 and 2 hold A's tokens after a different prefix: they must not hit"
    d = seq_of(Y + Z + [96])  # A's second and third blocks, at the start: nothing to share
    bm.allocate(d)
    assert d.num_cached_tokens == 0, "a block that was A's second must not hit as someone's first block"
    for s in (b, c, d):
        compute_all(bm, s)
    e = seq_of(W + Y + Z + X + [95])  # now C's prefix is cached too
    bm.allocate(e)
    assert e.num_cached_tokens == 12 and e.block_table[:3] == c.block_table[:3]
    bm.check_invariants([a, b, c, d, e])


def test_ch06_identical_blocks_at_different_depths_are_different_entries():
    # The same block repeated: [X, X, X]. Every full block gets its own hash and block.
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    X = [3, 1, 4, 1]
    a = seq_of(X * 3 + [5])
    bm.allocate(a)
    compute_all(bm, a)
    assert len(bm.hash_to_block) == 3, "three blocks with the same tokens but different prefixes need three hashes"
    b = seq_of(X * 2 + [9])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    bm.check_invariants([a, b])


# --- the lookup: _cached_prefix ----------------------------------------------------------

X, Y, Z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def cached_manager(*prompts, block_size=4, enable_prefix_caching=True):
    """A block manager that has computed (and hashed) each prompt, all still held."""
    bm = BlockManager(num_blocks=32, block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    seqs = []
    for tokens in prompts:
        seq = seq_of(tokens)
        bm.allocate(seq)
        compute_all(bm, seq)
        seqs.append(seq)
    return bm, seqs


def test_ch06_lookup_stops_at_the_first_miss():
    bm, (a,) = cached_manager(X + Y + Z + [0])
    hits = bm._cached_prefix(seq_of(X + Z + Y + [0]))
    assert hits == a.block_table[:1], f"X hits, then Z after X is a miss and the lookup stops there: {hits}"
    assert bm._cached_prefix(seq_of(X + Y + [7])) == a.block_table[:2], "X then Y, then a partial block: two hits"


def test_ch06_a_partial_block_never_hits():
    bm, (a,) = cached_manager(X + Y + [1, 2])
    assert bm._cached_prefix(seq_of(X + [5, 6, 7])) == a.block_table[:1], \
        "only full blocks are looked up: the three tokens after X are not a block"


def test_ch06_when_every_token_hits_the_last_block_is_recomputed():
    bm, (a,) = cached_manager(X + Y + [0])
    hits = bm._cached_prefix(seq_of(X + Y))
    assert hits == a.block_table[:1], (
        f"a prompt made only of cached blocks leaves nothing to compute its next token from: the last hit is "
        f"given back, got {hits}")


def test_ch06_no_lookup_without_prefix_caching_or_with_prompt_logprobs():
    bm, _ = cached_manager(X + Y + [0], enable_prefix_caching=False)
    assert bm._cached_prefix(seq_of(X + Y + [0])) == [], "prefix caching off: no hits"
    bm, _ = cached_manager(X + Y + [0])
    wants = Sequence(X + Y + [0], SamplingParams(prompt_logprobs=1))
    assert bm._cached_prefix(wants) == [], "a request for prompt logprobs needs every prompt token's logits: no hits"


def test_ch06_a_hash_collision_is_not_a_hit():
    # The table says "this hash is block b", but b holds other tokens (a collision, forged
    # here): handing it out would give this prompt another prompt's keys.
    bm, (a,) = cached_manager(X + Y + [0])
    bm.blocks[a.block_table[0]].token_ids = [4, 3, 2, 1]
    assert bm._cached_prefix(seq_of(X + Y + [0])) == [], "a cached block must hold exactly these tokens"
    bm, (a,) = cached_manager(X + Y + [0])
    bm.blocks[a.block_table[1]].parent_id = 31
    hits = bm._cached_prefix(seq_of(X + Y + [0]))
    assert hits == a.block_table[:1], f"a cached block's parent must be the block matched before it: {hits}"


# --- the commit: commit_full_blocks -------------------------------------------------------


def test_ch06_commit_hashes_exactly_the_full_computed_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = seq_of(X + Y + Z + [13, 14])
    bm.allocate(seq)
    seq.num_computed_tokens = 6  # a chunk of a prefill: block 0 full, block 1 half computed
    bm.commit_full_blocks(seq)
    hashes = [bm.blocks[b].hash for b in seq.block_table]
    assert hashes[0] == block_hash(X, None) and hashes[1:] == [None] * 3, (
        f"after 6 of 14 tokens only block 0 is full and computed: {hashes}")
    seq.num_computed_tokens = 14
    bm.commit_full_blocks(seq)
    blocks = [bm.blocks[b] for b in seq.block_table]
    expected = [block_hash(X, None)]
    expected += [block_hash(Y, expected[0])]
    expected += [block_hash(Z, expected[1])]
    assert [b.hash for b in blocks] == expected + [None], (
        "each full block's hash chains from the block before it; the partial last block has none")
    assert [b.token_ids for b in blocks[:3]] == [X, Y, Z], "a hashed block keeps its tokens (the collision guard)"
    assert [b.parent_id for b in blocks[:3]] == [None, seq.block_table[0], seq.block_table[1]], \
        "a hashed block keeps its parent block's id (None for the first)"
    assert bm.hash_to_block == {h: b for h, b in zip(expected, seq.block_table)}, \
        "every hash is registered to its block"


def test_ch06_commit_only_what_the_host_knows():
    # Asynchronous scheduling: the step computed a token the host has not received yet.
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = seq_of(X + [5, 6, 7])
    bm.allocate(seq)
    seq.num_computed_tokens = 8  # one more than the 7 tokens the host knows
    bm.commit_full_blocks(seq)
    assert [bm.blocks[b].hash is not None for b in seq.block_table] == [True, False], \
        "block 1's last token is not on the host yet: it cannot be hashed"


def test_ch06_commit_without_prefix_caching_hashes_nothing():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    seq = seq_of(X + Y + [0])
    bm.allocate(seq)
    compute_all(bm, seq)
    assert not bm.hash_to_block and all(b.hash is None for b in bm.blocks), "prefix caching off: no hashes"


def test_ch06_first_writer_wins():
    # Two sequences compute the same prompt at once: both blocks get the hash, the table keeps the first.
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = seq_of(X + Y + [0]), seq_of(X + Y + [0])
    bm.allocate(a)
    bm.allocate(b)  # nothing hashed yet: no hits
    compute_all(bm, a)
    compute_all(bm, b)
    assert bm.hash_to_block[block_hash(X, None)] == a.block_table[0], \
        "the block registered first keeps the entry; the identical later one stays a private copy"
    assert bm.blocks[b.block_table[1]].hash == block_hash(Y, block_hash(X, None)), "the copy is hashed all the same"
    bm.check_invariants([a, b])


def test_ch06_commit_step_by_step_continues_the_chain():
    # Decoding token by token: each commit hashes the block just filled, chained to the ones before.
    bm = BlockManager(num_blocks=16, block_size=2)
    seq = seq_of([1, 2, 3])
    bm.allocate(seq)
    compute_all(bm, seq)
    for t in range(4, 10):
        seq.token_ids.append(t)
        bm.grow(seq, 1)
        compute_all(bm, seq)
    parent, expected = None, []
    for i in range(len(seq.token_ids) // 2):
        parent = block_hash(seq.token_ids[2 * i : 2 * i + 2], parent)
        expected.append(parent)
    got = [bm.blocks[b].hash for b in seq.block_table[: len(expected)]]
    assert got == expected, f"the chain over blocks committed one step at a time: {got}, expected {expected}"


# --- the whole engine -----------------------------------------------------------------


def test_ch06_engine_with_a_shared_prefix_matches_transformers(tiny_qwen3, hf_qwen3):
    from minivllm import LLM

    g = torch.Generator().manual_seed(6)
    shared = torch.randint(0, 512, (40,), generator=g).tolist()  # 5 blocks of 8
    prompts = [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 7, 1, 12, 5)]
    with torch_threads(1):
        llm = LLM(model=tiny_qwen3, dtype="float32", device="cpu", num_kv_blocks=64, block_size=8, max_num_seqs=1,
                  enable_prefix_caching=True, record_trace=True)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        expected = []
        with torch.no_grad():
            for p in prompts:
                out = hf_qwen3.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
                expected.append(out[0, len(p):].tolist())
    cached = [o.num_cached_tokens for o in outputs]
    assert cached == [0, 40, 40, 40, 40], (
        f"one request at a time: the first computes the shared 40-token prefix (5 blocks of 8), every later one "
        f"should find all 5 blocks in the cache; cached tokens per request: {cached}"
    )
    for i, (o, e) in enumerate(zip(outputs, expected)):
        assert o.outputs[0].token_ids == e, f"prompt {i}: engine {o.outputs[0].token_ids}\n transformers {e}"
    assert sum(r.cache_hit_tokens for r in llm.engine.trace) == 160
