"""The ring's cost model (ringflash.cost) against the measured rows, then its prediction for
W = 8-64 ranks at 512k-4M tokens: why packed documents lose efficiency with block_stripe as
W grows, and what a layout built from the documents could reach (a bound from the model);
then the heads x ring grid's model (ringflash.cost_grid) against the measured grid rows,
and which grid (U, R) keeps packed documents fastest at W = 8-64 over nodes of 8 GPUs.

    python benchmarks/predict_scaling.py                       # every table, CPU, ~3 min on 2 cores
    python benchmarks/predict_scaling.py --fit                 # refit the constants first
    python benchmarks/predict_scaling.py --out /tmp/pred.json  # also the records (impl "cost_model")
    python benchmarks/predict_scaling.py --schedule rotate     # predict through the rotation alone
    python benchmarks/predict_scaling.py --gluon               # predict at the Gluon kernels' rates

Measured rows: every ring row of benchmarks/results/masks_h100x2.json, masks_h100x2_512k.json,
masks_h200x2.json and masks_h200x4.json against the 1-GPU row of the same run, and the efficiencies measured on 4 x H100 on
2026-11-26 (that run's JSON was not committed: quoted in ``QUOTED_H100X4``). Masks as
bench_masks.py builds them: documents of log-normal lengths (its own generator, seed 0),
causal within each; window: causal, 4096 keys back. bf16, 32 heads, head_dim 128, batch 1.
Efficiency = 1-GPU time / (W x ring time). ``--fit`` fits the model's constants to all of them
(``cost_fit.FITTED``; the rest held at ``cost.H100``'s). Also checked, not fitted to: the ring-alone
rows on packed documents of bench_ring.py's grid runs (``MESH_MEASURED``), and the ring rows
of ``CURRENT_LAYOUT`` (measured with the document layout as it is now, and counted so).
Left out: runs whose segment ids ran on the Gluon kernels (meta.runs' ``segment_kernels``),
faster than the Triton kernels the constants describe; the rows of ``GLUON_MEASURED``, run on
the Gluon kernels, are checked against ``cost.H100_GLUON`` instead. The measured rows ran the rotation
and are counted so (``ring_counts(..., schedule="rotate")``); the predictions take the
schedule the ring would (``--schedule``, as RINGFLASH_SCHEDULE: "auto", the direct schedule
from three steps on where shards travel cut), and each table says which rows ran it.

The grid (``ringflash.cost_grid``): every grid row (U > 1) of ``MESH_MEASURED``, its
efficiency, its all-to-alls timed alone (``alltoall_ms``: what ``cost_grid.NVLINK`` is fitted
to, ``--fit`` refits it) and what the grid exposes over its ring alone (``exposed_comm_ms``:
a test of the model's overlap rule, not fitted). Then for W = --worlds at --seqlens, the same
packed documents, 32 heads over 8 and over 32 kv heads: the ring alone on the documents'
layout and each grid (U, W / U), U in 2, 4, 8, on that layout over its ring; a heads group
within one node of --node-gpus GPUs, the ring across nodes at --internode-gbps a GPU.
Nothing is written unless --out says where.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Optional

import torch

from bench_masks import documents
import ringflash
from harness import cli, results
from ringflash import cost, cost_bound, cost_fit, cost_grid

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
# bench_masks.py --ring on the tree of 85a2f25 (2026-11-27), after documents could be cut in ring
# order: its documents rows are counted with the layout as ringflash.document_layout builds it
# now; checked against, not fitted to.
CURRENT_LAYOUT = ("masks_h200x2_documents.json",)
# bench_masks.py --ring on the Gluon kernels (2026-11-27/28, every ring step's segment ids,
# causal band or window on them where its pairs are on local indices): checked against
# cost.H100_GLUON, each row's own documents' draw and schedule.
GLUON_MEASURED = ("masks_h100x2_window.json", "masks_h100x4_window.json", "masks_h100x4_direct_128k.json",
                  "masks_h100x4_direct_512k.json", "masks_h100x4_direct_512k_nccl.json",
                  "masks_h200x4_documents.json", "masks_h200x4_zigzag_tiles.json", "masks_h200x4_direct_512k.json",
                  "masks_h200x4_direct_512k_nccl.json", "masks_h200x4_documents_rerun.json",
                  "masks_h200x4_routes_512k.json")
# Files of GLUON_MEASURED holding runs of earlier code beside today's: the runs counted.
GLUON_RUNS = {"masks_h200x4_zigzag_tiles.json": (2, 4), "masks_h200x4_routes_512k.json": (0, 2)}
# The grid runs (MESH_MEASURED's meta.runs) on trees whose document layout is today's: their
# rows are counted so too.
CURRENT_LAYOUT_COMMITS = ("85a2f25f6afd0b9315a03360e615a66144d8442d", "4343b21699db8aad437becc6feae7c66980f1a6e")


def _triton_documents(data: dict, record: dict) -> bool:
    """Whether ``record`` ran packed documents on the Triton kernels, whose rates the model's
    constants are fitted to: not a run whose meta.runs entry says its segment ids ran on
    the Gluon kernels (``segment_kernels``; 1.14-1.62x faster, kernels/dispatch.py), which
    the model does not count yet."""
    runs = data["meta"].get("runs")
    return runs is None or runs[record.get("run", 0)].get("segment_kernels") != "gluon_sm90"


def _current_layout(name: str, data: dict, record: dict) -> bool:
    """Whether ``record`` of results file ``name`` ran with the document layout as it is now."""
    runs = data["meta"].get("runs")
    return name in CURRENT_LAYOUT or (runs is not None and runs[record.get("run", 0)].get("commit")
                                      in CURRENT_LAYOUT_COMMITS)
# The grid table's query heads / kv heads, and the heads-group sizes it weighs.
GRID_HEADS = ((32, 8), (32, 32))
GRID_UNITS = (2, 4, 8)
PREDICT = [("causal", "zigzag"), ("documents", "block_stripe"), ("documents", "contiguous"),
           ("window", "contiguous"), ("window", "block_stripe"), ("documents", "document_layout"),
           ("documents", "documents")]


@functools.lru_cache(maxsize=None)
def documents_ring(world: int, seqlen: int, schedule: str = "auto") -> Optional[cost.RingCounts]:
    """The counts of ``ringflash.document_layout``'s ring of ``world`` ranks on the documents of
    ``seqlen`` tokens, counted token by token (None past world x seqlen = 2^26); kept, as the
    grid table's rings over R ranks are the same whatever U."""
    if world * seqlen > cost.TOKENWISE_LIMIT:
        return None
    return cost_grid.grid_ring(world, 1, seqlen, "documents", mask_of("documents", seqlen), schedule)


