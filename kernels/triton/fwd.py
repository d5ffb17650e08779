"""The forward kernel: one query tile's online softmax over the key tiles its band, segment
ids or block lists leave it (FlashAttention-2 order: query tile outer, key tiles inner,
normalization by l once at the end), merged with a running (out, lse) where the ring asks.

Per query row i, with s_ij = q_i . k_j * scale (base 2 internally: ``qk_scale = scale *
log2(e)`` is folded into one multiply-add with the row max):

    m = max_j s_ij,  l = sum_j exp(s_ij - m),  o = sum_j exp(s_ij - m) v_j / l,  lse = m + log(l).

The key tiles run in three loops (``_fwd_loop``): those some row sees only in part
(masked), those every row sees whole (no mask arithmetic, pipelined), and the partial
ones after them. q, k and v are read through TMA tensor descriptors over the whole
(B, S, H, D) tensor where the hardware has them and the strides are 16-byte aligned (the
copy engine zero-fills rows past the end); otherwise through pointer loads.
"""

import time

import triton
import triton.language as tl

from .tiles import (_column, _keep, _listed_range, _load_block, _offsets, _query_loop, _query_tile, _stats_row,
                    _tile_positions, _unpadded, _visible)

# What a tile that gives up on its chunk writes into every flag: past any epoch, so that
# the launch's other tiles, spinning or not yet started, leave at once (``_await_chunk``)
# without a second load in the spin that waits.
GAVE_UP = tl.constexpr(1 << 30)

if triton.knobs.runtime.interpret:  # decided as Triton decides: when the kernels are decorated
    @triton.jit
    def _clock():
        """The interpreter has no inline assembly: the host's monotonic clock, in ns."""
        return tl.full((), time.monotonic_ns(), tl.int64)
