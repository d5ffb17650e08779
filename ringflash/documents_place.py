"""How one candidate of ``document_layout`` places the documents (ringflash/documents.py,
steps 1-4 of its docstring): each rank's spans (start, length) and causal pairs, for one way
of splitting and one set of documents to split (``_spans``). documents.py makes the
candidates from these, judges them and keeps one.

What every candidate of a call reads is read once (``_documents``); a rank's pairs are
counted as its spans come (whole documents, pieces cut in ring order, the zigzag chunks
once aligned) rather than from its sorted runs afterwards, so that a candidate cut in ring
order can be given up as soon as it cannot be taken (``documents._beaten``)."""

from __future__ import annotations

import bisect
import math
from itertools import accumulate
from typing import NamedTuple, Optional

import torch

from .kernels.masks import BLOCK


# Documents placed one by one (heaviest first) per rank; the lighter rest is poured.
_PLACED_PER_RANK = 64
# Placing leaves every rank 1 / _RESERVE of its shard for the pour: a document the pour cuts
# then reaches the next rank, not one further on.
_RESERVE = 16


def _rank_work(bounds: list[int], runs: list) -> int:
    """The causal pairs a rank's queries see within their documents (padding: none), summed
    document piece by document piece over its runs (or any spans (start, length) of it):
    rows a..b-1 of a document starting at d see (a - d + 1) + ... + (b - d) keys."""
    total, tokens = 0, bounds[-1]
    for run in runs:
        at, stop = run[0], run[0] + run[1]
        stop = tokens if stop > tokens else stop
        d = bisect.bisect_right(bounds, at) - 1
        while at < stop:
            first, end = bounds[d], bounds[d + 1]
            end = stop if end > stop else end
            total += (at + end + 1 - 2 * first) * (end - at) // 2
            at, d = end, d + 1
    return total


class _Documents(NamedTuple):
    """What every candidate of one call reads (``_documents``): cu_seqlens as a list, each
    document's start, length and causal pairs (``work``), their sum, and the documents
    heaviest first (equals in sequence order; none of length 0)."""

    bounds: list[int]
    starts: list[int]
    lengths: list[int]
    work: list[float]
    total: float
    heaviest: list[int]


def _documents(bounds: torch.Tensor) -> _Documents:
    """``bounds`` (cu_seqlens) read once for all of a call's candidates."""
    listed = bounds.tolist()
    lengths = [b - a for a, b in zip(listed, listed[1:])]
    work = [length * (length + 1) / 2 for length in lengths]
    return _Documents(listed, listed[:-1], lengths, work, sum(work),
                      sorted((d for d in range(len(lengths)) if lengths[d]), key=lambda d: -work[d]))


def _heavy(docs: _Documents, n: int, world: int, spread: float, force: tuple = ()) -> list[int]:
    """What ``documents._assign`` splits: documents over n tokens or ``spread`` x a rank's pairs, and ``force``."""
    work, limit = docs.work, spread * (docs.total / world)
    return [d for d, length in enumerate(docs.lengths) if length > n or (length and work[d] > limit) or d in force]


def _cut_in_ring_order(start: int, length: int, limit: float, reserve: int, spans: list, room: list,
                       load: list) -> None:
    """Document [start, start + length) in consecutive pieces over consecutive ranks in ring
    order from the rank with the most room, each piece as long as its rank's room (less
    ``reserve`` for the pour) and its load up to ``limit`` pairs allow (a piece of rows
    a..b-1 of the document adds the causal pairs of those rows); a rank with nothing to
    spare is passed by, and what is left once every rank was visited goes on wherever
    there is room."""
    world = len(room)
    r = max(range(world), key=lambda q: (room[q], -load[q], -q))
    at, end, visits = start, start + length, 0

    def pairs(x: int) -> int:  # the causal pairs of the document's first x rows
        return x * (x + 1) // 2

    while at < end:
        take = min(end - at, room[r])
        if visits < world:  # the rows and pairs this rank can take
            take = min(take, max(room[r] - reserve, 0))
            if take:
                spare, done = int(limit - load[r]), pairs(at - start)
                if spare < pairs(at + take - start) - done:
                    rows = (math.isqrt(8 * max(done + spare, 0) + 1) - 1) // 2
                    take = max(0, min(take, start + rows - at))
        if take:
            spans[r].append((at, take))
            room[r] -= take
            load[r] += pairs(at + take - start) - pairs(at - start)
            at += take
        r, visits = (r + 1) % world, visits + 1


