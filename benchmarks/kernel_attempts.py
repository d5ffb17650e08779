"""Kernel variants that were measured and not taken into kernels/ (benchmarks/NOTES.md,
"Kernel, second round"), timed beside the library's kernels on one GPU:

    python benchmarks/kernel_attempts.py [--seqlen 16384] [--head-dim 128]

- ``ws``: the forward with device-side TMA descriptors and ``tl.range(...,
  warp_specialize=True)``, stripped to the non-causal case with no masks, with and
  without warp specialization;
- ``atomic``: a backward doing 5 matmuls per tile pair instead of 7, dQ added with fp32
  atomics from the dK/dV kernel (non-deterministic), MHA, non-causal.
Both need the sequence length to be a multiple of their tiles. Each is checked against
the library before it is timed.

Found afterwards by compiling for sm_90 without a GPU (triton 3.6): the ``ws`` kernel as
run here (8 warps) was never warp-specialized. Hopper's pass leaves 8-warp kernels alone,
so the PTX with ``warp_specialize=True`` and False is the same, and the measured +1.6% came
from something else (this kernel has no masks). With 4 warps the pass fails on the
``.reshape`` of the 4-D descriptor box. Round 3 (benchmarks/NOTES.md) ran a forward that
does specialize (per-head 2-D descriptors, one key loop, 4 warps; commit c244cc6,
FWD_WARP_SPECIALIZE): it compiled, and its outputs were wrong on the H200.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import triton
import triton.language as tl

import _harness as H
from ringflash.kernels import PairMask, attn_delta, triton_attn

LOG2E = math.log2(math.e)


@triton.jit
def _ws_fwd_kernel(Q, K, V, O, LSE, B, H, HKV, seqlen_q, seqlen_k,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                   qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   WS: tl.constexpr, STAGES: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    off_b = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    off_hk = off_h // (H // HKV)
    qd = tl.make_tensor_descriptor(Q, shape=[B, seqlen_q, H, HEAD_DIM],
                                   strides=[stride_qb, stride_qs, stride_qh, 1],
                                   block_shape=[1, BLOCK_M, 1, HEAD_DIM])
    kd = tl.make_tensor_descriptor(K, shape=[B, seqlen_k, HKV, HEAD_DIM],
                                   strides=[stride_kb, stride_ks, stride_kh, 1],
                                   block_shape=[1, BLOCK_N, 1, HEAD_DIM])
    vd = tl.make_tensor_descriptor(V, shape=[B, seqlen_k, HKV, HEAD_DIM],
                                   strides=[stride_vb, stride_vs, stride_vh, 1],
                                   block_shape=[1, BLOCK_N, 1, HEAD_DIM])
    q = qd.load([off_b, start_m, off_h, 0]).reshape(BLOCK_M, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in tl.range(0, seqlen_k, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        k = kd.load([off_b, start_n, off_hk, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = vd.load([off_b, start_n, off_hk, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(LSE + (off_b * H + off_h) * seqlen_q + offs_m,
             (m_i + tl.math.log2(l_i)) * 0.6931471805599453)
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, (acc / l_i[:, None]).to(O.dtype.element_ty))


def ws_fwd(q, k, v, out, lse, scale, *, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3,
           ws=True):
    """out, lse (contiguous (B, H, S)) of non-causal attention."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    # Device-side descriptors live in a scratch buffer the launcher asks for.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device=q.device))
    _ws_fwd_kernel[(sq // BLOCK_M, b * h)](
        q, k, v, out, lse, b, h, hkv, sq, sk, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2), scale * LOG2E, HEAD_DIM=d,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, WS=ws, STAGES=num_stages, num_warps=num_warps)
    return out, lse


