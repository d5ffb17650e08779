"""One head chunk or two on the heads x ring grid, measured, against the cost model's rule
"two chunks where half the all-to-alls take longer than the ring's steps x (step_ms + 2
message_ms)" (docs/performance.md, "One head chunk or two"; docs/notes/documents.md):

    python benchmarks/research/chunk_rule.py

For every pair of grid rows that differ only in their chunks, one and two
(``RINGFLASH_HEAD_CHUNKS=1`` against the default), in the results files below: the measured
forward+backward times, the all-to-alls of one unchunked call as measured beside them
(``alltoall_ms``), the ring's steps over its R ranks (R for a layout by name, whose causal
ring runs every hop; ``document_layout(...).steps`` of the row's documents for the document
layout), and the rule's choice with cost.H100's constants (those the model uses for every
GPU). CPU, no GPU needed: it reads committed results.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_masks import documents  # noqa: E402
from harness import results  # noqa: E402
from ringflash import cost, document_layout  # noqa: E402

FILES = ("mesh_h200x4_chunks.json", "mesh_h200x4_chunks_gqa_causal.json", "mesh_h200x4_chunks_gqa.json")
KEY = ("heads_parallel", "ring", "heads", "kv_heads", "mask", "seqlen", "layout")


def ring_steps(record: dict) -> int:
    """The steps of the ring over the record's R ranks: every hop for a layout by name, the
    layout's own for the document layout (bench_ring.py's documents: median 2k, seed 0)."""
    ring = record["ring"]
    if record["layout"] != "documents" or ring == 1:
        return ring
    lengths = documents(record["seqlen"])
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    return document_layout(bounds, record["seqlen"], world=ring).steps


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
    per_step = cost.H100.step_ms + 2 * cost.H100.message_ms
    rows = []
    for name, one, two in pairs():
        steps = ring_steps(one)
        hidden, paid = one["alltoall_ms"] / 2, steps * per_step
        rule = 2 if hidden > paid else 1
        faster = 2 if two["fwdbwd_ms"] < one["fwdbwd_ms"] else 1
        gain = one["fwdbwd_ms"] / two["fwdbwd_ms"] - 1
        rows.append(dict(file=name, grid=f"({one['heads_parallel']}, {one['ring']})",
                         heads=f"{one['heads']}/{one['kv_heads']}", mask=one["mask"], seqlen=f"{one['seqlen'] >> 10}k",
                         one=one["fwdbwd_ms"], two=two["fwdbwd_ms"], gain=100 * gain, a2a=one["alltoall_ms"],
                         steps=steps, hidden=hidden, paid=paid, rule=rule,
                         verdict="right" if rule == faster or abs(gain) < 0.005 else "wrong"))
    print(results.format_table(rows, [
        ("file", "file"), ("grid", "(U, R)"), ("heads", "heads"), ("mask", "mask"), ("seqlen", "seqlen"),
        ("one", "1 chunk ms", ".1f"), ("two", "2 chunks ms", ".1f"), ("gain", "2 over 1, speed %", "+.1f"),
        ("a2a", "a2a ms", ".2f"), ("steps", "steps"), ("hidden", "a2a / 2", ".2f"),
        ("paid", "steps x step cost", ".2f"), ("rule", "rule takes"), ("verdict", "rule")]))
    print(f"\nstep cost: step_ms {cost.H100.step_ms} + 2 x message_ms {cost.H100.message_ms} = {per_step:.3f} ms "
          "(cost.H100); 'right': the rule takes the faster, or the two are within 0.5%")


if __name__ == "__main__":
    main()
