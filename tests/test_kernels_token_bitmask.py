"""The token-bitmask kernel (chapter 18) against its torch reference on fresh random inputs.

On the CPU it runs in Triton's interpreter at small shapes; on a GPU (``gpu`` marker) at real
ones: Qwen3's 151,936-token vocabulary (not a multiple of the kernel's block), batches up to
256, float32 and bfloat16 logits. The output is compared exactly (the kernel writes -inf or
leaves a logit alone: there is no rounding), and the logits start random, so a row the kernel
skipped or a wrong bit shows.
"""
import pytest
import torch

from minivllm.ops.token_bitmask import apply_token_bitmask, apply_token_bitmask_reference


def random_case(rows: int, vocab: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    # Some rows sparse (a grammar that allows a few tokens), one without a grammar (all ones).
    sparse = torch.rand(rows, words, generator=g) < 0.9
    bitmask[sparse[:, 0]] &= torch.randint(0, 2, (int(sparse[:, 0].sum()), words), generator=g, dtype=torch.int32) << 5
    bitmask[0] = -1
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    return logits.to(device), bitmask.to(device)


def check(rows, vocab, dtype, device, seed):
    from minivllm.kernels.token_bitmask import apply_token_bitmask as kernel

    logits, bitmask = random_case(rows, vocab, dtype, device, seed)
    expected = apply_token_bitmask_reference(logits.clone(), bitmask)
    out = kernel(logits.clone(), bitmask)
    assert torch.equal(out, expected)
    assert torch.equal(out[0], logits[0])  # the row without a grammar is untouched
    assert not bool(torch.isnan(out).any())
    if rows > 1:  # the other rows have a grammar: something was masked
        assert bool(torch.isinf(out[1:]).any())


@pytest.mark.parametrize("rows,vocab", [(1, 31), (2, 31), (3, 1024), (4, 1500), (2, 8192)])
def test_token_bitmask_kernel_small_shapes(rows, vocab):
    check(rows, vocab, torch.float32, "cuda" if torch.cuda.is_available() else "cpu", seed=rows * vocab)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
@pytest.mark.parametrize("vocab", [151936, 8192, 32000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_bitmask_kernel_gpu(rows, vocab, dtype):
    check(rows, vocab, dtype, "cuda", seed=rows + vocab)
    # And through the op: the dispatch rule picks the kernel on a CUDA tensor.
    logits, bitmask = random_case(rows, vocab, dtype, "cuda", seed=rows)
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask), apply_token_bitmask_reference(logits, bitmask))


def test_op_refuses_a_bitmask_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"bitmask must be int32 \[2, 4\]"):
        apply_token_bitmask(torch.zeros(2, 100), torch.zeros(2, 3, dtype=torch.int32))
