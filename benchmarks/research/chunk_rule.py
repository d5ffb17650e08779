"""One head chunk or two on the heads x ring grid, measured, against the rule the library
chooses by (``ringflash.heads.chunks_pay``, the cost model's: "two chunks where half the
all-to-alls take longer than the ring's steps x (step_ms + 2 message_ms)"; docs/performance.md,
"One head chunk or two"):

    python benchmarks/research/chunk_rule.py

For every pair of grid rows that differ only in their chunks, one and two
(``RINGFLASH_HEAD_CHUNKS=1`` against two), in the results files below: the measured
forward+backward times; the all-to-alls of one unchunked call as measured beside them
(``alltoall_ms``) and as the library estimates them (``heads.unchunked_alltoall_ms``); the
ring's steps over its R ranks (``layouts.active_steps``, of the row's documents' layout for
the document layout); the rule's choice on the measured all-to-alls, and the library's
(``heads.grid_chunks``, on its estimate). CPU, no GPU needed: it reads committed results.
"""

from __future__ import annotations

import itertools
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_masks import documents  # noqa: E402
from harness import results  # noqa: E402
from ringflash import document_layout, heads  # noqa: E402
from ringflash.layouts import active_steps  # noqa: E402

FILES = ("mesh_h200x4_chunks.json", "mesh_h200x4_chunks_gqa_causal.json", "mesh_h200x4_chunks_gqa.json")
KEY = ("heads_parallel", "ring", "heads", "kv_heads", "mask", "seqlen", "layout")


def layout_of(record: dict):
    """The record's layout over its ring's R ranks: its name, or for the document layout the
    one bench_ring.py builds (its documents: median 2k, seed 0)."""
    if record["layout"] != "documents":
        return record["layout"]
    bounds = torch.tensor([0, *itertools.accumulate(documents(record["seqlen"]))], dtype=torch.int64)
    return document_layout(bounds, record["seqlen"], world=record["ring"])


def pairs() -> list[tuple[str, dict, dict]]:
    """(file, the one-chunk row, the two-chunk row) of each setting measured both ways."""
    found = []
    for name in FILES:
        rows = [r for r in results.load_results(results.RESULTS_DIR / name)["records"]
                if r["impl"] == "ringflash" and r.get("heads_parallel", 1) > 1]
        by_key = {}
        for r in rows:
            by_key.setdefault(tuple(r[k] for k in KEY), {})[r["head_chunks"]] = r
        found += [(name, c[1], c[2]) for c in by_key.values() if 1 in c and 2 in c]
    return found


def main() -> None:
    rows = []
    for name, one, two in pairs():
        u, r, local = one["heads_parallel"], one["ring"], one["seqlen"] // one["gpus"]
        layout, band = layout_of(one), (None, 0) if one["mask"] != "none" else (None, None)
        steps = active_steps(layout, r, u * local, band)
        entries = heads.kv_index(one["heads"], one["kv_heads"], u).shape[1]
        estimate = heads.unchunked_alltoall_ms(local, one["heads"], entries, one["head_dim"], 2, u)
        q = torch.empty(1, local, one["heads"], one["head_dim"], dtype=torch.bfloat16, device="meta")
        taken = heads.grid_chunks(q, entries, types.SimpleNamespace(heads_world=u, ring_world=r), layout, band)
        faster = 2 if two["fwdbwd_ms"] < one["fwdbwd_ms"] else 1
        gain = one["fwdbwd_ms"] / two["fwdbwd_ms"] - 1
        rows.append(dict(file=name, grid=f"({u}, {r})", heads=f"{one['heads']}/{one['kv_heads']}", mask=one["mask"],
                         seqlen=f"{one['seqlen'] >> 10}k", one=one["fwdbwd_ms"], two=two["fwdbwd_ms"], gain=100 * gain,
                         a2a=one["alltoall_ms"], estimate=estimate, steps=steps, paid=steps * heads.CHUNK_STEP_MS,
                         rule=2 if heads.chunks_pay(one["alltoall_ms"], steps) else 1, taken=taken,
                         verdict="right" if taken == faster or abs(gain) < 0.005 else "wrong"))
    print(results.format_table(rows, [
        ("file", "file"), ("grid", "(U, R)"), ("heads", "heads"), ("mask", "mask"), ("seqlen", "seqlen"),
        ("one", "1 chunk ms", ".1f"), ("two", "2 chunks ms", ".1f"), ("gain", "2 over 1, speed %", "+.1f"),
        ("a2a", "a2a ms", ".2f"), ("estimate", "a2a estimated", ".2f"), ("steps", "steps"),
        ("paid", "steps x CHUNK_STEP_MS", ".2f"), ("rule", "rule on a2a"), ("taken", "library takes"),
        ("verdict", "library")]))
    print(f"\nCHUNK_STEP_MS {heads.CHUNK_STEP_MS} (cost.H100's step_ms + 2 message_ms); two chunks where half the "
          "all-to-alls outweigh it a step; 'right': the library takes the faster, or the two are within 0.5%")


if __name__ == "__main__":
    main()