def schedule_of(ring: cost.RingCounts) -> str:
    """The schedule the model runs ``ring`` through: "direct", "early home" (a ring of two's
    ``rotate._home_first``) or "rotation"."""
    return "direct" if ring.direct else "early home" if ring.early_home else "rotation"


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
    for name in MEASURED + CURRENT_LAYOUT:
        data = results.load_results(results.RESULTS_DIR / name)
        kept = [r for r in data["records"] if _triton_documents(data, r)]
        one = {(r.get("run"), r["mask"], r["seqlen"]): r["fwdbwd_ms"] for r in kept if r["impl"] == "ringflash_1gpu"}
        for r in kept:
            if r["impl"] == "ringflash" and r.get("gpus"):
                t1 = one[(r.get("run"), r["mask"], r["seqlen"])]
                rows.append(dict(source=name, device=data["meta"]["device"], gpus=r["gpus"], mask=r["mask"],
                                 seqlen=r["seqlen"], layout=r["layout"], one_ms=t1,
                                 measured=t1 / (r["gpus"] * r["fwdbwd_ms"]),
                                 current_layout=_current_layout(name, data, r)))
    for name in MESH_MEASURED:  # the ring alone (U = 1) on packed documents, MHA, beside its 1-GPU row
        data = results.load_results(results.RESULTS_DIR / name)
        mha = [r for r in data["records"] if r["mask"] == "documents" and r.get("kv_heads") == r.get("heads")
               and _triton_documents(data, r)]
        one = {(r.get("run"), r["seqlen"]): r["fwdbwd_ms"] for r in mha if r["impl"] == "ringflash_1gpu"}
        rows += [dict(source=name, device=data["meta"]["device"], gpus=r["gpus"], mask="documents",
                      seqlen=r["seqlen"], layout=r["layout"], one_ms=one[(r.get("run"), r["seqlen"])],
                      measured=r["efficiency"], current_layout=_current_layout(name, data, r))
                 for r in mha if r["impl"] == "ringflash" and r.get("heads_parallel") == 1
                 and (r.get("run"), r["seqlen"]) in one]
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
            # as it was when these rows were measured: split documents zigzag only, or where
            # ``current_layout`` as it is now
            now = {} if r.get("current_layout") else dict(fills=())
            layout = ringflash.documents._made(torch.tensor(m.cu_seqlens), r["seqlen"], r["gpus"], **now)
        r["ring"] = cost.ring_counts(r["gpus"], r["seqlen"], layout, m, schedule="rotate")  # as measured
        r["one"] = cost.ring_counts(1, r["seqlen"], "contiguous", m)
        r["problem"] = cost.Problem(segments=m.cu_seqlens is not None)


