"""FlashAttention-2 forward and backward in Triton, one (query block, key block) pair.

The math, per query row i, with s_ij = q_i . k_j * scale (base-2 internally:
``qk_scale = scale * log2(e)`` is folded into one multiply-add with the row max):

    forward   m = max_j s_ij,  l = sum_j exp(s_ij - m),  o = sum_j exp(s_ij - m) v_j / l,
              lse = m + log(l); key tiles in the inner loop, normalization by l once.
    backward  p_ij = exp(s_ij - lse_i) from the saved lse, delta_i = do_i . o_i,
              ds_ij = p_ij (do_i . v_j - delta_i);
              dq_i = scale sum_j ds_ij k_j,  dk_j = scale sum_i ds_ij q_i,  dv_j = sum_i p_ij do_i.

Masks are a description (kernels/masks.py, ``PairMask``), evaluated per tile from local
indices and segment ids, never an N x N tensor:

    band      key j visible to query i only if band_lo <= j - i <= band_hi (``BAND``; an
              unbounded side is a sentinel). Causal with diagonal offset o is band_hi = o;
              a sliding window on global positions becomes a band of the pair's local rows.
              With POSITIONAL the band is on the rows' global positions instead (the
              block_stripe layout, whose rows jump: masks.PairMask.band_on_positions).
    segments  only if qseg_i == kseg_j >= 0 (``SEGMENTS``: packed documents, padding = -1).
              Each query row carries the hull of the key rows its id occupies (and each key
              row that of the query rows), since a pair's non-padding ids never decrease.

Both become one interval of columns per row, [first, stop) (``_row_bounds``): the whole
predicate is two comparisons an element, plus a test of the columns' ids only where
padding sits inside a document's hull. Per (query tile, key tile) a kernel classifies
from its rows' intervals: outside them all (empty, never loaded), inside every row's
(no mask arithmetic), or partial (the intervals applied).
In the forward and dQ kernels the band-partial tiles run in their own loops; the dK/dV
kernel masks all of its tiles (measured faster there, benchmarks/NOTES.md).

    blocks    block-sparse (``SPARSE``): a tile's row block iterates over index lists of
              the column blocks it computes, built once per launch (masks.block_lists):
              partial blocks with the predicate, then full ones without. Blocks not
              listed are never loaded, so the work follows the mask's nonzero blocks.
              The programs whose rows list far more blocks than the rest run first
              (masks.program_order), so that no long row ends a launch alone.

Layouts: q, o, do (B, Sq, H, D); k, v, dk, dv (B, Sk, Hkv, D), H a multiple of Hkv;
lse, delta (B, H, Sq). Any of them may be a strided view (last dim contiguous).
The forward reads q, k and v through TMA tensor descriptors over the whole (B, S, H, D)
tensor where the hardware has them and the strides are 16-byte aligned (the copy engine
zero-fills rows past the end); otherwise, and in the backward, through pointer loads.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import dropout
from .masks import BAND_INF, BLOCK, tensor_memo

LOG2E = math.log2(math.e)
SPARSE_BLOCK = tl.constexpr(BLOCK)


def _interpreting() -> bool:
    return triton.knobs.runtime.interpret


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def fwd_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile shape and launch parameters of the forward kernel, from benchmarks/tune_kernel.py
    on an H200 (bf16, 32 heads, TMA loads; see benchmarks/NOTES.md). fp32 tiles take twice
    the shared memory, so fp32 runs small unpipelined tiles: it is the exact path, not the
    fast one."""
    if _interpreting():
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    if head_dim <= 128:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=4)


def bwd_config(head_dim: int, dtype: torch.dtype, sparse: bool = False,
               dropout_only: bool = False) -> tuple[dict, dict]:
    """Tiles of the two backward kernels, (dK/dV kernel, dQ kernel): BLOCK_M query rows by
    BLOCK_N key rows in each, tuned apart. Same provenance as fwd_config. Under a block
    mask (sparse) dK/dV takes 128 keys a program: the listed query blocks sit apart in
    memory and each load of one then serves twice the keys (-2-8% dK/dV time at 128k,
    densities 0.05-0.5; benchmarks/NOTES.md, "Block-sparse, second round"). Under dropout
    with no other mask (dropout_only) the dK/dV kernel computes its scores queries by keys
    (QUERY_MAJOR), the layout the dropout bits are drawn in without redundant Philox calls,
    and passes P and dS to its products transposed: at head_dim 128, 16k, dK/dV 21.6 ->
    18.6 ms; no gain under a causal band, and 3% slower without dropout (benchmarks/NOTES.md,
    "Dropout, fourth round"). The results are the same either way."""
    if _interpreting():
        cfg = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
        return dict(cfg, QUERY_MAJOR=dropout_only), cfg
    if dtype == torch.float32:
        cfg = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
        return cfg, cfg
    if head_dim <= 64:
        return (dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3))
    if head_dim <= 128:
        dkdv = dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2) if sparse else \
            dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, QUERY_MAJOR=dropout_only)
        return dkdv, dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return (dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
            dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3))


