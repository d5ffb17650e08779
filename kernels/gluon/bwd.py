"""A warp-specialized attention backward for Hopper (sm_90), written in Gluon.

Status: compiled for sm_90 on CPU; not yet run on a GPU; not used by flash_attn or the
ring yet. Milestone 1 of a FlashAttention-3-style backward: the structure and correctness
first (tests/test_gluon_gpu.py, on a GPU), its speed later.

Shapes served: q, k, v, dout (B, S, H, 128) bf16 of the same shape (MHA: as many kv heads
as query heads), non-causal and unmasked, S a multiple of 128, any strides with a
contiguous last dimension (TMA: the other strides and the base addresses 16-byte
aligned). lse (natural log) and delta = rowsum(out * dout) are (B, H, S) fp32; dq_acc is
an fp32 (B, S, H, 128) running sum the kernel ADDS ``scale * dQ`` into (the ring's); dk
and dv, in q's dtype, are written once. Anything else raises a ValueError or TypeError
naming the argument.

The math (kernels/triton/bwd.py's conventions), per K/V tile and Q tile, keys by queries:

    Sᵀ = K Qᵀ,  Pᵀ = exp2(Sᵀ · scale · log2 e - lse · log2 e),  dPᵀ = V dOᵀ,
    dSᵀ = Pᵀ ∘ (dPᵀ - delta) · scale,  dV += Pᵀ dO,  dK += dSᵀ Q,  dQ += dS K.

The softmax scale is folded into dSᵀ before its bf16 rounding, so dK and dQ come out
scaled and no epilogue multiplies them.

Work split: one CTA per 128-row K/V tile of a (batch, head), looping over the sequence's
Q tiles of 64 rows. Four partitions (``gl.warp_specialize``):

- two consumer warp groups (``_consumer``), each owning 64 of the K/V rows and their dK,
  dV accumulators in registers (240 registers a thread); each computes its dSᵀ half, puts
  it in shared memory, and, once both halves are there, computes its 64-column half of
  dQ = dS K over all 128 keys into a shared fp32 tile;
- one loader warp (``_loader``): K and V once, then Q + lse and dO + delta per Q tile by
  TMA into two stages;
- one dQ writer warp (``_dq_writer``): the shared fp32 dQ tile TMA-reduce-added
  (``cp.reduce.async.bulk.tensor ... .add``) into dq_acc, so CTAs of the same (batch,
  head) sum their dQ without atomics in registers. The order of those adds is arrival
  order: dQ is not bit-deterministic run to run.

The TMA reduce-add has no public Gluon wrapper in triton 3.6; ``_tma_reduce_add`` calls
the builder's ``create_async_tma_reduce`` (a private binding: pin triton and keep the PTX
test, tests/test_gluon_compile.py).
"""

from __future__ import annotations

import math

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = math.log2(math.e)
# Tile constants, read by the kernels (hence constexpr; the host reads their .value).
HEAD_DIM = gl.constexpr(128)
BLOCK_N = gl.constexpr(128)  # K/V rows a CTA owns (two consumer groups of 64)
BLOCK_M = gl.constexpr(64)  # Q rows a step
DQ_COLS = gl.constexpr(32)  # columns of one dQ TMA box: 32 fp32 = 128 bytes, the widest a 128-byte swizzle takes
STAGES = gl.constexpr(2)  # Q/dO/lse/delta stages, and dSᵀ buffers
NUM_WARPS = 4  # the default partition: consumer group 0
MAXNREG = 168  # 12 warps (4 + 4 + 1 + 1, padded to warp groups) share 64K registers
CONSUMER_REGS = 240  # 2 x 128 threads x 240 + 128 x 24 <= 65536
WORKER_REGS = 24


@builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """src (shared) added element-wise into the box of ``desc`` at ``coord`` by TMA (fp32
    add in L2). Completes like a TMA store: ``tma.store_wait`` waits for src to be read."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


# ----------------------------------------------------------------------------- partitions
#
# Every partition gets the same four tuples and walks the same Q tiles:
#   descs = (q, k, v, do, lse, delta, dq): TMA descriptors
#   smem  = (q, do, lse, delta, k, v, dsT, dq): shared buffers
#   bars  = (kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty): mbarriers
#   tile  = (off_b, off_h, n0, n_tiles, bh, seqlen)
# Stage s = i % STAGES of Q tile i is filled at parity (i // STAGES) & 1.


@gluon.jit
def _loader(descs, smem, bars, tile):
    """One warp: K and V once, then per Q tile Q + lse (q_ready) and dO + delta
    (do_ready) into the stage both consumers last released (qdo_empty)."""
    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc = descs
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty = bars
    off_b, off_h, n0, n_tiles, bh, seqlen = tile
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [off_b, n0, off_h, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [off_b, n0, off_h, 0], kv_ready, v_smem)
    for i in range(n_tiles):
        s = i % STAGES
        m0 = i * BLOCK_M
        # A fresh barrier passes a wait on parity 1: the first STAGES fills do not wait.
        mbarrier.wait(qdo_empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, m0, off_h, 0], q_ready.index(s), q_smem.index(s))
        tma.async_copy_global_to_shared(lse_desc, [bh * seqlen + m0], q_ready.index(s), lse_smem.index(s))
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [off_b, m0, off_h, 0], do_ready.index(s), do_smem.index(s))
        tma.async_copy_global_to_shared(delta_desc, [bh * seqlen + m0], do_ready.index(s), delta_smem.index(s))


@gluon.jit
def _dq_writer(descs, smem, bars, tile):
    """One warp: per Q tile, once both consumers filled the shared dQ tile (dq_full), add
    it into dq_acc by TMA, and hand the tile back (dq_empty) once TMA has read it."""
    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc = descs
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty = bars
    off_b, off_h, n0, n_tiles, bh, seqlen = tile
    for i in range(n_tiles):
        mbarrier.wait(dq_full, i & 1)
        for c in gl.static_range(HEAD_DIM // DQ_COLS):
            _tma_reduce_add(dq_desc, [off_b, i * BLOCK_M, off_h, c * DQ_COLS],
                            dq_smem.index(c).reshape(dq_desc.block_type.shape))
        tma.store_wait(0)  # the tile was read (not that the adds landed: the grid's end sees to that)
        mbarrier.arrive(dq_empty, count=1)


@gluon.jit
def _signal(bar):
    """Every thread of the group has written shared memory that TMA or wgmma (the async
    proxy) reads next: fence each thread's writes, wait for the whole group, arrive once."""
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _consumer_step(i, dk, dv, k_rows, v_rows, k_cols, smem, bars, qk_scale, sm_scale, G: gl.constexpr):
    """Q tile i into this group's dK, dV (64 K/V rows, fp32 registers), and this group's
    64 columns of the tile's dQ into the shared fp32 tile. Returns (dk, dv)."""
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty = bars
    # 64 x 64 tiles (Sᵀ, dPᵀ, dQ half) and 64 x 128 (dK, dV); P and dS enter dV and dK
    # as register operands whose layout matches the 64 x 64 accumulator's registers.
    mma64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    mma128: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, 128, 16])
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma128, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, mma64)  # one value per Q row (a column of Sᵀ)
    s = i % STAGES
    ph = (i // STAGES) & 1
    q_s = q_smem.index(s).reshape([BLOCK_M, HEAD_DIM])
    do_s = do_smem.index(s).reshape([BLOCK_M, HEAD_DIM])
    zero = gl.zeros([64, BLOCK_M], gl.float32, mma64)

    # Sᵀ and dPᵀ issued back to back; the softmax runs under dPᵀ.
    mbarrier.wait(q_ready.index(s), ph)
    sT = warpgroup_mma(k_rows, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(s), ph)
    dpT = warpgroup_mma(v_rows, do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    lse = lse_smem.index(s).load(cols) * 1.4426950408889634  # natural log -> log2, as exp2 wants
    sT = warpgroup_mma_wait(1, deps=[sT])
    pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0))
    p_op = gl.convert_layout(pT.to(gl.bfloat16), op_a, assert_trivial=True)
    dv = warpgroup_mma(p_op, do_s, dv, is_async=True)

    delta = delta_smem.index(s).load(cols)
    dpT = warpgroup_mma_wait(1, deps=[dpT])  # Sᵀ and dPᵀ done; dV may still run
    dsT = (pT * (dpT - gl.expand_dims(delta, 0)) * sm_scale).to(gl.bfloat16)
    ds_op = gl.convert_layout(dsT, op_a, assert_trivial=True)
    dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)

    # dQ needs all 128 keys' dS: each group writes its 64 rows of dSᵀ, then both read both.
    ds_s = ds_smem.index(s)
    ds_s.slice(64 * G, 64).store(dsT)
    _signal(ds_ready.index(s))
    mbarrier.wait(ds_ready.index(s), ph)
    dq = warpgroup_mma(ds_s.permute((1, 0)), k_cols, zero, use_acc=False, is_async=True)
    dq, dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dq, dv, dk, p_op, ds_op])
    mbarrier.arrive(qdo_empty.index(s), count=1)  # Q, dO, lse, delta of stage s are read

    # This group's 64 dQ columns, as two 32-column boxes, once the writer released the tile.
    mbarrier.wait(dq_empty, (i & 1) ^ 1)
    left, right = dq.reshape([BLOCK_M, 2, DQ_COLS]).permute([0, 2, 1]).split()
    dq_smem.index(2 * G).store(left)
    dq_smem.index(2 * G + 1).store(right)
    _signal(dq_full)
    return dk, dv


