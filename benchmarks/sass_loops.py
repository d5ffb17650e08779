"""Instruction counts of the Triton kernels' tile loops, compiled for Hopper (sm_90) on any
machine: no GPU needed (triton ships ptxas and nvdisasm). For each kernel, without and
with dropout: registers, stack bytes (spills), and in one iteration of its unmasked tile
loop the instructions, the spill loads/stores and the opcodes that changed most.

    python benchmarks/sass_loops.py [--head-dim 128] [--kernels fwd dq dkdv] [--sparse]

A static proxy, not a timing (benchmarks/NOTES.md, "Dropout, second round", sets it beside
measured times): bf16, 32 heads, seqlen 32k, non-causal, no segments, the tiles of
fwd_config / bwd_config, arguments specialized as a launch on contiguous tensors would be.
The backward kernels are issue-bound on an H200, so their loop length tracks their time.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile, whatever the caller's environment says

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ringflash.kernels.triton import bwd, config, fwd  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = {"O": "*bf16", "LSE": "*fp32", "DELTA": "*fp32", "QSEG": "*i32", "KSEG": "*i32",
            **{n: "*fp32" for n in ("O_IN", "DQ_IN", "DK_IN", "DV_IN")},  # running sums
            "RANGES": "*i32", **{n: "*i32" for n in ("COUNTS", "INDEX", "ORDER")},
            **{n: "*bf16" for n in ("Q", "K", "V", "DO", "DK", "DV", "DQ", "Q2", "K2", "V2", "DO2")},
            "ARRIVED": "*i32"}
ONES = ("GROUP", "pos_stride")  # equal to 1 at these launches: Triton specializes them


def compile_kernel(which: str, head_dim: int, dropout: bool, sparse: bool = False,
                   band: bool = False, segments: bool = False, accumulate: bool = False,
                   positional: bool = False):
    """The compiled kernel and its launch options (sparse: reading block-mask index lists;
    band, segments: the masked variants, positional: the band on global positions;
    accumulate: merging into running sums)."""
    if which == "fwd":
        fn, cfg = fwd._fwd_kernel, config.fwd_config(head_dim, torch.bfloat16)
    else:
        dkdv_cfg, dq_cfg = config.bwd_config(head_dim, torch.bfloat16, sparse,
                                             dropout and not (sparse or band or segments))
        fn, cfg = (bwd._dkdv_kernel, dkdv_cfg) if which == "dkdv" else (bwd._dq_kernel, dq_cfg)
    bd = config.block_d(head_dim)
    column_ids = segments and which != "dkdv"  # as fwd() and bwd() launch them
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=bd, BAND=band, SEGMENTS=segments, SPARSE=sparse,
                  LIST_STAGES=config.list_stages(cfg, sparse, column_ids), DROPOUT=dropout,
                  GROUPED=dropout, ACCUMULATE=accumulate, PRECISION="tf32", POSITIONAL=positional,
                  **{n: 1 for n in ONES},
                  **{n: v for n, v in cfg.items() if n not in ("num_warps", "num_stages")})
    consts.update({p.name: p.default for p in fn.params  # constexprs a launch may leave out
                   if p.is_constexpr and p.has_default and p.name not in consts and p.name != "TMA"})
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts or name == "TMA":
            signature[name] = "constexpr"
        elif which == "fwd" and name in ("Q", "K", "V", "K2", "V2"):  # TMA descriptors over (B, S, H, D)
            rows = cfg["BLOCK_M"] if name == "Q" else cfg["BLOCK_N"]
            signature[name] = f"tensordesc<bf16[1,{rows},1,{bd}]>"
        elif name in POINTERS:
            signature[name], attrs[(i,)] = POINTERS[name], [["tt.divisibility", 16]]
        elif name in ("qk_scale", "sm_scale", "drop_scale"):
            signature[name] = "fp32"
        elif name == "seed":
            signature[name] = "i64"
        else:  # strides, sizes, positions: multiples of 16 here
            signature[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
    if which == "fwd":
        consts["TMA"] = True
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    src = ASTSource(fn, signature, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), cfg


def _tool(name: str, cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(BIN, name), *args, f.name], capture_output=True,
                              text=True, check=True).stdout


def tile_buffers(kernel) -> list[int]:
    """Depths of the kernel's multi-buffered shared-memory tiles, in program order (its
    loops'): one entry per pipelined tile load, e.g. [3, 3] for a loop that prefetches K and
    V two tiles ahead."""
    allocs = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x[\dx]*x(?:bf16|f16)",
                        kernel.asm["ttgir"])
    return [int(n) for n in allocs if int(n) > 1]


def tile_loop(sass: str) -> list[str]:
    """Opcodes of the shortest loop that issues matrix products: the unmasked tile loop."""
    ops, labels = [], {}
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ops)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\S*)(.*?);", line):
            ops.append((m.group(1), m.group(2) + m.group(3)))
    loops = []
    for i, (op, rest) in enumerate(ops):
        target = re.search(r"\((\.L_x_\d+)\)", rest) if op == "BRA" else None
        if target and labels.get(target.group(1), i + 1) <= i:
            body = [o for o, _ in ops[labels[target.group(1)]:i + 1]]
            if "HGMMA" in body:
                loops.append(body)
    return min(loops, key=len)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kernels", nargs="+", default=["fwd", "dq", "dkdv"], choices=["fwd", "dq", "dkdv"])
    p.add_argument("--sparse", action="store_true", help="also the block-sparse kernels (index lists)")
    args = p.parse_args(argv)
    variants = [("plain", False, False), ("dropout", True, False)] + [("sparse", False, True)] * args.sparse
    for which in args.kernels:
        counts = {}
        for name, dropout, sparse in variants:
            kernel, cfg = compile_kernel(which, args.head_dim, dropout, sparse)
            usage = _tool("cuobjdump", kernel.asm["cubin"], "--dump-resource-usage")
            regs, stack = (re.search(rf"{key}:(\d+)", usage).group(1) for key in ("REG", "STACK"))
            loop = collections.Counter(tile_loop(_tool("nvdisasm", kernel.asm["cubin"], "-c")))
            counts[name] = loop
            elems = cfg["BLOCK_M"] * cfg["BLOCK_N"] // (32 * cfg["num_warps"])
            print(f"{which:5s} {name:7s} {cfg['BLOCK_M']}x{cfg['BLOCK_N']} "
                  f"{cfg['num_warps']} warps: {regs} registers, {stack} B stack; tile loop "
                  f"{sum(loop.values())} instructions per thread ({elems} elements), "
                  f"spills {loop['LDL'] + loop['STL']}; tile buffers {tile_buffers(kernel)}")
        diff = counts["dropout"].copy()
        diff.subtract(counts["plain"])
        print("      added: " + " ".join(f"{op} {n:+d}" for op, n in diff.most_common(8) if n), flush=True)


if __name__ == "__main__":
    main()
