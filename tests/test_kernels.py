"""Every Triton kernel against its torch reference on fresh random inputs.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest)
with small shapes in float32: the interpreter computes in numpy float32, so results agree
with the reference to float32 rounding (atol 1e-4 on O(1) values). On a GPU the same tests
run at real shapes (Qwen3-0.6B's heads and head_dim) in bfloat16 against a float32
reference computed from the same bf16 inputs: bf16 keeps 8 bits of mantissa (relative
rounding 2^-8 ~ 4e-3) and the kernels accumulate in float32, so outputs agree within about
two bf16 ulps of O(1) values: atol 2e-2, rtol 2e-2.

Every input is random (never zeros); kernel outputs are checked for NaN and compared at
every element, and the KV store writes into a cache already full of random values, so an
unwritten or misplaced row shows.
"""
import pytest
import torch

from minivllm.context import Context
from minivllm.ops.attention import store_kvcache as store_reference
from minivllm.ops.attention import gather_kv, varlen_attention_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = dict(atol=2e-2, rtol=2e-2) if CUDA else dict(atol=1e-4, rtol=1e-4)
# (heads, kv_heads, head_dim, block_size)
SHAPES = [(16, 8, 128, 16), (32, 4, 64, 16)] if CUDA else [(4, 2, 16, 4), (6, 1, 32, 8)]


def random_paged_cache(lens, kv_heads, head_dim, block_size, spare=3):
    """A K/V pool with random contents and block tables that scatter each sequence."""
    blocks = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(blocks) + spare
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks).tolist()
    width = max(blocks)
    tables, i = [], 0
    for b in blocks:
        tables.append(perm[i : i + b] + [-1] * (width - b))
        i += b
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=DEVICE)


def reference(q, k_cache, v_cache, tables, lens, q_lens, scale, sliding_window=None):
    """The torch reference in float32, reading the same cache (nothing new to store)."""
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    ctx = Context(
        is_prefill=max(q_lens) > 1, cu_seqlens_q=cu.to(DEVICE), slot_mapping=torch.full((q.shape[0],), -1, device=DEVICE),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE), block_tables=tables,
    )
    dummy = q[:, : k_cache.shape[2]].float()
    return varlen_attention_reference(q.float(), dummy, dummy, k_cache.float(), v_cache.float(), ctx, scale, sliding_window)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("window", [None, 7 if not CUDA else 100])
def test_paged_decode_attention(heads, kv_heads, head_dim, block_size, num_splits, window):
    from minivllm.kernels.paged_attention import paged_decode_attention

    lens = [1, 37, 5, 300] if CUDA else [1, 13, 5, 22]
    if CUDA:
        lens += torch.randint(1, 2048, (60,)).tolist()  # batch 64
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size)
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    scale = head_dim**-0.5
    # max_context_len larger than any context, as under a CUDA graph (sized for max_model_len).
    out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                 scale, 2 * max(lens), num_splits, sliding_window=window)
    ref = reference(q, k_cache, v_cache, tables, lens, [1] * len(lens), scale, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, **TOL)


@pytest.mark.parametrize("block_size,block_n", [(4, 16), (16, 16), (16, 32)] if not CUDA else [(16, 64), (16, 128), (32, 16)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_tile_shapes(block_size, block_n, num_splits):
    """The decode kernel's tiles over cache blocks: a tile inside one block, or spanning
    several; contexts that end inside a tile, past the last block's ids; a sliding window
    that starts inside a tile."""
    from minivllm.kernels.paged_attention import paged_decode_attention

    heads, kv_heads, head_dim, _ = SHAPES[0]
    lens = [1, 37, 5, 300, 129] if CUDA else [1, 37, 5, 50, 17]
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size)
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    scale = head_dim**-0.5
    config = {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}
    for window in (None, 11):
        out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                     scale, max(lens), num_splits, sliding_window=window, config=config)
        ref = reference(q, k_cache, v_cache, tables, lens, [1] * len(lens), scale, window)
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), ref, **TOL)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_paged_decode_stores_the_new_keys_and_attends_over_them(num_splits, window):
    """A decode step hands the kernel its own keys and values (the fused KV store): each is
    written to its slot, a padding row (slot -1) writes nothing, and every query attends over
    its new key as the newest, as the reference does after storing it."""
    from minivllm.kernels.paged_attention import paged_decode_attention

    heads, kv_heads, head_dim, block_size = SHAPES[0]
    lens = [1, 37, 5, 300, 0, 129] if CUDA else [1, 37, 5, 50, 0, 17]  # 0: a CUDA-graph padding row
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size)
    # Each sequence's newest position is its slot; its cache row holds random values (poison).
    slots = torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
                          for i, n in enumerate(lens)], device=DEVICE)
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    k = torch.randn(len(lens), kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    qkv = torch.randn(len(lens), 3, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v = qkv[:, 1]  # a strided view, as the engine's v is a view into the packed qkv output
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_reference(k, v, k_ref, v_ref, slots)
    scale = head_dim**-0.5
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens_t, scale, 2 * max(lens), num_splits,
                                 sliding_window=window, k=k, v=v, slot_mapping=slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)  # every slot written, nothing else
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)
    ref = reference(q, k_ref, v_ref, tables, lens, [1] * len(lens), scale, window)
    assert not out.isnan().any() and out[4].abs().max() == 0
    torch.testing.assert_close(out.float(), ref, **TOL)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_padding_rows_give_zero(num_splits):
    """A row with context length 0 (CUDA-graph padding) must produce zeros, not NaN: through
    the merge (2 splits) and when the kernel writes the output itself (1 split)."""
    from minivllm.kernels.paged_attention import paged_decode_attention

    heads, kv_heads, head_dim, block_size = SHAPES[0]
    k_cache, v_cache, tables = random_paged_cache([9, 4], kv_heads, head_dim, block_size)
    q = torch.randn(2, heads, head_dim, device=DEVICE, dtype=DTYPE)
    out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([9, 0], dtype=torch.int32, device=DEVICE),
                                 head_dim**-0.5, 64, num_splits=num_splits)
    assert out[1].abs().max() == 0
    ref = reference(q[:1], k_cache, v_cache, tables[:1], [9], [1], head_dim**-0.5)
    torch.testing.assert_close(out[:1].float(), ref, **TOL)