@gluon.jit
def _consumer(descs, smem, bars, tile, out, G: gl.constexpr):
    """Consumer warp group G: K/V rows [64 G, 64 G + 64) of the CTA's tile over every Q
    tile, then its dK (scaled) and dV rows stored in the output dtype."""
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    off_b, off_h, n0, n_tiles, bh, seqlen = tile
    dk_ptr, dv_ptr, dk_strides, dv_strides, qk_scale, sm_scale = out
    mma128: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, 128, 16])
    k_full = k_smem.reshape([BLOCK_N, HEAD_DIM])
    k_rows = k_full.slice(64 * G, 64)  # Sᵀ's A operand
    k_cols = k_full.slice(64 * G, 64, dim=1)  # dQ's B operand: this group's dQ columns
    v_rows = v_smem.reshape([BLOCK_N, HEAD_DIM]).slice(64 * G, 64)
    dk = gl.zeros([64, HEAD_DIM], gl.float32, mma128)
    dv = gl.zeros([64, HEAD_DIM], gl.float32, mma128)
    mbarrier.wait(bars[0], 0)  # kv_ready
    for i in range(n_tiles):
        dk, dv = _consumer_step(i, dk, dv, k_rows, v_rows, k_cols, smem, bars, qk_scale, sm_scale, G)
    rows = gl.arange(0, 64, gl.SliceLayout(1, mma128))
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, mma128))
    first = n0 + 64 * G
    _store_rows(dk_ptr, dk_strides, off_b, first, off_h, rows, cols, dk)
    _store_rows(dv_ptr, dv_strides, off_b, first, off_h, rows, cols, dv)


@gluon.jit
def _store_rows(ptr, strides, off_b, first, off_h, rows, cols, x):
    """x (64 rows from ``first`` of (batch, head) of a (B, S, H, D) tensor): a 64-bit
    offset to the first row, 32-bit offsets inside the tile (the launcher bounds them)."""
    stride_b, stride_s, stride_h = strides
    base = off_b.to(gl.int64) * stride_b + first.to(gl.int64) * stride_s + off_h.to(gl.int64) * stride_h
    offs = gl.expand_dims(rows * stride_s.to(gl.int32), 1) + gl.expand_dims(cols, 0)
    gl.store(ptr + base + offs, x.to(ptr.dtype.element_ty))


@gluon.jit
def _consumer0(descs, smem, bars, tile, out):
    _consumer(descs, smem, bars, tile, out, 0)


@gluon.jit
def _consumer1(descs, smem, bars, tile, out):
    _consumer(descs, smem, bars, tile, out, 1)


