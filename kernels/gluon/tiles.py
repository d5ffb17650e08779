"""The tiles a CTA walks, for both Gluon kernels: bounds from the band and the host, and a
block mask's lists.

Each kernel computes from its band the tiles a CTA walks as four bounds (a, b, c, d): the
tiles [a, d) hold some visible pair, [b, c) are visible whole (no mask), [a, b) and
[c, d) take the masked steps (the forward's (start, u0, u1, end) over K tiles, the
backward's (first, split, split2, end) over Q tiles: ``_q_tiles``). With segment ids the
host adds four bounds of the same meaning per tile (``masks.segment_tiles``); ``_narrow``
intersects the two, so every partition of the CTA, calling it on the same values, walks
the same tiles. Under a block mask a kernel walks instead the blocks its tile's row of
``masks.block_lists`` names (``_list_row``; the backward's Q tiles ``_listed_tile``,
``_listed_steps``), every partition reading the same row.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..masks import BLOCK

BLOCK_N = gl.constexpr(128)  # the backward's K/V rows a CTA (one block of a block mask)
BLOCK_M = gl.constexpr(64)  # the backward's Q rows a step
HALVES = gl.constexpr(BLOCK // 64)  # Q tiles of BLOCK_M in a block mask's block
DQ_COLS = gl.constexpr(32)  # columns of one dQ TMA box: 32 fp32 = 128 bytes, the widest a 128-byte swizzle takes
STAGES = gl.constexpr(2)  # the backward's Q/dO/lse/delta stages, and dSᵀ buffers


@gluon.jit
def _narrow(a, b, c, d, tiles):
    """(a, b, c, d) intersected with the four int32 at ``tiles``: the visible tiles those
    of both, the whole ones those whole under both, kept a <= b <= c <= d."""
    a = gl.maximum(a, gl.load(tiles))
    d = gl.maximum(gl.minimum(d, gl.load(tiles + 3)), a)
    b = gl.minimum(gl.maximum(gl.maximum(b, gl.load(tiles + 1)), a), d)
    c = gl.minimum(gl.maximum(gl.minimum(c, gl.load(tiles + 2)), b), d)
    return a, b, c, d


@gluon.jit
def _q_tiles(n0, offset, band_lo, seqlen_q, segs, off_b, CAUSAL: gl.constexpr, LOWER: gl.constexpr,
             SEGMENTS: gl.constexpr):
    """(first, split, split2, end): the Q tiles (of BLOCK_M rows) [first, end) hold a query
    that sees a key of the K tile [n0, n0 + BLOCK_N); those in [split, split2) see every
    key of it; the others cross an edge of the band (some pair hidden: the masked step).
    Upper edge (CAUSAL), j <= i + offset: queries from n0 - offset on see key n0, and
    every query from n0 + BLOCK_N - 1 - offset on sees the whole tile. Lower edge (LOWER,
    a window), j >= i + band_lo: queries up to n0 + BLOCK_N - 1 - band_lo see the tile's
    last key, and every query up to n0 - band_lo sees all of it. Without a band,
    (0, 0, end, end). SEGMENTS: narrowed by the K tile's own four of batch off_b
    (``masks.segment_tiles`` over Q tiles: those some key's document reaches, those inside
    every key's; ``tiles._narrow``). Every partition calls this with the same scalars:
    they walk the same steps."""
    end = seqlen_q // BLOCK_M
    first = 0
    split = 0
    if CAUSAL:  # dividends clamped >= 0: integer division truncates
        first = gl.minimum(gl.maximum(n0 - offset, 0) // BLOCK_M, end)
        full = gl.maximum(n0 + BLOCK_N - 1 - offset, 0)
        split = gl.minimum(gl.maximum((full + BLOCK_M - 1) // BLOCK_M, first), end)
    split2 = end
    if LOWER:
        end = gl.maximum(gl.minimum(gl.maximum(n0 + BLOCK_N - 1 - band_lo + BLOCK_M, 0) // BLOCK_M, end), first)
        split = gl.minimum(split, end)
        split2 = gl.minimum(gl.maximum(gl.maximum(n0 - band_lo + 1, 0) // BLOCK_M, split), end)
    if SEGMENTS:
        first, split, split2, end = _narrow(first, split, split2, end, segs[4] + off_b.to(gl.int64) * segs[5]
                                            + (n0 // BLOCK_N) * 4)
    return first, split, split2, end


@gluon.jit
def _list_row(blks, off_hk, g, n0, GROUP: gl.constexpr):
    """Query head off_hk * GROUP + g's row of the block lists for the tile of 128 rows at
    n0 (``masks.block_lists``: the backward's transposed, a row a key block listing query
    blocks; the forward's a row a query block listing key blocks, with off_hk its query
    head and GROUP 1), the partial blocks first, then the full ones: (partial, full, a
    pointer to the row's indices)."""
    counts, index, kind_stride, head_rows, cols = blks
    row = (off_hk * GROUP + g) * head_rows + n0 // BLOCK_N
    return gl.load(counts + row), gl.load(counts + kind_stride + row), index + row.to(gl.int64) * cols


@gluon.jit
def _listed_tile(row, first, j):
    """The Q tile of step j over a list row's blocks from entry ``first``: HALVES a block."""
    return gl.load(row + first + j // HALVES) * HALVES + j % HALVES


@gluon.jit
def _listed_steps(blks, off_hk, n0, GROUP: gl.constexpr):
    """The unmasked steps of a block mask's walk: HALVES Q tiles a full block, every head's."""
    steps = 0
    for g in range(GROUP):
        partial, full, row = _list_row(blks, off_hk, g, n0, GROUP)
        steps += HALVES * full
    return steps
