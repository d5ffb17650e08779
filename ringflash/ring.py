"""The ring schedule: forward and backward, for every layout and mask (ops.py makes them
custom ops).

World size W, rank r. At step s the rank holds the K/V shard that started on rank
src = (r - s) mod W. Before computing step s it posts the send of that shard to r+1
and the receive of the next one from r-1, then runs the layout's block pairs for
(r, src) through the local kernel. Merging is the kernel's own epilogue: it resumes
the online softmax from the running (out, lse), kept in fp32 until the last step.

Masks are data on the way: the band on global positions (causal, sliding window) becomes
each pair's band of local indices (layouts.step_pairs), the visiting shard's segment
ids travel with its K/V, and dropout is keyed by the pair's global positions, so every
layout and world size drops the same elements as one device. A block mask on global
token blocks is sliced per pair (each pair of contiguous chunks is a rectangle of it), and
chunk pairs it leaves empty are dropped from the schedule. Steps after the last one that
computes anything on any rank are not run at all (``layouts.active_steps``): with a
sliding window or a local block mask the shards stop travelling once no rank further on
can see them.

Backward: the same rotation of K/V, with the own shard split around it: its dQ pass
first (hiding the first K/V trip), its dK/dV pass last. The running fp32 dK/dV of a
visiting shard starts on the rank after its owner and arrives from r-1 during each later
step (it left r-1 once r-1 had finished its previous step): the gradient buffer travels
one step behind the K/V it belongs to. Each step runs the dQ pass first, which needs
nothing in flight and so hides the transfer, then adds the dK/dV pass straight into the
arrived sum. The last trip takes each sum home while the owner runs its own dK/dV pass,
and the owner adds the two. dQ never leaves the rank.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .exchange import Ring
from .kernels import PairMask, attn_delta, flash_attn_bwd, flash_attn_fwd
from .kernels.masks import BLOCK, Blocks, tensor_memo
from .layouts import Band, active_steps, occupied_chunks, step_pairs, writes_first


def _kv_buffers(k: torch.Tensor, v: torch.Tensor, segments: Optional[torch.Tensor], ring: Ring,
                steps: int):
    """(current, next): the visiting shard's K/V packed into one tensor, so a step sends
    one message, and its segment ids (or None); then the buffers the next shard arrives
    in. A ring that never passes a shard on sends nothing."""
    if steps == 1:
        return ((k, v), segments), (None, None)
    kv = ring.buffer("kv", (2, 2, *k.shape), k.dtype, k.device)
    kv[0, 0].copy_(k)
    kv[0, 1].copy_(v)
    if segments is None:
        return (kv[0], None), (kv[1], None)
    seg = ring.buffer("segments", (2, *segments.shape), torch.int32, k.device)
    seg[0].copy_(segments)
    return (kv[0], seg[0]), (kv[1], seg[1])


def _pass_on(ring: Ring, cur, nxt) -> list:
    """Send this step's K/V (and segment ids) on, receive the next shard's."""
    (kv, seg), (kv_next, seg_next) = cur, nxt
    if seg is None:
        return ring.exchange((kv, kv_next))
    return ring.exchange((kv, kv_next), (seg, seg_next))


class _SparsePlan:
    """A global block mask as the ring uses it: the (query chunk, key chunk) pairs it
    occupies, and each block pair's rectangle of it as ``Blocks`` (a copy, whose index
    lists are built on first use and then kept). Holds no reference to the mask itself."""

    def __init__(self, blocks: torch.Tensor, layout: str, world: int, n: int):
        self.n = n
        self.occupied = occupied_chunks(blocks, layout, world, n, BLOCK)
        self._pairs: dict = {}

    def of(self, pair, blocks: torch.Tensor) -> Blocks:
        (q0, k0, _), lq, lk = pair.pos, len(range(self.n)[pair.q]), len(range(self.n)[pair.k])
        key = (q0, k0, lq, lk)
        if key not in self._pairs:
            self._pairs[key] = Blocks(blocks[:, q0 // BLOCK:(q0 + lq) // BLOCK,
                                             k0 // BLOCK:(k0 + lk) // BLOCK].clone())
        return self._pairs[key]


def _schedule(ring: Ring, layout: str, local_len: int, band: Band, dropout: tuple[float, int],
              blocks: Optional[torch.Tensor]):
    """(number of steps, the pairs of each step, whether step 0 writes its results, the
    block mask's plan or None). With dropout or a block mask, pairs keep their global
    positions (no merging across chunks)."""
    plan = None if blocks is None else tensor_memo(
        blocks, ("plan", layout, ring.world, local_len),
        lambda: _SparsePlan(blocks, layout, ring.world, local_len))
    occupied = None if plan is None else plan.occupied
    steps = active_steps(layout, ring.world, local_len, band, occupied) if ring.world > 1 else 1
    merge = dropout[0] == 0 and blocks is None
    pairs = [step_pairs(layout, ring.rank, (ring.rank - s) % ring.world, ring.world, local_len,
                        band, merge, occupied) for s in range(steps)]
    return steps, pairs, writes_first(pairs[0]), plan


def _own_ids(ids: torch.Tensor, part: slice) -> torch.Tensor:
    """The rank's own ids of a pair's rows, one tensor per slice while the ids stay
    unmodified: the own shard's pair then hands its kernels one tensor on both sides, and
    they compute its segment ranges once for the forward and both backward passes. (Not
    for the ring's buffers: a receive rewrites them without bumping their version.)"""
    return tensor_memo(ids, ("pair_ids", part.start, part.stop, part.step),
                       lambda: ids[:, part].clone(memory_format=torch.contiguous_format))


def _mask(pair, q_segments, k_segments, dropout: tuple[float, int], plan, blocks) -> PairMask:
    """The kernel's mask of one pair: its band, its rows' segment ids (q_segments: the
    rank's own; k_segments: the visiting shard's, the same tensor on the own step), dropout
    keyed by its positions, and its rectangle of the global block mask."""
    if q_segments is not None:
        own = k_segments is q_segments
        q_segments = _own_ids(q_segments, pair.q)
        k_segments = _own_ids(k_segments, pair.k) if own else k_segments[:, pair.k].contiguous()
    return PairMask(pair.band_lo, pair.band_hi, q_segments, k_segments, *dropout, pair.pos,
                    None if plan is None else plan.of(pair, blocks))


def ring_forward(q, k, v, segments, *, softmax_scale: float, band: Band, dropout: tuple[float, int],
                 layout: str, ring: Ring, blocks: Optional[torch.Tensor] = None):
    """Returns out (in q's dtype) and lse (fp32, (B, H, S)) of q against every rank's k, v.
    segments: this rank's (B, S) int32 segment ids, or None. dropout: (p, seed).
    blocks: the GLOBAL block mask (heads or 1, N / BLOCK, N / BLOCK) bool, or None."""
    b, n, h, d = q.shape
    steps, schedule, first_writes, plan = _schedule(ring, layout, n, band, dropout, blocks)
    out = torch.empty((b, n, h, d), device=q.device, dtype=torch.float32)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    if not first_writes:  # several pairs share the first step: every pair merges into these
        out.zero_()
        lse.fill_(-math.inf)
    cur, nxt = _kv_buffers(k, v, segments, ring, steps)
    for step, pairs in enumerate(schedule):
        pending = _pass_on(ring, cur, nxt) if step + 1 < steps else []
        # The own shard's step reads k, v and the ids themselves, not their ring copies.
        (kv, seg) = ((k, v), segments) if step == 0 else cur
        for pair in pairs:
            flash_attn_fwd(q[:, pair.q], kv[0][:, pair.k], kv[1][:, pair.k],
                           softmax_scale=softmax_scale, mask=_mask(pair, segments, seg, dropout, plan, blocks),
                           out=out[:, pair.q], lse=lse[:, :, pair.q],
                           accumulate=not (first_writes and step == 0))
        ring.wait(pending)
        cur, nxt = nxt, cur
    ring.finish()
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, dlse, segments, *, softmax_scale: float, band: Band,
                  dropout: tuple[float, int], layout: str, ring: Ring,
                  blocks: Optional[torch.Tensor] = None):
    """Returns dq (like q) and dk, dv of this rank's shards packed as one (2, *k.shape)
    tensor in k's dtype."""
    n = q.shape[1]
    steps, schedule, first_writes, plan = _schedule(ring, layout, n, band, dropout, blocks)
    delta = attn_delta(out, dout, dlse)
    dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    if not first_writes:
        dq.zero_()

    def add_grads(pair, kv, seg, write, dq=None, dkv=None):
        """One block pair's dQ pass (into dq) or dK/dV pass (into packed dkv)."""
        dk, dv = (None, None) if dkv is None else (dkv[0][:, pair.k], dkv[1][:, pair.k])
        flash_attn_bwd(dout[:, pair.q], q[:, pair.q], kv[0][:, pair.k], kv[1][:, pair.k],
                       lse[:, :, pair.q], delta[:, :, pair.q], None if dq is None else dq[:, pair.q],
                       dk, dv, softmax_scale=softmax_scale,
                       mask=_mask(pair, segments, seg, dropout, plan, blocks),
                       accumulate=not write)

    def dkv_pass(pairs, kv, seg, dkv):
        """A step's dK/dV passes into dkv, which starts there. A dK/dV pass writes every
        key row of its pair, so pairs over disjoint key rows write theirs and only the rows
        no pair covers are zeroed (-0.5 ms at 64k tokens a rank, 32 heads); overlapping
        pairs add into zeros."""
        spans = sorted((range(dkv.shape[2])[pair.k] for pair in pairs), key=lambda r: r.start)
        disjoint = all(a.stop <= b.start for a, b in zip(spans, spans[1:]))
        if disjoint:
            for lo, hi in zip([0] + [r.stop for r in spans], [r.start for r in spans] + [dkv.shape[2]]):
                for rows in dkv.flatten(0, 1)[:, lo:hi] if lo < hi else ():
                    rows.zero_()  # contiguous pieces: a strided zero_ runs 3x slower
        else:
            dkv.zero_()
        for pair in pairs:
            add_grads(pair, kv, seg, disjoint, dkv=dkv)

    own = ((k, v), segments)  # the ring's K/V buffers are overwritten by later shards
    cur, nxt = _kv_buffers(k, v, segments, ring, steps)
    # The own shard's dQ first: it needs nothing in flight, so it hides the first K/V trip.
    kv_pending = _pass_on(ring, cur, nxt) if steps > 1 else []
    for pair in schedule[0]:
        add_grads(pair, *own, first_writes, dq=dq)
    ring.wait(kv_pending)
    cur, nxt = nxt, cur
    # Packed (dk, dv) sums in fp32: `running` belongs to the shard this step computes and
    # arrives from r-1 during the step (the shard of step 1 starts its sum here); `sending`
    # belongs to the shard of the step before and leaves for r+1; `mine` is the own
    # shard's part (a ring that passes nothing on needs only that).
    if steps > 1:
        running, sending, mine = ring.buffer("grads", (3, 2, *k.shape), torch.float32, k.device)
    else:
        mine = torch.empty((2, *k.shape), device=k.device, dtype=torch.float32)
    for step in range(1, steps):
        pairs = schedule[step]
        (kv, seg) = cur
        # Two messages, the one needed first posted first: the running dK/dV (which the
        # dK/dV pass adds into) and the next K/V (needed by the next step only).
        grads_pending = [] if step == 1 else ring.exchange((sending, running))
        kv_pending = _pass_on(ring, cur, nxt) if step + 1 < steps else []
        # dQ needs nothing in flight, so it runs while the running dK/dV arrives; dK/dV
        # then add straight into it, only in the key rows this step touches.
        for pair in pairs:
            add_grads(pair, kv, seg, False, dq=dq)
        ring.wait(grads_pending)
        if step == 1:
            dkv_pass(pairs, kv, seg, running)
        else:
            for pair in pairs:
                add_grads(pair, kv, seg, False, dkv=running)
        ring.wait(kv_pending)
        cur, nxt = nxt, cur
        running, sending = sending, running
    # The own shard's dK/dV last, into a buffer of its own, while the last remote sum goes
    # home (steps - 1 ranks back; the next rank when the ring is whole) and this shard's sum
    # arrives: no trip after the last pass, and the own-shard step, often the largest
    # (local masks, packed documents), hides the one fp32 trip.
    home_pending = ring.exchange((sending, running), shift=1 - steps) if steps > 1 else []
    dkv_pass(schedule[0], *own, mine)
    ring.wait(home_pending)
    if steps == 1:
        dkv = mine.to(k.dtype)
    else:  # one pass: the fp32 sum rounded once, on the way out
        dkv = torch.add(mine, running, out=torch.empty_like(mine, dtype=k.dtype))
    ring.finish()
    return dq.to(q.dtype), dkv