@gluon.jit
def _attn_bwd_sm90_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, dk_ptr, dv_ptr,
                          dk_stride_b, dk_stride_s, dk_stride_h, dv_stride_b, dv_stride_s, dv_stride_h,
                          H, seqlen, qk_scale, sm_scale, CONSUMER_REGS: gl.constexpr,
                          WORKER_REGS: gl.constexpr):
    """Grid (S / 128, B H): K/V tile program_id(0) of (batch, head) program_id(1)."""
    bh = gl.program_id(1)
    tile = (bh // H, bh % H, gl.program_id(0) * BLOCK_N, seqlen // BLOCK_M, bh, seqlen)
    # Shared memory, about 193 KB: K, V 64 KB; Q, dO 2 x 2 x 16 KB; dSᵀ 2 x 16 KB; dQ 32 KB.
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_COLS], gl.float32)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.bfloat16)
    smem = (gl.allocate_shared_memory(gl.bfloat16, [STAGES] + q_desc.block_type.shape, q_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES] + do_desc.block_type.shape, do_desc.layout),
            gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout),
            gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, k_desc.block_type.shape, k_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, v_desc.block_type.shape, v_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_M], ds_layout),
            gl.allocate_shared_memory(gl.float32, [HEAD_DIM // DQ_COLS, BLOCK_M, DQ_COLS], dq_layout))
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # Arrival counts: TMA completes the *_ready of loads (one expect each); every
    # barrier the consumers arrive at takes one arrive from each group.
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(dq_full, count=2)
    mbarrier.init(dq_empty, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(qdo_empty.index(s), count=2)
        mbarrier.init(ds_ready.index(s), count=2)
    bars = (kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty)
    descs = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc)
    out = (dk_ptr, dv_ptr, (dk_stride_b, dk_stride_s, dk_stride_h), (dv_stride_b, dv_stride_s, dv_stride_h),
           qk_scale, sm_scale)
    gl.warp_specialize([(_consumer0, (descs, smem, bars, tile, out)),
                        (_consumer1, (descs, smem, bars, tile, out)),
                        (_loader, (descs, smem, bars, tile)),
                        (_dq_writer, (descs, smem, bars, tile))],
                       [4, 1, 1], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS])


# ----------------------------------------------------------------------------- host side


def _layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def _descriptors(q, k, v, dout, lse, delta, dq_acc):
    """TMA descriptors: (B, S, H, D) tensors through their own strides in boxes of one
    (batch, head) and BLOCK_M (q, dout, dq_acc) or BLOCK_N (k, v) rows; lse and delta
    (contiguous) as flat vectors read BLOCK_M at a time."""

    def rows(t, n, cols=HEAD_DIM.value, dtype=gl.bfloat16):
        block = [1, n, 1, cols]
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _layout(block, dtype))

    def flat(t):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
        return TensorDescriptor(t, [t.numel()], [1], [BLOCK_M.value], layout)

    m, n = BLOCK_M.value, BLOCK_N.value
    return (rows(q, m), rows(k, n), rows(v, n), rows(dout, m), flat(lse), flat(delta),
            rows(dq_acc, m, DQ_COLS.value, gl.float32))


