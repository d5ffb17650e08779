"""The Gluon Hopper backward (kernels/gluon/bwd.py) compiled for sm_90 on CPU: no GPU needed.

What a compile can show, checked on the compiled kernel: every matmul of the design is
a wgmma of the expected shape and count, the four partitions exist with their warp
counts and register budgets, shared memory fits an H100's 227 KB, the Q/dO/K/V/lse/delta
loads are TMA loads and dQ leaves by TMA reduce-adds (the private binding the module
relies on), and ptxas neither serializes the wgmmas nor spills inside the tile loops.
The argument checks are run too (they raise before any GPU is needed). Correctness on a
GPU is tests/test_gluon_gpu.py's.

One compile (about 6 s, cached by Triton afterwards) serves every test. Skipped only
when the installed triton lacks Gluon's Hopper module, the reduce binding, or the CUDA
tools it ships (ptxas, cuobjdump, nvdisasm).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="this triton has no Gluon Hopper module")

import triton  # noqa: E402
from triton._C.libtriton import gluon_ir  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
H100_SHARED = 227 * 1024  # the most shared memory one CTA may take on sm_90


@pytest.fixture(scope="module")
def kernel():
    if not hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce"):
        pytest.skip("this triton's Gluon builder has no create_async_tma_reduce (the dQ TMA reduce-add)")
    missing = [t for t in ("ptxas", "cuobjdump", "nvdisasm") if not (BIN / t).exists()]
    if missing:
        pytest.skip(f"this triton ships no {', '.join(missing)}")
    from ringflash.kernels.gluon import compile_sm90
    return compile_sm90()


def _tool(name: str, cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(BIN / name), *args, f.name], capture_output=True, text=True,
                              check=True).stdout


def _ptx_ops(ptx: str) -> Counter:
    """PTX instructions (predicates dropped) by full name, e.g. 'wgmma.mma_async.sync...'."""
    return Counter(re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)", ptx, re.M))


def _tile_loops(sass: str) -> list[list[str]]:
    """Opcodes of the SASS tile loops: a conditional backward branch over HGMMAs. The
    unconditional backward branches are the out-of-line retries of mbarrier waits and
    the workers' dispatch loop (which holds USETMAXREG): not loops of the tile."""
    ops, labels = [], {}
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ops)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)(\S*)(.*?);", line):
            ops.append((m.group(2), m.group(4), m.group(1) is not None))
    loops = []
    for i, (op, rest, predicated) in enumerate(ops):
        target = re.search(r"\((\.L_x_\d+)\)", rest) if op == "BRA" and predicated else None
        if target and labels.get(target.group(1), i + 1) <= i:
            body = [o for o, _, _ in ops[labels[target.group(1)]:i + 1]]
            if "HGMMA" in body and "USETMAXREG" not in body:
                loops.append(body)
    return loops


def test_every_matmul_is_a_wgmma(kernel):
    """Per consumer group and Q tile: Sᵀ, dPᵀ and its dQ half are 64x64 products over 128
    (8 k-steps of 16 each), dV and dK 64x128 over the 64 Q rows (4 each); two groups."""
    ops = _ptx_ops(kernel.asm["ptx"])
    assert ops["wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"] == 2 * 3 * 8, ops
    assert ops["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"] == 2 * 2 * 4, ops
    assert not [op for op in ops if op.startswith("mma.sync")], "an mma.sync fallback"
    # Partial waits: Sᵀ then dPᵀ each waited with one product still in flight.
    assert "wgmma.wait_group.sync.aligned 1;" in kernel.asm["ptx"]


def test_four_partitions_with_their_register_budgets(kernel):
    """Two 4-warp consumer groups (the default partition and one worker), a one-warp TMA
    loader and a one-warp dQ writer; 10 warps padded to 12, 168 registers at launch,
    re-split by setmaxnreg to 240 for the consumers and 24 for the loader and writer."""
    ttgir = kernel.asm["ttgir"]
    assert re.search(r"ttg\.warp_specialize\(.*requestedRegisters = array<i32: 240, 24, 24>", ttgir)
    workers = re.findall(r"partition\d+\(.*\) num_warps\((\d+)\)", ttgir)
    assert workers == ["4", "1", "1"], workers
    assert kernel.metadata.num_warps == 12
    ptx = kernel.asm["ptx"]
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    usage = _tool("cuobjdump", kernel.asm["cubin"], "--dump-resource-usage")
    assert int(re.search(r"REG:(\d+)", usage).group(1)) == 168, usage
    sass = _tool("nvdisasm", kernel.asm["cubin"], "-c")
    assert "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0" in sass  # a consumer group takes 240


