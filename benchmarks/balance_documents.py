"""Per-rank work of each layout on packed documents (causal within each document).

    python benchmarks/balance_documents.py [--seqlen 128k] [--world 4] [--draws 20]

Documents are drawn as in bench_masks.py (log-normal lengths, median 2k, about 1% past 64k),
packed into one sequence and cut at its end. A rank's work is the number of (query, key)
pairs its queries see, counted exactly from the global positions it holds
(``ringflash.layouts.global_positions``): the query at position p of a document starting at
s sees p - s + 1 keys. Imbalance = busiest rank / average rank: the ring runs at the pace of
its busiest rank, so 1.10 means 10% of the ring's time is waiting. Runs on a CPU in
seconds; writes balance_documents.json to a new temporary directory, or to --out-dir (the
committed file came from --out-dir benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench_masks import documents
from harness import cli, results
from ringflash.layouts import LAYOUTS, global_positions


def rank_work(lengths: list[int], seqlen: int, layout: str, world: int) -> list[int]:
    starts = torch.repeat_interleave(torch.tensor([0] + lengths[:-1]).cumsum(0), torch.tensor(lengths))
    seen = torch.arange(seqlen) - starts + 1  # keys each query sees
    return [int(seen[global_positions(seqlen, layout, r, world)].sum()) for r in range(world)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seqlen", default="128k", help="global sequence length")
    p.add_argument("--world", type=int, default=4, help="ranks")
    p.add_argument("--draws", type=int, default=20, help="packed sequences drawn (seeds 0..draws-1)")
    p.add_argument("--out-dir", default=None, help="results directory (default: a new temporary one)")
    args = p.parse_args(argv)
    seqlen = cli.parse_size(args.seqlen)
    records = []
    for layout in LAYOUTS:
        imbalance = []
        for seed in range(args.draws):
            work = rank_work(documents(seqlen, seed), seqlen, layout, args.world)
            imbalance.append(max(work) / (sum(work) / args.world))
        records.append(dict(layout=layout, seqlen=seqlen, world=args.world, draws=args.draws,
                            imbalance_mean=statistics.mean(imbalance), imbalance_worst=max(imbalance),
                            imbalance_per_draw=imbalance))
    print(f"packed documents, {cli.fmt_size(seqlen)} tokens, {args.world} ranks, {args.draws} draws: "
          "busiest rank / average rank")
    print(results.format_table(records, [("layout", "layout"), ("imbalance_mean", "mean", ".3f"),
                                   ("imbalance_worst", "worst", ".3f")]))
    path = results.write_results("balance_documents", results.collect_meta(None), records,
                                 results.results_dir(args.out_dir, smoke=True))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
