"""Sequence layouts: which global tokens each rank holds, and what each ring step computes.

A layout is data: one ``Layout`` record per layout holds its rules (which positions a
rank holds, what lengths it splits, which masks it serves) and, for a rank holding queries
and a visiting K/V shard that started on rank ``src``, the (query rows, key rows, mask)
pairs a ring step computes (``step_pairs``); the one schedule engine in ``ring/`` runs
those lists for every layout, and no code compares layout names. Every function that
takes a layout takes its name or the record (``layout_of``).

World size W, global length N, n = N / W tokens per rank:

- contiguous: rank r holds [r*n, (r+1)*n). Causal work is lopsided: rank r computes
  r + 1 of the W steps.
- zigzag: the sequence is cut into 2W chunks of c = n / 2; rank r holds chunks r and
  2W-1-r. Every causal step costs half a full block pair, on every rank.
- stripe: rank r holds tokens t with t mod W == r. Every causal step is one block pair
  with a diagonal offset of 0 or -1.
- block_stripe: the sequence is cut into blocks of BLOCK = 128 tokens (the kernels' tile
  and block-mask block); rank r holds the blocks b with b mod W == r, in order. Balanced
  like stripe, for causal attention and for packed documents alike (busiest rank within
  2% of the mean at 128k on 2 and 4 ranks, docs/notes/documents.md), and each local block of
  128 rows is 128 consecutive tokens, so a document keeps the tiles it has on one device.
  A pair's positions jump by W * BLOCK every BLOCK rows, so its band (causal, window) is
  kept on global positions (``Pair.on_positions``); the own shard under causal alone is
  plain causal on local indices.

A block mask (block-sparse attention) enters as the set of (query chunk, key chunk)
pairs of GLOBAL chunks it leaves any block in (``occupied_chunks``; block_stripe's chunk r
is rank r's whole shard): pairs outside it are dropped like pairs the band leaves empty,
so steps and hops shrink the same way.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import NamedTuple, Optional

import torch
from einops import reduce

from .kernels.masks import BLOCK, PairMask, band_interval

LAYOUTS = ("contiguous", "zigzag", "stripe", "block_stripe")
# The layout of every function that takes one (shard, unshard, positions, ring_flash_attn,
# RingSelfAttention, SequenceParallel): balanced for causal attention, and its shards are
# two contiguous chunks, so masks that are local in the sequence (windows, documents) leave
# whole block pairs empty. It needs the global length divisible by 2W.
DEFAULT_LAYOUT = "zigzag"
# The layout for packed documents (segment_ids): balanced whatever the document lengths,
# on the tiles one device would compute (docs/masks-and-layouts.md, "Which layout").
DOCUMENTS_LAYOUT = "block_stripe"
_ALL = slice(None)

# (lo, hi) of kp - qp on GLOBAL positions (None: unbounded): what a pair's keys must satisfy.
# Causal is (None, 0); a window (left, right) is (-left, right), intersected with it.
Band = tuple[Optional[int], Optional[int]]
NO_BAND: Band = (None, None)


class Pair(NamedTuple):
    """One kernel call: local query rows, visiting key rows, and the band of local indices
    key j of the pair must satisfy against query i: band_lo <= j - i <= band_hi (None:
    unbounded). pos = (q_pos, k_pos, stride, jump): the global positions of query i and
    key j are q_pos + i * stride + (i // BLOCK) * jump and k_pos + j * stride
    + (j // BLOCK) * jump (jump: 0, or BLOCK (W - 1) for block_stripe); None for a pair
    merged across chunks, which masks nothing. on_positions: the band is on the global
    positions instead, band_lo <= kp - qp <= band_hi (kernels.masks.PairMask)."""

    q: slice
    k: slice
    band_lo: Optional[int] = None
    band_hi: Optional[int] = None
    pos: Optional[tuple[int, int, int, int]] = None
    on_positions: bool = False


class _Chunk(NamedTuple):
    """Local rows [start, start + length) holding global positions gpos + i * stride."""

    start: int
    length: int
    gpos: int
    stride: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _local_pair(qc: _Chunk, kc: _Chunk, band: Band, n: int,
                occupied: Optional[frozenset] = None) -> Optional[Pair]:
    """The pair of two chunks with its band in local indices, or None if no key is visible.
    kp - qp = d + (j - i) * stride, so lo <= kp - qp <= hi is a band of j - i."""
    if occupied is not None and (qc.gpos // qc.length, kc.gpos // kc.length) not in occupied:
        return None
    lo, hi = band
    d, stride = kc.gpos - qc.gpos, qc.stride
    lo_l = None if lo is None else _ceil_div(lo - d, stride)
    hi_l = None if hi is None else (hi - d) // stride
    diff_min, diff_max = -(qc.length - 1), kc.length - 1
    if ((hi_l is not None and hi_l < diff_min) or (lo_l is not None and lo_l > diff_max)
            or (lo_l is not None and hi_l is not None and lo_l > hi_l)):
        return None
    lo_l = None if lo_l is None or lo_l <= diff_min else lo_l
    hi_l = None if hi_l is None or hi_l >= diff_max else hi_l

    def rows(c: _Chunk) -> slice:
        return _ALL if c.length == n else slice(c.start, c.start + c.length)

    return Pair(rows(qc), rows(kc), lo_l, hi_l, (qc.gpos, kc.gpos, stride, 0))


def _merged(pairs: list[Pair], n: int) -> list[Pair]:
    """Unmasked pairs side by side (same key rows and adjacent query rows, or the reverse)
    become one kernel call; positions no longer describe the result, which masks nothing."""
    def span(s: slice):
        return (0, n) if s == _ALL else (s.start, s.stop)

    def joined(a: slice, b: slice):
        (a0, a1), (b0, b1) = span(a), span(b)
        if a1 != b0:
            return None
        return _ALL if (a0, b1) == (0, n) else slice(a0, b1)

    pairs = list(pairs)
    changed = True
    while changed:
        changed = False
        for x in range(len(pairs)):
            for y in range(len(pairs)):
                a, b = pairs[x], pairs[y]
                if x == y or a.band_lo is not None or a.band_hi is not None \
                        or b.band_lo is not None or b.band_hi is not None:
                    continue
                if a.k == b.k and (q := joined(a.q, b.q)) is not None:
                    new = Pair(q, a.k)
                elif a.q == b.q and (k := joined(a.k, b.k)) is not None:
                    new = Pair(a.q, k)
                else:
                    continue
                pairs = [p for i, p in enumerate(pairs) if i not in (x, y)] + [new]
                changed = True
                break
            if changed:
                break
    return sorted(pairs, key=lambda p: (span(p.q), span(p.k)))


@functools.lru_cache(maxsize=4096)
def step_pairs(layout, rank: int, src: int, world: int, local_len: int,
               band: Band = NO_BAND, merge: bool = True,
               occupied: Optional[frozenset] = None) -> tuple[Pair, ...]:
    """The block pairs rank ``rank`` computes against the K/V shard of rank ``src``, for
    keys visible iff band[0] <= kp - qp <= band[1] on global positions (``NO_BAND``: all)
    and, with ``occupied`` (a block mask's ``occupied_chunks``), only chunk pairs in it;
    ``layout``: a name or a ``Layout`` (``Layout.pairs``). With ``merge``, full pairs side
    by side become one call (positions then no longer matter)."""
    return layout_of(layout).pairs(rank, src, world, local_len, band, merge, occupied)


def gathered_pair(rows: range, local_len: int, band: Band = NO_BAND, keys: bool = True) -> Optional[Pair]:
    """A ring of two over the contiguous layout, with both ranks' rows side by side in one
    buffer of 2 n rows: the whole sequence, row = global position. The pair of the query
    rows ``rows`` against all 2 n keys (``keys``), or of all 2 n queries against the key
    rows ``rows``, for tensors holding just those rows; None where the band leaves nothing
    visible."""
    part, every = _Chunk(0, len(rows), rows.start, 1), _Chunk(0, 2 * local_len, 0, 1)
    return _local_pair(*((part, every) if keys else (every, part)), band, local_len)


def keys_within(pair: Pair, start: int, stop: int, n: int) -> Optional[Pair]:
    """The part of ``pair`` whose key rows lie in [start, stop) of the visiting shard's n
    rows, or None if its band leaves those keys nothing. Its band of local indices and its
    positions follow its new first key row (where positions jump, that row must be a
    multiple of BLOCK past the old one)."""
    keys = range(n)[pair.k]
    lo, hi = max(keys.start, start), min(keys.stop, stop)
    if lo >= hi:
        return None
    if (lo, hi) == (keys.start, keys.stop):
        return pair
    skip = lo - keys.start
    pos, band_lo, band_hi = pair.pos, pair.band_lo, pair.band_hi
    if pos is not None:
        q_pos, k_pos, stride, jump = pos
        if jump and skip % BLOCK:
            raise ValueError(f"keys cut at row {lo}: positions jump every {BLOCK} rows")
        pos = (q_pos, k_pos + skip * stride + skip // BLOCK * jump, stride, jump)
    if not pair.on_positions:  # j - i of the new key index j is skip less
        band_lo = None if band_lo is None else band_lo - skip
        band_hi = None if band_hi is None else band_hi - skip
    part = pair._replace(k=_ALL if (lo, hi) == (0, n) else slice(lo, hi), band_lo=band_lo,
                         band_hi=band_hi, pos=pos)
    if (band_lo is not None or band_hi is not None) and pair_area(part, n) == 0:
        return None
    return part


@functools.lru_cache(maxsize=4096)
def step_pieces(layout, rank: int, src: int, world: int, local_len: int,
                band: Band = NO_BAND, merge: bool = True, occupied: Optional[frozenset] = None,
                cuts: tuple[int, ...] = ()) -> tuple[tuple[Pair, ...], ...]:
    """``step_pairs`` cut along the visiting shard's key rows at ``cuts`` (increasing): for
    each piece [0, cuts[0]), [cuts[0], cuts[1]), ..., [cuts[-1], local_len), the pairs'
    parts whose keys lie in it. Together they compute exactly what the step does; a
    key-major pass (dK/dV) run piece by piece finishes the keys of one piece before the
    next, so their sums can start a trip while the rest is computed."""
    pairs = step_pairs(layout, rank, src, world, local_len, band, merge, occupied)
    bounds = (0, *cuts, local_len)
    return tuple(tuple(part for pair in pairs
                       if (part := keys_within(pair, lo, hi, local_len)) is not None)
                 for lo, hi in zip(bounds, bounds[1:]))


def active_steps(layout, world: int, local_len: int, band: Band = NO_BAND,
                 occupied: Optional[frozenset] = None) -> int:
    """Ring steps that compute anything on some rank: the steps after them are empty on
    every rank, so K/V stop travelling there (a sliding window shorter than the sequence
    needs about window / local_len hops instead of W - 1; a block mask, as many as the
    farthest occupied chunk pair needs)."""
    busy = [s for s in range(world) for r in range(world)
            if step_pairs(layout, r, (r - s) % world, world, local_len, band, occupied=occupied)]
    return max(busy, default=0) + 1


def pair_area(pair: Pair, n: int) -> int:
    """How many (query, key) elements of a pair (of a rank's n rows) its band leaves."""
    rows = torch.arange(len(range(n)[pair.q]))
    mask = PairMask(pair.band_lo, pair.band_hi, pos=pair.pos, band_on_positions=pair.on_positions)
    first, stop = band_interval(rows, mask, len(range(n)[pair.k]))
    return int((stop - first).clamp(min=0).sum())


def visible_keys(pair: Pair, n: int) -> range:
    """The key rows of a visiting shard (of n rows) that the pair's band leaves some query
    row of the pair, as a range of the shard's rows (empty: none)."""
    keys = range(n)[pair.k]
    rows = torch.arange(len(range(n)[pair.q]))
    mask = PairMask(pair.band_lo, pair.band_hi, pos=pair.pos, band_on_positions=pair.on_positions)
    first, stop = band_interval(rows, mask, len(keys))
    seen = first < stop
    if not bool(seen.any()):
        return range(keys.start, keys.start)
    return range(keys.start + int(first[seen].min()), keys.start + int(stop[seen].max()))


@functools.lru_cache(maxsize=256)
def remote_share(layout, world: int, local_len: int, band: Band = NO_BAND) -> float:
    """Over every rank, the least ratio of the elements its step 1 computes (the first
    remote shard) to those of its own step, counted from the bands (segment ids aside;
    under a block mask the ring counts its blocks instead). The ring's backward asks it to
    know whether a remote step is large enough to hide a transfer behind."""
    ratios = []
    for rank in range(world):
        own, remote = (sum(pair_area(p, local_len) for p in step_pairs(
            layout, rank, (rank - s) % world, world, local_len, band)) for s in (0, 1))
        ratios.append(remote / max(own, 1))
    return min(ratios)


def writes_first(pairs) -> bool:
    """Whether the own-shard step is one pair over every row (the ring's first step then
    writes its results instead of adding into zeroed buffers)."""
    return len(pairs) == 1 and pairs[0].q == pairs[0].k == _ALL


def check_layout(layout):
    """``layout`` (a name or a ``Layout``), once it names a layout; ValueError otherwise."""
    layout_of(layout)
    return layout


def check_local_length(local_len: int, layout, name: str, pieces: int = 1) -> None:
    """ValueError naming ``name`` unless a rank's ``local_len`` tokens of it can be its
    share of ``layout``'s shard (``pieces`` of them, U on a heads x ring grid, make one)."""
    try:
        layout_of(layout).check_local(local_len * pieces)
    except ValueError as error:
        grid = f" ({pieces} of them make a ring shard of {local_len * pieces})" if pieces > 1 else ""
        raise ValueError(f"{name} has {local_len} tokens on this rank{grid}: {error}") from None


def layout_of(layout) -> "Layout":
    """The ``Layout`` record of a layout name (or the record itself). A layout computed from
    the documents (``ringflash.document_layout``) is found by its name while it is among the
    last ``_KEPT`` such layouts made in this process."""
    if isinstance(layout, Layout):
        return layout
    if isinstance(layout, str):
        found = _BY_NAME.get(layout) or _MADE.get(layout)
        if found is not None:
            return found
        if layout.startswith(_MADE_PREFIX):
            raise ValueError(f"layout {layout!r} is not among the last {_KEPT} document layouts this "
                             "process made: pass the layout object itself")
    raise ValueError(f"layout must be one of {LAYOUTS} or a ringflash.document_layout, got {layout!r}")


def layout_name(layout) -> str:
    """The name the ring's custom ops take the layout by (a layout made at run time is
    remembered again, so that ``layout_of`` finds it)."""
    layout = layout_of(layout)
    return layout.name if layout.name in _BY_NAME else remember(layout).name


def layout_code(layout) -> int:
    """The layout as one integer the ranks compare (``agreement``): its index in LAYOUTS, or
    for a layout made from the documents, a 62-bit digest of what it was made from."""
    layout = layout_of(layout)
    return LAYOUTS.index(layout.name) if layout.name in _BY_NAME else layout.digest


def layout_shown(code: int) -> str:
    """The layout of ``layout_code`` in words."""
    return LAYOUTS[code] if 0 <= code < len(LAYOUTS) else f"{_MADE_PREFIX}{code:016x}"


def layout_from_spec(layout, spec: Optional[torch.Tensor]):
    """The layout a ring op was given: ``layout`` itself (a name, or in eager mode a layout
    object), or, with ``spec``, the layout that the maker of kind ``layout`` (``spec_maker``)
    builds from that CPU int64 tensor. Layouts computed at run time travel into the ops so
    under torch.compile: a tensor is a graph input, where a name would be a constant (a new
    graph per layout)."""
    return layout if spec is None else _SPEC_MAKERS[layout](spec)


def spec_maker(name: str):
    """Register the function that builds layouts of kind ``name`` from their spec tensor."""
    def register(make):
        _SPEC_MAKERS[name] = make
        return make
    return register


def remember(layout: "Layout") -> "Layout":
    """Keep a layout made at run time findable by its name (``layout_of``): the ring's
    custom ops take the layout by name."""
    _MADE[layout.name] = layout
    _MADE.move_to_end(layout.name)
    while len(_MADE) > _KEPT:
        _MADE.popitem(last=False)
    return layout


def global_positions(seqlen: int, layout, rank: int, world: int) -> torch.Tensor:
    """Global token ids held by ``rank``, in local order (int64, CPU)."""
    layout = layout_of(layout)
    layout.check_seqlen(seqlen, world)
    return layout.positions(seqlen, rank, world)


def check_block_layout(layout, world: int, local_len: int, block: int) -> int:
    """The layout's chunk length, if a block mask of ``block``-token blocks can be cut along
    it (ValueError otherwise; ``Layout.block_chunk``)."""
    return layout_of(layout).block_chunk(world, local_len, block)


def occupied_chunks(block_mask: torch.Tensor, layout, world: int, local_len: int,
                    block: int) -> frozenset:
    """The (query chunk, key chunk) pairs of GLOBAL chunks in which ``block_mask`` (heads or
    1, N / block, N / block) has a nonzero block: chunks are the layout's pieces (W for
    contiguous, 2W for zigzag), numbered along the sequence; for block_stripe, chunk r is
    every block of rank r. One host synchronization."""
    layout = layout_of(layout)
    per = layout.block_chunk(world, local_len, block) // block
    return layout.occupied(block_mask.any(0), world, local_len, block, per)


# ----------------------------------------------------------------------------- the layouts


class Layout:
    """How a sequence of N tokens is split over W ranks (n = N / W tokens each), and the
    rules that follow from it: one instance per layout (``layout_of`` finds it by name).

    ``local_multiple``: n must be a multiple of it. ``keeps_kv``: a ring of two over it may
    hold the whole sequence's K/V in global order (its shards are the two halves: the
    ring's gathered schedule, ``ring.keeps_kv``)."""

    name = ""
    local_multiple = 1
    keeps_kv = False

    def __repr__(self) -> str:
        return f"Layout({self.name!r})"

    def pieces(self, world: int) -> int:
        """How many equal pieces of consecutive positions the sequence is cut into."""
        return world

    def seqlen_multiple(self, world: int) -> int:
        return self.pieces(world)

    def check_seqlen(self, seqlen: int, world: int) -> None:
        parts = self.seqlen_multiple(world)
        if seqlen % parts:
            raise ValueError(f"seqlen {seqlen} cannot be split by layout {self.name!r} over {world} ranks: "
                             f"it must be a multiple of {self._multiple_words(world, parts)}")

    def _multiple_words(self, world: int, parts: int) -> str:
        return f"the world size {world}"

    def check_local(self, local_len: int) -> None:
        """ValueError if a rank's n tokens cannot be this layout's shard."""

    def check_masks(self, band: Band, window: tuple[int, int], block_mask: bool, segments: bool) -> None:
        """ValueError if the layout does not serve this combination of masks (``segments``:
        segment ids given)."""

    def positions(self, seqlen: int, rank: int, world: int) -> torch.Tensor:
        raise NotImplementedError

    def block_chunk(self, world: int, local_len: int, block: int) -> int:
        """The chunk length a block mask of ``block``-token blocks is cut along (ValueError
        where the chunks do not hold whole blocks)."""
        chunk = world * local_len // self.pieces(world)
        if chunk % block:
            raise ValueError(f"block_mask needs the layout's chunks ({chunk} tokens: seqlen_local "
                             f"{local_len}{self._chunk_words}) to be a multiple of the block size {block}")
        return chunk

    _chunk_words = ""

    def occupied(self, any_head: torch.Tensor, world: int, local_len: int, block: int, per: int) -> frozenset:
        """``occupied_chunks`` from the mask's blocks over every head, ``per`` blocks a chunk."""
        parts = self.pieces(world)
        grid = reduce(any_head, "(qc qb) (kc kb) -> qc kc", "any", qc=parts, kc=parts).cpu()
        return frozenset((int(a), int(c)) for a, c in grid.nonzero().tolist())

    def pairs(self, rank: int, src: int, world: int, local_len: int, band: Band, merge: bool,
              occupied: Optional[frozenset]) -> tuple[Pair, ...]:
        raise NotImplementedError


class _Runs(Layout):
    """A layout whose shards are a few runs of evenly spaced global positions (``runs``).

    Every pair of (query run, key run) of a step is classified from its positions: empty
    (dropped), full (no band) or partial (a band of local indices). The own shard under a
    causal band is one pair over every row: positions increase with the local index, so
    kp <= qp is j <= i."""

    def runs(self, rank: int, world: int, n: int) -> list[_Chunk]:
        raise NotImplementedError

    def pairs(self, rank, src, world, local_len, band, merge, occupied):
        pairs = [p for qc in self.runs(rank, world, local_len)
                 for kc in self.runs(src, world, local_len)
                 if (p := _local_pair(qc, kc, band, local_len, occupied)) is not None]
        if not merge:
            return tuple(pairs)
        if src == rank and band in (NO_BAND, (None, 0)) and len(pairs) > 1:
            return (Pair(_ALL, _ALL, None, band[1]),)
        return tuple(_merged(pairs, local_len))


class Contiguous(_Runs):
    """Rank r holds [r n, (r + 1) n). Causal work is lopsided: rank r computes r + 1 of the
    W steps; a sliding window reaches about window / n ranks back."""

    name = "contiguous"
    keeps_kv = True

    def runs(self, rank, world, n):
        return [_Chunk(0, n, rank * n, 1)]

    def positions(self, seqlen, rank, world):
        n = seqlen // world
        return torch.arange(rank * n, (rank + 1) * n)


class Zigzag(_Runs):
    """The sequence cut into 2W chunks of c = n / 2; rank r holds chunks r and 2W - 1 - r.
    Every causal step costs half a full block pair, on every rank."""

    name = "zigzag"
    local_multiple = 2
    _chunk_words = " / 2"

    def pieces(self, world):
        return 2 * world

    def _multiple_words(self, world, parts):
        return f"2 x world size = {parts}"

    def check_local(self, local_len):
        if local_len % 2:
            raise ValueError(f"layout 'zigzag' needs an even seqlen_local (two chunks a rank), got {local_len}")

    def runs(self, rank, world, n):
        c = n // 2
        return [_Chunk(0, c, rank * c, 1), _Chunk(c, c, (2 * world - 1 - rank) * c, 1)]

    def positions(self, seqlen, rank, world):
        c = seqlen // world // 2
        first, second = rank * c, (2 * world - 1 - rank) * c
        return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


class Stripe(_Runs):
    """Rank r holds the tokens t with t mod W = r: every causal step is one block pair with a
    diagonal offset of 0 or -1. A block mask cannot be cut along it."""

    name = "stripe"

    def runs(self, rank, world, n):
        return [_Chunk(0, n, rank, world)]

    def positions(self, seqlen, rank, world):
        return torch.arange(rank, seqlen, world)

    def block_chunk(self, world, local_len, block):
        raise ValueError("block_mask needs layout 'contiguous', 'zigzag' or 'block_stripe': "
                         "stripe shards interleave the tokens of every block")


class BlockStripe(Layout):
    """Blocks of BLOCK tokens dealt round-robin: rank r holds the blocks b with b mod W = r,
    in order. Its rows jump by W BLOCK positions every BLOCK rows, so a band (causal,
    window) stays on global positions (``Pair.on_positions``)."""

    name = "block_stripe"
    local_multiple = BLOCK

    def seqlen_multiple(self, world):
        return BLOCK * world

    def _multiple_words(self, world, parts):
        return f"{BLOCK} x world size = {parts}"

    def check_local(self, local_len):
        if local_len % BLOCK:
            raise ValueError(f"layout 'block_stripe' needs seqlen_local a multiple of {BLOCK} (whole "
                             f"blocks a rank), got {local_len}")

    def check_masks(self, band, window, block_mask, segments):
        if block_mask and band not in ((None, None), (None, 0)):
            raise ValueError(f"block_mask with layout 'block_stripe' takes causal or full attention, "
                             f"not window_size {window}: a window cuts the shards' blocks (layouts "
                             "'contiguous' and 'zigzag' take both)")

    def positions(self, seqlen, rank, world):
        return torch.arange(seqlen).view(-1, BLOCK)[rank::world].reshape(-1)

    def block_chunk(self, world, local_len, block):  # its pieces are the blocks themselves
        if local_len % block:
            raise ValueError(f"block_mask with layout 'block_stripe' needs seqlen_local a multiple "
                             f"of the block size {block}, got {local_len}")
        return block

    def occupied(self, any_head, world, local_len, block, per):  # global block a W + r: rank r's a-th
        grid = reduce(any_head, "(qa qr) (ka kr) -> qr kr", "any", qr=world, kr=world).cpu()
        return frozenset((int(a), int(c)) for a, c in grid.nonzero().tolist())

    def pairs(self, rank, src, world, local_len, band, merge, occupied):
        """The one pair of a step (none where the band or a block mask leaves it empty).
        Query row i of rank r is at global position r BLOCK + i + (i // BLOCK) (W - 1) BLOCK,
        key row j of shard s likewise: the band stays on positions, and each row still sees
        one interval of key rows (``masks.band_interval``), which also tells an empty pair or
        a full one. The own shard keeps the global order, so causal alone is j <= i there."""
        if occupied is not None and (rank, src) not in occupied:
            return ()
        pos = (rank * BLOCK, src * BLOCK, 1, (world - 1) * BLOCK)
        if src == rank and band == (None, 0):
            return (Pair(_ALL, _ALL, None, 0, pos),)
        if band == NO_BAND:
            return (Pair(_ALL, _ALL, pos=pos),)
        pair = Pair(_ALL, _ALL, *band, pos, True)
        area = pair_area(pair, local_len)
        if area == 0:
            return ()
        return (Pair(_ALL, _ALL, pos=pos),) if area == local_len * local_len else (pair,)


_BY_NAME = {layout.name: layout for layout in (Contiguous(), Zigzag(), Stripe(), BlockStripe())}
assert tuple(_BY_NAME) == LAYOUTS
# Layouts made at run time (``ringflash.document_layout``), by name, the newest last.
_MADE: "OrderedDict[str, Layout]" = OrderedDict()
_SPEC_MAKERS: dict = {}  # kind -> layout from its spec tensor (``layout_from_spec``)
_MADE_PREFIX = "documents-"
_KEPT = 256
