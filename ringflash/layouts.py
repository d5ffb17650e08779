"""Sequence layouts: which global tokens each rank holds, and what each ring step computes.

A layout is data. For a rank holding queries and a visiting K/V shard that started on
rank ``src``, ``step_pairs`` lists the (query rows, key rows, mask) pairs to compute;
the one schedule engine in ``ring.py`` runs those lists for every layout.

World size W, global length N, n = N / W tokens per rank:

- contiguous: rank r holds [r*n, (r+1)*n). Causal work is lopsided: rank r computes
  r + 1 of the W steps.
- zigzag: the sequence is cut into 2W chunks of c = n / 2; rank r holds chunks r and
  2W-1-r. Every causal step costs half a full block pair, on every rank.
- stripe: rank r holds tokens t with t mod W == r. Every causal step is one block pair
  with a diagonal offset of 0 or -1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LAYOUTS = ("contiguous", "zigzag", "stripe")
# The layout of every function that takes one (shard, unshard, positions, ring_flash_attn,
# RingSelfAttention, SequenceParallel): balanced for causal attention, and its shards are
# two contiguous chunks, so masks that are local in the sequence (windows, documents) leave
# whole block pairs empty. It needs the global length divisible by 2W.
DEFAULT_LAYOUT = "zigzag"
_ALL = slice(None)


class Pair(NamedTuple):
    """One kernel call: local query rows, visiting key rows, causal diagonal offset
    (None: no mask; o: key j visible to query i iff j <= i + o, in local indices)."""

    q: slice
    k: slice
    causal_offset: int | None


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def step_pairs(layout: str, rank: int, src: int, local_len: int, causal: bool) -> list[Pair]:
    """The block pairs rank ``rank`` computes against the K/V shard of rank ``src``."""
    if not causal:
        return [Pair(_ALL, _ALL, None)]
    if layout == "stripe":
        # q token i*W + rank sees k token j*W + src iff j <= i (src <= rank) or j < i.
        return [Pair(_ALL, _ALL, 0 if src <= rank else -1)]
    if src == rank:
        return [Pair(_ALL, _ALL, 0)]
    if layout == "contiguous":
        return [Pair(_ALL, _ALL, None)] if src < rank else []
    half = local_len // 2  # zigzag: local = [chunk rank, chunk 2W-1-rank]
    if src < rank:  # both query chunks see all of src's first chunk, none of its second
        return [Pair(_ALL, slice(0, half), None)]
    return [Pair(slice(half, None), _ALL, None)]  # only our second chunk sees src, all of it


def split_factor(layout: str, world: int) -> int:
    """How many equal pieces the global sequence is cut into."""
    return 2 * world if layout == "zigzag" else world


def check_seqlen(seqlen: int, layout: str, world: int) -> None:
    parts = split_factor(layout, world)
    if seqlen % parts:
        what = f"2 x world size = {parts}" if layout == "zigzag" else f"the world size {world}"
        raise ValueError(
            f"seqlen {seqlen} cannot be split by layout {layout!r} over {world} ranks: "
            f"it must be a multiple of {what}")


def global_positions(seqlen: int, layout: str, rank: int, world: int) -> torch.Tensor:
    """Global token ids held by ``rank``, in local order (int64, CPU)."""
    check_seqlen(seqlen, layout, world)
    n = seqlen // world
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "stripe":
        return torch.arange(rank, seqlen, world)
    c = n // 2
    first, second = rank * c, (2 * world - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])
