"""The forward kernel: one query tile's online softmax over the key tiles its band, segment
ids or block lists leave it (FlashAttention-2 order: query tile outer, key tiles inner,
normalization by l once at the end), merged with a running (out, lse) where the ring asks.

Per query row i, with s_ij = q_i . k_j * scale (base 2 internally: ``qk_scale = scale *
log2(e)`` is folded into one multiply-add with the row max):

    m = max_j s_ij,  l = sum_j exp(s_ij - m),  o = sum_j exp(s_ij - m) v_j / l,  lse = m + log(l).

The band-partial tiles run in their own loops (masked), the tiles every row sees whole in
one without mask arithmetic. q, k and v are read through TMA tensor descriptors over the
whole (B, S, H, D) tensor where the hardware has them and the strides are 16-byte aligned
(the copy engine zero-fills rows past the end); otherwise through pointer loads.
"""

import triton
import triton.language as tl

from .tiles import (_column, _keep, _listed_range, _load_block, _query_loop, _query_tile,
                    _tile_positions, _unpadded, _visible)

@triton.jit
def _fwd_tile(acc, l_i, m_i, q, K, V, KSEG, off_b, off_h, off_hk, stride_kb, stride_ks, stride_kh,
              stride_vb, stride_vs, stride_vh, stride_segb, start_n, offs_m, first, stop, holes,
              seqlen_k, qk_scale, seed, threshold, drop_scale, qpos, k_pos0, pos_stride, pos_jump,
              shift, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, MASKED: tl.constexpr, SEGMENTS: tl.constexpr,
              DROPOUT: tl.constexpr, GROUPED: tl.constexpr, PRECISION: tl.constexpr,
              TMA: tl.constexpr):
    """One key tile of the online softmax. MASKED: the tile may cross a row's bounds or
    seqlen_k (loads bounded, the rows' intervals applied). SEGMENTS: segment ids are in
    play, so the padding test joins the intervals (a listed block that is full but for
    segments takes both). Both False for the tiles every row sees whole. K and V hold the
    keys from row ``shift`` on (a Joined second part; 0 else)."""
    k = _load_block(K, off_b, off_hk, start_n - shift, stride_kb, stride_ks, stride_kh,
                    seqlen_k - shift, BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, TMA)
    v = _load_block(V, off_b, off_hk, start_n - shift, stride_vb, stride_vs, stride_vh,
                    seqlen_k - shift, BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # unscaled; scale > 0 commutes with max
    if DROPOUT:  # drawn before the softmax: 886 instructions a tile loop against 950 after it
        kpos_start, kpos = _tile_positions(k_pos0, start_n, BLOCK_N, pos_stride, pos_jump)
        keep = _keep(seed, threshold, off_b, off_h, qpos, kpos_start, kpos, BLOCK_M, BLOCK_N, GROUPED)
    if MASKED or SEGMENTS:
        cols = start_n + tl.arange(0, BLOCK_N)
        qk = _visible(qk, offs_m, cols, first, stop, 0, 0, float("-inf"), True)  # bounds too
        if SEGMENTS:
            qk = _unpadded(qk, cols, KSEG, off_b, stride_segb, seqlen_k, holes, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED or SEGMENTS:  # a row may still have seen nothing: keep exp2 away from (-inf) - (-inf)
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.math.exp2(qk * qk_scale - m_new_safe[:, None])
    alpha = tl.math.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, 1)  # the softmax statistics are of the undropped scores
    if DROPOUT:
        p = p * tl.where(keep, drop_scale, 0.0)  # a multiply, not a select of packed bf16 halves
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fwd_kernel(Q, K, V, O, O_IN, LSE, KSEG, RANGES, COUNTS, INDEX, ORDER,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                stride_lb, stride_lh, stride_ksegb, stride_rp, stride_rb,
                H, GROUP, seqlen_q, seqlen_k, qk_scale, band_lo, band_hi,
                seed, threshold, drop_scale, q_pos0, k_pos0, pos_stride, pos_jump,
                stride_cp, stride_sh, n_col_blocks, K2, V2, split, ARRIVED, epoch, chunk_heads,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BAND: tl.constexpr, SEGMENTS: tl.constexpr,
                DROPOUT: tl.constexpr, GROUPED: tl.constexpr, SPARSE: tl.constexpr,
                LIST_STAGES: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
                TMA: tl.constexpr, POSITIONAL: tl.constexpr, PARTS: tl.constexpr = 1,
                LAST: tl.constexpr = 1, WAIT: tl.constexpr = False):
    """One query tile's attention over the keys its band or lists give. PARTS = 2: the keys'
    rows from ``split`` on are K2, V2 (``pair.Joined``; their blocks listed apart), and
    part LAST runs second. WAIT: part LAST is still arriving, in chunks of ``chunk_heads``
    K/V heads; chunk c is in once ARRIVED[c] >= epoch (written by the copy stream after
    the chunk), so the tile waits for its head's chunk before that part's loops
    (``pair.Arrival``)."""
    start_m, bh = _query_tile(ORDER, BLOCK_M, BAND, SPARSE)
    off_b = bh // H
    off_h = bh % H
    off_hk = off_h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q

    q = _load_block(Q, off_b, off_h, start_m, stride_qb, stride_qs, stride_qh, seqlen_q,
                    BLOCK_M, BLOCK_D, HEAD_DIM, True, TMA)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qpos = offs_m
    if DROPOUT:  # global positions
        _, qpos = _tile_positions(q_pos0, start_m, BLOCK_M, pos_stride, pos_jump)

    first, stop, holes, row, start, full_start, full_end, end = _query_loop(
        start_m, offs_m, seqlen_q, seqlen_k, band_lo, band_hi, RANGES, off_b, off_h, stride_rp,
        stride_rb, COUNTS, stride_cp, stride_sh, (q_pos0, k_pos0, pos_stride, pos_jump), BLOCK_M,
        BLOCK_N, BAND, SEGMENTS, SPARSE, POSITIONAL)
    for p in tl.static_range(PARTS):
        part = p if LAST == 1 else PARTS - 1 - p
        Kp, Vp = K, V
        shift = 0
        if part == 1:  # row r of the keys is row r - split of K2, V2
            Kp, Vp = K2, V2
            shift = split
        if PARTS == 2:
            start, full_start, full_end, end = _listed_range(COUNTS, stride_cp, row, part)
        if WAIT and part == LAST:  # this head's chunk of the visiting part has arrived
            arrived = ARRIVED + off_hk // chunk_heads
            while tl.load(arrived, volatile=True) < epoch:
                pass
        for pos in range(start, full_start, BLOCK_N):
            start_n = _column(pos, INDEX, row, n_col_blocks, SPARSE)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, Kp, Vp, KSEG, off_b, off_h, off_hk, stride_kb,
                                      stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ksegb,
                                      start_n, offs_m, first, stop, holes, seqlen_k, qk_scale, seed,
                                      threshold, drop_scale, qpos, k_pos0, pos_stride, pos_jump, shift, HEAD_DIM, BLOCK_M,
                                      BLOCK_N, BLOCK_D, True, SEGMENTS, DROPOUT, GROUPED, PRECISION,
                                      TMA)
        for pos in tl.range(full_start, full_end, BLOCK_N, num_stages=LIST_STAGES):
            start_n = _column(pos, INDEX, row, n_col_blocks, SPARSE)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, Kp, Vp, KSEG, off_b, off_h, off_hk, stride_kb,
                                      stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ksegb,
                                      start_n, offs_m, first, stop, holes, seqlen_k, qk_scale, seed,
                                      threshold, drop_scale, qpos, k_pos0, pos_stride, pos_jump, shift, HEAD_DIM, BLOCK_M,
                                      BLOCK_N, BLOCK_D, False, SEGMENTS and SPARSE, DROPOUT, GROUPED,
                                      PRECISION, TMA)
        for pos in range(full_end, end, BLOCK_N):
            start_n = _column(pos, INDEX, row, n_col_blocks, SPARSE)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, Kp, Vp, KSEG, off_b, off_h, off_hk, stride_kb,
                                      stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ksegb,
                                      start_n, offs_m, first, stop, holes, seqlen_k, qk_scale, seed,
                                      threshold, drop_scale, qpos, k_pos0, pos_stride, pos_jump, shift, HEAD_DIM, BLOCK_M,
                                      BLOCK_N, BLOCK_D, True, SEGMENTS, DROPOUT, GROUPED, PRECISION,
                                      TMA)

    o_offsets = off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    o_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    lse_ptrs = LSE + off_b * stride_lb + off_h * stride_lh + offs_m
    if ACCUMULATE:  # merge with a previous partial (o, lse), read only now: resuming from it
        # held its addresses through the tile loops (255 registers and 13-17% slower under
        # dropout, benchmarks/NOTES.md). O_IN is O itself, or a buffer with O's strides (the
        # ring's last step reads its fp32 sums and writes q's dtype).
        m_in = tl.load(lse_ptrs, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        m_new = tl.maximum(m_i, m_in)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        beta = tl.math.exp2(m_in - m_safe)
        o_in = tl.load(O_IN + o_offsets, mask=o_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + o_in * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = m_new
    empty = l_i == 0.0  # saw no key at all: out 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(lse_ptrs, lse, mask=row_ok)
    tl.store(O + o_offsets, (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=o_mask)
