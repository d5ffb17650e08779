"""The ring schedule: forward and backward, for every layout and mask (ops.py makes them
custom ops).

World size W, rank r. At step s the rank holds the K/V shard that started on rank
src = (r - s) mod W. Before computing step s it posts the send of that shard to r+1
and the receive of the next one from r-1, then runs the layout's block pairs for
(r, src) through the local kernel. Merging is the kernel's own epilogue: it merges its
block's softmax state with the running (out, lse), kept in fp32 until the last step, whose
kernels read those sums and write out in q's dtype (dQ, and dK/dV when two steps run, the
same way in the backward). The own shard leaves from k and v themselves; later shards
arrive in one buffer (two active steps: a ring of two, or a wider ring whose window or
local block mask stops the shards after one hop) or two taking turns.

Masks are data on the way: the band on global positions (causal, sliding window) becomes
each pair's band of local indices, or stays on positions where the rows jump
(block_stripe; layouts.step_pairs), the visiting shard's segment
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
and the owner adds the two. When two steps run and the remote one is large (causal, packed
documents: not a window's sliver), the remote dK/dV pass runs first instead, its dQ pass
hides the trip home, and the own dK/dV pass adds the arrived sum as it writes; both dK/dV
passes run in two halves of key rows (``layouts.step_pieces``), so the first half's sum
travels while the second is computed. dQ never leaves the rank.

A ring of two over contiguous shards under a block mask (``keeps_kv``) keeps the other
rank's K/V from the forward, which with its own make the whole sequence's (read in place,
in global order: ``kernels.Joined``). Its backward swaps queries instead (Q, dO, lse,
delta) under a dQ pass over every key,
then runs one dK/dV pass over every query (``_gathered_backward``): two launches of the
shape one GPU runs, where the rotation above runs six of half the size, whose fixed costs
no longer hide at low density. Holding every key and query, the ranks can also divide
the dK/dV work where the mask makes it even (``_SparsePlan.key_cut``). Its forward is one
launch too where the copy engines carry the shard (``_gathered_forward``): the shard
arrives in chunks of heads, and each query tile waits inside the kernel for its head's.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch

from .exchange import Ring
from .kernels import Arrival, Joined, PairMask, attn_delta, flash_attn_bwd, flash_attn_fwd
from .kernels.masks import (BAND_INF, BLOCK, Blocks, block_work, computed_blocks, pair_positions,
                            tensor_memo)
from .layouts import (Band, active_steps, gathered_pair, occupied_chunks, remote_share, step_pairs,
                      step_pieces, writes_first)


def _kv_slots(k: torch.Tensor, segments: Optional[torch.Tensor], ring: Ring, steps: int) -> list:
    """The buffers visiting shards arrive in, (K/V packed as (2, *k.shape), segment ids or
    None) each: none for a ring that passes nothing, one when only the own shard travels
    (two steps), two taking turns when received shards are passed on."""
    if steps == 1:
        return []
    slots = 1 if steps == 2 else 2
    kv = ring.buffer("kv", (slots, 2, *k.shape), k.dtype, k.device)
    seg = None if segments is None else ring.buffer("segments", (slots, *segments.shape),
                                                     torch.int32, k.device)
    return [(kv[i], None if seg is None else seg[i]) for i in range(slots)]


def _pass_on(ring: Ring, cur, nxt) -> list:
    """Send this step's K/V (and segment ids) on, receive the next shard's into ``nxt``.
    The own shard leaves from k and v themselves (two messages), a received one from its
    slot (one)."""
    (kv, seg), (kv_next, seg_next) = cur, nxt
    if isinstance(kv, tuple):
        pairs = [(kv[0].contiguous(), kv_next[0]), (kv[1].contiguous(), kv_next[1])]
    else:
        pairs = [(kv, kv_next)]
    if seg is not None:
        pairs.append((seg, seg_next))
    return ring.exchange(*pairs)


class _SparsePlan:
    """A global block mask as the ring uses it: the (query chunk, key chunk) pairs it
    occupies, and each block pair's blocks of it as ``Blocks`` (a copy, whose index lists
    are built on first use and then kept). Holds no reference to the mask itself."""

    def __init__(self, blocks: torch.Tensor, layout: str, world: int, n: int):
        self.layout, self.world, self.n = layout, world, n
        self.occupied = occupied_chunks(blocks, layout, world, n, BLOCK)
        self._pairs: dict = {}
        self._decided: dict = {}  # per band: remote_share, and ("cut", band): key_cut

    def _rows(self, part: slice) -> int:  # slices past n: a gathered pair's keys (2 n rows)
        return len(range(self.n if part.stop is None else part.stop)[part])

    def _blocks(self, pair, blocks: torch.Tensor) -> torch.Tensor:
        """The pair's blocks of the mask: the global blocks its rows and columns hold (by
        their positions), with a band on positions folded in (block_stripe: causal between
        two shards leaves every block pair wholly visible or wholly hidden, so it is itself
        a block mask, and ``_mask`` drops it)."""
        a, c = torch.arange(self._rows(pair.q) // BLOCK), torch.arange(self._rows(pair.k) // BLOCK)
        rows, cols = (p // BLOCK for p in pair_positions(pair.pos, a * BLOCK, c * BLOCK))
        mine = blocks[:, rows.to(blocks.device)][:, :, cols.to(blocks.device)]
        if pair.on_positions:  # key block c of a query block: kp - qp spans diff +- (BLOCK - 1)
            diff = (cols[None, :] - rows[:, None]) * BLOCK
            lo = -BAND_INF if pair.band_lo is None else pair.band_lo
            hi = BAND_INF if pair.band_hi is None else pair.band_hi
            whole = (diff - BLOCK + 1 >= lo) & (diff + BLOCK - 1 <= hi)
            none = (diff + BLOCK - 1 < lo) | (diff - BLOCK + 1 > hi)
            assert bool((whole | none).all()), "a band that cuts blocks (api refuses windows here)"
            mine = mine & whole.to(mine.device)
        return mine

    def of(self, pair, blocks: torch.Tensor) -> Blocks:
        """The pair's ``Blocks`` (``_blocks``), made once and kept."""
        key = (pair.pos, self._rows(pair.q), self._rows(pair.k), pair.band_lo, pair.band_hi,
               pair.on_positions)
        if key not in self._pairs:
            self._pairs[key] = Blocks(self._blocks(pair, blocks))
        return self._pairs[key]

    def remote_share(self, band: Band, blocks: torch.Tensor) -> float:
        """``layouts.remote_share`` counted in the blocks the mask computes (every head; a
        block the band crosses counts whole): a mask can leave a remote step a sliver
        where the band alone would not (a local band over contiguous shards). Every rank
        computes every rank's counts from the global mask, so all take one decision (one
        host synchronization per mask and band)."""
        if band not in self._decided:
            def work(rank: int, step: int) -> torch.Tensor:
                total = torch.zeros((), dtype=torch.int64, device=blocks.device)
                for pair in step_pairs(self.layout, rank, (rank - step) % self.world, self.world,
                                       self.n, band, False, self.occupied):
                    lo, hi = (None, None) if pair.on_positions else (pair.band_lo, pair.band_hi)
                    total = total + computed_blocks(
                        self._blocks(pair, blocks), -BAND_INF if lo is None else lo,
                        BAND_INF if hi is None else hi, self._rows(pair.q), self._rows(pair.k))
                return total
            counts = torch.stack([torch.stack([work(r, 0), work(r, 1)]) for r in range(self.world)]).tolist()
            self._decided[band] = min(remote / max(own, 1) for own, remote in counts)
        return self._decided[band]

    def key_cut(self, band: Band, blocks: torch.Tensor) -> int:
        """A ring of two that kept the other rank's K/V (``_gathered_backward``): the global key row
        where its dK/dV launches divide the keys, rank 0 taking those below it. Chosen from
        the mask's blocks so that each rank's forward, dQ and dK/dV work, weighed by what a
        block costs each kernel, is as even as the cut allows (a multiple of BLOCK; n, the
        own keys, when the ranks' work is even): local + global gives rank 0 its global rows
        and the global keys. Every rank computes it from the global mask (one host
        synchronization per mask and band)."""
        key = ("cut", band)
        if key not in self._decided:
            lo, hi = (-BAND_INF if band[0] is None else band[0]), (BAND_INF if band[1] is None else band[1])
            rows, cols = (t.tolist() for t in block_work(blocks, lo, hi, 2 * self.n, 2 * self.n))
            half = self.n // BLOCK
            fixed = [_ROW_COST * sum(rows[:half]), _ROW_COST * sum(rows[half:])]
            below = [0]
            for work in cols:
                below.append(below[-1] + work)
            slower = [max(fixed[0] + _KEY_COST * k, fixed[1] + _KEY_COST * (below[-1] - k)) for k in below]
            cut = min(range(len(slower)), key=slower.__getitem__)
            # moving keys costs a launch and a trip: not for less than 2% of the slower rank's work
            self._decided[key] = (cut if slower[cut] < 0.98 * slower[half] else half) * BLOCK
        return self._decided[key]


