"""The longest sequences: one causal forward+backward through the ring at 1M, 2M, 4M, ...
tokens, with its time, TFLOP/s per GPU and peak memory, and where that memory goes.

    torchrun --nproc-per-node=4 benchmarks/bench_scale.py                    # 1m 2m 4m
    torchrun --nproc-per-node=4 benchmarks/bench_scale.py --seqlens 1m 4m --head-chunks auto 4

Writes <out-dir>/scale_<gpu>x<N>.json after each run (``meta`` + ``records``: per run ``seqlen``,
``heads``, ``kv_heads``, ``gpus``, ``ok``, ``s``, ``tflops_per_gpu``, ``peak_gib``, and
``head_chunks``: the chunks of heads the ring ran in one after another, which bound its
buffers (``ringflash.heads.memory_chunks``; --head-chunks sets RINGFLASH_HEAD_CHUNKS, each
value its own run at every length, values giving a count an earlier one gave skipped).
Each run is one call (a 4M-token causal forward+backward takes minutes), after small
calls that compile the kernels; random bf16 data; the time is the slowest rank's, from
CUDA events. ``peak_gib`` is the largest rank's peak of allocated memory during the call,
its inputs and the copy-engine ring's buffers (outside torch's allocator) included;
``kept_gib`` is what any exact attention keeps (q, k, v, out, dout, lse and the gradients
dq, dk, dv); ``ring_gib`` the rest (the ring's fp32 sums and buffers). A length whose
kept tensors alone do not fit a rank's free memory is skipped on every rank (``ok``
false, ``error`` says why).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import ringflash
from harness import cli, results, timing
from ringflash import exchange
from ringflash.heads import CHUNKS_ENV, memory_chunks

GIB = 1024 ** 3


def kept_bytes(local: int, heads: int, kv_heads: int, head_dim: int, elem: int = 2) -> int:
    """Bytes every exact attention holds at the end of its backward, per rank: q, out, dout,
    dq (heads), k, v, dk, dv (kv heads) in ``elem``-byte elements, lse in fp32."""
    return local * (head_dim * elem * (4 * heads + 4 * kv_heads) + 4 * heads)


def one_call(q, k, v, dout, layout):
    out = ringflash.ring_flash_attn(q, k, v, causal=True, layout=layout)
    out.backward(dout)


def chunks_of(args, local: int, device, world: int, batch: int = 1) -> int:
    """The chunks of heads the ring runs a call of this shape in under the current
    RINGFLASH_HEAD_CHUNKS (shapes alone decide: meta tensors)."""
    q = torch.empty(batch, local, args.heads, args.head_dim, dtype=torch.bfloat16, device="meta")
    k = torch.empty(batch, local, args.kv_heads, args.head_dim, dtype=torch.bfloat16, device="meta")
    return memory_chunks(q, k, world, torch.cuda.get_device_properties(device).total_memory)


def run_length(args, seqlen, device, world, batch=1) -> dict:
    local = seqlen // world
    rec = dict(impl="ringflash", layout=args.layout, mask="causal", seqlen=seqlen, heads=args.heads,
               kv_heads=args.kv_heads, head_dim=args.head_dim, gpus=world, ok=False,
               head_chunks=chunks_of(args, local, device, world, batch))
    kept = kept_bytes(batch * local, args.heads, args.kv_heads, args.head_dim)
    free = torch.cuda.mem_get_info(device)[0]
    if not timing.all_ranks_ok(kept < 0.95 * free, dist.group.WORLD, device):
        rec["error"] = f"q, k, v, out and their gradients alone take {kept / GIB:.1f} GiB a rank (free {free / GIB:.1f})"
        return rec
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    q = torch.randn(batch, local, args.heads, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, local, args.kv_heads, args.head_dim, device=device, dtype=torch.bfloat16,
                        generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    for t in (q, k, v):
        t.requires_grad_()
    torch.cuda.synchronize(device)
    exchange.release_buffers()  # sized by this call alone
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) - sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    one_call(q, k, v, dout, args.layout)
    end.record()
    torch.cuda.synchronize(device)
    ms = timing.allreduce_max(start.elapsed_time(end), dist.group.WORLD, device)
    # the copy-engine ring's buffers live outside torch's allocator: counted beside its peak
    peak = timing.allreduce_max(torch.cuda.max_memory_allocated(device) - before + exchange.symmetric_bytes(),
                                dist.group.WORLD, device)
    flops = timing.attn_flops(batch, args.heads, seqlen, seqlen, args.head_dim, causal=True, mode="fwdbwd")
    finite = all(torch.isfinite(t.grad).all().item() for t in (q, k, v))
    rec.update(ok=bool(timing.all_ranks_ok(finite, dist.group.WORLD, device)), s=ms / 1e3,
               tflops_per_gpu=timing.tflops(flops / world, ms), peak_gib=peak / GIB, kept_gib=kept / GIB,
               ring_gib=(peak - kept) / GIB, bytes_per_token=peak / (batch * local),
               kept_bytes_per_token=kept / (batch * local))
    if not finite:
        rec["error"] = "non-finite gradients"
    del q, k, v, dout
    timing.free_memory(device)
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", nargs="+", default=["1m,2m,4m"], help="global sequence lengths")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--head-chunks", nargs="+", default=["auto"],
                   help="RINGFLASH_HEAD_CHUNKS values, each its own run at every length: auto, or a positive integer")
    p.add_argument("--out-name", default=None, help="results file name (default scale_<gpu>x<N>)")
    p.add_argument("--out-dir", default=None, help="results directory (default benchmarks/results)")
    args = p.parse_args(argv)
    args.seqlens = cli.parse_sizes(args.seqlens)
    with cli.gpu_run(True, "bench_scale.py", "the ring on CUDA", minutes=30.0) as (device, group, world, rank):
        long_batch = 2 ** 31 // (16384 * args.heads * args.head_dim)
        for value in args.head_chunks:
            with cli.env_var(CHUNKS_ENV, value):
                # Compile first: the kernels of every length, and their 64-bit-offset variants, which
                # a tensor of 2**31 elements or more needs (a batch of 32 rows of 16k local tokens).
                run_length(args, 16384 * world, device, world)
                run_length(args, 16384 * world, device, world, batch=long_batch)
        name = args.out_name or results.result_name("scale", device, world)
        meta = results.collect_meta(device, bench="scale", dtype="bf16")
        records = []
        for seqlen in args.seqlens:
            seen = set()
            for value in args.head_chunks:
                with cli.env_var(CHUNKS_ENV, value):
                    chunks = chunks_of(args, seqlen // world, device, world)
                    if chunks in seen:
                        continue
                    seen.add(chunks)
                    t0 = time.perf_counter()
                    rec = run_length(args, seqlen, device, world)
                records.append(rec)
                if rank == 0:
                    print(f"{cli.fmt_size(seqlen)} C={chunks}: " + ", ".join(
                        f"{key} {rec[key]:.3g}" if isinstance(rec.get(key), float) else f"{key} {rec.get(key)}"
                        for key in ("ok", "s", "tflops_per_gpu", "peak_gib", "ring_gib", "bytes_per_token", "error")
                        if key in rec) + f" (wall {time.perf_counter() - t0:.0f} s)", flush=True)
                    # after each run: a benchmark cut short keeps what it measured
                    print(results.write_results(name, meta, records, results.results_dir(args.out_dir, False)),
                          flush=True)
                if not rec["ok"]:
                    return  # the same on every rank: every verdict above is agreed


if __name__ == "__main__":
    main()
