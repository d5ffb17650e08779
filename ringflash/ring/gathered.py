"""A ring of two over contiguous shards under a block mask that keeps the other rank's K/V
(``keeps_kv``): one forward launch over the whole sequence's keys while the other rank's
arrive (``gathered_forward``), and a backward that swaps queries instead of K/V and
gradients (``gathered_backward``)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import kernels
from ..exchange import Ring
from ..kernels import Arrival, Joined, PairMask, dispatch
from ..kernels.masks import Blocks
from ..layouts import Band, gathered_pair, layout_of
from .plan import pair_mask
from .rows import Aside, overlap, rows_of


def keeps_kv(layout: str, world: int, needs_grad: bool, block_mask: bool, fused: bool = False) -> bool:
    """Whether ``ring_forward`` keeps the other rank's K/V for the backward: a ring of two
    over the contiguous layout under a block mask, when a backward follows, unless the
    Gluon backward serves its block pairs (``fused``, from ``fuses``). Its backward then
    moves queries instead of K/V and gradients, and runs one dQ and one dK/dV launch
    over the whole sequence, as one GPU does (``gathered_backward``), instead of six
    launches over half of it: worth a (2, B, S, Hkv, D) tensor saved per call where the
    work shrinks with the mask's density and the fixed costs do not (docs/notes/ring-of-two.md,
    "The ring of two keeps its K/V (issue 14, 32k)"). Dense attention gains nothing from it at any length.
    Where the Gluon backward serves the pairs, the rotation's fused backward (each pair's
    dQ and dK/dV in one call; the gathered launches take the Triton kernels) measured
    1.10-1.30x faster at densities 0.1-1 on 2 x H200, 32k and 128k tokens, and 0.79-0.80x
    at 0.05 and 32k, calls of 5-7 ms whose times moved by up to 25% between runs
    (docs/performance.md, "Block-sparse"). The choice reads only what a compiled graph's
    fake sees (shapes, dtypes, the GPU), not the mask's density."""
    return needs_grad and block_mask and world == 2 and layout_of(layout).keeps_kv and not fused


def fuses(q: torch.Tensor, k: torch.Tensor, segments: Optional[torch.Tensor], blocks: Optional[torch.Tensor],
          dropout_p: float, deterministic: bool) -> bool:
    """Whether the Gluon backward serves the block pairs of a ring whose shards are q's rows
    (``dispatch.gluon_serves``, from what every rank agrees on, as ``rotate._fuses``)."""
    n = q.shape[1]
    mask = PairMask(q_segments=segments, k_segments=segments, dropout_p=dropout_p,
                    blocks=None if blocks is None else Blocks(blocks))
    return dispatch.gluon_serves(q, k, n, n, mask, deterministic)


def chunk_heads(kv_heads: int, head_dim: int, size: int) -> int:
    """The K/V heads a chunk of a streamed shard carries: the fewest whose rows are 1 KiB
    wide (the copy engines' 2-D copies of narrower rows were not measured), a divisor of
    kv_heads."""
    return next(c for c in range(1, kv_heads + 1)
                if kv_heads % c == 0 and (c * head_dim * size >= 1024 or c == kv_heads))


def gathered_forward(q, k, v, recv, *, softmax_scale: float, band: Band,
                     dropout: tuple, ring: Ring, plan, blocks):
    """``ring_forward`` of a ring of two over contiguous shards that keeps the other rank's
    K/V (``keeps_kv``), without segment ids, where the transport streams the shard in by
    chunks of heads (``Ring.streams_chunks``; or on the CPU, where nothing overlaps): one
    launch over the whole sequence's keys, the own and the arriving ones joined in global
    order (``Joined``), the own ones first in every query tile (``Arrival``). On the copy
    engines each tile waits inside the kernel for its head's chunk, so the launch starts
    while the shard travels; it waits at most RINGFLASH_PEER_TIMEOUT_S
    (``exchange.peer_timeout``): a tile that gives up writes NaN, and the next call
    raises, naming the peer. Cut in two (own keys, then the visiting ones merged through
    fp32), the forward paid one more launch's per-program work and the merge: 0.25-0.35 ms
    a call at 32k (docs/notes/ring-of-two.md). Returns out, lse and what the backward keeps."""
    b, n, h, d = q.shape
    own = ring.rank  # which part of the joined keys is this rank's
    k, v = k.contiguous(), v.contiguous()
    heads = chunk_heads(k.shape[2], k.shape[3], k.element_size())
    pending, flags = ring.arriving((k, v), recv, heads)
    if flags is None:
        ring.wait(pending)
    try:
        keys, values = ((Joined(mine, theirs) if own == 0 else Joined(theirs, mine))
                        for mine, theirs in ((k, recv[0]), (v, recv[1])))
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
        pair = gathered_pair(range(own * n, (own + 1) * n), n, band)
        if pair is None:  # the band leaves these rows no key
            out.zero_()
            lse.fill_(-math.inf)
        else:
            # the wait's end (``Ring.watch``): a tile gives up on a peer that never sends
            arrival = Arrival(1 - own, flags, 1, heads, *getattr(ring, "watch", ()))
            kernels.flash_attn_fwd(q, keys, values, softmax_scale=softmax_scale,
                                   mask=pair_mask(pair, None, None, dropout, plan, blocks), out=out, lse=lse,
                                   arrival=arrival)
    finally:  # also when the launch raised (say out of memory, caught and retried by the
        # caller): a flag left up would let the next call's tiles read a shard in flight
        if flags is not None:
            ring.wait(pending)  # the whole trip, before the kept copy reads it
            flags.zero_()  # down again for the next call (``Ring.arriving``)
    kept, aside = torch.empty((2, *k.shape), device=k.device, dtype=k.dtype), Aside(q.device)
    aside.copy(kept, recv)  # out of the ring's buffer, which the next call reuses
    aside.join()
    return out, lse, (kept, None)


