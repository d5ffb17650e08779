"""A layout computed from the documents: ``document_layout(cu_seqlens, seqlen, group)``.

Packed documents under a document mask attend only within each document. ``block_stripe``
balances them by giving every rank blocks of every document, so each of the W ring steps
moves a whole K/V shard for a slice of pairs that shrinks as 1 / W^2
(docs/performance.md, "Cost model"). This layout keeps documents whole on one rank
wherever the balance allows, so most of the attention needs no communication at all
(steps 1-3 and the zigzag edges' alignment: ringflash/documents_place.py):

1. A document longer than a shard (n = seqlen / W tokens), or with more visible causal
   pairs than ``spread`` x a rank's share, is split. Zigzag over the W ranks (2W chunks;
   rank r holds chunks r and 2W - 1 - r, meeting on a tile boundary of its rows once the
   rest is placed: ``_align_zigzag``): every rank gets the same tokens and (within a few
   rows) pairs of it, and the ring runs W steps. Or in consecutive pieces over consecutive ranks in ring order
   (``_cut_in_ring_order``, heaviest first), each rank filled up to a share of its pairs
   (``_FILLS``): a piece's queries see only the pieces before it, k pieces need k - 1 hops,
   and a document over two ranks one hop, as the pour's cuts do.
2. The other documents, heaviest first (at most ``_PLACED_PER_RANK`` x W of them), go whole
   to the rank with room for them (keeping n / ``_RESERVE`` free) whose projected load is least: its pairs so far, plus
   what its remaining room will bring at the density (pairs per token) of what is left.
3. The rest (the lightest documents and the padding, in sequence order) is poured into the
   ranks' remaining room in ring order 0, 1, ..., W - 1: a document cut there starts on rank
   r and ends on rank r + 1, one ring step away.

``spread`` and the way of splitting are chosen per call (``_made``): of the candidates whose
busiest rank is within ``_BALANCED`` of the mean (for each way, the one of the fewest split
documents, ``_SPREADS``), the one whose ring runs the fewest steps (zigzag where they tie);
else the most even. On 4 ranks at 128k this takes the ring from 4 steps to 2
(docs/notes/documents.md, "Documents cut in ring order"). The documents are read once per
call, and a candidate that can no longer be taken is given up while it is made
(``_beaten``; docs/notes/documents.md, "Host time, second round").

A rank holds its tokens in increasing global position. Under causal (or full) attention
its own step is then one kernel call over the shard (key row <= query row; the segment
ids tell documents apart); the other steps compute only the pieces of the documents that
cross ranks (``DocumentLayout.pairs``; where a rank's shard is whole tiles of 128 rows, as
pairs widened to whole tiles that the segment ids mask, wherever every query piece of a
document in a pair sees every key piece of it there: ``_whole_tile_pairs``, with the
zigzag chunks' edges on tile boundaries for it, ``_align_zigzag``), and the ring runs only as
far as they reach (``layouts.active_steps``; ``DocumentLayout.steps``): 2 steps when every
crossing document spans two neighbours (the one hop hides behind the own step), W where
one is split zigzag.
"""

from __future__ import annotations

import bisect
import hashlib
from functools import cached_property
from itertools import accumulate
from typing import NamedTuple, Optional

import torch

from .api import check_cu_seqlens, positive_int
from .groups import resolve_grid
from .kernels.masks import BLOCK
from .documents_place import _documents, _Documents, _heavy, _spans
from .documents_place import _rank_work  # noqa: F401 - a rank's pairs (tests)
from .layouts import (_ALL, NO_BAND, Layout, Pair, _Chunk, _local_pair, _merged, _MADE_PREFIX,
                      remember, spec_maker)

# Split documents are tried at these multiples of a rank's share of the pairs (inf: only
# documents longer than a shard); the first whose busiest rank is within _BALANCED of the
# mean is taken.
_SPREADS = (float("inf"), 1.0, 0.5, 0.25)
_BALANCED = 1.03
# Cutting a document in ring order fills a rank up to one of these shares of its pairs (each a
# candidate: which one balances depends on the documents); whole documents and the pour bring
# it to its share.
_FILLS = (0.97, 0.9, 0.8)


class Piece(NamedTuple):
    """Tokens [start, start + length) of one document, at local rows [local, local + length)."""

    start: int
    length: int
    local: int

    def chunk(self) -> _Chunk:
        return _Chunk(self.local, self.length, self.start, 1)


