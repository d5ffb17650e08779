"""What a call's ring runs: the number of active steps and each step's block pairs (from the
layout), and a global block mask as the ring uses it (which chunk pairs it occupies, each
pair's blocks of it, and what the ring of two decides from them); the kernel's mask of one
pair (``pair_mask``)."""

from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple, Optional

import torch

from ..exchange import Ring
from ..kernels import PairMask
from ..kernels.masks import BAND_INF, BLOCK, Blocks, block_work, computed_blocks, pair_positions, tensor_memo
from ..layouts import (Band, Pair, active_steps, keys_within, occupied_chunks, step_pairs, step_pieces,
                       visible_keys, writes_first)
from .rows import uncovered


# What one block costs the kernels, ms per 4096 programs (docs/notes/ring-of-two.md, "The ring
# of two at 32k on 2 × H200: the GPU's time, launch by launch"): a query block's forward and
# dQ, a key block's dK/dV.
_ROW_COST, _KEY_COST = 0.061 + 0.084, 0.126


class SparsePlan:
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
        a block mask, and ``pair_mask`` drops it)."""
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
        """A ring of two that kept the other rank's K/V (``gathered_backward``): the global key row
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


class Schedule(NamedTuple):
    """What a call's ring runs: the number of active steps, each step's pairs, whether step
    0 writes its results (one pair over every row), the block mask's plan or None,
    ``pieces(step, cuts)``: the step's pairs cut along key rows (``layouts.step_pieces``),
    for two active steps, whether on EVERY rank the own step's pairs keep to disjoint
    key rows (a choice of schedule that depends on it must be the same on every rank: the
    ranks' messages pair up; False for other step counts), and ``sent``: per rank, the rows
    [lo, hi) of its K/V shard that travel (``travelling_rows``), or None where whole shards
    do. Where they are cut, the pairs of steps 1 on read key rows of the travelling part.
    ``direct``: the shards go straight to the ranks that compute them (``takes_direct``),
    and ``routes``: where shards travel cut, per source rank and step the rows it sends
    (``routes``); the pairs of steps 1 on then read key rows of the step's route."""

    steps: int
    pairs: list
    first_writes: bool
    plan: Optional[SparsePlan]
    pieces: Callable[[int, tuple[int, ...]], tuple]
    own_apart: bool
    sent: Optional[tuple[tuple[int, int], ...]] = None
    direct: bool = False
    routes: Optional[tuple] = None


SCHEDULE_ENV = "RINGFLASH_SCHEDULE"
SCHEDULES = ("auto", "rotate", "direct")


def schedule_choice() -> str:
    """RINGFLASH_SCHEDULE (read at each call): "auto" (the default), "rotate" or "direct"."""
    choice = os.environ.get(SCHEDULE_ENV, "auto").strip().lower()
    if choice not in SCHEDULES:
        raise ValueError(f"{SCHEDULE_ENV} must be one of {SCHEDULES}, got {choice!r}")
    return choice


def takes_direct(steps: int, sent, choice: Optional[str] = None) -> bool:
    """Whether a ring of ``steps`` active steps whose shards travel as ``sent``
    (``travelling_rows``) takes the direct schedule (rotate.py): every rank sends its shard
    straight to each rank that computes it, all at once, and each partial dK/dV sum goes
    straight home, instead of passing shards and running sums from neighbour to neighbour.
    The two differ only from three steps on. "auto" takes it where shards travel cut (a
    layout computed from packed documents, windows): there a rank's steps are uneven, and
    behind a short step a rotation's next trip and running sum are exposed, where the
    direct schedule posts every trip at the start (docs/performance.md, "Cost model").
    ``choice``: one of SCHEDULES, or None to read RINGFLASH_SCHEDULE (the cost model passes
    its own)."""
    choice = schedule_choice() if choice is None else choice
    return steps >= 3 and (choice == "direct" or (choice == "auto" and sent is not None))


@functools.lru_cache(maxsize=1024)
def _seen(layout, world: int, n: int, band: Band, merge: bool, steps: int,
          occupied: Optional[frozenset]) -> tuple[tuple[tuple[int, int, bool], ...], ...]:
    """Per source rank src, per step s = 1 … steps - 1, (lo, hi, jumps): the rows [lo, hi)
    of src's shard that rank src + s's pairs see (``layouts.visible_keys``; lo == hi: none),
    and whether a pair's positions jump."""
    table = []
    for src in range(world):
        row = []
        for s in range(1, steps):
            pairs = step_pairs(layout, (src + s) % world, src, world, n, band, merge, occupied)
            keys = [r for r in (visible_keys(pair, n) for pair in pairs) if len(r)]
            row.append((min((r.start for r in keys), default=0), max((r.stop for r in keys), default=0),
                        any(pair.pos is not None and pair.pos[3] for pair in pairs)))
        table.append(tuple(row))
    return tuple(table)


