"""Instruction counts of the Triton kernels' tile loops, compiled for Hopper (sm_90) on any
machine: no GPU needed (triton ships ptxas, cuobjdump and nvdisasm).

The kernels are compiled through the library's own launchers (kernels/triton/launch.py),
with a stand-in driver whose target is sm_90 and whose launches only compile: each variant
is specialized exactly as a launch on these tensors would specialize it.

    python tools/sass_loops.py [--head-dim 128] [--kernels fwd dq dkdv] [--sparse]

prints, for each kernel without and with dropout (and under a block mask): registers,
stack bytes (spills), and in one iteration of its unmasked tile loop the instructions, the
spill loads/stores and the opcodes that changed most. A static proxy, not a timing
(docs/notes/dropout.md, "Dropout, second round", sets it beside measured times): bf16, 32
heads, non-causal, no segments, the tiles of config.fwd_config / bwd_config. The backward
kernels are issue-bound on an H200, so their loop length tracks their time.

    python tools/sass_loops.py --fingerprint OUT.json
    python tools/sass_loops.py --compare BEFORE.json AFTER.json

record every launch variant of a matrix (dtypes, head dims, GQA, every mask, block lists,
accumulation, a sequence in two parts) with its registers, stack and the opcodes of each
of its tile loops, and compare two such records: the check that a change to the kernels'
source left the compiled loops as they were.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile, whatever the caller's environment says

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from ringflash.kernels import Arrival, PairMask  # noqa: E402
from ringflash.kernels import triton as kernels  # noqa: E402
from ringflash.kernels.masks import Blocks  # noqa: E402
from ringflash.kernels.triton import config  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
KERNELS = {"fwd": "_fwd_kernel", "dq": "_dq_kernel", "dkdv": "_dkdv_kernel"}


class _Hopper:
    """A driver whose current device is an sm_90 GPU that is never used."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _launcher_source(kernel) -> str:
    """The C source of the CUDA launcher Triton builds for ``kernel`` at its first launch
    (the steps of triton's CudaLauncher that need no GPU): a kernel that compiles may still
    take arguments its launcher cannot (triton 3.6: a tensor descriptor inside a tuple)."""
    from triton.backends.nvidia.driver import make_launcher
    src = kernel.src
    constants = {((src.fn.arg_names.index(i),) if isinstance(i, str) else i): value
                 for i, value in getattr(src, "constants", {}).items()}
    return make_launcher(constants, dict(src.signature), getattr(kernel.metadata, "tensordesc_meta", None))


@contextlib.contextmanager
def compiling():
    """Inside, every Triton launch compiles for sm_90 instead of running (and builds its
    launcher's source); yields the list of (kernel function name, compiled kernel) the
    launches made, in order."""
    made, run, active = [], JITFunction.run, driver._active

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        _launcher_source(kernel)
        made.append((self.fn.__name__, kernel))
        return kernel

    driver.set_active(_Hopper())
    JITFunction.run = compile_only
    try:
        yield made
    finally:
        JITFunction.run = run
        driver._active = active  # not reset_active(): without a GPU there is no default driver


def _inputs(head_dim: int, dtype=torch.bfloat16, seqlen: int = 1024, heads: int = 32, kv_heads: int = 32):
    """q, k, v, dout, out (CPU, never read by a compile) and lse, delta: contiguous, so
    every stride and length is a multiple of 16, as in a launch at 32k tokens."""
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, seqlen, heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, seqlen, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    stats = torch.zeros(1, heads, seqlen)
    return q, k, v, dout, torch.empty_like(q), stats, stats.clone()


