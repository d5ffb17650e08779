"""What the Gluon kernels issue beyond Gluon's public API: the dQ tile's TMA reduce-add (a
private builder binding: triton is pinned, and tests/test_gluon_compile.py checks the PTX),
the masks' selects as inline PTX, and the signal that shared memory written by a warp
group is ready for the async proxy."""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier


@builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """src (shared) added element-wise into the box of ``desc`` at ``coord`` by TMA (fp32
    add in L2). Completes like a TMA store: ``tma.store_wait`` waits for src to be read."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def _signal(bar):
    """Every thread of the group has written shared memory that TMA or wgmma (the async
    proxy) reads next: fence each thread's writes, wait for the whole group, arrive once."""
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _keep_visible(p, row, limit):
    """p where row <= limit, else 0 (broadcast; int32 row and limit): a setp + selp an
    element, as inline PTX. Written as gl.where, LLVM vectorizes the 32 comparisons of a
    thread into one <32 x i1> whose lowering packs and unpacks bits (about 100 more SASS
    instructions a step, and spills)."""
    return gl.inline_asm_elementwise("{ .reg .pred p; setp.le.s32 p, $2, $3; selp.f32 $0, $1, 0f00000000, p; }",
                                     "=f,f,r,r", [p, row, limit], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _hide(s, lhs, rhs):
    """s where lhs <= rhs, else -inf (broadcast int32): a setp + selp an element, as inline
    PTX (``_keep_visible`` says why not gl.where)."""
    return gl.inline_asm_elementwise("{ .reg .pred p; setp.le.s32 p, $2, $3; selp.f32 $0, $1, 0fFF800000, p; }",
                                     "=f,f,r,r", [s, lhs, rhs], dtype=gl.float32, is_pure=True, pack=1)