def test_paged_decode_splits_merged_by_log_sum_exp():
    """Contexts several splits long, so that the merge weighs real partial softmaxes by their
    log-sum-exp (natural log; the kernel's running max is in base 2)."""
    from minivllm.kernels.paged_attention import paged_decode_attention

    heads, kv_heads, head_dim, block_size = SHAPES[0]
    lens = [200, 70, 129, 3] if not CUDA else [4000, 700, 1500, 3]
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size)
    q = 4 * torch.randn(len(lens), heads, head_dim, device=DEVICE, dtype=DTYPE)  # peaked softmaxes
    out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                 head_dim**-0.5, max(lens), num_splits=4)
    ref = reference(q, k_cache, v_cache, tables, lens, [1] * len(lens), head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref, **TOL)


def poisoned_split_buffers(monkeypatch):
    """Make the split-context kernel's partial outputs and log-sum-exps start as NaN, and keep
    them for the test to look at: a split that should store nothing leaves NaN behind, and a
    merge that reads one shows it."""
    from minivllm.kernels import paged_attention

    made, package_split_buffers = [], paged_attention.split_buffers

    def split_buffers(out, num_splits):
        buffers = package_split_buffers(out, num_splits)
        if num_splits > 1:
            buffers[0].fill_(float("nan"))
            buffers[1].fill_(float("nan"))
            made.append(buffers)
        return buffers

    monkeypatch.setattr(paged_attention, "split_buffers", split_buffers)
    return made