def _spans_to_runs(spans: list[tuple[int, int]]) -> list[Piece]:
    """Spans (start, length) of one rank, sorted and joined where adjacent, with local rows."""
    starts: list[int] = []
    lengths: list[int] = []
    for start, length in sorted(spans):
        if length and starts and starts[-1] + lengths[-1] == start:
            lengths[-1] += length
        elif length:
            starts.append(start)
            lengths.append(length)
    return list(map(Piece._make, zip(starts, lengths, accumulate(lengths, initial=0))))


def _positions(runs: list[Piece]) -> torch.Tensor:
    """The global positions of a rank's runs, in local order (int64): one arange a run,
    joined (at 1M tokens over 2 ranks 1 ms against 5-6 for a repeat_interleave of the
    runs' offsets, one CPU core)."""
    if not runs:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(run.start, run.start + run.length) for run in runs])


def _assign(bounds: torch.Tensor, seqlen: int, world: int, spread: float, fill: Optional[float] = None,
            force: tuple = ()) -> tuple[list[list[Piece]], int, list[int]]:
    """Each rank's runs for one ``spread`` (module docstring, steps 1-3, then ``_align_zigzag``), the documents to
    split (those of ``force`` too) cut zigzag (``fill`` None) or in pieces over consecutive
    ranks, each filled up to ``fill`` x its share of the pairs; the number of documents
    split; and the documents placed whole nowhere (no rank had room), which the pour cut
    wherever the ranks' room ended."""
    docs = _documents(bounds)
    heavy = _heavy(docs, seqlen // world, world, spread, force)
    spans, splits, poured, _ = _spans(docs, seqlen, world, heavy, fill)
    return [_spans_to_runs(s) for s in spans], splits, poured


def _shared_pieces(bounds: list[int], runs: list[list[Piece]]) -> dict[int, dict[int, list[Piece]]]:
    """{document: {rank: its pieces there}} of the documents on more than one rank. Only a
    run's first and last documents can reach past it: the runs' edges are read first, and
    pieces made only of the documents found on two ranks or more (a run within one
    document is its own piece)."""
    def doc_at(position: int, lo: int = 0) -> int:  # -1: padding
        return -1 if position >= tokens else bisect.bisect_right(bounds, position, lo) - 1

    edges, first_rank, crossing, tokens = [], {}, set(), bounds[-1]
    for r, rank in enumerate(runs):
        for run in rank:  # a document on several ranks meets a run's edge wherever it lies
            start, stop = run.start, run.start + run.length
            a = bisect.bisect_right(bounds, start) - 1 if start < tokens else -1
            b = a if a < 0 or stop <= bounds[a + 1] else doc_at(stop - 1, a)
            for d in (a, b):
                if d >= 0 and first_rank.setdefault(d, r) != r:
                    crossing.add(d)
            edges.append((r, run, a, b))
    pieces: dict[int, dict[int, list[Piece]]] = {d: {} for d in sorted(crossing)}
    for r, run, a, b in edges:
        if a == b and a in crossing:
            pieces[a].setdefault(r, []).append(run)
        elif a != b:
            for d in (a, b) if b >= 0 else (a,):
                if d in crossing:
                    lo, hi = max(bounds[d], run.start), min(bounds[d + 1], run.start + run.length)
                    pieces[d].setdefault(r, []).append(Piece(lo, hi - lo, run.local + lo - run.start))
    return pieces


def _steps(shared: dict, world: int) -> int:
    """The ring steps causal attention runs over ranks holding ``shared`` pieces: 1, plus the
    farthest hop from a rank holding a piece of a crossing document to a rank holding a
    piece whose queries see it (``layouts.active_steps`` counts the same from the pairs)."""
    far = 0
    for pieces in shared.values():
        if far == world - 1:  # the farthest a hop goes (a document split zigzag reaches it)
            break
        first = {r: min(p.start for p in ps) for r, ps in pieces.items()}
        last = {r: max(p.start + p.length for p in ps) for r, ps in pieces.items()}
        far = max([far] + [(q - k) % world for q in pieces for k in pieces if k != q and first[k] < last[q]])
    return far + 1


class DocumentLayout(Layout):
    """A layout computed from one packed sequence's documents (``document_layout``): each
    rank's tokens as runs of consecutive positions (``runs``), and for every document that
    crosses ranks its pieces on each rank (``shared``). Equal layouts (the same documents,
    sequence length and world size) have equal names; the ranks compare its ``digest``.
    ``variant``: a layout made some other way from the same documents (``_made``'s
    ``fills``), named apart so that no cache keyed by name takes one for the other."""

    keeps_kv = False
    kind = "documents"  # its maker's name, for the ring's ops (``layouts.layout_from_spec``)

    def __init__(self, bounds: torch.Tensor, seqlen: int, world: int, runs: list[list[Piece]],
                 splits: int, spread: float, variant: str = "", shared: Optional[dict] = None):
        self.bounds, self.seqlen, self.world, self.runs = bounds, seqlen, world, runs
        if shared is not None:  # (``shared`` as its maker found it: the cached property's value)
            self.__dict__["shared"] = shared
        self._bounds = bounds.tolist()
        self.splits, self.spread = splits, spread
        self.local_len = seqlen // world
        key = f"{seqlen},{world}," + ",".join(map(str, bounds.tolist())) + variant
        self.digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 2
        self.name = f"{_MADE_PREFIX}{self.digest:016x}"
        # What the ring's ops take it as (``spec_of``): a CPU tensor is a graph input under
        # torch.compile, so a new layout of the same sizes needs no new graph.
        self.spec = torch.tensor([seqlen, world, *self._bounds], dtype=torch.int64)
        self._positions: dict[int, torch.Tensor] = {}  # per rank, made on first use

    def __repr__(self) -> str:
        return (f"DocumentLayout(seqlen={self.seqlen}, world={self.world}, documents={len(self.bounds) - 1}, "
                f"split={self.splits})")

    @cached_property
    def shared(self) -> dict[int, dict[int, list[Piece]]]:
        """{document: {rank: its pieces there}} of the documents on more than one rank
        (``_shared_pieces``), made on first use (``pairs``, ``steps``)."""
        return _shared_pieces(self._bounds, self.runs)

    @property
    def steps(self) -> int:
        """The ring steps causal attention over this layout runs (``_steps``)."""
        return _steps(self.shared, self.world)

    # ------------------------------------------------------------------ Layout's rules

    def check_seqlen(self, seqlen, world):
        if (seqlen, world) != (self.seqlen, self.world):
            raise ValueError(f"layout {self.name} was made for seqlen {self.seqlen} over {self.world} ranks, "
                             f"not seqlen {seqlen} over {world}")

    def check_local(self, local_len):
        if local_len != self.local_len:
            raise ValueError(f"layout {self.name} gives each rank {self.local_len} tokens "
                             f"(seqlen {self.seqlen} over {self.world} ranks), got {local_len}")

    def check_masks(self, band, window, block_mask, segments):
        if block_mask:
            raise ValueError("block_mask is not served with a document layout: use layout 'block_stripe'")
        if not segments:
            raise ValueError(f"layout {self.name} needs segment_ids: its ring steps compute only the "
                             "documents that cross ranks (segment_ids_from_cu_seqlens(cu_seqlens, seqlen, "
                             "layout=layout))")

    def positions(self, seqlen, rank, world):
        self.check_seqlen(seqlen, world)
        if rank not in self._positions:
            self._positions[rank] = _positions(self.runs[rank])
        return self._positions[rank].clone()

    def block_chunk(self, world, local_len, block):
        raise ValueError("block_mask is not served with a document layout: use layout 'block_stripe'")

    def pairs(self, rank, src, world, local_len, band, merge, occupied):
        """Own step: every run against itself and against the runs holding the same
        document (one call over the shard under causal or full attention when merging);
        other steps: the pieces of each document that both ranks hold."""
        tiled = ()
        if rank == src:
            if merge and band in (NO_BAND, (None, 0)):
                return (Pair(_ALL, _ALL, None, band[1]),)
            runs = self.runs[rank]
            together = {(a, a) for a in range(len(runs))}
            for pieces in self.shared.values():
                held = [next(i for i, run in enumerate(runs) if run.start <= p.start < run.start + run.length)
                        for p in pieces.get(rank, ())]
                together.update((a, b) for a in held for b in held)
            chunks = [(runs[a].chunk(), runs[b].chunk()) for a, b in sorted(together)]
        else:
            both = [(pieces[rank], pieces[src]) for pieces in self.shared.values() if rank in pieces and src in pieces]
            if merge and band in (NO_BAND, (None, 0)):
                tiled, both = _whole_tile_pairs(both, band, local_len)
            chunks = [(q.chunk(), k.chunk()) for qs, ks in both for q in qs for k in ks]
        pairs = [p for qc, kc in chunks if (p := _local_pair(qc, kc, band, local_len)) is not None]
        return tiled + tuple(_merged(pairs, local_len)) if merge else tuple(pairs)


def _whole_tile_pairs(both: list, band, n: int) -> tuple[tuple[Pair, ...], list]:
    """A remote step's pairs over whole tiles of BLOCK rows, and the documents of ``both``
    left to pairs on their exact rows (with their band).

    ``both``: for each document the two ranks share, (its pieces on the query rank, its
    pieces on the key rank). Pieces of one document on two ranks hold disjoint positions,
    so under causal attention a query piece sees all of a key piece (it comes first) or
    none of it; with no band, all. Each document's query pieces that see some key there
    and the key pieces they see, widened to whole tiles, make a pair; pairs whose query
    rows and key rows both overlap join (their hull), so no element lies in two pairs
    (pairs sharing query rows only are computed apart and merged as the ring merges its
    steps). Such a pair needs no band: the segment ids hide the rows the widening takes in
    where they belong to other documents, provided every query piece of a shared document
    within it sees every key piece of that document within it. Where that fails, the
    pair's documents are left to exact pairs (the other pairs hold none of their
    elements: every element of a document lies in its own pair's rectangle, and
    rectangles that meet are joined). The zigzag splits' chunks meet on tile boundaries
    (``_align_zigzag``) so that this seldom happens. So the Gluon kernels serve a document
    layout's remote steps whole, with no pieces cut out for the Triton kernels
    (``ring.plan.tile_pieces``); the kernels skip the tiles no document reaches. Every
    document is left where ``n`` is not a multiple of BLOCK."""
    def tiles(pieces) -> tuple[int, int]:
        lo, hi = min(p.local for p in pieces), max(p.local + p.length for p in pieces)
        return lo // BLOCK * BLOCK, -(-hi // BLOCK) * BLOCK

    def sees(q: Piece, k: Piece) -> bool:
        return band == NO_BAND or k.start + k.length <= q.start

    def within(p: Piece, lo: int, hi: int) -> bool:
        return p.local < hi and lo < p.local + p.length

    if n % BLOCK:
        return (), both
    groups: list[tuple[list[int], list]] = []  # ([q0, q1, k0, k1], its documents)
    for qs, ks in both:
        seeing = [q for q in qs if any(sees(q, k) for k in ks)]
        if not seeing:
            continue
        box, members = [*tiles(seeing), *tiles([k for k in ks if any(sees(q, k) for q in seeing)])], [(qs, ks)]
        while (meets := next((g for g in groups if box[0] < g[0][1] and g[0][0] < box[1] and box[2] < g[0][3]
                              and g[0][2] < box[3]), None)) is not None:
            groups.remove(meets)
            box = [min(box[0], meets[0][0]), max(box[1], meets[0][1]), min(box[2], meets[0][2]),
                   max(box[3], meets[0][3])]
            members += meets[1]
        groups.append((box, members))

    def part(lo: int, hi: int) -> slice:
        return _ALL if (lo, hi) == (0, n) else slice(lo, hi)

    hulls = [(min(p.local for p in qs), max(p.local + p.length for p in qs), min(p.local for p in ks),
              max(p.local + p.length for p in ks), qs, ks) for qs, ks in both]
    tiled, left = [], []
    for (q0, q1, k0, k1), members in sorted(groups, key=lambda g: g[0]):
        near = [(qs, ks) for a, b, c, d, qs, ks in hulls if a < q1 and q0 < b and c < k1 and k0 < d]
        if all(sees(q, k) for qs, ks in near for q in qs if within(q, q0, q1) for k in ks if within(k, k0, k1)):
            tiled.append(Pair(part(q0, q1), part(k0, k1)))
        else:
            left += members
    return tuple(tiled), left


def document_layout(cu_seqlens, seqlen: int, group=None, *, world: Optional[int] = None) -> DocumentLayout:
    """A layout for one packed sequence of ``seqlen`` tokens whose documents are given in
    flash_attn's varlen format (document d holds tokens [cu_seqlens[d], cu_seqlens[d + 1]);
    tokens from cu_seqlens[-1] on are padding), over the ring of ``group`` (a process
    group, a DeviceMesh, or a heads x ring grid: its ring).

    Documents stay whole on one rank where the balance allows; the ring's steps then
    compute, and its K/V travel for, only the documents that cross ranks (the module
    docstring says how it is made). Pass it as ``layout=`` wherever a layout name goes
    (``shard``, ``unshard``, ``positions``, ``ring_flash_attn``, ``SequenceParallel``,
    ``segment_ids_from_cu_seqlens``), together with segment ids of the same documents:
    ``segment_ids_from_cu_seqlens(cu_seqlens, seqlen, layout=layout, group=group)``. Ids
    may split its documents further, never join them.

    Local (no collective): every rank computes the same layout from the same cu_seqlens,
    and the ring's rank check compares it. seqlen must be a multiple of the ring's size.
    ``world``: the ring's size, to plan a layout without a process group (cost model,
    tests); with a group, it must be the group's. Block masks are not served with it
    (ValueError). Host time (one core, no GPU, bench_masks.py's documents, 2026-11-28):
    0.2-2.5 ms at 32k-1M tokens over 2 or 8 ranks, 2-8 ms over 64 (a rank's own positions,
    made on first use, included; the pieces shared between ranks, kept from choosing the
    layout where a balanced candidate was taken, else made on first use by ``pairs`` or
    ``steps``, not; docs/notes/documents.md, "Host time, third round").
    """
    seqlen = positive_int(seqlen, "seqlen")
    bounds = check_cu_seqlens(cu_seqlens, seqlen)
    ring_world = resolve_grid(group).ring_world
    if world is None:
        world = ring_world
    elif positive_int(world, "world") != ring_world and (group is not None or ring_world > 1):
        raise ValueError(f"world {world} is not the group's ring size {ring_world}")
    if seqlen % world:
        raise ValueError(f"seqlen {seqlen} cannot be split over {world} ranks: it must be a multiple of {world}")
    return _made(bounds, seqlen, world)


_FROM_SPEC: dict[tuple, DocumentLayout] = {}  # the layouts the ring's ops were last given as specs, by spec


@spec_maker("documents")
def _from_spec(spec: torch.Tensor) -> DocumentLayout:
    """The layout of ``DocumentLayout.spec`` [seqlen, world, *bounds] (the same object again
    while it is among the last 256 asked for: the ring's plans are cached per object)."""
    key = tuple(spec.tolist())
    layout = _FROM_SPEC.get(key)
    if layout is None:
        layout = _made(torch.tensor(key[2:], dtype=torch.int64), key[0], key[1])
    return _keep(key, layout)


def _keep(key: tuple, layout: DocumentLayout) -> DocumentLayout:
    """``layout`` as the newest of the last 256 found by their spec (as ``layouts.remember``
    keeps them by name: mostly the same objects)."""
    _FROM_SPEC.pop(key, None)
    _FROM_SPEC[key] = layout
    while len(_FROM_SPEC) > 256:
        del _FROM_SPEC[next(iter(_FROM_SPEC))]
    return layout


def _judged(docs: _Documents, spans: list[list[tuple[int, int]]], world: int, way: int,
            loads: list[int]) -> tuple[tuple, Optional[tuple]]:
    """A candidate's key (the least is taken): (0, its ring steps, way) where its busiest
    rank (``loads``: each rank's causal pairs) is within ``_BALANCED`` of the mean, else (1,
    busiest over mean, way); and where the steps needed them, its runs and shared pieces
    (``DocumentLayout``'s), else None."""
    worst = max(loads) / max(sum(loads) / world, 1)
    if worst > _BALANCED:
        return (1, round(worst, 9), way), None
    runs = [_spans_to_runs(s) for s in spans]
    shared = _shared_pieces(docs.bounds, runs)
    return (0, _steps(shared, world), way), (runs, shared)


def _candidates(bounds: torch.Tensor, seqlen: int, world: int, fills: tuple = _FILLS, every: bool = False):
    """``_made``'s candidates in order, (``_judged``'s key, runs, splits, spread, poured) each: per
    way of splitting (zigzag; in ring order at each of ``fills``) those of ``_SPREADS`` up to
    the first balanced one but those splitting the documents of the spread before (``_heavy``);
    none after one balanced in two steps or fewer. ``every``: all (research/layout_choice.py)."""
    for key, spans, judged, splits, spread, poured in _spanned(_documents(bounds), seqlen, world, fills, every):
        yield key, judged[0] if judged is not None else [_spans_to_runs(s) for s in spans], splits, spread, poured


def _spanned(docs: _Documents, seqlen: int, world: int, fills: tuple, every: bool, prune: bool = False):
    """``_candidates``, each as (key, spans, (runs, shared pieces) or None, splits, spread,
    poured): the runs are sorted only where judging needed them (``_made`` sorts the one it
    takes), and its shared pieces kept for the layout. ``prune``:
    leave out the candidates found, as they are made, uneven and no less than the least key
    so far (``_beaten``): they would not be taken, and only a balanced one stops a way."""
    done, heavies, least = False, {}, None
    for way, fill in enumerate((None, *fills)):
        if done and not every:  # balanced in one hop: nothing to gain
            return
        before = None
        for spread in _SPREADS:
            if spread not in heavies:  # the same for every way
                heavies[spread] = _heavy(docs, seqlen // world, world, spread)
            heavy = heavies[spread]
            if heavy == before:  # the spread before split the same documents: the same candidate
                continue
            before = heavy
            beaten = _beaten(least, way, docs.total / world) if prune else None  # (total: whole numbers, exact)
            made = _spans(docs, seqlen, world, heavy, fill, beaten)
            if made is None:  # uneven, so neither balanced nor a reason to stop
                continue
            spans, splits, poured, loads = made
            key, judged = _judged(docs, spans, world, way, loads)
            least = key if least is None else min(least, key)
            yield key, spans, judged, splits, spread, poured
            done = done or key[:2] <= (0, 2)
            if key[0] == 0 and not every:
                break


def _beaten(least: Optional[tuple], way: int, mean: float):
    """For a candidate of ``way`` made after one of key ``least`` (None: the first), the test
    of one rank's pairs that says it cannot be taken: its key (``_judged``) is then at
    least (1, that rank's pairs over the mean ``mean``, way), no less than ``least``."""
    if least is None:
        return None
    mean = max(mean, 1)

    def beaten(pairs: float) -> bool:
        worst = pairs / mean
        return worst > _BALANCED and (least[0] == 0 or (1, round(worst, 9), way) >= least)
    return beaten


def _made(bounds: torch.Tensor, seqlen: int, world: int, fills: tuple = _FILLS) -> DocumentLayout:
    """``document_layout`` once its arguments are checked: of the candidates (``_candidates``)
    the balanced one of the fewest ring steps (the first where they tie: zigzag), else the
    most even. Where the most even is a zigzag one, uneven, that poured documents no rank
    had room for whole (the pour cuts them where the ranks' room ends, a heavy piece on one
    rank: at 1M tokens over 32 ranks the busiest held 1.14x the mean), it is made again
    with those split zigzag too, and kept if more even (a zigzag ring runs W steps either
    way). ``fills=()``: zigzag only, the layout before documents were cut in ring order
    (the cost model's calibration counts the layout its measured rows ran)."""
    docs = _documents(bounds)
    key, spans, judged, splits, spread, poured = min(_spanned(docs, seqlen, world, fills, False, True),
                                                     key=lambda candidate: candidate[0])  # the first least
    if key[0] == 1 and key[2] == 0 and poured and fills == _FILLS:  # zigzag, uneven: split what it poured too
        heavy = _heavy(docs, seqlen // world, world, spread, tuple(poured))
        spans_again, splits_again, _, loads = _spans(docs, seqlen, world, heavy, None)
        again, judged_again = _judged(docs, spans_again, world, 0, loads)
        if again < key:
            spans, judged, splits = spans_again, judged_again, splits_again
    runs, shared = judged if judged is not None else ([_spans_to_runs(s) for s in spans], None)
    if fills != _FILLS:  # not what document_layout makes: a name of its own, not found by spec
        return remember(DocumentLayout(bounds, seqlen, world, runs, splits, spread, variant=f";fills={fills}",
                                       shared=shared))
    layout = DocumentLayout(bounds, seqlen, world, runs, splits, spread, shared=shared)
    return remember(_keep(tuple(layout.spec.tolist()), layout))
