"""A warp-specialized attention backward for Hopper (sm_90), written in Gluon.

A FlashAttention-3-style backward: non-causal and the causal band, MHA, GQA and MQA.
``flash_attn``'s default backward on sm_90 where it serves the call (kernels/dispatch.py),
and that of every block pair of the ring's steps where it serves them all (dK/dV added
into the ring's fp32 sums: ``accumulate``; ringflash/ring/rotate.py). Tested against the float64 oracle on an H100
(tests/test_gluon_gpu.py), compiled for sm_90 on CPU (tests/test_gluon_compile.py).

Shapes served: q, dout (B, Sq, H, 128) and k, v (B, Sk, Hkv, 128), bf16, Hkv dividing H
(query head h reads kv head h // (H / Hkv): MHA, GQA, MQA), Sq and Sk positive multiples
of 128, any strides with a contiguous last dimension (TMA: the other strides and the base
addresses 16-byte aligned). Masks: none (``causal_offset=None``) or the causal band with
an offset, as ``PairMask.causal(o)`` (kernels/masks.py): key j is seen by query i iff
j <= i + o, on the pair's local indices (o = q_start - k_start for two blocks of one
sequence: the ring's pairs). lse (natural log; -inf for a row that sees no key) and
delta = rowsum(out * dout) are (B, H, Sq) fp32; dq_acc is an fp32 (B, Sq, H, 128) running
sum the kernel ADDS ``scale * dQ`` into (the ring's); dk and dv (B, Sk, Hkv, 128), bf16 or
fp32, are written once (zeros for a key no query sees), or with ``accumulate`` (fp32 only)
added into: each CTA loads its rows' running sums in its epilogue, so a ring step adds
into the dK/dV sums it carries without a pass of its own, and every element gets one
fp32 add in a fixed order (dK/dV stay bit-stable). Anything else raises a ValueError or
TypeError naming the argument.

The math (kernels/triton/bwd.py's conventions), per K/V tile and Q tile, keys by queries:

    Sᵀ = K Qᵀ,  Pᵀ = exp2(Sᵀ · scale · log2 e - lse · log2 e),  dPᵀ = V dOᵀ,
    dSᵀ = Pᵀ ∘ (dPᵀ - delta) · scale,  dV += Pᵀ dO,  dK += dSᵀ Q,  dQ += dS K.

The softmax scale is folded into dSᵀ before its bf16 rounding, so dK and dQ come out
scaled and no epilogue multiplies them.

Work split: one CTA per 128-row K/V tile of a (batch, kv head), looping over the query
heads of its group and, per head, over the Q tiles of 64 rows that see some key of the
tile (``_q_tiles``). Four partitions (``gl.warp_specialize``):

- two consumer warp groups (``_consumer``), each owning 64 of the K/V rows and their dK,
  dV accumulators in fp32 registers (240 registers a thread), summed over every query
  head of the group; each computes its dSᵀ half, puts it in shared memory, and, once both
  halves are there, computes its 64-column half of dQ = dS K over all 128 keys into a
  shared fp32 tile;
- one loader warp (``_loader``): K and V once, then Q + lse and dO + delta per (query
  head, Q tile) by TMA into two stages;
- one dQ writer warp (``_dq_writer``): the shared fp32 dQ tile TMA-reduce-added
  (``cp.reduce.async.bulk.tensor ... .add``) into dq_acc, so CTAs of the same (batch,
  head) sum their dQ without atomics in registers. The order of those adds is arrival
  order: dQ is not bit-deterministic run to run.

Causal band: with K/V outer, a CTA skips the Q tiles none of its keys is seen by: its Q
range starts at the tile of query n0 - o (the first that sees key n0) and runs to the end.
The tiles of that range crossing the diagonal of the CTA's 128 keys ([first, split),
two or three of them) go through a masked step (``MASKED``: Pᵀ zeroed where j > i + o,
after the exp2, so a row whose lse is -inf gives 0, not NaN), in a loop of their own
after the unmasked steps ([split, end)), whose loop is the non-causal kernel's. The
loader, the two consumers and the dQ writer compute (first, split, end) each for itself
from the same scalars (``_q_tiles``) and walk the same steps in the same order: a step
one partition takes and another does not leaves an mbarrier waiting forever. A K tile
whose range is empty still loads K and V (the consumers wait for them, so the CTA does
not exit under a TMA in flight) and writes dk = dv = 0. Order: program_id(0) is the K
tile, in increasing order, so under the band the longest CTAs (first K tiles, most Q
tiles) start first; FA3 walks an LPT order over (head, K tile) in chunks sized to L2
(hopper/tile_scheduler.hpp), not done here.

GQA: GROUP = H / Hkv (a constexpr: one compile per group size) query heads per kv head;
a CTA's dK and dV sum over all of them, in the same fp32 registers, and dQ goes to each
query head's rows of dq_acc.

The TMA reduce-add has no public Gluon wrapper in triton 3.6; ``_tma_reduce_add`` calls
the builder's ``create_async_tma_reduce`` (a private binding: pin triton and keep the PTX
test, tests/test_gluon_compile.py).
"""

