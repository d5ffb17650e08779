"""A cost model of the ring, on the CPU and exact in what it counts: per rank and per ring
step, the visible (query, key) pairs, the kernel tiles they touch, the kernel calls the
step runs and the rows their programs cover, and the bytes each link carries, for any
world size W, global length N, layout and mask (causal, a sliding window, packed
documents); then a time per rank and an efficiency from a few measured constants
(``Costs``); ``ringflash.cost_bound`` adds a bound for a layout built from the documents,
``ringflash.cost_grid`` the heads x ring grid (an all-to-all over heads around this ring).
benchmarks/predict_scaling.py prints its calibration against the committed measurements
and its predictions for W = 8-64 (docs/performance.md, "Cost model").

What is counted (``ring_counts``), from the layout's own positions
(``layouts.global_positions``): query q sees the keys [lo(q), hi(q)] of the sequence
(``row_bounds``: causal, window, its document; a padding row sees none). The keys of a
shard are increasing positions, so on the shard of rank ``src`` the row sees the local
key rows [H(lo), H(hi + 1)), H(x) = the shard's tokens before position x. Sums of H over a
rank's rows come from histograms of whole 128-token units and one matrix product, so
N = 4M over W = 64 counts in 0.5-2.5 s on 2 cores; a layout whose shards are not whole
units (stripe) is counted token by token. A query tile (128 local rows) touches the key tiles
between its rows' first and last visible key row, as the kernels iterate them; a tile is
full when every row sees every key of it (no mask applied), partial otherwise.

What the ring runs (ring/plan.py, ring/rotate.py), from its own schedule: ``steps`` = the
steps the layout leaves anything to on some rank (``layouts.active_steps``: for a fixed
layout the band, causal or window; document boundaries do not shorten its ring; a layout
computed from the documents runs only the steps its crossing documents need); at each step
the layout's block pairs (``layouts.step_pairs``), one kernel call each in the forward, the
dQ pass and the dK/dV pass, whose programs run over the pair's query rows (forward, dQ) or
key rows (dK/dV), visible keys or not; cut to the rows that travel where shards travel cut
(``ring.plan.travelling_rows``). Each step but the last brings the next K/V shard (with its
segment ids) in the forward and again in the backward, and from the third step on the
backward's running fp32 dK/dV sum of the step's shard; after the last step that sum goes
home under the own shard's dK/dV pass (``rotate._rotate``); a ring of two whose whole
shards travel and whose remote step is large takes the sum home early, in two pieces
(``rotate._home_first``; ``RingCounts.early_home``). ``rank_times`` lays these out pass by
pass (``cost_timeline.rotation``); from three steps on where shards travel cut (``ring_counts``'
``schedule``: RINGFLASH_SCHEDULE), the direct schedule instead (``RingCounts.direct``,
``cost_timeline.direct``): shards straight to the ranks computing them, partial dK/dV sums straight home.
"""

from __future__ import annotations

import functools
from itertools import accumulate
from typing import NamedTuple, Optional, Sequence

import torch
from einops import rearrange

from .kernels.masks import BLOCK
from .api import check_cu_seqlens
from .kernels import band_of_window
from .layouts import active_steps, global_positions, keys_within, layout_of, remote_share, step_pairs
from .ring.plan import SCHEDULES, routes, takes_direct, travelling_rows
from . import cost_timeline as timeline
from .ring.rows import uncovered

# Counting token by token (a layout whose shards are not whole 128-token units) holds
# world x seqlen numbers; past this it raises rather than run for minutes.
TOKENWISE_LIMIT = 1 << 26
# The problem the constants were measured on (bench_masks.py): 32 heads, head_dim 128.
_REF_WIDTH = 32 * 128


class Mask(NamedTuple):
    """A mask on global positions, as ``ring_flash_attn`` takes it: ``causal``;
    ``window`` (left, right), -1 unbounded; ``cu_seqlens``: packed documents, document d
    holds tokens [cu_seqlens[d], cu_seqlens[d + 1]), tokens from cu_seqlens[-1] on are
    padding (None: one document)."""

    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    cu_seqlens: Optional[tuple[int, ...]] = None

    @classmethod
    def documents(cls, lengths: Sequence[int], causal: bool = True,
                  window: tuple[int, int] = (-1, -1)) -> "Mask":
        """Documents of ``lengths`` tokens packed from position 0."""
        return cls(causal, window, tuple(accumulate(map(int, lengths), initial=0)))