@triton.jit
def _atomic_bwd_kernel(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, H, seqlen, qk_scale, sm_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    off_b = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    row_stride = H * HEAD_DIM
    base = (off_b * seqlen * H + off_h) * HEAD_DIM
    offs_d = tl.arange(0, HEAD_DIM)
    cols = start_n + tl.arange(0, BLOCK_N)
    k = tl.load(K + base + cols[:, None] * row_stride + offs_d[None, :])
    v = tl.load(V + base + cols[:, None] * row_stride + offs_d[None, :])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    stat = (off_b * H + off_h) * seqlen
    for start_m in range(0, seqlen, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = tl.load(Q + base + rows[:, None] * row_stride + offs_d[None, :])
        do = tl.load(DO + base + rows[:, None] * row_stride + offs_d[None, :])
        lse = tl.load(LSE + stat + rows) * 1.4426950408889634
        delta = tl.load(DELTA + stat + rows)
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dsT = (pT * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
        dk = tl.dot(dsT, q, dk)
        dq = tl.dot(tl.trans(dsT), k) * sm_scale
        tl.atomic_add(DQ + base + rows[:, None] * row_stride + offs_d[None, :], dq, sem="relaxed")
    tl.store(DK + base + cols[:, None] * row_stride + offs_d[None, :], dk * sm_scale)
    tl.store(DV + base + cols[:, None] * row_stride + offs_d[None, :], dv)


def atomic_bwd(do, q, k, v, lse, delta, dq, dk, dv, scale, *, BLOCK_M=64, BLOCK_N=128,
               num_warps=8, num_stages=1):
    """dq, dk, dv (fp32, contiguous) of non-causal MHA attention."""
    b, s, h, d = q.shape
    dq.zero_()
    _atomic_bwd_kernel[(s // BLOCK_N, b * h)](
        q, k, v, do, lse, delta, dq, dk, dv, h, s, scale * LOG2E, scale, HEAD_DIM=d,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=num_warps, num_stages=num_stages)
    return dq, dk, dv


def main():
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).rstrip(":") + ".",
                                formatter_class=H.HelpFormatter)
    p.add_argument("--seqlen", type=int, default=16384, help="tokens (a multiple of the tiles, 128)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim")
    p.add_argument("--heads", type=int, default=32, help="heads (MHA)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ERROR: kernel_attempts.py times Triton kernels on a GPU; no CUDA device here")
    s, h, d = args.seqlen, args.heads, args.head_dim
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = d ** -0.5
    fwd_flops = 4 * h * s * s * d
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    report = lambda name, ms, factor, err: print(
        f"{name:48} {ms:8.3f} ms {fwd_flops * factor / ms / 1e9:6.0f} TFLOP/s  err {err:.1e}")

    out, lse = torch.empty_like(q), torch.empty(1, h, s, device="cuda")
    lib_fwd = lambda: triton_attn.fwd(q, k, v, out, lse, softmax_scale=scale, mask=PairMask(),
                                      accumulate=False)
    lib_fwd()
    report("library forward", bench(lib_fwd), 1.0, 0.0)
    o2, l2 = torch.empty_like(out), torch.empty_like(lse)
    for bn, stages, ws in itertools.product((64, 128), (2, 3), (False, True)):
        fn = lambda: ws_fwd(q, k, v, o2, l2, scale, BLOCK_N=bn, num_stages=stages, ws=ws)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a variant this triton cannot build
            print(f"ws BLOCK_N={bn} stages={stages} ws={ws}: {type(exc).__name__}")
            continue
        report(f"ws BLOCK_N={bn} stages={stages} warp_specialize={ws}", bench(fn), 1.0, H.rel_err(o2, out))

    delta = attn_delta(out, do)
    grads = [torch.empty(t.shape, device="cuda") for t in (q, k, v)]
    lib_bwd = lambda: triton_attn.bwd(do, q, k, v, lse, delta, *grads, softmax_scale=scale,
                                      mask=PairMask(), accumulate=False)
    lib_bwd()
    report("library backward (dK/dV + dQ kernels)", bench(lib_bwd), 2.5, 0.0)
    g = [torch.empty_like(t) for t in grads]
    for (bm, bn), warps in itertools.product(((64, 64), (64, 128), (128, 128)), (4, 8)):
        fn = lambda: atomic_bwd(do, q, k, v, lse, delta, *g, scale, BLOCK_M=bm, BLOCK_N=bn,
                                num_warps=warps)
        fn()
        err = max(H.rel_err(a, r) for a, r in zip(g, grads))
        report(f"atomic dQ {bm}x{bn} warps={warps}", bench(fn), 2.5, err)


if __name__ == "__main__":
    main()
