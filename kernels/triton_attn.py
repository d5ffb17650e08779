"""FlashAttention-2 forward and backward in Triton, one (query block, key block) pair.

The math, per query row i, with s_ij = q_i . k_j * scale (base-2 internally:
``qk_scale = scale * log2(e)`` is folded into one multiply-add with the row max):

    forward   m = max_j s_ij,  l = sum_j exp(s_ij - m),  o = sum_j exp(s_ij - m) v_j / l,
              lse = m + log(l); key tiles in the inner loop, normalization by l once.
    backward  p_ij = exp(s_ij - lse_i) from the saved lse, delta_i = do_i . o_i,
              ds_ij = p_ij (do_i . v_j - delta_i);
              dq_i = scale sum_j ds_ij k_j,  dk_j = scale sum_i ds_ij q_i,  dv_j = sum_i p_ij do_i.

Masks are a description, never a tensor: ``CAUSAL`` with an integer diagonal
offset, key j visible to query i iff j <= i + offset. Tiles that no query of the
program can see are never loaded; in the forward and dQ kernels, tiles every query sees
skip the mask (the causal dK/dV kernel masks all of its tiles: measured faster there).

Backward: two kernels by default, dK/dV (key tiles outer) and dQ (query tiles outer), each
recomputing S and dP: 7 matmuls per tile pair, no atomics, bit-identical run to run. The
fused kernel (FUSED_BWD, opt-in) does 5 and reduce-adds dQ partials into fp32 through TMA;
it measured no faster on an H200 (benchmarks/NOTES.md, "Backward, fused"). Its mask logic
is in _bwd_query_range and _bwd_mask.

Layouts: q, o, do (B, Sq, H, D); k, v, dk, dv (B, Sk, Hkv, D), H a multiple of Hkv;
lse, delta (B, H, Sq). Any of them may be a strided view (last dim contiguous).
The forward reads q, k and v through TMA tensor descriptors over the whole (B, S, H, D)
tensor where the hardware has them and the strides are 16-byte aligned (the copy engine
zero-fills rows past the end); otherwise, and in the backward, through pointer loads.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = math.log2(math.e)


def _interpreting() -> bool:
    return triton.knobs.runtime.interpret


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def fwd_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile shape and launch parameters of the forward kernel, from benchmarks/tune_kernel.py
    on an H200 (bf16, 32 heads, TMA loads; see benchmarks/NOTES.md). fp32 tiles take twice
    the shared memory, so fp32 runs small unpipelined tiles: it is the exact path, not the
    fast one."""
    if _interpreting():
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    if head_dim <= 128:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=4)


def bwd_config(head_dim: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Tiles of the two backward kernels, (dK/dV kernel, dQ kernel): BLOCK_M query rows by
    BLOCK_N key rows in each, tuned apart. Same provenance as fwd_config."""
    if _interpreting():
        cfg = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
        return cfg, cfg
    if dtype == torch.float32:
        cfg = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
        return cfg, cfg
    if head_dim <= 64:
        return (dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3))
    if head_dim <= 128:
        return (dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3))
    return (dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
            dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3))


def fused_bwd_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tiles of the fused backward kernel: BLOCK_N key rows held by the program (dK and dV
    in registers) by BLOCK_M query rows per step. Swept by benchmarks/tune_kernel.py
    --which fused at 16k on an H200 (benchmarks/NOTES.md, "Backward, fused")."""
    if _interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)
    if head_dim <= 128:
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3)
    return dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=2)


def deterministic_requested(deterministic: bool = False) -> bool:
    """The caller's flag, or RINGFLASH_DETERMINISTIC=1 in the environment (read per call)."""
    return bool(deterministic) or os.environ.get("RINGFLASH_DETERMINISTIC", "") == "1"


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: plain fp32 products, or with torch's TF32 switch on, three TF32 passes
    (error ~1e-6 rather than single TF32's ~1e-3, which the probabilities of long rows
    pile up past the contract). Half types ignore it."""
    if dtype != torch.float32:
        return "tf32"
    return "tf32x3" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """The interpreter (CPU tensors) emulates descriptors; on CUDA they need Hopper or later."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def _use_tma(*tensors: torch.Tensor) -> bool:
    """Descriptors need a 16-byte-aligned base and 16-byte-aligned strides."""
    return _has_tma(tensors[0].device) and all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in tensors)