def list_stages(cfg: dict, sparse: bool, column_ids: bool = False) -> int | None:
    """Pipeline stages of a kernel's loop over the full blocks a block mask lists (None:
    the launch's). The list entry is a load the tile loads' addresses wait on, and Triton's
    pipeliner shares the stages out between the two levels, (stages - 1) // 2 of prefetch
    each: 2 s - 1 stages keep the tiles' prefetch distance of the dense loop, s - 1.
    With s, the forward's tiles were prefetched one step ahead instead of two (-14%).
    Not when the loop also reads the key tiles' segment ids (column_ids: the forward and
    dQ with segments): the pipeliner then gives every stage its own K and V buffers, and
    2 s - 1 = 5 stages of 128 x 128 tiles ask 320 KB of shared memory, past the 227 KB a
    Hopper block can have (the launch fails); those keep s."""
    stages = cfg["num_stages"]
    return 2 * stages - 1 if sparse and stages > 1 and not column_ids else None


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: plain fp32 products, or with torch's TF32 switch on, three TF32 passes
    (error ~1e-6 rather than single TF32's ~1e-3, which the probabilities of long rows
    pile up past the contract). Half types ignore it."""
    if dtype != torch.float32:
        return "tf32"
    return "tf32x3" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """The interpreter (CPU tensors) emulates descriptors; on CUDA they need Hopper or later."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def _use_tma(*tensors: torch.Tensor) -> bool:
    """Descriptors need a 16-byte-aligned base and 16-byte-aligned strides."""
    return _has_tma(tensors[0].device) and all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in tensors)


def _source(t: torch.Tensor, block_rows: int, head_dim_block: int, tma: bool):
    """What the kernels read a (B, S, H, D) tensor through: a descriptor of
    (1, block_rows, 1, head_dim_block) boxes, or the tensor itself (a pointer)."""
    if not tma:
        return t
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_rows, 1, head_dim_block])


@triton.jit
def _load_block(src, off_b, off_h, start, stride_b, stride_s, stride_h, n_rows,
                BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                BOUNDED: tl.constexpr, TMA: tl.constexpr):
    """Rows [start, start + BLOCK_ROWS) of head off_h of batch off_b, a (BLOCK_ROWS, BLOCK_D)
    tile; rows past n_rows (checked only when BOUNDED) and columns past HEAD_DIM read 0."""
    if TMA:
        tile = src.load([off_b, start, off_h, 0]).reshape(BLOCK_ROWS, BLOCK_D)
    else:
        rows = start + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_D)
        ptrs = src + off_b * stride_b + off_h * stride_h + rows[:, None] * stride_s + cols[None, :]
        if BOUNDED:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
        elif BLOCK_D != HEAD_DIM:
            tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _program(ORDER, SPARSE: tl.constexpr):
    """(tile, batch * heads index) of this program: program_id(0) and (1), or under a block
    mask the program ORDER names for this launch position (``masks.program_order``: the
    programs whose rows list many more blocks than the rest run first)."""
    if SPARSE:
        n_tiles = tl.num_programs(0)
        program = tl.load(ORDER + tl.program_id(1) * n_tiles + tl.program_id(0))
        return program % n_tiles, program // n_tiles
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _query_tile(ORDER, BLOCK_M: tl.constexpr, BAND: tl.constexpr, SPARSE: tl.constexpr):
    """(first row of this program's query tile, batch * heads index). Banded grids run last
    tile first: under a causal band it sees the most keys, and a launch that ends on short
    tiles has a short tail (+1-9% on the causal forward, benchmarks/NOTES.md); under a
    block mask ORDER has that order built in."""
    tile, bh = _program(ORDER, SPARSE)
    if BAND and not SPARSE:
        tile = tl.num_programs(0) - 1 - tile
    return tile * BLOCK_M, bh


@triton.jit
def _visible(s, rows, cols, first, stop, band_lo, band_hi, fill, PER_ROW: tl.constexpr,
             KEYS_MAJOR: tl.constexpr = False):
    """s with ``fill`` where a column is hidden from a row (s is (rows, cols): queries by keys
    in the forward and dQ kernels, keys by queries in dK/dV, KEYS_MAJOR). PER_ROW: outside
    the row's [first, stop) (``_row_bounds``); otherwise outside the band alone,
    band_lo <= key - query <= band_hi: a function of the diagonal, which a thread's
    elements share in pairs, so that form compiles shorter where it is the whole
    predicate (dQ, dK/dV: -50 instructions a tile)."""
    if PER_ROW:
        ok = (cols[None, :] >= first[:, None]) & (cols[None, :] < stop[:, None])
    else:
        diff = rows[:, None] - cols[None, :] if KEYS_MAJOR else cols[None, :] - rows[:, None]
        ok = (diff >= band_lo) & (diff <= band_hi)
    return tl.where(ok, s, fill)