from __future__ import annotations

import math
from typing import Optional

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
# Every partition gets the same four tuples and walks the same (query head, Q tile) steps:
#   descs = (q, k, v, do, lse, delta, dq): TMA descriptors
#   smem  = (q, do, lse, delta, k, v, dsT, dq): shared buffers
#   bars  = (kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty): mbarriers
#   tile  = (off_b, off_hk, n0, heads, seqlen_q, offset)
# Steps: (query head off_hk * GROUP + g, Q tile m) for the tiles of _q_tiles(...), first the
# unmasked ones [split, end) (g outer), then the masked ones [first, split) (m outer).
# Step t (counted over both) uses stage s = t % STAGES, filled at parity
# (t // STAGES) & 1, and the dQ tile at parity t & 1.


@gluon.jit
def _q_tiles(n0, offset, seqlen_q, CAUSAL: gl.constexpr):
    """(first, split, end): the Q tiles (of BLOCK_M rows) [first, end) hold a query that
    sees a key of the K tile [n0, n0 + BLOCK_N); those in [first, split) cross the
    diagonal (some pair hidden: the masked step), those in [split, end) see every key.
    Causal, j <= i + offset: queries from n0 - offset on see key n0, and every query
    from n0 + BLOCK_N - 1 - offset on sees the whole tile. Without the band, (0, 0, end).
    Every partition calls this with the same scalars: they walk the same steps."""
    end = seqlen_q // BLOCK_M
    if CAUSAL:  # dividends clamped >= 0: integer division truncates
        first = gl.minimum(gl.maximum(n0 - offset, 0) // BLOCK_M, end)
        full = gl.maximum(n0 + BLOCK_N - 1 - offset, 0)
        split = gl.minimum(gl.maximum((full + BLOCK_M - 1) // BLOCK_M, first), end)
    else:
        first = 0
        split = 0
    return first, split, end


@gluon.jit
def _loader(descs, smem, bars, tile, GROUP: gl.constexpr, CAUSAL: gl.constexpr):
    """One warp: K and V once (even for an empty Q range: the consumers wait for them),
    then per (query head, Q tile) Q + lse (q_ready) and dO + delta (do_ready) into the
    stage both consumers last released (qdo_empty)."""
    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc = descs
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty = bars
    off_b, off_hk, n0, heads, seqlen_q, offset = tile
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [off_b, n0, off_hk, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [off_b, n0, off_hk, 0], kv_ready, v_smem)
    first, split, end = _q_tiles(n0, offset, seqlen_q, CAUSAL)
    t = 0
    for g in range(GROUP):  # the unmasked steps, every head's, then the masked ones
        for m in range(split, end):
            _load_step(t, off_b, off_hk * GROUP + g, m, heads, seqlen_q, descs, smem, bars)
            t += 1
    if CAUSAL:
        for m in range(first, split):
            for g in range(GROUP):
                _load_step(t, off_b, off_hk * GROUP + g, m, heads, seqlen_q, descs, smem, bars)
                t += 1


@gluon.jit
def _load_step(t, off_b, off_h, m, heads, seqlen_q, descs, smem, bars):
    """Step t: Q tile m of query head off_h, with its lse, delta and dO, into stage t % STAGES."""
    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc = descs
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty = bars
    s = t % STAGES
    m0 = m * BLOCK_M
    row = (off_b * heads + off_h) * seqlen_q + m0  # of lse and delta, flat
    # A fresh barrier passes a wait on parity 1: the first STAGES fills do not wait.
    mbarrier.wait(qdo_empty.index(s), ((t // STAGES) & 1) ^ 1)
    mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [off_b, m0, off_h, 0], q_ready.index(s), q_smem.index(s))
    tma.async_copy_global_to_shared(lse_desc, [row], q_ready.index(s), lse_smem.index(s))
    mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(do_desc, [off_b, m0, off_h, 0], do_ready.index(s), do_smem.index(s))
    tma.async_copy_global_to_shared(delta_desc, [row], do_ready.index(s), delta_smem.index(s))


@gluon.jit
def _dq_writer(descs, smem, bars, tile, GROUP: gl.constexpr, CAUSAL: gl.constexpr):
    """One warp: per (query head, Q tile), once both consumers filled the shared dQ tile
    (dq_full), add it into that head's rows of dq_acc by TMA, and hand the tile back
    (dq_empty) once TMA has read it."""
    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc = descs
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty = bars
    off_b, off_hk, n0, heads, seqlen_q, offset = tile
    first, split, end = _q_tiles(n0, offset, seqlen_q, CAUSAL)
    t = 0
    for g in range(GROUP):  # the loader's order
        for m in range(split, end):
            _write_step(t, off_b, off_hk * GROUP + g, m, dq_desc, dq_smem, dq_full, dq_empty)
            t += 1
    if CAUSAL:
        for m in range(first, split):
            for g in range(GROUP):
                _write_step(t, off_b, off_hk * GROUP + g, m, dq_desc, dq_smem, dq_full, dq_empty)
                t += 1


@gluon.jit
def _write_step(t, off_b, off_h, m, dq_desc, dq_smem, dq_full, dq_empty):
    """Step t: the shared dQ tile added into Q tile m of query head off_h of dq_acc."""
    mbarrier.wait(dq_full, t & 1)
    for c in gl.static_range(HEAD_DIM // DQ_COLS):
        _tma_reduce_add(dq_desc, [off_b, m * BLOCK_M, off_h, c * DQ_COLS],
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
def _keep_visible(p, row, limit):
    """p where row <= limit, else 0 (broadcast; int32 row and limit): a setp + selp an
    element, as inline PTX. Written as gl.where, LLVM vectorizes the 32 comparisons of a
    thread into one <32 x i1> whose lowering packs and unpacks bits (about 100 more SASS
    instructions a step, and spills)."""
    return gl.inline_asm_elementwise("{ .reg .pred p; setp.le.s32 p, $2, $3; selp.f32 $0, $1, 0f00000000, p; }",
                                     "=f,f,r,r", [p, row, limit], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _consumer_step(i, dk, dv, k_rows, v_rows, k_cols, smem, bars, qk_scale, sm_scale, diag, G: gl.constexpr,
                   MASKED: gl.constexpr):
    """Step i (a query head's Q tile) into this group's dK, dV (64 K/V rows, fp32
    registers), and this group's 64 columns of the tile's dQ into the shared fp32 tile.
    MASKED: Pᵀ is zeroed where key row r, query column c have r - c > diag (j > i + offset;
    diag = offset + m0 - first key of the group). Returns (dk, dv)."""
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
    if MASKED:  # after the exp2: a row that sees no key (lse -inf, exp2 inf) gets 0 too
        # r - c <= diag, split by bits so that the thread's part is one register and the
        # element's part folds to an immediate: in the wgmma accumulator a thread's rows
        # differ only in bit 3 (r & 8) and its columns only outside bits 1-2 (c & 6 is
        # the lane's). Built from r and c as a whole, the 32 indices of a thread are
        # hoisted out of the loop and spill.
        r = gl.arange(0, 64, gl.SliceLayout(1, mma64))
        c = gl.arange(0, BLOCK_M, cols)
        lhs = gl.expand_dims((r & -9) - diag, 1) - gl.expand_dims(c & 6, 0)
        rhs = gl.expand_dims(c & -7, 0) - gl.expand_dims(r & 8, 1)
        pT = _keep_visible(pT, lhs, rhs)
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
def _consumer(descs, smem, bars, tile, out, G: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
              ADD: gl.constexpr):
    """Consumer warp group G: K/V rows [64 G, 64 G + 64) of the CTA's tile over every
    (query head, Q tile) step, then its dK (scaled) and dV rows stored in the output dtype
    (zeros after no step), or with ADD added to the fp32 sums there."""
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    off_b, off_hk, n0, heads, seqlen_q, offset = tile
    dk_ptr, dv_ptr, dk_strides, dv_strides, qk_scale, sm_scale = out
    mma128: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, 128, 16])
    k_full = k_smem.reshape([BLOCK_N, HEAD_DIM])
    k_rows = k_full.slice(64 * G, 64)  # Sᵀ's A operand
    k_cols = k_full.slice(64 * G, 64, dim=1)  # dQ's B operand: this group's dQ columns
    v_rows = v_smem.reshape([BLOCK_N, HEAD_DIM]).slice(64 * G, 64)
    dk = gl.zeros([64, HEAD_DIM], gl.float32, mma128)
    dv = gl.zeros([64, HEAD_DIM], gl.float32, mma128)
    mbarrier.wait(bars[0], 0)  # kv_ready (also before an empty range: no exit under a TMA in flight)
    first, split, end = _q_tiles(n0, offset, seqlen_q, CAUSAL)
    # The unmasked steps first, every head's: the non-causal kernel's loop, whatever the band.
    # (The other way round, values hoisted for both loops spill in the unmasked loop.)
    t0 = GROUP * (end - split)
    for t in range(t0):
        dk, dv = _consumer_step(t, dk, dv, k_rows, v_rows, k_cols, smem, bars, qk_scale, sm_scale, 0, G, False)
    if CAUSAL:  # then the masked ones, (tile, head) for tiles [first, split), in a loop of their own
        diag0 = offset + first * BLOCK_M - n0 - 64 * G
        for j in range(GROUP * (split - first)):
            dk, dv = _consumer_step(t0 + j, dk, dv, k_rows, v_rows, k_cols, smem, bars, qk_scale, sm_scale,
                                    diag0 + (j // GROUP) * BLOCK_M, G, True)
    rows = gl.arange(0, 64, gl.SliceLayout(1, mma128))
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, mma128))
    row0 = n0 + 64 * G
    _store_rows(dk_ptr, dk_strides, off_b, row0, off_hk, rows, cols, dk, ADD)
    _store_rows(dv_ptr, dv_strides, off_b, row0, off_hk, rows, cols, dv, ADD)


@gluon.jit
def _store_rows(ptr, strides, off_b, first, off_h, rows, cols, x, ADD: gl.constexpr):
    """x (64 rows from ``first`` of (batch, head) of a (B, S, H, D) tensor) stored, or
    with ADD added to the fp32 values there: a 64-bit offset to the first row, 32-bit
    offsets inside the tile (the launcher bounds them)."""
    stride_b, stride_s, stride_h = strides
    base = off_b.to(gl.int64) * stride_b + first.to(gl.int64) * stride_s + off_h.to(gl.int64) * stride_h
    offs = gl.expand_dims(rows * stride_s.to(gl.int32), 1) + gl.expand_dims(cols, 0)
    if ADD:
        x = x + gl.load(ptr + base + offs)
    gl.store(ptr + base + offs, x.to(ptr.dtype.element_ty))


@gluon.jit
def _consumer0(descs, smem, bars, tile, out, GROUP: gl.constexpr, CAUSAL: gl.constexpr, ADD: gl.constexpr):
    _consumer(descs, smem, bars, tile, out, 0, GROUP, CAUSAL, ADD)


@gluon.jit
def _consumer1(descs, smem, bars, tile, out, GROUP: gl.constexpr, CAUSAL: gl.constexpr, ADD: gl.constexpr):
    _consumer(descs, smem, bars, tile, out, 1, GROUP, CAUSAL, ADD)


@gluon.jit
def _attn_bwd_sm90_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, dk_ptr, dv_ptr,
                          dk_stride_b, dk_stride_s, dk_stride_h, dv_stride_b, dv_stride_s, dv_stride_h,
                          heads, kv_heads, seqlen_q, causal_offset, qk_scale, sm_scale, GROUP: gl.constexpr,
                          CAUSAL: gl.constexpr, ADD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          WORKER_REGS: gl.constexpr):
    """Grid (Sk / 128, B Hkv): K/V tile program_id(0) of (batch, kv head) program_id(1);
    GROUP = heads / kv_heads query heads a kv head. causal_offset is read only when CAUSAL;
    ADD: dK, dV added to the fp32 sums at dk_ptr, dv_ptr instead of written."""
    bh = gl.program_id(1)
    tile = (bh // kv_heads, bh % kv_heads, gl.program_id(0) * BLOCK_N, heads, seqlen_q, causal_offset)
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
    gl.warp_specialize([(_consumer0, (descs, smem, bars, tile, out, GROUP, CAUSAL, ADD)),
                        (_consumer1, (descs, smem, bars, tile, out, GROUP, CAUSAL, ADD)),
                        (_loader, (descs, smem, bars, tile, GROUP, CAUSAL)),
                        (_dq_writer, (descs, smem, bars, tile, GROUP, CAUSAL))],
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


def unsupported(dout, q, k, v, lse, delta, dq_acc, dk, dv, softmax_scale, causal_offset,
                accumulate: bool = False) -> Optional[Exception]:
    """Why this kernel cannot take these arguments: a TypeError / ValueError naming the
    argument (the module's docstring says what it serves), or None. ``dq_acc`` None: not
    checked (a caller about to allocate it; ``kernels/dispatch.py``)."""
    named = dict(dout=dout, q=q, k=k, v=v, lse=lse, delta=delta, dq_acc=dq_acc, dk=dk, dv=dv)
    if dq_acc is None:
        del named["dq_acc"]
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            return TypeError(f"attn_bwd_sm90: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name in ("dout", "q", "k", "v"):
        if named[name].dtype != torch.bfloat16:
            return TypeError(f"attn_bwd_sm90: {name} must be bfloat16, got {named[name].dtype}")
    for name in ("dk", "dv"):
        allowed = (torch.float32,) if accumulate else (torch.bfloat16, torch.float32)
        if named[name].dtype not in allowed:
            return TypeError(f"attn_bwd_sm90: {name} must be {' or '.join(str(t) for t in allowed)}"
                             f"{' (accumulate adds into fp32 sums)' if accumulate else ''}, got {named[name].dtype}")
    for name in ("lse", "delta", "dq_acc"):
        if name in named and named[name].dtype != torch.float32:
            return TypeError(f"attn_bwd_sm90: {name} must be float32, got {named[name].dtype}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        return ValueError(f"attn_bwd_sm90: softmax_scale must be a positive finite number, got {softmax_scale!r}")
    if causal_offset is not None and (isinstance(causal_offset, bool) or not isinstance(causal_offset, int)):
        return TypeError(f"attn_bwd_sm90: causal_offset must be an int or None (key j seen by query i iff "
                         f"j <= i + causal_offset), got {type(causal_offset).__name__}")
    for name in ("q", "k"):
        if named[name].dim() != 4:
            return ValueError(f"attn_bwd_sm90: {name} must be (B, S, H, D), got shape {tuple(named[name].shape)}")
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if d != HEAD_DIM.value:
        return ValueError(f"attn_bwd_sm90: q's head_dim must be {HEAD_DIM.value}, got {d}")
    for name, s in (("q", sq), ("k", sk)):
        if s == 0 or s % BLOCK_N.value:
            return ValueError(f"attn_bwd_sm90: {name}'s seqlen must be a positive multiple of {BLOCK_N.value}, "
                              f"got {s}")
    if k.shape[0] != b or k.shape[3] != d or hkv == 0 or h % hkv:
        return ValueError(f"attn_bwd_sm90: k must be (B, Sk, Hkv, D) with q's B = {b}, D = {d} and Hkv dividing "
                          f"H = {h}, got {tuple(k.shape)}")
    for name, like in (("dout", "q"), ("dq_acc", "q"), ("v", "k"), ("dk", "k"), ("dv", "k")):
        if name in named and tuple(named[name].shape) != tuple(named[like].shape):
            return ValueError(f"attn_bwd_sm90: {name} must have {like}'s shape {tuple(named[like].shape)}, got "
                              f"{tuple(named[name].shape)}")
    for name in ("lse", "delta"):
        if tuple(named[name].shape) != (b, h, sq):
            return ValueError(f"attn_bwd_sm90: {name} must be (B, H, Sq) = {(b, h, sq)}, got "
                              f"{tuple(named[name].shape)}")
    for name, t in named.items():
        if t.device != q.device:
            return ValueError(f"attn_bwd_sm90: {name} is on {t.device}, q on {q.device}")
        if t.stride(-1) != 1:
            return ValueError(f"attn_bwd_sm90: {name} must have a contiguous last dimension, strides {t.stride()}")
    for name in (name for name in ("dout", "q", "k", "v", "dq_acc", "dk", "dv") if name in named):
        t = named[name]
        if t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
            return ValueError(f"attn_bwd_sm90: {name}'s address and strides {t.stride()} must be multiples of "
                              f"16 bytes (TMA)")
        if t.stride(1) * BLOCK_N.value >= 2 ** 31:
            return ValueError(f"attn_bwd_sm90: {name}'s row stride {t.stride(1)} is too large (offsets "
                              f"inside a tile are 32-bit)")
    if b * h * sq >= 2 ** 31:
        return ValueError(f"attn_bwd_sm90: lse and delta hold {b * h * sq} elements, TMA takes < 2**31")
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return ValueError(f"attn_bwd_sm90: q is on {q.device}; this kernel runs on a Hopper (sm_90) GPU")
    return None


def _check(*args) -> None:
    error = unsupported(*args)
    if error is not None:
        raise error


def _kernel_offset(causal_offset, seqlen_q, seqlen_k) -> int:
    """causal_offset clamped to [-Sq, Sk] (the same visible pairs: past Sk - 1 every key is
    seen, below -(Sq - 1) none), so the kernel's int32 index arithmetic cannot overflow;
    0 without the band (not read)."""
    return 0 if causal_offset is None else max(-seqlen_q, min(causal_offset, seqlen_k))


def attn_bwd_sm90(dout, q, k, v, lse, delta, dq_acc, dk, dv, softmax_scale: float,
                  causal_offset: Optional[int] = None, accumulate: bool = False):
    """The backward of one (query block, key block) pair (head_dim 128, bf16):
    ``dq_acc += scale * dQ`` (fp32), dk = scale * dK and dv = dV written (bf16 or fp32), or
    with ``accumulate`` added into dk and dv (fp32 sums).

    q, dout, dq_acc (B, Sq, H, 128); k, v, dk, dv (B, Sk, Hkv, 128), Hkv dividing H.
    lse (natural log, the FINAL one of these queries) and delta (rowsum(out * dout),
    kernels.attn_delta) are (B, H, Sq) fp32 (copied if not contiguous). causal_offset:
    None sees every key; an int o lets query i see key j iff j <= i + o (PairMask.causal,
    o = q_start - k_start for two blocks of one sequence). Returns (dq_acc, dk, dv)."""
    _check(dout, q, k, v, lse, delta, dq_acc, dk, dv, softmax_scale, causal_offset, accumulate)
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    lse, delta = lse.contiguous(), delta.contiguous()
    _attn_bwd_sm90_kernel[(sk // BLOCK_N.value, b * hkv)](
        *_descriptors(q, k, v, dout, lse, delta, dq_acc), dk, dv, dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), h, hkv, sq, _kernel_offset(causal_offset, sq, sk),
        softmax_scale * LOG2E, softmax_scale, h // hkv, causal_offset is not None, bool(accumulate), CONSUMER_REGS,
        WORKER_REGS, num_warps=NUM_WARPS, maxnreg=MAXNREG)
    return dq_acc, dk, dv


def compile_sm90(consumer_regs: int = CONSUMER_REGS, worker_regs: int = WORKER_REGS, maxnreg: int = MAXNREG,
                 causal_offset: Optional[int] = None, heads: int = 4, kv_heads: int = 4, seqlen_q: int = 1024,
                 seqlen_k: int = 1024, accumulate: bool = False):
    """The kernel compiled for sm_90 on any machine, no GPU needed (triton ships ptxas):
    its ``.asm`` holds "ttgir", "ptx", "cubin"; ``.metadata.shared`` its shared memory in
    bytes. Specialized as ``attn_bwd_sm90`` would specialize it on contiguous (1, seqlen_q,
    heads, 128) q and (1, seqlen_k, kv_heads, 128) k inputs with this causal_offset and
    accumulate (dk, dv then fp32) (CPU
    stand-ins: only their types, alignments and strides are read; as in a launch, an int
    argument equal to 1, e.g. kv_heads, is compiled in as a constant, and those divisible
    by 16 are marked so)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource

    q = torch.zeros(1, seqlen_q, heads, HEAD_DIM.value, dtype=torch.bfloat16)
    k = torch.zeros(1, seqlen_k, kv_heads, HEAD_DIM.value, dtype=torch.bfloat16)
    stats = torch.zeros(1, heads, seqlen_q)
    dkv = k.float() if accumulate else k
    values = (*_descriptors(q, k, k, q, stats, stats, torch.zeros(q.shape)), dkv, dkv, *k.stride()[:3], *k.stride()[:3],
              heads, kv_heads, seqlen_q, _kernel_offset(causal_offset, seqlen_q, seqlen_k), 0.1 * LOG2E, 0.1)
    kernel = _attn_bwd_sm90_kernel
    sig, attrs = {}, {}
    consts = dict(GROUP=heads // kv_heads, CAUSAL=causal_offset is not None, ADD=accumulate,
                  CONSUMER_REGS=consumer_regs, WORKER_REGS=worker_regs)
    for i, (name, value) in enumerate(zip(kernel.arg_names, values)):  # as the JIT's launch would
        sig[name], spec = native_specialize_impl(CUDABackend, value, False, True, True)
        if sig[name] == "constexpr":
            consts[name] = spec  # an int equal to 1
        elif isinstance(spec, str) and spec:
            attrs[(i,)] = CUDABackend.parse_attr(spec)  # e.g. tt.divisibility 16
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=NUM_WARPS, maxnreg=maxnreg))
