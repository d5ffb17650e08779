"""The Gluon backward's deterministic dQ (kernels/gluon/bwd.py, ``DETERMINISTIC``).

With ``deterministic`` every Q tile's dQ adds come in increasing order of K tiles,
whatever the CTAs' timing: an int32 counter per (batch, query head, Q tile) holds how many
adds landed; K tile j waits until it reads j (an acquire load, spun on), adds, waits until
its bulk adds are complete (not only read), and increments the counter (a release). The
K tiles seeing some query of a Q tile are 0 .. J without the band and with it (key j is
seen from query j - offset on, so a tile seen by K tile J is seen by every K tile below),
so the turn of K tile j is j; a window's lower edge starts them at the K tile of the
tile's first query's lowest key, j0 (``_q_tiles`` reaches the same tiles), and the turn is
j - j0. A CTA only ever waits for CTAs dispatched before it
(the kernel's grid), so the oldest unfinished CTA never waits and the grid cannot
deadlock. The unmasked steps walk the Q tiles downwards from the last one (tile outer,
heads inner), so K tiles j - 1 and j reach a Q tile at the same step: under the band the
lower K tile has more tiles ahead of it, but they lie at the walk's end. Each K tile's
masked steps come last, where the K tiles below it have passed or are passing its
diagonal tiles (an offset that puts a diagonal across two K tiles within one Q tile, not
a multiple of 64 off one of 128, makes the upper tile wait for the lower one's end).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _lanes():
    return gl.arange(0, 32, gl.BlockedLayout([1], [32], [1], [0]))


@gluon.jit
def _min(a, b):  # (gl.min is a jit function of triton.language that the CPU suite's interpreter patches)
    return gl.minimum(a, b)


@gluon.jit
def _read_acquire(ptrs):
    """The int32 every lane reads at the same address, as one scalar: an acquire load at
    GPU scope."""
    seen = gl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptrs], dtype=gl.int32,
                                     is_pure=False, pack=1)
    return gl.reduce(seen, 0, _min)


@gluon.jit
def _wait_for(flag, turn):
    """Spin (every lane of the warp) until the int32 at ``flag`` reads ``turn``: the adds
    counted there are then visible to what this warp issues next."""
    ptrs = flag + _lanes() * 0
    seen = _read_acquire(ptrs)
    while seen != turn:
        seen = _read_acquire(ptrs)


@gluon.jit
def _landed_then_pass(flag):
    """Wait until this thread's bulk adds are complete (``cp.async.bulk.wait_group 0``: the
    writes performed, not only the shared tile read), sync the warp (whichever lane issued
    them), then lane 0 adds 1 to the counter with release semantics at GPU scope."""
    lanes = _lanes()
    gl.inline_asm_elementwise(
        "{ .reg .pred p; cp.async.bulk.wait_group 0; bar.warp.sync -1; setp.eq.s32 p, $1, 0; "
        "@p red.release.gpu.global.add.s32 [$2], 1; mov.b32 $0, 0; }",
        "=r,r,l", [lanes, flag + lanes * 0], dtype=gl.int32, is_pure=False, pack=1)