# What one block costs the kernels, ms per 4096 programs (benchmarks/NOTES.md, "The ring of
# two at 32k on 2 x H200"): a query block's forward and dQ, a key block's dK/dV.
_ROW_COST, _KEY_COST = 0.061 + 0.084, 0.126


class _Schedule(NamedTuple):
    """What a call's ring runs: the number of active steps, each step's pairs, whether step
    0 writes its results (one pair over every row), the block mask's plan or None,
    ``pieces(step, cuts)``: the step's pairs cut along key rows (``layouts.step_pieces``),
    and, for two active steps, whether on EVERY rank the own step's pairs keep to disjoint
    key rows (a choice of schedule that depends on it must be the same on every rank: the
    ranks' messages pair up; False for other step counts)."""

    steps: int
    pairs: list
    first_writes: bool
    plan: Optional[_SparsePlan]
    pieces: Callable[[int, tuple[int, ...]], tuple]
    own_apart: bool


def _schedule(ring: Ring, layout: str, local_len: int, band: Band, dropout: tuple[float, int],
              blocks: Optional[torch.Tensor]) -> _Schedule:
    """The call's ``_Schedule``. With dropout or a block mask, pairs keep their global
    positions (no merging across chunks)."""
    plan = None if blocks is None else tensor_memo(
        blocks, ("plan", layout, ring.world, local_len),
        lambda: _SparsePlan(blocks, layout, ring.world, local_len))
    occupied = None if plan is None else plan.occupied
    steps = active_steps(layout, ring.world, local_len, band, occupied) if ring.world > 1 else 1
    merge = dropout[0] == 0 and blocks is None

    def of(rank: int, s: int) -> tuple:
        return (layout, rank, (rank - s) % ring.world, ring.world, local_len, band, merge, occupied)

    pairs = [step_pairs(*of(ring.rank, s)) for s in range(steps)]
    own_apart = steps == 2 and all(  # read by a ring of two only
        _uncovered([pair.k for pair in step_pairs(*of(rank, 0))], local_len) is not None
        for rank in range(ring.world))
    return _Schedule(steps, pairs, writes_first(pairs[0]), plan,
                     lambda s, cuts: step_pieces(*of(ring.rank, s), cuts), own_apart)


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
    lo, hi, on_positions = pair.band_lo, pair.band_hi, pair.on_positions
    pair_blocks = None if plan is None else plan.of(pair, blocks)
    if pair_blocks is not None and on_positions:  # a band of whole blocks, folded into them
        lo, hi, on_positions = None, None, False
    return PairMask(lo, hi, q_segments, k_segments, *dropout, pair.pos, pair_blocks, on_positions)


