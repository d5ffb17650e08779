"""How the ring lays out a call's passes and transfers in time, for ``ringflash.cost``:
from (R, S) [rank, step] pass times (``cost.pass_times``) and transfer times
(``cost.transfer_times``), each rank's time through the rotation (``rotation``; a ring of
two taking its sums home early: ``early_home``) or the direct schedule (``direct``). A
transfer hides behind the kernels it runs beside, and what it outlasts them by is waited
for."""

from __future__ import annotations

import torch

from .ring.rows import home_cuts


def forward(fwd, kv, steps: int) -> torch.Tensor:
    """(R,) ms of the forward alone: a step's kernels or the next shard's arrival, the longer."""
    return torch.maximum(fwd, kv)[:, :steps].sum(1)


def rotation(fwd, dq, dkv, kv, sums, home, steps: int) -> torch.Tensor:
    """(R,) ms of a forward+backward through the rotation (``rotate.ring_forward``,
    ``rotate._rotate``), pass by pass over the steps run, from (R, S) pass and transfer times
    and (R,) ``home``: forward step s runs its kernels while the next shard arrives; the
    backward runs the own shard's dQ pass while the first shard arrives, then at each later
    step its dQ pass while the running dK/dV sum arrives and its dK/dV pass once it has, the
    next shard arriving behind the sum on the same copy engine; and last the own shard's
    dK/dV pass while its sum comes home."""
    ahead = forward(fwd, kv, steps)
    later = torch.maximum(torch.maximum(dq, sums) + dkv, sums + kv)[:, 1:steps].sum(1)
    return ahead + torch.maximum(dq[:, 0], kv[:, 0]) + later + torch.maximum(dkv[:, 0], home)


def early_home(fwd, dq, dkv, kv, home, message_ms: float, n: int) -> torch.Tensor:
    """(2,) ms of a forward+backward of a ring of two through ``rotate._home_first``: the own
    dQ pass while the shard arrives; the remote dK/dV pass in two pieces of key rows
    (``ring.rows.home_cuts``), each piece's sum leaving for home once computed (one message
    each, one after the other); the remote dQ pass; the own dK/dV pass in the same two
    pieces, each once its piece of the sum is home. ``message_ms``: ``Costs.message_ms``."""
    cuts = home_cuts(n)
    a = cuts[0] / n if cuts else 1.0
    trip = home - message_ms  # the bytes
    first = a * dkv[:, 1] + a * trip + message_ms
    second = torch.maximum(dkv[:, 1], first) + ((1 - a) * trip + message_ms if cuts else 0)
    own = torch.maximum(dkv[:, 1] + dq[:, 1], first) + a * dkv[:, 0]
    own = torch.maximum(own, second) + (1 - a) * dkv[:, 0]
    return torch.maximum(fwd[:, 0], kv[:, 0]) + fwd[:, 1] + torch.maximum(dq[:, 0], kv[:, 0]) + own


def direct(fwd, dq, dkv, kv, partials, steps: int, kept: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """((R,), (R,)) ms of the forward and the backward of the direct schedule from (R, S) pass
    times, step s's K/V in kv[:, s - 1] and its partial dK/dV sum's trip home in
    partials[:, s - 1]. Each pass posts every step's K/V at its start, arriving one after
    another. Forward: the own step, then step s once its shard is in. Backward: the own dQ
    pass, then each remote step's dQ and dK/dV passes once its shard is in (``kept``: the
    K/V kept from the forward, the remote steps at once and the own dQ pass last), its sum
    leaving once computed and the one before has left; the own dK/dV pass last: done with
    it and the last send (the owner's adding up is not charged)."""
    arrived = kv.cumsum(1)
    forward, backward, sent = fwd[:, 0], dq[:, 0] * (not kept), torch.zeros_like(fwd[:, 0])
    for s in range(1, steps):
        forward = torch.maximum(forward, arrived[:, s - 1]) + fwd[:, s]
        backward = (backward if kept else torch.maximum(backward, arrived[:, s - 1])) + dq[:, s] + dkv[:, s]
        sent = torch.maximum(sent, backward) + partials[:, s - 1]
    return forward, torch.maximum(backward + dkv[:, 0] + dq[:, 0] * kept, sent)
