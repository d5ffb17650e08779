"""Attention dropout: ringflash at p = 0.1 beside p = 0, and torch SDPA's backends that
accept dropout, also at both rates (what dropout costs a peer), forward and
forward+backward, in one run.

    python benchmarks/bench_dropout.py                               # one GPU -> dropout_<gpu>.json
    torchrun --nproc-per-node=2 benchmarks/bench_dropout.py --ring   # ring -> dropout_<gpu>x2.json

SDPA's flash and cuDNN backends take dropout (torch 2.11, H200); a backend that refuses a
configuration is recorded with null times and the reason. Inputs: bf16, batch 1, 32 heads, head_dim 128, random.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import _harness as H
import ringflash
from bench_masks import timed

# The efficient (xformers) backend also takes dropout, at ~90 TFLOP/s: 10 s an iteration
# at 128k, so it is left out; the math backend materializes the N x N matrix.
SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ring", action="store_true", help="run the ring under torchrun (NCCL)")
    p.add_argument("--seqlens", nargs="+", default=["32k,128k"], help="sequence lengths")
    p.add_argument("--p", type=float, default=0.1, help="dropout rate")
    p.add_argument("--heads", type=int, default=32, help="query (= key/value) heads")
    p.add_argument("--head-dim", type=int, default=128, help="head dim")
    p.add_argument("--rep-ms", type=float, default=100.0, help="timed time per measurement")
    p.add_argument("--out-name", default=None, help="results file name (default dropout_<gpu>[xN])")
    p.add_argument("--out-dir", default=None, help="results directory (default benchmarks/results)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_dropout.py needs a GPU")
    group, world, rank = None, 1, 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if args.ring:
        import torch.distributed as dist
        H.init_process_group(device, timeout=datetime.timedelta(minutes=10))
        group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    records = []
    for seqlen in H.parse_sizes(args.seqlens):
        for causal in (False, True):
            flops = 3.5 * H.attn_flops(1, args.heads, seqlen, seqlen, args.head_dim, causal=causal)
            gen = torch.Generator(device=device).manual_seed(0)
            full = [torch.randn(1, seqlen, args.heads, args.head_dim, device=device, generator=gen,
                                dtype=torch.bfloat16) for _ in range(3)]
            layout = "zigzag" if causal else "contiguous"
            local = [ringflash.shard(t, 1, layout, group).requires_grad_() for t in full]
            for drop in (0.0, args.p):
                fn = (lambda q, k, v, drop=drop: ringflash.ring_flash_attn(
                    q, k, v, causal=causal, layout=layout, dropout_p=drop, seed=1234))
                fwd, fwdbwd = timed(fn, *local, device, args, group)
                records.append(dict(impl="ringflash", dropout_p=drop, seqlen=seqlen, causal=causal,
                                    gpus=world, layout=layout, fwd_ms=fwd, fwdbwd_ms=fwdbwd,
                                    fwdbwd_tflops_per_gpu=H.tflops(flops / world, fwdbwd)))
            if not args.ring:
                qt = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in full]
                for (name, backend), drop in itertools.product(SDPA.items(), (0.0, args.p)):
                    def sdpa(q, k, v, backend=backend, drop=drop):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=causal)
                    try:
                        fwd, fwdbwd = timed(sdpa, *qt, device, args)
                        err = None
                    except RuntimeError as e:  # this backend refuses dropout here
                        fwd = fwdbwd = None
                        err = H.short_error(e)
                    records.append(dict(impl=name, dropout_p=drop, seqlen=seqlen, causal=causal, gpus=1,
                                        fwd_ms=fwd, fwdbwd_ms=fwdbwd, error=err,
                                        fwdbwd_tflops_per_gpu=H.tflops(flops, fwdbwd)))
                del qt
            if rank == 0:
                print(H.format_table([r for r in records if r["seqlen"] == seqlen and r["causal"] == causal],
                                     [("impl", "impl"), ("dropout_p", "p"), ("seqlen", "seqlen"),
                                      ("causal", "causal"), ("fwd_ms", "fwd ms", ".2f"),
                                      ("fwdbwd_ms", "fwd+bwd ms", ".2f"),
                                      ("fwdbwd_tflops_per_gpu", "TFLOP/s/GPU", ".0f")]), flush=True)
            del full, local
            H.free_memory(device)
            if rank == 0:  # after every configuration: a run cut short keeps what it measured
                name = args.out_name or H.result_name("dropout", device, world if args.ring else None)
                H.write_results(name, H.collect_meta(device), records, args.out_dir)
    if args.ring:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