def test_empty_splits_store_no_partial_output(monkeypatch):
    """Contexts far shorter than the grid's eight splits: a split with no keys stores only a
    log-sum-exp of -inf, never a partial output, and the merge reads no partial output
    where the log-sum-exp is -inf (those are NaN here, as memory nobody wrote may be). A
    decode step, and a short prefill whose splits past the first have no cached keys."""
    from minivllm.kernels.paged_attention import (decode_config, paged_decode_attention,
                                                  paged_short_prefill_attention)

    made = poisoned_split_buffers(monkeypatch)
    heads, kv_heads, head_dim, block_size = SHAPES[0]
    tile = decode_config(head_dim)["BLOCK_N"]
    lens = [2 * tile + 5, 70, tile + 1, 3]
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size)
    q = 4 * torch.randn(len(lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens_t, head_dim**-0.5, 8 * tile, num_splits=8)
    ref = reference(q, k_cache, v_cache, tables, lens, [1] * len(lens), head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref, **TOL)
    part_out, part_lse = made.pop()
    used = [3, 1, 2, 1]  # splits of one tile each hold keys; the rest none
    for b, n in enumerate(used):
        assert not part_lse[b, :, :n].isnan().any() and (part_lse[b, :, n:] == float("-inf")).all()
        assert not part_out[b, :, :n].isnan().any() and part_out[b, :, n:].isnan().all()

    # A short prefill: two queries a sequence after its cached keys (split 0 takes the
    # step's own keys, the cached ones are cut into splits as a decode step's).
    q_lens = [2] * len(lens)
    cached = [n - 2 for n in lens]
    k, v = (torch.randn(2 * len(lens), kv_heads, head_dim, device=DEVICE, dtype=DTYPE) for _ in range(2))
    slots = [tables[b, p // block_size].item() * block_size + p % block_size for b, n in enumerate(lens)
             for p in range(n - 2, n)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    q = torch.randn(2 * len(lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(device=DEVICE, dtype=torch.int32)
    out = paged_short_prefill_attention(q, k_cache, v_cache, tables, lens_t, cu, 2, head_dim**-0.5, 8 * tile, k, v,
                                        slot_mapping, num_splits=8)
    ref = reference(q, k_cache, v_cache, tables, lens, q_lens, head_dim**-0.5)  # the step's keys now stored
    torch.testing.assert_close(out.float(), ref, **TOL)
    part_out, part_lse = made.pop()
    for b, n in enumerate(cached):
        holds = max(1, -(-n // tile))  # split 0 holds the step's keys even after no cached ones
        rows = slice(2 * b, 2 * b + 2)
        assert (part_lse[rows, :, holds:] == float("-inf")).all() and part_out[rows, :, holds:].isnan().all()
        assert not part_out[rows, :, :holds].isnan().any()


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("window", [None, 5 if not CUDA else 100])
def test_paged_prefill_attention(heads, kv_heads, head_dim, block_size, window):
    """Fresh prompts, prompts continuing a cached prefix, a chunk, and a decode row, mixed."""
    from minivllm.kernels.paged_attention import paged_prefill_attention

    if CUDA:
        lens, q_lens = [700, 1030, 64, 5, 257], [700, 30, 64, 1, 200]
    else:
        lens, q_lens = [9, 21, 6, 5], [9, 4, 6, 1]
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size)
    q = torch.randn(sum(q_lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(device=DEVICE, dtype=torch.int32)
    scale = head_dim**-0.5
    # int64 lengths, as the engine passes them (the decode test uses int32).
    out = paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int64, device=DEVICE),
                                  cu.long(), max(q_lens), scale, sliding_window=window)
    ref = reference(q, k_cache, v_cache, tables, lens, q_lens, scale, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, **TOL)


# Tile shapes and switches of the prefill kernel, each against the reference: a tile of keys
# inside one cache block, exactly one, spanning several, and a block size that is not a power
# of two (each key's block looked up on its own); all eight combinations of the switches.
if CUDA:
    PREFILL_TILINGS = [(64, 32, 16), (16, 32, 64), (16, 32, 16), (48, 32, 64), (16, 64, 128)]  # (block_size, BLOCK_M, BLOCK_N)
else:
    PREFILL_TILINGS = [(8, 4, 4), (4, 4, 4), (4, 4, 16), (6, 4, 8)]
SWITCHES = [dict(PREFETCH=p, K_T=t, PER_BLOCK=b) for p in (False, True) for t in (False, True) for b in (False, True)]
# NEW_KV (the step's keys read from the step's own K and V) is on by default; off, every key
# is gathered through the block table, as when the caller has no K and V to give.
SWITCHES[0]["NEW_KV"] = False


def step_kv(k_cache, v_cache, tables, lens, q_lens, padded_rows=None):
    """The keys and values a step computed (each sequence's last q_lens of its lens), as
    the kernel gets them from the model: rows of one [tokens, q + k + v] projection, so
    strided views, here of a wider buffer. Rows past the real ones (a graph's padding,
    ``padded_rows`` in all) hold NaN: the kernel must never let them into an output."""
    kv_heads, head_dim = k_cache.shape[2:]
    real = sum(q_lens)
    qkv = torch.full((padded_rows or real, 3, kv_heads, head_dim), float("nan"), device=DEVICE, dtype=k_cache.dtype)
    row = 0
    for table, n, m in zip(tables.tolist(), lens, q_lens):
        for cache, which in ((k_cache, 1), (v_cache, 2)):
            qkv[row : row + m, which] = gather_kv(cache, torch.tensor(table), n)[n - m :]
        row += m
    return qkv[:, 1], qkv[:, 2]


def check_prefill(heads, kv_heads, head_dim, block_size, lens, q_lens, window=None, config=None, seed=0):
    """The prefill kernel on random inputs against the float32 reference, into an output
    filled with NaN first: a row the kernel does not write stays NaN. The kernel gets the
    step's own keys and values too (read from there with NEW_KV, the default)."""
    from minivllm.kernels.paged_attention import paged_prefill_attention

    torch.manual_seed(seed)
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size)
    q = torch.randn(sum(q_lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(device=DEVICE, dtype=torch.int32)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    k, v = step_kv(k_cache, v_cache, tables, lens, q_lens)
    got = paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                  cu, max(q_lens), scale, sliding_window=window, config=config, out=out, k=k, v=v)
    assert got is out
    assert not out.isnan().any(), f"{out.isnan().any(-1).any(-1).sum().item()} query rows left unwritten"
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, tables, lens, q_lens, scale, window), **TOL)


# Fresh prompts, prompts after a cached prefix (a chunk), a decode row, lengths on and off
# tile and block boundaries.
PREFILL_BATCH = ([700, 1030, 64, 5, 257, 129], [700, 30, 64, 1, 200, 128]) if CUDA else \
    ([23, 40, 8, 5, 17], [23, 9, 8, 1, 16])


@pytest.mark.parametrize("block_size,block_m,block_n", PREFILL_TILINGS)
@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: "-".join(k for k, v in s.items() if v) or "plain")
def test_paged_prefill_tiles_and_switches(block_size, block_m, block_n, switches):
    heads, kv_heads, head_dim = (16, 8, 128) if CUDA else (4, 2, 16)
    config = dict(BLOCK_M=block_m, BLOCK_N=block_n, **switches)
    check_prefill(heads, kv_heads, head_dim, block_size, *PREFILL_BATCH, config=config)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1), (6, 2)],
                         ids=["group1", "group2", "group4", "group8", "group3"])
