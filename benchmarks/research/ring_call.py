"""One ring call's forward and forward+backward time (median of --reps, each between a
barrier and a synchronize), and with ``--profile`` rank 0's profiler table of one more
forward+backward (GPU time by kernel and op): for comparing trees or settings on one
machine, e.g. the heads' chunks (docs/performance.md, "Masks through the ring, 2 × H200"):

    torchrun --nproc-per-node=2 benchmarks/research/ring_call.py --layout block_stripe --seqlen 512k
    RINGFLASH_HEAD_CHUNKS=1 torchrun --nproc-per-node=2 benchmarks/research/ring_call.py ...

bf16, batch 1, 32 heads (--kv-heads), head_dim 128, a causal window of --window keys (0:
causal only), the global sequence sharded with --layout. Prints one line on rank 0.
``--device cpu`` runs a small gloo smoke of the same calls (wall clock).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import cli  # noqa: E402
import ringflash  # noqa: E402


def timed(call, reps: int, device: torch.device) -> float:
    """Median ms of ``call`` over ``reps`` runs after two warm-ups."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        call()
    times = []
    for _ in range(reps):
        dist.barrier()
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="block_stripe", help="a layout name (ringflash.LAYOUTS)")
    p.add_argument("--seqlen", type=cli.parse_size, default=512 * 1024, help="global tokens (512k, 1m, ...)")
    p.add_argument("--window", type=int, default=4096, help="left window of the causal mask (0: causal only)")
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--profile", action="store_true", help="print rank 0's profiler table of one call")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()
    if args.layout not in ringflash.LAYOUTS:
        p.error(f"--layout must be one of {ringflash.LAYOUTS}, got {args.layout!r}")
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    seqlen, dtype = (args.seqlen, torch.bfloat16) if cuda else (256 * dist.get_world_size(), torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)
    heads = (32, args.kv_heads, args.kv_heads, 32) if cuda else (4, 2, 2, 4)
    full = [torch.randn(1, seqlen, h, 128 if cuda else 32, device=device, generator=gen, dtype=dtype)
            for h in heads]
    q, k, v = (ringflash.shard(t, 1, args.layout).requires_grad_() for t in full[:3])
    dout = ringflash.shard(full[3], 1, args.layout)
    kw = dict(causal=True, layout=args.layout)
    if args.window:
        kw["window_size"] = (args.window, 0)

    def forward():
        with torch.no_grad():
            ringflash.ring_flash_attn(q, k, v, **kw)

    def step():
        ringflash.ring_flash_attn(q, k, v, **kw).backward(dout)

    fwd, fwdbwd = timed(forward, args.reps, device), timed(step, args.reps, device)
    if rank == 0:
        chunks = os.environ.get("RINGFLASH_HEAD_CHUNKS", "auto")
        print(f"layout={args.layout} seqlen={seqlen} window={args.window} kv_heads={args.kv_heads} "
              f"chunks={chunks} transport={ringflash.transport(None)} fwd_ms={fwd:.2f} fwdbwd_ms={fwdbwd:.2f}",
              flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            step()
            if cuda:
                torch.cuda.synchronize(device)
        if rank == 0:
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=90))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