class Costs(NamedTuple):
    """The time model's constants, for 32 heads of head_dim 128 in bf16 (compute scales with
    heads x head_dim, bytes with kv_heads x head_dim x dtype bytes). Forward+backward, each
    pass taking its share (``PASS_SHARES``) of a tile's and of a row's time:

    tile_ms: one fully visible 128 x 128 tile (all heads).
    partial: a partly visible tile's time over a full one's (the mask is applied).
    row_ms: per 128 rows a step's kernel calls run over (the forward and dQ passes over the
        pairs' query rows, dK/dV over their key rows): what every tile program pays
        whatever it sees (loading its rows, merging the running out, the passes' fp32
        read-modify-writes).
    step_ms: per step: what the step's launches cost beyond their programs (a pass split at
        a step boundary pays a launch's ramp and tail and the merge of its partial sums).
    link_gbps: bytes a link carries beside the kernels, GB/s (copy engines).
    message_ms: per exchange, beside its bytes: the copy-engine transport's handshakes
        before and after the copies (``exchange.PeerRing``; barriers of the whole group
        when the constants were fitted), paid where the exchange is not hidden behind the
        kernels it runs beside.
    keeps_received: the ring's messages go through torch.distributed (across nodes), so the
        direct schedule keeps the rows it received for the backward (eager calls: ops.py).
    gluon: a step's tile and row time on the Gluon kernels over the Triton kernels' (those
        the constants were fitted to), for the steps they serve (not ``RingCounts.triton``)."""

    tile_ms: float
    partial: float
    row_ms: float
    step_ms: float
    link_gbps: float
    message_ms: float = 0.0
    keeps_received: bool = False
    gluon: float = 1.0


# The forward's, the dQ pass's and the dK/dV pass's shares of a tile's and a row's time,
# measured, not fitted: the forward is 0.21-0.24 (mean 0.227) of one GPU's forward+backward in
# the committed mask runs (fwd_ms / fwdbwd_ms of every ringflash_1gpu record of masks_*.json),
# and dQ 0.37-0.40 of the backward in the kernel-by-kernel traces and launch sweeps
# (docs/notes/host-time.md, "Kernel by kernel" and "What a split launch costs").
PASS_SHARES = (0.23, 0.29, 0.48)

# Fitted by ``python benchmarks/predict_scaling.py --fit`` (2026-11-27) to every committed 2- and
# 4-GPU mask row the script reads (masks_h100x2.json, masks_h100x2_512k.json, masks_h200x2.json,
# masks_h200x4.json: their ring efficiencies and 1-GPU times) and the 4 x H100 efficiencies
# quoted in it, rms error 3.4%; every row within 8.9%. partial is held at 1 (a partly visible
# tile runs the products of a full one and applies the mask; fitted, it goes to 0.78 for 0.03
# points less rms error) and link_gbps at the copy engines' 393 GB/s beside the kernels on
# 2 x H100 (docs/notes/ring-of-two.md, "The ring of two at 32k"; fitted, it comes back at 393).
# step_ms, 0.40 ms, is of the order a pass split at a step boundary was measured to cost on one
# H100 (forward +0.20-0.29, dQ +0.24-0.26, dK/dV +0.05-0.10 ms: docs/notes/ring-of-two.md, "What
# splitting a launch costs"); message_ms, 0.24 ms, of two group barriers (the 2 x H100 trace of
# the same note: the copies "behind a 0.11 ms barrier", and an exchange has two). H100 and H200
# share them: their kernels run at one speed (masks_h200.json).
H100 = Costs(tile_ms=2.005e-3, partial=1.0, row_ms=8.597e-3, step_ms=0.4031, link_gbps=393.0, message_ms=0.2446)
# The kernels of today's Hopper runs (bf16, head_dim 128: kernels/dispatch.py): the 1-GPU kernel's
# measured time over the model's in the runs on them (masks_h100x4_window.json,
# masks_h100x4_direct_*.json, masks_h200x4_documents.json, 2026-11-28): 0.77-0.80.
H100_GLUON = H100._replace(gluon=0.79)