@pytest.mark.parametrize("window", [None, 6 if not CUDA else 100])
def test_paged_prefill_gqa_groups(heads, kv_heads, window):
    """Each group size packs its query heads into the tile's rows (group 3 pads to 4)."""
    if CUDA:
        heads, kv_heads = 4 * heads, 4 * kv_heads
    check_prefill(heads, kv_heads, 128 if CUDA else 16, 16 if CUDA else 4, *PREFILL_BATCH, window=window, seed=1)


@pytest.mark.parametrize("switches", [SWITCHES[0], SWITCHES[-1], dict(PREFETCH=True, K_T=False, PER_BLOCK=True)],
                         ids=["plain", "all", "default"])
@pytest.mark.parametrize("window", [3, 9] if not CUDA else [64, 300])
def test_paged_prefill_sliding_window_and_cached_prefix(switches, window):
    """A window that starts mid-tile, over a cached prefix longer than the window, so the
    walk starts past key 0 and tiles before the window are skipped."""
    lens, q_lens = ([50, 37, 12], [20, 37, 3]) if not CUDA else ([3000, 900], [512, 900])
    block_size, block_m, block_n = (4, 4, 8) if not CUDA else (16, 32, 64)
    heads, kv_heads, head_dim = (4, 2, 16) if not CUDA else (16, 8, 128)
    check_prefill(heads, kv_heads, head_dim, block_size, lens, q_lens, window=window,
                  config=dict(BLOCK_M=block_m, BLOCK_N=block_n, **switches), seed=2)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (6, 2)], ids=["group2", "group8", "group3"])
@pytest.mark.parametrize("window", [None, 6 if not CUDA else 100])
def test_paged_prefill_from_scratch(heads, kv_heads, window):
    """FROM_SCRATCH (a step in which every sequence computes its prompt from position 0)
    compiles the kernel without its gathered loops: every key comes from the step's own K
    and V. Prompts on and off tile boundaries, one of a single token."""
    if CUDA:
        heads, kv_heads = 4 * heads, 4 * kv_heads
    lens = [1000, 64, 1, 257, 700] if CUDA else [23, 8, 1, 17, 40]
    block_size, block_m, block_n = (16, 32, 64) if CUDA else (4, 4, 8)
    check_prefill(heads, kv_heads, 128 if CUDA else 16, block_size, lens, list(lens), window=window, seed=3,
                  config=dict(BLOCK_M=block_m, BLOCK_N=block_n, FROM_SCRATCH=True))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 2), (4, 4)], ids=["group2", "group4", "group1"])
