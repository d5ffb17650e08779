"""The ring's cost model (ringflash.cost) against the measured rows, then its prediction for
W = 8-64 ranks at 512k-4M tokens: why packed documents lose efficiency with block_stripe as
W grows, and what a layout built from the documents could reach (a bound from the model).

    python benchmarks/predict_scaling.py                       # both tables, CPU, ~6 min on 2 cores
    python benchmarks/predict_scaling.py --fit                 # refit the constants first
    python benchmarks/predict_scaling.py --out /tmp/pred.json  # also the records (impl "cost_model")

Measured rows: every ring row of benchmarks/results/masks_h100x2.json, masks_h100x2_512k.json,
masks_h200x2.json and masks_h200x4.json against the 1-GPU row of the same run, and the efficiencies measured on 4 x H100 on
2026-11-26 (that run's JSON was not committed: quoted in ``QUOTED_H100X4``). Masks as
bench_masks.py builds them: documents of log-normal lengths (its own generator, seed 0),
causal within each; window: causal, 4096 keys back. bf16, 32 heads, head_dim 128, batch 1.
Efficiency = 1-GPU time / (W x ring time). ``--fit`` fits the model's constants to all of them
(``cost.FITTED``; the rest held at ``cost.H100``'s). Also checked, not fitted to: the ring-alone
rows on packed documents of bench_ring.py's grid runs (``MESH_MEASURED``).
Nothing is written unless --out says where.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench_masks import documents
import ringflash
from harness import cli, results
from ringflash import cost, cost_bound

WINDOW = 4096
# 4 x H100, 2026-11-26 (`torchrun --nproc-per-node=4 benchmarks/bench_masks.py --ring` on the
# tree of that day; the run's JSON was not committed): (mask, seqlen, layout, efficiency).
# Their 1-GPU times are masks_h100x2.json's (same GPU, documents and command).
QUOTED_H100X4 = [("documents", 32768, "block_stripe", 0.74), ("documents", 131072, "block_stripe", 0.68),
                 ("window", 32768, "contiguous", 0.79), ("window", 131072, "contiguous", 0.87),
                 ("causal", 131072, "zigzag", 0.97)]
MEASURED = ("masks_h100x2.json", "masks_h100x2_512k.json", "masks_h200x2.json", "masks_h200x4.json")
# bench_ring.py's grid runs, whose ring-alone rows on packed documents are the same draw and
# layout (2026-11-27); checked against, not fitted to (the constants predate them).
MESH_MEASURED = ("mesh_h200x2.json", "mesh_h200x4.json")
PREDICT = [("causal", "zigzag"), ("documents", "block_stripe"), ("documents", "contiguous"),
           ("window", "contiguous"), ("window", "block_stripe"), ("documents", "document_layout"),
           ("documents", "documents")]


def mask_of(mask: str, seqlen: int) -> cost.Mask:
    if mask == "causal":
        return cost.Mask(causal=True)
    if mask == "window":
        return cost.Mask(causal=True, window=(WINDOW, 0))
    return cost.Mask.documents(documents(seqlen))


def measured_rows() -> list[dict]:
    """Each measured ring row: source, device, gpus, mask, seqlen, layout, measured efficiency,
    and the 1-GPU ms of its run."""
    rows = []
    for name in MEASURED:
        data = results.load_results(results.RESULTS_DIR / name)
        one = {(r["mask"], r["seqlen"]): r["fwdbwd_ms"] for r in data["records"] if r["impl"] == "ringflash_1gpu"}
        for r in data["records"]:
            if r["impl"] == "ringflash" and r.get("gpus"):
                t1 = one[(r["mask"], r["seqlen"])]
                rows.append(dict(source=name, device=data["meta"]["device"], gpus=r["gpus"], mask=r["mask"],
                                 seqlen=r["seqlen"], layout=r["layout"], one_ms=t1,
                                 measured=t1 / (r["gpus"] * r["fwdbwd_ms"])))
    for name in MESH_MEASURED:  # the ring alone (U = 1) on packed documents, MHA, beside its 1-GPU row
        data = results.load_results(results.RESULTS_DIR / name)
        mha = [r for r in data["records"] if r["mask"] == "documents" and r.get("kv_heads") == r.get("heads")]
        one = {r["seqlen"]: r["fwdbwd_ms"] for r in mha if r["impl"] == "ringflash_1gpu"}
        rows += [dict(source=name, device=data["meta"]["device"], gpus=r["gpus"], mask="documents",
                      seqlen=r["seqlen"], layout=r["layout"], one_ms=one[r["seqlen"]], measured=r["efficiency"])
                 for r in mha if r["impl"] == "ringflash" and r.get("heads_parallel") == 1 and r["seqlen"] in one]
    h100 = {(r["mask"], r["seqlen"]): r["one_ms"] for r in rows if r["source"] == MEASURED[0]}
    rows += [dict(source="4 x H100, quoted", device="4 x H100 (2026-11-26)", gpus=4, mask=m, seqlen=n, layout=lay,
                  one_ms=h100[(m, n)], measured=eff) for m, n, lay, eff in QUOTED_H100X4]
    return rows


def counted(rows: list[dict]) -> None:
    """Adds each row's ring and 1-GPU counts (``ring``, ``one``) and its Problem."""
    for r in rows:
        m = mask_of(r["mask"], r["seqlen"])
        layout = r["layout"]
        if layout == "documents":  # the layout bench_masks.py computed from the same documents,
            # as it was when these rows were measured: split documents zigzag only
            layout = ringflash.documents._made(torch.tensor(m.cu_seqlens), r["seqlen"], r["gpus"], fills=())
        r["ring"] = cost.ring_counts(r["gpus"], r["seqlen"], layout, m)
        r["one"] = cost.ring_counts(1, r["seqlen"], "contiguous", m)
        r["problem"] = cost.Problem(segments=m.cu_seqlens is not None)


