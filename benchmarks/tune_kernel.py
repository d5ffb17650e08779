"""Sweep the tile shapes of the Triton kernels on one GPU and print the fastest.

    python benchmarks/tune_kernel.py [--seqlen 16384] [--head-dims 64 128 256]
                                     [--which fwd dkdv dq fused] [--causal 0 1] [--no-tma]

The forward and the two backward kernels (dK/dV, dQ) are swept apart: each has its own
tiles. ``fused`` sweeps the one-kernel backward (tiles, and the rotated query order) with
bf16 gradients, i.e. with the fp32 dQ scratch and its epilogue, and times the two-kernel
(deterministic) backward beside it; both counted as 2.5 forwards. Every forward candidate is checked against torch SDPA and every backward one
against the library's current backward before it is timed; the chosen shapes go into
fwd_config / bwd_config in kernels/triton_attn.py by hand.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton

from ringflash.kernels import attn_delta, triton_attn

# Matmuls each kernel really runs, over the forward's two: dK/dV recomputes S and dP and
# accumulates dV and dK (4), dQ recomputes S and dP and accumulates dQ (3).
FLOP_FACTOR = {"fwd": 1.0, "dkdv": 2.0, "dq": 1.5, "fused": 2.5, "ordered": 2.5}


def _tflops(batch, heads, seqlen, head_dim, causal, ms, factor):
    flops = 4 * batch * heads * seqlen * seqlen * head_dim * factor / (2 if causal else 1)
    return flops / ms / 1e9


FUSED_CONFIGS = None  # --fused-configs: "BLOCK_M,BLOCK_N,warps,stages[,rotate]" tuples


def _candidates(which, head_dim):
    if which in ("fused", "ordered") and FUSED_CONFIGS:
        for c in FUSED_CONFIGS:
            bm, bn, warps, st, *rot = c
            yield dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=st, ROTATE=bool(rot and rot[0]))
        return
    if which in ("fused", "ordered"):  # (BLOCK_M, BLOCK_N, warps, stages): few spills for sm_90
        cfgs = {64: [(64, 128, 8, 2), (64, 64, 8, 2), (128, 128, 8, 2), (64, 128, 8, 3), (128, 64, 8, 2)],
                128: [(64, 128, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3), (128, 64, 8, 2), (32, 128, 8, 2),
                      (64, 128, 8, 3), (128, 128, 8, 2)],
                256: [(64, 64, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2), (32, 64, 4, 2)]}
        for bm, bn, warps, st in cfgs[min((c for c in cfgs if c >= head_dim))][:3 if which == "ordered" else None]:
            for rotate in (False, True) if which == "fused" else (False,):
                yield dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=st, ROTATE=rotate)
        return
    if which == "fwd":
        blocks = [(128, 32), (128, 64), (128, 128)] if head_dim <= 128 else [(128, 32), (128, 64), (64, 64)]
        stages = (2, 3, 4)
    else:
        blocks = [(32, 128), (64, 64), (64, 128), (128, 64), (128, 128)] if head_dim <= 128 else \
            [(32, 64), (64, 32), (64, 64), (32, 128), (128, 32)]
        stages = (2, 3)
    for (bm, bn), warps, st in itertools.product(blocks, (4, 8), stages):
        yield dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=st)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep(which, head_dim, causal, seqlen, heads=32, batch=1, dtype=torch.bfloat16):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype)
                   for _ in range(4))
    scale, offset = head_dim ** -0.5, (0 if causal else None)
    lse = torch.empty(batch, heads, seqlen, device="cuda")
    out = torch.empty_like(q)
    triton_attn.fwd(q, k, v, out, lse, softmax_scale=scale, causal_offset=offset, accumulate=False)
    delta = attn_delta(out, do)
    grads = [torch.empty(t.shape, device="cuda") for t in (q, k, v)]
    triton_attn.bwd(do, q, k, v, lse, delta, *grads, softmax_scale=scale, causal_offset=offset,
                    accumulate=False, deterministic=True)
    if which == "fwd":
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                             is_causal=causal).transpose(1, 2)
        o2, l2 = torch.empty_like(out), torch.empty_like(lse)
        fn = lambda: triton_attn.fwd(q, k, v, o2, l2, softmax_scale=scale, causal_offset=offset,
                                     accumulate=False)
        check = lambda: _rel(o2, ref)
    elif which in ("fused", "ordered"):
        g = [torch.empty_like(t) for t in (q, k, v)]  # the op's gradients: bf16, scratch dQ
        fn = lambda: triton_attn.bwd(do, q, k, v, lse, delta, *g, softmax_scale=scale,
                                     causal_offset=offset, accumulate=False,
                                     deterministic=which == "ordered")
        check = lambda: max(_rel(a, b) for a, b in zip(g, grads))
        two = lambda: triton_attn.bwd(do, q, k, v, lse, delta, *g, softmax_scale=scale,
                                      causal_offset=offset, accumulate=False, deterministic=True)
        two()
        ms = triton.testing.do_bench(two, warmup=25, rep=100, return_mode="median")
        print(f"  two-kernel d={head_dim} causal={causal}: {ms:.3f} ms "
              f"{_tflops(batch, heads, seqlen, head_dim, causal, ms, 2.5):.0f} TFLOP/s", flush=True)
    else:
        g = [torch.empty_like(t) for t in grads]
        args = (g[0], None, None) if which == "dq" else (None, g[1], g[2])
        fn = lambda: triton_attn.bwd(do, q, k, v, lse, delta, *args, softmax_scale=scale,
                                     causal_offset=offset, accumulate=False)
        checked = (0,) if which == "dq" else (1, 2)
        check = lambda: max(_rel(g[i], grads[i]) for i in checked)
    original = triton_attn.fwd_config, triton_attn.bwd_config
    original_fused = triton_attn.fused_bwd_config, triton_attn.FUSED_ROTATE
    fused_on = triton_attn.FUSED_BWD
    results = []
    for cfg in _candidates(which, head_dim):
        if which in ("fused", "ordered"):
            triton_attn.FUSED_BWD = True
            triton_attn.FUSED_DETERMINISTIC = which == "ordered"
            cfg = dict(cfg)
            triton_attn.FUSED_ROTATE = cfg.pop("ROTATE")
            triton_attn.fused_bwd_config = lambda d, dt, cfg=cfg: cfg
            cfg = dict(cfg, ROTATE=triton_attn.FUSED_ROTATE)
        elif which == "fwd":
            triton_attn.fwd_config = lambda d, dt, cfg=cfg: cfg
        else:
            dkdv_cfg, dq_cfg = original[1](head_dim, dtype)
            pair = (cfg, dq_cfg) if which == "dkdv" else (dkdv_cfg, cfg)
            triton_attn.bwd_config = lambda d, dt, pair=pair: pair
        try:
            fn()
            err = check()
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # out of shared memory, registers …
            print(f"  {which} {cfg}: {type(exc).__name__}")
            continue
        finally:
            triton_attn.fwd_config, triton_attn.bwd_config = original
            triton_attn.fused_bwd_config, triton_attn.FUSED_ROTATE = original_fused
            triton_attn.FUSED_DETERMINISTIC = False
            triton_attn.FUSED_BWD = fused_on
        tf = _tflops(batch, heads, seqlen, head_dim, causal, ms, FLOP_FACTOR[which])
        ok = err < 2e-2
        results.append((tf if ok else 0.0, cfg, ms, err))
        print(f"  {which} d={head_dim} causal={causal} {cfg}: {ms:.3f} ms {tf:.0f} TFLOP/s err={err:.1e}",
              flush=True)
    return max(results, key=lambda r: r[0])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--which", nargs="+", default=["fwd", "dkdv", "dq"],
                   choices=["fwd", "dkdv", "dq", "fused", "ordered"],
                   help="ordered: the fused kernel with semaphore-ordered dQ adds (deterministic)")
    p.add_argument("--causal", nargs="+", type=int, default=[0], help="0, 1 or both")
    p.add_argument("--no-tma", action="store_true", help="forward through pointer loads")
    p.add_argument("--fused-configs", nargs="+", default=None,
                   help="fused/ordered candidates, e.g. 64,128,8,3,1 (BLOCK_M,BLOCK_N,warps,stages,rotate)")
    p.add_argument("--fused-switch", nargs="+", default=[],
                   help="module switches of the fused kernel, e.g. FUSED_TMA_REDUCE=0 FUSED_TMA_LOADS=1")
    args = p.parse_args()
    global FUSED_CONFIGS
    if args.fused_configs:
        FUSED_CONFIGS = [tuple(int(x) for x in c.split(",")) for c in args.fused_configs]
    for switch in args.fused_switch:
        name, value = switch.split("=")
        setattr(triton_attn, name, bool(int(value)))
        print(f"  {name} = {bool(int(value))}")
    if args.no_tma:
        triton_attn._use_tma = lambda *tensors: False
    summary = []
    for which, d, causal in itertools.product(args.which, args.head_dims, map(bool, args.causal)):
        tf, cfg, ms, err = sweep(which, d, causal, args.seqlen)
        summary.append(f"{which:4} d={d:3} causal={causal!s:5} best {tf:5.0f} TFLOP/s {cfg}")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
