"""A study on the cost model (ringflash.cost): packed documents over 8-64 GPUs through the
rotation and through the direct schedule, with the K/V received again in the backward (the
copy engines, within a node) and kept from the forward (through torch.distributed, as
across nodes, in eager calls: ringflash/ops.py ``_keeps_received``).

    python benchmarks/research/direct_schedule.py [--seqlen 1m] [--grids 8x1 8x8 64x1 64x4 64x8]

The rotation (``cost.rank_times`` of ``ring_counts(..., schedule="rotate")``): at each step a
rank computes the block pairs of the shard it holds while the next one arrives from its
neighbour; in the backward the shards travel again and the running fp32 dK/dV sums travel
with them, home after the last step. Where a rank's own step is long and its later steps
are short (documents kept whole), the transfers behind the short steps are exposed.

Direct (``schedule="direct"``, what RINGFLASH_SCHEDULE=auto takes from three steps on where
shards travel cut: ``RingCounts.direct``, ``cost_timeline.direct``): every rank posts the receives
of all the rows it needs from every other shard at the start of the forward, and again at
the start of the backward; runs the own step first and each remote step once its rows are
in; in the backward its remote steps' dQ and dK/dV first, each remote shard's fp32 partial
dK/dV sum sent straight to its owner once computed (one after another), the own step's
dK/dV pass last.

"Direct, K/V kept" (``Costs.keeps_received``, which ``cost_grid.ring_link`` sets for a ring
across nodes): the rows received in the forward are kept for the backward (no second trip;
only where shards travel cut), whose remote steps then run at once and its own step's dQ
and dK/dV passes last, under the partial sums' trips home.

Links and the grid's all-to-all as benchmarks/predict_scaling.py has them (a heads group
within a node of 8, the ring across nodes at 50 GB/s), every all-to-all exposed (unchunked).
Prints the efficiency of the three, which one the library takes (auto), the busiest rank
over the mean (the direct schedule as the library runs it there), and per ring rank (up to
16) what its time is made of.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", default="1m")
    p.add_argument("--grids", nargs="+", default=["8x1", "8x8", "64x1", "64x4", "64x8"], help="W x U")
    p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 32])
    p.add_argument("--gluon", action="store_true", help="the Gluon kernels' rates (cost.H100_GLUON)")
    args = p.parse_args()
    base = cost.H100_GLUON if args.gluon else cost.H100
    seqlen = cli.parse_sizes([args.seqlen])[0]
    mask, grid = mask_of("documents", seqlen), cost_grid.NVLINK
    one = cost.ring_counts(1, seqlen, "contiguous", mask)
    for spec in args.grids:
        world, u = (int(x) for x in spec.split("x"))
        auto = cost_grid.grid_ring(world // u, 1, seqlen, "documents", mask)
        ring = cost_grid.grid_ring(world // u, 1, seqlen, "documents", mask, schedule="rotate")
        direct_ring = auto if auto.direct else cost_grid.grid_ring(world // u, 1, seqlen, "documents", mask,
                                                                   schedule="direct")
        costs = cost_grid.ring_link(base, world, world // u, grid)
        for kv_heads in args.kv_heads:
            problem = cost.Problem(heads=32, kv_heads=kv_heads, segments=True)
            whole = problem._replace(heads=32 // u, kv_heads=max(kv_heads // u, 1))
            t1 = float(cost.rank_times(one, base, problem)[0])
            a2a = (sum(cost_grid.exchange_ms(x, grid) for x in cost_grid.exchanges(u, world // u, seqlen, problem))
                   if u > 1 else 0.0)  # unchunked: every exchange exposed
            times = {"rotation": cost.rank_times(ring, costs, whole),
                     "direct": cost.rank_times(direct_ring, costs._replace(keeps_received=False), whole),
                     "direct, K/V kept": cost.rank_times(direct_ring, costs._replace(keeps_received=True), whole)}
            direct = times["direct, K/V kept" if costs.keeps_received else "direct"]
            print(f"W={world} U={u} R={world // u} heads 32/{kv_heads} steps {ring.steps}: "
                  + ", ".join(f"{name} {t1 / (world * (float(t.max()) + a2a)):.3f}" for name, t in times.items())
                  + f" (auto takes {'direct' if auto.direct else 'the rotation'}; direct's busiest rank / mean "
                  f"{float(direct.max() / direct.mean()):.3f}; all-to-all {a2a:.1f} ms; ideal {t1 / world:.1f} ms "
                  "a rank)")
            if world // u > 16:  # per rank: not for long rings
                continue
            fwd, dq, dkv = cost.pass_times(ring, costs, whole)
            kv = cost.transfer_times(ring, costs, whole)[0][:, :ring.steps].sum(1)
            for name, value in (("own step fwd+bwd", (fwd + dq + dkv)[:, 0]),
                                ("remote steps fwd+bwd", (fwd + dq + dkv)[:, 1:ring.steps].sum(1)),
                                ("K/V arrivals", kv), *times.items()):
                print(f"    {name:28s}" + " ".join(f"{x:7.1f}" for x in value.tolist()))


if __name__ == "__main__":
    main()
