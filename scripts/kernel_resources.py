#!/usr/bin/env python
"""Registers, spills and shared memory of the decode step's Triton kernels, as compiled for a
Hopper GPU (sm_90), on any machine: Triton compiles for a target without one, and its wheel
carries ptxas and cuobjdump. No GPU needed.

A multiprocessor has 65,536 registers, 228 KB of shared memory and room for 64 warps: a
kernel whose programs take 128 registers a thread on 4 warps and 74 KB of shared memory fits
three programs on one, and a grid of 1,600 such programs runs in about four waves on 132
multiprocessors. Registers past 255 spill to local memory (``spill``: bytes a thread). Each
kernel is compiled as a launch of these shapes would compile it (``aligned``). ``programs_per_sm``: how many programs
a multiprocessor holds at once by registers, shared memory and warps (the register
allocator's granularity left out: an upper bound). The shapes are Qwen3-0.6B's (16 query and
8 K/V heads of 128, hidden 1,024, intermediate 3,072), bfloat16, the tiles the package picks.

    python scripts/kernel_resources.py [--out FILE.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from minivllm.kernels import gemv, paged_attention  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
REGISTERS, SHARED, MAX_WARPS, MAX_PROGRAMS = 65536, 228 * 1024, 64, 32


def signature(kernel, pointers: dict, constants: dict) -> dict:
    """Every argument typed: pointers bf16 unless ``pointers`` says otherwise, scalars int32."""
    sig = {name: pointers.get(name, "*bf16") if name.endswith("_ptr") else "i32" for name in kernel.arg_names}
    sig.update({k: v for k, v in pointers.items() if not k.endswith("_ptr")})
    return {**sig, **{name: "constexpr" for name in constants}}


def aligned(kernel, sig: dict) -> dict:
    """What a launch tells the compiler about the arguments of these shapes: every pointer
    16-byte aligned and every integer a multiple of 16 (Qwen3-0.6B's sizes and strides are),
    but those the kernel declares ``do_not_specialize``. Without it the compiler cannot
    vectorise a load, and the registers it counts are another kernel's."""
    unknown = {p.name for p in kernel.params if p.do_not_specialize}
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
            if name not in unknown and (sig[name].startswith("*") or sig[name] == "i32")}


def resources(kernel, pointers: dict, constants: dict, num_warps: int, num_stages: int) -> dict:
    """Compile for sm_90 and read the cubin's resource usage."""
    sig = signature(kernel, pointers, constants)
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constants, attrs=aligned(kernel, sig)),
                              target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(item.split(":") for item in next(line for line in usage.splitlines() if "REG:" in line).split()
                  if ":" in item and item.split(":")[1].isdigit())
    regs, shared = int(fields["REG"]), compiled.metadata.shared
    per_sm = min(REGISTERS // (regs * 32 * num_warps), MAX_WARPS // num_warps, MAX_PROGRAMS,
                 SHARED // shared if shared else MAX_PROGRAMS)
    return {"warps": num_warps, "stages": num_stages, "registers": regs, "spill": int(fields["STACK"]),
            "shared": shared, "programs_per_sm": per_sm}


def decode_attention(direct: bool, block_n: int, warps: int, stages: int) -> dict:
    pointers = {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "part_out_ptr": "*bf16" if direct else "*fp32",
                "part_lse_ptr": "*fp32", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
                "cu_seqlens_ptr": "*i32", "slot_ptr": "*i64", "scale": "fp32"}
    constants = dict(GROUP=2, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=block_n, PRECISION="tf32",
                     USE_PDL=True, DIRECT=direct, NEW_KV=True, DECODE=True, BLOCK_Q=1, BLOCK_QK=16)
    return resources(paged_attention._decode_kernel, pointers, constants, warps, stages)


def gemv_kernel(rows: int, config: dict, gated: bool) -> dict:
    constants = dict(HAS_BIAS=False, HAS_SCALE=False, GATED=gated, USE_PDL=True, PRECISION="tf32",
                     DOT=config["DOT"], BLOCK_M=16 if config["DOT"] else triton.next_power_of_2(rows),
                     BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"])
    return resources(gemv._gemv_kernel, {"s_ptr": "*fp32"}, constants, config["num_warps"], config["num_stages"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="also write the table here (JSON)")
    args = parser.parse_args()
    hidden, heads, kv_heads, head_dim, inter = 1024, 16, 8, 128, 3072
    decode = paged_attention.decode_config(head_dim)
    rows = []
    for direct in (False, True):
        rows.append({"kernel": f"decode attention ({'one split' if direct else 'splits'}), BLOCK_N {decode['BLOCK_N']}",
                     **decode_attention(direct, decode["BLOCK_N"], decode["num_warps"], decode["num_stages"])})
    matrices = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden, False), "o": (hidden, heads * head_dim, False),
                "gate/up": (inter, hidden, True), "down": (hidden, inter, False)}
    for batch in (1, 8):
        for name, (n, k, gated) in matrices.items():
            config = (gemv.gated_config if gated else gemv.gemv_config)(n, k, batch)
            tile = f"{config['BLOCK_N']} x {config['BLOCK_K']}{' (tensor cores)' if config['DOT'] else ''}"
            rows.append({"kernel": f"gemv {name}, {batch} row{'s' if batch > 1 else ''}, tile {tile}",
                         **gemv_kernel(batch, config, gated)})
    width = max(len(r["kernel"]) for r in rows)
    print(f"{'kernel (sm_90)':{width}}  warps  registers  spill (B)  shared (B)  programs/SM")
    for r in rows:
        print(f"{r['kernel']:{width}}  {r['warps']:5}  {r['registers']:9}  {r['spill']:9}  {r['shared']:10}  "
              f"{r['programs_per_sm']:11}")
    if args.out:
        Path(args.out).write_text(json.dumps({"target": "sm_90", "triton": triton.__version__, "kernels": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