def refit(rows: list[dict]) -> cost.Costs:
    """The constants fitted to every measured row: its ring efficiency, and each run's 1-GPU
    time of every (mask, seqlen) (the quoted 4 x H100 rows borrow masks_h100x2.json's)."""
    ones = {(r["source"], r["mask"], r["seqlen"]): r for r in rows if r["source"] in MEASURED}.values()
    fitted = [r for r in rows if r["source"] not in MESH_MEASURED + CURRENT_LAYOUT]
    costs, rms = cost_fit.fit([(r["one"], r["problem"], r["one_ms"]) for r in ones],
                              [(r["ring"], r["one"], r["problem"], r["measured"]) for r in fitted])
    print(f"fitted {', '.join(cost_fit.FITTED)} on {len(fitted)} ring rows and {len(ones)} 1-GPU times "
          f"(rms error {rms:.3f}): {costs}\n")
    return costs


def calibration(rows: list[dict], costs: cost.Costs) -> list[dict]:
    for r in rows:
        r["predicted"] = cost.efficiency(r["ring"], r["one"], costs, r["problem"])
        r["one_predicted_ms"] = float(cost.rank_times(r["one"], costs, r["problem"])[0])
        r["error"] = r["predicted"] / r["measured"] - 1
    print("calibration: measured against predicted efficiency, forward+backward (the constants are "
          f"fitted to every row but those of {', '.join(MESH_MEASURED + CURRENT_LAYOUT)})")
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


