"""A study on the cost model (ringflash.cost): how much choosing ``document_layout``'s
candidate by the model's time would give over today's rule (balanced within 3% in the
fewest ring steps, else the most even), for packed documents (docs/notes/documents.md,
"Choosing a candidate by its time"):

    python benchmarks/research/layout_choice.py [--seqlens 256k 1m] [--rings 4 8] [--medians 2048 16384]

For each draw (bench_masks.py's log-normal documents, causal within each) and ring of R
ranks: every candidate ``documents._candidates(..., every=True)`` makes, priced by
``cost.rank_times`` (the Gluon kernels' rates, cost.H100_GLUON; the schedule "auto") as the
ring alone within a node (32 heads, MHA) and as the ring of the (8, R) grid across nodes
(4 heads a rank, MHA and GQA 32/8; ``cost_grid.ring_link``: 50 GB/s a GPU between nodes,
the all-to-all left out). Prints the efficiency of the layout ``document_layout`` takes and
of the model's best candidate, with its key ((0, ring steps, way) where balanced, else
(1, busiest rank over the mean, way); way 0 is zigzag, 1-3 the fills in ring order;
"taken": none beats the layout taken, which may be a zigzag one made again). CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_masks import documents  # noqa: E402
from harness import cli  # noqa: E402
from ringflash import cost, cost_grid  # noqa: E402
from ringflash import documents as layouts  # noqa: E402


def efficiency(layout, ring: int, seqlen: int, mask, costs, problem, one_gpu_ms: float) -> float:
    """One GPU's time over R x the busiest ring rank's, by the model."""
    counts = cost.ring_counts(ring, seqlen, layout, mask, "auto")
    return one_gpu_ms / (ring * float(cost.rank_times(counts, costs, problem).max()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", nargs="+", default=["256k,1m"])
    p.add_argument("--rings", type=int, nargs="+", default=[4, 8], help="ring ranks R")
    p.add_argument("--medians", type=int, nargs="+", default=[2048, 16384], help="median document length")
    p.add_argument("--seeds", type=int, default=4, help="draws per (seqlen, R, median)")
    args = p.parse_args()
    base = cost.H100_GLUON
    for seqlen in cli.parse_sizes(args.seqlens):
        for ring in args.rings:
            across = cost_grid.ring_link(base, 8 * ring, ring, cost_grid.NVLINK)
            settings = [("node 32/32", base, cost.Problem(heads=32, kv_heads=32, segments=True)),
                        (f"(8, {ring}) 32/32", across, cost.Problem(heads=4, kv_heads=4, segments=True)),
                        (f"(8, {ring}) 32/8", across, cost.Problem(heads=4, kv_heads=1, segments=True))]
            for median in args.medians:
                for seed in range(args.seeds):
                    lengths = documents(seqlen, seed, median)
                    bounds = torch.tensor([0, *lengths]).cumsum(0)
                    mask = cost.Mask.documents(lengths)
                    one = cost.ring_counts(1, seqlen, "contiguous", mask)
                    taken = layouts.document_layout(bounds, seqlen, world=ring)
                    candidates = [(key, layouts.remember(layouts.DocumentLayout(
                        bounds, seqlen, ring, runs, splits, spread, variant=f";candidate={i}")))
                        for i, (key, runs, splits, spread, _) in enumerate(
                            layouts._candidates(bounds, seqlen, ring, every=True))]
                    line = []
                    for name, costs, problem in settings:
                        one_ms = float(cost.rank_times(one, base, problem)[0])
                        now = efficiency(taken, ring, seqlen, mask, costs, problem, one_ms)
                        best, key = max([(now, ("taken",))] + [
                            (efficiency(layout, ring, seqlen, mask, costs, problem, one_ms), key)
                            for key, layout in candidates], key=lambda pair: pair[0])
                        line.append(f"{name} {now:.3f} -> {best:.3f} {tuple(round(x, 3) if isinstance(x, float) else x for x in key)}")
                    print(f"{seqlen // 1024}k R={ring} median {median} seed {seed} ({len(candidates)} candidates): "
                          + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
