"""A design study on the cost model (ringflash.cost): what packed documents over 8-64 GPUs
would gain from a schedule the library does not run, beside the rotation it runs.

    python benchmarks/research/direct_schedule.py [--seqlen 1m] [--grids 8x1 8x8 64x1 64x4 64x8]

The rotation (``cost.rank_times``): at each step a rank computes the block pairs of the
shard it holds while the next one arrives from its neighbour; in the backward the shards
travel again and the running fp32 dK/dV sums travel with them, home after the last step.
Where a rank's own step is long and its later steps are short (documents kept whole), the
transfers behind the short steps are exposed.

"Direct" (not built): every rank posts the receives of all the rows it needs from every
other shard at once, while its own step's forward runs; keeps them for the backward (no
second trip); runs its remote block pairs' dQ and dK/dV first and sends each remote shard's
fp32 dK/dV partial sum straight to its owner while its own step's backward runs. A rank's
time: the own step's forward, each remote step's forward once its rows are in (the receives
one after another on the link), the remote steps' backward, each partial sum leaving once
computed (one after another), and the own step's backward beside those departures, plus
``step_ms`` a step. The rows are ``cost``'s travelling rows
(``RingCounts.received``); links and the grid's all-to-all as
benchmarks/predict_scaling.py has them (a heads group within a node of 8, the ring across
nodes at 50 GB/s). Prints the efficiency of both schedules, the busiest rank over the mean
(direct), and per ring rank what its time is made of.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import cli  # noqa: E402
from predict_scaling import mask_of  # noqa: E402
from ringflash import cost, cost_grid  # noqa: E402


def direct_times(ring: cost.RingCounts, costs: cost.Costs, problem: cost.Problem) -> torch.Tensor:
    """(R,) ms of a forward+backward per ring rank under the direct schedule (module docstring)."""
    fwd, dq, dkv = cost.pass_times(ring, costs, problem)
    kv, _, _ = cost.transfer_times(ring, costs, problem)
    steps = ring.steps
    received = cost._received(ring)  # [rank, step]: the rows of step s + 1's shard
    sum_row = problem.kv_heads * problem.head_dim * 2 * 4
    sums = received * sum_row / (costs.link_gbps * 1e6) + costs.message_ms * (received > 0)
    arrived = kv.cumsum(1)  # every receive posted at once, one after another on the link
    t = fwd[:, 0].clone()  # the own step's forward, then each remote step once its rows are in
    for s in range(1, steps):
        t = torch.maximum(t, arrived[:, s - 1]) + fwd[:, s]
    sent = t.clone()  # the remote steps' backward first, each partial sum leaving once computed
    for s in range(1, steps):
        t = t + dq[:, s] + dkv[:, s]
        sent = torch.maximum(sent, t) + sums[:, s - 1]
    return torch.maximum(t + dq[:, 0] + dkv[:, 0], sent) + steps * costs.step_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", default="1m")
    p.add_argument("--grids", nargs="+", default=["8x1", "8x8", "64x1", "64x4", "64x8"], help="W x U")
    p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 32])
    args = p.parse_args()
    seqlen = cli.parse_sizes([args.seqlen])[0]
    mask, grid = mask_of("documents", seqlen), cost_grid.NVLINK
    one = cost.ring_counts(1, seqlen, "contiguous", mask)
    for spec in args.grids:
        world, u = (int(x) for x in spec.split("x"))
        ring = cost_grid.grid_ring(world // u, 1, seqlen, "documents", mask)
        costs = cost_grid.ring_link(cost.H100, world, world // u, grid)
        for kv_heads in args.kv_heads:
            problem = cost.Problem(heads=32, kv_heads=kv_heads, segments=True)
            whole = problem._replace(heads=32 // u, kv_heads=max(kv_heads // u, 1))
            t1 = float(cost.rank_times(one, cost.H100, problem)[0])
            a2a = (sum(cost_grid.exchange_ms(x, grid) for x in cost_grid.exchanges(u, world // u, seqlen, problem))
                   if u > 1 else 0.0)  # unchunked: every exchange exposed
            rotation, direct = cost.rank_times(ring, costs, whole), direct_times(ring, costs, whole)
            print(f"W={world} U={u} R={world // u} heads 32/{kv_heads} steps {ring.steps}: "
                  f"rotation {t1 / (world * (float(rotation.max()) + a2a)):.3f}, "
                  f"direct {t1 / (world * (float(direct.max()) + a2a)):.3f} "
                  f"(busiest rank / mean {float(direct.max() / direct.mean()):.3f}; all-to-all {a2a:.1f} ms; "
                  f"ideal {t1 / world:.1f} ms a rank)")
            fwd, dq, dkv = cost.pass_times(ring, costs, whole)
            kv = cost.transfer_times(ring, costs, whole)[0][:, :ring.steps].sum(1)
            for name, value in (("own step fwd+bwd", (fwd + dq + dkv)[:, 0]),
                                ("remote steps fwd+bwd", (fwd + dq + dkv)[:, 1:ring.steps].sum(1)),
                                ("K/V arrivals", kv), ("rotation", rotation), ("direct", direct)):
                print(f"    {name:22s}" + " ".join(f"{x:7.1f}" for x in value.tolist()))


if __name__ == "__main__":
    main()