class RingCounts(NamedTuple):
    """What each rank computes at each ring step: tensors (W, W) indexed [rank, step], the
    step s of rank r holding the shard of rank (r - s) mod W. int64 throughout.

    visible: (query, key) pairs its queries see in that shard.
    touched: 128 x 128 (query tile, key tile) pairs holding any visible pair.
    full: those of ``touched`` whose every pair is visible.
    steps: the steps the ring runs (``layouts.active_steps``); later steps are empty.
    calls: the kernel calls the step runs in each pass: its block pairs
        (``layouts.step_pairs``, as the ring's schedule has them).
    q_blocks, k_blocks: the 128-row blocks of query rows (forward and dQ passes) and of key
        rows (dK/dV) the step's kernel calls run programs over: over its pairs, ceil(rows / 128)
        each, cut to the rows that travel where shards travel cut.
    received: None where whole shards travel; else [rank, step] the K/V rows the rank
        receives during the step (``ring.plan.travelling_rows``).
    early_home: the backward takes a ring of two's early trip home (``rotate._home_first``):
        two steps, whole shards, no rank's own pairs overlapping in key rows and every remote
        step at least half its own step (``layouts.remote_share``); the rotation otherwise.
    direct: the direct schedule (``ring.plan.takes_direct``): three steps or more, and the
        schedule "direct", or "auto" where shards travel cut (``travelling_rows`` not None;
        not ``received``, set for a layout computed from the documents whatever travels).
    cut: shards travel cut; with the direct schedule and ``Costs.keeps_received`` the
        backward then starts on the rows the forward received (``ring_forward``'s keep_received).
    triton: None (every step), or (W, W) bool [rank, step]: the step's pairs hold a band on
        global positions (block_stripe's rows jump), which only the Triton kernels take.
    """

    world: int
    seqlen: int
    layout: str
    visible: torch.Tensor
    touched: torch.Tensor
    full: torch.Tensor
    steps: int
    calls: Optional[torch.Tensor] = None
    q_blocks: Optional[torch.Tensor] = None
    k_blocks: Optional[torch.Tensor] = None
    received: Optional[torch.Tensor] = None
    early_home: bool = False
    direct: bool = False
    cut: bool = False
    triton: Optional[torch.Tensor] = None

    @property
    def local_len(self) -> int:
        return self.seqlen // self.world


# ----------------------------------------------------------------------------- what a row sees


