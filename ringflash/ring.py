"""The ring schedule: forward and backward as one autograd.Function, for every layout.

World size W, rank r. At step s the rank holds the K/V shard that started on rank
src = (r - s) mod W. Before computing step s it posts the send of that shard to r+1
and the receive of the next one from r-1, then runs the layout's block pairs for
(r, src) through the local kernel. Merging is the kernel's own epilogue: it resumes
the online softmax from the running (out, lse), kept in fp32 until the last step.

Backward: the same rotation of K/V. Each step's dK/dV for the visiting shard is
computed into a local buffer, then added to the running dK/dV of that shard, which
arrives from r-1 during the step (it left r-1 once r-1 had finished its own previous
step): the gradient buffer travels one step behind the K/V it belongs to, so its
transfer overlaps compute too. After the last step one more hop takes every shard's
dK/dV home. dQ never leaves the rank.
"""

from __future__ import annotations

import math

import torch

from .exchange import Ring
from .kernels import attn_delta, flash_attn_bwd, flash_attn_fwd
from .layouts import step_pairs


def _pack(k: torch.Tensor, v: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    buf[0].copy_(k)
    buf[1].copy_(v)
    return buf


def _steps(ring: Ring, layout: str, local_len: int, causal: bool):
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        yield step, step_pairs(layout, ring.rank, src, local_len, causal)


def ring_forward(q, k, v, *, softmax_scale: float, causal: bool, layout: str, ring: Ring):
    """Returns out (in q's dtype) and lse (fp32, (B, H, S)) of q against every rank's k, v."""
    b, n, h, d = q.shape
    out = torch.zeros((b, n, h, d), device=q.device, dtype=torch.float32)
    lse = torch.full((b, h, n), -math.inf, device=q.device, dtype=torch.float32)
    kv = torch.empty((2, 2, *k.shape), device=k.device, dtype=k.dtype)  # two packed buffers
    cur, nxt = _pack(k, v, kv[0]), kv[1]
    for step, pairs in _steps(ring, layout, n, causal):
        pending = ring.exchange((cur, nxt)) if step + 1 < ring.world else []
        for pair in pairs:
            flash_attn_fwd(q[:, pair.q], cur[0][:, pair.k], cur[1][:, pair.k],
                           softmax_scale=softmax_scale, causal_offset=pair.causal_offset,
                           out=out[:, pair.q], lse=lse[:, :, pair.q], accumulate=True)
        ring.wait(pending)
        cur, nxt = nxt, cur
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, dlse, *, softmax_scale: float, causal: bool,
                  layout: str, ring: Ring):
    """Returns dq, dk, dv of this rank's shards (in their dtypes)."""
    n = q.shape[1]
    delta = attn_delta(out, dout, dlse)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    kv = torch.empty((2, 2, *k.shape), device=k.device, dtype=k.dtype)
    cur, nxt = _pack(k, v, kv[0]), kv[1]
    # dkv[i] = packed (dk, dv) in fp32: the step's own part, the running sum it sends,
    # and the one it receives.
    local, sending, incoming = torch.empty((3, 2, *k.shape), device=k.device, dtype=torch.float32)
    have_sending = False
    for step, pairs in _steps(ring, layout, n, causal):
        transfers = []
        if step + 1 < ring.world:
            transfers.append((cur, nxt))
        if have_sending:
            transfers.append((sending, incoming))
        pending = ring.exchange(*transfers) if transfers else []
        if pairs:
            local.zero_()
        for pair in pairs:
            flash_attn_bwd(dout[:, pair.q], q[:, pair.q], cur[0][:, pair.k], cur[1][:, pair.k],
                           lse[:, :, pair.q], delta[:, :, pair.q], dq[:, pair.q],
                           local[0][:, pair.k], local[1][:, pair.k], softmax_scale=softmax_scale,
                           causal_offset=pair.causal_offset, accumulate=True)
        ring.wait(pending)
        cur, nxt = nxt, cur
        # The running dK/dV of the shard just computed: what came from r-1 plus ours.
        if not have_sending:
            sending, local = (local, sending) if pairs else (sending.zero_(), local)
            have_sending = True
        elif pairs:
            incoming.add_(local)
            sending, incoming = incoming, sending
        else:
            sending, incoming = incoming, sending
    if ring.world > 1:  # one more hop: every shard's dK/dV reaches its owner
        ring.wait(ring.exchange((sending, incoming)))
        sending = incoming
    return dq.to(q.dtype), sending[0].to(k.dtype), sending[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, layout, ring):
        out, lse = ring_forward(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                layout=layout, ring=ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = dict(softmax_scale=softmax_scale, causal=causal, layout=layout, ring=ring)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, dlse, **ctx.args)
        return dq, dk, dv, None, None, None, None