def gluon_calibration() -> list[dict]:
    """Every ring row of ``GLUON_MEASURED`` against ``cost.H100_GLUON`` (the steps whose
    pairs carry a band on global positions, block_stripe's, at the Triton kernels' rates):
    its documents' draw (``documents_seed``, ``documents_median``), its schedule, its layout
    as ``ringflash.document_layout`` makes it now."""
    rows = []
    for name in GLUON_MEASURED:
        data = results.load_results(results.RESULTS_DIR / name)
        records = [r for r in data["records"] if r.get("run", 0) in GLUON_RUNS.get(name, (r.get("run", 0),))]
        one = {(r.get("run"), r["mask"], r["seqlen"]): r["fwdbwd_ms"] for r in records if r["impl"] == "ringflash_1gpu"}
        for r in (r for r in records if r["impl"] == "ringflash" and r.get("gpus")):
            seqlen, world = r["seqlen"], r["gpus"]
            m = (cost.Mask.documents(documents(seqlen, r.get("documents_seed", 0), r.get("documents_median", 2048)))
                 if r["mask"] == "documents" else mask_of(r["mask"], seqlen))
            layout = (ringflash.document_layout(torch.tensor(m.cu_seqlens), seqlen, world=world)
                      if r["layout"] == "documents" else r["layout"])
            ring = cost.ring_counts(world, seqlen, layout, m, schedule=r.get("schedule", "rotate"))
            measured = one[(r.get("run"), r["mask"], seqlen)] / (world * r["fwdbwd_ms"])
            predicted = cost.efficiency(ring, cost.ring_counts(1, seqlen, "contiguous", m), cost.H100_GLUON,
                                        cost.Problem(segments=m.cu_seqlens is not None))
            rows.append(dict(source=name, device=data["meta"]["device"], gpus=world, mask=r["mask"], seqlen=seqlen,
                             layout=r["layout"], schedule=r.get("schedule", "-"), measured=measured,
                             predicted=predicted, error=predicted / measured - 1))
    print("\nthe Gluon kernels (cost.H100_GLUON; checked, not fitted):")
    print(results.format_table(rows, [("source", "source"), ("gpus", "W"), ("mask", "mask"),
                                      ("seqlen", "seqlen", cli.fmt_size), ("layout", "layout"),
                                      ("schedule", "schedule"), ("measured", "measured", ".3f"),
                                      ("predicted", "predicted", ".3f"), ("error", "error", "+.1%")]))
    errors = torch.tensor([r["error"] for r in rows] or [0.0])
    print(f"rms {float(errors.square().mean().sqrt()):.1%}, largest {float(errors.abs().max()):.1%}; "
          f"{sum(abs(r['error']) <= 0.10 for r in rows)} of {len(rows)} rows within 10%")
    return [dict(impl="cost_model", layout=r["layout"], mask=r["mask"], seqlen=r["seqlen"], gpus=r["gpus"],
                 schedule=r["schedule"], predicted_efficiency=r["predicted"], measured_efficiency=r["measured"],
                 measured_on=r["device"], measured_in=r["source"], kernels="gluon") for r in rows]


def _direct_at(row: dict, names) -> str:
    """Which of ``names`` (the row's keys) ran the direct schedule: ``row["schedules"]``."""
    return ", ".join(name for name in names if row["schedules"].get(name) == "direct") or "-"


def predictions(worlds: list[int], seqlens: list[int], costs: cost.Costs, schedule: str = "auto") -> list[dict]:
    records, table = [], []
    for seqlen in seqlens:
        for mask, layout in PREDICT:
            m = mask_of(mask, seqlen)
            problem = cost.Problem(segments=m.cu_seqlens is not None)
            one = cost.ring_counts(1, seqlen, "contiguous", m)
            row = dict(mask=mask, seqlen=seqlen, layout=layout + (" (bound)" if layout == "documents" else ""),
                       schedules={})
            for world in worlds:
                if layout == "documents":  # the model's bound for a layout built from the documents
                    bound = cost_bound.document_bound(world, seqlen, documents(seqlen), costs, problem)
                    eff, steps, ran = bound["efficiency"], None, "rotation"  # its rings: cost_timeline.rotation
                else:  # document_layout: ringflash.document_layout, counted token by token
                    ring = (documents_ring(world, seqlen, schedule) if layout == "document_layout"
                            else cost.ring_counts(world, seqlen, layout, m, schedule))
                    if ring is None:
                        row[f"W={world}"] = float("nan")
                        continue
                    eff, steps, ran = cost.efficiency(ring, one, costs, problem), ring.steps, schedule_of(ring)
                row[f"W={world}"], row["schedules"][str(world)] = eff, ran
                records.append(dict(impl="cost_model", layout=layout, mask=mask, seqlen=seqlen, gpus=world,
                                    predicted_efficiency=eff, steps=steps, bound=layout == "documents",
                                    schedule=ran, window=WINDOW if mask == "window" else None))
            row["direct"] = _direct_at(row, [str(w) for w in worlds])
            table.append(row)
    print("\npredicted efficiency (the constants in use: cost.H100, or refitted; document_layout: "
          "ringflash.document_layout, nan past world x seqlen = 2^26; documents (bound): what a layout "
          "from the documents splitting long ones over the fewest ranks could reach, by the model; "
          f"schedule {schedule!r}: \"direct at W\" names the W whose ring ran the direct schedule, the "
          "rest the rotation)")
    print(results.format_table(table, [("mask", "mask"), ("seqlen", "seqlen", cli.fmt_size), ("layout", "layout")]
                               + [(f"W={w}", f"W={w}", ".2f") for w in worlds] + [("direct", "direct at W")]))
    return records


