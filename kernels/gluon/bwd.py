"""A warp-specialized attention backward for Hopper (sm_90), written in Gluon.

A FlashAttention-3-style backward: non-causal, the causal band and windows, segment ids, block
masks and dropout, MHA, GQA and MQA.
``flash_attn``'s default backward on sm_90 where it serves the call (kernels/dispatch.py),
and that of every block pair of the ring's steps where it serves them all (dK/dV added
into the ring's fp32 sums: ``accumulate``; ringflash/ring/rotate.py). Tested against the float64 oracle on an H100
(tests/test_gluon_gpu.py), compiled for sm_90 on CPU (tests/test_gluon_compile.py); its
host side (checks, descriptors, launch) is kernels/gluon/launch.py.

Shapes served: q, dout (B, Sq, H, D) and k, v (B, Sk, Hkv, D), D 64 or 128 (128 is the
tuned one), bf16, Hkv dividing H
(query head h reads kv head h // (H / Hkv): MHA, GQA, MQA), Sq and Sk positive multiples
of 128, any strides with a contiguous last dimension (TMA: the other strides and the base
addresses 16-byte aligned). Masks: none (``causal_offset=None``) or the causal band with
an offset, as ``PairMask.causal(o)`` (kernels/masks.py): key j is seen by query i iff
j <= i + o, on the pair's local indices (o = q_start - k_start for two blocks of one
sequence: the ring's pairs); with it or without it, a window's lower edge ``band_lo``: key
j seen only if j >= i + band_lo (``PairMask.band_lo``); with any of these, segment ids
(``SEGMENTS``, not with ``DETERMINISTIC``: key j seen only if its id equals query i's);
and with any of these, attention dropout (``DROPOUT``, not with ``DETERMINISTIC`` or a
block mask: kernels/dropout.py's bits on global positions, drawn per step in the Sᵀ tile's
registers by kernels/gluon/dropout.py; Pᵀ and dPᵀ scaled where kept, zeroed where
dropped, so dV, dK and dQ are those of the dropped probabilities). lse (natural
log; -inf for a row that sees no key) and delta = rowsum(out * dout) are (B, H, Sq) fp32;
dq_acc is an fp32 (B, Sq, H, D) running sum the kernel ADDS ``scale * dQ`` into (the
ring's); dk and dv (B, Sk, Hkv, D), bf16 or
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
  order by default (dQ's last bits may differ run to run); with ``DETERMINISTIC`` the
  K tiles add in increasing order (counters, acquire / release: kernels/gluon/ordered.py).

Causal band: with K/V outer, a CTA skips the Q tiles none of its keys is seen by: its Q
range starts at the tile of query n0 - o (the first that sees key n0) and runs to the end.
The tiles of that range crossing the diagonal of the CTA's 128 keys ([first, split),
two or three of them) go through a masked step (``MASKED``: Pᵀ zeroed where j > i + o,
after the exp2, so a row whose lse is -inf gives 0, not NaN), in a loop of their own
after the unmasked steps ([split, split2)), whose loop is the non-causal kernel's. The
loader, the two consumers and the dQ writer compute (first, split, split2, end) each for itself
from the same scalars (``_q_tiles``) and walk the same steps in the same order: a step
one partition takes and another does not leaves an mbarrier waiting forever. A K tile
whose range is empty still loads K and V (the consumers wait for them, so the CTA does
not exit under a TMA in flight) and writes dk = dv = 0. A window (``LOWER``) ends the
range at the last query that sees the tile's last key, and its tiles across that edge
([split2, end)) take a masked loop of their own after the first; every masked step masks
by every edge the kernel has (a window narrower than a K tile puts a Q tile across both).
Order: program_id(0) is the K
tile, in increasing order, so under the band the longest CTAs (first K tiles, most Q
tiles) start first; FA3 walks an LPT order over (head, K tile) in chunks sized to L2
(hopper/tile_scheduler.hpp), not done here.

Segment ids narrow (first, split, split2, end) by the K tile's own four bounds
(``masks.segment_tiles`` over Q tiles: the tiles some key's document reaches, those inside
every key's; ``tiles._narrow``), so both masked loops run; a masked step also masks by
each key's hull of queries sharing its id, two more edges read at the step
(``_consumer_step``; at head_dim 128 the masked loops spill a little,
tests/test_gluon_compile.py's MASKED_SPILLS).

GQA: GROUP = H / Hkv (a constexpr: one compile per group size) query heads per kv head;
a CTA's dK and dV sum over all of them, in the same fp32 registers, and dQ goes to each
query head's rows of dq_acc.

The TMA reduce-add has no public Gluon wrapper in triton 3.6; ``_tma_reduce_add`` calls
the builder's ``create_async_tma_reduce`` (a private binding: pin triton and keep the PTX
test, tests/test_gluon_compile.py).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .dropout import keep_t
from .ptx import _keep_visible, _signal
from .tiles import BLOCK_M, BLOCK_N, DQ_COLS, HALVES, STAGES, _list_row, _listed_steps, _listed_tile, _q_tiles
from .walk import _dq_writer, _loader

HEAD_DIMS = (64, 128)  # head dims served: the kernel reads its own from its descriptors' boxes
# The partitions get the same four tuples and walk the same (query head, Q tile) steps
# (kernels/gluon/walk.py has the loader's and the dQ writer's side, and the steps' order).


@gluon.jit
def _consumer_step(i, dk, dv, k_rows, v_rows, k_cols, smem, bars, qk_scale, sm_scale, diag, diag_lo, ids, at, drop,
                   G: gl.constexpr, MASKED: gl.constexpr, MASKED_LO: gl.constexpr, SEG: gl.constexpr,
                   DROPOUT: gl.constexpr):
    """Step i (a query head's Q tile) into this group's dK, dV (64 K/V rows, fp32
    registers), and this group's half of the tile's dQ columns into the shared fp32 tile.
    MASKED: Pᵀ is zeroed where key row r, query column c have r - c > diag (j > i + offset;
    diag = offset + m0 - first key of the group); MASKED_LO: where r - c < diag_lo (j < i +
    band_lo, the same way); SEG: where the query lies outside the key's hull [lo, hi) of
    queries sharing its id (``masks.segment_ranges``, read per masked step from the kernel's
    arguments for the group's 64 keys), as two more edges split the band's way, and where
    the query sees no key at all (a padding query inside a hull: its lse taken as +inf, so
    exp2 gives 0). Inside a hull every query that sees a key has the key's id (the ids are
    non-decreasing but for padding), so this is the id compare without the queries' ids.
    DROPOUT: Pᵀ and dPᵀ scaled where kept and zeroed where dropped (``dropout.keep_t``
    at the step's query head and first query position ``at``, ``_step_at``). Returns (dk, dv)."""
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    kv_ready, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty = bars
    # 64 x 64 tiles (Sᵀ, dPᵀ), 64 x D/2 (dQ half) and 64 x D (dK, dV); P and dS enter dV
    # and dK as register operands whose layout matches the 64 x 64 accumulator's registers.
    D: gl.constexpr = q_smem.shape[4]
    mma64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, D // 2, 16])
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, mma64)  # one value per Q row (a column of Sᵀ)
    s = i % STAGES
    ph = (i // STAGES) & 1
    q_s = q_smem.index(s).reshape([BLOCK_M, D])
    do_s = do_smem.index(s).reshape([BLOCK_M, D])
    zero = gl.zeros([64, BLOCK_M], gl.float32, mma64)

    # Sᵀ and dPᵀ issued back to back; the softmax runs under dPᵀ.
    mbarrier.wait(q_ready.index(s), ph)
    sT = warpgroup_mma(k_rows, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(s), ph)
    dpT = warpgroup_mma(v_rows, do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    lse = lse_smem.index(s).load(cols) * 1.4426950408889634  # natural log -> log2, as exp2 wants
    if SEG:  # a query that sees nothing (padding, inside some key's hull): P = exp2(-inf) = 0
        lse = gl.where(lse == float("-inf"), float("inf"), lse)
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
    if MASKED_LO:  # r - c >= diag_lo, split the same way: c - r + diag_lo <= 0
        r = gl.arange(0, 64, gl.SliceLayout(1, mma64))
        c = gl.arange(0, BLOCK_M, cols)
        lhs = gl.expand_dims(diag_lo - (r & -9), 1) + gl.expand_dims(c & 6, 0)
        rhs = gl.expand_dims(r & 8, 1) - gl.expand_dims(c & -7, 0)
        pT = _keep_visible(pT, lhs, rhs)
    if SEG:  # query0 + c in [lo, hi) of key key0 + r, split as the band's edges: c = (c & 6) + (c & -7)
        r = gl.arange(0, 64, gl.SliceLayout(1, mma64))
        c = gl.arange(0, BLOCK_M, cols)
        segs, off_b, key0, query0 = ids  # from the kernel's arguments: nothing kept in registers
        lo = gl.load(segs[0] + off_b.to(gl.int64) * segs[2] + key0 + r) - query0
        hi = gl.load(segs[1] + off_b.to(gl.int64) * segs[3] + key0 + r) - query0
        pT = _keep_visible(pT, gl.expand_dims(lo, 1) - gl.expand_dims(c & 6, 0),
                           gl.expand_dims(c & -7, 0) + gl.expand_dims(r * 0, 1))
        pT = _keep_visible(pT, gl.expand_dims(c & 6, 0) - gl.expand_dims(hi - 1, 1),
                           gl.expand_dims(-(c & -7), 0) + gl.expand_dims(r * 0, 1))
    keep = zero == 0  # DROPOUT: dV takes the dropped probabilities, dPᵀ the dropped gradient (delta unchanged)
    if DROPOUT:
        keep = keep_t(drop[6], at[1], at[0], drop[7], drop, mma64)
        p_op = gl.convert_layout(gl.where(keep, pT * drop[3], 0.0).to(gl.bfloat16), op_a, assert_trivial=True)
    else:
        p_op = gl.convert_layout(pT.to(gl.bfloat16), op_a, assert_trivial=True)
    dv = warpgroup_mma(p_op, do_s, dv, is_async=True)

    delta = delta_smem.index(s).load(cols)
    dpT = warpgroup_mma_wait(1, deps=[dpT])  # Sᵀ and dPᵀ done; dV may still run
    if DROPOUT:
        dpT = gl.where(keep, dpT * drop[3], 0.0)
    dsT = (pT * (dpT - gl.expand_dims(delta, 0)) * sm_scale).to(gl.bfloat16)
    ds_op = gl.convert_layout(dsT, op_a, assert_trivial=True)
    dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)

    # dQ needs all 128 keys' dS: each group writes its 64 rows of dSᵀ, then both read both.
    ds_s = ds_smem.index(s)
    ds_s.slice(64 * G, 64).store(dsT)
    _signal(ds_ready.index(s))
    mbarrier.wait(ds_ready.index(s), ph)
    dq = warpgroup_mma(ds_s.permute((1, 0)), k_cols, gl.zeros([BLOCK_M, D // 2], gl.float32, mma_q), use_acc=False,
                       is_async=True)
    dq, dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dq, dv, dk, p_op, ds_op])
    mbarrier.arrive(qdo_empty.index(s), count=1)  # Q, dO, lse, delta of stage s are read

    # This group's D / 2 dQ columns, as 32-column boxes, once the writer released the tile.
    mbarrier.wait(dq_empty, (i & 1) ^ 1)
    if D // 2 == 2 * DQ_COLS:
        left, right = dq.reshape([BLOCK_M, 2, DQ_COLS]).permute([0, 2, 1]).split()
        dq_smem.index(2 * G).store(left)
        dq_smem.index(2 * G + 1).store(right)
    else:  # D = 64: one box a group
        dq_smem.index(G).store(dq)
    _signal(dq_full)
    return dk, dv


@gluon.jit
def _consumer(descs, smem, bars, tile, out, segs, blks, drop, G: gl.constexpr, GROUP: gl.constexpr,
              CAUSAL: gl.constexpr, LOWER: gl.constexpr, SEGMENTS: gl.constexpr, ADD: gl.constexpr,
              BLOCKS: gl.constexpr, DROPOUT: gl.constexpr):
    """Consumer warp group G: K/V rows [64 G, 64 G + 64) of the CTA's tile over every
    (query head, Q tile) step, then its dK (scaled) and dV rows stored in the output dtype
    (zeros after no step), or with ADD added to the fp32 sums there."""
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    off_b, off_hk, n0, heads, seqlen_q, offset, band_lo = tile
    qk_scale, sm_scale = out[4], out[5]
    D: gl.constexpr = k_smem.shape[3]  # head_dim
    mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    k_full = k_smem.reshape([BLOCK_N, D])
    k_rows = k_full.slice(64 * G, 64)  # Sᵀ's A operand
    k_cols = k_full.slice(D // 2 * G, D // 2, dim=1)  # dQ's B operand: this group's dQ columns
    v_rows = v_smem.reshape([BLOCK_N, D]).slice(64 * G, 64)
    dk = gl.zeros([64, D], gl.float32, mma_d)
    dv = gl.zeros([64, D], gl.float32, mma_d)
    mbarrier.wait(bars[0], 0)  # kv_ready (also before an empty range: no exit under a TMA in flight)
    operands = (k_rows, v_rows, k_cols, qk_scale, sm_scale)
    # dropout's (seed lo, hi, threshold, scale, the kv head's first query head, q0, this group's first key, batch,
    # jump): global head and positions (read only when DROPOUT)
    drop = (drop[0], drop[1], drop[2], drop[3], off_hk * GROUP + drop[4], drop[5],
            drop[6] + n0 + 64 * G + (n0 // BLOCK_N) * drop[7], off_b, drop[7])
    if BLOCKS:  # the loader's listed steps: the unmasked ones need only their count
        steps = _listed_steps(blks, off_hk, n0, GROUP)
        dk, dv = _consume_unmasked(steps, 0, dk, dv, operands, smem, bars, drop, G, GROUP, False)
        if CAUSAL or LOWER:
            dk, dv = _consume_listed(steps, dk, dv, operands, smem, bars, blks, off_hk, n0 + 64 * G,
                                     offset, band_lo, G, GROUP, CAUSAL, LOWER)
    else:
        first, split, split2, end = _q_tiles(n0, offset, band_lo, seqlen_q, segs, off_b, CAUSAL, LOWER, SEGMENTS)
        # The unmasked steps first, every head's: the non-causal kernel's loop, whatever the
        # band, then the masked ones, (tile, head), in loops of their own: the tiles [first,
        # split) across the band's upper edge, then [split2, end) across its lower edge (each
        # masked by both edges: a narrow window's tile may cross both). (Masked loops first,
        # values hoisted for both kinds of loop spill in the unmasked one.)
        dk, dv = _consume_unmasked(GROUP * (split2 - split), split, dk, dv, operands, smem, bars, drop, G, GROUP,
                                   DROPOUT)
        if CAUSAL or SEGMENTS:
            at = first * BLOCK_M - n0 - 64 * G  # the first tile's first query minus the group's first key
            dk, dv = _consume_masked(GROUP * (split2 - split), GROUP * (split - first), first, offset + at,
                                     band_lo + at, dk, dv, operands, smem, bars,
                                     (segs, off_b, n0 + 64 * G, first * BLOCK_M), drop, G, GROUP, CAUSAL, LOWER,
                                     SEGMENTS, DROPOUT)
        if LOWER or SEGMENTS:
            at = split2 * BLOCK_M - n0 - 64 * G
            dk, dv = _consume_masked(GROUP * (split2 - first), GROUP * (end - split2), split2, offset + at,
                                     band_lo + at, dk, dv, operands, smem, bars,
                                     (segs, off_b, n0 + 64 * G, split2 * BLOCK_M), drop, G, GROUP, CAUSAL, LOWER,
                                     SEGMENTS, DROPOUT)
    _store_dkv(dk, dv, out, off_b, off_hk, n0, G, ADD)


@gluon.jit
def _store_dkv(dk, dv, out, off_b, off_hk, n0, G: gl.constexpr, ADD: gl.constexpr):
    """Group G's dK (scaled) and dV rows stored in the output dtype, or with ADD added to
    the fp32 sums there."""
    dk_ptr, dv_ptr, dk_strides, dv_strides, qk_scale, sm_scale = out
    D: gl.constexpr = dk.shape[1]
    mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    rows = gl.arange(0, 64, gl.SliceLayout(1, mma_d))
    cols = gl.arange(0, D, gl.SliceLayout(0, mma_d))
    row0 = n0 + 64 * G
    _store_rows(dk_ptr, dk_strides, off_b, row0, off_hk, rows, cols, dk, ADD)
    _store_rows(dv_ptr, dv_strides, off_b, row0, off_hk, rows, cols, dv, ADD)


@gluon.jit
def _consume_unmasked(steps, split, dk, dv, operands, smem, bars, drop, G: gl.constexpr, GROUP: gl.constexpr,
                      DROPOUT: gl.constexpr):
    """Steps 0 .. steps - 1, unmasked: (head, Q tile) from tile ``split`` (walk.py's
    ``_load_unmasked`` order; the head and tile are read only for DROPOUT, which is not
    served with DETERMINISTIC, whose order differs)."""
    k_rows, v_rows, k_cols, qk_scale, sm_scale = operands
    tiles = steps // GROUP
    for t in range(steps):
        at = (0, 0)
        if DROPOUT:
            at = _step_at(drop, t // tiles, split + t % tiles)
        dk, dv = _consumer_step(t, dk, dv, k_rows, v_rows, k_cols, smem, bars, qk_scale, sm_scale, 0, 0, (0, 0), at,
                                drop, G, False, False, False, DROPOUT)
    return dk, dv


@gluon.jit
def _step_at(drop, g, m):
    """Dropout's ``at`` of a step: (the global index of query head g of the group, the
    global position of Q tile m's first query: q0 + m0 + (m0 // 128) * jump, PairMask.pos)."""
    m0 = m * BLOCK_M
    return drop[4] + g, drop[5] + m0 + (m0 // BLOCK_N) * drop[8]


@gluon.jit
def _consume_listed(t0, dk, dv, operands, smem, bars, blks, off_hk, key0, offset, band_lo, G: gl.constexpr,
                    GROUP: gl.constexpr, CAUSAL: gl.constexpr, LOWER: gl.constexpr):
    """A block mask's masked steps from step t0 (``_load_listed``'s: every head's partial
    blocks), each masked by the band's edges at its Q tile's diagonals (the group's first
    key ``key0``)."""
    k_rows, v_rows, k_cols, qk_scale, sm_scale = operands
    t = t0
    for g in range(GROUP):
        partial, full, row = _list_row(blks, off_hk, g, key0 - 64 * G, GROUP)
        for j in range(HALVES * partial):
            at = _listed_tile(row, 0, j) * BLOCK_M - key0
            dk, dv = _consumer_step(t + j, dk, dv, k_rows, v_rows, k_cols, smem, bars, qk_scale, sm_scale,
                                    offset + at, band_lo + at, (0, 0), (0, 0), (0, 0), G, CAUSAL, LOWER, False, False)
        t += HALVES * partial
    return dk, dv


@gluon.jit
def _consume_masked(t0, steps, m_first, diag0, diag0_lo, dk, dv, operands, smem, bars, ids, drop, G: gl.constexpr,
                    GROUP: gl.constexpr, CAUSAL: gl.constexpr, LOWER: gl.constexpr, SEGMENTS: gl.constexpr,
                    DROPOUT: gl.constexpr):
    """Steps t0 .. t0 + steps - 1, masked by the band's edges (each where CAUSAL, LOWER) and
    the ids (SEGMENTS): (Q tile, head) from tile m_first, the diagonals ``diag0``,
    ``diag0_lo`` and the first query ids[3] (``_consumer_step``'s, for the first tile) one
    Q tile further every GROUP steps."""
    k_rows, v_rows, k_cols, qk_scale, sm_scale = operands
    for j in range(steps):
        at = (0, 0)
        if DROPOUT:
            at = _step_at(drop, j % GROUP, m_first + j // GROUP)
        dk, dv = _consumer_step(t0 + j, dk, dv, k_rows, v_rows, k_cols, smem, bars, qk_scale, sm_scale,
                                diag0 + (j // GROUP) * BLOCK_M, diag0_lo + (j // GROUP) * BLOCK_M,
                                (ids[0], ids[1], ids[2], ids[3] + (j // GROUP) * BLOCK_M), at, drop, G, CAUSAL, LOWER,
                                SEGMENTS, DROPOUT)
    return dk, dv


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
def _consumer0(descs, smem, bars, tile, out, segs, blks, drop, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
               LOWER: gl.constexpr, SEGMENTS: gl.constexpr, ADD: gl.constexpr, BLOCKS: gl.constexpr,
               DROPOUT: gl.constexpr):
    _consumer(descs, smem, bars, tile, out, segs, blks, drop, 0, GROUP, CAUSAL, LOWER, SEGMENTS, ADD, BLOCKS, DROPOUT)


@gluon.jit
def _consumer1(descs, smem, bars, tile, out, segs, blks, drop, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
               LOWER: gl.constexpr, SEGMENTS: gl.constexpr, ADD: gl.constexpr, BLOCKS: gl.constexpr,
               DROPOUT: gl.constexpr):
    _consumer(descs, smem, bars, tile, out, segs, blks, drop, 1, GROUP, CAUSAL, LOWER, SEGMENTS, ADD, BLOCKS, DROPOUT)


@gluon.jit(do_not_specialize=("seed_lo", "seed_hi", "drop_threshold", "drop_head0", "drop_q0", "drop_k0", "drop_jump"))
def _attn_bwd_sm90_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, dk_ptr, dv_ptr,
                          dk_stride_b, dk_stride_s, dk_stride_h, dv_stride_b, dv_stride_s, dv_stride_h,
                          heads, kv_heads, seqlen_q, causal_offset, band_lo, qk_scale, sm_scale, dq_turns,
                          keys_lo_ptr, keys_hi_ptr, keys_lo_stride_b, keys_hi_stride_b, tiles_ptr, tiles_stride_b,
                          blk_counts, blk_index, blk_kind_stride, blk_head_rows, blk_cols,
                          seed_lo, seed_hi, drop_threshold, drop_scale, drop_head0, drop_q0, drop_k0, drop_jump,
                          GROUP: gl.constexpr, CAUSAL: gl.constexpr, LOWER: gl.constexpr, SEGMENTS: gl.constexpr,
                          ADD: gl.constexpr, DETERMINISTIC: gl.constexpr, BLOCKS: gl.constexpr,
                          DROPOUT: gl.constexpr, CONSUMER_REGS: gl.constexpr, WORKER_REGS: gl.constexpr):
    """Grid (R, B Hkv, Sk / (128 R)): K/V tile program_id(0) + R program_id(2) of (batch, kv
    head) program_id(1). R = Sk / 128, one round, by default; DETERMINISTIC: rounds of R
    (16, or fewer where they do not divide Sk / 128) K tiles of every (batch, kv head) in
    turn. Blocks are dispatched in the order of x, then y, then z, so a CTA waits only for
    CTAs dispatched before it (its K tile's predecessors), and a wave of 132 CTAs holds
    about 132 / R heads: the chain of adds one Q tile waits through within a wave is R
    long, not the whole wave (and under the band the longest CTAs, the lowest K tiles,
    still start first). GROUP = heads / kv_heads query heads a kv head. causal_offset is
    read only when CAUSAL, band_lo (a window's lower edge, j >= i + band_lo) only when
    LOWER; ADD: dK, dV added to the fp32 sums at dk_ptr, dv_ptr instead of
    written; dq_turns (DETERMINISTIC only): (B, H, Sq / 64) int32 zeros, the dQ adds'
    counters; SEGMENTS (not with DETERMINISTIC): each key's hull of queries [lo, hi), int32
    (B, Sk) with contiguous rows (``masks.segment_ranges``), and ``masks.segment_tiles``'
    (B, Sk / 128, 4) over Q tiles of 64. BLOCKS (a block mask; not with SEGMENTS or
    DETERMINISTIC): ``masks.block_lists`` of the mask transposed (a row a key block, its
    query blocks), counts (2, Hm, Sk / 128) int32 whose partial / full stride is
    blk_kind_stride, indices (Hm, Sk / 128, blk_cols) int32, a query head's rows
    blk_head_rows apart (0: one mask for every head). DROPOUT (not with DETERMINISTIC or
    BLOCKS): kernels/dropout.py's bits of the 64-bit seed (seed_lo, seed_hi), threshold and
    kept scale, query head h's global index drop_head0 + h, and PairMask.pos's positions
    (q0, k0, stride 1, jump) with q0 % 16 == k0 % 32 == jump % 32 == 0 (``dropout.py``)."""
    bh = gl.program_id(1)
    n0 = (gl.program_id(0) + gl.program_id(2) * gl.num_programs(0)) * BLOCK_N
    tile = (bh // kv_heads, bh % kv_heads, n0, heads, seqlen_q, causal_offset, band_lo)
    # read only when SEGMENTS, each where used (kernel arguments: kept out of the loops' registers)
    segs = (keys_lo_ptr, keys_hi_ptr, keys_lo_stride_b, keys_hi_stride_b, tiles_ptr, tiles_stride_b)
    blks = (blk_counts, blk_index, blk_kind_stride, blk_head_rows, blk_cols)  # read only when BLOCKS
    drop = (seed_lo, seed_hi, drop_threshold, drop_scale, drop_head0, drop_q0, drop_k0, drop_jump)  # only DROPOUT
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
            gl.allocate_shared_memory(gl.float32, [q_desc.block_type.shape[3] // DQ_COLS, BLOCK_M, DQ_COLS],
                                      dq_layout))
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
    gl.warp_specialize([(_consumer0, (descs, smem, bars, tile, out, segs, blks, drop, GROUP, CAUSAL, LOWER, SEGMENTS,
                                       ADD, BLOCKS, DROPOUT)),
                        (_consumer1, (descs, smem, bars, tile, out, segs, blks, drop, GROUP, CAUSAL, LOWER, SEGMENTS,
                                       ADD, BLOCKS, DROPOUT)),
                        (_loader, (descs, smem, bars, tile, segs, blks, GROUP, CAUSAL, LOWER, SEGMENTS, DETERMINISTIC,
                                   BLOCKS)),
                        (_dq_writer, (descs, smem, bars, tile, segs, blks, dq_turns, GROUP, CAUSAL, LOWER, SEGMENTS,
                                      DETERMINISTIC, BLOCKS))],
                       [4, 1, 1], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS])
