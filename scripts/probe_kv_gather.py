"""How fast the decode attention's gather can read a paged KV cache, by layout, with nothing
else in the kernel (chapter 20's open question: the fp8 decode attention reads at about 72%
of the DRAM bandwidth where the bf16 one reaches 92%, and converting the elements is not
what holds it: benchmarks/README.md).

One program per (sequence, K/V head), as the decode kernel's, walks its sequence's keys
BLOCK_N at a time through a shuffled block table, loads each tile as the kernel does (one
block id a key, clamped) and takes it into a 16-row dot, as the kernel does (so that the
compiler pipelines the loads the same way), with no softmax. Five layouts of one K/V
head's rows within a 16-token cache block, and a second way to read one of them:

- ``bf16 keys``: [block, slot, head, dim], the engine's layout: 16 runs of 256 bytes, 2 KB
  apart;
- ``fp8 keys``: the same in one byte: 16 runs of 128 bytes, 1 KB apart;
- ``fp8 keys, head-major``: [block, head, slot, dim]: one run of 2 KB;
- ``fp8 values``: the engine's float8 values, [block, head, dim, slot] read as
  [dim, keys]: one run of 2 KB, loaded 16 bytes a key run (a warp takes 64 bytes of each of
  eight blocks);
- ``fp8 values, whole blocks``: the same memory read a block's 2 KB chunk at a time (a warp
  takes 512 contiguous bytes), rearranged into [dim, keys] in registers;
- ``bf16 keys, head-major``: one run of 4 KB.

If the float8 keys' 128-byte runs read slower than the others, the fp8 cache wants its keys
head-major too; if the whole-block read beats the values' 16-byte runs, the kernel wants it.
Reports GB/s and the share of the copy bandwidth measured in the same run. On an H100 at
`bb06619` (benchmarks/h100/kv_gather_bb06619.json) the values' 16-byte runs read at 54% and
whole blocks at 82%, the fp8 keys at 78% (79% head-major): the kernel reads its float8
values a block at a time since `c7b721a`, and the keys stay as they are.

    python scripts/probe_kv_gather.py [--out FILE.json]
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minivllm.bench.roofline import measure_ceilings, time_cuda  # noqa: E402

SEQS, CONTEXT, KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N = 256, 1024, 8, 128, 16, 128


@triton.jit
def _gather_kernel(cache_ptr, bt_ptr, q_ptr, out_ptr, num_keys, stride_bt, stride_cb, stride_cs, stride_ch,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KEY_MAJOR: tl.constexpr,
                   WHOLE_BLOCKS: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    r = tl.arange(0, 16)
    # Each tile goes into a 16-row dot, as the attention's does: the compiler pipelines a
    # load that feeds the tensor cores (through shared memory), which a plain sum would not.
    q = tl.load(q_ptr + r[:, None] * HEAD_DIM + d[None, :])  # [16, HEAD_DIM] float16
    p = tl.load(q_ptr + r[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])  # [16, BLOCK_N] float16
    last_block = (num_keys - 1) // BLOCK_SIZE
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    acc_t = tl.zeros([16, HEAD_DIM], tl.float32)
    for n0 in range(0, num_keys, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        block = tl.load(bt_ptr + b * stride_bt + tl.minimum(n // BLOCK_SIZE, last_block)).to(tl.int64)
        rows = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch  # [BLOCK_N]
        if KEY_MAJOR:
            tile = tl.load(cache_ptr + rows[:, None] + d[None, :])  # [BLOCK_N, HEAD_DIM]
            acc = tl.dot(q, tl.trans(tile.to(tl.float16)), acc)
        elif not WHOLE_BLOCKS:
            # Keys contiguous (the float8 values' layout): [HEAD_DIM, BLOCK_N], runs of BLOCK_SIZE keys.
            RUN: tl.constexpr = BLOCK_SIZE if BLOCK_SIZE < BLOCK_N else BLOCK_N
            rows = tl.max_contiguous(tl.multiple_of(rows, RUN), RUN)
            tile = tl.load(cache_ptr + rows[None, :] + d[:, None] * BLOCK_SIZE)
            acc_t = tl.dot(p, tl.trans(tile.to(tl.float16)), acc_t)
        else:
            # The same layout read a block's [HEAD_DIM, BLOCK_SIZE] chunk at a time, each one
            # contiguous run (a warp reads 512 bytes of one block, not 64 of eight), then
            # rearranged into [HEAD_DIM, BLOCK_N] in registers.
            NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
            j = n0 // BLOCK_SIZE + tl.arange(0, NB)
            blocks = tl.load(bt_ptr + b * stride_bt + tl.minimum(j, last_block)).to(tl.int64)
            chunk = tl.arange(0, HEAD_DIM * BLOCK_SIZE)
            tile = tl.load(cache_ptr + (blocks * stride_cb + kv_head * stride_ch)[:, None] + chunk[None, :])
            tile = tl.reshape(tl.permute(tl.reshape(tile, [NB, HEAD_DIM, BLOCK_SIZE]), (1, 0, 2)), [HEAD_DIM, BLOCK_N])
            acc_t = tl.dot(p, tl.trans(tile.to(tl.float16)), acc_t)
    out = tl.sum(acc, axis=1) + tl.sum(acc_t, axis=1)
    tl.store(out_ptr + (b * tl.num_programs(1) + kv_head) * 16 + r, out)


def layouts() -> dict:
    """name: (dtype, the strides of [block, slot, head] (dim: 1, or BLOCK_SIZE where the keys are
    contiguous), key-major: True, False, or None for the keys-contiguous layout read a whole
    block's chunk at a time)."""
    bs, h, dim = BLOCK_SIZE, KV_HEADS, HEAD_DIM
    standard = (bs * h * dim, h * dim, dim)
    head_major = (bs * h * dim, dim, bs * dim)
    return {
        "bf16 keys": (torch.bfloat16, standard, True),
        "fp8 keys": (torch.float8_e4m3fn, standard, True),
        "fp8 keys, head-major": (torch.float8_e4m3fn, head_major, True),
        "fp8 values (key-contiguous)": (torch.float8_e4m3fn, (bs * h * dim, 1, dim * bs), False),
        "fp8 values, whole blocks": (torch.float8_e4m3fn, (bs * h * dim, 1, dim * bs), None),
        "bf16 keys, head-major": (torch.bfloat16, head_major, True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    bandwidth = measure_ceilings()["copy_bandwidth_bytes_per_s"]
    num_blocks = SEQS * CONTEXT // BLOCK_SIZE
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(SEQS, -1)
    out = torch.empty(SEQS, KV_HEADS, 16, device="cuda")
    q = torch.randn(16 * max(HEAD_DIM, BLOCK_N), device="cuda").half()
    rows = []
    for name, (dtype, strides, key_major) in layouts().items():
        memory = torch.randn(num_blocks * BLOCK_SIZE * KV_HEADS * HEAD_DIM, device="cuda").to(dtype)
        cache_bytes = memory.numel() * memory.element_size()

        def launch():
            _gather_kernel[(SEQS, KV_HEADS)](memory, tables, q, out, CONTEXT, tables.stride(0), *strides,
                                             HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
                                             KEY_MAJOR=bool(key_major), WHOLE_BLOCKS=key_major is None, num_warps=4,
                                             num_stages=3)

        seconds = time_cuda(launch, warmup=3, repeat=20)
        row = {"layout": name, "seconds": seconds, "bytes": cache_bytes, "gb_per_s": cache_bytes / seconds / 1e9,
               "percent_of_copy_bandwidth": 100 * cache_bytes / seconds / bandwidth}
        rows.append(row)
        print(f"{name:30s} {seconds * 1e6:7.1f} us  {row['gb_per_s']:6.0f} GB/s  {row['percent_of_copy_bandwidth']:5.1f}%",
              flush=True)
        del memory
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bandwidth_bytes_per_s":
                                              bandwidth, "shape": [SEQS, CONTEXT, KV_HEADS, HEAD_DIM, BLOCK_SIZE],
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