def _spans(slices, n: int) -> list[range]:
    """The rows of each slice of [0, n), in order of their first row."""
    return sorted((range(n)[part] for part in slices), key=lambda r: r.start)


def _uncovered(slices, n: int, within: Optional[range] = None) -> Optional[list[slice]]:
    """The rows of ``within`` (all n rows) that none of ``slices`` (rows inside it) covers,
    as slices; None if two overlap."""
    within = range(n) if within is None else within
    spans = _spans(slices, n)
    if any(a.stop > b.start for a, b in zip(spans, spans[1:])):
        return None
    bounds = zip([within.start] + [r.stop for r in spans], [r.start for r in spans] + [within.stop])
    return [slice(lo, hi) for lo, hi in bounds if lo < hi]


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, rows: slice, dim: int) -> None:
    """dst[rows] = src[rows] along ``dim`` (0 where src is None), in contiguous pieces: a
    strided copy or zero_ runs ~3x slower."""
    lead = dst.flatten(0, dim - 1) if dim > 1 else dst
    pieces = lead[:, rows] if dim > 1 else [lead[:, rows]]
    sources = [None] * len(pieces) if src is None else (
        src.flatten(0, dim - 1)[:, rows] if dim > 1 else [src[:, rows]])
    for piece, source in zip(pieces, sources):
        if source is None:
            piece.zero_()
        else:
            piece.copy_(source)


