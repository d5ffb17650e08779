"""Attention dropout's keep decisions in the Gluon backward's keys-by-queries tiles.

The bits are the library's (kernels/dropout.py has the definition and its PyTorch twin):
one Philox4x32-7 call a block of 16 elements, 2 queries by 8 keys (query bit 3; key bits
0, 3 and 4), keyed by (seed, batch, global head, global query position, global key
position), so this kernel drops exactly what the forward (and the Triton kernels) drop.

In the 64 x 64 wgmma accumulator of Sᵀ (keys by queries, kernels/gluon/bwd.py) a thread
holds key rows differing in bit 3 and query columns differing in bits 0, 3, 4 and 5; key
bits 0-2 are its lane's and 4-5 its warp's. So of a call's 16 elements a thread holds 4
(key bit 3 by query bit 3: the call's four words), and its byte within each word (key
bits 0 and 4) is the same for all of them. Each thread runs the 8 calls of its 32
elements (4 threads share each call, as in the Triton dK/dV kernel) and takes its byte of
each word, with no data leaving its registers (``_call_axes``).

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
    triton.language.philox and kernels/dropout.py."""
    k0 = seed_lo
    k1 = seed_hi
    for _ in gl.static_range(ROUNDS):
        hi_b = gl.umulhi(c2, 0xCD9E8D57)
        lo_b = c2 * 0xCD9E8D57
        hi_a = gl.umulhi(c0, 0xD2511F53)
        lo_a = c0 * 0xD2511F53
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
def keep_t(key0, query0, head, batch, drop, layout: gl.constexpr):
    """(64, 64) bool in ``layout`` (the 64 x 64 wgmma accumulator): whether the pair of key
    key0 + r and query query0 + c (global positions, key0 % 32 == 0 and query0 % 16 == 0)
    is kept. drop = (seed_lo, seed_hi, threshold, ...) (``bwd._attn_bwd_sm90_kernel``'s)."""
    seed_lo, seed_hi, threshold = drop[0].to(gl.uint32), drop[1].to(gl.uint32), drop[2].to(gl.uint32)
    r = gl.arange(0, 64, gl.SliceLayout(1, layout)).to(gl.uint32) + key0.to(gl.uint32)
    c = gl.arange(0, 64, gl.SliceLayout(0, layout)).to(gl.uint32) + query0.to(gl.uint32)
    kc, qc = gl.broadcast(gl.expand_dims(((r >> 5) << 2) | ((r >> 1) & 3), 1),
                          gl.expand_dims(((c >> 4) << 3) | (c & 7), 0))
    shift, _ = gl.broadcast(gl.expand_dims(8 * ((r & 1) | ((r >> 3) & 2)), 1), qc)  # byte k0 | k4 << 1
    kc, _ = _call_axes(kc).split()  # query bit 3 = 0
    kc, _ = kc.split()  # key bit 3 = 0
    qc, _ = _call_axes(qc).split()
    qc, _ = qc.split()
    shift, _ = _call_axes(shift).split()
    shift, _ = shift.split()
    head = gl.full(kc.shape, 0, gl.uint32, kc.type.layout) + head.to(gl.uint32)
    batch = gl.full(kc.shape, 0, gl.uint32, kc.type.layout) + batch.to(gl.uint32)
    o0, o1, o2, o3 = _philox(seed_lo, seed_hi, kc, qc, head, batch)
    # word k3 | q3 << 1 decides element (k3, q3) of the call
    x = gl.join(gl.join(_byte_kept(o0, shift, threshold), _byte_kept(o1, shift, threshold)),
                gl.join(_byte_kept(o2, shift, threshold), _byte_kept(o3, shift, threshold)))
    x = x.permute([0, 5, 1, 2, 6, 3, 4]).reshape([64, 64])  # back to (k5 k4, k3, k2-0, q5 q4, q3, q2 q1, q0)
    return gl.convert_layout(x, layout, assert_trivial=True)
