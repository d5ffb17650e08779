"""Sweep the tile shapes of the Triton kernels on one GPU and print the fastest.

    python benchmarks/tune_kernel.py [--seqlen 16384] [--head-dims 64 128] [--which fwd bwd]

Every candidate is checked against torch SDPA before it is timed; the chosen shapes
go into fwd_config / bwd_config in kernels/triton_attn.py by hand.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton

from ringflash.kernels import attn_delta, triton_attn
from ringflash.kernels.interface import flash_attn_bwd, flash_attn_fwd


def _tflops(batch, heads, seqlen, head_dim, causal, ms, factor=1.0):
    flops = 4 * batch * heads * seqlen * seqlen * head_dim * factor / (2 if causal else 1)
    return flops / ms / 1e9


def _candidates(which, head_dim):
    blocks = [(64, 64), (128, 64), (128, 128), (128, 32)] if which == "fwd" else \
        [(32, 64), (64, 64), (64, 128), (32, 128), (128, 64)]
    if head_dim > 128:
        blocks = [(bm, bn) for bm, bn in blocks if bm * bn <= 64 * 64]
    for (bm, bn), warps, stages in itertools.product(blocks, (4, 8), (2, 3) if which == "bwd" else (2, 3, 4)):
        yield dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)


def sweep(which, head_dim, causal, seqlen, heads=32, batch=1, dtype=torch.bfloat16):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype)
                   for _ in range(4))
    scale = head_dim ** -0.5
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         is_causal=causal).transpose(1, 2)
    offset = 0 if causal else None
    out, lse = flash_attn_fwd(q, k, v, softmax_scale=scale, causal_offset=offset)
    delta = attn_delta(out, do)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    results = []
    original = triton_attn.fwd_config if which == "fwd" else triton_attn.bwd_config
    for cfg in _candidates(which, head_dim):
        setattr(triton_attn, f"{which}_config", lambda d, c, cfg=cfg: cfg)
        try:
            if which == "fwd":
                fn = lambda: flash_attn_fwd(q, k, v, softmax_scale=scale, causal_offset=offset)
                err = ((fn()[0].float() - ref.float()).norm() / ref.float().norm()).item()
            else:
                fn = lambda: flash_attn_bwd(do, q, k, v, lse, delta, *grads, softmax_scale=scale,
                                            causal_offset=offset)
                fn()
                err = 0.0 if all(torch.isfinite(g).all() for g in grads) else float("nan")
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # out of shared memory, registers …
            print(f"  {cfg}: {type(exc).__name__}")
            continue
        finally:
            setattr(triton_attn, f"{which}_config", original)
        factor = 1.0 if which == "fwd" else 2.5
        tf = _tflops(batch, heads, seqlen, head_dim, causal, ms, factor)
        ok = err < 2e-2
        results.append((tf if ok else 0.0, cfg, ms, err))
        print(f"  {which} d={head_dim} causal={causal} {cfg}: {ms:.3f} ms {tf:.0f} TFLOP/s err={err:.1e}")
    best = max(results, key=lambda r: r[0])
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--which", nargs="+", default=["fwd", "bwd"])
    p.add_argument("--causal", nargs="+", type=int, default=[0], help="0, 1 or both")
    args = p.parse_args()
    summary = []
    for which, d, causal in itertools.product(args.which, args.head_dims, map(bool, args.causal)):
        tf, cfg, ms, err = sweep(which, d, causal, args.seqlen)
        summary.append(f"{which} d={d} causal={causal!s:5} best {tf:5.0f} TFLOP/s {cfg}")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