def _home_cuts(n: int) -> tuple[int, ...]:
    """Where a ring of two cuts its dK/dV passes and the trip home: at the multiple of BLOCK
    nearest half the rank's n rows (not below 2 BLOCK rows)."""
    half = round(n / 2 / BLOCK) * BLOCK
    return (half,) if BLOCK <= half <= n - BLOCK else ()


def _key_rows(send: torch.Tensor, recv: torch.Tensor, rows: range) -> list:
    """(send, recv) message pairs of key rows ``rows`` of two packed (2, B, n, H, D)
    buffers: one contiguous piece for each of dk, dv and each batch row."""
    return [(s[rows.start:rows.stop], r[rows.start:rows.stop])
            for s, r in zip(send.flatten(0, 1), recv.flatten(0, 1))]


def keeps_kv(layout: str, world: int, needs_grad: bool, block_mask: bool) -> bool:
    """Whether ``ring_forward`` keeps the other rank's K/V for the backward: a ring of two
    over the contiguous layout under a block mask, when a backward follows. Its backward
    then moves queries instead of K/V and gradients, and runs one dQ and one dK/dV launch
    over the whole sequence, as one GPU does (``_gathered_backward``), instead of six
    launches over half of it: worth a (2, B, S, Hkv, D) tensor saved per call where the
    work shrinks with the mask's density and the fixed costs do not (benchmarks/NOTES.md,
    "The ring of two keeps its K/V"). Dense attention gains nothing from it at any length."""
    return needs_grad and block_mask and world == 2 and layout == "contiguous"


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


class _Aside:
    """Copies that run beside the kernels, on a side stream of the device that starts once
    the work queued so far is done; ``join`` makes the current stream wait for them (and
    does nothing if none was made: under CUDA graph capture, waiting on a stream the
    capture never forked into is an error). On the CPU, at once."""

    def __init__(self, device: torch.device):
        self.device, self.stream = device, None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.device.type != "cuda":
            dst.copy_(src)
            return
        if self.stream is None:
            if self.device.index not in _SIDE_STREAMS:
                _SIDE_STREAMS[self.device.index] = torch.cuda.Stream(self.device, priority=-1)
            self.stream = _SIDE_STREAMS[self.device.index]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            dst.copy_(src)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)


