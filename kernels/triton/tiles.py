"""Shared @triton.jit helpers of the attention kernels, and the records their arguments
travel in: tile loads, program order, masks as column intervals per row, loop bounds
(band, segments, block lists) and dropout bits.

Masks are a description (kernels/masks.py, ``PairMask``), evaluated per tile from local
indices and segment ids, never an N x N tensor:

    band      key j visible to query i only if band.lo <= j - i <= band.hi (``Band``; an
              unbounded side is a sentinel). Causal with diagonal offset o is hi = o; a
              sliding window on global positions becomes a band of the pair's local rows.
              With VARIANT.POSITIONAL the band is on the rows' global positions instead (the
              block_stripe layout, whose rows jump: masks.PairMask.band_on_positions).
    segments  only if qseg_i == kseg_j >= 0 (``Segments``: packed documents, padding -1).
              Each query row carries the hull of the key rows its id occupies (and each key
              row that of the query rows), since a pair's non-padding ids never decrease.

Both become one interval of columns per row, [first, stop) (``_row_bounds``): the whole
predicate is two comparisons an element, plus a test of the columns' ids only where
padding sits inside a document's hull. Per (query tile, key tile) a kernel classifies
from its rows' intervals: outside them all (empty, never loaded), inside every row's
(no mask arithmetic), or partial (the intervals applied).

    blocks    block-sparse (``Lists``): a tile's row block iterates over index lists of the
              column blocks it computes, built once per launch (masks.block_lists): partial
              blocks with the predicate, then full ones without. Blocks not listed are
              never loaded, so the work follows the mask's nonzero blocks. The programs
              whose rows list far more blocks than the rest run first
              (masks.program_order), so that no long row ends a launch alone.

The records are NamedTuples: a launch passes them as single arguments (Triton flattens a
tuple into its fields, each specialized as a loose argument would be) and the kernels read
their fields by name. What a launch compiles for (which masks, block lists, a sequence in
two parts) is one record of plain values, ``Variant``, passed as the kernels' one
``VARIANT: tl.constexpr`` argument: Triton compiles a kernel per value, and looks the
value up (a tuple of bools and ints) as fast as it can hash it. Switches inside the other
records (``tl.constexpr`` fields) cost the host ~50 us a forward+backward in Triton's
argument binding, and a record built inside a jit function loses them on the way to the
next function.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from .. import dropout
from ..masks import BLOCK

SPARSE_BLOCK = tl.constexpr(BLOCK)
_PHILOX_ROUNDS = tl.constexpr(dropout.ROUNDS)


class Rows(NamedTuple):
    """A (B, S, H, D) operand: a pointer and its strides over batch, rows and heads (the last
    dimension is contiguous)."""

    ptr: object
    stride_b: int
    stride_s: int
    stride_h: int


class Strides(NamedTuple):
    """The strides of a (B, S, H, D) operand read through a TMA descriptor or a pointer
    passed apart: Triton 3.6's launcher takes tensor descriptors only as arguments of
    their own, not as fields of a record."""

    stride_b: int
    stride_s: int
    stride_h: int


class QKV(NamedTuple):
    """The ``Strides`` of the forward's q, k and v (K2, V2 share k's and v's)."""

    q: Strides
    k: Strides
    v: Strides


class Shape(NamedTuple):
    """The launch's sizes: ``heads`` its grid runs over (query heads in the forward and dQ
    kernels, K/V heads in dK/dV), ``group`` query heads per K/V head, and the rows of the
    queries and of the keys."""

    heads: int
    group: int
    seqlen_q: int
    seqlen_k: int


class Stats(NamedTuple):
    """lse or delta, (B, H, S) fp32: a pointer and its batch and head strides."""

    ptr: object
    stride_b: int
    stride_h: int


