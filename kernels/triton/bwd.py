"""The backward kernels: delta = rowsum(dO * O), then dK/dV (key tiles outer, written once
without atomics) and dQ (query tiles outer), each recomputing P from the saved lse.

    p_ij = exp(s_ij - lse_i),  delta_i = do_i . o_i,  ds_ij = p_ij (do_i . v_j - delta_i);
    dq_i = scale sum_j ds_ij k_j,  dk_j = scale sum_i ds_ij q_i,  dv_j = sum_i p_ij do_i.

The dK/dV kernel masks all of its tiles (measured faster there than splitting off the
unmasked ones); the dQ kernel splits them as the forward does. Both read through pointers:
TMA descriptors measured slower here (docs/notes/kernel.md). The argument records are
those of kernels/triton/tiles.py.
"""

import triton
import triton.language as tl

from .tiles import (SPARSE_BLOCK, _column, _keep, _listed_range, _load_block, _load_stats,
                    _offsets, _program, _query_loop, _query_tile, _row_bounds, _stats_row, _store_grad,
                    _tile_positions, _tile_range, _unpadded, _visible, _with_ptr)


@triton.jit
def _delta_kernel(o, do, delta, seqlen, heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_S: tl.constexpr, LONG: tl.constexpr):
    """delta (``Stats``) = rowsum(do * o) in fp32 for BLOCK_S rows of one (batch, head)
    (LONG: 64-bit offsets, ``tiles._tile_ptrs``)."""
    off_b = tl.program_id(1) // heads
    off_h = tl.program_id(1) % heads
    start = tl.program_id(0) * BLOCK_S
    rows = start + tl.arange(0, BLOCK_S)
    o_tile = _load_block(o.ptr, o, off_b, off_h, start, seqlen, BLOCK_S, BLOCK_D, HEAD_DIM, True, False, LONG)
    do_tile = _load_block(do.ptr, do, off_b, off_h, start, seqlen, BLOCK_S, BLOCK_D, HEAD_DIM, True, False, LONG)
    tl.store(_stats_row(delta, off_b, off_h, LONG) + rows,
             tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1), mask=rows < seqlen)


@triton.jit
def _part(x, y, tail, part):
    """(x, y) (``Rows``) as part ``part`` of a sequence held in two parts reads them: the
    tensors themselves for part 0; for part 1, row r is row r - tail.split of tail.x,
    tail.y (``pair.Joined``, same strides)."""
    x_part, y_part = x, y
    if part == 1:
        # tl.cast, not .to: a split of 1 reaches the kernel as a Python int (Triton specializes
        # integer arguments equal to 1)
        split = tl.cast(tail.split, tl.int64)
        x_part = _with_ptr(x, tail.x - split * x.stride_s)
        y_part = _with_ptr(y, tail.y - split * y.stride_s)
    return x_part, y_part


