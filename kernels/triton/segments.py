"""Segment ranges on the GPU: for every row, the hull of the columns that carry its segment
id and where the run of them from its first column ends (masks.segment_ranges is the
definition, in torch ops), in three launches; and the Gluon kernels' tile bounds from them
(masks.segment_tiles is the definition) in one."""

import torch
import triton
import triton.language as tl

from ..masks import tensor_memo
from . import config

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
    block = 64 if config.interpreting() else 1024
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


@triton.jit
def _segment_tiles_kernel(RANGES, TILES, n_tiles, stride_rp, stride_rb, stride_tb, ROWS: tl.constexpr,
                          COLS: tl.constexpr):
    """Per tile of ROWS rows (program_id(0)) of one batch row (program_id(1)): [start, u0,
    u1, end] in tiles of COLS columns, from its rows' [lo, hi, run_end]."""
    tile, off_b = tl.program_id(0), tl.program_id(1)
    rows = RANGES + off_b * stride_rb + tile * ROWS + tl.arange(0, ROWS)
    lo, hi, run_end = tl.load(rows), tl.load(rows + stride_rp), tl.load(rows + 2 * stride_rp)
    start = tl.minimum(tl.min(lo, 0) // COLS, n_tiles)
    end = tl.maximum((tl.max(hi, 0) + COLS - 1) // COLS, start)
    u0 = tl.minimum(tl.maximum((tl.max(lo, 0) + COLS - 1) // COLS, start), end)
    u1 = tl.minimum(tl.maximum(tl.min(run_end, 0) // COLS, u0), end)
    out = TILES + off_b * stride_tb + tile * 4
    tl.store(out, start)
    tl.store(out + 1, u0)
    tl.store(out + 2, u1)
    tl.store(out + 3, end)


def segment_tiles(ranges: torch.Tensor, n_cols: int, rows_block: int, cols_block: int) -> torch.Tensor:
    """masks.segment_tiles (its definition, in some twenty torch ops) in one launch: (B,
    S_rows / rows_block, 4) int32 from ``segment_ranges``' (3, B, S_rows), S_rows a multiple
    of ``rows_block`` and ``n_cols`` of ``cols_block``."""
    ranges = ranges.contiguous()
    _, b, n_rows = ranges.shape
    tiles = torch.empty((b, n_rows // rows_block, 4), dtype=torch.int32, device=ranges.device)
    _segment_tiles_kernel[(n_rows // rows_block, b)](ranges, tiles, n_cols // cols_block, ranges.stride(0),
                                                     ranges.stride(1), tiles.stride(0), ROWS=rows_block,
                                                     COLS=cols_block)
    return tiles