class Variant(NamedTuple):
    """What a launch compiles for. BAND: a band bounds the keys; POSITIONAL: on global
    positions; SEGMENTS: segment ids; DROPOUT; GROUPED: dropout positions in aligned runs
    (Philox calls shared); SPARSE: block-mask index lists, LIST_STAGES the pipeline stages
    of their loop over full blocks (config.list_stages); PARTS: 2 where the keys (forward,
    dQ) or queries (dK/dV) are held in two tensors (pair.Joined), LAST the part whose loops
    run second; WAIT: that part is still arriving (pair.Arrival); ACCUMULATE: merge into
    running sums (out and lse; the gradients); QUERY_MAJOR: the dK/dV kernel's scores queries
    by keys (config.bwd_config says when); LONG: some tensor spans 2**31 elements or more,
    so offsets are 64-bit (``_tile_ptrs``)."""

    BAND: bool = False
    POSITIONAL: bool = False
    SEGMENTS: bool = False
    DROPOUT: bool = False
    GROUPED: bool = False
    SPARSE: bool = False
    LIST_STAGES: object = None
    PARTS: int = 1
    LAST: int = 1
    WAIT: bool = False
    ACCUMULATE: bool = False
    QUERY_MAJOR: bool = False
    LONG: bool = False


class Band(NamedTuple):
    """band.lo <= j - i <= band.hi (local rows; VARIANT.POSITIONAL: global positions), an
    unbounded side -+masks.BAND_INF."""

    lo: int
    hi: int


class Positions(NamedTuple):
    """Global positions of the pair's rows (PairMask.pos): query row i at q0 + i * stride +
    (i // BLOCK) * jump, key row j at k0 + j * stride + (j // BLOCK) * jump."""

    q0: int
    k0: int
    stride: int
    jump: int


class Segments(NamedTuple):
    """Segment ids: the columns' ids (B, S_cols) int32 and the rows' ranges (3, B, S_rows)
    int32 (masks.segment_ranges), with their strides."""

    cols: object
    stride_cols: int
    ranges: object
    stride_plane: int
    stride_b: int


class Dropout(NamedTuple):
    """Philox seed, the 8-bit drop threshold, the kept probabilities' scale (kernels/
    dropout.py) and the global index of head 0 (``PairMask.dropout_head0``)."""

    seed: int
    threshold: int
    scale: float
    head0: int = 0


class Lists(NamedTuple):
    """A block mask's index lists (masks.block_lists): counts (2 or 4, Hm, R) and indices
    (Hm, R, C) int32, the program order (masks.program_order), the counts' plane stride,
    the lists' head stride (0 for a mask shared by the heads) and C."""

    counts: object
    index: object
    order: object
    stride_plane: int
    stride_head: int
    n_cols: int


class Tail(NamedTuple):
    """The rows from ``split`` on of two operands (K and V, or Q and dO) when held in
    tensors of their own (pair.Joined, VARIANT.PARTS = 2), with the first parts' strides
    (else x, y are stand-ins). The forward's x, y are None: its second parts are K2, V2,
    which may be descriptors."""

    x: object
    y: object
    split: int


class Wait(NamedTuple):
    """A part still arriving (pair.Arrival, VARIANT.WAIT): chunk c of ``chunk_heads`` K/V
    heads is in once flags[c] >= epoch. A tile that finds its chunk's flag down waits at
    most ``timeout_ns`` (a float, so that no value specializes a launch) on the GPU's
    clock (``fwd._await_chunk``); then it gives up: it writes c + 1 at ``status`` (an
    int64 word, in host-mapped memory where the host is to see it without a
    synchronization) and fwd.GAVE_UP into every flag, and the launch's tiles that give
    up or find a flag so write NaN."""

    flags: object
    epoch: int
    chunk_heads: int
    timeout_ns: float
    status: object