def _check(dout, q, k, v, lse, delta, dq_acc, dk, dv, softmax_scale) -> None:
    """Raise TypeError / ValueError, naming the argument, for anything this kernel does
    not serve (the module's docstring)."""
    named = dict(dout=dout, q=q, k=k, v=v, lse=lse, delta=delta, dq_acc=dq_acc, dk=dk, dv=dv)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attn_bwd_sm90: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name in ("dout", "q", "k", "v", "dk", "dv"):
        if named[name].dtype != torch.bfloat16:
            raise TypeError(f"attn_bwd_sm90: {name} must be bfloat16, got {named[name].dtype}")
    for name in ("lse", "delta", "dq_acc"):
        if named[name].dtype != torch.float32:
            raise TypeError(f"attn_bwd_sm90: {name} must be float32, got {named[name].dtype}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"attn_bwd_sm90: softmax_scale must be a positive finite number, got {softmax_scale!r}")
    if q.dim() != 4:
        raise ValueError(f"attn_bwd_sm90: q must be (B, S, H, D), got shape {tuple(q.shape)}")
    b, s, h, d = q.shape
    if d != HEAD_DIM.value:
        raise ValueError(f"attn_bwd_sm90: q's head_dim must be {HEAD_DIM.value}, got {d}")
    if s == 0 or s % BLOCK_N.value:
        raise ValueError(f"attn_bwd_sm90: q's seqlen must be a positive multiple of {BLOCK_N.value}, got {s}")
    for name in ("dout", "k", "v", "dq_acc", "dk", "dv"):
        if tuple(named[name].shape) != tuple(q.shape):
            raise ValueError(f"attn_bwd_sm90: {name} must have q's shape {tuple(q.shape)} (MHA, equal "
                             f"seqlens), got {tuple(named[name].shape)}")
    for name in ("lse", "delta"):
        if tuple(named[name].shape) != (b, h, s):
            raise ValueError(f"attn_bwd_sm90: {name} must be (B, H, S) = {(b, h, s)}, got "
                             f"{tuple(named[name].shape)}")
    for name, t in named.items():
        if t.device != q.device:
            raise ValueError(f"attn_bwd_sm90: {name} is on {t.device}, q on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"attn_bwd_sm90: {name} must have a contiguous last dimension, strides {t.stride()}")
    for name in ("dout", "q", "k", "v", "dq_acc", "dk", "dv"):
        t = named[name]
        if t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
            raise ValueError(f"attn_bwd_sm90: {name}'s address and strides {t.stride()} must be multiples of "
                             f"16 bytes (TMA)")
        if t.stride(1) * BLOCK_N.value >= 2 ** 31:
            raise ValueError(f"attn_bwd_sm90: {name}'s row stride {t.stride(1)} is too large (offsets "
                             f"inside a tile are 32-bit)")
    if b * h * s >= 2 ** 31:
        raise ValueError(f"attn_bwd_sm90: lse and delta hold {b * h * s} elements, TMA takes < 2**31")
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        raise ValueError(f"attn_bwd_sm90: q is on {q.device}; this kernel runs on a Hopper (sm_90) GPU")


def attn_bwd_sm90(dout, q, k, v, lse, delta, dq_acc, dk, dv, softmax_scale: float):
    """Non-causal MHA backward (head_dim 128, bf16): ``dq_acc += scale * dQ`` (fp32),
    dk = scale * dK and dv = dV written (bf16). lse (natural log) and delta (rowsum(out *
    dout), kernels.attn_delta) are (B, H, S) fp32 (copied if not contiguous). Returns
    (dq_acc, dk, dv)."""
    _check(dout, q, k, v, lse, delta, dq_acc, dk, dv, softmax_scale)
    b, s, h, _ = q.shape
    lse, delta = lse.contiguous(), delta.contiguous()
    _attn_bwd_sm90_kernel[(s // BLOCK_N.value, b * h)](
        *_descriptors(q, k, v, dout, lse, delta, dq_acc), dk, dv, dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), h, s, softmax_scale * LOG2E, softmax_scale,
        CONSUMER_REGS, WORKER_REGS, num_warps=NUM_WARPS, maxnreg=MAXNREG)
    return dq_acc, dk, dv


def compile_sm90(consumer_regs: int = CONSUMER_REGS, worker_regs: int = WORKER_REGS, maxnreg: int = MAXNREG):
    """The kernel compiled for sm_90 on any machine, no GPU needed (triton ships ptxas):
    its ``.asm`` holds "ttgir", "ptx", "cubin"; ``.metadata.shared`` its shared memory in
    bytes. Specialized as ``attn_bwd_sm90`` would specialize it on contiguous (1, 1024, 4,
    128) inputs (CPU stand-ins: only their types, alignments and strides are read)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource

    x = torch.zeros(1, 1024, 4, HEAD_DIM.value, dtype=torch.bfloat16)
    stats = torch.zeros(1, 4, 1024)
    values = (*_descriptors(x, x, x, x, stats, stats, torch.zeros(x.shape)), x, x, *x.stride()[:3], *x.stride()[:3],
              x.shape[2], x.shape[1], 0.1 * LOG2E, 0.1)
    kernel = _attn_bwd_sm90_kernel
    sig, attrs = {}, {}
    for i, (name, value) in enumerate(zip(kernel.arg_names, values)):  # as the JIT's launch would
        sig[name], spec = native_specialize_impl(CUDABackend, value, False, True, True)
        if isinstance(spec, str) and spec:
            attrs[(i,)] = CUDABackend.parse_attr(spec)  # e.g. tt.divisibility 16
    consts = dict(CONSUMER_REGS=consumer_regs, WORKER_REGS=worker_regs)
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=NUM_WARPS, maxnreg=maxnreg))
