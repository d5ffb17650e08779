"""The rotation: K/V shards travel around the ring while every rank computes its step's
block pairs; the backward sends the dK/dV sums after them (the package docstring has the
schedule)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import kernels
from ..exchange import Ring
from ..kernels import attn_delta, dispatch
from ..kernels.masks import BLOCK
from ..layouts import Band, remote_share
from .gathered import gathered_backward, gathered_forward
from .plan import pair_mask, schedule_of, tile_pieces
from .rows import Aside, add_rows, copy_rows, home_cuts, key_rows, overlap, sum_rows, uncovered
from .slots import Slots, pass_on


def ring_forward(q, k, v, segments, *, softmax_scale: float, band: Band, dropout: tuple,
                 layout: str, ring: Ring, blocks: Optional[torch.Tensor] = None, keep: bool = False,
                 keep_received: bool = False):
    """Returns out (in q's dtype), lse (fp32, (B, H, S)) of q against every rank's k, v, and
    what the backward keeps: None; with ``keep`` (``keeps_kv``) and two active steps,
    (kv, segment ids): the other rank's K/V, (2, B, S, Hkv, D), and both ranks' (B, 2 S)
    int32 segment ids in global order, or None; with ``keep_received``, under the direct
    schedule where shards travel cut, every row its slots received (this rank's
    ``Slots.held``), (2 B Hkv D rows,) and (B rows,) int32 or None, flat (the backward then
    receives no K/V).
    segments: this rank's (B, S) int32 segment ids, or None. dropout: (p, seed[, global head 0]).
    blocks: the GLOBAL block mask (heads or 1, N / BLOCK, N / BLOCK) bool, or None.

    The running out stays fp32 until the last step, whose pairs write the result in q's
    dtype straight from it where their query rows do not overlap (no separate cast of
    the rows they cover). The kept copies run on a side stream, under the kernels."""
    b, n, h, d = q.shape
    sched = schedule_of(ring, layout, n, band, dropout, blocks)
    steps, schedule, first_writes, plan = sched.steps, sched.pairs, sched.first_writes, sched.plan
    slots = Slots(k, segments, ring, steps, sched.sent, sched.direct, routes=sched.routes)
    keep = keep and steps == 2
    if keep and segments is None and (ring.streams_chunks or not q.is_cuda):
        return gathered_forward(q, k, v, slots.at(1)[0], softmax_scale=softmax_scale, band=band,
                                dropout=dropout, ring=ring, plan=plan, blocks=blocks)
    held = slots.held(ring.rank) if keep_received and sched.direct and sched.sent is not None else 0
    received = None if not held else (
        torch.empty(slots.row * held, device=k.device, dtype=k.dtype),
        None if segments is None else torch.empty(b * held, device=k.device, dtype=torch.int32))
    out = torch.empty((b, n, h, d), device=q.device, dtype=torch.float32)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    if not first_writes:  # several pairs share the first step: every pair merges into these
        out.zero_()
        lse.fill_(-math.inf)
    result = out if q.dtype == torch.float32 else torch.empty(q.shape, device=q.device, dtype=q.dtype)
    gaps = None if result is out else uncovered([pair.q for pair in schedule[-1]], n)
    kept, aside = None, Aside(q.device)
    if keep:
        kept = (torch.empty((2, *k.shape), device=k.device, dtype=k.dtype),
                None if segments is None else torch.empty((b, 2 * n), device=k.device, dtype=torch.int32))
        if segments is not None:
            kept[1][:, ring.rank * n:(ring.rank + 1) * n] = segments
    cur = ((k, v), segments)
    # Where the Gluon forward runs (whole tiles of 128 rows only), a pair that is not whole
    # tiles runs as its whole tiles and the rest (``tile_pieces``), as the fused backward's.
    cut = plan is None and dispatch.capability(q) == (9, 0)
    trips = slots.send_all(k, v, segments) if sched.direct else None  # one a step, all posted now
    for step, pairs in enumerate(schedule):
        nxt = slots.at(step + 1) if step + 1 < steps else None
        pending = ([] if nxt is None else trips[step] if trips else slots.send_own(k, v, segments) if step == 0
                   else pass_on(ring, cur, nxt))
        (kv, seg) = cur
        final = step == steps - 1 and gaps is not None
        merge = not (first_writes and step == 0)
        for pair in pairs:
            pieces = tile_pieces(pair, n) if cut else (pair,)
            for i, piece in enumerate(pieces):
                # Pieces of one query rows follow each other: the first takes the pair's mode,
                # the others merge into the fp32 out, and the last writes where the pair would.
                first = i == 0 or pieces[i - 1].q != piece.q
                last = i + 1 == len(pieces) or pieces[i + 1].q != piece.q
                merges, writes = merge or not first, final and last
                kernels.flash_attn_fwd(q[:, piece.q], kv[0][:, piece.k], kv[1][:, piece.k],
                                       softmax_scale=softmax_scale,
                                       mask=pair_mask(piece, segments, seg, dropout, plan, blocks),
                                       out=(result if writes else out)[:, piece.q], lse=lse[:, :, piece.q],
                                       accumulate=merges, out_partial=out[:, piece.q] if writes and merges else None)
        ring.wait(pending)
        cur = nxt
        if received is not None and nxt is not None:
            slots.keep(aside, received, step + 1)
        if kept is not None and step == 0:  # out of the ring's buffer, which the next call reuses
            aside.copy(kept[0], cur[0])
            if cur[1] is not None:
                aside.copy(kept[1][:, (1 - ring.rank) * n:(2 - ring.rank) * n], cur[1])
    if result is not out:
        for rows in [slice(None)] if gaps is None else gaps:
            copy_rows(result, out, rows, 1)
    aside.join()
    return result, lse, kept if received is None else received


class _Grads:
    """A backward's block-pair passes and the fp32 dQ sums they add into (``dq``; the last
    step's pairs write ``dq_out``, in q's dtype, straight from them, or with ``fused``
    ``result`` casts the sums once every pass has added into them).

    ``fused``: each pair runs as one call computing dQ and dK/dV together (``fused_pass``),
    where the Gluon backward serves the ring's masks (``_fuses``); else a step runs a dQ
    pass and a dK/dV pass apart (the Triton kernels: two kernels a pair either way)."""

    def __init__(self, dout, q, lse, delta, segments, *, softmax_scale: float, dropout, plan, blocks,
                 first_writes: bool, deterministic: bool = False, fused: bool = False, dq_out=None):
        self.dout, self.q, self.lse, self.delta, self.segments = dout, q, lse, delta, segments
        self.softmax_scale, self.dropout, self.plan, self.blocks = softmax_scale, dropout, plan, blocks
        self.deterministic, self.fused = deterministic, fused
        self.n = q.shape[1]
        self.dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        if fused or not first_writes:
            self.dq.zero_()
        # A given dq_out (a view, say a chunk's heads) only where the passes never write it
        # with the fp32 sums as their partials, which must share its strides: fused.
        if dq_out is None or not fused:
            dq_out = self.dq if q.dtype == torch.float32 else torch.empty(q.shape, device=q.device, dtype=q.dtype)
        self.dq_out = dq_out

    def pair(self, pair, kv, seg, write: bool, dq=None, dkv=None, partial=None, write_dkv: bool = False) -> None:
        """One block pair's dQ pass (into dq) or dK/dV pass (into packed dkv), adding to
        ``partial`` (fp32 sums laid out like the destination) instead of the destination;
        ``write_dkv``: dQ added, dK/dV written (``kernels.flash_attn_bwd``'s accumulate_dkv)."""
        dk, dv = (None, None) if dkv is None else (dkv[0][:, pair.k], dkv[1][:, pair.k])
        if partial is None:
            partials = {}
        elif dq is not None:
            partials = dict(dq_partial=partial[:, pair.q])
        else:
            partials = dict(dk_partial=partial[0][:, pair.k], dv_partial=partial[1][:, pair.k])
        kernels.flash_attn_bwd(self.dout[:, pair.q], self.q[:, pair.q], kv[0][:, pair.k], kv[1][:, pair.k],
                               self.lse[:, :, pair.q], self.delta[:, :, pair.q],
                               None if dq is None else dq[:, pair.q], dk, dv, softmax_scale=self.softmax_scale,
                               mask=pair_mask(pair, self.segments, seg, self.dropout, self.plan, self.blocks),
                               accumulate=not write, deterministic=self.deterministic,
                               accumulate_dkv=False if write_dkv else None, **partials)

    def fused_pass(self, pairs, kv, seg, dest, keys: Optional[range] = None) -> None:
        """A step's pairs, one call each: dQ added into the fp32 dq, dK/dV into the packed
        sums ``dest`` (2, B, rows, Hkv, D). ``keys`` None: added to dest (fp32 sums). A
        range: dest's key rows ``keys`` (the pairs' keys lie inside) start here: where the
        pairs keep to disjoint key rows and each runs as one call, each writes its key rows
        (dest may then be in k's dtype: final gradients) and only the rows no pair covers
        are zeroed; else all of them are zeroed and added into. A pair whose rows are not
        whole tiles runs as its whole tiles (the Gluon kernel) and the rest
        (``tile_pieces``), without a block mask, whose blocks are the pair's."""
        gaps = None if keys is None else self._unwritten(pairs, keys, dest.shape[2])
        if keys is not None:
            for rows in [slice(keys.start, keys.stop)] if gaps is None else gaps:
                copy_rows(dest, None, rows, 2)
        for pair in pairs:
            for piece in self._runs(pair):
                self.pair(piece, kv, seg, False, dq=self.dq, dkv=dest, write_dkv=gaps is not None)

    def _runs(self, pair) -> tuple:
        return (pair,) if self.plan is not None else tile_pieces(pair, self.n)

    def _unwritten(self, pairs, keys: range, rows: int) -> Optional[list[slice]]:
        """Where ``fused_pass`` writes the dK/dV of ``pairs`` over the key rows ``keys`` (of
        ``rows``): the rows of keys no pair covers; None where it adds them into zeroed sums
        instead (pairs over the same key rows, or cut into tiles and the rest)."""
        if any(len(self._runs(pair)) > 1 for pair in pairs):
            return None
        return uncovered([pair.k for pair in pairs], rows, keys)

    def writes(self, pairs, keys: range) -> bool:
        """Whether ``fused_pass`` writes the dK/dV of ``pairs`` over the own shard's key rows
        ``keys`` (so that they may go straight into the gradients, in k's dtype)."""
        return self._unwritten(pairs, keys, self.n) is not None

    def result(self) -> torch.Tensor:
        """dq in q's dtype, once every pass has run (a fused backward casts its sums here)."""
        if self.fused and self.dq_out is not self.dq:
            self.dq_out.copy_(self.dq)
        return self.dq_out

    def dq_pass(self, pairs, kv, seg, write: bool, last: bool) -> None:
        """A step's dQ passes into the fp32 dq. The last step's pairs write dq in q's dtype
        (dq_out) straight from those sums where their query rows do not overlap."""
        dq, dq_out = self.dq, self.dq_out
        gaps = uncovered([pair.q for pair in pairs], self.n) if last and dq_out is not dq else None
        for pair in pairs:
            if gaps is None:
                self.pair(pair, kv, seg, write, dq=dq)
            else:
                self.pair(pair, kv, seg, write, dq=dq_out, partial=None if write else dq)
        if last and dq_out is not dq:
            for rows in [slice(None)] if gaps is None else gaps:
                copy_rows(dq_out, dq, rows, 1)

    def dkv_pass(self, pairs, kv, seg, dest, base=None, keys: Optional[range] = None) -> None:
        """A step's dK/dV passes into packed ``dest``, for the key rows ``keys`` (None: all of
        dest's rows; the pairs' keys lie inside them). The sums start there (base None) or at ``base``,
        fp32 sums laid out like dest (then the pairs' key rows must not overlap). A dK/dV
        pass writes every key row of its pair, so pairs over disjoint key rows write theirs
        and only the rows no pair covers are zeroed or copied from base (-0.5 ms at 64k
        tokens a rank, 32 heads); overlapping pairs add into zeros."""
        gaps = uncovered([pair.k for pair in pairs], dest.shape[2], keys)
        if gaps is None and keys is None:
            dest.zero_()
        elif gaps is None:
            copy_rows(dest, None, slice(keys.start, keys.stop), 2)
        for rows in gaps or ():
            copy_rows(dest, base, rows, 2)
        for pair in pairs:
            self.pair(pair, kv, seg, gaps is not None and base is None, dkv=dest, partial=base)


def ring_backward(dout, q, k, v, out, lse, dlse, segments, *, softmax_scale: float, band: Band,
                  dropout: tuple, layout: str, ring: Ring,
                  blocks: Optional[torch.Tensor] = None, kept=None, deterministic: bool = False,
                  into: Optional[tuple] = None):
    """Returns dq (like q) and dk, dv of this rank's shards packed as one (2, *k.shape)
    tensor in k's dtype. kept: what ``ring_forward`` kept, or None. deterministic: the
    same bits run to run (``kernels.flash_attn_bwd``: the Gluon kernel's dQ adds in a fixed
    order). into: None, or (dq, dkv) of those shapes and dtypes, any strides with the last
    dimension contiguous (a chunk's heads of larger tensors), written where the schedule
    writes its results from fp32 sums or without partial sums, so that no copy follows;
    what is returned is then those tensors, or, where not, new ones (the caller copies)."""
    n = q.shape[1]
    sched = schedule_of(ring, layout, n, band, dropout, blocks)
    steps, schedule, first_writes, plan, pieces, own_apart, sent, direct, routes = sched
    delta = attn_delta(out, dout, dlse)
    if kept is not None and steps == 2:
        return gathered_backward(dout, q, k, v, lse, delta, segments, kept, softmax_scale=softmax_scale,
                                 band=band, dropout=dropout, ring=ring, plan=plan, blocks=blocks)
    # What the forward received, kept (``keep_received``): the direct schedule's K/V need not come again.
    received = kept if kept is not None and direct else None
    slots = Slots(k, segments, ring, steps, sent, direct, kept=received, routes=routes)
    # With the fused kernel the own step runs in pieces of key rows: the first half's hide
    # the first K/V trip, the second half's the trip home of the last sums (``_rotate``).
    own_first, own_last = _own_pieces(pieces, n, range(n)[slots.rows(ring.rank)]) if steps > 1 else (
        [(range(n), schedule[0])], [])
    fused = _fuses(q, k, (*(pairs for _, pairs in own_first + own_last), *schedule[1:]), segments, dropout, plan,
                   blocks, deterministic)
    # With the K/V kept nothing is in flight to hide at the start: the remote steps run at
    # once and the own step's passes all run last, under the partial sums' trips home.
    late = received is not None
    dq_into, dkv_into = (None, None) if into is None else into
    grads = _Grads(dout, q, lse, delta, segments, softmax_scale=softmax_scale, dropout=dropout, plan=plan,
                   blocks=blocks, first_writes=first_writes and not late, deterministic=deterministic, fused=fused,
                   dq_out=dq_into)
    own = ((k, v), segments)
    if steps == 1:
        dkv = _one_step(grads, k, own, schedule[0], first_writes, dkv_into)
        return grads.result(), dkv
    # Two active steps (a ring of two) take ``_home_first`` where no rank's own pairs overlap
    # in key rows and every rank's remote step is at least half its own step (a sliding
    # window's sliver of a remote step would not hide the trip; the own dK/dV pass of
    # ``_rotate`` does), and whole shards travel; not with the fused kernel, which adds
    # each pair's dK/dV into fp32 sums as ``_rotate`` keeps them.
    home_first = not fused and steps == 2 and own_apart and sent is None and (
        remote_share(layout, ring.world, n, band) if plan is None else plan.remote_share(band, blocks)) >= 0.5
    # The own shard's dQ first (fused: its first pieces): it needs nothing in flight, so it
    # hides the first K/V trip (the direct schedule's trips all start here; none if kept).
    trips = ([[]] * slots.count if received is not None else slots.send_all(k, v, segments) if direct
             else [slots.send_own(k, v, segments)])
    if home_first:
        grads.dq_pass(schedule[0], *own, first_writes, False)
        ring.wait(trips[0])
        return grads.result(), _home_first(grads, ring, k, own, slots.at(1), schedule, pieces)
    # fp32 sums (2 * k.numel() each): the rotation's running and sent sums take turns in
    # the first two, the direct schedule's partial sums come home into one a step; the
    # last is the own shard's (``_OwnSums.mine``).
    sums = ring.buffer("grads", (steps if direct else 3, 2 * k.numel()), torch.float32, k.device)
    own_sums = _OwnSums(sums[-1].view(2, *k.shape), torch.empty((2, *k.shape), device=k.device, dtype=k.dtype)
                        if dkv_into is None else dkv_into, slots.rows(ring.rank))
    if late:
        own_last = own_first + own_last
    elif fused:  # the own shard's dK/dV start here
        for rows, pairs in own_first:
            grads.fused_pass(pairs, *own, own_sums.into(rows, grads.writes(pairs, rows)), keys=rows)
    else:
        grads.dq_pass(schedule[0], *own, first_writes, False)
    ring.wait(trips[0])
    if direct:
        home, pending = _direct(grads, ring, k, slots, schedule, steps, sums, trips, last_dq=not late)
    else:
        home, pending = _rotate(grads, ring, k, slots, schedule, steps, sums)
    # The own shard's dK/dV last, while the last sums go home: no trip after the last pass,
    # and the own step, often the largest (local masks, packed documents), hides them.
    if fused:
        for rows, pairs in own_last:
            grads.fused_pass(pairs, *own, own_sums.into(rows, grads.writes(pairs, rows)), keys=rows)
    else:
        if late:
            grads.dq_pass(schedule[0], *own, False, True)
        own_sums.into(range(n))
        grads.dkv_pass(schedule[0], *own, own_sums.mine)
    ring.wait(pending)
    return grads.result(), own_sums.finish(home)  # the rows that stayed are the own pass's alone


class _OwnSums:
    """Where the fused backward puts the own shard's dK/dV: the key rows that travel
    (``travelling``, a slice) into fp32 sums (``mine``), which the sum coming home joins
    at the end; the others straight into the gradients (``dkv``, k's dtype), final at once
    (no fp32 sums to zero, round and copy). A piece of key rows is one or the other
    (``_own_pieces`` cuts them so), or, cut elsewhere, goes to ``mine`` and ``finish``
    rounds its rows that do not travel."""

    def __init__(self, mine: torch.Tensor, dkv: torch.Tensor, travelling: slice):
        self.mine, self.dkv = mine, dkv
        self.travelling = range(mine.shape[2])[travelling]
        self.rounded: list[range] = []  # rows in mine that do not travel

    def into(self, rows: range, writes: bool = False) -> torch.Tensor:
        """Where the own dK/dV of key rows ``rows`` go; ``writes``: the pass writes them
        (``_Grads.writes``), else it adds them into fp32 sums."""
        if writes and not overlap(rows, self.travelling):
            return self.dkv
        self.rounded += [part for part in (range(rows.start, min(rows.stop, self.travelling.start)),
                                           range(max(rows.start, self.travelling.stop), rows.stop)) if part]
        return self.mine

    def finish(self, home) -> torch.Tensor:
        """The gradients: the travelling rows' sum with ``home`` (their sum from the other
        ranks, (2, B, rows, Hkv, D) fp32; or a list of (rows, partial sum over those rows of
        the shard), added into ``mine`` in order), each rounded once."""
        if isinstance(home, list):  # the direct schedule's partial sums
            for rows, part in home:
                self.mine[:, :, rows.start:rows.stop].add_(part)
            self.rounded.append(self.travelling)
            home = None
        for rows in self.rounded:
            copy_rows(self.dkv, self.mine, slice(rows.start, rows.stop), 2)
        if home is not None:
            sum_rows(self.dkv, self.mine, home, slice(self.travelling.start, self.travelling.stop))
        return self.dkv


def _own_pieces(pieces, n: int, travelling: range) -> tuple[list, list]:
    """The own step's pairs in pieces of key rows, (rows, pairs) each, for the fused
    backward: those starting in the first half (``home_cuts``), run while the first K/V
    trip runs, and the others, while the last sums go home. Cut also where the rows that
    travel start and end (widened to whole tiles of BLOCK rows, which the Gluon kernel
    takes uncut), so that pieces hold either travelling rows or final ones (``_OwnSums``),
    but into no piece under an eighth of the rows: a kernel over fewer key tiles leaves SMs
    idle, the more so with fewer kv heads (packed documents, 128k tokens, 32 / 8 heads, 4
    H200s: cut at every end, 0.84 of one GPU; with this rule, 0.88; docs/performance.md).
    The smallest piece joins a neighbour, across the half's cut where that is one of its
    ends (the halves need not be equal), else the smaller neighbour; its rows that stay
    go to the fp32 sums and are rounded at the end."""
    half = home_cuts(n)
    ends = {travelling.start // BLOCK * BLOCK, min(n, -(-travelling.stop // BLOCK) * BLOCK)}
    cuts = sorted({*half, *ends} - {0, n})
    least = max(BLOCK, n // 8)
    while cuts:
        bounds = (0, *cuts, n)
        sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
        small = min(range(len(sizes)), key=sizes.__getitem__)
        if sizes[small] >= least:
            break
        sides = [i for i in (small - 1, small) if 0 <= i < len(cuts)]  # the cuts at its ends
        joined = [i for i in sides if cuts[i] in half] or [min(sides, key=lambda i: sizes[i] + sizes[i + 1])]
        del cuts[joined[0]]
    bounds = (0, *cuts, n)
    parts = list(zip((range(lo, hi) for lo, hi in zip(bounds, bounds[1:])), pieces(0, tuple(cuts))))
    return ([part for part in parts if not half or part[0].start < half[0]],
            [part for part in parts if half and part[0].start >= half[0]])


def _fuses(q, k, steps, segments, dropout, plan, blocks, deterministic: bool) -> bool:
    """Whether the backward takes the fused schedule: the Gluon backward serves the masks of
    every pair of ``steps`` (lists of pairs) on shards of this rank's rows
    (``dispatch.gluon_serves``), judged from what every rank agrees on (the shard's rows,
    not each pair's, which differ from rank to rank under a document layout; ranks agree
    on ``deterministic`` and torch's mode: ringflash/agreement.py), so that all ranks
    choose the same schedule. A pair whose rows the Gluon kernel does not take (not
    multiples of 128: the pieces of a document two ranks share, zigzag's chunks of a
    384-row shard) runs the Triton kernels inside that schedule, adding into the same fp32
    sums (``kernels/dispatch.py`` routes each call)."""
    n = q.shape[1]
    pairs = [pair for step in steps for pair in step]
    return bool(pairs) and all(
        dispatch.gluon_serves(q, k, n, n, pair_mask(pair, segments, segments, dropout, plan, blocks), deterministic)
        for pair in pairs)


def _one_step(grads: _Grads, k, own, pairs, first_writes: bool, into=None) -> torch.Tensor:
    """dK/dV of a ring whose shards never travel (one rank, or masks that keep to the own
    shard), after its dQ: pairs adding into one key row add in fp32, then round once (the
    fused kernel writes k's dtype where its pairs keep to disjoint key rows, and adds into
    fp32 sums elsewhere). ``into``: where k's dtype may be written (``ring_backward``)."""
    overlapping = uncovered([pair.k for pair in pairs], grads.n) is None
    rows = range(grads.n)
    fp32 = overlapping or (grads.fused and not grads.writes(pairs, rows))
    sums = into if into is not None and not fp32 else torch.empty(
        (2, *k.shape), device=k.device, dtype=torch.float32 if fp32 else k.dtype)
    if grads.fused:
        grads.fused_pass(pairs, *own, sums, keys=rows)
    else:
        grads.dq_pass(pairs, *own, first_writes, True)
        grads.dkv_pass(pairs, *own, sums)
    return sums if sums is into else sums.to(k.dtype)


def _home_first(grads: _Grads, ring: Ring, k, own, cur, schedule, pieces) -> torch.Tensor:
    """dK/dV of a ring of two whose one remote sum starts at the last step, so that step
    runs its dK/dV pass first, its dQ pass hiding the trip home, and the own dK/dV pass adds
    the arrived sum as it writes the gradients in k's dtype (no final add, no buffer for
    the own part). Both dK/dV passes run in two pieces of key rows (``home_cuts``): the
    first piece's sums go home while the second's are computed, and the own pass adds the
    first before the second has arrived, so only the dQ pass need cover the last half of
    the trip."""
    n = grads.n
    dkv = torch.empty((2, *k.shape), device=k.device, dtype=k.dtype)
    (kv, seg), cuts = cur, home_cuts(n)
    running, arrived = ring.buffer("grads", (2, 2, *k.shape), torch.float32, k.device)
    bounds = (0, *cuts, n)
    keys = [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    home = []
    for rows, pairs in zip(keys, pieces(1, cuts)):
        grads.dkv_pass(pairs, kv, seg, running, keys=rows)
        home.append(ring.exchange(*key_rows(running, arrived, rows), shift=-1))
    grads.dq_pass(schedule[1], kv, seg, False, True)
    for rows, pairs, pending in zip(keys, pieces(0, cuts), home):
        ring.wait(pending)
        grads.dkv_pass(pairs, *own, dkv, base=arrived, keys=rows)
    return dkv


def _rotate(grads: _Grads, ring: Ring, k, slots: Slots, schedule, steps: int,
            sums: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The rotation's remote steps: each visiting shard's running fp32 dK/dV sum travels one
    step behind its K/V, and leaves for home after the last step. Returns (where the own
    shard's sum arrives, the pending trip home).

    With the fused kernel (``grads.fused``) a visiting step adds its pairs' dK/dV into a
    zeroed buffer of its own (``fresh``) while the running sum arrives, then that buffer
    into the sum (one add over the key rows the step touches): no kernel waits for a
    trip."""
    # Packed (dk, dv) sums in fp32: `running` belongs to the shard this step computes and
    # arrives from r-1 during the step (the shard of step 1 starts its sum here); `sending`
    # belongs to the shard of the step before and leaves for r+1. Both hold the travelling
    # rows of their shard (``Slots``).
    fresh = None if not grads.fused or steps < 3 else torch.empty(2 * k.numel(), device=k.device,
                                                                  dtype=torch.float32)
    running = sending = None
    for step in range(1, steps):
        pairs = schedule[step]
        (kv, seg) = slots.at(step)
        running = slots.packed(sums[step % 2], (ring.rank - step) % ring.world)
        # Two messages, the one needed first posted first: the running dK/dV (which the
        # dK/dV pass adds into) and the next K/V (needed by the next step only).
        grads_pending = [] if step == 1 else ring.exchange((sending, running))
        kv_pending = pass_on(ring, (kv, seg), slots.at(step + 1)) if step + 1 < steps else []
        if grads.fused:
            if step == 1:  # the sum starts here
                grads.fused_pass(pairs, kv, seg, running, keys=range(running.shape[2]))
            elif not pairs:  # nothing to add on this rank: the sum passes through
                ring.wait(grads_pending)
            else:
                touched = _key_span(pairs, running.shape[2])
                part = slots.packed(fresh, (ring.rank - step) % ring.world)
                copy_rows(part, None, touched, 2)
                grads.fused_pass(pairs, kv, seg, part)
                ring.wait(grads_pending)
                add_rows(running, part, touched, 2)
        else:
            # dQ needs nothing in flight, so it runs while the running dK/dV arrives; dK/dV
            # then add straight into it, only in the key rows this step touches.
            grads.dq_pass(pairs, kv, seg, False, step == steps - 1)
            ring.wait(grads_pending)
            if step == 1:
                grads.dkv_pass(pairs, kv, seg, running)
            else:
                for pair in pairs:
                    grads.pair(pair, kv, seg, False, dkv=running)
        ring.wait(kv_pending)
        sending = running
    # The last remote sum goes home (steps - 1 ranks back; the next rank when the ring is
    # whole) while this shard's sum arrives.
    home = slots.packed(sums[steps % 2], ring.rank)
    return home, ring.exchange((sending, home), shift=1 - steps)


def _direct(grads: _Grads, ring: Ring, k, slots: Slots, schedule, steps: int, sums: torch.Tensor,
            trips: list, last_dq: bool = True) -> tuple[list, list]:
    """The direct schedule's remote steps: step s runs once its shard has arrived (``trips``,
    all posted at the start), its dK/dV into an fp32 partial sum of that shard's rows of
    its own, which goes straight home (s ranks back) while the next steps run; this rank's
    own shard's partial sums arrive from the s ranks ahead, one into each of ``sums``'
    first steps - 1 rows, each over the rows its route sent there (``Slots.rows``). Returns
    ((rows, partial sum) a step, which ``_OwnSums.finish`` adds in step order, so the bits
    do not depend on the order they arrive in; the pending trips home). No
    step waits for another rank's gradients, so a short step exposes nothing. ``last_dq``:
    the last step's dQ pass is the last (else the own step's follows)."""
    homes = [(range(slots.n)[slots.rows(ring.rank, step)], slots.packed(sums[step - 1], ring.rank, step))
             for step in range(1, steps)]
    pending = []
    for step in range(1, steps):
        ring.wait(trips[step - 1] if step > 1 else [])  # step 1's: waited for under the own pass
        pairs, (kv, seg) = schedule[step], slots.at(step)
        part = torch.empty((2, *kv.shape[1:]), device=k.device, dtype=torch.float32)
        if grads.fused:
            grads.fused_pass(pairs, kv, seg, part, keys=range(part.shape[2]))
        else:
            grads.dq_pass(pairs, kv, seg, False, last_dq and step == steps - 1)
            grads.dkv_pass(pairs, kv, seg, part)
        pending += ring.exchange((part, homes[step - 1][1]), shift=-step)
    return homes, pending


def _key_span(pairs, rows: int) -> slice:
    """The key rows from the first to the last that ``pairs`` touch (of ``rows``)."""
    spans = [range(rows)[pair.k] for pair in pairs]
    return slice(min(r.start for r in spans), max(r.stop for r in spans))