@triton.jit
def _tile_ptrs(ptr, strides, off_b, off_h, start, BLOCK_ROWS: tl.constexpr, cols, LONG: tl.constexpr):
    """Pointers to rows [start, start + BLOCK_ROWS) x ``cols`` of head off_h of batch off_b
    of a (B, S, H, D) tensor at ``ptr`` read with ``strides`` (a ``Rows`` or ``Strides``).

    LONG (a tensor of the launch spans 2**31 elements or more): the offset of the tile's
    first element is 64-bit and the offsets inside the tile 32-bit (the launcher checks
    that BLOCK_ROWS rows span fewer than 2**31 elements: launch._check_offsets). Otherwise
    every offset fits 32 bits and is computed as it always was: the 64-bit form
    everywhere cost the backward 8-13% (tools/ab_kernel.py on one H100, 2026-11-26),
    its tile offsets no longer depending on the loop and so held in registers across
    it."""
    if LONG:  # a constexpr: one branch is compiled (a function returns from one place)
        first = (off_b.to(tl.int64) * strides.stride_b + off_h.to(tl.int64) * strides.stride_h
                 + start.to(tl.int64) * strides.stride_s)
        ptrs = ptr + first + (tl.arange(0, BLOCK_ROWS)[:, None] * strides.stride_s + cols[None, :])
    else:
        rows = start + tl.arange(0, BLOCK_ROWS)
        ptrs = (ptr + off_b * strides.stride_b + off_h * strides.stride_h + rows[:, None] * strides.stride_s
                + cols[None, :])
    return ptrs


@triton.jit
def _load_block(src, strides, off_b, off_h, start, n_rows, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                HEAD_DIM: tl.constexpr, BOUNDED: tl.constexpr, TMA: tl.constexpr, LONG: tl.constexpr):
    """Rows [start, start + BLOCK_ROWS) of head off_h of batch off_b, a (BLOCK_ROWS, BLOCK_D)
    tile of ``src``: a TMA descriptor (TMA), or a pointer read with ``strides`` (a ``Rows``
    or ``Strides``; LONG as in ``_tile_ptrs``). Rows past n_rows (checked only when BOUNDED)
    and columns past HEAD_DIM read 0."""
    if TMA:
        tile = src.load([off_b, start, off_h, 0]).reshape(BLOCK_ROWS, BLOCK_D)
    else:
        rows = start + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_D)
        ptrs = _tile_ptrs(src, strides, off_b, off_h, start, BLOCK_ROWS, cols, LONG)
        if BOUNDED:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
        elif BLOCK_D != HEAD_DIM:
            tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _with_ptr(rows, ptr):
    """``rows`` read through another pointer (or descriptor) with the same strides."""
    return Rows(ptr=ptr, stride_b=rows.stride_b, stride_s=rows.stride_s, stride_h=rows.stride_h)


@triton.jit
def _offsets(dst, off_b, off_h, rows, cols, LONG: tl.constexpr):
    """Element offsets of rows x cols of head off_h of batch off_b of ``dst`` (``Rows``), for
    a kernel's stores after its loops: 64-bit with LONG (``_tile_ptrs``), 32-bit otherwise."""
    if LONG:
        offsets = (off_b.to(tl.int64) * dst.stride_b + off_h.to(tl.int64) * dst.stride_h
                   + rows.to(tl.int64)[:, None] * dst.stride_s + cols[None, :])
    else:
        offsets = off_b * dst.stride_b + off_h * dst.stride_h + rows[:, None] * dst.stride_s + cols[None, :]
    return offsets


@triton.jit
def _program(lists, SPARSE: tl.constexpr):
    """(tile, batch * heads index) of this program: program_id(0) and (1), or under a block
    mask the program lists.order names for this launch position (``masks.program_order``:
    the programs whose rows list many more blocks than the rest run first)."""
    if SPARSE:
        n_tiles = tl.num_programs(0)
        program = tl.load(lists.order + tl.program_id(1) * n_tiles + tl.program_id(0))
        return program % n_tiles, program // n_tiles
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _query_tile(lists, BLOCK_M: tl.constexpr, VARIANT: tl.constexpr):
    """(first row of this program's query tile, batch * heads index). Banded grids run last
    tile first: under a causal band it sees the most keys, and a launch that ends on short
    tiles has a short tail (+1-9% on the causal forward, docs/notes/); under a
    block mask the program order has that order built in."""
    tile, bh = _program(lists, VARIANT.SPARSE)
    if VARIANT.BAND and not VARIANT.SPARSE:
        tile = tl.num_programs(0) - 1 - tile
    return tile * BLOCK_M, bh


