"""A cost model of the ring, on the CPU and exact in what it counts: per rank and per ring
step, the visible (query, key) pairs, the kernel tiles they touch and the bytes each link
carries, for any world size W, global length N, layout and mask (causal, a sliding
window, packed documents); then a time per rank and an efficiency from a few measured
constants (``Costs``), and a bound for a layout built from the documents
(``document_bound``). benchmarks/predict_scaling.py prints its calibration against the
committed measurements and its predictions for W = 8-64 (docs/performance.md, "Cost
model").

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

What the ring runs (rotate.py): ``steps`` = the steps the band (causal, window) leaves
anything to on some rank (``layouts.active_steps``: document boundaries do not shorten the
ring); each step runs every query and key tile of the shard once (the forward's running
out, the dQ and dK/dV passes, visible keys or not), and each step but the last sends the
K/V shard one hop in the forward, again in the backward, and a running fp32 dK/dV sum --
as the rows of it that travel where shards travel cut (``ring.plan.travelling_rows``). A
layout computed from the documents (``ringflash.document_layout``) runs its own steps:
only those its crossing documents need, each over the rows of its pairs (``_cut_steps``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Sequence

import torch
from einops import rearrange

from .kernels.masks import BLOCK
from .api import check_cu_seqlens
from .kernels import band_of_window
from .layouts import active_steps, global_positions, layout_of, step_pairs
from .ring.plan import travelling_rows

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
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + int(length))
        return cls(causal, window, tuple(bounds))


class Costs(NamedTuple):
    """The time model's constants, for 32 heads of head_dim 128 in bf16 (compute scales with
    heads x head_dim, bytes with kv_heads x head_dim x dtype bytes). Forward+backward:

    tile_ms: one fully visible 128 x 128 tile (all heads).
    partial: a partly visible tile's time over a full one's (the mask is applied).
    row_ms: per 128 rows of the shard per step: what every tile program pays whatever it
        sees (loading Q, merging the running out, the dQ and dK/dV passes' reads and fp32
        read-modify-writes).
    step_ms: per step: launches and the step's synchronization.
    link_gbps: bytes a link carries beside the kernels, GB/s (copy engines)."""

    tile_ms: float
    partial: float
    row_ms: float
    step_ms: float
    link_gbps: float


# Fitted by ``python benchmarks/predict_scaling.py --fit`` (2026-11-26) to the 1-GPU times and
# ring efficiencies of benchmarks/results/masks_h100x2.json (2 x H100, 2026-11-25) and the
# 4 x H100 efficiencies measured 2026-11-26 (QUOTED_H100X4 in benchmarks/predict_scaling.py),
# rms error 4.8%. link_gbps is held, not fitted:
# the copy engines' 393 GB/s beside the kernels on 2 x H100 (docs/notes/ring-of-two.md, "The ring
# of two at 32k"). row_ms is about 2x what the passes' bytes take at the H100's 3.35 TB/s
# (about 22 MB per 128 rows). The 2 x H200 rows (masks_h200x2.json) are predicted with the same
# constants within 7% (its kernels run at the H100's speed: masks_h200.json).
H100 = Costs(tile_ms=1.902e-3, partial=1.196, row_ms=1.297e-2, step_ms=0.0621, link_gbps=393.0)


class RingCounts(NamedTuple):
    """What each rank computes at each ring step: tensors (W, W) indexed [rank, step], the
    step s of rank r holding the shard of rank (r - s) mod W. int64 throughout.

    visible: (query, key) pairs its queries see in that shard.
    touched: 128 x 128 (query tile, key tile) pairs holding any visible pair.
    full: those of ``touched`` whose every pair is visible.
    steps: the steps the ring runs (``layouts.active_steps``); later steps are empty.
    rows: None where every step runs its passes over the whole shard; else [rank, step]
        the rows they run over (a layout computed from the documents: the pieces of the
        documents that cross ranks).
    received: None where whole shards travel; else [rank, step] the K/V rows the rank
        receives during the step (``ring.plan.travelling_rows``).
    """

    world: int
    seqlen: int
    layout: str
    visible: torch.Tensor
    touched: torch.Tensor
    full: torch.Tensor
    steps: int
    rows: Optional[torch.Tensor] = None
    received: Optional[torch.Tensor] = None

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


def ring_counts(world: int, seqlen: int, layout: str, mask: Mask = Mask()) -> RingCounts:
    """The ``RingCounts`` of a ring of ``world`` ranks over ``seqlen`` tokens split by
    ``layout`` (world 1: one device on the whole sequence, whatever the layout)."""
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
    return _cut_steps(counts, layout_of(layout), mask) if world > 1 else counts


def _covered(slices, n: int) -> int:
    """How many of n rows the slices (which may overlap) cover."""
    total = end = 0
    for a, b in sorted((r.start, r.stop) for r in (range(n)[part] for part in slices)):
        if b > end:
            total, end = total + b - max(a, end), b
    return total


def _cut_steps(counts: RingCounts, layout, mask: Mask) -> RingCounts:
    """The counts with what travels where shards travel cut (``ring.plan.travelling_rows``:
    K/V rows received per rank and step), and for a layout computed from the documents
    (``ringflash.document_layout``, whose documents must be the mask's) its own steps: the
    ring runs only those some crossing document needs, each over the rows of its pairs."""
    world, n = counts.world, counts.local_len
    band = band_of_window(mask.causal, mask.window)
    documents = hasattr(layout, "shared")
    steps = active_steps(layout, world, n, band) if documents else counts.steps
    sent = travelling_rows(layout, world, n, band, True, steps) if steps > 1 else None
    if sent is None and not documents:
        return counts
    received = torch.zeros(world, world, dtype=torch.long)
    for rank in range(world):
        for s in range(steps - 1):  # the shard of step s + 1 arrives during step s
            lo, hi = (0, n) if sent is None else sent[(rank - s - 1) % world]
            received[rank, s] = hi - lo
    rows = None
    if documents:
        rows = torch.zeros(world, world, dtype=torch.long)
        for rank in range(world):
            rows[rank, 0] = n
            for s in range(1, steps):
                pairs = step_pairs(layout, rank, (rank - s) % world, world, n, band)
                q, k = (_covered([getattr(p, side) for p in pairs], n) for side in ("q", "k"))
                rows[rank, s] = (q + k + 1) // 2
    return counts._replace(steps=steps, rows=rows, received=received)


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


def step_times(counts: RingCounts, costs: Costs,
               problem: Problem = Problem()) -> tuple[torch.Tensor, torch.Tensor]:
    """(compute, comm), ms of a forward+backward: compute (W, W) [rank, step] from the tiles
    and the rows of the shard (0 past the steps run), comm (W,) from ``link_bytes``. The
    constants may be 0-dim tensors (``fit`` differentiates through this)."""
    scale = problem.heads * problem.head_dim / _REF_WIDTH
    partial = (counts.touched - counts.full).double()
    run = (torch.arange(counts.world) < counts.steps).double()
    rows = counts.local_len if counts.rows is None else counts.rows
    compute = scale * run * (costs.tile_ms * (counts.full.double() + costs.partial * partial)
                             + costs.row_ms * -(-rows // BLOCK))
    comm = link_bytes(counts, problem).double() / (costs.link_gbps * 1e6)
    return compute, comm


def rank_times(counts: RingCounts, costs: Costs, problem: Problem = Problem()) -> torch.Tensor:
    """(W,) ms of a forward+backward per rank: over the steps run, each step's compute or its
    transfer, whichever is longer (the transfer of step s brings the shard of step s + 1
    while step s computes), plus ``step_ms`` a step. The ring takes its slowest rank's."""
    compute, comm = step_times(counts, costs, problem)
    return torch.maximum(compute, comm).sum(1) + counts.steps * costs.step_ms


def efficiency(ring: RingCounts, one: RingCounts, costs: Costs = H100, problem: Problem = Problem()):
    """One device's time (``one``: the counts at world 1) over W x the ring's time (its
    slowest rank), both from the model; a float, or a 0-dim tensor for tensor constants."""
    ratio = rank_times(one, costs, problem)[0] / (ring.world * rank_times(ring, costs, problem).max())
    return ratio if isinstance(costs.tile_ms, torch.Tensor) else float(ratio)


def fit(one_gpu: Sequence[tuple], rings: Sequence[tuple], link_gbps: float, start: Costs = H100,
        iters: int = 600) -> tuple[Costs, float]:
    """(the constants, their rms relative error): tile_ms, partial, row_ms and step_ms fitted
    to measurements, ``link_gbps`` held. one_gpu: (counts at world 1, Problem, measured ms);
    rings: (ring counts, counts at world 1, Problem, measured efficiency). Least squares on
    the log of predicted over measured (1-GPU times and ring efficiencies alike), by Adam on
    the constants' logs from ``start``: the max() of compute and transfer is piecewise linear."""
    logs = torch.tensor([math.log(v) for v in start[:4]], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([logs], lr=0.03)

    def errors() -> torch.Tensor:
        costs = Costs(*logs.exp(), link_gbps)
        out = [torch.log(rank_times(c, costs, p)[0] / ms) for c, p, ms in one_gpu]
        out += [torch.log(efficiency(ring, one, costs, p) / eff) for ring, one, p, eff in rings]
        return torch.stack(out)

    for _ in range(iters):
        opt.zero_grad()
        loss = errors().square().mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        rms = float(errors().square().mean().sqrt())
    return Costs(*(float(v) for v in logs.detach().exp()), link_gbps), rms


# ----------------------------------------------------------------------------- a layout from the documents


def _packed_tiles(lengths: Sequence[int]) -> tuple[int, int]:
    """(touched, full) tiles of causal documents of ``lengths`` packed from a tile's start on
    one device (exactly ``ring_counts(1, ...)``'s for that sequence, without padding): query
    tile a touches key tiles from its first row's document start to a, and a key tile is full
    from its last row's document start on, below a."""
    if not lengths:
        return 0, 0
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    tiles = torch.arange(-(-int(bounds[-1]) // BLOCK))
    first, last = tiles * BLOCK, torch.clamp(tiles * BLOCK + BLOCK - 1, max=int(bounds[-1]) - 1)
    start_first, start_last = (bounds[torch.searchsorted(bounds[1:], rows, right=True)] for rows in (first, last))
    touched = tiles - start_first // BLOCK + 1
    full = (tiles + start_last // -BLOCK).clamp(min=0)  # a - ceil(start_last / BLOCK)
    return int(touched.sum()), int(full.sum())


@functools.lru_cache(maxsize=256)
def _split_ring(length: int, k: int) -> RingCounts:
    """A document of ``length`` tokens split zigzag over k ranks, as a ring of its own."""
    padded = -(-length // (2 * BLOCK * k)) * 2 * BLOCK * k
    return ring_counts(k, padded, "zigzag", Mask.documents([length]))


def _assign(world: int, n: int, lengths: list[int], spread: float):
    """Documents to ranks, largest first: split over k ranks (the least loaded) where the
    tokens exceed n or the visible pairs exceed ``spread`` x a rank's share, else whole on
    the least loaded rank with room. Returns (whole lengths per rank, split (length, k),
    per rank its (split index, rank within the split))."""
    pairs = [length * (length + 1) // 2 for length in lengths]
    share = sum(pairs) / world
    work, room = [0.0] * world, [n] * world
    whole: list[list[int]] = [[] for _ in range(world)]
    split, pieces = [], [[] for _ in range(world)]
    for d in sorted(range(len(lengths)), key=lambda d: -pairs[d]):
        length = lengths[d]
        k = max(-(-length // n), math.ceil(pairs[d] / (spread * share) - 1e-9), 1)
        fits = [r for r in range(world) if room[r] >= length]
        if k == 1 and fits:
            r = min(fits, key=lambda r: work[r])
            whole[r].append(length)
            work[r], room[r] = work[r] + pairs[d], room[r] - length
            continue
        k = min(max(k, 2), world)
        for i, r in enumerate(sorted(range(world), key=lambda r: (work[r], -room[r]))[:k]):
            pieces[r].append((len(split), i))
            work[r], room[r] = work[r] + pairs[d] / k, room[r] - length / k
        split.append((length, k))
    return whole, split, pieces


def _bound_times(world: int, n: int, assignment, costs: Costs, problem: Problem) -> list[float]:
    whole, split, pieces = assignment
    scale = problem.heads * problem.head_dim / _REF_WIDTH
    times = []
    for r in range(world):
        rings = [(_split_ring(*split[d]), i) for d, i in pieces[r]]
        steps = [0.0] * max([1] + [ring.steps for ring, _ in rings])
        comm = [0.0] * len(steps)
        touched, full = _packed_tiles(whole[r])
        steps[0] = scale * (costs.tile_ms * (full + costs.partial * (touched - full))
                            + costs.row_ms * -(-n // BLOCK))
        for ring, i in rings:
            compute, hop = step_times(ring, costs, problem)
            compute[:, 0] -= scale * costs.row_ms * -(-ring.local_len // BLOCK)  # in the rank's pass
            for s in range(ring.steps):
                steps[s] += float(compute[i, s])
                comm[s] += float(hop[s])
        times.append(sum(max(c, t) for c, t in zip(steps, comm)) + len(steps) * costs.step_ms)
    return times


def document_bound(world: int, seqlen: int, lengths: Sequence[int], costs: Costs = H100,
                   problem: Problem = Problem(segments=True)) -> dict:
    """What a layout computed from the documents could reach on causal packed documents, by
    this model: a bound to aim at, not a measurement of anything built. Each rank holds
    n = seqlen / W tokens. A document longer than n, or with more visible pairs than
    ``spread`` x a rank's share, is split zigzag over the fewest ranks k that fit both (the
    least loaded k) and runs as a ring of k over its own tokens alone (counted by
    ``ring_counts``); every other document stays whole on the least loaded rank with room
    for it (largest first) and needs no communication. A rank's time: its whole documents'
    tiles (packed from the start of its shard), one pass over its n rows, and the steps of the
    split documents it holds a piece of. ``spread`` trades balance against steps: the best
    of a few values is kept, or block_stripe's ring where that is faster (``spread`` None).
    Returns {"efficiency", "rank_ms" (W,), "split": the split documents' (length, k),
    "spread"}."""
    n = seqlen // world
    lengths = [int(length) for length in lengths if length > 0]
    one = ring_counts(1, seqlen, "contiguous", Mask.documents(lengths))
    t1 = float(rank_times(one, costs, problem)[0])
    striped = seqlen % (BLOCK * world) == 0
    ring = ring_counts(world, seqlen, "block_stripe", Mask.documents(lengths)) if striped else None
    best = None if ring is None else dict(
        efficiency=efficiency(ring, one, costs, problem), rank_ms=rank_times(ring, costs, problem).tolist(),
        split=[], spread=None)  # the layout may fall back to block_stripe (spread None)
    for spread in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0):
        assignment = _assign(world, n, lengths, spread)
        times = _bound_times(world, n, assignment, costs, problem)
        if best is None or max(times) < max(best["rank_ms"]):
            best = dict(efficiency=t1 / (world * max(times)), rank_ms=times, split=assignment[1], spread=spread)
    return best