def test_shared_memory_fits_hopper(kernel):
    """K, V (64 KB), Q and dO in two stages (64 KB), dSᵀ in two (32 KB), the fp32 dQ tile
    (32 KB), lse/delta stages and barriers: above 192 KB, within 227 KB."""
    assert 192 * 1024 < kernel.metadata.shared <= H100_SHARED, kernel.metadata.shared


def test_loads_and_dq_go_through_tma(kernel):
    """Q, dO, K, V by 4-D TMA boxes (one (batch, head), any strides; a box's 128 bf16
    columns are 256 bytes, past the 128-byte swizzle, so Triton issues it as two copies
    of 64 columns), lse and delta by 1-D boxes, and dQ added into the fp32 accumulator by
    four 4-D TMA reduce-adds (32 columns each), whose shared source is waited for before
    the tile is reused."""
    ops = _ptx_ops(kernel.asm["ptx"])
    loads4d = ops["cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"]
    loads1d = ops["cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes"]
    assert (loads4d, loads1d) == (2 * 4, 2), ops
    assert ops["cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.bulk_group"] == 4, ops
    assert ops["cp.async.bulk.wait_group.read"] >= 1, ops
    assert ops["fence.proxy.async.shared::cta"] >= 4, ops  # dSᵀ and dQ stores, both groups


def test_ptxas_neither_serializes_nor_spills_in_the_loop(kernel):
    """ptxas keeps the wgmmas asynchronous (no C7510-C7515 serialization warning) and the
    tile loops free of local-memory traffic (a register spilled around the loop is allowed)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "bwd.ptx"
        ptx.write_text(kernel.asm["ptx"])
        done = subprocess.run([str(BIN / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "a.cubin")],
                              capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "serialized" not in done.stderr, done.stderr
    stack = int(re.search(r"(\d+) bytes stack frame", done.stderr).group(1))
    assert stack <= 64, done.stderr
    loops = _tile_loops(_tool("nvdisasm", kernel.asm["cubin"], "-c"))
    assert len(loops) == 2, [len(loop) for loop in loops]  # one tile loop per consumer group
    for loop in loops:
        assert not {"LDL", "STL"} & set(loop), Counter(op for op in loop if op in ("LDL", "STL"))


# ----------------------------------------------------------------------------- argument checks


def _args(b=1, s=256, h=2, d=128, **changes):
    q = torch.zeros(b, s, h, d, dtype=torch.bfloat16)
    args = dict(dout=q.clone(), q=q, k=q.clone(), v=q.clone(), lse=torch.zeros(b, h, s),
                delta=torch.zeros(b, h, s), dq_acc=torch.zeros(b, s, h, d), dk=q.clone(), dv=q.clone(),
                softmax_scale=d ** -0.5)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,error,words", [
    (dict(v=torch.zeros(1, 256, 2, 128, dtype=torch.float16)), TypeError, "v must be bfloat16"),
    (dict(dq_acc=torch.zeros(1, 256, 2, 128, dtype=torch.bfloat16)), TypeError, "dq_acc must be float32"),
    (dict(lse=[0.0]), TypeError, "lse must be a torch.Tensor"),
    (dict(d=64), ValueError, "head_dim must be 128"),
    (dict(s=192), ValueError, "seqlen must be a positive multiple of 128"),
    (dict(k=torch.zeros(1, 256, 1, 128, dtype=torch.bfloat16)), ValueError, "k must have q's shape"),
    (dict(delta=torch.zeros(1, 256, 2)), ValueError, "delta must be (B, H, S)"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be a positive finite"),
    (dict(dk=torch.zeros(1, 256, 2, 256, dtype=torch.bfloat16)[..., ::2]), ValueError,
     "dk must have a contiguous last dimension"),
    (dict(q=torch.zeros(1, 256, 2, 132, dtype=torch.bfloat16)[..., :128]), ValueError, "q's address and strides"),
    (dict(), ValueError, "runs on a Hopper (sm_90) GPU"),  # all fine but on the CPU
])
def test_arguments_outside_the_kernel_raise_naming_them(changes, error, words):
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from ringflash.kernels.gluon import attn_bwd_sm90
    shape = {key: changes.pop(key) for key in ("b", "s", "h", "d") if key in changes}
    with pytest.raises(error, match=re.escape(words)):
        attn_bwd_sm90(**_args(**shape, **changes))