@triton.jit
def _visible(s, rows, cols, first, stop, band, fill, PER_ROW: tl.constexpr,
             KEYS_MAJOR: tl.constexpr = False):
    """s with ``fill`` where a column is hidden from a row (s is (rows, cols): queries by keys
    in the forward and dQ kernels, keys by queries in dK/dV, KEYS_MAJOR). PER_ROW: outside
    the row's [first, stop) (``_row_bounds``); otherwise outside the band alone,
    band.lo <= key - query <= band.hi: a function of the diagonal, which a thread's
    elements share in pairs, so that form compiles shorter where it is the whole
    predicate (dQ, dK/dV: -50 instructions a tile)."""
    if PER_ROW:
        ok = (cols[None, :] >= first[:, None]) & (cols[None, :] < stop[:, None])
    else:
        diff = rows[:, None] - cols[None, :] if KEYS_MAJOR else cols[None, :] - rows[:, None]
        ok = (diff >= band.lo) & (diff <= band.hi)
    return tl.where(ok, s, fill)


@triton.jit
def _unpadded(s, cols, segments, off_b, n, holes, fill):
    """s with ``fill`` in the padding columns (segment id -1, or past n), read only when
    ``holes`` (some row's segment hull holds padding between its own columns;
    ``_row_bounds``)."""
    if holes:
        ids = tl.load(segments.cols + off_b * segments.stride_cols + cols, mask=cols < n, other=-1)
        s = tl.where(ids[None, :] >= 0, s, fill)
    return s


