"""Tile bounds from the host that narrow a CTA's walk, for both Gluon kernels.

Each kernel computes from its band the tiles a CTA walks as four bounds (a, b, c, d): the
tiles [a, d) hold some visible pair, [b, c) are visible whole (no mask), [a, b) and
[c, d) take the masked steps (the forward's (start, u0, u1, end) over K tiles, the
backward's (first, split, split2, end) over Q tiles). With segment ids the host adds four
bounds of the same meaning per tile (``masks.segment_tiles``); ``_narrow`` intersects the
two, so every partition of the CTA, calling it on the same values, walks the same tiles.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _narrow(a, b, c, d, tiles):
    """(a, b, c, d) intersected with the four int32 at ``tiles``: the visible tiles those
    of both, the whole ones those whole under both, kept a <= b <= c <= d."""
    a = gl.maximum(a, gl.load(tiles))
    d = gl.maximum(gl.minimum(d, gl.load(tiles + 3)), a)
    b = gl.minimum(gl.maximum(gl.maximum(b, gl.load(tiles + 1)), a), d)
    c = gl.minimum(gl.maximum(gl.minimum(c, gl.load(tiles + 2)), b), d)
    return a, b, c, d
