"""The ring schedule: forward and backward, for every layout (ops.py makes them custom ops).

World size W, rank r. At step s the rank holds the K/V shard that started on rank
src = (r - s) mod W. Before computing step s it posts the send of that shard to r+1
and the receive of the next one from r-1, then runs the layout's block pairs for
(r, src) through the local kernel. Merging is the kernel's own epilogue: it resumes
the online softmax from the running (out, lse), kept in fp32 until the last step.

Backward: the same rotation of K/V. The running fp32 dK/dV of the visiting shard
arrives from r-1 during the step (it left r-1 once r-1 had finished its own previous
step): the gradient buffer travels one step behind the K/V it belongs to. Each step
runs the dQ pass first, which needs nothing in flight and so hides the transfer, then
adds the dK/dV pass straight into the arrived sum. After the last step one more hop,
in the gradients' own dtype, takes every shard's dK/dV home. dQ never leaves the rank.
"""

from __future__ import annotations

import torch

from .exchange import Ring
from .kernels import attn_delta, flash_attn_bwd, flash_attn_fwd
from .layouts import step_pairs


def _kv_buffers(k: torch.Tensor, v: torch.Tensor, ring: Ring):
    """(current, next): K/V of this step, packed into one tensor so a step sends one
    message, and the buffer the next shard arrives in. A ring of one sends nothing."""
    if ring.world == 1:
        return (k, v), None
    kv = ring.buffer("kv", (2, 2, *k.shape), k.dtype, k.device)
    kv[0, 0].copy_(k)
    kv[0, 1].copy_(v)
    return kv[0], kv[1]


def _steps(ring: Ring, layout: str, local_len: int, causal: bool):
    """(step, block pairs, first): step 0 is the rank's own shard, one pair over every row
    (a layout's invariant), so its kernels write their results and later steps add to them;
    no buffer needs zeroing first."""
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        pairs = step_pairs(layout, ring.rank, src, local_len, causal)
        if step == 0 and not (len(pairs) == 1 and pairs[0].q == pairs[0].k == slice(None)):
            raise AssertionError(f"layout {layout}: the first step must be one pair over all rows")
        yield step, pairs, step == 0


def ring_forward(q, k, v, *, softmax_scale: float, causal: bool, layout: str, ring: Ring):
    """Returns out (in q's dtype) and lse (fp32, (B, H, S)) of q against every rank's k, v."""
    b, n, h, d = q.shape
    out = torch.empty((b, n, h, d), device=q.device, dtype=torch.float32)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    cur, nxt = _kv_buffers(k, v, ring)
    for step, pairs, first in _steps(ring, layout, n, causal):
        pending = ring.exchange((cur, nxt)) if step + 1 < ring.world else []
        for pair in pairs:
            flash_attn_fwd(q[:, pair.q], cur[0][:, pair.k], cur[1][:, pair.k],
                           softmax_scale=softmax_scale, causal_offset=pair.causal_offset,
                           out=out[:, pair.q], lse=lse[:, :, pair.q], accumulate=not first)
        ring.wait(pending)
        cur, nxt = nxt, cur
    ring.finish()
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, dlse, *, softmax_scale: float, causal: bool,
                  layout: str, ring: Ring, packed_kv_grads: bool = False):
    """Returns dq, dk, dv of this rank's shards (in their dtypes); with packed_kv_grads,
    dq and one (2, *k.shape) tensor holding dk and dv."""
    n = q.shape[1]
    delta = attn_delta(out, dout, dlse)
    dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    cur, nxt = _kv_buffers(k, v, ring)
    # Packed (dk, dv) running sums in fp32: `running` belongs to the shard this step
    # computes and arrives from r-1 during the step; `sending` belongs to the shard of the
    # step before and leaves for r+1.
    running, sending = ring.buffer("grads", (2, 2, *k.shape), torch.float32, k.device)

    def add_grads(pair, kv, first, dq=None, dkv=None):
        """One block pair's dQ pass (into dq) or dK/dV pass (into packed dkv); the first
        step writes, the others add."""
        dk, dv = (None, None) if dkv is None else (dkv[0][:, pair.k], dkv[1][:, pair.k])
        flash_attn_bwd(dout[:, pair.q], q[:, pair.q], kv[0][:, pair.k], kv[1][:, pair.k],
                       lse[:, :, pair.q], delta[:, :, pair.q], None if dq is None else dq[:, pair.q],
                       dk, dv, softmax_scale=softmax_scale, causal_offset=pair.causal_offset,
                       accumulate=not first)

    for step, pairs, first in _steps(ring, layout, n, causal):
        # Two messages, the one needed first posted first: the running dK/dV (which the
        # dK/dV pass adds into; our own shard's sum starts here) and the next K/V (needed
        # by the next step only).
        grads_pending = [] if first else ring.exchange((sending, running))
        kv_pending = ring.exchange((cur, nxt)) if step + 1 < ring.world else []
        # dQ needs nothing in flight, so it runs while the running dK/dV arrives; dK/dV
        # then add straight into it, only in the key rows this step touches.
        for pair in pairs:
            add_grads(pair, cur, first, dq=dq)
        ring.wait(grads_pending)
        for pair in pairs:
            add_grads(pair, cur, first, dkv=running)
        ring.wait(kv_pending)
        cur, nxt = nxt, cur
        running, sending = sending, running
    if ring.world == 1:
        dkv = sending.to(k.dtype)
        return (dq.to(q.dtype), dkv) if packed_kv_grads else (dq.to(q.dtype), dkv[0], dkv[1])
    # One more hop takes every shard's dK/dV to its owner, in the gradients' dtype: the
    # sums are complete, so rounding before or after the hop gives the same bits.
    dkv = ring.buffer("home", sending.shape, k.dtype, k.device)
    dkv.copy_(sending)
    home = torch.empty_like(dkv)
    ring.wait(ring.exchange((dkv, home)))
    ring.finish()
    return (dq.to(q.dtype), home) if packed_kv_grads else (dq.to(q.dtype), home[0], home[1])