@triton.jit
def _tile_positions(pos0, start, BLOCK: tl.constexpr, pos):
    """(global position of local row ``start``, global positions of rows [start, start +
    BLOCK)) for rows whose row 0 is at pos0, spaced as ``pos`` (``Positions``) says; a tile
    never straddles two blocks (tiles divide SPARSE_BLOCK), so inside one the positions
    are evenly spaced."""
    tl.static_assert(SPARSE_BLOCK % BLOCK == 0, "dropout positions need tiles that divide a block")
    first = pos0 + start * pos.stride + (start // SPARSE_BLOCK) * pos.jump
    return first, first + tl.arange(0, BLOCK) * pos.stride


@triton.jit
def _byte_keep(word, t24, shift):
    """The byte at bit ``shift`` of word >= t, compared at the top of the word
    (t24 = t << 24): no extraction."""
    return (word << (24 - shift)) >= t24


@triton.jit
def _word_keep(word, t24):
    """The keep decisions of a word's 4 bytes, on two appended axes (key bit 0, key bit 4)."""
    return tl.join(tl.join(_byte_keep(word, t24, 0), _byte_keep(word, t24, 8)),
                   tl.join(_byte_keep(word, t24, 16), _byte_keep(word, t24, 24)))


@triton.jit
def _keep(drop, off_b, off_h, qpos, kpos_start, kpos, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          GROUPED: tl.constexpr, KEYS_MAJOR: tl.constexpr = False):
    """(BLOCK_M, BLOCK_N) dropout keep decisions (``drop``: ``Dropout``) of queries at global
    positions qpos and keys at kpos (kernels/dropout.py has the definition and its PyTorch
    twin).

    GROUPED: qpos is one run of consecutive positions starting at a multiple of 16,
    and kpos one starting at kpos_start, a multiple of 32. Then a Philox call's 16 elements
    (query bit 3; key bits 0, 3, 4) lie in registers of one thread of the query-by-key MMA
    layout (forward, dQ): each call runs once and its bytes are joined into place. In the
    key-by-query layout of the dK/dV kernel (KEYS_MAJOR) only query bit 3 and key bit 3 do,
    so each thread runs the calls of its own elements (4 threads share each) and takes
    one byte of each word. Otherwise every element runs its own call. Counter parts that
    vary along one axis stay unbroadcast, so Philox's first two rounds cost next to nothing."""
    seed = drop.seed
    head = (off_h + drop.head0).to(tl.uint32)
    batch = off_b.to(tl.uint32)
    t24 = tl.cast(drop.threshold, tl.uint32) << 24  # not .to: a threshold of 1 arrives as an int
    if GROUPED and BLOCK_M >= 16 and BLOCK_N >= 32:
        q = tl.split(tl.permute(qpos.to(tl.uint32).reshape(BLOCK_M // 16, 2, 8), (0, 2, 1)))[0]
        qc = ((q >> 4) << 3) | (q & 7)  # (query bits 4.., query bits 0-2)
        if KEYS_MAJOR:
            k = (kpos_start + 16 * tl.arange(0, BLOCK_N // 16)[:, None]
                 + tl.arange(0, 8)[None, :]).to(tl.uint32)  # (key bits 4.., key bits 0-2)
            kc = ((k >> 5) << 2) | ((k >> 1) & 3)
            o0, o1, o2, o3 = tl.philox(seed, kc[:, :, None, None], qc[None, None, :, :], head,
                                       batch, _PHILOX_ROUNDS)
            shift = (8 * (k & 1) + 16 * ((k >> 4) & 1))[:, :, None, None]
            keep = tl.join(tl.join(_byte_keep(o0, t24, shift), _byte_keep(o1, t24, shift)),
                           tl.join(_byte_keep(o2, t24, shift), _byte_keep(o3, t24, shift)))
            # (k 4.., k 0-2, q 4.., q 0-2, k 3, q 3) -> (k, q) -> (q, k)
            keep = tl.trans(tl.permute(keep, (0, 4, 1, 2, 5, 3)).reshape(BLOCK_N, BLOCK_M))
        else:
            kc = ((kpos_start // 32 + tl.arange(0, BLOCK_N // 32)).to(tl.uint32) << 2)[:, None] \
                | tl.arange(0, 4).to(tl.uint32)[None, :]  # (key bits 5.., key bits 1-2)
            o0, o1, o2, o3 = tl.philox(seed, kc[None, None, :, :], qc[:, :, None, None], head,
                                       batch, _PHILOX_ROUNDS)
            keep = tl.join(tl.join(_word_keep(o0, t24), _word_keep(o1, t24)),
                           tl.join(_word_keep(o2, t24), _word_keep(o3, t24)))
            # (q 4.., q 0-2, k 5.., k 1-2, k 0, k 4, k 3, q 3) -> (q, k)
            keep = tl.permute(keep, (0, 7, 1, 2, 5, 6, 3, 4)).reshape(BLOCK_M, BLOCK_N)
    else:
        qp = qpos.to(tl.uint32)[:, None]
        kp = kpos.to(tl.uint32)[None, :]
        o0, o1, o2, o3 = tl.philox(seed, ((kp >> 5) << 2) | ((kp >> 1) & 3),
                                   ((qp >> 4) << 3) | (qp & 7), head, batch, _PHILOX_ROUNDS)
        w = ((kp >> 3) & 1) | ((qp >> 2) & 2)
        word = tl.where(w < 2, tl.where(w == 0, o0, o1), tl.where(w == 2, o2, o3))
        keep = _byte_keep(word, t24, 8 * ((kp & 1) | ((kp >> 3) & 2)))
    return keep


@triton.jit
def _first_at_or_after(t, pos0, stride, jump):
    """The first local row whose global position (pos0 + c * stride + (c // BLOCK) * jump,
    PairMask.pos) is >= t (masks.first_at_or_after), or 0 for t <= pos0: no division of a
    negative number."""
    period = SPARSE_BLOCK * stride + jump
    u = tl.maximum(t - pos0, 0)
    blocks = u // period
    offset = u - blocks * period
    return blocks * SPARSE_BLOCK + tl.minimum((offset + stride - 1) // stride, SPARSE_BLOCK)


@triton.jit
def _band_interval(rows, band, pos, POSITIONAL: tl.constexpr, TRANSPOSED: tl.constexpr):
    """[first, stop) of the columns the band leaves each of ``rows`` (a tensor or a scalar):
    query rows i see keys c with lo <= c - i <= hi, or with POSITIONAL lo <= kpos(c)
    - qpos(i) <= hi on the global positions ``pos`` gives. TRANSPOSED: rows are keys and
    columns queries (the dK/dV kernel), the same band read the other way. Non-decreasing
    in the row either way."""
    lo, hi = band.lo, band.hi
    if TRANSPOSED:
        lo, hi = -hi, -lo
    if POSITIONAL:
        row_pos0, col_pos0 = (pos.k0, pos.q0) if TRANSPOSED else (pos.q0, pos.k0)
        at = row_pos0 + rows * pos.stride + rows // SPARSE_BLOCK * pos.jump
        first = _first_at_or_after(at + lo, col_pos0, pos.stride, pos.jump)
        stop = _first_at_or_after(at + hi + 1, col_pos0, pos.stride, pos.jump)
    else:
        first, stop = rows + lo, rows + hi + 1
    return first, stop


@triton.jit
def _row_bounds(rows, n_rows, n_cols, band, pos, segments, off_b, VARIANT: tl.constexpr,
                TRANSPOSED: tl.constexpr):
    """What each row of a tile may see, as column intervals: (first, stop, run_stop, holes).

    Row r sees at most the columns [first[r], stop[r]): those the band leaves it
    (``_band_interval``), within [0, n_cols), and (VARIANT.SEGMENTS) within the hull of the
    columns carrying its segment id; rows past n_rows see none. The columns [first[r],
    run_stop[r]) carry its id, every one (= stop without segments). ``holes``: some row's
    hull holds padding columns between its own, which only the per-column id test
    (``_unpadded``) masks; otherwise the intervals are the whole predicate, two
    comparisons an element.

    segments.ranges (3, B, n_rows) int32, per row: hull [lo, hi) and run end
    (masks.segment_ranges). Rows are queries and columns keys in the forward and dQ
    kernels; the reverse (TRANSPOSED) in dK/dV."""
    ok = rows < n_rows
    first = tl.zeros_like(rows)
    stop = tl.where(ok, n_cols, 0)
    if VARIANT.BAND:
        band_first, band_stop = _band_interval(rows, band, pos, VARIANT.POSITIONAL, TRANSPOSED)
        first = tl.maximum(first, band_first)
        stop = tl.minimum(stop, band_stop)
    run_stop = stop
    holes = False
    if VARIANT.SEGMENTS:
        base = segments.ranges + off_b * segments.stride_b + rows
        hull_stop = tl.load(base + segments.stride_plane, mask=ok, other=0)
        run_end = tl.load(base + 2 * segments.stride_plane, mask=ok, other=0)
        first = tl.maximum(first, tl.load(base, mask=ok, other=n_cols))
        stop = tl.minimum(stop, hull_stop)
        run_stop = tl.minimum(stop, run_end)
        holes = tl.max((run_end < hull_stop).to(tl.int32), 0) > 0
    return first, stop, run_stop, holes


@triton.jit
def _tile_range(start_r, n_rows, n_cols, band, pos, first, stop, run_stop, BLOCK_ROWS: tl.constexpr,
                BLOCK_COLS: tl.constexpr, VARIANT: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Loop bounds over the column tiles of the row tile [start_r, start_r + BLOCK_ROWS),
    (start, full_start, full_end, end), from its rows' ``_row_bounds`` (with segments; the
    band alone gives them from the tile's first and last rows). Columns outside
    [start, end) are invisible to every row; the BLOCK_COLS-aligned tiles in
    [full_start, full_end) are visible to every row (no mask arithmetic), the others in
    [start, end) partly."""
    last = tl.minimum(start_r + BLOCK_ROWS, n_rows) - 1
    if VARIANT.SEGMENTS:
        ok = start_r + tl.arange(0, BLOCK_ROWS) < n_rows
        begin = tl.min(tl.where(ok, first, n_cols), 0)
        stop_all = tl.max(stop, 0)
        full_begin = tl.max(tl.where(ok, first, 0), 0)
        full_stop = tl.min(tl.where(ok, run_stop, n_cols), 0)
    else:
        begin = 0
        stop_all = n_cols
        full_begin = 0
        full_stop = n_cols
        if VARIANT.BAND:  # the tile's first and last rows bound the others' intervals
            first_of_first, stop_of_first = _band_interval(start_r, band, pos, VARIANT.POSITIONAL, TRANSPOSED)
            first_of_last, stop_of_last = _band_interval(last, band, pos, VARIANT.POSITIONAL, TRANSPOSED)
            begin = tl.maximum(first_of_first, 0)
            stop_all = tl.minimum(stop_of_last, n_cols)
            full_begin = first_of_last
            full_stop = tl.minimum(stop_of_first, n_cols)
    start = begin // BLOCK_COLS * BLOCK_COLS
    end = tl.maximum(stop_all, start)
    full_start = tl.minimum(tl.maximum(start, (full_begin + BLOCK_COLS - 1) // BLOCK_COLS * BLOCK_COLS), end)
    full_end = tl.maximum(tl.minimum(full_stop, end) // BLOCK_COLS * BLOCK_COLS, full_start)
    return start, full_start, full_end, end


@triton.jit
def _listed_range(lists, row, PART=0):
    """Block-sparse loop bounds (start, full_start, full_end, end), in virtual columns: the
    blocks listed for row block ``row`` laid end to end, its partial blocks in
    [start, full_start) and its full ones in [full_start, end). ``_column`` maps them back.
    PART: of the columns' second part (lists split where the columns are held in two
    tensors, ``masks.block_lists``), listed after the first's."""
    counts, plane = lists.counts, lists.stride_plane
    start = 0
    if PART == 1:
        start = (tl.load(counts + row) + tl.load(counts + plane + row)) * SPARSE_BLOCK
    full_start = start + tl.load(counts + 2 * PART * plane + row) * SPARSE_BLOCK
    end = full_start + tl.load(counts + (2 * PART + 1) * plane + row) * SPARSE_BLOCK
    return start, full_start, end, end


@triton.jit
def _query_loop(start_m, rows, seqlen_q, seqlen_k, band, pos, segments, lists, off_b, off_h,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr):
    """The key loop of a query tile (forward, dQ): its rows' ``_row_bounds`` (first, stop,
    holes), its block-mask list row (0 without lists) and its loop bounds (start,
    full_start, full_end, end), from the rows' intervals or the query block's lists."""
    first, stop, run_stop, holes = _row_bounds(rows, seqlen_q, seqlen_k, band, pos, segments, off_b,
                                               VARIANT, False)
    row = 0
    if VARIANT.SPARSE:  # the query block's index lists
        row = off_h * lists.stride_head + start_m // SPARSE_BLOCK
        start, full_start, full_end, end = _listed_range(lists, row)
    else:
        start, full_start, full_end, end = _tile_range(start_m, seqlen_q, seqlen_k, band, pos, first, stop,
                                                       run_stop, BLOCK_M, BLOCK_N, VARIANT, False)
    return first, stop, holes, row, start, full_start, full_end, end


@triton.jit
def _column(v, lists, row, SPARSE: tl.constexpr):
    """The column of loop position v: v itself, or under a block mask the column of virtual
    column v in the blocks listed for row block ``row``."""
    if SPARSE:
        block = v // SPARSE_BLOCK
        return tl.load(lists.index + row * lists.n_cols + block) * SPARSE_BLOCK + (v - block * SPARSE_BLOCK)
    else:
        return v


@triton.jit
def _load_stats(lse, delta, rows, seqlen_q):
    """lse in base 2 (a row that saw no key gets +inf, so its p is 0) and delta of rows,
    from pointers to one (batch, head)'s rows of each."""
    ok = rows < seqlen_q
    row_lse = tl.load(lse + rows, mask=ok, other=float("inf"))
    row_lse = tl.where(row_lse == float("-inf"), float("inf"), row_lse) * 1.4426950408889634
    return row_lse, tl.load(delta + rows, mask=ok, other=0.0)


@triton.jit
def _stats_row(stats, off_b, off_h, LONG: tl.constexpr):
    """Pointer to the rows of batch off_b, head off_h of ``stats`` (``Stats``; LONG: 64-bit
    offsets, as in ``_tile_ptrs``)."""
    if LONG:
        row = stats.ptr + off_b.to(tl.int64) * stats.stride_b + off_h.to(tl.int64) * stats.stride_h
    else:
        row = stats.ptr + off_b * stats.stride_b + off_h * stats.stride_h
    return row


@triton.jit
def _store_grad(dst, src, offsets, mask, grad, ACCUMULATE: tl.constexpr):
    """dst[offsets] = grad, plus src[offsets] when accumulating (src: dst itself, or a running
    sum with dst's strides, which the ring's last pass reads in fp32 to write k's dtype)."""
    if ACCUMULATE:
        grad += tl.load(src + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + offsets, grad.to(dst.dtype.element_ty), mask=mask)
