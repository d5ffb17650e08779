"""``--profile`` (bench_ring.py, bench_blocksparse.py): what the GPU did during one profiled
ring call, from a PyTorch profiler (Kineto) chrome trace: time by kind of work (attention
kernels, merge, other, communication), the communication no compute hid, and the GPU's
idle time. ``profile_call`` profiles one call (``fwd_bwd_step``) on every rank, writes the
traces and prints ``profile_report``.

Communication is whatever moves data between GPUs or waits for another GPU: NCCL's
kernels, and the copy-engine ring's (ringflash.exchange.PeerRing) barrier kernel from
torch's symmetric memory and its copies out of the neighbour's memory. Kineto exports
copies as "gpu_memcpy" events named after CUPTI's copy kind ("Memcpy PtoP (Device ->
Device)", "Memcpy DtoD (...)"); a peer-to-peer record carries "fromDevice" and "toDevice"
in its args, any other one a single "device". A copy within one GPU is no communication,
unless a communication kernel runs on its stream (it is that transfer's own copy).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import time
from collections import defaultdict
from typing import Callable, Optional

import torch

from .checks import short_error
from .results import format_table
from .timing import barrier, dist_active, sync


CLASSES = ("attention", "merge", "other", "comm")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
COMM_KERNELS = ("nccl", "symmetric_memory")  # the copy ring's barrier: c10d::symmetric_memory::barrier_kernel
PEER_COPY = "Memcpy PtoP"  # CUPTI's kind of a copy between two GPUs


def classify_name(name: str) -> str:
    """The class of a GPU event by its name alone (all key_averages knows of it)."""
    n = name.lower()
    if any(s in n for s in COMM_KERNELS) or name.startswith(PEER_COPY):
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


def _stream(event: dict) -> tuple:
    return event.get("pid"), event.get("tid")  # Kineto: pid the device, tid the stream


def is_peer_copy(event: dict) -> bool:
    """A copy from one GPU to another, by CUPTI's copy kind or Kineto's device args."""
    args = event.get("args") or {}
    src, dst = args.get("fromDevice"), args.get("toDevice")
    return event.get("name", "").startswith(PEER_COPY) or (src is not None and dst is not None and src != dst)


def gpu_work(trace: dict) -> list[tuple[str, float, float]]:
    """(class, start us, end us) of every kernel, copy and memset in a chrome trace."""
    events = [e for e in trace.get("traceEvents", [])
              if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in GPU_CATS and "ts" in e]
    comm_streams = {_stream(e) for e in events
                    if e["cat"] == "kernel" and classify_name(e.get("name", "")) == "comm"}
    work = []
    for e in events:
        if e["cat"] == "kernel":
            cls = classify_name(e.get("name", ""))
        elif e["cat"] == "gpu_memcpy" and (is_peer_copy(e) or _stream(e) in comm_streams):
            cls = "comm"
        else:
            cls = "other"
        start = float(e["ts"])
        work.append((cls, start, start + float(e.get("dur", 0.0))))
    return work


def trace_breakdown(trace: dict, wall_ms: Optional[float] = None, phases=("ringflash.fwd", "ringflash.bwd")) -> dict:
    """GPU time of one profiled step from a chrome trace, in ms.

    attention / merge / other / comm: summed durations of the kernels, copies and memsets
    by class (comm: NCCL kernels, the copy ring's barriers and peer copies; local copies and
    memsets are other). exposed_comm: time when communication runs and nothing else does,
    i.e. communication the compute did not hide. idle: wall time with nothing running on
    the GPU (launch gaps, host work). Per phase too when the trace has the phases' GPU
    annotations. The step's idle time in two known parts: gaps, the GPU idle between its
    first and last operation; lead, from the host's start of the first phase (its CPU
    annotation) to the GPU's first operation (host work before anything is queued: the
    rank check, planning, launches), None without that annotation.
    """
    work = gpu_work(trace)

    def summarize(lo=-math.inf, hi=math.inf, wall=None) -> dict:
        by_class = defaultdict(list)
        for cls, s, e in work:
            by_class[cls].extend(_clip([(s, e)], lo, hi))
        total = {c: sum(e - s for s, e in iv) / 1e3 for c, iv in by_class.items()}
        all_iv = [iv for ivs in by_class.values() for iv in ivs]
        non_comm = [iv for c, ivs in by_class.items() if c != "comm" for iv in ivs]
        busy = _union_us(all_iv) / 1e3
        out = {c: total.get(c, 0.0) for c in CLASSES}
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
        out["gaps"] = out["gpu_span"] - busy
        return out

    result = {"step": summarize(wall=wall_ms)}
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    starts = [float(e["ts"]) for e in events if e.get("name") == phases[0] and e.get("cat") == "user_annotation"]
    first_gpu = min((s for _, s, _ in work), default=None)
    result["step"]["lead"] = None if not starts or first_gpu is None else (first_gpu - min(starts)) / 1e3
    for ph in phases:
        windows = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                   if e.get("name") == ph and e.get("cat") == "gpu_user_annotation"]
        if windows:
            result[ph] = summarize(min(s for s, _ in windows), max(e for _, e in windows))
    return result


def key_averages_breakdown(prof) -> dict:
    """Self device time (ms) of the profiler's key_averages, by class of the names (a copy
    through a peer mapping that CUPTI calls DtoD counts as other here, unlike in the trace)."""
    from torch.autograd import DeviceType

    totals = defaultdict(float)
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            continue
        t = getattr(evt, "self_device_time_total", None)
        if t is None:
            t = getattr(evt, "self_cuda_time_total", 0.0)
        totals[classify_name(evt.key)] += float(t) / 1e3
    return {c: totals.get(c, 0.0) for c in CLASSES}


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
            ("comm", "comm ms", ".2f"), ("exposed_comm", "exposed comm ms", ".2f"),
            ("idle", "gpu idle ms", ".2f"), ("gaps", "of it gaps ms", ".2f"), ("lead", "host lead ms", ".2f")]
    lines = ["From the trace (GPU time by class; comm = NCCL kernels, the copy ring's barriers and peer "
             "copies; exposed comm = comm running while nothing else is; gaps = GPU idle between its first "
             "and last operation; host lead = the host's start of the call to the GPU's first operation):"]
    lines.append(format_table(rows, cols) if rows else "  (no trace breakdown)")
    ka_rows = [{"rank": i["rank"], **i["key_averages"]} for i in infos if "key_averages" in i]
    if ka_rows:
        lines.append("From key_averages (self device time by class, ms):")
        lines.append(format_table(ka_rows, [("rank", "rank"), ("attention", "attention", ".2f"),
                                              ("merge", "merge", ".2f"), ("other", "other", ".2f"),
                                              ("comm", "comm", ".2f")]))
    for i in infos:
        for key in ("trace_error", "key_averages_error"):
            if key in i:
                lines.append(f"rank {i['rank']} {key}: {i[key]}")
    return "\n".join(lines)


def fwd_bwd_step(call: Callable, inputs, dout: torch.Tensor) -> Callable[[], None]:
    """One forward+backward of ``call(q, k, v)`` on leaves over ``inputs`` against ``dout``,
    its phases under record_function("ringflash.fwd") and ("ringflash.bwd"): the step
    ``profile_call`` traces."""
    from torch.profiler import record_function

    leaves = [t.detach().requires_grad_() for t in inputs]

    def step():
        for t in leaves:
            t.grad = None
        with record_function("ringflash.fwd"):
            out = call(*leaves)
        with record_function("ringflash.bwd"):
            out.backward(dout)

    return step


def profile_call(step: Callable[[], None], *, device: torch.device, group, path: str,
                 title: str, warmup: int = 3) -> None:
    """Run ``step`` (one forward+backward, its phases under record_function("ringflash.fwd")
    and ("ringflash.bwd")) ``warmup`` times, then once under the profiler on every rank of
    ``group``: each rank writes its chrome trace (``trace_path``), rank 0 prints the
    profiler's table and every rank's ``trace_breakdown``."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for _ in range(warmup):  # compilation, communicators, the allocator
        step()
    sync(device)
    barrier(group)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    rank = dist.get_rank(group) if dist_active(group) else 0
    path = trace_path(path, rank)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    prof.export_chrome_trace(path)
    info = {"rank": rank, "path": path, "wall_ms": wall_ms}
    try:
        info["trace"] = trace_breakdown(load_trace(path), wall_ms)
    except Exception as exc:  # noqa: BLE001
        info["trace_error"] = short_error(exc)
    try:
        info["key_averages"] = key_averages_breakdown(prof)
    except Exception as exc:  # noqa: BLE001
        info["key_averages_error"] = short_error(exc)
    table = None
    if rank == 0:
        for sort_by in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
            try:
                table = prof.key_averages().table(sort_by=sort_by, row_limit=25)
                break
            except Exception:  # noqa: BLE001 - older/newer names of the sort key
                continue
    infos = [info]
    if dist_active(group):
        infos = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, info, group=group)
    if rank == 0:
        print(f"\n== profile: {title} ==")
        if table:
            print(table)
        print(profile_report(infos))
        print("traces: " + ", ".join(i["path"] for i in infos), flush=True)