def _spans(docs: _Documents, seqlen: int, world: int, heavy: list[int], fill: Optional[float],
           beaten=None) -> Optional[tuple[list[list[tuple[int, int]]], int, list[int], list[int]]]:
    """``documents._assign`` before each rank's spans (start, length) are sorted into runs,
    the documents to split (``heavy``) given: (spans, the number split, the documents poured
    for want of room, each rank's causal pairs as ``_rank_work`` counts them). ``beaten``: a
    test of one rank's pairs that says the candidate can no longer be taken
    (``documents._made``); it is asked of the busiest rank once the pairs are counted, and
    where the documents are cut in ring order (pairs counted exactly, only growing) as they
    grow, and the candidate given up (None) once it says so."""
    n = seqlen // world
    starts, lengths, work = docs.starts, docs.lengths, docs.work
    share = docs.total / world
    spans: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    room, load = [n] * world, [0.0] * world
    placed = [False] * len(lengths)
    rotate, splits = 0, 0
    reserve = n // _RESERVE  # room kept for the pour on every rank, so that it never skips one
    for d in sorted(heavy, key=lambda d: -work[d]) if fill else ():  # 1. in ring order
        _cut_in_ring_order(starts[d], lengths[d], fill * share, reserve, spans, room, load)
        placed[d], splits = True, splits + 1
        if beaten and beaten(max(load)):
            return None
    peak = max(load)  # the most pairs a rank holds (cut in ring order), asked of beaten as it grows
    zigzag = []  # (start, chunk sizes) of each document split zigzag
    for d in () if fill else heavy:  # 1. zigzag over every rank
        length = lengths[d]
        base, extra = divmod(length, world)
        per = [base + ((r - rotate) % world < extra) for r in range(world)]
        rotate = (rotate + extra) % world  # the ranks that take the odd tokens take turns
        zigzag.append((starts[d], [p // 2 for p in per] + [p - p // 2 for p in reversed(per)]))
        for r in range(world):
            room[r] -= per[r]
            load[r] += work[d] / world
        placed[d], splits = True, splits + 1
    stream_tokens = seqlen - sum(n - r for r in room)
    # (every sum of pairs is a whole number below 2 ** 53 here, so exact in any order)
    stream_work = docs.total - sum(work[d] for d in heavy) if docs.total < 2 ** 53 else \
        sum(work[d] for d in range(len(lengths)) if not placed[d] and lengths[d] > 0)
    poured, ranks, most = [], range(world), max(room)
    for d in [d for d in docs.heaviest if not placed[d]][:_PLACED_PER_RANK * world]:  # 2. whole
        length = lengths[d]
        needs = length + reserve
        if needs > most:  # (the most room a rank has, kept as rooms shrink)
            poured.append(d)
            continue
        # the rank with ``needs`` tokens of room whose projected load (its pairs, plus what its room
        # left after this document brings at the density, pairs a token, of what is left) is
        # least, the first of equals (inline: a call per document cost more than the scan;
        # stream_tokens, the room left, is never below 0)
        density, r, least = stream_work / (stream_tokens or 1), -1, math.inf
        for q, free, held in zip(ranks, room, load):
            if free >= needs:
                projected = held + density * (free - length)
                if projected < least:
                    r, least = q, projected
        spans[r].append((starts[d], length))
        if room[r] == most:
            room[r] -= length
            most = max(room)
        else:
            room[r] -= length
        load[r] += work[d]
        stream_tokens -= length
        stream_work -= work[d]
        placed[d] = True
        if beaten and fill and load[r] > peak:  # (zigzag: a share of each split counted a rank till 4.)
            peak = load[r]
            if beaten(peak):
                return None
    whole = [len(rank) for rank in spans]  # (zigzag: each rank's documents placed whole, first)
    added = _pour(docs, placed, seqlen, room, spans)  # 3.
    if fill:  # each rank's pairs: counted as they came, and the pour's
        pairs = [int(held) + _rank_work(docs.bounds, more) for held, more in zip(load, added)]
    else:  # 4. the zigzag chunks' edges on tile boundaries; the pairs of the chunks, and of the rest
        chunks, held = _align_zigzag(zigzag, spans, docs.bounds)  # (it moves none of the whole ones)
        pairs = [chunked + sum([length * (length + 1) // 2 for _, length in rank[:k]])
                 + _rank_work(docs.bounds, rank[k:]) for chunked, rank, k in zip(held, spans, whole)]
        for rank, more in zip(spans, chunks):
            rank += more
    if beaten and beaten(max(pairs)):
        return None
    return spans, splits, poured, pairs


def _pour(docs: _Documents, placed: list[bool], seqlen: int, room: list[int],
          spans: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """Step 3: the documents not ``placed`` and the padding, in sequence order, into the ranks'
    ``room`` in ring order (added to ``spans``, and returned: each rank's)."""
    gaps, at = [], 0  # the stretches of tokens no rank holds yet
    for d, start in enumerate(docs.starts):
        if placed[d]:
            if start > at:
                gaps.append((at, start - at))
            at = start + docs.lengths[d]
    if seqlen > at:
        gaps.append((at, seqlen - at))
    added: list[list[tuple[int, int]]] = [[] for _ in room]
    r = 0
    for start, length in gaps:
        while length:
            while room[r] == 0:
                r += 1
            take = min(length, room[r])
            spans[r].append((start, take))
            added[r].append((start, take))
            room[r] -= take
            start, length = start + take, length - take
    return added


def _align_zigzag(zigzag: list[tuple[int, list[int]]], spans: list[list[tuple[int, int]]],
                  bounds: list[int]) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """Moves the edges of the zigzag splits' chunks (``zigzag``: each document's start and
    chunk sizes) onto tile boundaries of the ranks' local rows, every rank keeping its
    tokens and every document its length (``spans``: every rank's other spans, moved where
    need be; ``bounds``: the documents' cu_seqlens). Returns each rank's chunks (start,
    length) and their causal pairs:

    - on each rank r < W - 1 a document's first chunk ends where its second starts (the
      chunks between them are other ranks'): d tokens go from chunk r + 1 to chunk r and
      come back from chunk 2W - 1 - r to chunk 2W - 2 - r (|d| < BLOCK);
    - where the next document is split too, zigzag or in consecutive pieces one a rank (as
      the pour leaves one that ends the sequence), this one's second chunk on each rank
      holding a piece of it grows by e, that rank's piece of the next shrinking by as much,
      so that it ends on a tile boundary; the e add up to 0, the last of those ranks taking
      the rest (the ends add up to the documents' border, so one may stay off a boundary).

    A remote step's queries then see either all of another rank's keys of a document or
    none, tile by tile, and its pairs run over whole tiles with no band
    (``_whole_tile_pairs``): no slivers for the Triton kernels. A move that would leave a
    chunk or piece shorter than 0 is not made. The documents are visited in sequence order,
    the other spans swept once in order of position: the rows each rank holds before a
    document are those swept (less what pieces moved) and the chunks before it as cut."""
    world = len(spans)
    chunks, pairs = [[] for _ in range(world)], [0] * world
    if not zigzag:
        return chunks, pairs
    last = 2 * world - 1
    items = sorted(zigzag)
    split = {start: sizes for start, sizes in items}
    others = sorted((at, length, r) for r, rank in enumerate(spans) for at, length in rank)
    swept, rows = 0, [0] * world  # rows of the other spans before the sweep's position, per rank
    shift = [0] * world  # tokens the document before took from this one, per rank
    for start, sizes in items:
        cut = [a + b for a, b in zip(sizes[:world], sizes[:world - 1:-1])]  # rank r's chunks r and 2W - 1 - r
        if any(shift):
            sizes[world:] = [size - s for size, s in zip(sizes[world:], reversed(shift))]
        while swept < len(others) and others[swept][0] < start:
            rows[others[swept][2]] += others[swept][1]
            swept += 1
        before = [held + s for held, s in zip(rows, shift)]
        rows = [held + c for held, c in zip(rows, cut)]  # the chunks as cut count for the documents after
        for r in range(world - 1):  # (sizes are never below 0)
            d = -(before[r] + sizes[r]) % BLOCK
            if min(sizes[r + 1], sizes[last - r]) < d:  # they cannot give d: give BLOCK - d back
                d -= BLOCK
                if min(sizes[r], sizes[last - 1 - r]) < -d:  # nor that: no move
                    continue
            sizes[r] += d
            sizes[r + 1] -= d
            sizes[last - 1 - r] += d
            sizes[last - r] -= d
        shift = [0] * world
        end = start + sum(sizes)
        nxt = split.get(end)
        if nxt is not None:  # zigzag: rank r's piece is its chunks, the second gives way
            ranks, room = list(range(world)), [nxt[last - r] for r in range(world)]
        else:  # in pieces one a rank, in the order of their positions
            pieces = _pieces_of_next(others, bounds, end)
            if not pieces:
                continue
            ranks, room = [r for _, r in pieces], [span[1] for span, _ in pieces]
        moved = 0
        for i, r in enumerate(ranks[:-1]):  # e = target or target - BLOCK, the one that keeps the sum nearest 0
            target = -(before[r] + sizes[r] + sizes[last - r]) % BLOCK
            grow, shrink = room[i] >= target, sizes[last - r] >= BLOCK - target  # (neither is below 0)
            if grow and shrink:
                shift[r] = target if abs(moved + target) <= abs(moved + target - BLOCK) else target - BLOCK
            else:
                shift[r] = target if grow else target - BLOCK if shrink else 0
            moved += shift[r]
        shift[ranks[-1]] = -moved
        if sizes[last - ranks[-1]] + shift[ranks[-1]] < 0 or room[-1] - shift[ranks[-1]] < 0:
            shift = [0] * world
        sizes[world:] = [size + s for size, s in zip(sizes[world:], reversed(shift))]
        if nxt is None and any(shift):
            at = end
            for (span, r), length in zip(pieces, room):
                spans[r].remove(span)
                spans[r].append((at, length - shift[r]))
                at += length - shift[r]
                rows[r] -= shift[r]  # swept later at its old length
            shift = [0] * world
    for start, sizes in items:
        at = list(accumulate(sizes, initial=0))  # each chunk's first row in its document
        for r, a, k, b, j in zip(range(world), at, sizes, at[last:world - 1:-1], sizes[last:world - 1:-1]):
            chunks[r] += (start + a, k), (start + b, j)  # chunks r and 2W - 1 - r
            # rows a..a+k-1 of a document see (a + 1) + ... + (a + k) keys: (2a + k + 1) k / 2, a whole number
            pairs[r] += ((2 * a + k + 1) * k + (2 * b + j + 1) * j) // 2
    return chunks, pairs


def _pieces_of_next(others: list[tuple[int, int, int]], bounds: list[int], end: int) -> list:
    """The pieces ((start, length), rank) of the document starting at ``end`` among the spans
    ``others`` (start, length, rank), sorted by position, where they are one a rank and hold
    all of it; else []."""
    d = bisect.bisect_right(bounds, end) - 1
    stop = bounds[d + 1] if bounds[d] == end and d + 1 < len(bounds) else end
    i, pieces = bisect.bisect_left(others, (end,)), []
    while i < len(others) and others[i][0] < stop:
        at, length, r = others[i]
        if length > 0:
            pieces.append(((at, length), r))
        i += 1
    if len({r for _, r in pieces}) < len(pieces) or sum(span[1] for span, _ in pieces) != stop - end:
        return []
    return pieces
