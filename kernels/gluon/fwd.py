"""A warp-specialized attention forward for Hopper (sm_90), written in Gluon.

FlashAttention-3's forward structure: the softmax of one K tile runs on the CUDA cores
while the tensor cores multiply the previous tile's P by its V. Its host side (checks,
descriptors, launch, the CPU compile) is in kernels/gluon/launch.py (``attn_fwd_sm90``).

Shapes served: q (B, Sq, H, D) and k, v (B, Sk, Hkv, D), D 128 or 64 (64 passes its
GPU tests but measured level with the Triton forward: kernels/dispatch.py routes 128), bf16,
Hkv dividing H (query head h reads kv head h // (H / Hkv): MHA, GQA, MQA), Sq and Sk
positive multiples of 128, any strides with a contiguous last dimension (TMA: the other
strides and the base addresses 16-byte aligned). Masks: none or the causal band with an
offset, as ``PairMask.causal(o)``: key j is seen by query i iff j <= i + o on the pair's
local indices (the ring's pairs); with it or without it a window's lower edge
``band_lo``, key j seen only if j >= i + band_lo; with any of these, segment ids
(SEGMENTS: packed documents, int32 (B, Sq) and (B, Sk), key j seen only if its id equals
query i's, ids < 0 padding), or a block mask with or without the band (BLOCKS, not with
segment ids: the K tiles of the Q tile's row of ``masks.block_lists``, the partial ones
masked, as the backward walks its lists); with any of these but a block mask, attention
dropout (DROPOUT: kernels/dropout.py's bits on global positions, drawn per step in the
score tile's registers by kernels/gluon/dropout.py's ``keep`` while the step's products
run; P scaled where kept and zeroed where dropped before P V, l and lse those of the
undropped P, as the Triton forward).
Outputs: out (B, Sq, H, D) in any float dtype and lse (B, H, Sq) fp32 (natural log; a
row that sees no key gets out 0 and lse -inf), through their own strides; with
``ACCUMULATE`` the block's result is merged with the running (out_in, lse) first, exactly
as the Triton forward merges it (kernels/triton/fwd.py: the unnormalized sums rescaled to
the larger max), then written: out_in is out itself or a buffer with out's strides (the
ring's last step reads its fp32 sums and writes q's dtype).

The math per Q tile (the Triton forward's conventions, in log2 units):

    S = Q Kᵀ,  m' = max(m, rowmax(S) · scale · log2 e),  P = exp2(S · scale · log2 e - m'),
    l' = l · exp2(m - m') + rowsum(P),  O' = O · exp2(m - m') + P V,
    out = O / l,  lse = (m + log2 l) · ln 2.

Work split: one CTA per 128 query rows of a (batch, head), over the K tiles that hold a
key some of its queries see; three partitions (``gl.warp_specialize``):

- two consumer warp groups (``_consumer``), each owning 64 query rows: their O (fp32, 64
  registers a thread), m and l, and P of the previous tile (bf16, a register operand of
  the P V product);
- one loader warp (``_loader``): both 64-row halves of Q once, then K and V tile by tile
  into their stages, K and V each refilled as soon as both consumers released it (K
  after the scores' product, V after P V).

A consumer's step j (``_step``): issue S_j = Q K_jᵀ, then O += P_{j-1} V_{j-1}; wait for
S_j only (``warpgroup_mma_wait(1)``), run its softmax while P V runs, then wait for P V
and rescale O by exp2(m_{j-1} - m_j). The first tile's product has no P V to hide
under (the prologue) and the last P V no softmax (the epilogue).

The band: the K tiles [start, end) hold a key some query of the CTA sees, [u0, u1) are
seen whole by every query (no mask); [start, u0) cross a window's lower edge and [u1, end)
the causal edge, and take a masked step (S set to -inf where hidden by either edge, then
a max of -inf taken as 0 so that an all-hidden row gives P = 0, not NaN), each in a loop
of its own, in increasing order of tiles. Under the causal band CTAs run longest first
(the last Q tiles, which see the most keys). The loader and both consumers compute
(start, u0, u1, end) from the same scalars (``_k_tiles``) and walk the same tiles: a tile
one partition takes and another does not leaves an mbarrier waiting forever.

Segment ids narrow the same four per Q tile (``masks.segment_tiles``, from the host: the
tiles some row's document reaches, and those inside every row's document), so the masked
loops then take both sides of the unmasked tiles; a masked step also compares the rows'
ids (loaded once) with its tile's 128 keys' (loaded per masked step).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .dropout import keep
from .ptx import _hide
from .tiles import _list_row, _narrow

HEAD_DIMS = (64, 128)  # head dims served
BLOCK_M = gl.constexpr(128)  # query rows a CTA (two consumer groups of 64)
BLOCK_N = gl.constexpr(128)  # keys a tile
LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _k_tiles(m0, offset, band_lo, seqlen_k, segs, CAUSAL: gl.constexpr, LOWER: gl.constexpr,
             SEGMENTS: gl.constexpr):
    """(start, u0, u1, end): the K tiles [start, end) hold a key some query of rows
    [m0, m0 + BLOCK_M) sees; every query sees all of tiles [u0, u1); the others cross an
    edge of the band (the masked steps). Upper edge (CAUSAL, j <= i + offset): the last
    query sees keys up to m0 + BLOCK_M - 1 + offset, the first up to m0 + offset. Lower
    edge (LOWER, a window: j >= i + band_lo): the first query sees keys from m0 + band_lo
    on, the last from m0 + BLOCK_M - 1 + band_lo. Dividends clamped >= 0 (integer division
    truncates). Without a band (0, 0, n, n). SEGMENTS: intersected with the Q tile's own
    four (``segment_tiles``: the tiles some row's document reaches, and those whose keys all
    carry every row's id), at ``segs[2]`` (``tiles._narrow``)."""
    n_k = seqlen_k // BLOCK_N
    end = n_k
    full = n_k
    if CAUSAL:
        end = gl.minimum((gl.maximum(m0 + BLOCK_M + offset, 0) + BLOCK_N - 1) // BLOCK_N, n_k)
        full = gl.minimum(gl.maximum(m0 + offset + 1, 0) // BLOCK_N, end)
    start = 0
    u0 = 0
    u1 = full
    if LOWER:
        start = gl.minimum(gl.maximum(m0 + band_lo, 0) // BLOCK_N, end)
        u0 = gl.minimum(gl.maximum((gl.maximum(m0 + BLOCK_M - 1 + band_lo, 0) + BLOCK_N - 1) // BLOCK_N, start), end)
        u1 = gl.maximum(full, u0)
    if SEGMENTS:
        start, u0, u1, end = _narrow(start, u0, u1, end, segs[2])
    return start, u0, u1, end


@gluon.jit
def _loader(descs, smem, bars, tile, segs, blks, CAUSAL: gl.constexpr, LOWER: gl.constexpr, SEGMENTS: gl.constexpr,
            BLOCKS: gl.constexpr):
    """Q's two halves once, then K and V of tiles [start, end) (BLOCKS: of the Q tile's row
    of the block lists, partial blocks first), each into its stage once both consumers
    released the tile that held it STAGES tiles before."""
    q_desc = descs[0]
    q_smem = smem[0]
    q_ready = bars[0]
    off_b, off_h, off_hk, m0, seqlen_k, offset, band_lo = tile
    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [off_b, m0, off_h, 0], q_ready, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [off_b, m0 + 64, off_h, 0], q_ready, q_smem.index(1))
    if BLOCKS:
        partial, full, row = _list_row(blks, off_h, 0, m0, 1)
        for t in range(partial + full):
            _load_kv(t, gl.load(row + t), off_b, off_hk, descs, smem, bars)
    else:
        start, u0, u1, end = _k_tiles(m0, offset, band_lo, seqlen_k, segs, CAUSAL, LOWER, SEGMENTS)
        for j in range(start, end):
            _load_kv(j - start, j, off_b, off_hk, descs, smem, bars)


@gluon.jit
def _load_kv(t, j, off_b, off_hk, descs, smem, bars):
    """The CTA's t-th tile, K tile j, into stage t % STAGES."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, v_smem = smem
    q_ready, k_ready, v_ready, k_empty, v_empty = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    s = t % STAGES
    ph = ((t // STAGES) & 1) ^ 1  # a fresh barrier passes a wait on parity 1: the first fills do not wait
    mbarrier.wait(k_empty.index(s), ph)
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [off_b, j * BLOCK_N, off_hk, 0], k_ready.index(s), k_smem.index(s))
    mbarrier.wait(v_empty.index(s), ph)
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [off_b, j * BLOCK_N, off_hk, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _hide_other(s, q_ids, k_ids):
    """s where the query row's id equals the key column's (broadcast int32), else -inf."""
    return gl.inline_asm_elementwise("{ .reg .pred p; setp.eq.s32 p, $2, $3; selp.f32 $0, $1, 0fFF800000, p; }",
                                     "=f,f,r,r", [s, q_ids, k_ids], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _max(a, b):  # (gl.max and gl.sum are jit functions of triton.language that the CPU suite's interpreter patches)
    return gl.maximum(a, b)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, diag, ids, MASKED: gl.constexpr, CAUSAL: gl.constexpr, LOWER: gl.constexpr,
             SEGMENTS: gl.constexpr):
    """The online softmax of a score tile s (64 x 128, fp32): (P, m, l, alpha), alpha the
    factor the running O takes. MASKED: s hidden where key column c, query row r have
    c - r > diag[0] (CAUSAL: j > i + offset; diag[0] = offset + first query - first key) or
    r - c > diag[1] (LOWER: j < i + band_lo; diag[1] = first key - first query - band_lo),
    each split by bits as the backward's masks are (a thread's rows differ only in bit 3,
    its columns share bits 1-2: one register a thread, an immediate an element); SEGMENTS:
    also where the row's id (ids[0], 64, padding rows made unequal to every key) differs
    from the column's (ids[1], 128: ``_tile_ids``); and a max of -inf taken as 0."""
    if MASKED:
        mma: gl.constexpr = s.type.layout
        r = gl.arange(0, 64, gl.SliceLayout(1, mma))
        c = gl.arange(0, BLOCK_N, gl.SliceLayout(0, mma))
        if CAUSAL:
            lhs = gl.expand_dims(c & 6, 0) - gl.expand_dims((r & -9) + diag[0], 1)
            rhs = gl.expand_dims(r & 8, 1) - gl.expand_dims(c & -7, 0)
            s = _hide(s, lhs, rhs)
        if LOWER:
            lhs = gl.expand_dims((r & -9) - diag[1], 1) - gl.expand_dims(c & 6, 0)
            rhs = gl.expand_dims(c & -7, 0) - gl.expand_dims(r & 8, 1)
            s = _hide(s, lhs, rhs)
        if SEGMENTS:
            rows_ids = gl.expand_dims(ids[0], 1) + gl.expand_dims(c * 0, 0)
            cols_ids = gl.expand_dims(ids[1], 0) + gl.expand_dims(r * 0, 1)
            s = _hide_other(s, rows_ids, cols_ids)
    m_new = gl.maximum(m_i, gl.reduce(s, 1, _max) * qk_scale)
    m_use = m_new
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.reduce(p, 1, _add)
    return p, m_new, l_i, alpha


@gluon.jit
def _step(t, p, m_i, l_i, acc, q, smem, bars, qk_scale, diag, ids, key0, drop, MASKED: gl.constexpr,
          CAUSAL: gl.constexpr, LOWER: gl.constexpr, SEGMENTS: gl.constexpr, DROPOUT: gl.constexpr):
    """The CTA's t-th K tile's scores and softmax under the previous tile's P V (``diag``,
    ``ids``: ``_softmax``'s, for this tile): returns (P as the next P V's bf16 register operand, m,
    l, O rescaled to the new m). DROPOUT: P dropped (``_dropped``) at the tile's first key
    position ``key0``, its bits drawn while the two products run."""
    q_smem, k_smem, v_smem = smem
    q_ready, k_ready, v_ready, k_empty, v_empty = bars
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    STAGES: gl.constexpr = k_smem.shape[0]
    s = t % STAGES
    sp = (t - 1) % STAGES
    mbarrier.wait(k_ready.index(s), (t // STAGES) & 1)
    scores = warpgroup_mma(q, k_smem.index(s).reshape([BLOCK_N, q.shape[1]]).permute((1, 0)),
                           gl.zeros([64, BLOCK_N], gl.float32, mma), use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(sp), ((t - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(sp).reshape([BLOCK_N, q.shape[1]]), acc, is_async=True)
    kept = _kept(key0, drop, mma, DROPOUT)
    scores = warpgroup_mma_wait(1, deps=[scores])  # the scores done; P V may still run
    mbarrier.arrive(k_empty.index(s), count=1)
    p_new, m_i, l_i, alpha = _softmax(scores, m_i, l_i, qk_scale, diag, ids, MASKED, CAUSAL, LOWER, SEGMENTS)
    p_new = _dropped(p_new, kept, drop, DROPOUT)
    acc, p = warpgroup_mma_wait(0, deps=[acc, p])
    mbarrier.arrive(v_empty.index(sp), count=1)
    acc = acc * gl.expand_dims(_rows_of(alpha, acc), 1)
    return gl.convert_layout(p_new.to(gl.bfloat16), p.type.layout, assert_trivial=True), m_i, l_i, acc


@gluon.jit
def _kept(key0, drop, layout: gl.constexpr, DROPOUT: gl.constexpr):
    """DROPOUT: the keep decisions of the tile at key position ``key0`` for the rows of
    ``drop`` = (seed lo, hi, threshold, kept scale, global head, the rows' first query
    position, k0, a K tile's step in positions, batch) (``dropout.keep``); else 0 (unread)."""
    kept = 0
    if DROPOUT:
        kept = keep(drop[5], key0, drop[4], drop[8], drop, layout)
    return kept


@gluon.jit
def _dropped(p, kept, drop, DROPOUT: gl.constexpr):
    """P as P V takes it: DROPOUT scales the kept probabilities and zeroes the dropped ones
    (a multiply, as the Triton forward; l has the undropped P)."""
    if DROPOUT:
        p = p * gl.where(kept, drop[3], 0.0)
    return p


@gluon.jit
def _rows_of(x, acc):
    """A per-row vector of the scores' layout in the rows of ``acc``'s (the same rows of the
    same threads: at head_dim 128 the same layout, at 64 another name for it)."""
    return gl.convert_layout(x, gl.SliceLayout(1, acc.type.layout), assert_trivial=True)


@gluon.jit
def _first(p, m_i, l_i, q, smem, bars, qk_scale, diag, ids, key0, drop, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
           LOWER: gl.constexpr, SEGMENTS: gl.constexpr, DROPOUT: gl.constexpr):
    """The CTA's first K tile's scores and softmax (nothing to hide them under): (P, m, l)."""
    q_smem, k_smem, v_smem = smem
    q_ready, k_ready, v_ready, k_empty, v_empty = bars
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    mbarrier.wait(k_ready.index(0), 0)
    scores = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, q.shape[1]]).permute((1, 0)),
                           gl.zeros([64, BLOCK_N], gl.float32, mma), use_acc=False, is_async=True)
    kept = _kept(key0, drop, mma, DROPOUT)
    scores = warpgroup_mma_wait(0, deps=[scores])
    mbarrier.arrive(k_empty.index(0), count=1)
    p_new, m_i, l_i, alpha = _softmax(scores, m_i, l_i, qk_scale, diag, ids, MASKED, CAUSAL, LOWER, SEGMENTS)
    p_new = _dropped(p_new, kept, drop, DROPOUT)
    return gl.convert_layout(p_new.to(gl.bfloat16), p.type.layout, assert_trivial=True), m_i, l_i


@gluon.jit
def _tile_ids(q_ids, k_ids_ptr, j, MASKED: gl.constexpr, SEGMENTS: gl.constexpr):
    """``_softmax``'s ids for K tile j: the rows' (``q_ids``) and, in a masked step with
    SEGMENTS, the tile's 128 keys' from ``k_ids_ptr`` (a padding key's, < 0, made -1)."""
    k_ids = 0
    if MASKED and SEGMENTS:
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        k_ids = gl.load(k_ids_ptr + j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, mma)))
        k_ids = gl.where(k_ids < 0, -1, k_ids)
    return q_ids, k_ids


@gluon.jit
def _consume(t0, t1, start, p, m_i, l_i, acc, q, smem, bars, qk_scale, diag0, ids, drop, MASKED: gl.constexpr,
             CAUSAL: gl.constexpr, LOWER: gl.constexpr, SEGMENTS: gl.constexpr, DROPOUT: gl.constexpr):
    """The K tiles [t0, t1) (absolute; the CTA's own count from ``start``), each a ``_step``
    with its tile's diagonals and ids (``_softmax``'s, from those of K tile 0 and from
    ids = (the rows' ids, the keys' ids pointer)) and, with DROPOUT, its first key's position."""
    for j in range(t0, t1):
        p, m_i, l_i, acc = _step(j - start, p, m_i, l_i, acc, q, smem, bars, qk_scale,
                                 (diag0[0] - j * BLOCK_N, j * BLOCK_N - diag0[1]),
                                 _tile_ids(ids[0], ids[1], j, MASKED, SEGMENTS), drop[6] + j * drop[7], drop, MASKED,
                                 CAUSAL, LOWER, SEGMENTS, DROPOUT)
    return p, m_i, l_i, acc


@gluon.jit
def _consume_listed(e0, e1, row, p, m_i, l_i, acc, q, smem, bars, qk_scale, diag0, MASKED: gl.constexpr,
                    CAUSAL: gl.constexpr, LOWER: gl.constexpr):
    """Entries [e0, e1) of a block-list row (the CTA's steps e0..e1 - 1), each a ``_step``;
    a masked one reads its K tile from the row for its diagonals."""
    for e in range(e0, e1):
        j = 0
        if MASKED:
            j = gl.load(row + e)
        p, m_i, l_i, acc = _step(e, p, m_i, l_i, acc, q, smem, bars, qk_scale,
                                 (diag0[0] - j * BLOCK_N, j * BLOCK_N - diag0[1]), (0, 0), 0, (0, ), MASKED, CAUSAL,
                                 LOWER, False, False)
    return p, m_i, l_i, acc


@gluon.jit
def _walk_listed(p, m_i, l_i, acc, q, smem, bars, qk_scale, tile, row0, blks, CAUSAL: gl.constexpr,
                 LOWER: gl.constexpr):
    """A block mask's walk (``_loader``'s): the Q tile's row of the block lists, its partial
    blocks (masked steps) first, then its full ones. Returns (P, m, l, O, 0, steps)."""
    off_b, off_h, off_hk, m0, seqlen_k, offset, band_lo = tile
    diag0 = (offset + row0, row0 + band_lo)  # the masked step's diagonals at K tile 0 (``_softmax``)
    partial, full, row = _list_row(blks, off_h, 0, m0, 1)
    steps = partial + full
    if steps > 0:  # the first tile, masked if the band crosses it
        if (CAUSAL or LOWER) and partial > 0:
            j = gl.load(row)
            p, m_i, l_i = _first(p, m_i, l_i, q, smem, bars, qk_scale, (diag0[0] - j * BLOCK_N,
                                 j * BLOCK_N - diag0[1]), (0, 0), 0, (0, ), True, CAUSAL, LOWER, False, False)
        else:
            p, m_i, l_i = _first(p, m_i, l_i, q, smem, bars, qk_scale, (0, 0), (0, 0), 0, (0, ), False, CAUSAL, LOWER,
                                 False, False)
    if CAUSAL or LOWER:
        p, m_i, l_i, acc = _consume_listed(1, partial, row, p, m_i, l_i, acc, q, smem, bars, qk_scale, diag0, True,
                                           CAUSAL, LOWER)
    p, m_i, l_i, acc = _consume_listed(gl.maximum(partial, 1), steps, row, p, m_i, l_i, acc, q, smem, bars, qk_scale,
                                       diag0, False, CAUSAL, LOWER)
    return p, m_i, l_i, acc, 0, steps


@gluon.jit
def _consumer(smem, bars, tile, out, segs, blks, drop, HALF: gl.constexpr, CAUSAL: gl.constexpr, LOWER: gl.constexpr,
              SEGMENTS: gl.constexpr, ACCUMULATE: gl.constexpr, BLOCKS: gl.constexpr, DROPOUT: gl.constexpr):
    """Consumer warp group HALF: query rows [m0 + 64 HALF, m0 + 64 HALF + 64) over the K
    tiles [start, end) (``_k_tiles``) in increasing order: those across the lower edge
    (masked), the unmasked ones, those across the upper edge (masked); BLOCKS: over the Q
    tile's listed blocks (``_walk_listed``); then out and lse (merged with the running ones
    first with ACCUMULATE). DROPOUT (not with BLOCKS): ``drop`` = (seed lo, hi, threshold,
    kept scale, head 0's global index, q0, k0, jump) (``attn_fwd_sm90``'s positions,
    PairMask.pos: local row x at q0 + x + (x // 128) jump)."""
    q_smem, k_smem, v_smem = smem
    q_ready, k_ready, v_ready, k_empty, v_empty = bars
    off_b, off_h, off_hk, m0, seqlen_k, offset, band_lo = tile
    D: gl.constexpr = q_smem.shape[4]
    STAGES: gl.constexpr = k_smem.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 16])  # the scores'
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma_s)
    qk_scale = out[5]
    acc = gl.zeros([64, D], gl.float32, mma)
    m_i = gl.full([64], float("-inf"), gl.float32, rows_l)
    l_i = gl.full([64], 0.0, gl.float32, rows_l)
    p = gl.zeros([64, BLOCK_N], gl.bfloat16, p_layout)
    mbarrier.wait(q_ready, 0)  # also when no tile is seen: no exit under a TMA in flight
    q = q_smem.index(HALF).reshape([64, D])
    row0 = m0 + 64 * HALF
    if BLOCKS:
        p, m_i, l_i, acc, start, end = _walk_listed(p, m_i, l_i, acc, q, smem, bars, qk_scale, tile, row0, blks,
                                                    CAUSAL, LOWER)
    else:  # the rows' global head and first query position, K tile j's first key at k0 + j (128 + jump)
        drop = (drop[0], drop[1], drop[2], drop[3], drop[4] + off_h, drop[5] + row0 + (m0 // BLOCK_M) * drop[7],
                drop[6], BLOCK_N + drop[7], off_b)
        p, m_i, l_i, acc, start, end = _walk(p, m_i, l_i, acc, q, smem, bars, qk_scale, tile, row0, segs, drop,
                                             CAUSAL, LOWER, SEGMENTS, DROPOUT)
    if end > start:  # the last tile's P V
        last = end - 1 - start
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(last % STAGES).reshape([BLOCK_N, D]), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)
    _epilogue(acc, _rows_of(m_i, acc), _rows_of(l_i, acc), row0, off_b, off_h, out, ACCUMULATE)