def _source(t: torch.Tensor, block_rows: int, head_dim_block: int, tma: bool):
    """What the kernels read a (B, S, H, D) tensor through: a descriptor of
    (1, block_rows, 1, head_dim_block) boxes, or the tensor itself (a pointer)."""
    if not tma:
        return t
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_rows, 1, head_dim_block])


@triton.jit
def _load_block(src, off_b, off_h, start, stride_b, stride_s, stride_h, n_rows,
                BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                BOUNDED: tl.constexpr, TMA: tl.constexpr):
    """Rows [start, start + BLOCK_ROWS) of head off_h of batch off_b, a (BLOCK_ROWS, BLOCK_D)
    tile; rows past n_rows (checked only when BOUNDED) and columns past HEAD_DIM read 0."""
    if TMA:
        tile = src.load([off_b, start, off_h, 0]).reshape(BLOCK_ROWS, BLOCK_D)
    else:
        rows = start + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_D)
        ptrs = src + off_b * stride_b + off_h * stride_h + rows[:, None] * stride_s + cols[None, :]
        if BOUNDED:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
        elif BLOCK_D != HEAD_DIM:
            tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _query_tile(BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """First row of this program's query tile (program_id(0)). Causal grids run last tile
    first: it sees the most keys, and a launch that ends on short tiles has a short tail
    (+1-9% on the causal forward, benchmarks/NOTES.md)."""
    if CAUSAL:
        return (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    return tl.program_id(0) * BLOCK_M


# ----------------------------------------------------------------------------- forward


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, K, V, off_b, off_hk, stride_kb, stride_ks, stride_kh,
              stride_vb, stride_vs, stride_vh, start_n, offs_m, seqlen_k, qk_scale, causal_offset,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
              TMA: tl.constexpr):
    k = _load_block(K, off_b, off_hk, start_n, stride_kb, stride_ks, stride_kh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, TMA)
    v = _load_block(V, off_b, off_hk, start_n, stride_vb, stride_vs, stride_vh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # unscaled; scale > 0 commutes with max
    if MASKED:
        cols = start_n + tl.arange(0, BLOCK_N)
        visible = cols[None, :] < seqlen_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + causal_offset)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED:  # a row may still have seen nothing: keep exp2 away from (-inf) - (-inf)
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.math.exp2(qk * qk_scale - m_new_safe[:, None])
    alpha = tl.math.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                stride_lb, stride_lh,
                H, GROUP, seqlen_q, seqlen_k, qk_scale, causal_offset,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr,
                PRECISION: tl.constexpr, TMA: tl.constexpr):
    start_m = _query_tile(BLOCK_M, CAUSAL)
    off_b = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    off_hk = off_h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q

    q = _load_block(Q, off_b, off_h, start_m, stride_qb, stride_qs, stride_qh, seqlen_q,
                    BLOCK_M, BLOCK_D, HEAD_DIM, True, TMA)
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    o_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    lse_ptrs = LSE + off_b * stride_lb + off_h * stride_lh + offs_m

    if ACCUMULATE:  # resume the online softmax from a previous partial (o, lse): m = lse, l = 1
        m_i = tl.load(lse_ptrs, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        acc = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Key tiles [0, full_end) are seen whole by every row; [full_end, end) need the mask.
    if CAUSAL:
        end = tl.maximum(tl.minimum(seqlen_k, start_m + BLOCK_M + causal_offset), 0)
        full_end = tl.maximum(start_m + causal_offset + 1, 0) // BLOCK_N * BLOCK_N
        full_end = tl.minimum(full_end, seqlen_k // BLOCK_N * BLOCK_N)
    else:
        end = seqlen_k
        full_end = seqlen_k // BLOCK_N * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K, V, off_b, off_hk, stride_kb, stride_ks,
                                  stride_kh, stride_vb, stride_vs, stride_vh, start_n, offs_m,
                                  seqlen_k, qk_scale, causal_offset, HEAD_DIM, BLOCK_N, BLOCK_D,
                                  False, CAUSAL, PRECISION, TMA)
    for start_n in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K, V, off_b, off_hk, stride_kb, stride_ks,
                                  stride_kh, stride_vb, stride_vs, stride_vh, start_n, offs_m,
                                  seqlen_k, qk_scale, causal_offset, HEAD_DIM, BLOCK_N, BLOCK_D,
                                  True, CAUSAL, PRECISION, TMA)

    empty = l_i == 0.0  # saw no key at all: out 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(lse_ptrs, lse, mask=row_ok)
    tl.store(o_ptrs, (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=o_mask)


def fwd(q, k, v, out, lse, *, softmax_scale: float, causal_offset: int | None, accumulate: bool):
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    cfg = fwd_config(d, q.dtype)
    bd = block_d(d)
    tma = _use_tma(q, k, v)
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]), b * h)
    _fwd_kernel[grid](
        _source(q, cfg["BLOCK_M"], bd, tma), _source(k, cfg["BLOCK_N"], bd, tma),
        _source(v, cfg["BLOCK_N"], bd, tma), out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        h, h // hkv, sq, sk, softmax_scale * LOG2E, causal_offset or 0,
        HEAD_DIM=d, BLOCK_D=bd, CAUSAL=causal_offset is not None, ACCUMULATE=accumulate,
        PRECISION=_dot_precision(q.dtype), TMA=tma, **cfg)
    return out, lse