def _rows(lo: int, hi: int, jumps: bool, n: int) -> tuple[int, int]:
    """[lo, hi), at least one row, on whole blocks of BLOCK where positions jump."""
    if jumps:
        lo, hi = lo // BLOCK * BLOCK, min(n, -(-hi // BLOCK) * BLOCK)
    return lo, max(hi, lo + 1)


@functools.lru_cache(maxsize=1024)
def travelling_rows(layout, world: int, n: int, band: Band, merge: bool, steps: int,
                    occupied: Optional[frozenset] = None) -> Optional[tuple[tuple[int, int], ...]]:
    """Per source rank, the rows [lo, hi) of its K/V shard that the pairs of steps 1 to
    steps - 1 see on the ranks it visits (``layouts.visible_keys``; at least one row, and
    whole blocks of BLOCK where a pair's positions jump); None where together they are more
    than half of all shards' rows. A shard then travels as those rows only: packed documents on a layout computed from
    them send the few documents that cross ranks, a sliding window over contiguous shards
    its last window of keys, causal contiguous shards nothing backwards. The same on every
    rank (it is computed from every rank's pairs), so the messages' sizes agree."""
    rows = []
    for seen in _seen(layout, world, n, band, merge, steps, occupied):
        some = [(lo, hi) for lo, hi, _ in seen if lo < hi]
        rows.append(_rows(min((lo for lo, _ in some), default=0), max((hi for _, hi in some), default=1),
                          any(jumps for *_, jumps in seen), n))
    # Cut shards keep the ring of two off ``_home_first`` (rotate.py): worth it only where
    # they save at least half of what whole shards carry (documents, windows), not for the
    # block or chunk that causal attention leaves unseen on block_stripe or zigzag.
    return None if sum(hi - lo for lo, hi in rows) > world * n // 2 else tuple(rows)


@functools.lru_cache(maxsize=1024)
def routes(layout, world: int, n: int, band: Band, merge: bool, steps: int,
           occupied: Optional[frozenset] = None) -> Optional[tuple[tuple[Optional[tuple[int, int]], ...], ...]]:
    """What the direct schedule sends where shards travel cut (``travelling_rows`` not
    None): per source rank, per step s = 1 … steps - 1, the rows [lo, hi) of its shard
    that rank src + s's pairs see (inside its travelling rows), or None where they see
    none (one row then travels, and no pair runs). Each rank gets only what its own queries
    see, not every row that some rank sees: on packed documents over 8 ranks most of a
    long document's rows go to the one or two ranks holding its later pieces."""
    if travelling_rows(layout, world, n, band, merge, steps, occupied) is None:
        return None
    return tuple(tuple(_rows(lo, hi, jumps, n) if lo < hi else None for lo, hi, jumps in seen)
                 for seen in _seen(layout, world, n, band, merge, steps, occupied))


def _travelling(pairs: tuple, rows: tuple[int, int], n: int) -> tuple:
    """Pairs cut to the key rows [lo, hi) that travel, and their key rows counted from lo
    (positions and bands follow the cut: ``layouts.keys_within``)."""
    lo, hi = rows
    if (lo, hi) == (0, n):
        return pairs
    cut = [part for pair in pairs if (part := keys_within(pair, lo, hi, n)) is not None]
    return tuple(part._replace(k=slice(range(n)[part.k].start - lo, range(n)[part.k].stop - lo)) for part in cut)