@gluon.jit
def _walk(p, m_i, l_i, acc, q, smem, bars, qk_scale, tile, row0, segs, drop, CAUSAL: gl.constexpr,
          LOWER: gl.constexpr, SEGMENTS: gl.constexpr, DROPOUT: gl.constexpr):
    """The band's walk (``_loader``'s): the K tiles [start, end) of ``_k_tiles`` in
    increasing order, masked where an edge crosses them (``drop``: ``_kept``'s). Returns
    (P, m, l, O, start, end)."""
    off_b, off_h, off_hk, m0, seqlen_k, offset, band_lo = tile
    rows_l: gl.constexpr = gl.SliceLayout(1, gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                       instr_shape=[16, BLOCK_N, 16]))
    start, u0, u1, end = _k_tiles(m0, offset, band_lo, seqlen_k, segs, CAUSAL, LOWER, SEGMENTS)
    diag0 = (offset + row0, row0 + band_lo)  # the masked step's diagonals at K tile 0 (``_softmax``)
    q_ids = 0
    if SEGMENTS:  # the rows' ids, a padding row's (< 0) made unequal to every key's (>= -1)
        q_ids = gl.load(segs[0] + row0 + gl.arange(0, 64, rows_l))
        q_ids = gl.where(q_ids < 0, -2, q_ids)
    ids = (q_ids, segs[1])
    if end > start:  # the first tile, masked unless every query sees all of it
        if (start >= u0) & (start < u1):
            p, m_i, l_i = _first(p, m_i, l_i, q, smem, bars, qk_scale, (diag0[0] - start * BLOCK_N,
                                 start * BLOCK_N - diag0[1]), _tile_ids(q_ids, segs[1], start, False, SEGMENTS),
                                 drop[6] + start * drop[7], drop, False, CAUSAL, LOWER, SEGMENTS, DROPOUT)
        else:
            p, m_i, l_i = _first(p, m_i, l_i, q, smem, bars, qk_scale, (diag0[0] - start * BLOCK_N,
                                 start * BLOCK_N - diag0[1]), _tile_ids(q_ids, segs[1], start, True, SEGMENTS),
                                 drop[6] + start * drop[7], drop, True, CAUSAL, LOWER, SEGMENTS, DROPOUT)
    if LOWER or SEGMENTS:
        p, m_i, l_i, acc = _consume(start + 1, u0, start, p, m_i, l_i, acc, q, smem, bars, qk_scale, diag0, ids,
                                    drop, True, CAUSAL, LOWER, SEGMENTS, DROPOUT)
    p, m_i, l_i, acc = _consume(gl.maximum(u0, start + 1), u1, start, p, m_i, l_i, acc, q, smem, bars, qk_scale,
                                diag0, ids, drop, False, CAUSAL, LOWER, SEGMENTS, DROPOUT)
    if CAUSAL or SEGMENTS:
        p, m_i, l_i, acc = _consume(gl.maximum(u1, start + 1), end, start, p, m_i, l_i, acc, q, smem, bars, qk_scale,
                                    diag0, ids, drop, True, CAUSAL, LOWER, SEGMENTS, DROPOUT)
    return p, m_i, l_i, acc, start, end


