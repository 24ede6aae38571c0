"""The readable two-stage decode kernel (kernels/flash_decode.py, chapter 09) against the
torch reference, on fresh random inputs: scattered blocks, GQA groups, contexts that end
inside a block (whose tail holds NaN), a context of one key, several splits (more than some
contexts have blocks), and an output buffer full of NaN that every row must overwrite.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set in conftest) in
float32; on a GPU at Qwen3-0.6B's heads in bfloat16 against a float32 reference of the
same inputs (atol 2e-2, as in test_kernels.py).
"""
import pytest
import torch

from minivllm.context import Context
from minivllm.ops.attention import varlen_attention_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = dict(atol=2e-2, rtol=2e-2) if CUDA else dict(atol=1e-4, rtol=1e-4)
# (heads, kv_heads, head_dim, block_size)
SHAPES = [(16, 8, 128, 16), (32, 4, 64, 16)] if CUDA else [(8, 2, 16, 4), (6, 1, 32, 8), (4, 4, 16, 4)]


def random_paged_cache(lens, kv_heads, head_dim, block_size, spare=3):
    """A K/V pool with random contents, its rows past each context NaN, and block tables
    that scatter each sequence through it."""
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + spare
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks).tolist()
    tables, i = [], 0
    for n, b in zip(lens, blocks):
        tables.append(perm[i : i + b] + [-1] * (max(blocks) - b))
        tail = n % block_size
        if tail:
            k_cache[perm[i + b - 1], tail:] = float("nan")
            v_cache[perm[i + b - 1], tail:] = float("nan")
        i += b
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=DEVICE)


def reference(q, k_cache, v_cache, tables, lens, scale):
    """The chapter 05 op in float32 over the same cache (nothing new to store)."""
    i32 = dict(dtype=torch.int32, device=DEVICE)
    ctx = Context(is_prefill=False, cu_seqlens_q=torch.arange(len(lens) + 1, **i32),
                  slot_mapping=torch.full((len(lens),), -1, device=DEVICE), context_lens=torch.tensor(lens, **i32),
                  block_tables=tables)
    unused = q[:, : k_cache.shape[2]].float()
    return varlen_attention_reference(q.float(), unused, unused, k_cache.float(), v_cache.float(), ctx, scale)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_flash_decode_matches_the_reference(heads, kv_heads, head_dim, block_size, num_splits):
    from minivllm.kernels.flash_decode import flash_decode

    lens = [1, 37, 5, 300, 16] if CUDA else [1, 13, 5, 22, 8]
    if CUDA:
        lens += torch.randint(1, 2048, (27,)).tolist()
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size)
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    out = torch.full_like(q, float("nan"))  # every row must be written
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    assert flash_decode(q, k_cache, v_cache, tables, context_lens, head_dim**-0.5, num_splits, out=out) is out
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5), **TOL)


def test_flash_decode_agrees_with_the_tuned_kernel():
    """The two kernels chapter 09 times against each other compute the same attention."""
    from minivllm.kernels.flash_decode import flash_decode
    from minivllm.kernels.paged_attention import paged_decode_attention

    heads, kv_heads, head_dim, block_size = SHAPES[0]
    lens = [200, 3, 77] if CUDA else [40, 3, 17]
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size)
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    tuned = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, head_dim**-0.5, max(lens))
    torch.testing.assert_close(flash_decode(q, k_cache, v_cache, tables, context_lens, head_dim**-0.5).float(),
                               tuned.float(), **TOL)


def test_flash_decode_rejects_what_it_cannot_read():
    from minivllm.kernels.flash_decode import flash_decode

    k_cache, v_cache, tables = random_paged_cache([5], 2, 16, 4)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="whole GQA groups"):
        flash_decode(torch.randn(1, 3, 16, device=DEVICE, dtype=DTYPE), k_cache, v_cache, tables, lens, 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        flash_decode(torch.randn(1, 16, 4, device=DEVICE, dtype=DTYPE).transpose(1, 2), k_cache, v_cache, tables,
                     lens, 0.25)