@triton.jit
def _unpadded(s, cols, SEG, off_b, stride_b, n, holes, fill):
    """s with ``fill`` in the padding columns (segment id -1), read only when ``holes`` (some
    row's segment hull holds padding between its own columns; ``_row_bounds``)."""
    if holes:
        s = tl.where(_segment_ids(SEG, off_b, stride_b, cols, n)[None, :] >= 0, s, fill)
    return s


@triton.jit
def _segment_ids(SEG, off_b, stride_b, idx, n):
    """Segment ids of rows idx (-1 past n: padding sees nothing and is never seen)."""
    return tl.load(SEG + off_b * stride_b + idx, mask=idx < n, other=-1)


_PHILOX_ROUNDS = tl.constexpr(dropout.ROUNDS)


@triton.jit
def _tile_positions(pos0, start, BLOCK: tl.constexpr, stride, jump):
    """(global position of local row ``start``, global positions of rows [start, start +
    BLOCK)) for dropout. Local row i is at pos0 + i * stride + (i // SPARSE_BLOCK) * jump
    (PairMask.pos; jump is 0 but for the block_stripe layout); a tile never straddles two
    blocks (tiles divide SPARSE_BLOCK), so inside one the positions are evenly spaced."""
    tl.static_assert(SPARSE_BLOCK % BLOCK == 0, "dropout positions need tiles that divide a block")
    first = pos0 + start * stride + (start // SPARSE_BLOCK) * jump
    return first, first + tl.arange(0, BLOCK) * stride


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
def _keep(seed, threshold, off_b, off_h, qpos, kpos_start, kpos, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, GROUPED: tl.constexpr, KEYS_MAJOR: tl.constexpr = False):
    """(BLOCK_M, BLOCK_N) dropout keep decisions of queries at global positions qpos and keys
    at kpos (kernels/dropout.py has the definition and its PyTorch twin).

    GROUPED: qpos is one run of consecutive positions starting at a multiple of 16, and
    kpos one starting at kpos_start, a multiple of 32. Then a Philox call's 16 elements
    (query bit 3; key bits 0, 3, 4) lie in registers of one thread of the query-by-key MMA
    layout (forward, dQ): each call runs once and its bytes are joined into place. In the
    key-by-query layout of the dK/dV kernel (KEYS_MAJOR) only query bit 3 and key bit 3 do,
    so each thread runs the calls of its own elements (4 threads share each) and takes
    one byte of each word. Otherwise every element runs its own call. Counter parts that
    vary along one axis stay unbroadcast, so Philox's first two rounds cost next to nothing."""
    head = off_h.to(tl.uint32)
    batch = off_b.to(tl.uint32)
    t24 = threshold.to(tl.uint32) << 24
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
def _band_interval(rows, lo, hi, positions, POSITIONAL: tl.constexpr, TRANSPOSED: tl.constexpr):
    """[first, stop) of the columns the band leaves each of ``rows`` (a tensor or a scalar):
    query rows i see keys c with lo <= c - i <= hi, or with POSITIONAL lo <= kpos(c) -
    qpos(i) <= hi on global positions: positions = (row_pos0, col_pos0, stride, jump), rows
    and columns at row_pos0 / col_pos0 + index * stride + (index // BLOCK) * jump (with
    TRANSPOSED the rows' are the keys'). TRANSPOSED: rows are keys and columns queries (the
    dK/dV kernel), the same band read the other way. Non-decreasing in the row either way."""
    if TRANSPOSED:
        lo, hi = -hi, -lo
    if POSITIONAL:
        row_pos0, col_pos0, stride, jump = positions
        at = row_pos0 + rows * stride + rows // SPARSE_BLOCK * jump
        first = _first_at_or_after(at + lo, col_pos0, stride, jump)
        stop = _first_at_or_after(at + hi + 1, col_pos0, stride, jump)
    else:
        first, stop = rows + lo, rows + hi + 1
    return first, stop


@triton.jit
def _row_bounds(rows, n_rows, n_cols, lo, hi, RANGES, off_b, stride_plane, stride_b, positions,
                BAND: tl.constexpr, SEGMENTS: tl.constexpr, POSITIONAL: tl.constexpr,
                TRANSPOSED: tl.constexpr):
    """What each row of a tile may see, as column intervals: (first, stop, run_stop, holes).

    Row r sees at most the columns [first[r], stop[r]): those the band leaves it (BAND,
    ``_band_interval``), within [0, n_cols), and (SEGMENTS) within the hull of the columns
    carrying its segment id; rows past n_rows see none. The columns [first[r],
    run_stop[r]) carry its id, every one (= stop without segments). ``holes``: some row's hull holds padding columns
    between its own, which only the per-column id test (``_unpadded``) masks; otherwise
    the intervals are the whole predicate, two comparisons an element.

    RANGES (3, B, n_rows) int32, per row: hull [lo, hi) and run end (masks.segment_ranges).
    Rows are queries and columns keys in the forward and dQ kernels; the reverse
    (TRANSPOSED) in dK/dV."""
    ok = rows < n_rows
    first = tl.zeros_like(rows)
    stop = tl.where(ok, n_cols, 0)
    if BAND:
        band_first, band_stop = _band_interval(rows, lo, hi, positions, POSITIONAL, TRANSPOSED)
        first = tl.maximum(first, band_first)
        stop = tl.minimum(stop, band_stop)
    run_stop = stop
    holes = False
    if SEGMENTS:
        base = RANGES + off_b * stride_b + rows
        hull_stop = tl.load(base + stride_plane, mask=ok, other=0)
        run_end = tl.load(base + 2 * stride_plane, mask=ok, other=0)
        first = tl.maximum(first, tl.load(base, mask=ok, other=n_cols))
        stop = tl.minimum(stop, hull_stop)
        run_stop = tl.minimum(stop, run_end)
        holes = tl.max((run_end < hull_stop).to(tl.int32), 0) > 0
    return first, stop, run_stop, holes


@triton.jit
def _tile_range(start_r, n_rows, n_cols, lo, hi, first, stop, run_stop, positions,
                BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BAND: tl.constexpr,
                SEGMENTS: tl.constexpr, POSITIONAL: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Loop bounds over the column tiles of the row tile [start_r, start_r + BLOCK_ROWS),
    (start, full_start, full_end, end), from its rows' ``_row_bounds`` (with segments; the
    band alone gives them from the tile's first and last rows). Columns outside
    [start, end) are invisible to every row; the BLOCK_COLS-aligned tiles in
    [full_start, full_end) are visible to every row (no mask arithmetic), the others in
    [start, end) partly."""
    last = tl.minimum(start_r + BLOCK_ROWS, n_rows) - 1
    if SEGMENTS:
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
        if BAND:  # the tile's first and last rows bound the others' intervals
            first_of_first, stop_of_first = _band_interval(start_r, lo, hi, positions, POSITIONAL,
                                                           TRANSPOSED)
            first_of_last, stop_of_last = _band_interval(last, lo, hi, positions, POSITIONAL, TRANSPOSED)
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
def _listed_range(COUNTS, stride_plane, row, PART=0):
    """Block-sparse loop bounds (start, full_start, full_end, end), in virtual columns: the
    blocks listed for row block ``row`` laid end to end, its partial blocks in
    [start, full_start) and its full ones in [full_start, end). ``_column`` maps them back.
    PART: of the columns' second part (lists split where the columns are held in two
    tensors, ``masks.block_lists``), listed after the first's."""
    start = 0
    if PART == 1:
        start = (tl.load(COUNTS + row) + tl.load(COUNTS + stride_plane + row)) * SPARSE_BLOCK
    full_start = start + tl.load(COUNTS + 2 * PART * stride_plane + row) * SPARSE_BLOCK
    end = full_start + tl.load(COUNTS + (2 * PART + 1) * stride_plane + row) * SPARSE_BLOCK
    return start, full_start, end, end


@triton.jit
def _query_loop(start_m, rows, seqlen_q, seqlen_k, band_lo, band_hi, RANGES, off_b, off_h,
                stride_rp, stride_rb, COUNTS, stride_cp, stride_sh, positions, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BAND: tl.constexpr, SEGMENTS: tl.constexpr,
                SPARSE: tl.constexpr, POSITIONAL: tl.constexpr):
    """The key loop of a query tile (forward, dQ): its rows' ``_row_bounds`` (first, stop,
    holes), its block-mask list row (0 without SPARSE) and its loop bounds (start,
    full_start, full_end, end), from the rows' intervals or the query block's lists."""
    first, stop, run_stop, holes = _row_bounds(rows, seqlen_q, seqlen_k, band_lo, band_hi, RANGES,
                                               off_b, stride_rp, stride_rb, positions, BAND,
                                               SEGMENTS, POSITIONAL, False)
    row = 0
    if SPARSE:  # the query block's index lists
        row = off_h * stride_sh + start_m // SPARSE_BLOCK
        start, full_start, full_end, end = _listed_range(COUNTS, stride_cp, row)
    else:
        start, full_start, full_end, end = _tile_range(start_m, seqlen_q, seqlen_k, band_lo, band_hi, first,
                                                       stop, run_stop, positions, BLOCK_M, BLOCK_N, BAND,
                                                       SEGMENTS, POSITIONAL, False)
    return first, stop, holes, row, start, full_start, full_end, end


@triton.jit
def _column(v, INDEX, row, n_col_blocks, SPARSE: tl.constexpr):
    """The column of loop position v: v itself, or with SPARSE the column of virtual column
    v in the blocks INDEX lists for row block ``row``."""
    if SPARSE:
        block = v // SPARSE_BLOCK
        return tl.load(INDEX + row * n_col_blocks + block) * SPARSE_BLOCK + (v - block * SPARSE_BLOCK)
    else:
        return v


# ----------------------------------------------------------------------------- forward


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
    rows from ``split`` on are K2, V2 (``interface.Joined``; their blocks listed apart), and
    part LAST runs second. WAIT: part LAST is still arriving, in chunks of ``chunk_heads``
    K/V heads; chunk c is in once ARRIVED[c] >= epoch (written by the copy stream after
    the chunk), so the tile waits for its head's chunk before that part's loops
    (``interface.Arrival``)."""
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


def _or(partial, dest):
    """The running sum an accumulating launch reads: ``partial``, or ``dest`` itself."""
    return dest if partial is None else partial


_STAND_INS: dict = {}


def _stand_in(device: torch.device) -> torch.Tensor:
    """A one-element int32 tensor for the pointer arguments of a feature a launch leaves
    off (segment ids, block lists): never read, so one per device is made and kept. A
    fresh one per launch cost an allocation and a fill kernel each, six to twelve in a
    ring of two's forward+backward (benchmarks/NOTES.md, "The ring of two at 32k": the
    launches' host time 1.62 -> 1.35-1.44 ms a call)."""
    if device not in _STAND_INS:
        _STAND_INS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _STAND_INS[device]


def _mask_args(mask, device: torch.device):
    """Kernel arguments of a PairMask: (band_lo, band_hi, qseg, kseg, BAND, SEGMENTS) and the
    dropout arguments (seed, threshold, scale, q_pos0, k_pos0, stride, jump, DROPOUT, GROUPED),
    whose positions a band on positions reads too. Without segments, the segment pointers
    are a one-element stand-in."""
    band = mask.band_lo is not None or mask.band_hi is not None
    lo = -BAND_INF if mask.band_lo is None else mask.band_lo
    hi = BAND_INF if mask.band_hi is None else mask.band_hi
    positions = mask.pos if mask.dropout_p > 0 or mask.band_on_positions else (0, 0, 1, 0)
    if mask.dropout_p > 0:
        q_pos0, k_pos0, stride, jump = positions
        grouped = stride == 1 and q_pos0 % 16 == 0 and k_pos0 % 32 == 0 and jump % 32 == 0
        drop = (mask.seed, dropout.threshold(mask.dropout_p), dropout.keep_scale(mask.dropout_p),
                *positions, True, grouped)
    else:
        drop = (0, 0, 1.0, *positions, False, False)
    if mask.q_segments is None:
        return (lo, hi, _stand_in(device), _stand_in(device), band, False), drop
    return (lo, hi, mask.q_segments, mask.k_segments, band, True), drop


def _sparse_args(mask, lo: int, hi: int, n_rows: int, n_cols: int, transpose: bool, device,
                 grid: tuple[int, int, int, int], reverse: bool = False, split: Optional[int] = None,
                 chunk: int = 0):
    """Kernel arguments of a block mask for one kernel: (counts, indices, program order,
    counts' plane stride, head stride of the lists, index row length) and SPARSE. Rows are
    queries (forward, dQ) or, with transpose, keys (dK/dV, band negated). ``grid`` is the
    launch's (tile rows, batch, heads, list heads a program loops over), ``reverse`` its
    tiles' natural order reversed, ``chunk`` the heads of a chunk the programs run in
    order of (``masks.program_order``); ``split``: the column where the columns' second
    part starts (lists split there), or None."""
    if mask.blocks is None:
        return (_stand_in(device), _stand_in(device), _stand_in(device), 0, 0, 0), False
    if mask.band_on_positions:
        raise ValueError("a block mask cannot be combined with a band on positions")
    counts, index = mask.blocks.lists(lo, hi, n_rows, n_cols, transpose, split)
    order = mask.blocks.order(lo, hi, n_rows, n_cols, transpose, *grid, reverse, chunk)
    heads, n_row_blocks, n_col_blocks = index.shape
    return (counts, index, order, counts.stride(0), n_row_blocks if heads > 1 else 0,
            n_col_blocks), True


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit
def _chunk_of_columns(COLS, base, chunk, n, BLOCK: tl.constexpr):
    """Column indices of a chunk, their ids (-1 past n) and where each column's run of equal
    ids ends (idx + 1 at a run's last column, n elsewhere)."""
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(COLS + base + idx, mask=idx < n, other=-1)
    after = tl.load(COLS + base + idx + 1, mask=idx + 1 < n, other=-2)  # -2: no column
    return idx, ids, tl.where(ids != after, idx + 1, n)


@triton.jit
def _chunk_summary_kernel(COLS, SUMMARY, n, stride_b, stride_sp, stride_sb, BLOCK: tl.constexpr):
    """Per chunk of BLOCK columns (program_id(0)) of one batch row (program_id(1)): its
    largest id, its smallest non-padding id and its first run end, the carries the
    other chunks' scans start from."""
    chunk, off_b = tl.program_id(0), tl.program_id(1)
    idx, ids, ends = _chunk_of_columns(COLS, off_b * stride_b, chunk, n, BLOCK)
    out = SUMMARY + off_b * stride_sb + chunk
    tl.store(out, tl.max(ids, 0))
    tl.store(out + stride_sp, tl.min(tl.where(ids < 0, 2147483647, ids), 0))
    tl.store(out + 2 * stride_sp, tl.min(ends, 0))


@triton.jit
def _column_runs_kernel(COLS, SUMMARY, AHEAD, BEHIND, RUN_END, n, n_chunks, stride_b, stride_sp,
                        stride_sb, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """Per column: the largest id at or before it (ahead), the smallest id at or after it
    (behind), padding (-1) skipped in both, and where its run of equal ids ends. Each
    program scans one chunk, starting from the carries of the chunks before (ahead) or
    after it (behind, run end) in SUMMARY."""
    chunk, off_b = tl.program_id(0), tl.program_id(1)
    base = off_b * stride_b
    others = tl.arange(0, CHUNKS)
    summary = SUMMARY + off_b * stride_sb + others
    before, after = others < chunk, (others > chunk) & (others < n_chunks)
    carry_ahead = tl.max(tl.load(summary, mask=before, other=-1), 0)
    carry_behind = tl.min(tl.load(summary + stride_sp, mask=after, other=2147483647), 0)
    carry_end = tl.min(tl.load(summary + 2 * stride_sp, mask=after, other=n), 0)
    idx, ids, ends = _chunk_of_columns(COLS, base, chunk, n, BLOCK)
    ok = idx < n
    tl.store(AHEAD + base + idx, tl.maximum(tl.associative_scan(ids, 0, _max), carry_ahead), mask=ok)
    behind = tl.associative_scan(tl.where(ids < 0, 2147483647, ids), 0, _min, reverse=True)
    tl.store(BEHIND + base + idx, tl.minimum(behind, carry_behind), mask=ok)
    tl.store(RUN_END + base + idx, tl.minimum(tl.associative_scan(ends, 0, _min, reverse=True), carry_end),
             mask=ok)


@triton.jit
def _search(SORTED, ids, n, steps, RIGHT: tl.constexpr):
    """Per id, the first index of the non-decreasing SORTED[:n] whose value is >= the id
    (> with RIGHT): a binary search of ``steps`` (= bit length of n) halvings."""
    lo = tl.zeros_like(ids)
    hi = tl.zeros_like(ids) + n
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        val = tl.load(SORTED + mid, mask=active, other=0)
        right = active & ((val <= ids) if RIGHT else (val < ids))
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo


@triton.jit
def _segment_ranges_kernel(ROWS, AHEAD, BEHIND, RUN_END, OUT, n_rows, n_cols, steps,
                           stride_rowsb, stride_colsb, stride_op, stride_ob, BLOCK: tl.constexpr):
    off_b = tl.program_id(1)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n_rows
    ids = tl.load(ROWS + off_b * stride_rowsb + idx, mask=ok, other=-1)
    col_base = off_b * stride_colsb
    lo = _search(AHEAD + col_base, ids, n_cols, steps, False)
    hi = _search(BEHIND + col_base, ids, n_cols, steps, True)
    some = (lo < hi) & (ids >= 0)
    run_end = tl.load(RUN_END + col_base + lo, mask=some, other=0)
    out = OUT + off_b * stride_ob + idx
    tl.store(out, tl.where(some, lo, n_cols), mask=ok)
    tl.store(out + stride_op, tl.where(some, hi, 0), mask=ok)
    tl.store(out + 2 * stride_op, run_end, mask=ok)


def segment_ranges(rows_seg: torch.Tensor, cols_seg: torch.Tensor) -> torch.Tensor:
    """masks.segment_ranges (its definition, in torch ops) in three launches: the column
    chunks' carries, the columns' scans, a binary search per row (~20 small ops before:
    0.5-0.8 ms on an H200 at 32k-128k tokens, paid per pair and kernel in the ring)."""
    rows, cols = rows_seg.contiguous(), cols_seg.contiguous()
    (b, n_rows), n_cols = rows.shape, cols.shape[1]
    block = 64 if _interpreting() else 1024
    n_chunks = triton.cdiv(n_cols, block)
    summary = torch.empty((3, b, n_chunks), dtype=torch.int32, device=cols.device)
    runs = torch.empty((3, b, n_cols), dtype=torch.int32, device=cols.device)
    out = torch.empty((3, b, n_rows), dtype=torch.int32, device=rows.device)
    _chunk_summary_kernel[(n_chunks, b)](cols, summary, n_cols, cols.stride(0), summary.stride(0),
                                         summary.stride(1), BLOCK=block)
    _column_runs_kernel[(n_chunks, b)](cols, summary, runs[0], runs[1], runs[2], n_cols, n_chunks,
                                       cols.stride(0), summary.stride(0), summary.stride(1),
                                       BLOCK=block, CHUNKS=triton.next_power_of_2(n_chunks))
    _segment_ranges_kernel[(triton.cdiv(n_rows, block), b)](
        rows, runs[0], runs[1], runs[2], out, n_rows, n_cols, max(n_cols, 1).bit_length(),
        rows.stride(0), runs.stride(1), out.stride(0), out.stride(1), BLOCK=block)
    return out


def _ranges(rows_seg, cols_seg, segments: bool):
    """segment_ranges (3, B, rows) where there are segments, a stand-in otherwise. One
    tensor of ids on both sides (one device: queries and keys are the same tokens) gives
    the same ranges either way round: computed once and kept while the tensor is."""
    if not segments:
        return rows_seg.view(1, 1, -1)
    if rows_seg is cols_seg:
        return tensor_memo(rows_seg, ("segment_ranges",), lambda: segment_ranges(rows_seg, rows_seg))
    return segment_ranges(rows_seg, cols_seg)


def fwd(q, k, v, out, lse, *, softmax_scale: float, mask, accumulate: bool, out_partial=None,
        tail=None, arrival=None):
    """``tail``: the keys' and values' rows that follow k and v when held apart
    (``interface.Joined``, under a block mask), or None; ``arrival``: with a tail, an
    ``interface.Arrival`` (which part runs last, and whether the kernel waits for it)."""
    b, sq, h, d = q.shape
    split, hkv = k.shape[1], k.shape[2]
    sk = split + (0 if tail is None else tail[0].shape[1])
    k2, v2 = tail or (k, v)  # stand-ins if whole
    cfg = fwd_config(d, q.dtype)
    bd = block_d(d)
    tma = _use_tma(q, k, v, k2, v2)
    (lo, hi, qseg, kseg, band, segments), drop = _mask_args(mask, q.device)
    ranges = _ranges(qseg, kseg, segments)
    wait = arrival is not None and arrival.flags is not None
    chunk = arrival.heads if wait else hkv
    (counts, index, order, *sparse_strides), sparse = _sparse_args(
        mask, lo, hi, sq, sk, False, q.device, (cfg["BLOCK_M"], b, h, 1), band,
        split=None if tail is None else split, chunk=chunk * (h // hkv) if wait else 0)
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]), b * h)
    _fwd_kernel[grid](
        _source(q, cfg["BLOCK_M"], bd, tma), _source(k, cfg["BLOCK_N"], bd, tma),
        _source(v, cfg["BLOCK_N"], bd, tma), out, _or(out_partial, out), lse, kseg, ranges, counts,
        index, order,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), kseg.stride(0), ranges.stride(0), ranges.stride(1),
        h, h // hkv, sq, sk, softmax_scale * LOG2E, lo, hi, *drop[:7], *sparse_strides,
        _source(k2, cfg["BLOCK_N"], bd, tma), _source(v2, cfg["BLOCK_N"], bd, tma), split,
        arrival.flags if wait else _stand_in(q.device), arrival.epoch if wait else 0, chunk,
        HEAD_DIM=d, BLOCK_D=bd, BAND=band, SEGMENTS=segments, DROPOUT=drop[7], GROUPED=drop[8],
        SPARSE=sparse, LIST_STAGES=list_stages(cfg, sparse, segments), ACCUMULATE=accumulate,
        PRECISION=_dot_precision(q.dtype), TMA=tma, POSITIONAL=mask.band_on_positions,
        PARTS=1 if tail is None else 2, LAST=1 if arrival is None else arrival.last, WAIT=wait,
        **cfg)
    return out, lse