def ring_forward(q, k, v, segments, *, softmax_scale: float, band: Band, dropout: tuple[float, int],
                 layout: str, ring: Ring, blocks: Optional[torch.Tensor] = None, keep: bool = False):
    """Returns out (in q's dtype), lse (fp32, (B, H, S)) of q against every rank's k, v, and
    what the backward keeps: None, or with ``keep`` (``keeps_kv``) and two active steps,
    (kv, segment ids): the other rank's K/V, (2, B, S, Hkv, D), and both ranks' (B, 2 S)
    int32 segment ids in global order, or None.
    segments: this rank's (B, S) int32 segment ids, or None. dropout: (p, seed).
    blocks: the GLOBAL block mask (heads or 1, N / BLOCK, N / BLOCK) bool, or None.

    The running out stays fp32 until the last step, whose pairs write the result in q's
    dtype straight from it where their query rows do not overlap (no separate cast of
    the rows they cover). The kept copy runs on a side stream, under the kernels."""
    b, n, h, d = q.shape
    steps, schedule, first_writes, plan, *_ = _schedule(ring, layout, n, band, dropout, blocks)
    slots = _kv_slots(k, segments, ring, steps)
    keep = keep and steps == 2
    if keep and segments is None and (ring.streams_chunks or not q.is_cuda):
        return _gathered_forward(q, k, v, slots[0][0], softmax_scale=softmax_scale, band=band,
                                 dropout=dropout, ring=ring, plan=plan, blocks=blocks)
    out = torch.empty((b, n, h, d), device=q.device, dtype=torch.float32)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    if not first_writes:  # several pairs share the first step: every pair merges into these
        out.zero_()
        lse.fill_(-math.inf)
    result = out if q.dtype == torch.float32 else torch.empty(q.shape, device=q.device, dtype=q.dtype)
    gaps = None if result is out else _uncovered([pair.q for pair in schedule[-1]], n)
    kept, aside = None, _Aside(q.device)
    if keep:
        kept = (torch.empty((2, *k.shape), device=k.device, dtype=k.dtype),
                None if segments is None else torch.empty((b, 2 * n), device=k.device, dtype=torch.int32))
        if segments is not None:
            kept[1][:, ring.rank * n:(ring.rank + 1) * n] = segments
    cur = ((k, v), segments)
    for step, pairs in enumerate(schedule):
        nxt = slots[step % len(slots)] if step + 1 < steps else None
        pending = _pass_on(ring, cur, nxt) if nxt is not None else []
        (kv, seg) = cur
        final = step == steps - 1 and gaps is not None
        merge = not (first_writes and step == 0)
        for pair in pairs:
            flash_attn_fwd(q[:, pair.q], kv[0][:, pair.k], kv[1][:, pair.k],
                           softmax_scale=softmax_scale, mask=_mask(pair, segments, seg, dropout, plan, blocks),
                           out=(result if final else out)[:, pair.q], lse=lse[:, :, pair.q],
                           accumulate=merge, out_partial=out[:, pair.q] if final and merge else None)
        ring.wait(pending)
        cur = nxt
        if kept is not None and step == 0:  # out of the ring's buffer, which the next call reuses
            aside.copy(kept[0], cur[0])
            if cur[1] is not None:
                aside.copy(kept[1][:, (1 - ring.rank) * n:(2 - ring.rank) * n], cur[1])
    if result is not out:
        for rows in [slice(None)] if gaps is None else gaps:
            _copy_rows(result, out, rows, 1)
    aside.join()
    return result, lse, kept


def _chunk_heads(kv_heads: int, head_dim: int, size: int) -> int:
    """The K/V heads a chunk of a streamed shard carries: the fewest whose rows are 1 KiB
    wide (the copy engines' 2-D copies of narrower rows were not measured), a divisor of
    kv_heads."""
    return next(c for c in range(1, kv_heads + 1)
                if kv_heads % c == 0 and (c * head_dim * size >= 1024 or c == kv_heads))


def _gathered_forward(q, k, v, recv, *, softmax_scale: float, band: Band,
                      dropout: tuple[float, int], ring: Ring, plan, blocks):
    """``ring_forward`` of a ring of two over contiguous shards that keeps the other rank's
    K/V (``keeps_kv``), without segment ids, where the transport streams the shard in by
    chunks of heads (``Ring.streams_chunks``; or on the CPU, where nothing overlaps): one
    launch over the whole sequence's keys, the own and the arriving ones joined in global
    order (``Joined``), the own ones first in every query tile (``Arrival``). On the copy
    engines each tile waits inside the kernel for its head's chunk, so the launch starts
    while the shard travels. Cut in two (own keys, then the visiting ones merged through
    fp32), the forward paid one more launch's per-program work and the merge: 0.25-0.35 ms
    a call at 32k (benchmarks/NOTES.md). Returns out, lse and what the backward keeps."""
    b, n, h, d = q.shape
    own = ring.rank  # which part of the joined keys is this rank's
    k, v = k.contiguous(), v.contiguous()
    heads = _chunk_heads(k.shape[2], k.shape[3], k.element_size())
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
            flash_attn_fwd(q, keys, values, softmax_scale=softmax_scale,
                           mask=_mask(pair, None, None, dropout, plan, blocks), out=out, lse=lse,
                           arrival=Arrival(1 - own, flags, 1, heads))
    finally:  # also when the launch raised (say out of memory, caught and retried by the
        # caller): a flag left up would let the next call's tiles read a shard in flight
        if flags is not None:
            ring.wait(pending)  # the whole trip, before the kept copy reads it
            flags.zero_()  # down again for the next call (``Ring.arriving``)
    kept, aside = torch.empty((2, *k.shape), device=k.device, dtype=k.dtype), _Aside(q.device)
    aside.copy(kept, recv)  # out of the ring's buffer, which the next call reuses
    aside.join()
    return out, lse, (kept, None)


