"""Attention dropout: ringflash at p = 0.1 beside p = 0, and torch SDPA's backends that
accept dropout, also at both rates (what dropout costs a peer), forward and
forward+backward, in one run.

    python benchmarks/bench_dropout.py                               # one GPU -> dropout_<gpu>.json
    torchrun --nproc-per-node=2 benchmarks/bench_dropout.py --ring   # ring -> dropout_<gpu>x2.json

SDPA's flash and cuDNN backends take dropout (torch 2.11, H200); a backend that refuses a
configuration is recorded with null times and the reason. Inputs: bf16, batch 1, 32 heads, head_dim 128, random.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringflash
from harness import checks, cli, results, timing
from harness.timing import timed

# The efficient (xformers) backend also takes dropout, at ~90 TFLOP/s: 10 s an iteration
# at 128k, so it is left out; the math backend materializes the N x N matrix.
SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def run(args, device, group, world, rank) -> None:
    file_name = args.out_name or results.result_name("dropout", device, world if args.ring else None)
    out_dir = results.results_dir(args.out_dir, results.is_smoke_run(device))
    records = []
    for seqlen in cli.parse_sizes(args.seqlens):
        for causal in (False, True):
            flops = 3.5 * timing.attn_flops(1, args.heads, seqlen, seqlen, args.head_dim, causal=causal)
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
                                    fwdbwd_tflops_per_gpu=timing.tflops(flops / world, fwdbwd)))
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
                        err = checks.short_error(e)
                    records.append(dict(impl=name, dropout_p=drop, seqlen=seqlen, causal=causal, gpus=1,
                                        fwd_ms=fwd, fwdbwd_ms=fwdbwd, error=err,
                                        fwdbwd_tflops_per_gpu=timing.tflops(flops, fwdbwd)))
                del qt
            if rank == 0:
                print(results.format_table([r for r in records if r["seqlen"] == seqlen and r["causal"] == causal],
                                     [("impl", "impl"), ("dropout_p", "p"), ("seqlen", "seqlen"),
                                      ("causal", "causal"), ("fwd_ms", "fwd ms", ".2f"),
                                      ("fwdbwd_ms", "fwd+bwd ms", ".2f"),
                                      ("fwdbwd_tflops_per_gpu", "TFLOP/s/GPU", ".0f")]), flush=True)
            del full, local
            timing.free_memory(device)
            if rank == 0:  # after every configuration: a run cut short keeps what it measured
                results.write_results(file_name, results.collect_meta(device), records, out_dir)


def main(argv=None):
    p = cli.gpu_parser(__doc__, "dropout_<gpu>[xN]")
    p.add_argument("--p", type=float, default=0.1, help="dropout rate")
    args = p.parse_args(argv)
    with cli.gpu_run(args.ring, "bench_dropout.py") as (device, group, world, rank):
        run(args, device, group, world, rank)


if __name__ == "__main__":
    main()