def _mask(seqlen: int, heads: int, dropout=False, sparse=False, band=False, segments=False,
          positional=False, sparse_heads=False) -> PairMask:
    gen = torch.Generator().manual_seed(1)
    ids = None
    if segments:
        ids = torch.zeros(1, seqlen, dtype=torch.int32)
        ids[:, seqlen // 3:] = 1
        ids[:, 2 * seqlen // 3:] = 2
        ids[:, seqlen - seqlen // 8:] = -1
    n = seqlen // 128
    blocks = Blocks(torch.rand(heads if sparse_heads else 1, n, n, generator=gen) < 0.5) if sparse else None
    lo, hi = (-300, 0) if positional else (None, 0 if band else None)
    return PairMask(lo, hi, ids, ids, 0.1 if dropout else 0.0, 7, (128, 0, 1, 384) if positional else (0, 0, 1, 0),
                    blocks, positional)


def _launch(which: str, q, k, v, dout, out, lse, delta, mask: PairMask, accumulate=False):
    """The launcher calls that compile kernel ``which`` (fwd, dq, dkdv, or all of them)."""
    common = dict(softmax_scale=q.shape[-1] ** -0.5, mask=mask, accumulate=accumulate)
    if which in ("fwd", "all"):
        kernels.fwd(q, k, v, out, lse, **common)
    if which in ("dq", "all"):
        kernels.bwd(dout, q, k, v, lse, delta, torch.zeros(q.shape), None, None, **common)
    if which in ("dkdv", "all"):
        kernels.bwd(dout, q, k, v, lse, delta, None, torch.zeros(k.shape), torch.zeros(v.shape), **common)
    if which == "all":
        kernels.delta(out, dout)


def compile_kernel(which: str, head_dim: int, dropout: bool = False, sparse: bool = False,
                   band: bool = False, segments: bool = False, accumulate: bool = False,
                   positional: bool = False):
    """Kernel ``which`` (fwd, dq, dkdv) compiled for sm_90 as its launcher would launch it
    (sparse: reading block-mask index lists; band: causal; segments: packed documents;
    positional: a band on global positions; accumulate: merging into running sums), and
    its tile config."""
    q, k, v, dout, out, lse, delta = _inputs(head_dim)
    mask = _mask(q.shape[1], q.shape[2], dropout, sparse, band, segments, positional)
    with compiling() as made:
        _launch(which, q, k, v, dout, out, lse, delta, mask, accumulate)
    kernel = next(kernel for name, kernel in made if name == KERNELS[which])
    if which == "fwd":
        cfg = config.fwd_config(head_dim, q.dtype)
    else:
        dkdv_cfg, dq_cfg = config.bwd_config(head_dim, q.dtype, sparse, dropout and not (sparse or band or segments))
        cfg = dkdv_cfg if which == "dkdv" else dq_cfg
    return kernel, cfg


def _tool(name: str, cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(BIN, name), *args, f.name], capture_output=True,
                              text=True, check=True).stdout


def resources(kernel) -> tuple[int, int]:
    """(registers, stack bytes) of a compiled kernel."""
    usage = _tool("cuobjdump", kernel.asm["cubin"], "--dump-resource-usage")
    return tuple(int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))


def tile_buffers(kernel) -> list[int]:
    """Depths of the kernel's multi-buffered shared-memory tiles, in program order (its
    loops'): one entry per pipelined tile load, e.g. [3, 3] for a loop that prefetches K and
    V two tiles ahead."""
    allocs = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x[\dx]*x(?:bf16|f16)",
                        kernel.asm["ttgir"])
    return [int(n) for n in allocs if int(n) > 1]


def tile_loops(sass: str) -> list[list[str]]:
    """The opcodes of every loop that issues matrix products, in program order."""
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
    return loops


def tile_loop(sass: str) -> list[str]:
    """Opcodes of the shortest loop that issues matrix products: the unmasked tile loop."""
    return min(tile_loops(sass), key=len)


# ----------------------------------------------------------------------------- the summary


def summary(head_dim: int, which_kernels, sparse: bool) -> None:
    variants = [("plain", False, False), ("dropout", True, False)] + [("sparse", False, True)] * sparse
    for which in which_kernels:
        counts = {}
        for name, dropout, sparse_ in variants:
            kernel, cfg = compile_kernel(which, head_dim, dropout, sparse_)
            regs, stack = resources(kernel)
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


# ----------------------------------------------------------------------------- fingerprints


def _matrix():
    """(name, launcher calls) of every launch variant the fingerprint records."""
    for dtype, d in [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.bfloat16, 256), (torch.float16, 128),
                     (torch.float32, 128), (torch.bfloat16, 36)]:
        yield f"{str(dtype)[6:]}-d{d}", dict(head_dim=d, dtype=dtype), {}, {}
    yield "gqa", dict(head_dim=128, kv_heads=8), {}, {}
    yield "ragged-causal", dict(head_dim=128, seqlen=1000), dict(band=True), {}
    for name, flags in [("causal", dict(band=True)), ("segments", dict(segments=True)),
                        ("segments-causal", dict(segments=True, band=True)), ("positional", dict(positional=True)),
                        ("dropout", dict(dropout=True)), ("dropout-causal", dict(dropout=True, band=True)),
                        ("sparse", dict(sparse=True)), ("sparse-heads-causal", dict(sparse=True, sparse_heads=True,
                                                                                   band=True)),
                        ("sparse-segments", dict(sparse=True, segments=True, band=True)),
                        ("sparse-dropout", dict(sparse=True, dropout=True))]:
        yield name, dict(head_dim=128), flags, {}
    yield "accumulate-causal", dict(head_dim=128), dict(band=True), dict(accumulate=True)
    yield "joined", dict(head_dim=128), dict(sparse=True), dict(joined=True)
    yield "joined-arriving", dict(head_dim=128), dict(sparse=True), dict(joined=True, arriving=True)