else:
    @triton.jit
    def _clock():
        """Nanoseconds on the GPU's global timer."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)


@triton.jit
def _await_chunk(wait, chunk, chunks):
    """Wait until flag ``chunk`` of ``wait`` (a ``Wait``; ``chunks`` flags in all) reaches
    its epoch; return the value seen. The first load is the whole cost when the chunk is
    in. Else the tile spins, reading the global timer beside the flag, for at most
    wait.timeout_ns from its first look: then it records chunk + 1 at wait.status, raises
    every flag to GAVE_UP (the launch's other tiles stop waiting) and returns GAVE_UP. A
    value >= GAVE_UP tells the caller to write NaN (the host raises: exchange.PeerRing)."""
    arrived = wait.flags + chunk
    seen = tl.load(arrived, volatile=True)
    if seen < wait.epoch:
        start = _clock()
        while seen < wait.epoch:
            if (_clock() - start).to(tl.float32) > wait.timeout_ns:
                tl.store(wait.status, (chunk + 1).to(tl.int64))
                for c in range(0, chunks):
                    tl.store(wait.flags + c, GAVE_UP)
                seen = tl.full((), GAVE_UP, tl.int32)
            else:
                seen = tl.load(arrived, volatile=True)
    return seen


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, keys, start, end, tile, head, seqlen_k, qk_scale, segments, drop, pos,
              lists, row, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
              MASKED: tl.constexpr, SEGMENTS: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
              TMA: tl.constexpr, VARIANT: tl.constexpr):
    """The online softmax of one query tile over the key tiles at loop positions [start, end)
    (columns, or under a block mask virtual columns of the tile's lists: ``_column``).

    tile = (offs_m, first, stop, holes, qpos): the tile's rows, their column intervals
    (``_row_bounds``) and global positions; head = (off_b, off_h, off_hk). keys = (K, V,
    k strides, v strides, shift): K and V (descriptors or pointers) hold the keys from row
    ``shift`` on (a Joined second part; 0 else). MASKED: a tile may cross a row's bounds
    or seqlen_k (loads bounded, the rows' intervals applied). SEGMENTS: segment ids are in
    play, so the padding test joins the intervals (a listed block that is full but for
    segments takes both). Both False for the tiles every row sees whole. STAGES: the
    loop's pipeline stages (None: the launch's). The switches are arguments of their own:
    a constexpr inside a tuple built here would reach the loop as a runtime value."""
    offs_m, first, stop, holes, qpos = tile
    off_b, off_h, off_hk = head
    K, V, k_strides, v_strides, shift = keys
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    for loop_pos in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        start_n = _column(loop_pos, lists, row, VARIANT.SPARSE)
        k_tile = _load_block(K, k_strides, off_b, off_hk, start_n - shift, seqlen_k - shift, BLOCK_N,
                             BLOCK_D, HEAD_DIM, MASKED, TMA, VARIANT.LONG)
        v_tile = _load_block(V, v_strides, off_b, off_hk, start_n - shift, seqlen_k - shift, BLOCK_N,
                             BLOCK_D, HEAD_DIM, MASKED, TMA, VARIANT.LONG)
        qk = tl.dot(q, tl.trans(k_tile), input_precision=PRECISION)  # unscaled; scale > 0 commutes with max
        if VARIANT.DROPOUT:  # drawn before the softmax: 886 instructions a tile loop against 950 after it
            kpos_start, kpos = _tile_positions(pos.k0, start_n, BLOCK_N, pos)
            keep = _keep(drop, off_b, off_h, qpos, kpos_start, kpos, BLOCK_M, BLOCK_N, VARIANT.GROUPED)
        if MASKED or SEGMENTS:
            cols = start_n + tl.arange(0, BLOCK_N)
            qk = _visible(qk, offs_m, cols, first, stop, None, float("-inf"), True)  # bounds too
            if SEGMENTS:
                qk = _unpadded(qk, cols, segments, off_b, seqlen_k, holes, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if MASKED or SEGMENTS:  # a row may still have seen nothing: keep exp2 away from (-inf) - (-inf)
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.math.exp2(qk * qk_scale - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)  # the softmax statistics are of the undropped scores
        if VARIANT.DROPOUT:
            p = p * tl.where(keep, drop.scale, 0.0)  # a multiply, not a select of packed bf16 halves
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, K2, V2, strides, o, o_in, lse, shape, qk_scale, band, pos, segments, drop, lists,
                tail, wait, VARIANT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    """One query tile's attention over the keys its band or lists give, written to o (``Rows``)
    and lse (``Stats``); with VARIANT.ACCUMULATE merged with the running (o_in, lse) first (o_in:
    o itself, or a buffer with its strides). Q, K, V: TMA descriptors (TMA) or pointers
    read with ``strides`` (``QKV``); shape: ``Shape``; VARIANT: ``Variant``. PARTS = 2: the
    keys' rows from tail.split on are K2, V2 (``pair.Joined``; their blocks listed apart),
    and part LAST runs second. WAIT: part LAST is still arriving, so the tile waits for its
    head's chunk before that part's loops (``pair.Arrival``), for at most wait.timeout_ns;
    a tile that gives up, or finds another tile gave up, writes NaN out and lse
    (``_await_chunk``)."""
    heads, group, seqlen_q, seqlen_k = shape
    start_m, bh = _query_tile(lists, BLOCK_M, VARIANT)
    off_b = bh // heads
    off_h = bh % heads
    off_hk = off_h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q

    q_tile = _load_block(Q, strides.q, off_b, off_h, start_m, seqlen_q, BLOCK_M, BLOCK_D, HEAD_DIM, True, TMA,
                         VARIANT.LONG)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qpos = offs_m
    if VARIANT.DROPOUT:  # global positions
        _, qpos = _tile_positions(pos.q0, start_m, BLOCK_M, pos)

    first, stop, holes, row, start, full_start, full_end, end = _query_loop(
        start_m, offs_m, seqlen_q, seqlen_k, band, pos, segments, lists, off_b, off_h, BLOCK_M, BLOCK_N, VARIANT)
    tile, head = (offs_m, first, stop, holes, qpos), (off_b, off_h, off_hk)
    PARTS: tl.constexpr = VARIANT.PARTS  # attributes of a constexpr record read as plain values
    for p in tl.static_range(PARTS):
        part = p if VARIANT.LAST == 1 else PARTS - 1 - p
        keys = (K, V, strides.k, strides.v, 0)
        if part == 1:  # row r of the keys is row r - split of K2, V2
            keys = (K2, V2, strides.k, strides.v, tail.split)
        if VARIANT.PARTS == 2:
            start, full_start, full_end, end = _listed_range(lists, row, part)
        if VARIANT.WAIT and part == VARIANT.LAST:  # this head's chunk of the visiting part has arrived
            seen = _await_chunk(wait, off_hk // wait.chunk_heads, heads // group // wait.chunk_heads)
            l_i = tl.where(seen >= GAVE_UP, float("nan"), l_i)  # gave up: NaN out and lse
        acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q_tile, keys, start, full_start, tile, head, seqlen_k,
                                  qk_scale, segments, drop, pos, lists, row, BLOCK_N, BLOCK_D, HEAD_DIM, True,
                                  VARIANT.SEGMENTS, None, PRECISION, TMA, VARIANT)
        acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q_tile, keys, full_start, full_end, tile, head, seqlen_k,
                                  qk_scale, segments, drop, pos, lists, row, BLOCK_N, BLOCK_D, HEAD_DIM, False,
                                  VARIANT.SEGMENTS and VARIANT.SPARSE, VARIANT.LIST_STAGES, PRECISION, TMA,
                                  VARIANT)
        acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q_tile, keys, full_end, end, tile, head, seqlen_k,
                                  qk_scale, segments, drop, pos, lists, row, BLOCK_N, BLOCK_D, HEAD_DIM, True,
                                  VARIANT.SEGMENTS, None, PRECISION, TMA, VARIANT)

    o_offsets = _offsets(o, off_b, off_h, offs_m, offs_d, VARIANT.LONG)
    o_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    lse_ptrs = _stats_row(lse, off_b, off_h, VARIANT.LONG) + offs_m
    if VARIANT.ACCUMULATE:  # merge with a previous partial (o, lse), read only now: resuming from it
        # held its addresses through the tile loops (255 registers and 13-17% slower under
        # dropout, docs/notes/dropout.md). o_in is o itself, or a buffer with o's strides (the
        # ring's last step reads its fp32 sums and writes q's dtype).
        m_in = tl.load(lse_ptrs, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        m_new = tl.maximum(m_i, m_in)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        beta = tl.math.exp2(m_in - m_safe)
        o_prev = tl.load(o_in + o_offsets, mask=o_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + o_prev * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = m_new
    empty = l_i == 0.0  # saw no key at all: out 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    row_lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(lse_ptrs, row_lse, mask=row_ok)
    tl.store(o.ptr + o_offsets, (acc / l_safe[:, None]).to(o.ptr.dtype.element_ty), mask=o_mask)