# ----------------------------------------------------------------------------- backward


@triton.jit
def _load_stats(LSE, DELTA, rows, seqlen_q):
    """lse in base 2 (a row that saw no key gets +inf, so its p is 0) and delta."""
    ok = rows < seqlen_q
    lse = tl.load(LSE + rows, mask=ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    return lse, tl.load(DELTA + rows, mask=ok, other=0.0)


@triton.jit
def _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, off_b, off_h, stride_qb, stride_qs, stride_qh,
               stride_dob, stride_dos, stride_doh, start_m, cols, seqlen_q, qk_scale,
               causal_offset, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_D: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_block(Q, off_b, off_h, start_m, stride_qb, stride_qs, stride_qh, seqlen_q,
                    BLOCK_M, BLOCK_D, HEAD_DIM, True, False)
    do = _load_block(DO, off_b, off_h, start_m, stride_dob, stride_dos, stride_doh, seqlen_q,
                     BLOCK_M, BLOCK_D, HEAD_DIM, True, False)
    lse, delta = _load_stats(LSE, DELTA, rows, seqlen_q)
    # Transposed scores (keys x queries) so the tile products need no transposed store.
    pT = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :])
    if MASKED:
        pT = tl.where(cols[:, None] <= rows[None, :] + causal_offset, pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
    dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _store_grad(ptrs, mask, grad, ACCUMULATE: tl.constexpr):
    if ACCUMULATE:
        grad += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, grad.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                 stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                 stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                 stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                 stride_lb, stride_lh, stride_deltab, stride_deltah,
                 HKV, GROUP, seqlen_q, seqlen_k, qk_scale, sm_scale, causal_offset,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One key tile of one kv head; loops over the query heads of its group and over
    the query tiles that see it, so dK and dV are written once, without atomics."""
    start_n = tl.program_id(0) * BLOCK_N
    off_b = tl.program_id(1) // HKV
    off_hk = tl.program_id(1) % HKV
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    k = _load_block(K, off_b, off_hk, start_n, stride_kb, stride_ks, stride_kh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, True, False)
    v = _load_block(V, off_b, off_hk, start_n, stride_vb, stride_vs, stride_vh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, True, False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Causal: the query tiles from the first one that sees this key tile on. One loop that
    # masks every tile: splitting off the unmasked tiles into a second loop, as the forward
    # does, measured 17% slower here (benchmarks/NOTES.md), the mask being cheap beside
    # four matmuls.
    begin = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M if CAUSAL else 0
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        lse_base = LSE + off_b * stride_lb + off_h * stride_lh
        delta_base = DELTA + off_b * stride_deltab + off_h * stride_deltah
        for start_m in range(begin, seqlen_q, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, lse_base, delta_base, off_b, off_h,
                                stride_qb, stride_qs, stride_qh, stride_dob, stride_dos,
                                stride_doh, start_m, cols, seqlen_q, qk_scale, causal_offset,
                                HEAD_DIM, BLOCK_M, BLOCK_D, CAUSAL, PRECISION)

    mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    dk_ptrs = DK + off_b * stride_dkb + off_hk * stride_dkh + cols[:, None] * stride_dks + offs_d[None, :]
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh + cols[:, None] * stride_dvs + offs_d[None, :]
    _store_grad(dk_ptrs, mask, dk * sm_scale, ACCUMULATE)
    _store_grad(dv_ptrs, mask, dv, ACCUMULATE)


@triton.jit
def _dq_tile(dq, q, do, lse, delta, K, V, off_b, off_hk, stride_kb, stride_ks, stride_kh,
             stride_vb, stride_vs, stride_vh, start_n, rows, seqlen_k, qk_scale, causal_offset,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             BOUNDED: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    # Keys past seqlen_k load as zeros, so they add nothing to dq: only the loads are bounded.
    k = _load_block(K, off_b, off_hk, start_n, stride_kb, stride_ks, stride_kh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, BOUNDED, False)
    v = _load_block(V, off_b, off_hk, start_n, stride_vb, stride_vs, stride_vh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, BOUNDED, False)
    p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse[:, None])
    if MASKED:
        cols = start_n + tl.arange(0, BLOCK_N)
        p = tl.where(cols[None, :] <= rows[:, None] + causal_offset, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
               stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
               stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
               stride_dqb, stride_dqs, stride_dqh,
               stride_lb, stride_lh, stride_deltab, stride_deltah,
               H, GROUP, seqlen_q, seqlen_k, qk_scale, sm_scale, causal_offset,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr,
               PRECISION: tl.constexpr):
    start_m = _query_tile(BLOCK_M, CAUSAL)
    off_b = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    off_hk = off_h // GROUP
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q = _load_block(Q, off_b, off_h, start_m, stride_qb, stride_qs, stride_qh, seqlen_q,
                    BLOCK_M, BLOCK_D, HEAD_DIM, True, False)
    do = _load_block(DO, off_b, off_h, start_m, stride_dob, stride_dos, stride_doh, seqlen_q,
                     BLOCK_M, BLOCK_D, HEAD_DIM, True, False)
    lse, delta = _load_stats(LSE + off_b * stride_lb + off_h * stride_lh,
                             DELTA + off_b * stride_deltab + off_h * stride_deltah, rows, seqlen_q)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Key tiles [0, full_end) are whole and seen by every row; [full_end, end) straddle
    # the causal diagonal or the end of the keys.
    if CAUSAL:
        end = tl.maximum(tl.minimum(seqlen_k, start_m + BLOCK_M + causal_offset), 0)
        full_end = tl.maximum(start_m + causal_offset + 1, 0) // BLOCK_N * BLOCK_N
        full_end = tl.minimum(full_end, seqlen_k // BLOCK_N * BLOCK_N)
    else:
        end = seqlen_k
        full_end = seqlen_k // BLOCK_N * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse, delta, K, V, off_b, off_hk, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, start_n, rows, seqlen_k, qk_scale,
                      causal_offset, HEAD_DIM, BLOCK_N, BLOCK_D, False, False, PRECISION)
    for start_n in range(full_end, end, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse, delta, K, V, off_b, off_hk, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, start_n, rows, seqlen_k, qk_scale,
                      causal_offset, HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, PRECISION)

    mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    dq_ptrs = DQ + off_b * stride_dqb + off_h * stride_dqh + rows[:, None] * stride_dqs + offs_d[None, :]
    _store_grad(dq_ptrs, mask, dq * sm_scale, ACCUMULATE)


# ----------------------------------------------------------------------------- fused backward
# One program per key tile: 5 matmuls per (query tile, key tile) pair instead of the
# two-kernel path's 7; dQ partials are summed in fp32 by reduce-adds (non-deterministic
# order). All mask logic sits in the two helpers below.


@triton.jit
def _bwd_query_range(start_n, seqlen_q, causal_offset, BLOCK_M: tl.constexpr,
                     CAUSAL: tl.constexpr):
    """Query rows [begin, end) whose tiles the key tile [start_n, start_n + BLOCK_N) must
    visit, begin a multiple of BLOCK_M: causal, from the first query that sees its first key."""
    if CAUSAL:
        begin = tl.minimum(tl.maximum(start_n - causal_offset, 0), seqlen_q) // BLOCK_M * BLOCK_M
    else:
        begin = 0
    return begin, seqlen_q


@triton.jit
def _bwd_mask(pT, rows, cols, causal_offset, CAUSAL: tl.constexpr):
    """pT (keys x queries) with the probabilities of invisible pairs set to 0. Rows past the
    queries need nothing here (their lse loads as +inf), keys past the end neither (their
    k and v load as 0, and their dK/dV rows are never stored)."""
    if CAUSAL:
        pT = tl.where(cols[:, None] <= rows[None, :] + causal_offset, pT, 0.0)
    return pT


@triton.jit
def _add_dq(DQACC, dq, off_b, off_h, start_m, rows, stride_ab, stride_as, stride_ah, seqlen_q,
            LOCK, rank, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
            TMA_REDUCE: tl.constexpr, ORDERED: tl.constexpr):
    """dQACC[rows] += dq in fp32: one TMA reduce-add of the tile (rows past the end are
    clipped by the copy engine), or pointer atomics where there is no TMA (the interpreter,
    pre-Hopper GPUs, unaligned accumulators). ORDERED: a plain read-add-write once the tile's
    counter LOCK says that the programs of lower rank have added theirs (a fixed order of
    the sums, so bit-identical results), then the counter passes to the next rank."""
    if ORDERED:
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = DQACC + off_b * stride_ab + off_h * stride_ah + rows[:, None] * stride_as + offs_d[None, :]
        ok = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
        while tl.atomic_cas(LOCK, rank, rank, sem="acquire") != rank:
            pass
        cur = tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(ptrs, cur + dq, mask=ok, cache_modifier=".cg")
        tl.debug_barrier()
        tl.atomic_xchg(LOCK, rank + 1, sem="release")
    elif TMA_REDUCE:
        DQACC.atomic_add([off_b, start_m, off_h, 0], dq.reshape(1, BLOCK_M, 1, BLOCK_D))
    else:
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = DQACC + off_b * stride_ab + off_h * stride_ah + rows[:, None] * stride_as + offs_d[None, :]
        tl.atomic_add(ptrs, dq, mask=(rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM),
                      sem="relaxed")


@triton.jit
def _fused_bwd_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQACC, LOCKS,
                      stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                      stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                      stride_ab, stride_as, stride_ah,
                      stride_lb, stride_lh, stride_deltab, stride_deltah,
                      HKV, GROUP, seqlen_q, seqlen_k, qk_scale, sm_scale, causal_offset,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr,
                      PRECISION: tl.constexpr, TMA: tl.constexpr, TMA_REDUCE: tl.constexpr,
                      ROTATE: tl.constexpr, ORDERED: tl.constexpr, SKIP_DQ_ADD: tl.constexpr):
    """One key tile of one kv head, over the query heads of its group and the query tiles
    that see it: dK and dV stay in registers and are written once; every step adds its dQ
    partial, dS·K·scale, into the fp32 accumulator DQACC. Program ids run key tiles fastest,
    so the programs running together share a head and its accumulator stays in L2. Causal
    key tiles are in ascending order: the first sees the most queries (longest first).
    ORDERED (deterministic): the adds to each dQ tile come in key-tile order, through one
    counter per (batch, head, query tile) in LOCKS; the key tiles that see a query tile are
    0, 1, ..., so key tile n adds when the counter reads n. Lower program ids start first,
    so nobody waits on a program that cannot run."""
    start_n = tl.program_id(0) * BLOCK_N
    off_b = tl.program_id(1) // HKV
    off_hk = tl.program_id(1) % HKV
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    k = _load_block(K, off_b, off_hk, start_n, stride_kb, stride_ks, stride_kh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, True, TMA)
    v = _load_block(V, off_b, off_hk, start_n, stride_vb, stride_vs, stride_vh, seqlen_k,
                    BLOCK_N, BLOCK_D, HEAD_DIM, True, TMA)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    begin, end = _bwd_query_range(start_n, seqlen_q, causal_offset, BLOCK_M, CAUSAL)
    n_tiles = tl.cdiv(end - begin, BLOCK_M)
    # ROTATE: program i starts i tiles further on (wrapping), so the programs running
    # together reduce into different dQ tiles instead of queueing on the same one.
    shift = tl.program_id(0) % tl.maximum(n_tiles, 1)
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        lse_base = LSE + off_b * stride_lb + off_h * stride_lh
        delta_base = DELTA + off_b * stride_deltab + off_h * stride_deltah
        lock_base = LOCKS + (off_b * HKV * GROUP + off_h) * tl.cdiv(seqlen_q, BLOCK_M)
        for i in range(0, n_tiles):
            if ROTATE:
                j = i + shift
                start_m = begin + tl.where(j >= n_tiles, j - n_tiles, j) * BLOCK_M
            else:
                start_m = begin + i * BLOCK_M
            rows = start_m + tl.arange(0, BLOCK_M)
            q = _load_block(Q, off_b, off_h, start_m, stride_qb, stride_qs, stride_qh, seqlen_q,
                            BLOCK_M, BLOCK_D, HEAD_DIM, True, TMA)
            do = _load_block(DO, off_b, off_h, start_m, stride_dob, stride_dos, stride_doh,
                             seqlen_q, BLOCK_M, BLOCK_D, HEAD_DIM, True, TMA)
            lse, delta = _load_stats(lse_base, delta_base, rows, seqlen_q)
            pT = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
                              - lse[None, :])
            pT = _bwd_mask(pT, rows, cols, causal_offset, CAUSAL)
            dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # before dV: overlaps exp2
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
            dsT = (pT * (dpT - delta[None, :]) * sm_scale).to(q.dtype)
            dk = tl.dot(dsT, q, dk, input_precision=PRECISION)
            dq = tl.dot(tl.trans(dsT), k, input_precision=PRECISION)
            if SKIP_DQ_ADD:  # a measurement: every cost but the adds' traffic (mask never true)
                tl.atomic_add(DQACC + rows[:, None] * stride_as + offs_d[None, :], dq,
                              mask=(rows[:, None] < seqlen_q) & (seqlen_k < 0), sem="relaxed")
            else:
                _add_dq(DQACC, dq, off_b, off_h, start_m, rows, stride_ab, stride_as, stride_ah,
                        seqlen_q, lock_base + start_m // BLOCK_M, tl.program_id(0), HEAD_DIM,
                        BLOCK_M, BLOCK_D, TMA_REDUCE, ORDERED)

    mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    dk_ptrs = DK + off_b * stride_dkb + off_hk * stride_dkh + cols[:, None] * stride_dks + offs_d[None, :]
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh + cols[:, None] * stride_dvs + offs_d[None, :]
    _store_grad(dk_ptrs, mask, dk, ACCUMULATE)
    _store_grad(dv_ptrs, mask, dv, ACCUMULATE)


def _reduce_target(dq: torch.Tensor, accumulate: bool):
    """(fp32 tensor the fused kernel reduces dQ into, whether it is dq itself). An fp32 dq
    takes the adds directly (zeroed first unless accumulating), any other gets a zeroed fp32
    scratch, added or copied into dq afterwards."""
    if dq.dtype == torch.float32:
        if not accumulate:
            dq.zero_()
        return dq, True
    return torch.zeros(dq.shape, device=dq.device, dtype=torch.float32), False


def _fused_bwd(do, q, k, v, lse, delta, dq, dk, dv, *, softmax_scale, causal_offset, accumulate,
               common, scalars, qkv_strides, stat_strides, ordered=False):
    cfg = fused_bwd_config(q.shape[3], q.dtype)
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    acc, direct = _reduce_target(dq, accumulate)
    # The interpreter has no descriptor reduce; the ordered adds are plain stores.
    tma_reduce = FUSED_TMA_REDUCE and not FUSED_SKIP_DQ_ADD and acc.is_cuda and _use_tma(acc) and not ordered
    locks = (torch.zeros((b, h, triton.cdiv(sq, cfg["BLOCK_M"])), device=q.device, dtype=torch.int32)
             if ordered else acc)
    target = _source(acc, cfg["BLOCK_M"], common["BLOCK_D"], True) if tma_reduce else acc
    tma = FUSED_TMA_LOADS and _use_tma(q, k, v, do)
    bm, bn, bd = cfg["BLOCK_M"], cfg["BLOCK_N"], common["BLOCK_D"]
    _fused_bwd_kernel[(triton.cdiv(sk, bn), b * hkv)](
        _source(q, bm, bd, tma), _source(k, bn, bd, tma), _source(v, bn, bd, tma), _source(do, bm, bd, tma),
        lse, delta, dk, dv, target, locks, *qkv_strides,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2), *stat_strides, hkv, *scalars,
        TMA=tma, TMA_REDUCE=tma_reduce, ROTATE=FUSED_ROTATE and not ordered, ORDERED=ordered,
        SKIP_DQ_ADD=FUSED_SKIP_DQ_ADD, **common, **cfg)
    if not direct:  # the epilogue: cast (and add) the fp32 sums into the caller's dq
        if accumulate:
            dq.add_(acc)
        else:
            dq.copy_(acc)


# The fused backward measured slower than the two kernels on an H200 overall (benchmarks/
# NOTES.md, "Backward, fused": 0.97-1.04x at head_dim 128, 0.88-0.95x at 64, 0.6x at 256),
# so it is opt-in: True sends every joint, non-deterministic dq+dk+dv call to it.
FUSED_BWD = False
# Launch variants of the fused kernel, measured in the same section; the defaults won.
FUSED_ROTATE = True       # program i starts its query loop i tiles on
FUSED_TMA_LOADS = False   # q, k, v, do through TMA descriptors
FUSED_TMA_REDUCE = True   # dQ adds by TMA reduce (False: pointer atomics)
FUSED_SKIP_DQ_ADD = False  # a measurement only: drop the dQ adds (wrong dQ)
FUSED_DETERMINISTIC = False  # deterministic=True runs the ordered fused kernel, not two kernels


def bwd(do, q, k, v, lse, delta, dq, dk, dv, *, softmax_scale: float, causal_offset: int | None,
        accumulate: bool, deterministic: bool = False):
    """dq (skipped when None) and dk, dv (skipped when None). By default two kernels, dK/dV
    and dQ, each recomputing S and dP: bit-identical run to run, and a caller may run them
    apart. With FUSED_BWD on, all three requested and not ``deterministic`` (nor
    RINGFLASH_DETERMINISTIC=1): the fused kernel, whose dQ sums come in a varying order
    (bits may differ run to run, within rounding). The backward reads through pointers:
    TMA descriptors measured slower here (benchmarks/NOTES.md)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dkdv_cfg, dq_cfg = bwd_config(d, q.dtype)
    common = dict(HEAD_DIM=d, BLOCK_D=block_d(d), CAUSAL=causal_offset is not None,
                  ACCUMULATE=accumulate, PRECISION=_dot_precision(q.dtype))
    scalars = (h // hkv, sq, sk, softmax_scale * LOG2E, softmax_scale, causal_offset or 0)
    qkv_strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    stat_strides = (lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1))
    det = deterministic_requested(deterministic)
    if dq is not None and dk is not None and FUSED_BWD and (FUSED_DETERMINISTIC or not det):
        _fused_bwd(do, q, k, v, lse, delta, dq, dk, dv, softmax_scale=softmax_scale,
                   causal_offset=causal_offset, accumulate=accumulate, common=common,
                   scalars=scalars, qkv_strides=qkv_strides, stat_strides=stat_strides,
                   ordered=det)
        return dq, dk, dv
    if dk is not None:  # key tiles outer: q and do are read in BLOCK_M rows, k and v once
        _dkdv_kernel[(triton.cdiv(sk, dkdv_cfg["BLOCK_N"]), b * hkv)](
            q, k, v, do, lse, delta, dk, dv, *qkv_strides,
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            *stat_strides, hkv, *scalars, **common, **dkdv_cfg)
    if dq is not None:  # query tiles outer: k and v are read in BLOCK_N rows
        _dq_kernel[(triton.cdiv(sq, dq_cfg["BLOCK_M"]), b * h)](
            q, k, v, do, lse, delta, dq, *qkv_strides, dq.stride(0), dq.stride(1), dq.stride(2),
            *stat_strides, h, *scalars, **common, **dq_cfg)
    return dq, dk, dv
