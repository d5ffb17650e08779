"""Sweep the tile shapes of the Triton kernels on one GPU and print the fastest.

    python tools/tune_kernel.py [--seqlen 16384] [--head-dims 64 128 256]
                                [--which fwd dkdv dq] [--causal 0 1] [--no-tma]
                                [--dropout 0.1]

The forward and the two backward kernels (dK/dV, dQ) are swept apart: each has its own
tiles. Every forward candidate is checked against torch SDPA and every backward one
against the library's current backward before it is timed; the chosen shapes go into
fwd_config / bwd_config in kernels/triton/config.py by hand. With --dropout the kernels
draw dropout bits (checked against the current shapes with the same seed), and the current
shapes are also timed without dropout, the speed the dropout path is held to.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' harness
from harness.checks import rel_err  # noqa: E402
from harness.cli import HelpFormatter  # noqa: E402
from ringflash.kernels import PairMask, attn_delta  # noqa: E402
from ringflash.kernels import triton as triton_kernels  # noqa: E402
from ringflash.kernels.triton import config  # noqa: E402

# Matmuls each kernel really runs, over the forward's two: dK/dV recomputes S and dP and
# accumulates dV and dK (4), dQ recomputes S and dP and accumulates dQ (3).
FLOP_FACTOR = {"fwd": 1.0, "dkdv": 2.0, "dq": 1.5}


def _tflops(batch, heads, seqlen, head_dim, causal, ms, factor):
    flops = 4 * batch * heads * seqlen * seqlen * head_dim * factor / (2 if causal else 1)
    return flops / ms / 1e9


def _candidates(which, head_dim):
    if which == "fwd":
        blocks = [(64, 64), (64, 128), (128, 32), (128, 64), (128, 128)] if head_dim <= 128 else \
            [(128, 32), (128, 64), (64, 64)]
        stages = (2, 3, 4)
    else:
        blocks = [(32, 128), (64, 64), (64, 128), (128, 64), (128, 128)] if head_dim <= 128 else \
            [(32, 64), (64, 32), (64, 64), (32, 128), (128, 32)]
        stages = (2, 3)
    orientations = (False, True) if which == "dkdv" else (None,)  # dK/dV's QUERY_MAJOR
    for (bm, bn), warps, st, qm in itertools.product(blocks, (4, 8), stages, orientations):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=st)
        yield cfg if qm is None else dict(cfg, QUERY_MAJOR=qm)


@contextlib.contextmanager
def tiles(which, cfg):
    """The Triton launchers running kernel ``which`` (fwd, dkdv, dq) with the tiles ``cfg``, the other
    kernels with their own: fwd_config / bwd_config stand-ins that take whatever arguments
    the launches pass them."""
    original = config.fwd_config, config.bwd_config

    def bwd_config(*args, **kwargs):
        dkdv_cfg, dq_cfg = original[1](*args, **kwargs)
        return (cfg, dq_cfg) if which == "dkdv" else (dkdv_cfg, cfg)

    if which == "fwd":
        config.fwd_config = lambda *args, **kwargs: cfg
    else:
        config.bwd_config = bwd_config
    try:
        yield
    finally:
        config.fwd_config, config.bwd_config = original


def sweep(which, head_dim, causal, seqlen, heads=32, batch=1, dtype=torch.bfloat16, dropout_p=0.0):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype)
                   for _ in range(4))
    scale, offset = head_dim ** -0.5, (0 if causal else None)
    plain = PairMask.causal(offset)
    mask = plain._replace(dropout_p=dropout_p, seed=1234, pos=(0, 0, 1, 0)) if dropout_p else plain
    lse = torch.empty(batch, heads, seqlen, device="cuda")
    out = torch.empty_like(q)
    triton_kernels.fwd(q, k, v, out, lse, softmax_scale=scale, mask=mask, accumulate=False)
    delta = attn_delta(out, do)
    grads = [torch.empty(t.shape, device="cuda") for t in (q, k, v)]
    triton_kernels.bwd(do, q, k, v, lse, delta, *grads, softmax_scale=scale, mask=mask, accumulate=False)
    if which == "fwd":
        ref = out if dropout_p else F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)
        o2, l2 = torch.empty_like(out), torch.empty_like(lse)
        fn = lambda mask=mask: triton_kernels.fwd(q, k, v, o2, l2, softmax_scale=scale, mask=mask,
                                                  accumulate=False)
        check = lambda: rel_err(o2, ref)
    else:
        g = [torch.empty_like(t) for t in grads]
        args = (g[0], None, None) if which == "dq" else (None, g[1], g[2])
        fn = lambda mask=mask: triton_kernels.bwd(do, q, k, v, lse, delta, *args, softmax_scale=scale,
                                                  mask=mask, accumulate=False)
        checked = (0,) if which == "dq" else (1, 2)
        check = lambda: max(rel_err(g[i], grads[i]) for i in checked)
    if dropout_p:  # the bar: the current shapes without dropout
        fn(plain)
        ms = triton.testing.do_bench(lambda: fn(plain), warmup=25, rep=100, return_mode="median")
        tf = _tflops(batch, heads, seqlen, head_dim, causal, ms, FLOP_FACTOR[which])
        print(f"  {which} d={head_dim} causal={causal} current shapes, no dropout: {ms:.3f} ms {tf:.0f} TFLOP/s",
              flush=True)
    results = []
    for cfg in _candidates(which, head_dim):
        try:
            with tiles(which, cfg):
                fn()
                err = check()
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # out of shared memory, registers …
            print(f"  {which} {cfg}: {type(exc).__name__}")
            continue
        tf = _tflops(batch, heads, seqlen, head_dim, causal, ms, FLOP_FACTOR[which])
        ok = err < 2e-2
        results.append((tf if ok else 0.0, cfg, ms, err))
        print(f"  {which} d={head_dim} causal={causal} {cfg}: {ms:.3f} ms {tf:.0f} TFLOP/s err={err:.1e}",
              flush=True)
    return max(results, key=lambda r: r[0])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("--seqlen", type=int, default=16384, help="tokens (batch 1, 32 heads, bf16)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256], help="head dims to sweep")
    p.add_argument("--which", nargs="+", default=["fwd", "dkdv", "dq"], choices=["fwd", "dkdv", "dq"],
                   help="kernels to sweep")
    p.add_argument("--causal", nargs="+", type=int, default=[0], help="0 (non-causal), 1 (causal) or both")
    p.add_argument("--no-tma", action="store_true", help="forward through pointer loads")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout rate the kernels run with")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ERROR: tune_kernel.py times Triton kernels on a GPU; no CUDA device here")
    if args.no_tma:
        config.use_tma = lambda *tensors: False
    summary = []
    for which, d, causal in itertools.product(args.which, args.head_dims, map(bool, args.causal)):
        tf, cfg, ms, err = sweep(which, d, causal, args.seqlen, dropout_p=args.dropout)
        summary.append(f"{which:4} d={d:3} causal={causal!s:5} p={args.dropout:g} best {tf:5.0f} TFLOP/s {cfg}")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
