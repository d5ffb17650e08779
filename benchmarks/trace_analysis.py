"""What the GPU did during one profiled ring call, from a PyTorch profiler (Kineto) chrome
trace: time by kind of work (attention kernels, merge, other, communication), the
communication no compute hid, and the GPU's idle time. bench_ring.py --profile writes the
traces and prints ``profile_report``.
"""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict
from typing import Optional

import _harness as H


def classify_kernel(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "comm"
    if "merge" in n:
        return "merge"
    if any(s in n for s in ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel", "attn", "attention", "flash", "fmha")):
        return "attention"
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _clip(intervals, lo, hi):
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_breakdown(trace: dict, wall_ms: Optional[float] = None, phases=("ringflash.fwd", "ringflash.bwd")) -> dict:
    """GPU time of one profiled step from a chrome trace, in ms.

    attention / merge / other / comm: summed kernel durations by class (NCCL kernels are
    comm; copies and memsets count as other). exposed_comm: time when an NCCL kernel runs
    and nothing else does, i.e. communication the compute did not hide. idle: wall time
    with no kernel running (launch gaps, host work). Per phase too when the trace has
    the phases' GPU annotations.
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    kernels = [(e.get("name", ""), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("cat"))
               for e in events if e.get("cat") in GPU_CATS and "ts" in e]

    def summarize(lo=-math.inf, hi=math.inf, wall=None) -> dict:
        by_class = defaultdict(list)
        for name, s, e, cat in kernels:
            cls = classify_kernel(name) if cat == "kernel" else "other"
            by_class[cls].extend(_clip([(s, e)], lo, hi))
        total = {c: sum(e - s for s, e in iv) / 1e3 for c, iv in by_class.items()}
        all_iv = [iv for ivs in by_class.values() for iv in ivs]
        non_comm = [iv for c, ivs in by_class.items() if c != "comm" for iv in ivs]
        busy = _union_us(all_iv) / 1e3
        out = {c: total.get(c, 0.0) for c in ("attention", "merge", "other", "comm")}
        out["exposed_comm"] = busy - _union_us(non_comm) / 1e3
        out["gpu_busy"] = busy
        if all_iv:
            out["gpu_span"] = (max(e for _, e in all_iv) - min(s for s, _ in all_iv)) / 1e3
        else:
            out["gpu_span"] = 0.0
        if wall is None and math.isfinite(lo) and math.isfinite(hi):
            wall = (hi - lo) / 1e3
        out["wall"] = wall
        out["idle"] = None if wall is None else max(wall - busy, 0.0)
        return out

    result = {"step": summarize(wall=wall_ms)}
    for ph in phases:
        windows = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                   if e.get("name") == ph and e.get("cat") == "gpu_user_annotation"]
        if windows:
            result[ph] = summarize(min(s for s, _ in windows), max(e for _, e in windows))
    return result


def key_averages_breakdown(prof) -> dict:
    """Self device time (ms) of the profiler's key_averages, by kernel class."""
    from torch.autograd import DeviceType

    totals = defaultdict(float)
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            continue
        t = getattr(evt, "self_device_time_total", None)
        if t is None:
            t = getattr(evt, "self_cuda_time_total", 0.0)
        totals[classify_kernel(evt.key)] += float(t) / 1e3
    return {c: totals.get(c, 0.0) for c in ("attention", "merge", "other", "comm")}


def trace_path(path: str, rank: int) -> str:
    if rank == 0:
        return path
    for ext in (".json.gz", ".json"):
        if path.endswith(ext):
            return path[: -len(ext)] + f".rank{rank}" + ext
    return path + f".rank{rank}"


def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def profile_report(infos: list[dict]) -> str:
    rows = []
    for info in infos:
        for phase, b in (info.get("trace") or {}).items():
            rows.append({"rank": info["rank"], "phase": phase, **b})
    cols = [("rank", "rank"), ("phase", "phase"), ("wall", "wall ms", ".2f"),
            ("attention", "attn kern ms", ".2f"), ("merge", "merge ms", ".2f"), ("other", "other ms", ".2f"),
            ("comm", "nccl kern ms", ".2f"), ("exposed_comm", "exposed comm ms", ".2f"),
            ("idle", "gpu idle ms", ".2f")]
    lines = ["From the trace (kernel time by class; exposed comm = NCCL running while no other kernel is):"]
    lines.append(H.format_table(rows, cols) if rows else "  (no trace breakdown)")
    ka_rows = [{"rank": i["rank"], **i["key_averages"]} for i in infos if "key_averages" in i]
    if ka_rows:
        lines.append("From key_averages (self device time by class, ms):")
        lines.append(H.format_table(ka_rows, [("rank", "rank"), ("attention", "attention", ".2f"),
                                              ("merge", "merge", ".2f"), ("other", "other", ".2f"),
                                              ("comm", "nccl", ".2f")]))
    for i in infos:
        for key in ("trace_error", "key_averages_error"):
            if key in i:
                lines.append(f"rank {i['rank']} {key}: {i[key]}")
    return "\n".join(lines)