def _gathered_backward(dout, q, k, v, lse, delta, segments, kept, *, softmax_scale: float, band: Band,
                       dropout: tuple[float, int], ring: Ring, plan, blocks):
    """``ring_backward`` of a ring of two whose forward kept the other rank's K/V
    (``keeps_kv``): the whole sequence's keys are on this rank, its own and the kept ones
    read where they are, in global order (``Joined``). The ranks swap their queries
    instead (Q, dO, lse and delta) while one dQ launch runs over every key. Then the dK/dV
    launches run over every query, the own and the received ones joined the same way: one
    over this rank's keys, where the mask leaves the ranks even work; else the busier rank
    leaves the other some of its keys (``_SparsePlan.key_cut``), whose finished dK/dV come
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
        flash_attn_bwd(dout, q, joined(k, remote[0]), joined(v, remote[1]), lse, delta, dq, None, None,
                       softmax_scale=softmax_scale, mask=_mask(pair, segments, seg, dropout, plan, blocks))
    ring.wait(pending)
    every = torch.empty((2, b, h, 2 * n), device=q.device, dtype=torch.float32)  # lse, delta
    every[..., _rows(here)], every[..., _rows(there)] = mine, stats
    q_all, dout_all = joined(q, q_in), joined(dout, dout_in)

    def dkv_pass(rows: range, dest: torch.Tensor) -> None:
        """dK/dV of the key rows ``rows`` (global; on one rank) over every query, into
        packed ``dest``."""
        pair = gathered_pair(rows, n, band, keys=False)
        if pair is None:
            dest.zero_()
            return
        cols = _rows(rows)
        own = rows.start >= here.start and rows.stop <= here.stop
        keys, values = (k, v) if own else remote
        part = _rows(rows, (here if own else there).start)
        flash_attn_bwd(dout_all, q_all, keys[:, part], values[:, part], every[0], every[1], None,
                       dest[0], dest[1], softmax_scale=softmax_scale,
                       mask=_mask(pair, seg, None if seg is None else seg[:, cols], dropout, plan, blocks))

    cut = n if plan is None else plan.key_cut(band, blocks)
    keys = range(0, cut) if ring.rank == 0 else range(cut, 2 * n)
    theirs = range(0, cut) if ring.rank == 1 else range(cut, 2 * n)
    lent, moved = _overlap(keys, there), _overlap(theirs, here)
    dkv = torch.empty((2, *k.shape), device=k.device, dtype=k.dtype)
    if lent or moved:  # the other rank's keys computed here go home under this rank's own pass
        slot = ring.buffer("moved", (2, b, len(lent or moved), *k.shape[2:]), k.dtype, k.device)
        if lent:
            done = torch.empty(slot.shape, device=k.device, dtype=k.dtype)
            dkv_pass(lent, done)
            pending = ring.exchange((done, slot.view(-1)[:0], slot))
        else:
            pending = ring.exchange((slot.new_empty(0), slot))
    own = _overlap(keys, here)
    if own:
        dkv_pass(own, dkv[:, :, _rows(own, here.start)])
    if lent or moved:
        ring.wait(pending)
    if moved:
        dkv[:, :, _rows(moved, here.start)].copy_(slot)
    return dq, dkv


def _rows(rows: range, start: int = 0) -> slice:
    """``rows`` as a slice of a tensor whose first row is ``start``."""
    return slice(rows.start - start, rows.stop - start)


def _overlap(a: range, b: range) -> range:
    """The rows two ranges share (an empty range if none)."""
    return range(max(a.start, b.start), max(min(a.stop, b.stop), max(a.start, b.start)))


def ring_backward(dout, q, k, v, out, lse, dlse, segments, *, softmax_scale: float, band: Band,
                  dropout: tuple[float, int], layout: str, ring: Ring,
                  blocks: Optional[torch.Tensor] = None, kept=None):
    """Returns dq (like q) and dk, dv of this rank's shards packed as one (2, *k.shape)
    tensor in k's dtype. kept: what ``ring_forward`` kept, or None."""
    n = q.shape[1]
    steps, schedule, first_writes, plan, pieces, own_apart = _schedule(ring, layout, n, band, dropout,
                                                                       blocks)
    delta = attn_delta(out, dout, dlse)
    if kept is not None and steps == 2:
        return _gathered_backward(dout, q, k, v, lse, delta, segments, kept, softmax_scale=softmax_scale,
                                  band=band, dropout=dropout, ring=ring, plan=plan, blocks=blocks)
    dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    if not first_writes:
        dq.zero_()
    dq_out = dq if q.dtype == torch.float32 else torch.empty(q.shape, device=q.device, dtype=q.dtype)

    def add_grads(pair, kv, seg, write, dq=None, dkv=None, partial=None):
        """One block pair's dQ pass (into dq) or dK/dV pass (into packed dkv), adding to
        ``partial`` (fp32 sums laid out like the destination) instead of the destination."""
        dk, dv = (None, None) if dkv is None else (dkv[0][:, pair.k], dkv[1][:, pair.k])
        if partial is None:
            partials = {}
        elif dq is not None:
            partials = dict(dq_partial=partial[:, pair.q])
        else:
            partials = dict(dk_partial=partial[0][:, pair.k], dv_partial=partial[1][:, pair.k])
        flash_attn_bwd(dout[:, pair.q], q[:, pair.q], kv[0][:, pair.k], kv[1][:, pair.k],
                       lse[:, :, pair.q], delta[:, :, pair.q], None if dq is None else dq[:, pair.q],
                       dk, dv, softmax_scale=softmax_scale,
                       mask=_mask(pair, segments, seg, dropout, plan, blocks),
                       accumulate=not write, **partials)

    def dq_pass(pairs, kv, seg, write, last):
        """A step's dQ passes into the fp32 dq. The last step's pairs write dq in q's dtype
        (dq_out) straight from those sums where their query rows do not overlap."""
        gaps = _uncovered([pair.q for pair in pairs], n) if last and dq_out is not dq else None
        for pair in pairs:
            if gaps is None:
                add_grads(pair, kv, seg, write, dq=dq)
            else:
                add_grads(pair, kv, seg, write, dq=dq_out, partial=None if write else dq)
        if last and dq_out is not dq:
            for rows in [slice(None)] if gaps is None else gaps:
                _copy_rows(dq_out, dq, rows, 1)

    def dkv_pass(pairs, kv, seg, dest, base=None, keys: Optional[range] = None):
        """A step's dK/dV passes into packed ``dest``, for the key rows ``keys`` (None: all n;
        the pairs' keys lie inside them). The sums start there (base None) or at ``base``, fp32 sums
        laid out like dest (then the pairs' key rows must not overlap). A dK/dV pass writes
        every key row of its pair, so pairs over disjoint key rows write theirs and only
        the rows no pair covers are zeroed or copied from base (-0.5 ms at 64k tokens a
        rank, 32 heads); overlapping pairs add into zeros."""
        gaps = _uncovered([pair.k for pair in pairs], n, keys)
        if gaps is None and keys is None:
            dest.zero_()
        elif gaps is None:
            _copy_rows(dest, None, slice(keys.start, keys.stop), 2)
        for rows in gaps or ():
            _copy_rows(dest, base, rows, 2)
        for pair in pairs:
            add_grads(pair, kv, seg, gaps is not None and base is None, dkv=dest, partial=base)

    own = ((k, v), segments)
    slots = _kv_slots(k, segments, ring, steps)
    # The own shard's dQ first: it needs nothing in flight, so it hides the first K/V trip.
    kv_pending = _pass_on(ring, own, slots[0]) if steps > 1 else []
    dq_pass(schedule[0], *own, first_writes, steps == 1)
    ring.wait(kv_pending)
    cur = slots[0] if steps > 1 else None
    if steps == 1:  # pairs adding into one key row add in fp32, then round once
        overlap = _uncovered([pair.k for pair in schedule[0]], n) is None
        sums = torch.empty((2, *k.shape), device=k.device, dtype=torch.float32 if overlap else k.dtype)
        dkv_pass(schedule[0], *own, sums)
        return dq_out, sums.to(k.dtype)
    dkv = torch.empty((2, *k.shape), device=k.device, dtype=k.dtype)
    # Two active steps (a ring of two): the one remote sum starts at the last step, so that
    # step can run its dK/dV pass first, its dQ pass hiding the trip home, and the own dK/dV
    # pass add the arrived sum as it writes the gradients in k's dtype (no final add, no
    # buffer for the own part). Taken where no rank's own pairs overlap in key rows and
    # every rank's remote step is at least half its own step (a sliding window's sliver
    # of a remote step would not hide the trip; the own dK/dV pass below does). Both dK/dV
    # passes run in two pieces of key rows (``_home_cuts``): the first piece's sums go home
    # while the second's are computed, and the own pass adds the first before the second
    # has arrived, so only the dQ pass need cover the last half of the trip.
    if steps == 2 and own_apart and (
            remote_share(layout, ring.world, n, band) if plan is None
            else plan.remote_share(band, blocks)) >= 0.5:
        (kv, seg), cuts = cur, _home_cuts(n)
        running, arrived = ring.buffer("grads", (2, 2, *k.shape), torch.float32, k.device)
        bounds = (0, *cuts, n)
        keys = [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        home = []
        for rows, pairs in zip(keys, pieces(1, cuts)):
            dkv_pass(pairs, kv, seg, running, keys=rows)
            home.append(ring.exchange(*_key_rows(running, arrived, rows), shift=-1))
        dq_pass(schedule[1], kv, seg, False, True)
        for rows, pairs, pending in zip(keys, pieces(0, cuts), home):
            ring.wait(pending)
            dkv_pass(pairs, *own, dkv, base=arrived, keys=rows)
        return dq_out, dkv
    # Packed (dk, dv) sums in fp32: `running` belongs to the shard this step computes and
    # arrives from r-1 during the step (the shard of step 1 starts its sum here); `sending`
    # belongs to the shard of the step before and leaves for r+1; `mine` is the own
    # shard's part.
    running, sending, mine = ring.buffer("grads", (3, 2, *k.shape), torch.float32, k.device)
    for step in range(1, steps):
        pairs = schedule[step]
        (kv, seg) = cur
        # Two messages, the one needed first posted first: the running dK/dV (which the
        # dK/dV pass adds into) and the next K/V (needed by the next step only).
        grads_pending = [] if step == 1 else ring.exchange((sending, running))
        nxt = slots[step % 2] if step + 1 < steps else None
        kv_pending = _pass_on(ring, cur, nxt) if nxt is not None else []
        # dQ needs nothing in flight, so it runs while the running dK/dV arrives; dK/dV
        # then add straight into it, only in the key rows this step touches.
        dq_pass(pairs, kv, seg, False, step == steps - 1)
        ring.wait(grads_pending)
        if step == 1:
            dkv_pass(pairs, kv, seg, running)
        else:
            for pair in pairs:
                add_grads(pair, kv, seg, False, dkv=running)
        ring.wait(kv_pending)
        cur = nxt
        running, sending = sending, running
    # The own shard's dK/dV last, into a buffer of its own, while the last remote sum goes
    # home (steps - 1 ranks back; the next rank when the ring is whole) and this shard's sum
    # arrives: no trip after the last pass, and the own-shard step, often the largest
    # (local masks, packed documents), hides the one fp32 trip.
    home_pending = ring.exchange((sending, running), shift=1 - steps)
    dkv_pass(schedule[0], *own, mine)
    ring.wait(home_pending)
    torch.add(mine, running, out=dkv)  # one pass: the fp32 sum rounded once, on the way out
    return dq_out, dkv
