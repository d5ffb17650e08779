"""The buffers the K/V shards a rank computes arrive in (``Slots``), and passing a
received shard on (``pass_on``): the rotation's two slots taking turns, the direct
schedule's one a step."""

from __future__ import annotations

from typing import Optional

import torch

from ..exchange import Ring
from .rows import Aside


class Slots:
    """The buffers visiting shards arrive in: none for a ring that passes nothing, one when
    only the own shard travels (two steps), two taking turns when received shards are passed
    on, one a step under the direct schedule (``direct``: every shard arrives at once, each
    into a slot of exactly its rows). ``sent`` (``plan.travelling_rows``): per source rank
    the rows of its shard that travel, or None (whole shards); a slot then holds the rows of
    whichever shard it holds, from its start, so that every rank receives a message where
    its sender wrote it. ``routes`` (``plan.routes``, the direct schedule's): per source
    rank and step the rows it sends, each rank's own. ``kept``: (K/V, segment ids or None)
    that ``ring_forward`` kept from its slots (``held`` rows), in the same places, instead
    of the ring's buffers."""

    def __init__(self, k: torch.Tensor, segments: Optional[torch.Tensor], ring: Ring, steps: int, sent,
                 direct: bool = False, kept: Optional[tuple] = None, routes: Optional[tuple] = None):
        self.ring, self.sent, self.n, self.direct, self.routes = ring, sent, k.shape[1], direct, routes
        self.count = 0 if steps == 1 else 1 if steps == 2 else steps - 1 if direct else 2
        b, _, hkv, d = k.shape
        self.shape, self.row = (b, hkv, d), 2 * b * hkv * d  # elements of one packed K/V row
        self.longest = max(map(self.length, range(ring.world)))
        if kept is not None:
            self.kv, self.seg = kept
            return
        # The same size on every rank (the copy engines' buffers are allocated together).
        rows = max(map(self.held, range(ring.world)))
        self.kv = ring.buffer("kv", (self.row * rows,), k.dtype, k.device)
        self.seg = None if segments is None else ring.buffer("segments", (b * rows,), torch.int32, k.device)

    def rows(self, src: int, shift: Optional[int] = None) -> slice:
        """The rows of rank src's shard that travel (to rank src + ``shift``, where each
        rank gets its own: ``routes``; one row where it sees none)."""
        if self.routes is not None and shift is not None:
            route = self.routes[src][shift - 1]
            return slice(*route) if route is not None else slice(self.sent[src][0], self.sent[src][0] + 1)
        return slice(None) if self.sent is None else slice(*self.sent[src])

    def length(self, src: int, shift: Optional[int] = None) -> int:
        """How many rows of rank src's shard travel (to rank src + ``shift``)."""
        return len(range(self.n)[self.rows(src, shift)])

    def start(self, rank: int, step: int) -> int:
        """The row where rank ``rank``'s slot for step ``step`` (>= 1) starts: the direct
        schedule's slots follow each other, each as long as the rows it receives there;
        the others take turns, each as long as the longest."""
        world = self.ring.world
        if self.direct:
            return sum(self.length((rank - s) % world, s) for s in range(1, step))
        return 0 if self.count == 0 else (step - 1) % self.count * self.longest

    def held(self, rank: int) -> int:
        """The rows of rank's slots together."""
        if self.direct:
            return self.start(rank, self.count + 1)
        return self.count * self.longest

    def packed(self, flat: torch.Tensor, src: int, shift: Optional[int] = None) -> torch.Tensor:
        """The start of ``flat`` as rank src's travelling K/V rows (to rank src + ``shift``),
        packed (2, B, rows, Hkv, D)."""
        b, hkv, d = self.shape
        rows = self.length(src, shift)
        return flat[:self.row * rows].view(2, b, rows, hkv, d)

    def _span(self, rank: int, step: int, width: int) -> slice:
        """The elements of rank's slot for ``step`` in a flat buffer of ``width`` elements a
        row, as long as the rows of the shard that step computes there."""
        at = self.start(rank, step)
        return slice(width * at, width * (at + self.length((rank - step) % self.ring.world, step)))

    def _slot(self, rank: int, step: int) -> tuple:
        """(K/V, segment ids or None) of rank's slot for ``step``, flat views of the buffers."""
        return (self.kv[self._span(rank, step, self.row)],
                None if self.seg is None else self.seg[self._span(rank, step, self.shape[0])])

    def at(self, step: int) -> tuple:
        """(K/V packed as (2, B, rows, Hkv, D), segment ids (B, rows) or None) of the shard
        that step ``step`` (>= 1) computes, in its slot."""
        kv, seg = self._slot(self.ring.rank, step)
        return self.packed(kv, (self.ring.rank - step) % self.ring.world, step), None if seg is None else seg.view(
            self.shape[0], -1)

    def keep(self, aside: Aside, kept: tuple, step: int) -> None:
        """Copy step ``step``'s slot, arrived, into the same place of ``kept`` (K/V and
        segment ids or None, flat, this rank's ``held`` rows), on the side stream."""
        for dst, buf, width in zip(kept, (self.kv, self.seg), (self.row, self.shape[0])):
            if buf is not None:
                span = self._span(self.ring.rank, step, width)
                aside.copy(dst[span], buf[span])

    def send_own(self, k: torch.Tensor, v: torch.Tensor, segments: Optional[torch.Tensor], shift: int = 1) -> list:
        """Send the own shard's travelling rows to rank + ``shift``, from k and v themselves
        (two messages) and its segment ids, and receive rank - shift's into the slot of step
        ``shift``. Each message lands where the receiver's view of this shard has it (its
        slot for step ``shift``, and there its V after this shard's K rows)."""
        rank = self.ring.rank
        rows, (kv_next, seg_next) = self.rows(rank, shift), self.at(shift)
        kv_theirs, seg_theirs = self._slot((rank + shift) % self.ring.world, shift)
        theirs = self.packed(kv_theirs, rank, shift)
        pairs = [(k[:, rows], kv_next[0], theirs[0]), (v[:, rows], kv_next[1], theirs[1])]
        if segments is not None:
            pairs.append((segments[:, rows].contiguous(), seg_next, seg_theirs))
        return self.ring.exchange(*pairs, shift=shift)

    def send_all(self, k: torch.Tensor, v: torch.Tensor, segments: Optional[torch.Tensor]) -> list[list]:
        """The direct schedule's trips, all posted at once: the own shard to each rank that
        computes it (rank + s, for the steps s = 1, 2, ...), and into each step's slot the
        shard it computes. One pending list a step, in step order (they travel in turn)."""
        return [self.send_own(k, v, segments, shift) for shift in range(1, self.count + 1)]


def pass_on(ring: Ring, cur, nxt) -> list:
    """Send a received shard (packed K/V in its slot, and segment ids) on, and receive the
    next one into ``nxt``."""
    (kv, seg), (kv_next, seg_next) = cur, nxt
    return ring.exchange(*[(kv, kv_next)] + ([] if seg is None else [(seg, seg_next)]))
