"""Causal load balance of the layouts: per-rank compute time and whole-ring time.

    torchrun --nproc-per-node=4 benchmarks/bench_balance.py [--seqlen-local 16384]
    torchrun --nproc-per-node=2 benchmarks/bench_balance.py --device cpu   # smoke test, gloo

For each layout, every rank first replays its own part of one causal forward+backward
(the exact kernel calls the ring schedules for it, each transfer replaced by a local
copy), so the time is that rank's compute alone; then the real ring runs forward+backward with
communication, once per transport in --transports. Writes <out-dir>/balance_<gpu>x<W>.json,
e.g. benchmarks/results/balance_h200x4.json; a CPU smoke run (gloo, small sizes, fp32)
writes to a new temporary directory unless --out-dir is given. Without torchrun it runs
as a world of one.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import ringflash
from harness import cli, results, timing
from ringflash.exchange import Ring
from ringflash.ring import ring_backward, ring_forward


class ComputeOnly(Ring):
    """This rank's place in the ring with the network switched off: each "transfer" is a
    local copy, so the kernels see real data and no rank waits for another."""

    def exchange(self, *pairs, shift=1):
        for send, recv in pairs:
            recv.copy_(send)
        return []


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    p.add_argument("--seqlen-local", type=int, default=None,
                   help="tokens per rank (default 16384; on the cpu 256)")
    p.add_argument("--heads", type=int, default=None, help="heads (default 32; on the cpu 4)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; on the cpu 32)")
    p.add_argument("--transports", nargs="+", default=["auto"], choices=("auto", "nccl", "peer"),
                   help="ring transport(s) (RINGFLASH_TRANSPORT) of the whole-ring runs")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda if there is a GPU; cpu: a smoke test of the script over gloo")
    p.add_argument("--out-dir", default=None,
                   help="directory for the results (default benchmarks/results; a new temporary "
                        "directory on the cpu)")
    p.add_argument("--timeout-min", type=float, default=5.0, help="process group timeout (minutes)")
    args = p.parse_args(argv)

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cpu = args.device == "cpu"
    for name, gpu, cpu in (("seqlen_local", 16384, 256), ("heads", 32, 4), ("head_dim", 128, 32)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if on_cpu else gpu)
    device = cli.start_ranks(args.device, args.timeout_min)  # the cpu: a smoke run over gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    n, h, d = args.seqlen_local, args.heads, args.head_dim
    scale = d ** -0.5
    gen = torch.Generator(device=device).manual_seed(rank)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v, dout = (torch.randn(1, n, h, d, device=device, dtype=dtype, generator=gen)
                     for _ in range(4))
    timing.init_l2_flush(device)
    local_ring = ComputeOnly(None)

    def compute_only(layout):
        kw = dict(softmax_scale=scale, band=(None, 0), dropout=(0.0, 0), layout=layout, ring=local_ring)
        out, lse, _ = ring_forward(q, k, v, None, **kw)
        ring_backward(dout, q, k, v, out, lse, None, None, **kw)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def whole_ring(layout):
        out = ringflash.ring_flash_attn(*leaves, causal=True, layout=layout)
        out.backward(dout)

    records = []
    for layout in ringflash.LAYOUTS:
        mine = timing.bench_ms(lambda: compute_only(layout), device=device, group=None)
        per_rank = [0.0] * world
        per_rank[rank] = mine
        per_rank = timing.allreduce_sum(per_rank, dist.group.WORLD, device)
        for choice in args.transports:
            os.environ["RINGFLASH_TRANSPORT"] = choice
            ring_ms = timing.bench_ms(lambda: whole_ring(layout), device=device, grad_to_none=leaves,
                                 group=dist.group.WORLD)
            records.append(dict(layout=layout, transport=cli.backend_label(ringflash.transport()), seqlen_local=n,
                                world=world, heads=h, head_dim=d, compute_ms_per_rank=per_rank,
                                imbalance=max(per_rank) / min(per_rank), ring_fwdbwd_ms=ring_ms))
    if rank == 0:
        print(f"causal fwd+bwd, {world} ranks ({device.type}, {dist.get_backend()}), seqlen_local {n}, "
              f"{h} heads, head_dim {d}, {dtype}" + ("; smoke run" if device.type != "cuda" else ""))
        print(f"{'layout':<11} {'transport':<9} {'compute ms per rank':<36} {'max/min':>7} "
              f"{'ring ms':>8} {'vs contiguous':>13}")
        for r in records:
            base = next(b["ring_fwdbwd_ms"] for b in records
                        if b["layout"] == "contiguous" and b["transport"] == r["transport"])
            r["ring_vs_contiguous"] = r["ring_fwdbwd_ms"] / base
            ranks = " ".join(f"{x:7.1f}" for x in r["compute_ms_per_rank"])
            print(f"{r['layout']:<11} {r['transport']:<9} {ranks:<36} {r['imbalance']:7.2f} "
                  f"{r['ring_fwdbwd_ms']:8.1f} {r['ring_vs_contiguous']:13.2f}")
        out_dir = results.results_dir(args.out_dir, results.is_smoke_run(device))
        path = results.write_results(results.result_name("balance", device, world),
                                     results.collect_meta(device, world_size=world, bench="balance",
                                                          backend=dist.get_backend()),
                                     records, out_dir)
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
