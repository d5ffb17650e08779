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
    then per (query head, Q tile) Q + lse (q_ready) and dO + delta (do_ready) into the
    stage both consumers last released (qdo_empty). DETERMINISTIC: the unmasked steps in
    ``_load_unmasked``'s other order. BLOCKS: the listed steps (``_load_listed``)."""
    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc = descs
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty = bars
    off_b, off_hk, n0, heads, seqlen_q, offset, band_lo = tile
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [off_b, n0, off_hk, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [off_b, n0, off_hk, 0], kv_ready, v_smem)
    if BLOCKS:
        _load_listed(off_b, off_hk, n0, heads, seqlen_q, blks, descs, smem, bars, GROUP, CAUSAL or LOWER)
    else:
        first, split, split2, end = _q_tiles(n0, offset, band_lo, seqlen_q, segs, off_b, CAUSAL, LOWER, SEGMENTS)
        _load_unmasked(split, split2, off_b, off_hk, heads, seqlen_q, descs, smem, bars, GROUP, DETERMINISTIC)
        if CAUSAL or SEGMENTS:
            _load_masked(GROUP * (split2 - split), first, split, off_b, off_hk, heads, seqlen_q, descs, smem, bars,
                         GROUP)
        if LOWER or SEGMENTS:
            _load_masked(GROUP * (split2 - first), split2, end, off_b, off_hk, heads, seqlen_q, descs, smem, bars,
                         GROUP)


@gluon.jit
def _load_unmasked(split, end, off_b, off_hk, heads, seqlen_q, descs, smem, bars, GROUP: gl.constexpr,
                   DETERMINISTIC: gl.constexpr):
    """The unmasked steps, from step 0: (head, Q tile) for tiles [split, end), head outer;
    DETERMINISTIC: (Q tile, head) for tiles end - 1 down to split, tile outer, so that every
    K tile of a (batch, kv head) reaches Q tile m at the same step, whichever its first tile
    (the deterministic dQ's order, below)."""
    if DETERMINISTIC:
        for i in range(end - split):
            for g in range(GROUP):
                _load_step(i * GROUP + g, off_b, off_hk * GROUP + g, end - 1 - i, heads, seqlen_q, descs, smem, bars)
    else:
        for g in range(GROUP):
            for m in range(split, end):
                _load_step(g * (end - split) + m - split, off_b, off_hk * GROUP + g, m, heads, seqlen_q, descs,
                           smem, bars)


@gluon.jit
def _load_listed(off_b, off_hk, n0, heads, seqlen_q, blks, descs, smem, bars, GROUP: gl.constexpr,
                 BAND: gl.constexpr):
    """A block mask's steps: every head's full blocks (HALVES Q tiles each, head outer),
    then with a BAND every head's partial ones, the same way (the blocks the band crosses:
    the masked steps)."""
    t = 0
    for g in range(GROUP):
        partial, full, row = _list_row(blks, off_hk, g, n0, GROUP)
        for j in range(HALVES * full):
            _load_step(t + j, off_b, off_hk * GROUP + g, _listed_tile(row, partial, j), heads, seqlen_q, descs, smem,
                       bars)
        t += HALVES * full
    if BAND:
        for g in range(GROUP):
            partial, full, row = _list_row(blks, off_hk, g, n0, GROUP)
            for j in range(HALVES * partial):
                _load_step(t + j, off_b, off_hk * GROUP + g, _listed_tile(row, 0, j), heads, seqlen_q, descs, smem,
                           bars)
            t += HALVES * partial


@gluon.jit
def _load_masked(t0, first, split, off_b, off_hk, heads, seqlen_q, descs, smem, bars, GROUP: gl.constexpr):
    """The masked steps from step t0: (Q tile, head) for tiles [first, split), tile outer."""
    for m in range(first, split):
        for g in range(GROUP):
            _load_step(t0 + (m - first) * GROUP + g, off_b, off_hk * GROUP + g, m, heads, seqlen_q, descs, smem,
                       bars)


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
    """One warp: per (query head, Q tile), once both consumers filled the shared dQ tile
    (dq_full), add it into that head's rows of dq_acc by TMA, and hand the tile back
    (dq_empty) once TMA has read it. DETERMINISTIC: each add waits for its turn
    (``_wait_for``: K tiles in increasing order) and the tile goes back once the add has
    landed. The loader's order."""
    if BLOCKS:
        t = 0
        for g in range(GROUP):
            partial, full, row = _list_row(blks, tile[1], g, tile[2], GROUP)
            for j in range(HALVES * full):
                _write_step(t + j, g, _listed_tile(row, partial, j), descs, smem, bars, tile, turns, GROUP, LOWER,
                            False)
            t += HALVES * full
        if CAUSAL or LOWER:
            for g in range(GROUP):
                partial, full, row = _list_row(blks, tile[1], g, tile[2], GROUP)
                for j in range(HALVES * partial):
                    _write_step(t + j, g, _listed_tile(row, 0, j), descs, smem, bars, tile, turns, GROUP, LOWER,
                                False)
                t += HALVES * partial
    else:
        first, split, split2, end = _q_tiles(tile[2], tile[5], tile[6], tile[4], segs, tile[0], CAUSAL, LOWER, SEGMENTS)
        _write_unmasked(split, split2, descs, smem, bars, tile, turns, GROUP, LOWER, DETERMINISTIC)
        if CAUSAL or SEGMENTS:
            _write_masked(GROUP * (split2 - split), first, split, descs, smem, bars, tile, turns, GROUP, LOWER,
                          DETERMINISTIC)
        if LOWER or SEGMENTS:
            _write_masked(GROUP * (split2 - first), split2, end, descs, smem, bars, tile, turns, GROUP, LOWER,
                          DETERMINISTIC)


@gluon.jit
def _write_unmasked(split, end, descs, smem, bars, tile, turns, GROUP: gl.constexpr, LOWER: gl.constexpr,
                    DETERMINISTIC: gl.constexpr):
    """_load_unmasked's steps."""
    if DETERMINISTIC:
        for i in range(end - split):
            for g in range(GROUP):
                _write_step(i * GROUP + g, g, end - 1 - i, descs, smem, bars, tile, turns, GROUP, LOWER, DETERMINISTIC)
    else:
        for g in range(GROUP):
            for m in range(split, end):
                _write_step(g * (end - split) + m - split, g, m, descs, smem, bars, tile, turns, GROUP, LOWER,
                            DETERMINISTIC)


@gluon.jit
def _write_masked(t0, first, split, descs, smem, bars, tile, turns, GROUP: gl.constexpr, LOWER: gl.constexpr,
                  DETERMINISTIC: gl.constexpr):
    """_load_masked's steps."""
    for m in range(first, split):
        for g in range(GROUP):
            _write_step(t0 + (m - first) * GROUP + g, g, m, descs, smem, bars, tile, turns, GROUP, LOWER, DETERMINISTIC)


@gluon.jit
def _write_step(t, g, m, descs, smem, bars, tile, turns, GROUP: gl.constexpr, LOWER: gl.constexpr,
                DETERMINISTIC: gl.constexpr):
    """Step t: the shared dQ tile added into Q tile m of query head off_hk * GROUP + g."""
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