# ----------------------------------------------------------------------------- backward


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


def delta(out: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """rowsum(do * out) in fp32, (B, H, S), in one pass over the two (B, S, H, D) tensors
    (last dimension contiguous); the twin's fp32 products take three more."""
    b, s, h, d = out.shape
    res = torch.empty((b, h, s), device=out.device, dtype=torch.float32)
    block_s = 16 if _interpreting() else 64
    _delta_kernel[(triton.cdiv(s, block_s), b * h)](
        out, do, res, s, h, out.stride(0), out.stride(1), out.stride(2), do.stride(0), do.stride(1),
        do.stride(2), res.stride(0), res.stride(1), HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_S=block_s)
    return res


@triton.jit
def _load_stats(LSE, DELTA, rows, seqlen_q):
    """lse in base 2 (a row that saw no key gets +inf, so its p is 0) and delta."""
    ok = rows < seqlen_q
    lse = tl.load(LSE + rows, mask=ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    return lse, tl.load(DELTA + rows, mask=ok, other=0.0)


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
def _store_grad(OUT, IN, offsets, mask, grad, ACCUMULATE: tl.constexpr):
    """OUT[offsets] = grad, plus IN[offsets] when accumulating (IN: OUT itself, or a running
    sum with OUT's strides, which the ring's last pass reads in fp32 to write k's dtype)."""
    if ACCUMULATE:
        grad += tl.load(IN + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, grad.to(OUT.dtype.element_ty), mask=mask)


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
    from ``split`` on are K2, V2 (``interface.Joined``); their blocks are listed apart, so
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


def bwd(do, q, k, v, lse, delta, dq, dk, dv, *, softmax_scale: float, mask, accumulate: bool,
        partials=(None, None, None), tails=(None, None)):
    """dq (skipped when None) and dk, dv (skipped when None): two kernels, so a caller can
    run them apart. The backward reads through pointers: TMA descriptors measured slower
    here (benchmarks/NOTES.md). ``tails``: the rows that follow (q, do) and (k, v) when
    held apart (``interface.Joined``: same strides, under a block mask), or None; the
    kernels read both parts where they are."""
    b, h, d = q.shape[0], q.shape[2], q.shape[3]
    hkv = k.shape[2]
    (q_split, sq), (k_split, sk) = ((t.shape[1], t.shape[1] + (0 if tail is None else tail[0].shape[1]))
                                    for t, tail in zip((q, k), tails))
    q_tails, k_tails = (tail or t for t, tail in zip(((q, do), (k, v)), tails))  # stand-ins if whole
    (lo, hi, qseg, kseg, band, segments), drop = _mask_args(mask, q.device)
    sparse = mask.blocks is not None
    dkdv_cfg, dq_cfg = bwd_config(d, q.dtype, sparse, drop[7] and not (band or segments or sparse))
    common = dict(HEAD_DIM=d, BLOCK_D=block_d(d), BAND=band, SEGMENTS=segments, DROPOUT=drop[7],
                  GROUPED=drop[8], SPARSE=sparse, ACCUMULATE=accumulate,
                  PRECISION=_dot_precision(q.dtype), POSITIONAL=mask.band_on_positions)
    scalars = (h // hkv, sq, sk, softmax_scale * LOG2E, softmax_scale, lo, hi, *drop[:7])
    qkv_strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    stat_strides = (lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1))
    if dk is not None:  # key tiles outer: q and do are read in BLOCK_M rows, k and v once
        ranges = _ranges(kseg, qseg, segments)
        (counts, index, order, *sparse_strides), _ = _sparse_args(
            mask, lo, hi, sk, sq, True, q.device, (dkdv_cfg["BLOCK_N"], b, hkv, h // hkv),
            split=None if tails[0] is None else q_split)
        _dkdv_kernel[(triton.cdiv(sk, dkdv_cfg["BLOCK_N"]), b * hkv)](
            q, k, v, do, lse, delta, dk, dv, _or(partials[1], dk), _or(partials[2], dv), ranges,
            counts, index, order, *qkv_strides,
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            *stat_strides, ranges.stride(0), ranges.stride(1), hkv, *scalars, *sparse_strides,
            *q_tails, q_split, LIST_STAGES=list_stages(dkdv_cfg, common["SPARSE"]),
            PARTS=1 if tails[0] is None else 2, **common, **dkdv_cfg)
    if dq is not None:  # query tiles outer: k and v are read in BLOCK_N rows
        ranges = _ranges(qseg, kseg, segments)
        (counts, index, order, *sparse_strides), _ = _sparse_args(
            mask, lo, hi, sq, sk, False, q.device, (dq_cfg["BLOCK_M"], b, h, 1), band,
            split=None if tails[1] is None else k_split)
        _dq_kernel[(triton.cdiv(sq, dq_cfg["BLOCK_M"]), b * h)](
            q, k, v, do, lse, delta, dq, _or(partials[0], dq), kseg, ranges, counts, index, order,
            *qkv_strides,
            dq.stride(0), dq.stride(1), dq.stride(2), *stat_strides, kseg.stride(0),
            ranges.stride(0), ranges.stride(1), h,
            *scalars, *sparse_strides, *k_tails, k_split,
            LIST_STAGES=list_stages(dq_cfg, common["SPARSE"], segments),
            PARTS=1 if tails[1] is None else 2, **common, **dq_cfg)
    return dq, dk, dv