@triton.jit
def _dkdv_loop(dk, dv, k, v, q, do, lse_row, delta_row, start, end, keys, off_b, off_h, seqlen_q,
               qk_scale, band, drop, pos, lists, row, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, PER_ROW: tl.constexpr,
               STAGES: tl.constexpr, PRECISION: tl.constexpr, VARIANT: tl.constexpr):
    """The query tiles at loop positions [start, end) (rows, or virtual rows of the key
    block's lists) into one key tile's dK, dV (fp32 accumulators; k, v its tiles).

    keys = (cols, first, stop, kpos_start, kpos): the key tile's rows, their intervals of
    query rows (``_row_bounds``, transposed) and global positions. lse_row, delta_row:
    pointers to this (batch, head)'s rows of lse and delta. MASKED: the keys' intervals of
    queries apply (PER_ROW: as intervals; else the band alone, ``_visible``). Padding
    queries need no test here: they saw nothing (lse -inf), so their probabilities are 0
    whatever the tile. VARIANT.QUERY_MAJOR: the scores are computed queries by keys, as in
    the forward, and P and dS reach dV and dK transposed (config.bwd_config says when)."""
    cols, first, stop, kpos_start, kpos = keys
    BLOCK_N: tl.constexpr = cols.shape[0]
    for loop_pos in tl.range(start, end, BLOCK_M, num_stages=STAGES):
        start_m = _column(loop_pos, lists, row, VARIANT.SPARSE)
        rows = start_m + tl.arange(0, BLOCK_M)
        q_tile = _load_block(q.ptr, q, off_b, off_h, start_m, seqlen_q,
                             BLOCK_M, BLOCK_D, HEAD_DIM, True, False, VARIANT.LONG)
        do_tile = _load_block(do.ptr, do, off_b, off_h, start_m, seqlen_q,
                              BLOCK_M, BLOCK_D, HEAD_DIM, True, False, VARIANT.LONG)
        lse, delta = _load_stats(lse_row, delta_row, rows, seqlen_q)
        if VARIANT.DROPOUT:  # drawn before the products, in the layout of the scores
            _, qpos = _tile_positions(pos.q0, start_m, BLOCK_M, pos)
            keep = _keep(drop, off_b, off_h, qpos, kpos_start, kpos, BLOCK_M, BLOCK_N, VARIANT.GROUPED,
                         not VARIANT.QUERY_MAJOR)
        if VARIANT.QUERY_MAJOR:  # scores queries by keys, as in the forward; P and dS reach dV, dK transposed
            pT = tl.trans(tl.math.exp2(tl.dot(q_tile, tl.trans(k), input_precision=PRECISION) * qk_scale
                                       - lse[:, None]))
            dpT = tl.trans(tl.dot(do_tile, tl.trans(v), input_precision=PRECISION))
        else:  # scores keys by queries: P and dS feed dV and dK from the accumulator's registers
            pT = tl.math.exp2(tl.dot(k, tl.trans(q_tile), input_precision=PRECISION) * qk_scale
                              - lse[None, :])
            dpT = tl.dot(v, tl.trans(do_tile), input_precision=PRECISION)
        if MASKED:
            pT = _visible(pT, cols, rows, first, stop, band, 0.0, PER_ROW, True)
        if VARIANT.DROPOUT:  # dV takes the dropped probabilities, dP the dropped gradient (D unchanged)
            scaleT = tl.trans(tl.where(keep, drop.scale, 0.0))
            dv = tl.dot((pT * scaleT).to(do_tile.dtype), do_tile, dv, input_precision=PRECISION)
            dpT = dpT * scaleT
        else:
            dv = tl.dot(pT.to(do_tile.dtype), do_tile, dv, input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q_tile.dtype), q_tile, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_kernel(q, k, v, do, lse, delta, dk, dv, dk_in, dv_in, shape, qk_scale, sm_scale, band, pos,
                 segments, drop, lists, tail, VARIANT: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of one kv head; loops over the query heads of its group and over the
    query tiles that see it, so dK and dV are written once, without atomics (plus dk_in,
    dv_in with VARIANT.ACCUMULATE: dk, dv themselves or running sums with their strides).
    VARIANT.PARTS = 2: the queries' rows from tail.split on are tail.x, tail.y (Q, dO),
    listed apart (as in ``_dq_kernel``)."""
    tl.static_assert(VARIANT.PARTS == 1 or VARIANT.SPARSE, "queries in two parts need block lists")
    kv_heads, group, seqlen_q, seqlen_k = shape
    tile, bh = _program(lists, VARIANT.SPARSE)
    start_n = tile * BLOCK_N
    off_b = bh // kv_heads
    off_hk = bh % kv_heads
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    k_tile = _load_block(k.ptr, k, off_b, off_hk, start_n, seqlen_k, BLOCK_N, BLOCK_D, HEAD_DIM, True, False,
                         VARIANT.LONG)
    v_tile = _load_block(v.ptr, v, off_b, off_hk, start_n, seqlen_k, BLOCK_N, BLOCK_D, HEAD_DIM, True, False,
                         VARIANT.LONG)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    kpos_start, kpos = start_n, cols
    if VARIANT.DROPOUT:  # global positions
        kpos_start, kpos = _tile_positions(pos.k0, start_n, BLOCK_N, pos)

    # Only the query tiles that see this key tile (the band read transposed), in one loop
    # that masks every tile: splitting off the unmasked tiles, as the forward does, measured
    # 17% slower here without segments and 44% slower with them (docs/notes/kernel.md and
    # documents.md), the mask being cheap beside four matmuls. Block-sparse: the index
    # lists of the key block, per query head (rows are key blocks there).
    first, stop, run_stop, _ = _row_bounds(cols, seqlen_k, seqlen_q, band, pos, segments, off_b, VARIANT, True)
    begin, full_start, full_end, end = _tile_range(start_n, seqlen_k, seqlen_q, band, pos, first, stop, run_stop,
                                                   BLOCK_N, BLOCK_M, VARIANT, True)
    full_start = end
    full_end = end
    keys = (cols, first, stop, kpos_start, kpos)
    masked: tl.constexpr = VARIANT.BAND or VARIANT.SEGMENTS
    per_row: tl.constexpr = VARIANT.SEGMENTS or VARIANT.POSITIONAL
    row = 0
    for g in range(0, group):
        off_h = off_hk * group + g
        lse_row = _stats_row(lse, off_b, off_h, VARIANT.LONG)
        delta_row = _stats_row(delta, off_b, off_h, VARIANT.LONG)
        if VARIANT.SPARSE:
            row = off_h * lists.stride_head + start_n // SPARSE_BLOCK
            begin, full_start, full_end, end = _listed_range(lists, row)
        for part in range(VARIANT.PARTS):
            q_part, do_part = _part(q, do, tail, part)
            if part == 1:
                begin, full_start, full_end, end = _listed_range(lists, row, part)
            dk_acc, dv_acc = _dkdv_loop(dk_acc, dv_acc, k_tile, v_tile, q_part, do_part, lse_row, delta_row,
                                        begin, full_start, keys, off_b, off_h, seqlen_q, qk_scale, band,
                                        drop, pos, lists, row, BLOCK_M, BLOCK_D, HEAD_DIM, masked, per_row,
                                        None, PRECISION, VARIANT)
            dk_acc, dv_acc = _dkdv_loop(dk_acc, dv_acc, k_tile, v_tile, q_part, do_part, lse_row, delta_row,
                                        full_start, full_end, keys, off_b, off_h, seqlen_q, qk_scale, band,
                                        drop, pos, lists, row, BLOCK_M, BLOCK_D, HEAD_DIM,
                                        VARIANT.SEGMENTS and VARIANT.SPARSE, per_row, VARIANT.LIST_STAGES,
                                        PRECISION, VARIANT)
            dk_acc, dv_acc = _dkdv_loop(dk_acc, dv_acc, k_tile, v_tile, q_part, do_part, lse_row, delta_row,
                                        full_end, end, keys, off_b, off_h, seqlen_q, qk_scale, band,
                                        drop, pos, lists, row, BLOCK_M, BLOCK_D, HEAD_DIM, masked, per_row,
                                        None, PRECISION, VARIANT)

    mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    dk_offsets = _offsets(dk, off_b, off_hk, cols, offs_d, VARIANT.LONG)
    dv_offsets = _offsets(dv, off_b, off_hk, cols, offs_d, VARIANT.LONG)
    _store_grad(dk.ptr, dk_in, dk_offsets, mask, dk_acc * sm_scale, VARIANT.ACCUMULATE)
    _store_grad(dv.ptr, dv_in, dv_offsets, mask, dv_acc, VARIANT.ACCUMULATE)


@triton.jit
def _dq_loop(dq, q, do, lse, delta, k, v, start, end, tile, head, seqlen_k, qk_scale, band, segments,
             drop, pos, lists, row, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
             MASKED: tl.constexpr, SEGMENTS: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
             VARIANT: tl.constexpr):
    """The key tiles at loop positions [start, end) into one query tile's dQ (fp32; q, do its
    tiles, lse and delta its rows' statistics); tile = (rows, first, stop, holes, qpos) and
    head = (off_b, off_h, off_hk) as in ``fwd._fwd_loop``, and MASKED, SEGMENTS too (a
    band mask applies only to MASKED tiles). Keys past seqlen_k load as zeros, so they add
    nothing to dq: only the loads are bounded."""
    rows, first, stop, holes, qpos = tile
    off_b, off_h, off_hk = head
    BLOCK_M: tl.constexpr = rows.shape[0]
    for loop_pos in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        start_n = _column(loop_pos, lists, row, VARIANT.SPARSE)
        k_tile = _load_block(k.ptr, k, off_b, off_hk, start_n, seqlen_k,
                             BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, False, VARIANT.LONG)
        v_tile = _load_block(v.ptr, v, off_b, off_hk, start_n, seqlen_k,
                             BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, False, VARIANT.LONG)
        p = tl.math.exp2(tl.dot(q, tl.trans(k_tile), input_precision=PRECISION) * qk_scale - lse[:, None])
        if (MASKED and VARIANT.BAND) or SEGMENTS:
            cols = start_n + tl.arange(0, BLOCK_N)
            p = _visible(p, rows, cols, first, stop, band, 0.0, SEGMENTS or VARIANT.POSITIONAL)
            if SEGMENTS:
                p = _unpadded(p, cols, segments, off_b, seqlen_k, holes, 0.0)
        dp = tl.dot(do, tl.trans(v_tile), input_precision=PRECISION)
        if VARIANT.DROPOUT:
            kpos_start, kpos = _tile_positions(pos.k0, start_n, BLOCK_N, pos)
            keep = _keep(drop, off_b, off_h, qpos, kpos_start, kpos, BLOCK_M, BLOCK_N, VARIANT.GROUPED)
            dp = dp * tl.where(keep, drop.scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k_tile.dtype), k_tile, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _dq_kernel(q, k, v, do, lse, delta, dq, dq_in, shape, qk_scale, sm_scale, band, pos, segments, drop,
               lists, tail, VARIANT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One query tile's dQ over the keys its band or lists give (plus dq_in with VARIANT.ACCUMULATE).
    VARIANT.PARTS = 2: the keys' rows from tail.split on are tail.x, tail.y (``pair.Joined``);
    their blocks are listed apart, so each part's loops read through one base (a base
    chosen per tile costs the loop ~10% more instructions). The parts are a loop around
    the tile loops, not unrolled: unrolled, a joined launch ran 2-4% behind one over a
    single tensor (docs/notes/ring-of-two.md)."""
    tl.static_assert(VARIANT.PARTS == 1 or VARIANT.SPARSE, "keys in two parts need block lists")
    heads, group, seqlen_q, seqlen_k = shape
    start_m, bh = _query_tile(lists, BLOCK_M, VARIANT)
    off_b = bh // heads
    off_h = bh % heads
    off_hk = off_h // group
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q_tile = _load_block(q.ptr, q, off_b, off_h, start_m, seqlen_q, BLOCK_M, BLOCK_D, HEAD_DIM, True, False,
                         VARIANT.LONG)
    do_tile = _load_block(do.ptr, do, off_b, off_h, start_m, seqlen_q,
                          BLOCK_M, BLOCK_D, HEAD_DIM, True, False, VARIANT.LONG)
    row_lse, row_delta = _load_stats(_stats_row(lse, off_b, off_h, VARIANT.LONG),
                                     _stats_row(delta, off_b, off_h, VARIANT.LONG), rows, seqlen_q)
    dq_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qpos = rows
    if VARIANT.DROPOUT:  # global positions
        _, qpos = _tile_positions(pos.q0, start_m, BLOCK_M, pos)

    first, stop, holes, row, start, full_start, full_end, end = _query_loop(
        start_m, rows, seqlen_q, seqlen_k, band, pos, segments, lists, off_b, off_h, BLOCK_M, BLOCK_N, VARIANT)
    tile, head = (rows, first, stop, holes, qpos), (off_b, off_h, off_hk)
    for part in range(VARIANT.PARTS):
        k_part, v_part = _part(k, v, tail, part)
        if part == 1:
            start, full_start, full_end, end = _listed_range(lists, row, part)
        dq_acc = _dq_loop(dq_acc, q_tile, do_tile, row_lse, row_delta, k_part, v_part, start, full_start,
                          tile, head, seqlen_k, qk_scale, band, segments, drop, pos, lists, row, BLOCK_N,
                          BLOCK_D, HEAD_DIM, True, VARIANT.SEGMENTS, None, PRECISION, VARIANT)
        dq_acc = _dq_loop(dq_acc, q_tile, do_tile, row_lse, row_delta, k_part, v_part, full_start, full_end,
                          tile, head, seqlen_k, qk_scale, band, segments, drop, pos, lists, row, BLOCK_N,
                          BLOCK_D, HEAD_DIM, False, VARIANT.SEGMENTS and VARIANT.SPARSE, VARIANT.LIST_STAGES,
                          PRECISION, VARIANT)
        dq_acc = _dq_loop(dq_acc, q_tile, do_tile, row_lse, row_delta, k_part, v_part, full_end, end,
                          tile, head, seqlen_k, qk_scale, band, segments, drop, pos, lists, row, BLOCK_N,
                          BLOCK_D, HEAD_DIM, True, VARIANT.SEGMENTS, None, PRECISION, VARIANT)

    mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    dq_offsets = _offsets(dq, off_b, off_h, rows, offs_d, VARIANT.LONG)
    _store_grad(dq.ptr, dq_in, dq_offsets, mask, dq_acc * sm_scale, VARIANT.ACCUMULATE)
