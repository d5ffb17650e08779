"""Kernel variants that were measured and not taken into kernels/ (docs/notes/kernel.md,
"Kernel, second round"; docs/notes/dropout.md, "Dropout, seventh round" and "eighth
round"), timed beside the library's kernels on one GPU:

    python benchmarks/research/kernel_attempts.py [--seqlen 16384] [--head-dim 128] [--variants ws gluon atomic]

- ``ws``: the forward with device-side TMA descriptors and ``tl.range(...,
  warp_specialize=True)``, stripped to the non-causal case with no masks, with and
  without warp specialization;
- ``atomic``: a backward doing 5 matmuls per tile pair instead of 7, dQ added with fp32
  atomics from the dK/dV kernel (non-deterministic), MHA, non-causal;
- ``gluon``: a warp-specialized forward in Gluon (``triton.experimental.gluon``, Hopper):
  a TMA warp loads K and V tiles into a ring of shared-memory stages, two consumer warp
  groups (64 query rows each) share every stage, the scores' product runs asynchronously
  while the dropout bits are drawn, and the dropped probabilities are zeroed on packed
  bf16 pairs (one PRMT and one AND a pair) with the scale folded into the epilogue. The
  bits are the library's (kernels/dropout.py). Non-causal, MHA, no mask, head_dim 128,
  p <= 0.5. Variants (``GLUON_VARIANTS``, checked to give the same out and lse bit for
  bit): 2 or 3 stages; ``bits="group"``, a fourth warp group that draws the bits and
  hands them to the consumers packed in shared memory; ``pingpong``, the consumers taking
  turns at issuing their scores' products; and two probes, the mask applied with constant
  bits and the bits' group not waited for. ``--rounds N`` times the variants in N
  interleaved rounds (medians). ``gluon_compile`` builds it for sm_90 on any machine.
All need the sequence length to be a multiple of their tiles. Each is checked against
the library before it is timed.

Found afterwards by compiling for sm_90 without a GPU (triton 3.6): the ``ws`` kernel as
run here (8 warps) was never warp-specialized. Hopper's pass leaves 8-warp kernels alone,
so the PTX with ``warp_specialize=True`` and False is the same, and the measured +1.6% came
from something else (this kernel has no masks). With 4 warps the pass fails on the
``.reshape`` of the 4-D descriptor box. Round 3 (docs/notes/kernel.md, "Kernel, third
round") ran a forward that does specialize (per-head 2-D descriptors, one key loop, 4
warps; commit c244cc6, FWD_WARP_SPECIALIZE): it compiled, and its outputs were wrong on
the H200.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
from harness.checks import rel_err  # noqa: E402
from harness.cli import HelpFormatter  # noqa: E402
from ringflash.kernels import PairMask, attn_delta, dropout  # noqa: E402
from ringflash.kernels import triton as triton_kernels  # noqa: E402

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


@gluon.jit
def _philox(seed_lo, seed_hi, c0, c1, c2, c3, ROUNDS: gl.constexpr):
    """Philox4x32 (as tl.philox and kernels/dropout.py) on uint32 tensors."""
    k0 = seed_lo
    k1 = seed_hi
    for _ in gl.static_range(ROUNDS):
        hi_b = gl.umulhi(c2, 0xCD9E8D57)
        lo_b = c2 * 0xCD9E8D57
        hi_a = gl.umulhi(c0, 0xD2511F53)
        lo_a = c0 * 0xD2511F53
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@gluon.jit
def _call_axes(x):
    """A (64, 128) tile in the wgmma accumulator layout with the 16 elements of each Philox
    call (query bit 3; key bits 0, 3, 4: all in one thread's registers) on the last axes:
    (q5 q4, q2-0, k6 k5, k2 k1, k3, q3, k4, k0). Register moves only."""
    return x.reshape([4, 2, 8, 4, 2, 2, 4, 2]).permute([0, 2, 3, 6, 5, 1, 4, 7])


@gluon.jit
def _keep_words(rows, cols, seed_lo, seed_hi, head, batch, t4):
    """The Philox words of a (64, 128) tile of global rows x cols, on axes (q5 q4, q2-0,
    k6 k5, k2 k1, k3, q3) (word = k3 | q3 << 1), each byte reduced to its keep bit in
    bit 7 (byte >= t, four bytes at once: ((w | 0x80..) - t4) | w, valid for t <= 128)."""
    r = gl.expand_dims(rows.to(gl.uint32), 1)
    c = gl.expand_dims(cols.to(gl.uint32), 0)
    kc, qc = gl.broadcast(((c >> 5) << 2) | ((c >> 1) & 3), ((r >> 4) << 3) | (r & 7))
    kc = _call_axes(kc)
    qc = _call_axes(qc)
    for _ in gl.static_range(4):  # one element of each call: k0 = k4 = q3 = k3 = 0
        kc, _k1 = kc.split()
        qc, _q1 = qc.split()
    head = gl.full(kc.shape, 0, gl.uint32, kc.type.layout) + head
    batch = gl.full(kc.shape, 0, gl.uint32, kc.type.layout) + batch
    o0, o1, o2, o3 = _philox(seed_lo, seed_hi, kc, qc, head, batch, 7)
    w = gl.join(gl.join(o0, o1), gl.join(o2, o3))
    return (((w | 0x80808080) - t4) | w) & 0x80808080


@gluon.jit
def _pack_words(w):
    """A thread's 16 keep words of a (64, 128) tile (``_keep_words``: keep bits in bit 7 of
    each byte) packed into 2: word (k3, q3) of key half k5 goes to bit 7 - (q3 + 2 k3 + 4 k5)
    of each byte. Axes (q5 q4, q2-0, k2 k1, k6)."""
    a, b = w.split()  # q3
    w = a | (b >> 1)
    a, b = w.split()  # k3
    w = (a | (b >> 2)).permute([0, 1, 3, 2]).reshape([4, 8, 4, 2, 2])  # (.., k2 k1, k6, k5)
    a, b = w.split()  # k5
    return a | (b >> 4)


@gluon.jit
def _unpack_words(x):
    """``_pack_words`` undone: each word's keep bits back in bit 7 of its bytes (the other
    bits are left over from the packing, and ``_drop`` reads bit 7 only)."""
    w = gl.join(x, x << 4).reshape([4, 8, 4, 4]).permute([0, 1, 3, 2])  # (.., k6 k5, k2 k1)
    w = gl.join(w, w << 2)  # k3
    return gl.join(w, w << 1)  # q3


@gluon.jit
def _drop(p, words, layout: gl.constexpr):
    """p (64, 128) bf16 in the wgmma ``layout`` with the dropped elements zeroed: byte
    k0 | k4 << 1 of a word decides element (k4, k0) of its call; two sign-replicated bytes
    (PRMT) mask one packed pair of p (k0 = 0, 1). No data leaves its register."""
    pe, po = _call_axes(p).split()  # k0
    p00, p10 = pe.split()  # k4
    p01, p11 = po.split()
    q00, q01, q10, q11 = gl.inline_asm_elementwise(
        """{
        .reg .b32 m, x;
        prmt.b32 m, $4, 0, 0x9988;
        mov.b32 x, {$5, $6};
        and.b32 x, x, m;
        mov.b32 {$0, $1}, x;
        prmt.b32 m, $4, 0, 0xBBAA;
        mov.b32 x, {$7, $8};
        and.b32 x, x, m;
        mov.b32 {$2, $3}, x;
        }""",
        "=h,=h,=h,=h,r,h,h,h,h", [words, p00, p01, p10, p11],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    q = gl.join(gl.join(q00, q01), gl.join(q10, q11))  # (.., k0, k4)
    return gl.convert_layout(q.permute([0, 5, 1, 2, 7, 4, 3, 6]).reshape([64, 128]), layout,
                             assert_trivial=True)


@gluon.jit
def _tile_words(a, rows, cols, s, ph, probe, BITS: gl.constexpr, HALF: gl.constexpr):
    """A consumer's keep words of its rows and the key tile's ``cols`` (``_keep_words``), in
    ``probe``'s layout, by ``BITS_MODES[BITS]``: drawn here; read from stage ``s`` of the
    bits' group once it is filled, and unpacked; constant (all kept: a probe of what the
    mask's application costs); or read from the stage without waiting (a probe of what
    the bits' group costs the consumers; its outputs are not defined)."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
     bits_smem, bits_ready, turn, o_ptr, lse_ptr, row_q, row_k, col, n_tiles, H, seqlen,
     qk_scale, seed_lo, seed_hi, t4, drop_scale) = a
    if BITS == 0:
        bh = gl.program_id(1)
        return _keep_words(rows, cols, seed_lo, seed_hi, (bh % H).to(gl.uint32),
                           (bh // H).to(gl.uint32), t4)
    elif BITS == 2:
        return probe | 0x80808080
    else:
        if BITS == 1:
            mbarrier.wait(bits_ready.index(s), ph)
        packed = bits_smem.index(2 * s + HALF).load(_pack_words(probe).type.layout)
        return gl.convert_layout(_unpack_words(packed), probe.type.layout, assert_trivial=True)


@gluon.jit
def _gl_loader(a, STAGES: gl.constexpr, DROPOUT: gl.constexpr, BITS: gl.constexpr,
               PINGPONG: gl.constexpr):
    """The TMA warp: both halves of the query tile once, then K and V tile by tile into
    the ring of stages, each stage refilled once both consumers have released it."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
     bits_smem, bits_ready, turn, o_ptr, lse_ptr, row_q, row_k, col, n_tiles, H, seqlen,
     qk_scale, seed_lo, seed_hi, t4, drop_scale) = a
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row_q, col], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [row_q + 64, col], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        s = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(kv_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row_k + j * 128, col], k_ready.index(s),
                                        k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row_k + j * 128, col], v_ready.index(s),
                                        v_smem.index(s))


@gluon.jit
def _gl_consume(a, STAGES: gl.constexpr, DROPOUT: gl.constexpr, BITS: gl.constexpr,
                PINGPONG: gl.constexpr, HALF: gl.constexpr):
    """One consumer warp group: the online softmax of query rows [64 HALF, 64 HALF + 64)
    of the program's tile over every key tile, then out and lse. Its dropout bits come
    from ``_tile_words``."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
     bits_smem, bits_ready, turn, o_ptr, lse_ptr, row_q, row_k, col, n_tiles, H, seqlen,
     qk_scale, seed_lo, seed_hi, t4, drop_scale) = a
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 128, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    bh = gl.program_id(1)
    off_b = bh // H
    off_h = bh % H
    rows = gl.program_id(0) * 128 + HALF * 64 + gl.arange(0, 64, rows_l)
    cols = gl.arange(0, 128, cols_l)
    m_i = gl.full([64], float("-inf"), gl.float32, rows_l)
    l_i = gl.full([64], 0.0, gl.float32, rows_l)
    acc = gl.zeros([64, 128], gl.float32, mma)
    zero = gl.zeros([64, 128], gl.float32, mma)
    probe = _words_probe(mma)
    mbarrier.wait(q_bar, 0)
    q = q_smem.index(HALF)
    for j in range(n_tiles):
        s = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(s), ph)
        if PINGPONG:  # the groups take turns at issuing their scores' products
            mbarrier.wait(turn.index(HALF), (j & 1) ^ (1 - HALF))
        qk = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - HALF), count=1)
        if DROPOUT:  # drawn under the scores' product, or read from the bits' group
            words = _tile_words(a, rows, j * 128 + cols, s, ph, probe, BITS, HALF)
        qk = warpgroup_mma_wait(0, deps=[qk])
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)  # of the undropped scores
        acc = acc * gl.expand_dims(alpha, 1)
        pb = p.to(gl.bfloat16)
        if DROPOUT:
            pb = _drop(pb, words, mma)
        mbarrier.wait(v_ready.index(s), ph)
        acc = warpgroup_mma(gl.convert_layout(pb, p_layout), v_smem.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(kv_empty.index(s), count=1)
        m_i = m_new
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(lse_ptr + bh * seqlen + rows, lse)
    offs = ((off_b * seqlen + gl.expand_dims(rows, 1)) * H + off_h) * 128 + gl.expand_dims(cols, 0)
    gl.store(o_ptr + offs, (acc * (drop_scale / gl.expand_dims(l_i, 1))).to(gl.bfloat16))


@gluon.jit
def _gl_consume0(a, STAGES: gl.constexpr, DROPOUT: gl.constexpr, BITS: gl.constexpr,
                 PINGPONG: gl.constexpr):
    _gl_consume(a, STAGES, DROPOUT, BITS, PINGPONG, 0)


@gluon.jit
def _gl_consume1(a, STAGES: gl.constexpr, DROPOUT: gl.constexpr, BITS: gl.constexpr,
                 PINGPONG: gl.constexpr):
    _gl_consume(a, STAGES, DROPOUT, BITS, PINGPONG, 1)


@gluon.jit
def _gl_rng(a, STAGES: gl.constexpr, DROPOUT: gl.constexpr, BITS: gl.constexpr,
            PINGPONG: gl.constexpr):
    """The bits' warp group (``BITS`` 1 or 3): each key tile's keep words for both query halves,
    packed (``_pack_words``) into the stage its K and V occupy, refilled when they are."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
     bits_smem, bits_ready, turn, o_ptr, lse_ptr, row_q, row_k, col, n_tiles, H, seqlen,
     qk_scale, seed_lo, seed_hi, t4, drop_scale) = a
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 128, 16])
    bh = gl.program_id(1)
    head = (bh % H).to(gl.uint32)
    batch = (bh // H).to(gl.uint32)
    rows = gl.program_id(0) * 128 + gl.arange(0, 64, gl.SliceLayout(1, mma))
    cols = gl.arange(0, 128, gl.SliceLayout(0, mma))
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        for half in gl.static_range(2):
            words = _keep_words(rows + 64 * half, j * 128 + cols, seed_lo, seed_hi, head, batch, t4)
            bits_smem.index(2 * s + half).store(_pack_words(words))
        gl.thread_barrier()  # every warp's words stored before the one arrive
        mbarrier.arrive(bits_ready.index(s), count=1)


@gluon.jit
def _words_probe(mma: gl.constexpr):
    """Zeros shaped and laid out as ``_keep_words``'s result for a tile in ``mma`` (only its
    type is used)."""
    z = _call_axes(gl.zeros([64, 128], gl.uint32, mma))
    for _ in gl.static_range(4):
        z, _z = z.split()
    return gl.join(gl.join(z, z), gl.join(z, z))


@gluon.jit
def _gl_fwd_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, H, seqlen, qk_scale, seed, threshold,
                   drop_scale, STAGES: gl.constexpr, DROPOUT: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, BITS: gl.constexpr, RNG_REGS: gl.constexpr,
                   PINGPONG: gl.constexpr):
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 128], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, 128], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, 128], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bits_smem = gl.allocate_shared_memory(  # the bits' group's packed words, both halves a stage
        gl.uint32, [2 * STAGES, 4, 8, 4, 2],
        gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[3, 2, 1, 0]))
    bits_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bits_ready.index(i), count=1)
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumers release a stage
    off_b = gl.program_id(1) // H
    seed64 = seed.to(gl.int64)
    a = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
         bits_smem, bits_ready, turn, o_ptr, lse_ptr, off_b * seqlen + gl.program_id(0) * 128,
         off_b * seqlen, (gl.program_id(1) % H) * 128, seqlen // 128, H, seqlen, qk_scale,
         (seed64 & 0xFFFFFFFF).to(gl.uint32), ((seed64 >> 32) & 0xFFFFFFFF).to(gl.uint32),
         threshold.to(gl.uint32) * 0x01010101, drop_scale)
    if BITS % 2 == 1:  # a bits' group
        gl.warp_specialize([(_gl_consume0, (a, STAGES, DROPOUT, BITS, PINGPONG)),
                            (_gl_consume1, (a, STAGES, DROPOUT, BITS, PINGPONG)),
                            (_gl_loader, (a, STAGES, DROPOUT, BITS, PINGPONG)),
                            (_gl_rng, (a, STAGES, DROPOUT, BITS, PINGPONG))],
                           [4, 1, 4], [CONSUMER_REGS, 24, RNG_REGS])
    else:
        gl.warp_specialize([(_gl_consume0, (a, STAGES, DROPOUT, BITS, PINGPONG)),
                            (_gl_consume1, (a, STAGES, DROPOUT, BITS, PINGPONG)),
                            (_gl_loader, (a, STAGES, DROPOUT, BITS, PINGPONG))],
                           [4, 1], [CONSUMER_REGS, 24])


def _gl_descs(q, k, v):
    """TMA descriptors over (B S, H D) views of contiguous (B, S, H, 128) tensors."""
    b, s, h, d = q.shape
    lay_q = gl.NVMMASharedLayout.get_default_for([64, d], gl.bfloat16)
    lay_kv = gl.NVMMASharedLayout.get_default_for([128, d], gl.bfloat16)
    return (TensorDescriptor(q, [b * s, h * d], [h * d, 1], [64, d], lay_q),
            TensorDescriptor(k, [b * s, h * d], [h * d, 1], [128, d], lay_kv),
            TensorDescriptor(v, [b * s, h * d], [h * d, 1], [128, d], lay_kv))


BITS_MODES = ("consumers", "group", "constant", "group-nowait")  # _tile_words
# (stages, bits, pingpong); the last two are probes, timed at p > 0 only
GLUON_VARIANTS = [(3, "consumers", False), (2, "consumers", False), (3, "consumers", True),
                  (2, "group", False), (2, "group", True), (2, "constant", False),
                  (2, "group-nowait", False)]


def _gl_options(group):
    """Launch options and register budgets (a Hopper SM's 64K registers shared by warp groups:
    two consumers, the loader's warp padded to a group, and with ``group`` the bits' group)."""
    if group:  # 16 warps at 128: consumers 2 x 200, loader 24, bits 88
        return dict(num_warps=4, maxnreg=128), 200, 88
    return dict(num_warps=4, maxnreg=168), 232, 0  # 12 warps at 168: consumers 2 x 232, loader 24


def gluon_fwd(q, k, v, out, lse, scale, *, dropout_p=0.0, seed=0, stages=3, bits="consumers",
              pingpong=False):
    """out (B, S, H, 128) bf16 and lse (B, H, S) fp32 of non-causal MHA attention, with the
    library's dropout bits for (dropout_p, seed). ``bits`` (``BITS_MODES``): who draws them,
    the consumers or a warp group of their own that hands them over in shared memory, or
    one of two probes (see ``_tile_words``); ``pingpong``: the consumers take turns at
    issuing their scores' products."""
    b, s, h, d = q.shape
    if d != 128 or s % 128 or dropout.threshold(dropout_p) > 128:
        raise ValueError("gluon_fwd: head_dim 128, seqlen a multiple of 128, dropout_p <= 0.5")
    mode = BITS_MODES.index(bits) if dropout_p > 0 else 0
    if mode % 2 and stages > 2:
        raise ValueError("gluon_fwd: a bits' group takes 2 stages (with 3, 227 KB is exceeded)")
    drop_scale = dropout.keep_scale(dropout_p) if dropout_p > 0 else 1.0
    options, consumer_regs, rng_regs = _gl_options(mode % 2)
    _gl_fwd_kernel[(s // 128, b * h)](*_gl_descs(q, k, v), out, lse, h, s, scale * LOG2E, seed,
                                      dropout.threshold(dropout_p), drop_scale, stages,
                                      dropout_p > 0, consumer_regs, mode, rng_regs, pingpong,
                                      **options)
    return out, lse


def gluon_compile(dropout_on: bool, stages: int = 3, bits: str = "consumers",
                  pingpong: bool = False):
    """The Gluon forward compiled for sm_90 without a GPU (for its SASS and resources)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource
    t = torch.zeros(1, 256, 2, 128, dtype=torch.bfloat16)
    sig = {name: native_specialize_impl(CUDABackend, desc, False, True, True)[0]
           for name, desc in zip(("q_desc", "k_desc", "v_desc"), _gl_descs(t, t, t))}
    sig.update(o_ptr="*bf16", lse_ptr="*fp32", H="i32", seqlen="i32", qk_scale="fp32", seed="i64",
               threshold="i32", drop_scale="fp32", STAGES="constexpr", DROPOUT="constexpr",
               CONSUMER_REGS="constexpr", BITS="constexpr", RNG_REGS="constexpr",
               PINGPONG="constexpr")
    mode = BITS_MODES.index(bits)
    options, consumer_regs, rng_regs = _gl_options(mode % 2)
    consts = dict(STAGES=stages, DROPOUT=dropout_on, CONSUMER_REGS=consumer_regs, BITS=mode,
                  RNG_REGS=rng_regs, PINGPONG=pingpong)
    return triton.compile(GluonASTSource(_gl_fwd_kernel, sig, consts),
                          target=GPUTarget("cuda", 90, 32), options=options)


def clocks(q, k, v, do, scale, seconds):
    """The SM clock and board power (medians of nvidia-smi samples every 50 ms) while the
    library's forward, then its backward, run back to back at p = 0 and p = 0.1."""
    out, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda")
    grads = [torch.empty(t.shape, device="cuda") for t in (q, k, v)]
    phases = []
    for kind in ("forward", "backward"):
        for p_drop in (0.0, 0.1):
            mask = PairMask(dropout_p=p_drop, seed=1234, pos=(0, 0, 1, 0))
            fwd = lambda mask=mask: triton_kernels.fwd(q, k, v, out, lse, softmax_scale=scale,
                                                       mask=mask, accumulate=False)
            fn = fwd
            if kind == "backward":
                fwd()
                delta = attn_delta(out, do)
                fn = (lambda mask=mask, delta=delta: triton_kernels.bwd(
                    do, q, k, v, lse, delta, *grads, softmax_scale=scale, mask=mask, accumulate=False))
            fn()
            phases.append((f"library {kind}, dropout {p_drop}", fn))
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "-i", str(torch.cuda.current_device()), "-lms", "50",
                            "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                            "--format=csv,noheader,nounits"], stdout=subprocess.PIPE, text=True)
    start = time.monotonic()
    spans = []
    for name, fn in phases:
        calls, t0 = 0, time.monotonic()
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
        while time.monotonic() - t0 < seconds:
            fn()
            calls += 1
            torch.cuda.synchronize()
        last.record()
        last.synchronize()
        spans.append((name, t0 - start, time.monotonic() - start, first.elapsed_time(last) / calls))
    smi.terminate()
    samples = [line.split(", ") for line in smi.communicate()[0].strip().splitlines()]
    step = (time.monotonic() - start) / max(len(samples), 1)  # samples at a steady rate
    for name, a, b, ms in spans:
        inside = [row for i, row in enumerate(samples) if a + seconds / 4 <= i * step <= b]
        clock = statistics.median(float(r[0]) for r in inside) if inside else float("nan")
        power = statistics.median(float(r[1]) for r in inside) if inside else float("nan")
        reasons = sorted({r[2] for r in inside})
        print(f"{name:40} {ms:9.3f} ms a call  SM {clock:5.0f} MHz  {power:4.0f} W  "
              f"throttle reasons {reasons} ({len(inside)} samples)")


def main():
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).rstrip(":") + ".",
                                formatter_class=HelpFormatter)
    p.add_argument("--seqlen", type=int, default=16384, help="tokens (a multiple of the tiles, 128)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim")
    p.add_argument("--heads", type=int, default=32, help="heads (MHA)")
    p.add_argument("--variants", nargs="+", default=["ws", "gluon", "atomic"],
                   choices=["ws", "gluon", "atomic"], help="which attempts to time")
    p.add_argument("--rounds", type=int, default=1, help="gluon: time the variants in this many "
                   "interleaved rounds and print medians")
    p.add_argument("--clocks", type=float, default=0.0, metavar="SECONDS",
                   help="also run the library's forward and backward at p = 0 and 0.1 for this "
                   "long each and print the SM clock and power nvidia-smi samples meanwhile")
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
    lib_fwd = lambda: triton_kernels.fwd(q, k, v, out, lse, softmax_scale=scale, mask=PairMask(),
                                         accumulate=False)
    lib_fwd()
    report("library forward", bench(lib_fwd), 1.0, 0.0)
    o2, l2 = torch.empty_like(out), torch.empty_like(lse)
    for bn, stages, ws in itertools.product((64, 128), (2, 3), (False, True)) if "ws" in args.variants else ():
        fn = lambda: ws_fwd(q, k, v, o2, l2, scale, BLOCK_N=bn, num_stages=stages, ws=ws)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a variant this triton cannot build
            print(f"ws BLOCK_N={bn} stages={stages} ws={ws}: {type(exc).__name__}")
            continue
        report(f"ws BLOCK_N={bn} stages={stages} warp_specialize={ws}", bench(fn), 1.0, rel_err(o2, out))

    if d == 128 and "gluon" in args.variants:
        cases = []  # (name, fn), each checked once, then timed in rounds
        for p_drop in (0.0, 0.1):
            mask = PairMask(dropout_p=p_drop, seed=1234, pos=(0, 0, 1, 0))
            cases.append((f"library forward, dropout {p_drop}",
                          lambda mask=mask: triton_kernels.fwd(q, k, v, out, lse, softmax_scale=scale,
                                                               mask=mask, accumulate=False)))
            cases[-1][1]()
            ref = None
            for stages, bits, pingpong in GLUON_VARIANTS:
                if bits != "consumers" and not p_drop:
                    continue
                fn = (lambda p_drop=p_drop, stages=stages, bits=bits, pingpong=pingpong: gluon_fwd(
                    q, k, v, o2, l2, scale, dropout_p=p_drop, seed=1234, stages=stages, bits=bits,
                    pingpong=pingpong))
                fn()
                if ref is None:
                    ref = o2.clone(), l2.clone()
                    print(f"gluon, dropout {p_drop}: relative error against the library "
                          f"{rel_err(o2, out):.1e}")
                elif bits in ("consumers", "group"):  # the same arithmetic on the same bits
                    assert torch.equal(o2, ref[0]) and torch.equal(l2, ref[1]), (stages, bits, pingpong)
                name = f"gluon stages={stages}" + (f", bits {bits}" if p_drop else "")
                cases.append((name + (", ping-pong" if pingpong else "") + f", dropout {p_drop}", fn))
        times = {name: [] for name, _ in cases}
        for _ in range(args.rounds):
            for name, fn in cases:
                times[name].append(bench(fn))
        for name, t in times.items():
            spread = f"  ({min(t):.2f}-{max(t):.2f} over {len(t)} rounds)" if len(t) > 1 else ""
            print(f"{name:56} {statistics.median(t):8.3f} ms{spread}")
        lib_fwd()  # out, lse of the dropout-free forward again, for the backward below
    if args.clocks:
        clocks(q, k, v, do, scale, args.clocks)

    delta = attn_delta(out, do)
    grads = [torch.empty(t.shape, device="cuda") for t in (q, k, v)]
    lib_bwd = lambda: triton_kernels.bwd(do, q, k, v, lse, delta, *grads, softmax_scale=scale,
                                         mask=PairMask(), accumulate=False)
    lib_bwd()
    report("library backward (dK/dV + dQ kernels)", bench(lib_bwd), 2.5, 0.0)
    g = [torch.empty_like(t) for t in grads]
    for (bm, bn), warps in (itertools.product(((64, 64), (64, 128), (128, 128)), (4, 8))
                            if "atomic" in args.variants else ()):
        fn = lambda: atomic_bwd(do, q, k, v, lse, delta, *g, scale, BLOCK_M=bm, BLOCK_N=bn,
                                num_warps=warps)
        fn()
        err = max(rel_err(a, r) for a, r in zip(g, grads))
        report(f"atomic dQ {bm}x{bn} warps={warps}", bench(fn), 2.5, err)


if __name__ == "__main__":
    main()
