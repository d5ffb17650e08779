"""The ring's forward+backward called back to back, as a training loop calls it: the period
between calls (CUDA events after each call, no synchronization between them) and the
host's time to enqueue a call, then the same with the host sleeping after each call, to
tell whether the host or the GPU sets the pace (docs/notes/documents.md, "The ring's own
backward overhead, measured back to back"):

    torchrun --nproc-per-node=4 benchmarks/research/back_to_back.py [--seqlen 131072] [--mask documents]
        [--kv-heads 32] [--calls 25] [--host-sleep-ms 0 8 12 16] [--trace DIR]

bf16, batch 1, 32 heads, head_dim 128; ``--mask documents``: bench_masks.py's packed
documents (log-normal lengths, median 2k) on the layout computed from them, causal within
each; ``causal``: zigzag. With ``--trace DIR``, a CUDA-only profile of six calls in a row
per rank (DIR/rank<r>.json, Chrome trace format). Prints one JSON line per rank and host
sleep: the median period and host time in ms. ``--device cpu`` runs a small gloo smoke of
the same loop (wall clock).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_masks import documents  # noqa: E402
import ringflash  # noqa: E402


def inputs(seqlen: int, kv_heads: int, mask: str, device: torch.device, dtype):
    """This rank's q, k, v (leaves), dout, the layout and the segment ids (None: causal)."""
    gen = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(1, seqlen, h, 128, device=device, generator=gen).to(dtype) for h in (32, kv_heads, kv_heads, 32)]
    layout, ids = "zigzag", None
    if mask == "documents":
        lengths = documents(seqlen)
        layout = ringflash.document_layout(torch.tensor([0, *itertools.accumulate(lengths)]), seqlen)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(torch.int32)[None]
        ids = ringflash.shard(ids.to(device), dim=1, layout=layout)
    q, k, v, dout = (ringflash.shard(t, dim=1, layout=layout) for t in full)
    return [t.requires_grad_() for t in (q, k, v)], dout, layout, ids


def period(call, calls: int, device: torch.device, host_sleep_ms: float) -> tuple[float, float]:
    """(median ms between the ends of consecutive calls, median host ms to enqueue a call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    ends, host = [time.perf_counter()], []
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)] if device.type == "cuda" else None
    if events:
        events[0].record()
    for i in range(calls):
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e3)
        if events:
            events[i + 1].record()
        else:
            ends.append(time.perf_counter())
        if host_sleep_ms:
            time.sleep(host_sleep_ms / 1e3)
    sync()
    gaps = ([a.elapsed_time(b) for a, b in zip(events, events[1:])] if events
            else [(b - a) * 1e3 - host_sleep_ms for a, b in zip(ends, ends[1:])])
    return statistics.median(gaps), statistics.median(host)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=None, help="global tokens (default 131072; CPU 1024)")
    p.add_argument("--mask", choices=("documents", "causal"), default="documents")
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--calls", type=int, default=25)
    p.add_argument("--host-sleep-ms", type=float, nargs="+", default=[0.0, 8.0, 12.0, 16.0])
    p.add_argument("--trace", default=None, help="folder for a CUDA-only profile of six calls a rank")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    seqlen = args.seqlen or (131072 if device.type == "cuda" else 1024)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    leaves, dout, layout, ids = inputs(seqlen, args.kv_heads, args.mask, device, dtype)

    def call():
        for t in leaves:
            t.grad = None
        ringflash.ring_flash_attn(*leaves, causal=True, layout=layout, segment_ids=ids).backward(dout)

    for _ in range(3):  # compiles, buffers
        call()
    for sleep in args.host_sleep_ms:
        ms, host = period(call, args.calls, device, sleep)
        print(json.dumps(dict(rank=dist.get_rank(), seqlen=seqlen, mask=args.mask, kv_heads=args.kv_heads,
                              host_sleep_ms=sleep, period_ms=round(ms, 3), host_ms=round(host, 3))), flush=True)
    if args.trace and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(6):
                call()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(Path(args.trace) / f"rank{dist.get_rank()}.json"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