def grid_rows(keep=lambda record: True) -> list[dict]:
    """Each measured grid row (U > 1) of ``MESH_MEASURED`` whose record ``keep`` keeps: source,
    device, world, U, R, chunks, mask, seqlen, layout, heads, measured efficiency, alltoall_ms
    and exposed_ms as measured; with the counts of its ring over R ranks and at world 1
    (``counted``: documents on the layout then built), its Problem, and ``timed``: the
    exchanges its all-to-alls were timed on alone (bench_ring.py's ``_alltoall_ms``: the
    unchunked call's, no segment ids)."""
    rows = []
    for name in MESH_MEASURED:
        data = results.load_results(results.RESULTS_DIR / name)
        for r in data["records"]:
            if (r["impl"] != "ringflash" or r.get("heads_parallel", 1) < 2 or r.get("fwdbwd_ms") is None
                    or not keep(r) or not _triton_documents(data, r)):
                continue
            rows.append(dict(source=name, device=data["meta"]["device"], gpus=r["ring"], world=r["gpus"],
                             heads_parallel=r["heads_parallel"], ring_world=r["ring"], chunks=r["head_chunks"],
                             mask=r["mask"], seqlen=r["seqlen"], layout=r["layout"],
                             heads=f"{r['heads']}/{r['kv_heads']}", measured=r["efficiency"],
                             alltoall_ms=r["alltoall_ms"], exposed_ms=r["exposed_comm_ms"],
                             current_layout=_current_layout(name, data, r)))
    counted(rows)  # "gpus": the ring's R ranks; "ring": its counts
    for r in rows:
        heads, kv_heads = map(int, r["heads"].split("/"))
        r["problem"] = r["problem"]._replace(heads=heads, kv_heads=kv_heads)
        r["timed"] = cost_grid.exchanges(r["heads_parallel"], r["ring_world"], r["seqlen"],
                                         r["problem"]._replace(segments=False), 1)
    return rows