def test_paged_prefill_verifying_step_with_padding(heads, kv_heads):
    """A verifying step as its CUDA graph lays it out (minivllm.engine.cuda_graphs, a verify graph):
    sequences of 1 to 9 query tokens after contexts short and long, then padding sequences
    with no queries and no keys, then padding rows that belong to no sequence. The default
    tiles (on a GPU, the short-query ones: every query is at most SHORT_QUERY tokens) must
    give the reference's rows and leave the padding rows unwritten (NaN)."""
    from minivllm.kernels.paged_attention import SHORT_QUERY, paged_prefill_attention, prefill_config

    if CUDA:
        heads, kv_heads = 4 * heads, 4 * kv_heads
    head_dim, block_size = (128, 16) if CUDA else (16, 4)
    lens, q_lens = ([2048, 513, 9, 130], [9, 4, 1, 2]) if CUDA else ([40, 9, 3, 17], [5, 4, 1, 2])
    assert max(q_lens) <= SHORT_QUERY
    if CUDA:  # the short-query tiles are what this step gets
        assert prefill_config(head_dim, heads // kv_heads, True, max(q_lens))["BLOCK_M"] * \
            triton_next_power_of_2(heads // kv_heads) == 16
    torch.manual_seed(4)
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size)
    num_pad_seqs, padded_rows = 3, 10 * (len(lens) + 3)
    q = torch.randn(padded_rows, heads, head_dim, device=DEVICE, dtype=DTYPE)
    real = sum(q_lens)
    cu = torch.tensor([0] + q_lens + [0] * num_pad_seqs).cumsum(0).to(device=DEVICE, dtype=torch.int64)
    all_lens = torch.tensor(lens + [0] * num_pad_seqs, dtype=torch.int64, device=DEVICE)
    all_tables = torch.cat([tables, torch.zeros(num_pad_seqs, tables.shape[1], dtype=tables.dtype, device=DEVICE)])
    out = torch.full_like(q, float("nan"))
    k, v = step_kv(k_cache, v_cache, tables, lens, q_lens, padded_rows)  # NaN in the padding rows
    paged_prefill_attention(q, k_cache, v_cache, all_tables, all_lens, cu, 10, head_dim**-0.5, out=out, k=k, v=v)
    assert not out[:real].isnan().any() and out[real:].isnan().all()
    want = reference(q[:real], k_cache, v_cache, tables, lens, q_lens, head_dim**-0.5)
    torch.testing.assert_close(out[:real].float(), want, **TOL)


# Hopper's shared memory per block (the H200's 227 KB), which every default tile must fit.
HOPPER_SHARED_BYTES = 232448

# Compiles the prefill kernel for sm_90 with prefill_config's tiles and prints the shared
# memory each needs; run in a process of its own, without the interpreter (conftest's
# TRITON_INTERPRET), on any machine: Triton's compiler needs no GPU.
SHARED_MEMORY_PROBE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from minivllm.kernels.paged_attention import _prefill_kernel, prefill_config
out = []
for dtype, head_dim, group, max_seqlen_q in json.loads(sys.argv[1]):
    config = prefill_config(head_dim, group, True, max_seqlen_q, 4 if dtype == "fp32" else 2)
    signature = {name: "*" + dtype for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    signature.update({name: f"tensordesc<{dtype}[{config['BLOCK_N']},{head_dim}]>" for name in ("k_new", "v_new")})
    signature.update({"block_tables_ptr": "*i64", "context_lens_ptr": "*i64", "cu_seqlens_ptr": "*i64", "scale": "fp32",
                      "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"})
    signature.update({name: "i32" for name in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs",
                                               "stride_ch", "stride_bt", "window")})
    constexprs = {"GROUP": group, "BLOCK_G": group, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16,
                  "PRECISION": "ieee" if dtype == "fp32" else "tf32",
                  **{k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    kernel = triton.compile(triton.compiler.ASTSource(fn=_prefill_kernel, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]})
    out.append([dtype, head_dim, group, max_seqlen_q, kernel.metadata.shared])
print(json.dumps(out))
"""


def test_prefill_defaults_fit_hopper_shared_memory():
    """The prefill kernel's default tiles, compiled for sm_90, fit in a block's shared
    memory, for half precision and float32, narrow and wide heads, long and short queries.
    Float32 once took the half-precision tiles: 393 KB at head_dim 128, a launch that fails
    on the GPU."""
    import json
    import os
    import subprocess
    import sys

    cases = [["fp32", 128, 2, None], ["fp32", 64, 4, None], ["fp32", 256, 8, None], ["fp32", 128, 2, 4],
             ["bf16", 128, 2, None], ["bf16", 128, 8, None], ["bf16", 256, 8, None], ["bf16", 128, 2, 4]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SHARED_MEMORY_PROBE, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    for dtype, head_dim, group, max_seqlen_q, shared in results:
        assert 0 < shared <= HOPPER_SHARED_BYTES, (dtype, head_dim, group, max_seqlen_q, shared)


def triton_next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# A step of short queries (a verifying step of speculative decoding) after contexts long and
# short: a query of one token, queries longer than the context before them (a prompt from
# scratch), lengths on and off tile and block boundaries. Then, as a CUDA graph lays such a
# step out, padding sequences (no queries, no keys) and padding rows (no sequence).
SHORT_BATCH = ([2048, 513, 9, 130, 16, 300], [9, 4, 1, 2, 16, 5]) if CUDA else ([40, 9, 3, 17, 5], [5, 4, 1, 2, 5])


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("window", [None, 6 if not CUDA else 100])
def test_paged_short_prefill_stores_the_step_and_attends(heads, kv_heads, head_dim, block_size, num_splits, window):
    """The short-prefill kernel against the reference. The cache starts with random values
    at the step's own slots (not the step's keys), so an output that reads them instead of
    the step's K and V, or a slot left unstored, shows; every other slot must stay as it was.
    The step's K and V hold NaN in the padding rows, which must reach no output."""
    from minivllm.kernels.paged_attention import paged_short_prefill_attention, takes_short_prefill

    lens, q_lens = SHORT_BATCH
    assert takes_short_prefill(max(q_lens), heads // kv_heads, head_dim)
    torch.manual_seed(7)
    want_k, want_v, tables = random_paged_cache(lens, kv_heads, head_dim, block_size)
    num_pad_seqs, padded_rows = 2, sum(q_lens) + 7
    k, v = step_kv(want_k, want_v, tables, lens, q_lens, padded_rows)  # the cache's own rows: what must be stored
    slots = []
    for table, n, m in zip(tables.tolist(), lens, q_lens):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n - m, n)]
    real = len(slots)
    slot_mapping = torch.tensor(slots + [-1] * (padded_rows - real), dtype=torch.int64, device=DEVICE)
    k_cache, v_cache = want_k.clone(), want_v.clone()
    flat = (-1, kv_heads, head_dim)
    k_cache.view(flat)[slot_mapping[:real]] = torch.randn(real, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v_cache.view(flat)[slot_mapping[:real]] = torch.randn(real, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    q = torch.randn(padded_rows, heads, head_dim, device=DEVICE, dtype=DTYPE)
    cu = torch.tensor([0] + q_lens + [0] * num_pad_seqs).cumsum(0).to(device=DEVICE, dtype=torch.int64)
    all_lens = torch.tensor(lens + [0] * num_pad_seqs, dtype=torch.int64, device=DEVICE)
    all_tables = torch.cat([tables, torch.zeros(num_pad_seqs, tables.shape[1], dtype=tables.dtype, device=DEVICE)])
    scale = head_dim**-0.5
    out = paged_short_prefill_attention(q, k_cache, v_cache, all_tables, all_lens, cu, max(q_lens), scale,
                                        4096 if CUDA else max(lens), k, v, slot_mapping, sliding_window=window,
                                        num_splits=num_splits)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), "the step's keys and values, stored exactly"
    assert not out[:real].isnan().any()
    ref = reference(q[:real], want_k, want_v, tables, lens, q_lens, scale, window)
    torch.testing.assert_close(out[:real].float(), ref, **TOL)


def test_short_prefill_takes_short_steps_only():
    """The dispatch's bound: up to SHORT_QUERY tokens a sequence, in a tile of at most
    SHORT_PREFILL_TILE elements; anything wider is refused by the kernel, by name."""
    from minivllm.kernels.paged_attention import (SHORT_QUERY, paged_short_prefill_attention, short_prefill_pays,
                                                  takes_short_prefill)

    assert takes_short_prefill(4, 2, 128) and takes_short_prefill(SHORT_QUERY, 2, 128) and takes_short_prefill(1, 8, 256)
    assert not takes_short_prefill(SHORT_QUERY + 1, 1, 64)  # past SHORT_QUERY
    assert not takes_short_prefill(16, 8, 128)  # 128 rows of 128
    assert not takes_short_prefill(0, 2, 128)
    # Only while the prefill kernel's (sequence, K/V head) programs fill a quarter of the GPU.
    assert short_prefill_pays(1, 8, 132) and short_prefill_pays(4, 8, 132) and short_prefill_pays(8, 4, 132)
    assert not short_prefill_pays(5, 8, 132) and not short_prefill_pays(16, 8, 132)
    q = torch.randn(17, 2, 16, device=DEVICE, dtype=DTYPE)
    k_cache = torch.randn(4, 4, 1, 16, device=DEVICE, dtype=DTYPE)
    kv = torch.randn(17, 1, 16, device=DEVICE, dtype=DTYPE)
    cu = torch.tensor([0, 17], device=DEVICE)
    with pytest.raises(ValueError, match="max_seqlen_q=17"):
        paged_short_prefill_attention(q, k_cache, k_cache, torch.zeros(1, 4, dtype=torch.int32, device=DEVICE),
                                      torch.tensor([17], device=DEVICE), cu, 17, 0.25, 17, kv, kv,
                                      torch.arange(17, device=DEVICE))


def test_paged_prefill_rejects_bad_config_and_out():
    from minivllm.kernels.paged_attention import paged_prefill_attention

    k_cache = torch.randn(2, 16, 2, 16, device=DEVICE, dtype=DTYPE)
    tables = torch.tensor([[0], [1]], device=DEVICE, dtype=torch.int32)
    lens = torch.tensor([5, 3], device=DEVICE, dtype=torch.int32)
    cu = torch.tensor([0, 5, 8], device=DEVICE, dtype=torch.int32)
    q = torch.randn(8, 4, 16, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="config keys"):
        paged_prefill_attention(q, k_cache, k_cache, tables, lens, cu, 5, 0.25, config={"BLOCK_K": 16})
    with pytest.raises(ValueError, match="out must"):
        paged_prefill_attention(q, k_cache, k_cache, tables, lens, cu, 5, 0.25, out=q[:4])
    with pytest.raises(ValueError, match="scale"):
        paged_prefill_attention(q, k_cache, k_cache, tables, lens, cu, 5, -0.25)


def test_store_kvcache():
    from minivllm.kernels.kv_store import store_kvcache

    heads, kv_heads, head_dim, block_size = SHAPES[0]
    tokens = 50 if CUDA else 9
    k_cache = torch.randn(12, block_size, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(12 * block_size, device=DEVICE)[:tokens]
    slots[3] = -1  # padding: must not be written
    # k as a strided view into a packed projection output, as the model produces it.
    packed = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=DTYPE)
    k = packed[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = packed[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slots)
    store_reference(k, v, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(with_residual):
    from minivllm.kernels.elementwise import rms_norm
    from minivllm.ops.norm import rms_norm as reference_norm

    hidden = 1024 if CUDA else 48
    x = torch.randn(37, hidden, device=DEVICE, dtype=DTYPE)
    w = torch.randn(hidden, device=DEVICE, dtype=DTYPE)
    if with_residual:
        r = torch.randn_like(x)
        out, res = rms_norm(x, w, 1e-6, r)
        torch.testing.assert_close(res, x + r, atol=0, rtol=0)
        torch.testing.assert_close(out.float(), reference_norm((x + r).float(), w.float(), 1e-6), **TOL)
    else:
        out = rms_norm(x, w, 1e-6)
        torch.testing.assert_close(out.float(), reference_norm(x.float(), w.float(), 1e-6), **TOL)


def test_silu_and_mul():
    from minivllm.kernels.elementwise import silu_and_mul
    from minivllm.ops.activation import silu_and_mul as reference_silu

    inter = 3072 if CUDA else 40
    x = torch.randn(29, 2 * inter, device=DEVICE, dtype=DTYPE)
    torch.testing.assert_close(silu_and_mul(x).float(), reference_silu(x.float()), **TOL)


@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope(with_norm):
    from minivllm.kernels.elementwise import qk_norm_rope
    from minivllm.layers.rotary import RotaryEmbedding
    from minivllm.ops.norm import rms_norm as reference_norm
    from minivllm.ops.rotary import apply_rotary

    heads, kv_heads, head_dim, _ = SHAPES[0]
    rotary = RotaryEmbedding(head_dim, 4096, 1_000_000.0).to(DEVICE)
    positions = torch.randint(0, 4096, (33,), device=DEVICE)
    # q and k as the model passes them: strided views into one packed qkv row.
    qkv = torch.randn(33, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=DTYPE)
    q = qkv[:, : heads * head_dim].view(33, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(33, kv_heads, head_dim)
    weights = ()
    if with_norm:
        weights = (torch.randn(head_dim, device=DEVICE, dtype=DTYPE), torch.randn(head_dim, device=DEVICE, dtype=DTYPE))
    q_out, k_out = qk_norm_rope(q, k, positions, rotary.cos_cache, rotary.sin_cache, *weights, eps=1e-6)
    cos, sin = rotary.cos_cache[positions], rotary.sin_cache[positions]
    q_ref, k_ref = q.float(), k.float()
    if with_norm:
        q_ref = reference_norm(q_ref, weights[0].float(), 1e-6)
        k_ref = reference_norm(k_ref, weights[1].float(), 1e-6)
    # The norm's output is O(|w|) and rounds once more to bf16 before the rotation.
    tol = dict(atol=5e-2, rtol=2e-2) if CUDA and with_norm else TOL
    torch.testing.assert_close(q_out.float(), apply_rotary(q_ref, cos, sin), **tol)
    torch.testing.assert_close(k_out.float(), apply_rotary(k_ref, cos, sin), **tol)


# Up to SUM_ROWS rows take the sum-of-products path by default (blocks narrower than 16
# allowed), more rows the tensor cores; DOT picks either (the sum path up to 8 rows).
@pytest.mark.parametrize("rows,block_n,dot", [(1, 4, None), (1, 16, None), (1, 64, None), (3, 16, None), (4, 4, None),
                                              (3, 16, True), (8, 8, False), (16, 16, None), (16, 64, None)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv(rows, block_n, dot, with_bias):
    from minivllm.kernels.gemv import gemv

    # Shapes that are not multiples of the blocks, so every mask matters.
    n, k = (4096 + 48, 1024 + 40) if CUDA else (70, 300)
    x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
    w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k**0.5
    b = torch.randn(n, device=DEVICE, dtype=DTYPE) if with_bias else None
    config = {"BLOCK_N": block_n, "BLOCK_K": 64 if not CUDA else 256, "num_warps": 4, "num_stages": 2}
    if dot is not None:
        config["DOT"] = dot
    out = gemv(x, w, b, **config)
    assert out.shape == (rows, n) and out.dtype == x.dtype
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(out.float(), ref, **TOL)
    # The default block shapes too.
    torch.testing.assert_close(gemv(x, w, b).float(), ref, **TOL)


@pytest.mark.parametrize("k", [1000, 3072, 4400])
def test_gemv_one_row_takes_its_whole_row_of_w_in_one_tile(k):
    """At one row a program's whole row of W up to 4,096 columns is one tile (no K loop after
    the wait for the kernel before); past 4,096 the loop takes the rest."""
    from minivllm.kernels.gemv import gated_config, gemv, gemv_config, gemv_silu_and_mul

    config = gemv_config(96, k, rows=1)
    assert config["BLOCK_K"] >= min(k, 4096) and config["BLOCK_N"] * config["BLOCK_K"] == 8192
    assert gated_config(48, k, rows=1) == config
    x = torch.randn(1, k, device=DEVICE, dtype=DTYPE)
    w = torch.randn(96, k, device=DEVICE, dtype=DTYPE) / k**0.5
    ref = x.float() @ w.float().T
    torch.testing.assert_close(gemv(x, w).float(), ref, **TOL)
    torch.testing.assert_close(gemv_silu_and_mul(x, w).float(),
                               torch.nn.functional.silu(ref[:, :48]) * ref[:, 48:], **TOL)


def test_gemv_rejects_a_path_its_rows_or_blocks_do_not_fit():
    from minivllm.kernels.gemv import gemv

    w = torch.randn(40, 64, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="DOT=False"):
        gemv(torch.randn(9, 64, device=DEVICE, dtype=DTYPE), w, DOT=False, BLOCK_N=4, BLOCK_K=64)
    with pytest.raises(ValueError, match="BLOCK_N >= 16"):
        gemv(torch.randn(2, 64, device=DEVICE, dtype=DTYPE), w, DOT=True, BLOCK_N=4, BLOCK_K=64)
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(torch.randn(17, 64, device=DEVICE, dtype=DTYPE), w)


@pytest.mark.parametrize("rows,block_n,block_k", [(1, 4, 64), (1, 16, 128), (3, 4, 64), (5, 16, 64), (16, 32, 128)])
def test_gemv_silu_and_mul(rows, block_n, block_k):
    """The gate/up product ending in SwiGLU equals the two-kernel path it replaces."""
    from minivllm.kernels.gemv import gemv, gemv_silu_and_mul
    from minivllm.ops.activation import silu_and_mul

    # Widths that are not multiples of the blocks, and a K of several tiles.
    n, k = (3072 + 40, 1024 + 24) if CUDA else (50, 300)
    x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
    w = torch.randn(2 * n, k, device=DEVICE, dtype=DTYPE) / k**0.5
    config = {"BLOCK_N": block_n, "BLOCK_K": block_k if not CUDA else 4 * block_k, "num_warps": 4, "num_stages": 2}
    out = gemv_silu_and_mul(x, w, **config)
    assert out.shape == (rows, n) and out.dtype == x.dtype and not out.isnan().any()
    gate_up = x.float() @ w.float().T
    ref = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    torch.testing.assert_close(out.float(), ref, **TOL)
    # Against the unfused kernels on the same inputs: the same rounding of gate and up.
    unfused = silu_and_mul(gemv(x, w, **config)).float()
    torch.testing.assert_close(out.float(), unfused, atol=1e-2 if CUDA else 1e-5, rtol=1e-2 if CUDA else 1e-5)
    torch.testing.assert_close(gemv_silu_and_mul(x, w).float(), ref, **TOL)  # the default blocks
    with pytest.raises(ValueError, match="even"):
        gemv_silu_and_mul(x, w[:-1])


def test_kernels_reject_bad_shapes():
    from minivllm.kernels.elementwise import rms_norm, silu_and_mul

    x = torch.randn(3, 8, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(x, torch.randn(7, device=DEVICE, dtype=DTYPE), 1e-6)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(3, 7, device=DEVICE, dtype=DTYPE))


def test_attention_kernels_reject_missing_bounds():
    """The host-side bounds size the launch grids: a zero (Context's default) would launch
    nothing (prefill) or read too few keys (decode). Both are refused by name."""
    from minivllm.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

    k_cache = torch.randn(2, 16, 2, 16, device=DEVICE, dtype=DTYPE)
    tables = torch.tensor([[0], [1]], device=DEVICE, dtype=torch.int32)
    lens = torch.tensor([5, 3], device=DEVICE, dtype=torch.int32)
    cu = torch.tensor([0, 5, 8], device=DEVICE, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        paged_prefill_attention(torch.randn(8, 4, 16, device=DEVICE, dtype=DTYPE), k_cache, k_cache, tables, lens, cu, 0, 0.25)
    with pytest.raises(ValueError, match="max_context_len"):
        paged_decode_attention(torch.randn(2, 4, 16, device=DEVICE, dtype=DTYPE), k_cache, k_cache, tables, lens, 0.25, 0)