@gluon.jit
def _epilogue(acc, m_i, l_i, row0, off_b, off_h, out, ACCUMULATE: gl.constexpr):
    """out and lse of 64 rows from row0: with ACCUMULATE the running (out_in, lse) merged
    in first (the Triton forward's rule); a row that saw no key gets out 0 and lse -inf.
    64-bit offsets to the first row, 32-bit inside the tile (the launcher bounds them)."""
    o_ptr, o_in_ptr, o_strides, lse_ptr, lse_strides, _ = out
    mma: gl.constexpr = acc.type.layout
    D: gl.constexpr = acc.shape[1]
    rows = gl.arange(0, 64, gl.SliceLayout(1, mma))
    cols = gl.arange(0, D, gl.SliceLayout(0, mma))
    base = off_b.to(gl.int64) * o_strides[0] + row0.to(gl.int64) * o_strides[1] + off_h.to(gl.int64) * o_strides[2]
    offs = gl.expand_dims(rows * o_strides[1].to(gl.int32), 1) + gl.expand_dims(cols, 0)
    lse_ptrs = (lse_ptr + off_b.to(gl.int64) * lse_strides[0] + off_h.to(gl.int64) * lse_strides[1]
                + (row0 + rows).to(gl.int64) * lse_strides[2])
    if ACCUMULATE:
        m_in = gl.load(lse_ptrs) * LOG2E
        m_new = gl.maximum(m_i, m_in)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        beta = gl.exp2(m_in - m_safe)
        o_prev = gl.load(o_in_ptr + base + offs).to(gl.float32)
        acc = acc * gl.expand_dims(alpha, 1) + o_prev * gl.expand_dims(beta, 1)
        l_i = l_i * alpha + beta
        m_i = m_new
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    gl.store(lse_ptrs, gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2))
    gl.store(o_ptr + base + offs, (acc / gl.expand_dims(l_safe, 1)).to(o_ptr.dtype.element_ty))