def grid_calibration(rows: list[dict], costs: cost.Costs, grid: cost_grid.GridCosts, refit: bool):
    """Prints the all-to-all constants fitted to the rows' ``alltoall_ms`` (each measured
    configuration once), and per grid row the measured against predicted efficiency, the
    all-to-alls alone, and the time exposed over the ring alone. Returns (the grid constants
    in use: the fitted ones where ``refit``, else ``grid``; the records)."""
    timed = {(r["source"], r["heads_parallel"], r["ring_world"], r["seqlen"], r["heads"], r["mask"]): r for r in rows}
    fitted, rms = cost_grid.fit_alltoall([(r["timed"], r["alltoall_ms"]) for r in timed.values()], grid)
    grid = fitted if refit else grid
    print(f"\nall-to-all fitted to the alltoall_ms of {len(timed)} measured configurations: "
          f"{fitted.alltoall_gbps:.1f} GB/s a rank + {fitted.alltoall_ms:.4f} ms a call, rms error {rms:.3f} "
          f"(in use: {grid.alltoall_gbps:.1f} GB/s + {grid.alltoall_ms:.4f} ms)")
    for r in rows:
        times = cost_grid.grid_times(r["ring"], r["heads_parallel"], r["problem"], costs, grid, r["chunks"])
        r["predicted"] = cost_grid.efficiency_of(times, r["one"], costs, r["problem"])
        r["error"] = r["predicted"] / r["measured"] - 1
        r["alltoall_predicted"] = sum(cost_grid.exchange_ms(x, grid) for x in r["timed"])
        r["alltoall_error"] = r["alltoall_predicted"] / r["alltoall_ms"] - 1
        r["exposed_predicted"] = times.exposed_ms
    print("grid calibration: efficiency measured against predicted (the ring's constants unchanged), the "
          "all-to-alls of one unchunked call alone (fitted) and what the grid exposes over its ring alone "
          "(ms, not fitted)")
    print(results.format_table(rows, [
        ("source", "source"), ("heads_parallel", "U"), ("ring_world", "R"), ("chunks", "C"), ("mask", "mask"),
        ("seqlen", "seqlen", cli.fmt_size), ("heads", "heads"), ("measured", "measured", ".3f"),
        ("predicted", "predicted", ".3f"), ("error", "error", "+.1%"), ("alltoall_ms", "a2a", ".2f"),
        ("alltoall_predicted", "a2a model", ".2f"), ("alltoall_error", "a2a error", "+.1%"),
        ("exposed_ms", "exposed", ".2f"), ("exposed_predicted", "exposed model", ".2f")]))
    worst = max(rows, key=lambda r: abs(r["error"]))
    rms = (sum(r["error"] ** 2 for r in rows) / len(rows)) ** 0.5
    print(f"largest efficiency error {worst['error']:+.1%} ({worst['source']}, ({worst['heads_parallel']}, "
          f"{worst['ring_world']}), {worst['mask']}, {cli.fmt_size(worst['seqlen'])}, heads {worst['heads']}, "
          f"C = {worst['chunks']}); rms {rms:.1%}")
    return grid, [dict(impl="cost_model", layout=r["layout"], mask=r["mask"], seqlen=r["seqlen"], gpus=r["world"],
                       heads_parallel=r["heads_parallel"], ring=r["ring_world"], head_chunks=r["chunks"],
                       heads=r["problem"].heads, kv_heads=r["problem"].kv_heads,
                       predicted_efficiency=r["predicted"], measured_efficiency=r["measured"],
                       predicted_alltoall_ms=r["alltoall_predicted"], measured_alltoall_ms=r["alltoall_ms"],
                       predicted_exposed_ms=r["exposed_predicted"], measured_exposed_ms=r["exposed_ms"],
                       measured_on=r["device"], measured_in=r["source"]) for r in rows]


