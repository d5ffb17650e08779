"""The cost model's bound for a layout built from the documents (``document_bound``): what
the ring could reach by ``ringflash.cost``'s model if it kept documents whole on the least
loaded rank with room, largest first, and split only a document longer than a shard, or
with more than its share of the pairs, over the fewest ranks that fit, as a ring of its
own (docs/performance.md, "Cost model"). Not a layout the library builds
(``ringflash.document_layout`` splits a long document over every rank)."""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from .cost import (_REF_WIDTH, H100, PASS_SHARES, Costs, Mask, Problem, RingCounts, efficiency,
                   pass_times, rank_times, ring_counts, transfer_times)
from .cost_timeline import rotation
from .kernels.masks import BLOCK

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
    """Each rank's ms (``document_bound``): step 0 its whole documents' tiles and one pass over
    its n rows, plus the steps of the split documents it holds a piece of, their passes and
    transfers added step by step (one exchange a step carrying them all), through the
    rotation (``cost_timeline.rotation``)."""
    whole, split, pieces = assignment
    scale = problem.heads * problem.head_dim / _REF_WIDTH
    times = []
    for r in range(world):
        rings = [(_split_ring(*split[d]), i) for d, i in pieces[r]]
        steps = max([1] + [ring.steps for ring, _ in rings])
        passes = torch.zeros(3, 1, steps, dtype=torch.float64)
        trips = torch.zeros(3, 1, steps, dtype=torch.float64)  # bytes' ms: kv, sums, and home at step 0
        touched, full = _packed_tiles(whole[r])
        tiles = costs.tile_ms * (full + costs.partial * (touched - full))
        passes[:, 0, 0] = torch.tensor([scale * share * (tiles + costs.row_ms * -(-n // BLOCK))
                                        for share in PASS_SHARES])
        for ring, i in rings:
            fwd, dq, dkv = pass_times(ring, costs, problem)
            own = ring.q_blocks[i, 0], ring.q_blocks[i, 0], ring.k_blocks[i, 0]
            for p, (part, blocks, share) in enumerate(zip((fwd, dq, dkv), own, PASS_SHARES)):
                part[i, 0] -= scale * share * costs.row_ms * blocks  # its rows are in the rank's pass
                passes[p, 0, :ring.steps] += part[i, :ring.steps]
            kv, sums, home = transfer_times(ring, costs, problem)
            for t, (part, msg) in enumerate(zip((kv[i], sums[i], home[i:i + 1]),
                                                (kv[i] > 0, sums[i] > 0, home[i:i + 1] > 0))):
                trips[t, 0, :part.numel()] += part - costs.message_ms * msg
        kv, sums = (t + costs.message_ms * (t > 0) for t in trips[:2])
        home = trips[2, :, 0] + costs.message_ms * (trips[2, :, 0] > 0)
        times.append(float(rotation(*passes, kv, sums, home, steps)[0]) + steps * costs.step_ms)
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