@gluon.jit
def _consumer0(smem, bars, tile, out, segs, blks, drop, CAUSAL: gl.constexpr, LOWER: gl.constexpr,
               SEGMENTS: gl.constexpr, ACCUMULATE: gl.constexpr, BLOCKS: gl.constexpr, DROPOUT: gl.constexpr):
    _consumer(smem, bars, tile, out, segs, blks, drop, 0, CAUSAL, LOWER, SEGMENTS, ACCUMULATE, BLOCKS, DROPOUT)


@gluon.jit
def _consumer1(smem, bars, tile, out, segs, blks, drop, CAUSAL: gl.constexpr, LOWER: gl.constexpr,
               SEGMENTS: gl.constexpr, ACCUMULATE: gl.constexpr, BLOCKS: gl.constexpr, DROPOUT: gl.constexpr):
    _consumer(smem, bars, tile, out, segs, blks, drop, 1, CAUSAL, LOWER, SEGMENTS, ACCUMULATE, BLOCKS, DROPOUT)


@gluon.jit(do_not_specialize=("seed_lo", "seed_hi", "drop_threshold", "drop_head0", "drop_q0", "drop_k0", "drop_jump"))
def _attn_fwd_sm90_kernel(q_desc, k_desc, v_desc, o_ptr, o_in_ptr, lse_ptr, o_stride_b, o_stride_s, o_stride_h,
                          lse_stride_b, lse_stride_h, lse_stride_s, heads, group, seqlen_k, causal_offset, band_lo,
                          qk_scale, q_ids_ptr, k_ids_ptr, q_ids_stride_b, k_ids_stride_b, tiles_ptr, tiles_stride_b,
                          blk_counts, blk_index, blk_kind_stride, blk_head_rows, blk_cols, blk_order,
                          seed_lo, seed_hi, drop_threshold, drop_scale, drop_head0, drop_q0, drop_k0, drop_jump,
                          CAUSAL: gl.constexpr, LOWER: gl.constexpr, SEGMENTS: gl.constexpr,
                          ACCUMULATE: gl.constexpr, BLOCKS: gl.constexpr, DROPOUT: gl.constexpr, STAGES: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, WORKER_REGS: gl.constexpr):
    """Grid (Sq / 128, B H): Q tile program_id(0) of (batch, head) program_id(1), the last
    Q tile first under the band (it sees the most keys). ``group`` = heads / kv_heads;
    causal_offset is read only when CAUSAL, band_lo (a window's lower edge, j >= i +
    band_lo) only when LOWER; the ids (int32 (B, Sq) and (B, Sk), rows contiguous) and
    ``segment_tiles``' (B, Sq / 128, 4) only when SEGMENTS; o_in_ptr (ACCUMULATE only) has o_ptr's strides;
    BLOCKS (a block mask, not with SEGMENTS): ``masks.block_lists`` of the mask, a row per
    Q tile, as the backward's (``tiles._list_row``), the CTAs in the order blk_order gives
    (``masks.program_order``, numbered (b H + h) Sq / 128 + Q tile: the rows with much more
    work than the rest first, so that none runs alone at the end; under the band the last
    Q tile first); DROPOUT (not with BLOCKS): kernels/dropout.py's bits of the 64-bit seed
    (seed_lo, seed_hi), threshold and kept scale, query head h's global index drop_head0 +
    h, and PairMask.pos's positions (q0, k0, stride 1, jump) with q0 % 16 == k0 % 32 ==
    jump % 32 == 0, read only then; STAGES: the K and V stages (each its own: K is
    released a step before V)."""
    if BLOCKS:
        program = gl.load(blk_order + gl.program_id(1) * gl.num_programs(0) + gl.program_id(0))
        bh, m_tile = program // gl.num_programs(0), program % gl.num_programs(0)
        off_h = bh % heads
    else:  # this order of the statements keeps the SASS of the kernels routed before
        bh = gl.program_id(1)
        off_h = bh % heads
        m_tile = gl.program_id(0)
        if CAUSAL:
            m_tile = gl.num_programs(0) - 1 - m_tile
    tile = (bh // heads, off_h, off_h // group, m_tile * BLOCK_M, seqlen_k, causal_offset, band_lo)
    off_b = (bh // heads).to(gl.int64)
    segs = (q_ids_ptr + off_b * q_ids_stride_b, k_ids_ptr + off_b * k_ids_stride_b,
            tiles_ptr + off_b * tiles_stride_b + m_tile * 4)  # read only when SEGMENTS
    blks = (blk_counts, blk_index, blk_kind_stride, blk_head_rows, blk_cols)  # read only when BLOCKS
    drop = (seed_lo, seed_hi, drop_threshold, drop_scale, drop_head0, drop_q0, drop_k0, drop_jump)  # only DROPOUT
    # Shared memory: Q 32 KB, K and V STAGES x 2 x 32 KB (160 KB at 2 stages, 224 KB at 3).
    smem = (gl.allocate_shared_memory(gl.bfloat16, [2] + q_desc.block_type.shape, q_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES] + k_desc.block_type.shape, k_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES] + v_desc.block_type.shape, v_desc.layout))
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)  # both consumers release a tile
        mbarrier.init(v_empty.index(s), count=2)
    bars = (q_ready, k_ready, v_ready, k_empty, v_empty)
    out = (o_ptr, o_in_ptr, (o_stride_b, o_stride_s, o_stride_h), lse_ptr, (lse_stride_b, lse_stride_h, lse_stride_s),
           qk_scale)
    gl.warp_specialize([(_consumer0, (smem, bars, tile, out, segs, blks, drop, CAUSAL, LOWER, SEGMENTS, ACCUMULATE,
                                       BLOCKS, DROPOUT)),
                        (_consumer1, (smem, bars, tile, out, segs, blks, drop, CAUSAL, LOWER, SEGMENTS, ACCUMULATE,
                                       BLOCKS, DROPOUT)),
                        (_loader, ((q_desc, k_desc, v_desc), smem, bars, tile, segs, blks, CAUSAL, LOWER, SEGMENTS,
                                   BLOCKS))],
                       [4, 1], [CONSUMER_REGS, WORKER_REGS])