def schedule_of(ring: Ring, layout: str, local_len: int, band: Band, dropout: tuple,
                blocks: Optional[torch.Tensor]) -> Schedule:
    """The call's ``Schedule``. With dropout or a block mask, pairs keep their global
    positions (no merging across chunks)."""
    plan = None if blocks is None else tensor_memo(
        blocks, ("plan", layout, ring.world, local_len),
        lambda: SparsePlan(blocks, layout, ring.world, local_len))
    occupied = None if plan is None else plan.occupied
    steps = active_steps(layout, ring.world, local_len, band, occupied) if ring.world > 1 else 1
    merge = dropout[0] == 0 and blocks is None

    def of(rank: int, s: int) -> tuple:
        return (layout, rank, (rank - s) % ring.world, ring.world, local_len, band, merge, occupied)

    pairs = [step_pairs(*of(ring.rank, s)) for s in range(steps)]
    own_apart = steps == 2 and all(  # read by a ring of two only
        uncovered([pair.k for pair in step_pairs(*of(rank, 0))], local_len) is not None
        for rank in range(ring.world))
    # Cut shards travel where no block mask is given (its ring of two may keep whole shards).
    sent = None if blocks is not None or steps == 1 else travelling_rows(
        layout, ring.world, local_len, band, merge, steps)
    direct = takes_direct(steps, sent)
    table = routes(layout, ring.world, local_len, band, merge, steps) if direct else None
    if sent is not None:
        pairs = [pairs[0]] + [_travelling(p, sent[(ring.rank - s) % ring.world], local_len) if table is None
                              else _routed(p, table[(ring.rank - s) % ring.world][s - 1], local_len)
                              for s, p in enumerate(pairs[1:], 1)]
    return Schedule(steps, pairs, writes_first(pairs[0]), plan,
                    lambda s, cuts: step_pieces(*of(ring.rank, s), cuts), own_apart, sent, direct, table)


def _routed(pairs: tuple, route: Optional[tuple[int, int]], n: int) -> tuple:
    """A direct step's pairs cut to its route's rows (``routes``); none where it sees none."""
    return () if route is None else _travelling(pairs, route, n)


def _own_ids(ids: torch.Tensor, part: slice) -> torch.Tensor:
    """The rank's own ids of a pair's rows, one tensor per slice while the ids stay
    unmodified: the own shard's pair then hands its kernels one tensor on both sides, and
    they compute its segment ranges once for the forward and both backward passes. (Not
    for the ring's buffers: a receive rewrites them without bumping their version.)"""
    return tensor_memo(ids, ("pair_ids", part.start, part.stop, part.step),
                       lambda: ids[:, part].clone(memory_format=torch.contiguous_format))


def pair_mask(pair, q_segments, k_segments, dropout: tuple, plan, blocks) -> PairMask:
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
    p, seed, *head0 = dropout  # (p, seed[, the global index of head 0])
    return PairMask(lo, hi, q_segments, k_segments, p, seed, pair.pos, pair_blocks, on_positions,
                    head0[0] if head0 else 0)


def tile_pieces(pair: Pair, n: int) -> tuple[Pair, ...]:
    """``pair`` (of a shard of ``n`` rows) cut where its rows stop filling whole tiles of
    BLOCK: the part of whole tiles on both sides, which the Gluon backward takes, and the
    rest (a sliver of queries, one of keys, their corner), each with its band and positions
    moved to its own first rows; ``(pair,)`` where nothing is cut (rows already whole
    tiles, fewer than one tile, strided, or a band on positions). Every element of the pair
    lies in one piece, so the pieces' gradients add up to the pair's. A document layout's
    pieces that two ranks share have rows of any length (ringflash/documents.py)."""
    q, k = range(n)[pair.q], range(n)[pair.k]
    whole_q, whole_k = len(q) // BLOCK * BLOCK, len(k) // BLOCK * BLOCK
    if (q.step != 1 or k.step != 1 or pair.on_positions or not whole_q or not whole_k
            or (whole_q, whole_k) == (len(q), len(k))):
        return (pair,)
    return tuple(_sub_pair(pair, q.start, k.start, a, b, c, d)
                 for a, b in ((0, whole_q), (whole_q, len(q))) for c, d in ((0, whole_k), (whole_k, len(k)))
                 if a < b and c < d)


def _sub_pair(pair: Pair, q0: int, k0: int, a: int, b: int, c: int, d: int) -> Pair:
    """The pair's query rows [a, b) and key rows [c, d) (a and c multiples of BLOCK), as a
    pair of their own: j - i of its rows is the pair's minus c - a."""
    lo, hi = (None if x is None else x - (c - a) for x in (pair.band_lo, pair.band_hi))
    pos = pair.pos
    if pos is not None:
        qp, kp, stride, jump = pos
        pos = (qp + a * stride + a // BLOCK * jump, kp + c * stride + c // BLOCK * jump, stride, jump)
    return Pair(slice(q0 + a, q0 + b), slice(k0 + c, k0 + d), lo, hi, pos, pair.on_positions)
