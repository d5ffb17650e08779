"""The Gluon backward's two worker partitions (kernels/gluon/bwd.py): the loader warp, which
fills the stages the consumers read, and the dQ writer warp, which adds each step's shared
dQ tile into dq_acc by TMA. Both walk the consumers' steps in the same order, each
computing its bounds from the same scalars: a step one partition takes and another does
not leaves an mbarrier waiting forever."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .ordered import _landed_then_pass, _wait_for
from .ptx import _tma_reduce_add
from .tiles import BLOCK_M, BLOCK_N, DQ_COLS, HALVES, STAGES, _list_row, _listed_tile, _q_tiles

# Every partition gets the same four tuples and walks the same (query head, Q tile) steps:
#   descs = (q, k, v, do, lse, delta, dq): TMA descriptors
#   smem  = (q, do, lse, delta, k, v, dsT, dq): shared buffers
#   bars  = (kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty): mbarriers
#   tile  = (off_b, off_hk, n0, heads, seqlen_q, offset, band_lo)
# Steps: (query head off_hk * GROUP + g, Q tile m) for the tiles of _q_tiles(...), first the
# unmasked ones [split, split2) (g outer; DETERMINISTIC: m outer, downwards), then the masked
# ones (m outer): [first, split) across the band's upper edge, then [split2, end) across its
# lower edge.
# Step t (counted over both) uses stage s = t % STAGES, filled at parity
# (t // STAGES) & 1, and the dQ tile at parity t & 1.


@gluon.jit
def _loader(descs, smem, bars, tile, segs, blks, GROUP: gl.constexpr, CAUSAL: gl.constexpr, LOWER: gl.constexpr,
            SEGMENTS: gl.constexpr, DETERMINISTIC: gl.constexpr, BLOCKS: gl.constexpr):
    """One warp: K and V once (even for an empty Q range: the consumers wait for them),
    then per step (``_walk``) Q + lse (q_ready) and dO + delta (do_ready) into the stage
    both consumers last released (qdo_empty)."""
    k_desc, v_desc, k_smem, v_smem, kv_ready = descs[1], descs[2], smem[4], smem[5], bars[0]
    off_b, off_hk, n0 = tile[0], tile[1], tile[2]
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [off_b, n0, off_hk, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [off_b, n0, off_hk, 0], kv_ready, v_smem)
    _walk(_load_at, (descs, smem, bars, tile), tile, segs, blks, GROUP, CAUSAL, LOWER, SEGMENTS, DETERMINISTIC, BLOCKS)


@gluon.jit
def _walk(STEP: gl.constexpr, ctx, tile, segs, blks, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
          LOWER: gl.constexpr, SEGMENTS: gl.constexpr, DETERMINISTIC: gl.constexpr, BLOCKS: gl.constexpr):
    """``STEP(t, g, m, ctx, GROUP, LOWER, DETERMINISTIC)`` for every step t of the CTA, query
    head off_hk * GROUP + g and Q tile m, in the consumers' order (the comment above): the
    loader's and the dQ writer's one walk. BLOCKS: a block mask's listed steps, every
    head's full blocks (HALVES Q tiles each, head outer), then under a band every head's
    partial ones the same way. Else the unmasked tiles [split, split2), head outer, or
    DETERMINISTIC tile outer from split2 - 1 down to split (so that every K tile of a
    (batch, kv head) reaches Q tile m at the same step, whichever its first tile: the
    deterministic dQ's order), then the masked ones tile outer (``_walk_masked``)."""
    off_b, off_hk, n0, heads, seqlen_q, offset, band_lo = tile
    if BLOCKS:
        t = 0
        for g in range(GROUP):
            partial, full, row = _list_row(blks, off_hk, g, n0, GROUP)
            for j in range(HALVES * full):
                STEP(t + j, g, _listed_tile(row, partial, j), ctx, GROUP, LOWER, False)
            t += HALVES * full
        if CAUSAL or LOWER:
            for g in range(GROUP):
                partial, full, row = _list_row(blks, off_hk, g, n0, GROUP)
                for j in range(HALVES * partial):
                    STEP(t + j, g, _listed_tile(row, 0, j), ctx, GROUP, LOWER, False)
                t += HALVES * partial
    else:
        first, split, split2, end = _q_tiles(n0, offset, band_lo, seqlen_q, segs, off_b, CAUSAL, LOWER, SEGMENTS)
        if DETERMINISTIC:
            for i in range(split2 - split):
                for g in range(GROUP):
                    STEP(i * GROUP + g, g, split2 - 1 - i, ctx, GROUP, LOWER, DETERMINISTIC)
        else:
            for g in range(GROUP):
                for m in range(split, split2):
                    STEP(g * (split2 - split) + m - split, g, m, ctx, GROUP, LOWER, DETERMINISTIC)
        if CAUSAL or SEGMENTS:
            _walk_masked(STEP, ctx, GROUP * (split2 - split), first, split, GROUP, LOWER, DETERMINISTIC)
        if LOWER or SEGMENTS:
            _walk_masked(STEP, ctx, GROUP * (split2 - first), split2, end, GROUP, LOWER, DETERMINISTIC)


@gluon.jit
def _walk_masked(STEP: gl.constexpr, ctx, t0, first, split, GROUP: gl.constexpr, LOWER: gl.constexpr,
                 DETERMINISTIC: gl.constexpr):
    """The masked steps from step t0: (Q tile, head) for tiles [first, split), tile outer."""
    for m in range(first, split):
        for g in range(GROUP):
            STEP(t0 + (m - first) * GROUP + g, g, m, ctx, GROUP, LOWER, DETERMINISTIC)


@gluon.jit
def _load_at(t, g, m, ctx, GROUP: gl.constexpr, LOWER: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """The loader's step (``_walk``'s STEP)."""
    descs, smem, bars, tile = ctx
    _load_step(t, tile[0], tile[1] * GROUP + g, m, tile[3], tile[4], descs, smem, bars)


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
def _dq_writer(descs, smem, bars, tile, segs, blks, turns, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
               LOWER: gl.constexpr, SEGMENTS: gl.constexpr, DETERMINISTIC: gl.constexpr, BLOCKS: gl.constexpr):
    """One warp: per step (``_walk``), once both consumers filled the shared dQ tile
    (dq_full), add it into that head's rows of dq_acc by TMA, and hand the tile back
    (dq_empty) once TMA has read it. DETERMINISTIC: each add waits for its turn
    (``_wait_for``: K tiles in increasing order) and the tile goes back once the add has
    landed."""
    _walk(_write_step, (descs, smem, bars, tile, turns), tile, segs, blks, GROUP, CAUSAL, LOWER, SEGMENTS,
          DETERMINISTIC, BLOCKS)


@gluon.jit
def _write_step(t, g, m, ctx, GROUP: gl.constexpr, LOWER: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """The dQ writer's step (``_walk``'s STEP): the shared dQ tile added into Q tile m of
    query head off_hk * GROUP + g."""
    descs, smem, bars, tile, turns = ctx
    dq_desc, dq_smem, dq_full, dq_empty = descs[6], smem[7], bars[5], bars[6]
    off_b, off_hk, n0, heads, seqlen_q = tile[0], tile[1], tile[2], tile[3], tile[4]
    off_h = off_hk * GROUP + g
    mbarrier.wait(dq_full, t & 1)
    if DETERMINISTIC:
        flag = turns + (off_b * heads + off_h) * (seqlen_q // BLOCK_M) + m
        first_k = 0  # the lowest K tile that reaches Q tile m
        if LOWER:  # a window: the K tile of query m * BLOCK_M's lowest key, m * BLOCK_M + band_lo
            first_k = gl.maximum(m * BLOCK_M + tile[6], 0) // BLOCK_N
        _wait_for(flag, n0 // BLOCK_N - first_k)  # the K tiles add in increasing order
    boxes: gl.constexpr = dq_smem.shape[0]  # head_dim / DQ_COLS
    for c in gl.static_range(boxes):
        _tma_reduce_add(dq_desc, [off_b, m * BLOCK_M, off_h, c * DQ_COLS],
                        dq_smem.index(c).reshape(dq_desc.block_type.shape))
    if DETERMINISTIC:
        _landed_then_pass(flag)
    else:
        tma.store_wait(0)  # the tile was read (not that the adds landed: the grid's end sees to that)
    mbarrier.arrive(dq_empty, count=1)