def refit(rows: list[dict]) -> cost.Costs:
    """The constants fitted to every measured row: its ring efficiency, and each run's 1-GPU
    time of every (mask, seqlen) (the quoted 4 x H100 rows borrow masks_h100x2.json's)."""
    ones = {(r["source"], r["mask"], r["seqlen"]): r for r in rows if r["source"] in MEASURED}.values()
    fitted = [r for r in rows if r["source"] not in MESH_MEASURED]
    costs, rms = cost.fit([(r["one"], r["problem"], r["one_ms"]) for r in ones],
                          [(r["ring"], r["one"], r["problem"], r["measured"]) for r in fitted])
    print(f"fitted {', '.join(cost.FITTED)} on {len(fitted)} ring rows and {len(ones)} 1-GPU times "
          f"(rms error {rms:.3f}): {costs}\n")
    return costs


def calibration(rows: list[dict], costs: cost.Costs) -> list[dict]:
    for r in rows:
        r["predicted"] = cost.efficiency(r["ring"], r["one"], costs, r["problem"])
        r["one_predicted_ms"] = float(cost.rank_times(r["one"], costs, r["problem"])[0])
        r["error"] = r["predicted"] / r["measured"] - 1
    print("calibration: measured against predicted efficiency, forward+backward (the constants are "
          "fitted to every row)")
    print(results.format_table(rows, [("source", "source"), ("gpus", "W"), ("mask", "mask"),
                                      ("seqlen", "seqlen", cli.fmt_size), ("layout", "layout"),
                                      ("measured", "measured", ".3f"), ("predicted", "predicted", ".3f"),
                                      ("error", "error", "+.1%")]))
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"largest error {worst['error']:+.1%} ({worst['source']}, W = {worst['gpus']}, {worst['mask']}, "
          f"{cli.fmt_size(worst['seqlen'])}, {worst['layout']})")
    return [dict(impl="cost_model", layout=r["layout"], mask=r["mask"], seqlen=r["seqlen"], gpus=r["gpus"],
                 predicted_efficiency=r["predicted"], measured_efficiency=r["measured"], measured_on=r["device"],
                 measured_in=r["source"]) for r in rows]


def predictions(worlds: list[int], seqlens: list[int], costs: cost.Costs) -> list[dict]:
    records, table = [], []
    for seqlen in seqlens:
        for mask, layout in PREDICT:
            m = mask_of(mask, seqlen)
            problem = cost.Problem(segments=m.cu_seqlens is not None)
            one = cost.ring_counts(1, seqlen, "contiguous", m)
            row = dict(mask=mask, seqlen=seqlen, layout=layout + (" (bound)" if layout == "documents" else ""))
            for world in worlds:
                if layout == "documents":  # the model's bound for a layout built from the documents
                    bound = cost_bound.document_bound(world, seqlen, documents(seqlen), costs, problem)
                    eff, steps = bound["efficiency"], None
                elif layout == "document_layout":  # ringflash.document_layout, counted token by token
                    if world * seqlen > cost.TOKENWISE_LIMIT:
                        row[f"W={world}"] = float("nan")
                        continue
                    built = ringflash.document_layout(torch.tensor(m.cu_seqlens), seqlen, world=world)
                    ring = cost.ring_counts(world, seqlen, built, m)
                    eff, steps = cost.efficiency(ring, one, costs, problem), ring.steps
                else:
                    ring = cost.ring_counts(world, seqlen, layout, m)
                    eff, steps = cost.efficiency(ring, one, costs, problem), ring.steps
                row[f"W={world}"] = eff
                records.append(dict(impl="cost_model", layout=layout, mask=mask, seqlen=seqlen, gpus=world,
                                    predicted_efficiency=eff, steps=steps, bound=layout == "documents",
                                    window=WINDOW if mask == "window" else None))
            table.append(row)
    print("\npredicted efficiency (the constants in use: cost.H100, or refitted; document_layout: "
          "ringflash.document_layout, nan past world x seqlen = 2^26; documents (bound): what a layout "
          "from the documents splitting long ones over the fewest ranks could reach, by the model)")
    print(results.format_table(table, [("mask", "mask"), ("seqlen", "seqlen", cli.fmt_size), ("layout", "layout")]
                               + [(f"W={w}", f"W={w}", ".2f") for w in worlds]))
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=cli.HelpFormatter)
    p.add_argument("--worlds", nargs="+", default=["8,16,32,64"], help="ranks to predict for")
    p.add_argument("--seqlens", nargs="+", default=["512k,1m,2m,4m"], help="global lengths to predict for")
    p.add_argument("--fit", action="store_true", help="refit the constants to the measured rows first")
    p.add_argument("--no-calibration", action="store_true", help="skip the measured rows")
    p.add_argument("--out", default=None, metavar="PATH", help="write the records as JSON here (a .json path)")
    args = p.parse_args(argv)
    worlds = sorted({int(w) for v in args.worlds for w in str(v).split(",") if w.strip()})
    seqlens = cli.parse_sizes(args.seqlens)
    start, costs, records = time.time(), cost.H100, []
    if not args.no_calibration:
        rows = measured_rows()
        counted(rows)
        if args.fit:
            costs = refit(rows)
        records += calibration(rows, costs)
    records += predictions(worlds, seqlens, costs)
    print(f"\nconstants: {costs}; {time.time() - start:.1f} s on the CPU")
    if args.out:
        path = Path(args.out)
        meta = dict(results.collect_meta(None), costs=costs._asdict(), model="ringflash.cost")
        print(f"wrote {results.write_results(path.stem, meta, records, path.parent)}")


if __name__ == "__main__":
    main()