def row_bounds(seqlen: int, mask: Mask, rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi), int64 shaped like ``rows`` (global positions; None: every position): query q
    sees the keys [lo, hi] on global positions (a padding row: lo = q + 1, hi = q, nothing).
    Both do not decrease along q, and lo <= q <= hi wherever q sees anything."""
    left, right = mask.window
    if left < -1 or right < -1:
        raise ValueError(f"window must be (left, right) with -1 for unbounded, got {mask.window}")
    q = torch.arange(seqlen) if rows is None else rows
    lo, hi = torch.zeros_like(q), torch.full_like(q, seqlen - 1)
    if mask.cu_seqlens is not None:
        bounds = check_cu_seqlens(torch.as_tensor(mask.cu_seqlens), seqlen)
        doc = torch.searchsorted(bounds[1:], q, right=True).clamp(max=max(bounds.numel() - 2, 0))
        lo, hi = bounds[doc], bounds[(doc + 1).clamp(max=bounds.numel() - 1)] - 1
    if mask.causal:
        hi = torch.minimum(hi, q)
    if left >= 0:
        lo = torch.maximum(lo, q - left)
    if right >= 0:
        hi = torch.minimum(hi, q + right)
    if mask.cu_seqlens is not None:  # padding: sees nothing (and is never seen: not in any [lo, hi])
        pad = q >= int(mask.cu_seqlens[-1])
        lo, hi = torch.where(pad, q + 1, lo), torch.where(pad, q, hi)
    return lo, hi


# ----------------------------------------------------------------------------- who holds what


class _Shards(NamedTuple):
    """The layout's shards in units of 2^``shift`` tokens (128 where every shard is made of
    whole aligned 128-token blocks, else 1): ``owner`` (N / unit + 1,) the rank holding each
    unit (-1 past the end); ``below`` (W, N / unit + 1) float64, rank src's tokens before
    unit u; ``positions`` (W, n) each rank's global positions in local order; ``base``
    (N,) the rank holding each token times the number of units (a histogram's row)."""

    shift: int
    owner: torch.Tensor
    below: torch.Tensor
    positions: torch.Tensor
    base: torch.Tensor

    def held_before(self, x: torch.Tensor) -> torch.Tensor:
        """(W, *x.shape) int64: H_src(x), the tokens of shard src at positions < x (0 <= x <= N),
        which is also the local key row where position x would sit."""
        u, off = x >> self.shift, x & ((1 << self.shift) - 1)
        mine = self.owner[u] == torch.arange(self.below.shape[0]).view(-1, *([1] * x.dim()))
        return self.below[:, u].long() + mine * off


@functools.lru_cache(maxsize=4)  # the masks of one (world, seqlen, layout) share it
def _shards(world: int, seqlen: int, layout: str) -> _Shards:
    positions = torch.stack([global_positions(seqlen, layout, r, world) for r in range(world)])
    n = seqlen // world
    rank_of = torch.empty(seqlen, dtype=torch.long)
    rank_of[positions] = torch.arange(world)[:, None]
    unit = BLOCK
    if n % BLOCK == 0:
        runs = rearrange(positions, "w (t b) -> w t b", b=BLOCK)
        aligned = bool((runs[..., :1] % BLOCK == 0).all())
        if not (aligned and bool((runs == runs[..., :1] + torch.arange(BLOCK)).all())):
            unit = 1
    else:
        unit = 1
    if unit == 1 and world * seqlen > TOKENWISE_LIMIT:
        raise ValueError(f"layout {layout!r} over {world} ranks at seqlen {seqlen}: its shards are not whole "
                         f"{BLOCK}-token blocks, so they are counted token by token, which needs "
                         f"world x seqlen <= {TOKENWISE_LIMIT}")
    owner = torch.cat([rank_of[::unit], torch.tensor([-1])])
    held = (owner[:-1, None] == torch.arange(world)).double() * unit  # (units, W)
    below = torch.cat([torch.zeros(1, world, dtype=torch.float64), held.cumsum(0)]).T.contiguous()
    return _Shards(unit.bit_length() - 1, owner, below, positions, rank_of * owner.numel())


# ----------------------------------------------------------------------------- counting


class _Rows(NamedTuple):
    """What the rows of a (seqlen, mask) see, kept for every layout and world size: ``lo``,
    ``hi`` (N,) (``row_bounds``), and where N is a multiple of 128, per global block of 128
    rows: ``stats`` (4, N / 128), ``_tile_stats``'s four numbers, and ``entries``: for hi + 1
    and for lo, the block's rows grouped by the unit of 128 positions they fall in, as
    (block, unit, rows, sum of offsets in the unit) (a few a block: both do not decrease)."""

    lo: torch.Tensor
    hi: torch.Tensor
    stats: Optional[torch.Tensor]
    entries: Optional[tuple]


def _stats(lo: torch.Tensor, hi: torch.Tensor, real: torch.Tensor, seqlen: int) -> torch.Tensor:
    """(4, ...) over the last dim of rows: the least lo and the largest hi + 1 of the rows that
    see anything, and the largest lo and least hi + 1 of all real rows (a row seeing nothing
    makes both empty, so no key tile is full)."""
    seen = real & (lo <= hi)
    blind = (real & ~seen).any(-1)
    return torch.stack([torch.where(seen, lo, seqlen).amin(-1), torch.where(seen, hi + 1, 0).amax(-1),
                        torch.where(blind, seqlen, torch.where(real, lo, 0).amax(-1)),
                        torch.where(blind, 0, torch.where(real, hi + 1, seqlen).amin(-1))])


def _grouped(x: torch.Tensor, units: int) -> tuple:
    """(block, unit, rows, offset sum) of the rows (in order) grouped by (row // 128, x // 128);
    x must not decrease along the rows."""
    key = (torch.arange(x.numel()) >> 7) * units + (x >> 7)
    key, count = torch.unique_consecutive(key, return_counts=True)
    ends = torch.cat([torch.zeros(1, dtype=torch.long), (x & (BLOCK - 1)).cumsum(0)])[count.cumsum(0)]
    return key // units, key % units, count.double(), torch.diff(ends, prepend=ends.new_zeros(1)).double()


@functools.lru_cache(maxsize=8)
def _rows(seqlen: int, mask: Mask) -> _Rows:
    lo, hi = row_bounds(seqlen, mask)
    if seqlen % BLOCK:
        return _Rows(lo, hi, None, None)
    blocks = lambda t: t.view(-1, BLOCK)  # noqa: E731
    stats = _stats(blocks(lo), blocks(hi), torch.ones(seqlen // BLOCK, BLOCK, dtype=torch.bool), seqlen)
    units = seqlen // BLOCK + 1
    return _Rows(lo, hi, stats, (_grouped(hi + 1, units), _grouped(lo, units)))


def _visible(shards: _Shards, rows: _Rows) -> torch.Tensor:
    """(W, W) [rank, src] int64: sum over the rank's rows q of H_src(hi + 1) - H_src(lo). With
    x = unit u and offset o, H_src(x) = below[src, u] + (owner[u] == src) o, so the sum over a
    rank's rows is its histogram of units times ``below``, plus its offsets on the units src
    owns: two matrix products in float64 (exact: every sum stays below 2^53). In units of 128
    the histograms add up the blocks' ``entries``; token by token, the rows themselves."""
    world, units = shards.below.shape
    owned = (shards.owner[:, None] == torch.arange(world)).double()  # (units, W); -1 owns nothing
    total = torch.zeros(world, world, dtype=torch.float64)
    if shards.shift:
        for (block, unit, count, offset), sign in zip(rows.entries, (1.0, -1.0)):
            index = shards.owner[block] * units + unit
            hist = torch.bincount(index, weights=count, minlength=world * units).view(world, units)
            offs = torch.bincount(index, weights=offset, minlength=world * units).view(world, units)
            total += sign * (hist @ shards.below.T + offs @ owned)
        return total.round().long()
    for x, sign in ((rows.hi + 1, 1.0), (rows.lo, -1.0)):
        hist = torch.bincount(shards.base + x, minlength=world * units).view(world, units).double()
        total += sign * (hist @ shards.below.T)
    return total.round().long()


def _tile_stats(shards: _Shards, rows: _Rows) -> torch.Tensor:
    """(4, W, T) ``_stats`` per rank and query tile: a tile is a global block in units of 128,
    else gathered row by row (rows past n are no rows)."""
    world, n = shards.positions.shape
    if shards.shift:
        return rows.stats[:, shards.positions[:, ::BLOCK] >> 7]
    pad = -(-n // BLOCK) * BLOCK - n

    def per_tile(values: torch.Tensor, fill) -> torch.Tensor:
        v = torch.nn.functional.pad(values[shards.positions], (0, pad), value=fill)
        return rearrange(v, "w (t b) -> w t b", b=BLOCK)

    real = per_tile(torch.ones(rows.lo.numel(), dtype=torch.bool), False)
    return _stats(per_tile(rows.lo, 0), per_tile(rows.hi, 0), real, rows.lo.numel())


def _tiles(shards: _Shards, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(touched, full), each (W, W) [rank, src]: a query tile touches the key tiles of the
    shard between its rows' first and last visible key row; a key tile is full where every
    row's interval covers it."""
    world, n = shards.positions.shape
    first, stop, first_max, stop_min = shards.held_before(_tile_stats(shards, rows)).unbind(1)
    # (src, rank, tile): local key rows of shard src
    touched = torch.where(stop > first, -(-stop // BLOCK) - first // BLOCK, 0)
    whole = torch.where(stop_min >= n, -(-n // BLOCK), stop_min // BLOCK)  # key tiles ending by stop_min
    full = (whole - (-(-first_max // BLOCK))).clamp(min=0)
    return touched.sum(-1).T, full.sum(-1).T


def _by_step(per_src: torch.Tensor) -> torch.Tensor:
    """[rank, src] -> [rank, step], step s of rank r holding the shard of (r - s) mod W."""
    world = per_src.shape[0]
    r, s = torch.arange(world)[:, None], torch.arange(world)[None, :]
    return per_src.gather(1, (r - s) % world)


def _band_steps(shards: _Shards, seqlen: int, mask: Mask) -> int:
    """The steps the ring runs (``layouts.active_steps``): through the last step at which some
    rank's queries see some key of the shard under the band alone (causal, window: document
    boundaries do not stop the K/V). Under the band a tile's rows see from the first row's lo
    to the last row's hi, both rows' positions read from the layout."""
    world, n = shards.positions.shape
    firsts, lasts = shards.positions[:, ::BLOCK], shards.positions[:, BLOCK - 1::BLOCK]
    if lasts.shape[1] < firsts.shape[1]:  # a last tile of fewer rows
        lasts = torch.cat([lasts, shards.positions[:, -1:]], 1)
    band = mask._replace(cu_seqlens=None)
    first = shards.held_before(row_bounds(seqlen, band, firsts)[0])
    stop = shards.held_before(row_bounds(seqlen, band, lasts)[1] + 1)
    reach = _by_step((stop > first).any(-1).T.long()).gt(0).any(0).nonzero()
    return int(reach.max()) + 1 if reach.numel() else 1


def ring_counts(world: int, seqlen: int, layout: str, mask: Mask = Mask(), schedule: str = "auto") -> RingCounts:
    """The ``RingCounts`` of a ring of ``world`` ranks over ``seqlen`` tokens split by
    ``layout`` (world 1: one device on the whole sequence, whatever the layout); ``schedule``
    as RINGFLASH_SCHEDULE would ask (``SCHEDULES``; the model does not read the variable)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive integer, got {world!r}")
    if not isinstance(seqlen, int) or seqlen < 1:
        raise ValueError(f"seqlen must be a positive integer, got {seqlen!r}")
    name = layout_of(layout).name
    if mask.cu_seqlens is not None:  # a tuple of ints: the cache's key
        mask = mask._replace(cu_seqlens=tuple(check_cu_seqlens(torch.as_tensor(mask.cu_seqlens), seqlen).tolist()))
    shards = _shards(world, seqlen, name if world > 1 else "contiguous")
    rows = _rows(seqlen, mask)
    touched, full = _tiles(shards, rows)
    counts = RingCounts(world, seqlen, name, _by_step(_visible(shards, rows)), _by_step(touched),
                        _by_step(full), _band_steps(shards, seqlen, mask))
    if world == 1:  # one kernel call a pass over the whole sequence
        blocks = torch.full((1, 1), -(-seqlen // BLOCK), dtype=torch.long)
        return counts._replace(calls=torch.ones(1, 1, dtype=torch.long), q_blocks=blocks, k_blocks=blocks)
    return _scheduled(counts, layout_of(layout), mask, schedule)


def _scheduled(counts: RingCounts, layout, mask: Mask, schedule: str = "auto") -> RingCounts:
    """The counts with the ring's schedule (``ring.plan.schedule_of``): its steps (a layout
    computed from the documents, ``ringflash.document_layout``, whose documents must be the
    mask's, runs only those its crossing documents need), each step's block pairs and the
    rows their programs run over, cut to the rows that travel from the second step on where
    shards travel cut (``ring.plan.travelling_rows``: then also the K/V rows received per
    rank and step), and which backward runs (``early_home``, as ``rotate.ring_backward``
    decides it for the Triton backward) and whether the direct schedule runs (``direct``,
    as ``ring.plan.takes_direct`` decides it from ``schedule``)."""
    world, n = counts.world, counts.local_len
    band = band_of_window(mask.causal, mask.window)
    documents = hasattr(layout, "shared")
    steps = active_steps(layout, world, n, band) if documents else counts.steps
    sent = travelling_rows(layout, world, n, band, True, steps) if steps > 1 else None
    direct = takes_direct(steps, sent, schedule)
    table = routes(layout, world, n, band, True, steps) if direct else None
    calls, q_blocks, k_blocks = (torch.zeros(world, world, dtype=torch.long) for _ in range(3))
    triton = torch.zeros(world, world, dtype=torch.bool)
    for rank in range(world):
        for s in range(steps):
            src = (rank - s) % world
            pairs = step_pairs(layout, rank, src, world, n, band, True, None)  # travelling_rows's cache key
            rows = None if not s or sent is None else sent[src] if table is None else table[src][s - 1]
            if s and table is not None and rows is None:  # a route that sees nothing: no pair runs
                pairs = []
            elif rows is not None and rows != (0, n):
                pairs = [part for pair in pairs if (part := keys_within(pair, *rows, n)) is not None]
            calls[rank, s], triton[rank, s] = len(pairs), any(pair.on_positions for pair in pairs)
            q_blocks[rank, s] = sum(-(-len(range(n)[pair.q]) // BLOCK) for pair in pairs)
            k_blocks[rank, s] = sum(-(-len(range(n)[pair.k]) // BLOCK) for pair in pairs)
    received = None
    if sent is not None or documents:
        received = torch.zeros(world, world, dtype=torch.long)
        for rank in range(world):
            for s in range(steps - 1):  # the shard of step s + 1 arrives during step s
                src = (rank - s - 1) % world
                lo, hi = ((0, n) if sent is None else sent[src] if table is None
                          else table[src][s] or (0, 1))  # one row where the route sees nothing
                received[rank, s] = hi - lo
    early_home = (steps == 2 and sent is None and remote_share(layout, world, n, band) >= 0.5 and all(
        uncovered([pair.k for pair in step_pairs(layout, rank, rank, world, n, band, True, None)], n) is not None
        for rank in range(world)))
    return counts._replace(steps=steps, calls=calls, q_blocks=q_blocks, k_blocks=k_blocks, received=received,
                           early_home=early_home, direct=direct, cut=sent is not None,
                           triton=triton)


# ----------------------------------------------------------------------------- bytes and time


class Problem(NamedTuple):
    """The tensors' sizes beyond the sequence: batch 1, ``heads`` query heads, ``kv_heads``
    K/V heads, ``head_dim``, ``dtype_bytes`` (2: bf16), ``segments``: segment ids travel
    with the K/V (packed documents)."""

    heads: int = 32
    kv_heads: int = 32
    head_dim: int = 128
    dtype_bytes: int = 2
    segments: bool = False


def kv_bytes(local_len: int, problem: Problem = Problem()) -> int:
    """One K/V shard, the message of a forward step: n x kv_heads x head_dim x 2 tensors x
    dtype bytes."""
    return local_len * problem.kv_heads * problem.head_dim * 2 * problem.dtype_bytes


def link_bytes(counts: RingCounts, problem: Problem = Problem()) -> torch.Tensor:
    """(W,) int64, or (W, W) [rank, step] where shards travel cut (``RingCounts.received``):
    bytes every rank receives from its neighbour during step s of a forward+backward: the
    K/V shard in the forward and again in the backward, the running dK/dV sum in fp32, and
    with segments their int32 ids both ways; nothing at the last step run and after it."""
    def of(n):
        return (2 * kv_bytes(1, problem) + problem.kv_heads * problem.head_dim * 2 * 4
                + (2 * 4 if problem.segments else 0)) * n
    if counts.received is not None:
        return of(counts.received)
    out = torch.zeros(counts.world, dtype=torch.long)
    out[:counts.steps - 1] = of(counts.local_len)
    return out


def pass_times(counts: RingCounts, costs: Costs,
               problem: Problem = Problem()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(forward, dQ, dK/dV), ms, each (W, W) [rank, step] (0 past the steps run): the step's
    tiles at ``tile_ms`` (times ``partial`` where partly visible) and the rows its kernel calls
    run over at ``row_ms`` (query rows in the forward and dQ passes, key rows in dK/dV), each
    pass its share of both (``PASS_SHARES``), times ``gluon`` where the Gluon kernels serve it. The constants may be 0-dim tensors
    (``cost_fit.fit`` differentiates through this)."""
    scale = problem.heads * problem.head_dim / _REF_WIDTH
    run = (torch.arange(counts.world) < counts.steps).double()
    tiles = costs.tile_ms * (counts.full.double() + costs.partial * (counts.touched - counts.full).double())
    q, k = counts.q_blocks.double(), counts.k_blocks.double()
    gluon = torch.ones_like(run) * costs.gluon  # float64 as every time here; a tensor where fitted
    run = run * (gluon if counts.triton is None else gluon.masked_fill(counts.triton, 1.0))
    return tuple(scale * share * run * (tiles + costs.row_ms * rows) for share, rows in zip(PASS_SHARES, (q, q, k)))


def _received(counts: RingCounts) -> torch.Tensor:
    """(W, W) [rank, step] float64: the K/V rows that arrive during the step (the next shard)."""
    if counts.received is not None:
        return counts.received.double()
    out = torch.zeros(counts.world, counts.world, dtype=torch.float64)
    out[:, :counts.steps - 1] = counts.local_len
    return out


def transfer_times(counts: RingCounts, costs: Costs,
                   problem: Problem = Problem()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv, sums, home), ms of the exchanges a rank waits for, each its bytes at ``link_gbps``
    plus ``message_ms``: kv (W, W) [rank, step], the next shard's K/V (and segment ids) that
    arrive during the step, in the forward and again in the backward; sums (W, W), the
    running fp32 dK/dV sum of the step's shard, arriving during backward steps 2 on; home
    (W,), the rank's own shard's sum coming home after the last step (rows as the shards
    travel: ``RingCounts.received``)."""
    world, steps = counts.world, counts.steps
    kv_row = kv_bytes(1, problem) + (4 if problem.segments else 0)
    sum_row = problem.kv_heads * problem.head_dim * 2 * 4
    received = _received(counts)
    sums = torch.zeros_like(received)
    sums[:, 2:steps] = received[:, 1:steps - 1]  # the shard of step s arrived during step s - 1
    own = received[(torch.arange(world) + 1) % world, 0]  # the rows of rank r's shard that travel
    return _link_ms(received, kv_row, costs), _link_ms(sums, sum_row, costs), _link_ms(own, sum_row, costs)


def _link_ms(rows: torch.Tensor, row_bytes: int, costs: Costs) -> torch.Tensor:
    """ms of exchanges of ``rows`` rows of ``row_bytes``: at ``link_gbps``, plus ``message_ms``."""
    return rows * row_bytes / (costs.link_gbps * 1e6) + costs.message_ms * (rows > 0)


def _schedule_times(counts: RingCounts, costs: Costs, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """(the forward, forward+backward), each (W,) ms, as the call's schedule lays them out
    (``rank_times`` without ``step_ms``)."""
    fwd, dq, dkv = pass_times(counts, costs, problem)
    kv, sums, home = transfer_times(counts, costs, problem)
    if counts.direct:
        partials = _link_ms(_received(counts), problem.kv_heads * problem.head_dim * 2 * 4, costs)
        forward, backward = timeline.direct(fwd, dq, dkv, kv, partials, counts.steps, counts.cut and costs.keeps_received)
        return forward, forward + backward
    if counts.early_home:
        return timeline.forward(fwd, kv, counts.steps), timeline.early_home(fwd, dq, dkv, kv, home, costs.message_ms, counts.local_len)
    return timeline.forward(fwd, kv, counts.steps), timeline.rotation(fwd, dq, dkv, kv, sums, home, counts.steps)


def rank_times(counts: RingCounts, costs: Costs, problem: Problem = Problem()) -> torch.Tensor:
    """(W,) ms of a forward+backward per rank, pass by pass as the ring schedules them
    (``cost_timeline``: the rotation; a ring of two taking its sums home early; the direct
    schedule), plus ``step_ms`` a step. A transfer hides behind the kernels it
    runs beside, and what it outlasts them by is waited for. The ring takes its slowest
    rank's, each rank's time its own: the coupling of one rank's steps to its neighbours'
    through the exchanges' handshakes (the whole group's barriers until 2026-11-27) is not
    charged (docs/performance.md, "Cost model", its limits)."""
    return _schedule_times(counts, costs, problem)[1] + counts.steps * costs.step_ms


def efficiency(ring: RingCounts, one: RingCounts, costs: Costs = H100, problem: Problem = Problem()):
    """One device's time (``one``: the counts at world 1) over W x the ring's time (its
    slowest rank), both from the model; a float, or a 0-dim tensor where a constant is one
    (``cost_fit.fit``)."""
    ratio = rank_times(one, costs, problem)[0] / (ring.world * rank_times(ring, costs, problem).max())
    return ratio if any(isinstance(v, torch.Tensor) for v in costs) else float(ratio)