def _joined_launches(q, k, v, dout, out, lse, delta, mask, arriving: bool, split: int | None = None) -> None:
    """A sequence held in two tensors (pair.Joined), its first part ``split`` rows long (half
    by default): the forward over joined keys (waiting for the second part with
    ``arriving``), dQ over joined keys, dK/dV over joined queries."""
    half = q.shape[1] // 2 if split is None else split
    halves = [(t[:, :half].contiguous(), t[:, half:].contiguous()) for t in (q, k, v, dout)]
    (q1, q2), (k1, k2), (v1, v2), (d1, d2) = halves
    flags = torch.zeros(k.shape[2], dtype=torch.int32) if arriving else None
    common = dict(softmax_scale=q.shape[-1] ** -0.5, mask=mask, accumulate=False)
    kernels.fwd(q, k1, v1, out, lse, tail=(k2, v2), arrival=Arrival(1, flags, 1, 1), **common)
    kernels.bwd(dout, q, k1, v1, lse, delta, torch.zeros(q.shape), None, None, tails=(None, (k2, v2)), **common)
    kernels.bwd(d1, q1, k, v, lse, delta, None, torch.zeros(k.shape), torch.zeros(v.shape),
                tails=((q2, d2), None), **common)


def fingerprint(path: str) -> None:
    """Compile the matrix; write {variant/kernel: registers, stack, shared memory,
    instructions, and each tile loop's opcode counts} to ``path``."""
    record = {}
    for name, shape, flags, how in _matrix():
        q, k, v, dout, out, lse, delta = _inputs(**shape)
        mask = _mask(q.shape[1], q.shape[2], **flags)
        with compiling() as made:
            if how.get("joined"):
                _joined_launches(q, k, v, dout, out, lse, delta, mask, how.get("arriving", False))
            else:
                _launch("all", q, k, v, dout, out, lse, delta, mask, how.get("accumulate", False))
        for kernel_name, kernel in made:
            sass = _tool("nvdisasm", kernel.asm["cubin"], "-c")
            regs, stack = resources(kernel)
            key = f"{name}/{kernel_name}"
            record[key] = dict(registers=regs, stack=stack, shared=kernel.metadata.shared,
                               instructions=sass.count(";"),
                               loops=[dict(collections.Counter(op for op in loop if op != "NOP"))
                                      for loop in tile_loops(sass)])
            print(f"{key:40s} {regs:3d} registers, {stack:4d} B stack, tile loops "
                  f"{[sum(loop.values()) for loop in record[key]['loops']]}", flush=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def compare(before_path: str, after_path: str) -> int:
    """Print the variants whose registers, stack or tile loops differ; returns how many."""
    with open(before_path) as f:
        before = json.load(f)
    with open(after_path) as f:
        after = json.load(f)
    changed = 0
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a is None or b is None:
            print(f"{key:40s} only {'after' if a is None else 'before'}")
            changed += 1
            continue
        if (a["registers"], a["stack"], a["loops"]) == (b["registers"], b["stack"], b["loops"]):
            continue
        changed += 1
        sizes = [sum(loop.values()) for loop in a["loops"]], [sum(loop.values()) for loop in b["loops"]]
        deltas = []
        for x, y in zip(a["loops"], b["loops"]):
            delta = collections.Counter(y)
            delta.subtract(x)
            deltas.append(" ".join(f"{op}{n:+d}" for op, n in sorted(delta.items()) if n) or "same")
        print(f"{key:40s} registers {a['registers']}->{b['registers']}, stack {a['stack']}->{b['stack']}, "
              f"tile loops {sizes[0]}->{sizes[1]}: {'; '.join(deltas)}")
    total = len(set(before) | set(after))
    print(f"{total - changed} of {total} variants unchanged (registers, stack, tile loops)")
    return changed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kernels", nargs="+", default=["fwd", "dq", "dkdv"], choices=["fwd", "dq", "dkdv"])
    p.add_argument("--sparse", action="store_true", help="also the block-sparse kernels (index lists)")
    p.add_argument("--fingerprint", metavar="OUT", help="compile every launch variant; write them to OUT (JSON)")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two fingerprints")
    args = p.parse_args(argv)
    if args.compare:
        sys.exit(1 if compare(*args.compare) else 0)
    if args.fingerprint:
        fingerprint(args.fingerprint)
    else:
        summary(args.head_dim, args.kernels, args.sparse)


if __name__ == "__main__":
    main()
