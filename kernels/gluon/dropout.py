"""Attention dropout's keep decisions in the Gluon kernels' tiles: the forward's queries by
keys (``keep``) and the backward's keys by queries (``keep_t``).

The bits are the library's (kernels/dropout.py has the definition and its PyTorch twin):
one Philox4x32-7 call a block of 16 elements, 2 queries by 8 keys (query bit 3; key bits
0, 3 and 4), keyed by (seed, batch, global head, global query position, global key
position), so this kernel drops exactly what the forward (and the Triton kernels) drop.

In the forward's 64 x 128 wgmma accumulator of S (queries by keys, kernels/gluon/fwd.py) a
thread holds query rows differing in bit 3 and key columns differing in bits 0 and 3-6:
all 16 elements of each call it needs (query bit 3; key bits 0, 3, 4), four calls a tile,
each run once and its bytes joined into place (``keep``), as the Triton forward does.

In the backward's 64 x 64 wgmma accumulator of Sᵀ (keys by queries, kernels/gluon/bwd.py) a thread
holds key rows differing in bit 3 and query columns differing in bits 0, 3, 4 and 5; key
bits 0-2 are its lane's and 4-5 its warp's. So of a call's 16 elements a thread holds 4
(key bit 3 by query bit 3: the call's four words), and its byte within each word (key
bits 0 and 4) is the same for all of them. Its partner lane (key bit 0 flipped) holds the
same 8 calls, so each of the two runs 4 of them, takes its own byte of each word, and
hands the other its byte's 16 decisions in one shuffle (``keep_t``); the other 16 bytes
of a call are two warps away (key bit 4), so each call runs twice. The decisions are joined
into the accumulator's registers without moving data (``_call_axes``). Philox's two
products a round are one 32 x 32 -> 64 bit multiply each (``mul.wide.u32``).

Needs the tile's key positions to start at a multiple of 32 and its query positions at a
multiple of 16, one run of consecutive positions each (the launcher checks:
kernels/gluon/launch.py), so that the bits of a position below 5 (keys) and 4 (queries)
are those of the row and column.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ROUNDS = gl.constexpr(7)  # Philox4x32-7, kernels/dropout.py's


@gluon.jit
def _philox(seed_lo, seed_hi, c0, c1, c2, c3):
    """Philox4x32-7 of uint32 counter words under the 64-bit key (seed_lo, seed_hi), as
    triton.language.philox and kernels/dropout.py (the same words: tests/test_gluon_gpu.py's
    dropout cases compare against the PyTorch twin's keep mask)."""
    k0 = seed_lo
    k1 = seed_hi
    for _ in gl.static_range(ROUNDS):
        hi_b, lo_b = gl.inline_asm_elementwise(  # one 32 x 32 -> 64 multiply for both halves
            "{ .reg .b64 t; mul.wide.u32 t, $2, 0xCD9E8D57; mov.b64 {$1, $0}, t; }", "=r,=r,r", [c2],
            dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)
        hi_a, lo_a = gl.inline_asm_elementwise(
            "{ .reg .b64 t; mul.wide.u32 t, $2, 0xD2511F53; mov.b64 {$1, $0}, t; }", "=r,=r,r", [c0],
            dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@gluon.jit
def _call_axes(x):
    """A (64 keys, 64 queries) tile as (k5 k4, k2-0, q5 q4, q2 q1, q0, k3, q3): a call's
    four elements of one thread (key bit 3, query bit 3) on the last two axes. Register
    moves only."""
    return x.reshape([4, 2, 8, 4, 2, 4, 2]).permute([0, 2, 3, 5, 6, 1, 4])


@gluon.jit
def _byte_kept(word, shift, threshold):
    """Whether the byte of ``word`` at bit ``shift`` is >= threshold (kept)."""
    return ((word >> shift) & 0xFF) >= threshold


@gluon.jit
def _fwd_call_axes(x):
    """A (64 queries, 128 keys) tile as (q5 q4, q2-0, k6 k5, k2 k1, k0, k4, k3, q3): a call's
    16 elements, all of one thread's registers, on the last four axes. Register moves only."""
    return x.reshape([4, 2, 8, 4, 2, 2, 4, 2]).permute([0, 2, 3, 6, 7, 4, 5, 1])


@gluon.jit
def _word_kept(word, threshold):
    """A word's four bytes' decisions on two new last axes: (key bit 0, key bit 4)."""
    return gl.join(gl.join(_byte_kept(word, 0, threshold), _byte_kept(word, 8, threshold)),
                   gl.join(_byte_kept(word, 16, threshold), _byte_kept(word, 24, threshold)))


@gluon.jit
def keep(query0, key0, head, batch, drop, layout: gl.constexpr):
    """(64, 128) bool in ``layout`` (the forward's 64 x 128 wgmma accumulator of S): whether
    the pair of query query0 + r and key key0 + c (global positions, query0 % 16 == 0 and
    key0 % 32 == 0) is kept. drop = (seed_lo, seed_hi, threshold, ...). Each call once: its
    counter words from the tile's first element of it (``_fwd_call_axes``, split down to
    one element a call), its 16 bytes joined back into place: word (key bit 3, query bit
    3), byte (key bit 0, key bit 4)."""
    seed_lo, seed_hi, threshold = drop[0].to(gl.uint32), drop[1].to(gl.uint32), drop[2].to(gl.uint32)
    r = gl.arange(0, 64, gl.SliceLayout(1, layout)).to(gl.uint32) + query0.to(gl.uint32)
    c = gl.arange(0, 128, gl.SliceLayout(0, layout)).to(gl.uint32) + key0.to(gl.uint32)
    qc, kc = gl.broadcast(gl.expand_dims(((r >> 4) << 3) | (r & 7), 1),
                          gl.expand_dims(((c >> 5) << 2) | ((c >> 1) & 3), 0))
    qc, kc = _fwd_call_axes(qc), _fwd_call_axes(kc)
    qc, _ = qc.split()  # query bit 3 = 0, then key bits 3, 4 and 0: one element a call
    qc, _ = qc.split()
    qc, _ = qc.split()
    qc, _ = qc.split()
    kc, _ = kc.split()
    kc, _ = kc.split()
    kc, _ = kc.split()
    kc, _ = kc.split()
    head = gl.full(kc.shape, 0, gl.uint32, kc.type.layout) + head.to(gl.uint32)
    batch = gl.full(kc.shape, 0, gl.uint32, kc.type.layout) + batch.to(gl.uint32)
    o0, o1, o2, o3 = _philox(seed_lo, seed_hi, kc, qc, head, batch)
    x = gl.join(gl.join(_word_kept(o0, threshold), _word_kept(o1, threshold)),
                gl.join(_word_kept(o2, threshold), _word_kept(o3, threshold)))  # (..., k0, k4, k3, q3)
    x = x.permute([0, 7, 1, 2, 5, 6, 3, 4]).reshape([64, 128])
    return gl.convert_layout(x, layout, assert_trivial=True)


@gluon.jit
def keep_t(key0, query0, head, batch, drop, layout: gl.constexpr):
    """(64, 64) bool in ``layout`` (the 64 x 64 wgmma accumulator): whether the pair of key
    key0 + r and query query0 + c (global positions, key0 % 32 == 0 and query0 % 16 == 0)
    is kept. drop = (seed_lo, seed_hi, threshold, ...) (``bwd._attn_bwd_sm90_kernel``'s).

    The two lanes of a warp whose rows differ in key bit 0 (lane bit 2) hold the same calls:
    each runs half of them (those of query bit 0 equal to its key bit 0), takes its own byte
    of each word, and hands the other lane its byte's 16 decisions in one shuffle."""
    seed_lo, seed_hi, threshold = drop[0].to(gl.uint32), drop[1].to(gl.uint32), drop[2].to(gl.uint32)
    r = gl.arange(0, 64, gl.SliceLayout(1, layout)).to(gl.uint32) + key0.to(gl.uint32)
    c = gl.arange(0, 64, gl.SliceLayout(0, layout)).to(gl.uint32) + query0.to(gl.uint32)
    k0 = r & 1
    # the query's bit 0 taken from the row's key bit 0: the lane's half of the calls
    kc, qc = gl.broadcast(gl.expand_dims(((r >> 5) << 2) | ((r >> 1) & 3), 1),
                          gl.expand_dims(((c >> 4) << 3) | (c & 6), 0))
    lane, _ = gl.broadcast(gl.expand_dims(k0, 1), qc)
    qc = qc | lane
    shift, col = gl.broadcast(gl.expand_dims(8 * (k0 | ((r >> 3) & 2)), 1), gl.expand_dims((c >> 4) & 3, 0))
    kc, _ = _call_axes(kc).split()  # query bit 3 = 0
    kc, _ = kc.split()  # key bit 3 = 0
    qc, _ = _call_axes(qc).split()
    qc, _ = qc.split()
    shift, _ = _call_axes(shift).split()
    shift, _ = shift.split()
    col, _ = _call_axes(col).split()
    col, _ = col.split()
    col, _ = col.split()  # query bits 4-5 of the call, axis 2
    kc, _ = kc.split()  # query bit 0 = 0: one call of each pair
    qc, _ = qc.split()
    shift, _ = shift.split()
    head = gl.full(kc.shape, 0, gl.uint32, kc.type.layout) + head.to(gl.uint32)
    batch = gl.full(kc.shape, 0, gl.uint32, kc.type.layout) + batch.to(gl.uint32)
    o0, o1, o2, o3 = _philox(seed_lo, seed_hi, kc, qc, head, batch)
    other = shift ^ 8  # the partner lane's byte: key bit 0 flipped
    bits = ((_byte_kept(o0, other, threshold).to(gl.uint32) << col)
            | (_byte_kept(o1, other, threshold).to(gl.uint32) << (col + 4))
            | (_byte_kept(o2, other, threshold).to(gl.uint32) << (col + 8))
            | (_byte_kept(o3, other, threshold).to(gl.uint32) << (col + 12)))
    theirs = gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 4, 0x1f, 0xffffffff;", "=r,r",
                                       [gl.reduce(bits, 2, _or)], dtype=gl.uint32, is_pure=True, pack=1)
    theirs, _ = gl.broadcast(gl.expand_dims(theirs, 2), col)
    odd = (shift & 8) != 0  # this lane's key bit 0: its own calls are those of query bit 0 = 1
    x0 = _halves(_byte_kept(o0, shift, threshold), ((theirs >> col) & 1) != 0, odd)
    x1 = _halves(_byte_kept(o1, shift, threshold), ((theirs >> (col + 4)) & 1) != 0, odd)
    x2 = _halves(_byte_kept(o2, shift, threshold), ((theirs >> (col + 8)) & 1) != 0, odd)
    x3 = _halves(_byte_kept(o3, shift, threshold), ((theirs >> (col + 12)) & 1) != 0, odd)
    # word k3 | q3 << 1 decides element (k3, q3) of the call
    x = gl.join(gl.join(x0, x1), gl.join(x2, x3))
    x = x.permute([0, 5, 1, 2, 6, 3, 4]).reshape([64, 64])  # back to (k5 k4, k3, k2-0, q5 q4, q3, q2 q1, q0)
    return gl.convert_layout(x, layout, assert_trivial=True)


@gluon.jit
def _or(a, b):  # a reduction's combine (gl.sum's is a triton.language jit function the CPU suite's interpreter patches)
    return a | b


@gluon.jit
def _halves(mine, theirs, odd):
    """A word's decisions for query bit 0 = 0 and 1 (a new last axis): this lane's own for
    the calls it ran (query bit 0 = its key bit 0, ``odd``), the partner's for the others."""
    return gl.join(gl.where(odd, theirs, mine), gl.where(odd, mine, theirs))