def grid_predictions(worlds: list[int], seqlens: list[int], costs: cost.Costs, grid: cost_grid.GridCosts,
                     schedule: str = "auto") -> list[dict]:
    """Per W, seqlen and GRID_HEADS: the predicted efficiency on the packed documents of the
    ring alone with one link speed on every hop (cost's, as ``predictions``), and of the ring
    alone (U = 1) and each grid (U, W / U), U in GRID_UNITS dividing the heads and W, on the
    documents' layout over the ring, with ``grid``'s links (a heads group within a node, the
    ring across nodes where W > node_gpus); which is best; which ran the direct schedule.
    nan (-) past R x seqlen = 2^26."""
    records, table = [], []
    for seqlen in seqlens:
        one = cost.ring_counts(1, seqlen, "contiguous", mask_of("documents", seqlen))
        for heads, kv_heads in GRID_HEADS:
            problem = cost.Problem(heads=heads, kv_heads=kv_heads, segments=True)
            for world in worlds:
                ring = documents_ring(world, seqlen, schedule)
                row = dict(world=world, seqlen=seqlen, heads=f"{heads}/{kv_heads}", schedules={},
                           one_link=float("nan") if ring is None else cost.efficiency(ring, one, costs, problem))
                if ring is not None:
                    row["schedules"]["one link"] = schedule_of(ring)
                for u in (1,) + GRID_UNITS:
                    if heads % u or world % u or u > grid.node_gpus:
                        continue
                    ring = documents_ring(world // u, seqlen, schedule)
                    if ring is None:
                        row[f"U={u}"] = float("nan")
                        continue
                    times = cost_grid.grid_times(ring, u, problem, costs, grid)
                    row[f"U={u}"] = eff = cost_grid.efficiency_of(times, one, costs, problem)
                    name = "(1, W)" if u == 1 else f"({u}, W/{u})"
                    row["schedules"][name] = schedule_of(ring)
                    records.append(dict(impl="cost_model", layout="document_layout", mask="documents", seqlen=seqlen,
                                        gpus=world, heads_parallel=u, ring=world // u, head_chunks=times.chunks,
                                        heads=heads, kv_heads=kv_heads, predicted_efficiency=eff,
                                        schedule=schedule_of(ring), node_gpus=grid.node_gpus,
                                        internode_gbps=grid.internode_gbps))
                row["direct"] = _direct_at(row, ["one link", "(1, W)"] + [f"({u}, W/{u})" for u in GRID_UNITS])
                best = max(((row[f"U={u}"], u) for u in (1,) + GRID_UNITS if row.get(f"U={u}", float("nan")) > 0),
                           default=None)
                if best is not None:
                    row.update(best=f"({best[1]}, {world // best[1]})", best_efficiency=best[0])
                table.append(row)
    print(f"\npredicted efficiency of the grid on packed documents (the layout from the documents over the "
          f"ring; one link: the ring alone, every hop at {costs.link_gbps:g} GB/s as in the table above; the "
          f"rest: a heads group within a node of {grid.node_gpus} GPUs, all-to-all at "
          f"{grid.alltoall_gbps:g} GB/s + {grid.alltoall_ms:g} ms a call, the ring's hops at "
          f"{grid.internode_gbps:g} GB/s where W > {grid.node_gpus}; - past R x seqlen = 2^26; schedule "
          f"{schedule!r}: \"direct\" names the columns whose ring ran the direct schedule, the rest the rotation)")
    print(results.format_table(table, [("world", "W"), ("seqlen", "seqlen", cli.fmt_size), ("heads", "heads"),
                                       ("one_link", "ring, one link", ".2f"), ("U=1", "(1, W)", ".2f")]
                               + [(f"U={u}", f"({u}, W/{u})", ".2f") for u in GRID_UNITS]
                               + [("best", "best"), ("best_efficiency", "best eff", ".2f"), ("direct", "direct")]))
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=cli.HelpFormatter)
    p.add_argument("--worlds", nargs="+", default=["8,16,32,64"], help="ranks to predict for")
    p.add_argument("--seqlens", nargs="+", default=["512k,1m,2m,4m"], help="global lengths to predict for")
    p.add_argument("--fit", action="store_true", help="refit the constants to the measured rows first")
    p.add_argument("--no-calibration", action="store_true", help="skip the measured rows")
    p.add_argument("--node-gpus", type=int, default=cost_grid.NVLINK.node_gpus,
                   help="GPUs a node: a heads group lies within one, the ring spans nodes beyond")
    p.add_argument("--internode-gbps", type=float, default=cost_grid.NVLINK.internode_gbps,
                   help="the ring's link across nodes, GB/s a GPU (50: one 400 Gb/s InfiniBand NIC a GPU)")
    p.add_argument("--schedule", choices=cost.SCHEDULES, default="auto",
                   help="the predictions' schedule, as RINGFLASH_SCHEDULE (the measured rows ran the rotation)")
    p.add_argument("--gluon", action="store_true",
                   help="predict with cost.H100_GLUON (the Gluon kernels' rates) instead of cost.H100")
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
        records += calibration(rows, costs) + gluon_calibration()
    ahead = costs._replace(gluon=cost.H100_GLUON.gluon) if args.gluon else costs  # the predictions'
    records += predictions(worlds, seqlens, ahead, args.schedule)
    grid = cost_grid.NVLINK._replace(node_gpus=args.node_gpus, internode_gbps=args.internode_gbps)
    if not args.no_calibration:
        grid, measured = grid_calibration(grid_rows(), costs, grid, args.fit)
        records += measured
    records += grid_predictions(worlds, seqlens, ahead, grid, args.schedule)
    print(f"\nconstants: {ahead}; {grid}; {time.time() - start:.1f} s on the CPU")
    if args.out:
        path = Path(args.out)
        meta = dict(results.collect_meta(None), costs=ahead._asdict(), grid_costs=grid._asdict(),
                    model="ringflash.cost, ringflash.cost_grid")
        print(f"wrote {results.write_results(path.stem, meta, records, path.parent)}")


if __name__ == "__main__":
    main()