def gathered_backward(dout, q, k, v, lse, delta, segments, kept, *, softmax_scale: float, band: Band,
                      dropout: tuple, ring: Ring, plan, blocks):
    """``ring_backward`` of a ring of two whose forward kept the other rank's K/V
    (``keeps_kv``): the whole sequence's keys are on this rank, its own and the kept ones
    read where they are, in global order (``Joined``). The ranks swap their queries
    instead (Q, dO, lse and delta) while one dQ launch runs over every key. Then the dK/dV
    launches run over every query, the own and the received ones joined the same way: one
    over this rank's keys, where the mask leaves the ranks even work; else the busier rank
    leaves the other some of its keys (``SparsePlan.key_cut``), whose finished dK/dV come
    home. One GPU runs the same launches over twice the programs: no pass is split by
    shard, no partial sum travels, each gradient is rounded once, and nothing is copied to
    join the shards."""
    b, n, h, d = q.shape
    here, there = (range(r * n, (r + 1) * n) for r in (ring.rank, 1 - ring.rank))  # global rows
    q, dout = q.contiguous(), dout.contiguous()
    q_in, dout_in = (ring.buffer(name, q.shape, q.dtype, q.device) for name in ("q", "dout"))
    stats = ring.buffer("stats", (2, b, h, n), torch.float32, q.device)
    mine = torch.stack([lse, delta])
    pending = ring.exchange((mine, stats), (q, q_in), (dout, dout_in))
    (remote, seg), pair = kept, gathered_pair(here, n, band)

    def joined(own: torch.Tensor, other: torch.Tensor) -> Joined:
        """The two ranks' rows of one tensor, in global order."""
        own, other = own.contiguous(), other.contiguous()
        return Joined(own, other) if ring.rank == 0 else Joined(other, own)

    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if pair is None:
        dq.zero_()
    else:
        kernels.flash_attn_bwd(dout, q, joined(k, remote[0]), joined(v, remote[1]), lse, delta, dq, None, None,
                               softmax_scale=softmax_scale,
                               mask=pair_mask(pair, segments, seg, dropout, plan, blocks))
    ring.wait(pending)
    every = torch.empty((2, b, h, 2 * n), device=q.device, dtype=torch.float32)  # lse, delta
    every[..., rows_of(here)], every[..., rows_of(there)] = mine, stats
    q_all, dout_all = joined(q, q_in), joined(dout, dout_in)

    def dkv_pass(rows: range, dest: torch.Tensor) -> None:
        """dK/dV of the key rows ``rows`` (global; on one rank) over every query, into
        packed ``dest``."""
        pair = gathered_pair(rows, n, band, keys=False)
        if pair is None:
            dest.zero_()
            return
        cols = rows_of(rows)
        own = rows.start >= here.start and rows.stop <= here.stop
        keys, values = (k, v) if own else remote
        part = rows_of(rows, (here if own else there).start)
        kernels.flash_attn_bwd(dout_all, q_all, keys[:, part], values[:, part], every[0], every[1], None,
                               dest[0], dest[1], softmax_scale=softmax_scale,
                               mask=pair_mask(pair, seg, None if seg is None else seg[:, cols], dropout, plan,
                                              blocks))

    cut = n if plan is None else plan.key_cut(band, blocks)
    keys = range(0, cut) if ring.rank == 0 else range(cut, 2 * n)
    theirs = range(0, cut) if ring.rank == 1 else range(cut, 2 * n)
    lent, moved = overlap(keys, there), overlap(theirs, here)
    dkv = torch.empty((2, *k.shape), device=k.device, dtype=k.dtype)
    if lent or moved:  # the other rank's keys computed here go home under this rank's own pass
        slot = ring.buffer("moved", (2, b, len(lent or moved), *k.shape[2:]), k.dtype, k.device)
        if lent:
            done = torch.empty(slot.shape, device=k.device, dtype=k.dtype)
            dkv_pass(lent, done)
            pending = ring.exchange((done, slot.view(-1)[:0], slot))
        else:
            pending = ring.exchange((slot.new_empty(0), slot))
    own = overlap(keys, here)
    if own:
        dkv_pass(own, dkv[:, :, rows_of(own, here.start)])
    if lent or moved:
        ring.wait(pending)
    if moved:
        dkv[:, :, rows_of(moved, here.start)].copy_(slot)
    return dq, dkv
