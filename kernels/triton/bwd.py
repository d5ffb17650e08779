"""The backward kernels: delta = rowsum(dO * O), then dK/dV (key tiles outer, written once
without atomics) and dQ (query tiles outer), each recomputing P from the saved lse.

    p_ij = exp(s_ij - lse_i),  delta_i = do_i . o_i,  ds_ij = p_ij (do_i . v_j - delta_i);
    dq_i = scale sum_j ds_ij k_j,  dk_j = scale sum_i ds_ij q_i,  dv_j = sum_i p_ij do_i.

The dK/dV kernel masks all of its tiles (measured faster there than splitting off the
unmasked ones); the dQ kernel splits them as the forward does. Both read through pointers.
"""

import triton
import triton.language as tl

from .tiles import (SPARSE_BLOCK, _column, _keep, _listed_range, _load_block, _load_stats,
                    _program, _query_loop, _query_tile, _row_bounds, _store_grad, _tile_positions,
                    _tile_range, _unpadded, _visible)

@triton.jit
def _delta_kernel(O, DO, DELTA, seqlen, H, stride_ob, stride_os, stride_oh, stride_dob, stride_dos,
                  stride_doh, stride_db, stride_dh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    off_b = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < seqlen) & (cols[None, :] < HEAD_DIM)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + rows[:, None] * stride_os + cols[None, :],
                mask=ok, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows[:, None] * stride_dos + cols[None, :],
                 mask=ok, other=0.0)
    tl.store(DELTA + off_b * stride_db + off_h * stride_dh + rows,
             tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < seqlen)




@triton.jit
def _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, off_b, off_h, stride_qb, stride_qs, stride_qh,
               stride_dob, stride_dos, stride_doh, start_m, cols, first, stop, band_lo, band_hi,
               seqlen_q,
               qk_scale, seed, threshold, drop_scale, q_pos0, kpos_start, kpos, pos_stride, pos_jump,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, MASKED: tl.constexpr, SEGMENTS: tl.constexpr,
               DROPOUT: tl.constexpr, GROUPED: tl.constexpr, PRECISION: tl.constexpr,
               POSITIONAL: tl.constexpr, QUERY_MAJOR: tl.constexpr):
    """One query tile into a key tile's dK, dV. MASKED: the keys' intervals of queries
    apply. Padding queries need no test here: they saw nothing (lse -inf), so their
    probabilities are 0 whatever the tile."""
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_block(Q, off_b, off_h, start_m, stride_qb, stride_qs, stride_qh, seqlen_q,
                    BLOCK_M, BLOCK_D, HEAD_DIM, True, False)
    do = _load_block(DO, off_b, off_h, start_m, stride_dob, stride_dos, stride_doh, seqlen_q,
                     BLOCK_M, BLOCK_D, HEAD_DIM, True, False)
    lse, delta = _load_stats(LSE, DELTA, rows, seqlen_q)
    if DROPOUT:  # drawn before the products, in the layout of the scores
        _, qpos = _tile_positions(q_pos0, start_m, BLOCK_M, pos_stride, pos_jump)
        keep = _keep(seed, threshold, off_b, off_h, qpos, kpos_start, kpos, BLOCK_M, BLOCK_N,
                     GROUPED, not QUERY_MAJOR)
    if QUERY_MAJOR:  # scores queries by keys, as in the forward; P and dS reach dV, dK transposed
        pT = tl.trans(tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                                   - lse[:, None]))
        dpT = tl.trans(tl.dot(do, tl.trans(v), input_precision=PRECISION))
    else:  # scores keys by queries: P and dS feed dV and dK from the accumulator's registers
        pT = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :])
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    if MASKED:
        pT = _visible(pT, cols, rows, first, stop, band_lo, band_hi, 0.0, SEGMENTS or POSITIONAL, True)
    if DROPOUT:  # dV takes the dropped probabilities, dP the dropped gradient (D unchanged)
        scaleT = tl.trans(tl.where(keep, drop_scale, 0.0))
        dv = tl.dot((pT * scaleT).to(do.dtype), do, dv, input_precision=PRECISION)
        dpT = dpT * scaleT
    else:
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv




@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DK_IN, DV_IN, RANGES, COUNTS, INDEX, ORDER,
                 stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                 stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                 stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                 stride_lb, stride_lh, stride_deltab, stride_deltah, stride_rp, stride_rb,
                 HKV, GROUP, seqlen_q, seqlen_k, qk_scale, sm_scale, band_lo, band_hi,
                 seed, threshold, drop_scale, q_pos0, k_pos0, pos_stride, pos_jump,
                 stride_cp, stride_sh, n_col_blocks, Q2, DO2, split,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BAND: tl.constexpr, SEGMENTS: tl.constexpr,
                 DROPOUT: tl.constexpr, GROUPED: tl.constexpr, SPARSE: tl.constexpr,
                 LIST_STAGES: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
                 POSITIONAL: tl.constexpr, QUERY_MAJOR: tl.constexpr = False,
                 PARTS: tl.constexpr = 1):
    """One key tile of one kv head; loops over the query heads of its group and over
    the query tiles that see it, so dK and dV are written once, without atomics. PARTS = 2:
    the queries' rows from ``split`` on are Q2, DO2, listed apart (as in ``_dq_kernel``)."""
    tl.static_assert(PARTS == 1 or SPARSE, "queries in two parts need block lists")
    tile, bh = _program(ORDER, SPARSE)
    start_n = tile * BLOCK_N
    off_b = bh // HKV
    off_hk = bh % HKV
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    k = _load_block(K, off_b, off_hk, start_n, stride_kb, stride_ks, stride_kh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, True, False)
    v = _load_block(V, off_b, off_hk, start_n, stride_vb, stride_vs, stride_vh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, True, False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    kpos_start, kpos = start_n, cols
    if DROPOUT:  # global positions
        kpos_start, kpos = _tile_positions(k_pos0, start_n, BLOCK_N, pos_stride, pos_jump)

    # Only the query tiles that see this key tile (the band read transposed), in
    # one loop that masks every tile: splitting off the unmasked tiles, as the forward does,
    # measured 17% slower here without segments and 44% slower with them (benchmarks/NOTES.md),
    # the mask being cheap beside four matmuls. Block-sparse: the index lists of the key
    # block, per query head (rows are key blocks there).
    positions = (k_pos0, q_pos0, pos_stride, pos_jump)  # rows are keys here
    first, stop, run_stop, _ = _row_bounds(cols, seqlen_k, seqlen_q, band_lo, band_hi, RANGES,
                                           off_b, stride_rp, stride_rb, positions, BAND, SEGMENTS,
                                           POSITIONAL, True)
    begin, full_start, full_end, end = _tile_range(start_n, seqlen_k, seqlen_q, band_lo, band_hi, first,
                                                   stop, run_stop, positions, BLOCK_N, BLOCK_M, BAND,
                                                   SEGMENTS, POSITIONAL, True)
    full_start = end
    full_end = end
    row = 0
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        lse_base = LSE + off_b * stride_lb + off_h * stride_lh
        delta_base = DELTA + off_b * stride_deltab + off_h * stride_deltah
        if SPARSE:
            row = off_h * stride_sh + start_n // SPARSE_BLOCK
            begin, full_start, full_end, end = _listed_range(COUNTS, stride_cp, row)
        for part in range(PARTS):
            Qp, DOp = Q, DO
            if part == 1:  # row r of the queries is row r - split of Q2, DO2
                Qp, DOp = Q2 - split.to(tl.int64) * stride_qs, DO2 - split.to(tl.int64) * stride_dos
                begin, full_start, full_end, end = _listed_range(COUNTS, stride_cp, row, part)
            for pos in range(begin, full_start, BLOCK_M):
                start_m = _column(pos, INDEX, row, n_col_blocks, SPARSE)
                dk, dv = _dkdv_tile(dk, dv, k, v, Qp, DOp, lse_base, delta_base, off_b, off_h,
                                    stride_qb, stride_qs, stride_qh, stride_dob, stride_dos,
                                    stride_doh, start_m, cols, first, stop, band_lo, band_hi, seqlen_q, qk_scale, seed, threshold, drop_scale, q_pos0,
                                    kpos_start, kpos, pos_stride, pos_jump, HEAD_DIM, BLOCK_M, BLOCK_N,
                                    BLOCK_D, BAND or SEGMENTS, SEGMENTS, DROPOUT,
                                    GROUPED, PRECISION, POSITIONAL, QUERY_MAJOR)
            for pos in tl.range(full_start, full_end, BLOCK_M, num_stages=LIST_STAGES):
                start_m = _column(pos, INDEX, row, n_col_blocks, SPARSE)
                dk, dv = _dkdv_tile(dk, dv, k, v, Qp, DOp, lse_base, delta_base, off_b, off_h,
                                    stride_qb, stride_qs, stride_qh, stride_dob, stride_dos,
                                    stride_doh, start_m, cols, first, stop, band_lo, band_hi, seqlen_q, qk_scale, seed, threshold, drop_scale, q_pos0,
                                    kpos_start, kpos, pos_stride, pos_jump, HEAD_DIM, BLOCK_M, BLOCK_N,
                                    BLOCK_D, SEGMENTS and SPARSE, SEGMENTS, DROPOUT,
                                    GROUPED, PRECISION, POSITIONAL, QUERY_MAJOR)
            for pos in range(full_end, end, BLOCK_M):
                start_m = _column(pos, INDEX, row, n_col_blocks, SPARSE)
                dk, dv = _dkdv_tile(dk, dv, k, v, Qp, DOp, lse_base, delta_base, off_b, off_h,
                                    stride_qb, stride_qs, stride_qh, stride_dob, stride_dos,
                                    stride_doh, start_m, cols, first, stop, band_lo, band_hi, seqlen_q, qk_scale, seed, threshold, drop_scale, q_pos0,
                                    kpos_start, kpos, pos_stride, pos_jump, HEAD_DIM, BLOCK_M, BLOCK_N,
                                    BLOCK_D, BAND or SEGMENTS, SEGMENTS, DROPOUT,
                                    GROUPED, PRECISION, POSITIONAL, QUERY_MAJOR)

    mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    dk_offsets = off_b * stride_dkb + off_hk * stride_dkh + cols[:, None] * stride_dks + offs_d[None, :]
    dv_offsets = off_b * stride_dvb + off_hk * stride_dvh + cols[:, None] * stride_dvs + offs_d[None, :]
    _store_grad(DK, DK_IN, dk_offsets, mask, dk * sm_scale, ACCUMULATE)
    _store_grad(DV, DV_IN, dv_offsets, mask, dv, ACCUMULATE)


@triton.jit
def _dq_tile(dq, q, do, lse, delta, K, V, KSEG, off_b, off_h, off_hk, stride_kb, stride_ks,
             stride_kh, stride_vb, stride_vs, stride_vh, stride_ksegb, start_n, rows, first, stop,
             holes, seqlen_k, qk_scale, band_lo, band_hi, seed, threshold, drop_scale, qpos, k_pos0,
             pos_stride, pos_jump,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr, MASKED: tl.constexpr, BAND: tl.constexpr,
             SEGMENTS: tl.constexpr, DROPOUT: tl.constexpr, GROUPED: tl.constexpr,
             PRECISION: tl.constexpr, POSITIONAL: tl.constexpr):
    """One key tile into a query tile's dQ; MASKED and SEGMENTS as in ``_fwd_tile``.
    Keys past seqlen_k load as zeros, so they add nothing to dq: only the loads are bounded."""
    k = _load_block(K, off_b, off_hk, start_n, stride_kb, stride_ks, stride_kh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, False)
    v = _load_block(V, off_b, off_hk, start_n, stride_vb, stride_vs, stride_vh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, False)
    p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse[:, None])
    if (MASKED and BAND) or SEGMENTS:
        cols = start_n + tl.arange(0, BLOCK_N)
        p = _visible(p, rows, cols, first, stop, band_lo, band_hi, 0.0, SEGMENTS or POSITIONAL)
        if SEGMENTS:
            p = _unpadded(p, cols, KSEG, off_b, stride_ksegb, seqlen_k, holes, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if DROPOUT:
        kpos_start, kpos = _tile_positions(k_pos0, start_n, BLOCK_N, pos_stride, pos_jump)
        keep = _keep(seed, threshold, off_b, off_h, qpos, kpos_start, kpos, BLOCK_M, BLOCK_N, GROUPED)
        dp = dp * tl.where(keep, drop_scale, 0.0)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, DQ_IN, KSEG, RANGES, COUNTS, INDEX, ORDER,
               stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
               stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
               stride_dqb, stride_dqs, stride_dqh,
               stride_lb, stride_lh, stride_deltab, stride_deltah, stride_ksegb, stride_rp,
               stride_rb,
               H, GROUP, seqlen_q, seqlen_k, qk_scale, sm_scale, band_lo, band_hi,
               seed, threshold, drop_scale, q_pos0, k_pos0, pos_stride, pos_jump,
               stride_cp, stride_sh, n_col_blocks, K2, V2, split,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BAND: tl.constexpr, SEGMENTS: tl.constexpr,
               DROPOUT: tl.constexpr, GROUPED: tl.constexpr, SPARSE: tl.constexpr,
               LIST_STAGES: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
               POSITIONAL: tl.constexpr, PARTS: tl.constexpr = 1):
    """One query tile's dQ over the keys its band or lists give. PARTS = 2: the keys' rows
    from ``split`` on are K2, V2 (``pair.Joined``); their blocks are listed apart, so
    each part's loops read through one base (a base chosen per tile costs the loop ~10%
    more instructions). The parts are a loop around the tile loops, not unrolled: unrolled,
    a joined launch ran 2-4% behind one over a single tensor (benchmarks/NOTES.md)."""
    tl.static_assert(PARTS == 1 or SPARSE, "keys in two parts need block lists")
    start_m, bh = _query_tile(ORDER, BLOCK_M, BAND, SPARSE)
    off_b = bh // H
    off_h = bh % H
    off_hk = off_h // GROUP
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q = _load_block(Q, off_b, off_h, start_m, stride_qb, stride_qs, stride_qh, seqlen_q,
                    BLOCK_M, BLOCK_D, HEAD_DIM, True, False)
    do = _load_block(DO, off_b, off_h, start_m, stride_dob, stride_dos, stride_doh, seqlen_q,
                     BLOCK_M, BLOCK_D, HEAD_DIM, True, False)
    lse, delta = _load_stats(LSE + off_b * stride_lb + off_h * stride_lh,
                             DELTA + off_b * stride_deltab + off_h * stride_deltah, rows, seqlen_q)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qpos = rows
    if DROPOUT:  # global positions
        _, qpos = _tile_positions(q_pos0, start_m, BLOCK_M, pos_stride, pos_jump)

    first, stop, holes, row, start, full_start, full_end, end = _query_loop(
        start_m, rows, seqlen_q, seqlen_k, band_lo, band_hi, RANGES, off_b, off_h, stride_rp,
        stride_rb, COUNTS, stride_cp, stride_sh, (q_pos0, k_pos0, pos_stride, pos_jump), BLOCK_M,
        BLOCK_N, BAND, SEGMENTS, SPARSE, POSITIONAL)
    for part in range(PARTS):
        Kp, Vp = K, V
        if part == 1:  # row r of the keys is row r - split of K2, V2
            Kp, Vp = K2 - split.to(tl.int64) * stride_ks, V2 - split.to(tl.int64) * stride_vs
            start, full_start, full_end, end = _listed_range(COUNTS, stride_cp, row, part)
        for pos in range(start, full_start, BLOCK_N):
            start_n = _column(pos, INDEX, row, n_col_blocks, SPARSE)
            dq = _dq_tile(dq, q, do, lse, delta, Kp, Vp, KSEG, off_b, off_h, off_hk, stride_kb,
                          stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ksegb, start_n,
                          rows, first, stop, holes, seqlen_k, qk_scale, band_lo, band_hi, seed,
                          threshold, drop_scale, qpos, k_pos0, pos_stride, pos_jump,
                          HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, True, BAND,
                          SEGMENTS, DROPOUT, GROUPED, PRECISION, POSITIONAL)
        for pos in tl.range(full_start, full_end, BLOCK_N, num_stages=LIST_STAGES):
            start_n = _column(pos, INDEX, row, n_col_blocks, SPARSE)
            dq = _dq_tile(dq, q, do, lse, delta, Kp, Vp, KSEG, off_b, off_h, off_hk, stride_kb,
                          stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ksegb, start_n,
                          rows, first, stop, holes, seqlen_k, qk_scale, band_lo, band_hi, seed,
                          threshold, drop_scale, qpos, k_pos0, pos_stride, pos_jump,
                          HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, False, BAND,
                          SEGMENTS and SPARSE, DROPOUT, GROUPED, PRECISION, POSITIONAL)
        for pos in range(full_end, end, BLOCK_N):
            start_n = _column(pos, INDEX, row, n_col_blocks, SPARSE)
            dq = _dq_tile(dq, q, do, lse, delta, Kp, Vp, KSEG, off_b, off_h, off_hk, stride_kb,
                          stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ksegb, start_n,
                          rows, first, stop, holes, seqlen_k, qk_scale, band_lo, band_hi, seed,
                          threshold, drop_scale, qpos, k_pos0, pos_stride, pos_jump,
                          HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, True, BAND,
                          SEGMENTS, DROPOUT, GROUPED, PRECISION, POSITIONAL)

    mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    dq_offsets = off_b * stride_dqb + off_h * stride_dqh + rows[:, None] * stride_dqs + offs_d[None, :]
    _store_grad(DQ, DQ_IN, dq_offsets, mask, dq * sm_scale, ACCUMULATE)

