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
program can see are never loaded; tiles every query sees skip the mask.

Layouts: q, o, do (B, Sq, H, D); k, v, dk, dv (B, Sk, Hkv, D), H a multiple of Hkv;
lse, delta (B, H, Sq). Any of them may be a strided view (last dim contiguous).
The forward reads q, k and v through TMA tensor descriptors over the whole (B, S, H, D)
tensor where the hardware has them and the strides are 16-byte aligned (the copy engine
zero-fills rows past the end); otherwise, and in the backward, through pointer loads.
Launch variants under measurement (program order, a persistent forward grid, descriptors
made in the kernel, warp specialization) are module-level switches, off by default.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = math.log2(math.e)

# ----------------------------------------------------------------------------- launch variants
# Read by the launchers at every call, so that a benchmark can A/B them in one process
# (.exp/kernel_round3.py; benchmarks/NOTES.md). The defaults are the measured behaviour:
# with them the kernels are the ones measured before these switches existed.

FWD_LONGEST_FIRST = False
"""Causal forward: program i runs query tile n-1-i, so the tiles with the most keys start
first instead of last (the tail of the launch is then the short tiles)."""

DQ_LONGEST_FIRST = False
"""Causal dQ kernel: the same order. (The dK/dV kernel already starts with key tile 0,
the one the most queries see.)"""

FWD_PERSISTENT = 0
"""Forward grid: 0, one program per (query tile, head); k > 0, min(items, k * SMs)
programs, each looping over (query tile, head) items with a stride of the grid size;
causal items are walked longest-first."""

FWD_PERSISTENT_HEAD_GROUP = 1
"""Order of the persistent items: heads taken in groups of this many (0: all of them),
query tiles outer and heads inner within a group. 1 walks one head after the other (its
neighbours in time share K/V in L2); 0 walks every head's longest tile first."""

FWD_DEVICE_DESCRIPTORS = False
"""Forward: TMA descriptors made in the kernel, 2-D (S, D) ones of the program's head
(tl.make_tensor_descriptor, scratch from triton.set_allocator; one is installed when none
is), instead of 4-D (B, S, H, D) ones made on the host."""

FWD_WARP_SPECIALIZE = False
"""Forward: one key loop ``tl.range(..., warp_specialize=True)`` over every key tile, each
masked when the mask is causal or the keys end inside a tile (instead of an unmasked loop
and a masked one: Hopper's pass in triton 3.6 fails on the pair). Implies
FWD_DEVICE_DESCRIPTORS (the pass fails on the reshape of a 4-D box) and 4 warps (it leaves
8-warp kernels alone and turns 4-warp ones into a producer and two consumer warp groups).
Where TMA is not usable (misaligned strides, pre-Hopper) both are off."""

FWD_WS_STAGES = 2
"""Pipeline stages of the warp-specialized forward: its buffers take more shared memory
(128x128 tiles at head_dim 128: ~246 KB with 3 stages, over the H200's 227; ~180 with 2)."""


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


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 4 in the interpreter, so a persistent grid loops there too."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator(device: torch.device) -> None:
    """Device-side descriptors live in scratch memory that Triton asks an allocator for at
    launch. Install one (torch's caching allocator) unless the caller has set their own."""
    if device.type != "cuda":
        return
    try:
        from triton.runtime import _allocation
        missing = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):  # another triton: install ours
        missing = True
    if missing:
        triton.set_allocator(_scratch)


@triton.jit
def _load_block(src, off_b, off_h, start, stride_b, stride_s, stride_h, n_rows,
                BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                BOUNDED: tl.constexpr, TMA: tl.constexpr):
    """Rows [start, start + BLOCK_ROWS) of head off_h of batch off_b, a (BLOCK_ROWS, BLOCK_D)
    tile; rows past n_rows (checked only when BOUNDED) and columns past HEAD_DIM read 0.
    src: TMA false, a pointer; TMA true (1), a descriptor over the whole (B, S, H, D) tensor;
    TMA 2, a 2-D (S, D) descriptor of this one head (made in the kernel)."""
    if TMA == 2:
        tile = src.load([start, 0])
    elif TMA:
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
def _fwd_item(Q, K, V, O, LSE, start_m, off_b, off_h, off_hk,
              stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
              stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
              stride_lb, stride_lh, seqlen_q, seqlen_k, qk_scale, causal_offset,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr,
              PRECISION: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
              EVEN_K: tl.constexpr):
    """Query rows [start_m, start_m + BLOCK_M) of head off_h of batch off_b, every key.
    TMA 2: Q, K, V are pointers; this head's (S, D) descriptors are made here. 2-D, because
    Hopper's warp specialization in triton 3.6 fails on the reshape a 4-D box needs."""
    if TMA == 2:
        Q = tl.make_tensor_descriptor(Q + off_b * stride_qb + off_h * stride_qh,
                                      shape=[seqlen_q, HEAD_DIM], strides=[stride_qs, 1],
                                      block_shape=[BLOCK_M, BLOCK_D])
        K = tl.make_tensor_descriptor(K + off_b * stride_kb + off_hk * stride_kh,
                                      shape=[seqlen_k, HEAD_DIM], strides=[stride_ks, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V + off_b * stride_vb + off_hk * stride_vh,
                                      shape=[seqlen_k, HEAD_DIM], strides=[stride_vs, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
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
    if WARP_SPECIALIZE:
        # One key loop: Hopper's warp specialization (triton 3.6) fails on a kernel with a
        # second loop bounded by a value the first one also uses, and ignores a loop whose
        # body branches. So every tile is masked, unless no tile needs it.
        for start_n in tl.range(0, end, BLOCK_N, warp_specialize=True):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K, V, off_b, off_hk, stride_kb, stride_ks,
                                      stride_kh, stride_vb, stride_vs, stride_vh, start_n, offs_m,
                                      seqlen_k, qk_scale, causal_offset, HEAD_DIM, BLOCK_N,
                                      BLOCK_D, CAUSAL or not EVEN_K, CAUSAL, PRECISION, TMA)
    else:
        for start_n in range(0, full_end, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K, V, off_b, off_hk, stride_kb, stride_ks,
                                      stride_kh, stride_vb, stride_vs, stride_vh, start_n, offs_m,
                                      seqlen_k, qk_scale, causal_offset, HEAD_DIM, BLOCK_N,
                                      BLOCK_D, False, CAUSAL, PRECISION, TMA)
        for start_n in range(full_end, end, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K, V, off_b, off_hk, stride_kb, stride_ks,
                                      stride_kh, stride_vb, stride_vs, stride_vh, start_n, offs_m,
                                      seqlen_k, qk_scale, causal_offset, HEAD_DIM, BLOCK_N,
                                      BLOCK_D, True, CAUSAL, PRECISION, TMA)

    empty = l_i == 0.0  # saw no key at all: out 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(lse_ptrs, lse, mask=row_ok)
    tl.store(o_ptrs, (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=o_mask)


@triton.jit
def _persistent_item(item, n_tiles, n_heads, head_group, CAUSAL: tl.constexpr):
    """(query tile, batch * H + head) of a persistent item: heads in groups of head_group,
    tiles outer within a group; causal tiles last-first (the longest first)."""
    group_items = head_group * n_tiles
    group = item // group_items
    first = group * head_group
    size = tl.minimum(head_group, n_heads - first)
    within = item - group * group_items
    tile = within // size
    if CAUSAL:
        tile = n_tiles - 1 - tile
    return tile, first + within % size


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                stride_lb, stride_lh,
                B, H, GROUP, seqlen_q, seqlen_k, qk_scale, causal_offset, head_group,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr,
                PRECISION: tl.constexpr, TMA: tl.constexpr, LONGEST_FIRST: tl.constexpr,
                PERSISTENT: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, EVEN_K: tl.constexpr):
    """Grid (query tiles, B * H), or with PERSISTENT a 1-D grid of programs that loop over
    the (query tile, head) items. TMA as in _load_block."""
    if PERSISTENT:
        n_tiles = tl.cdiv(seqlen_q, BLOCK_M)
        for item in range(tl.program_id(0), n_tiles * B * H, tl.num_programs(0)):
            tile, bh = _persistent_item(item, n_tiles, B * H, head_group, CAUSAL)
            off_h = bh % H
            _fwd_item(Q, K, V, O, LSE, tile * BLOCK_M, bh // H, off_h, off_h // GROUP,
                      stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                      stride_lb, stride_lh, seqlen_q, seqlen_k, qk_scale, causal_offset,
                      HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, ACCUMULATE, PRECISION, TMA,
                      WARP_SPECIALIZE, EVEN_K)
    else:
        if LONGEST_FIRST:  # causal: the last query tile sees the most keys
            tile = tl.num_programs(0) - 1 - tl.program_id(0)
        else:
            tile = tl.program_id(0)
        off_h = tl.program_id(1) % H
        _fwd_item(Q, K, V, O, LSE, tile * BLOCK_M, tl.program_id(1) // H, off_h, off_h // GROUP,
                  stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                  stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                  stride_lb, stride_lh, seqlen_q, seqlen_k, qk_scale, causal_offset,
                  HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, ACCUMULATE, PRECISION, TMA,
                  WARP_SPECIALIZE, EVEN_K)


def fwd(q, k, v, out, lse, *, softmax_scale: float, causal_offset: int | None, accumulate: bool):
    """The launch variants (FWD_* above) are read here, at every call."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    cfg = fwd_config(d, q.dtype)
    bd = block_d(d)
    tma = _use_tma(q, k, v)
    causal = causal_offset is not None
    warp_specialize = bool(FWD_WARP_SPECIALIZE) and tma
    device_desc = tma and (FWD_DEVICE_DESCRIPTORS or warp_specialize)
    if warp_specialize and not _interpreting():
        cfg = dict(cfg, num_warps=4, num_stages=FWD_WS_STAGES)
    n_tiles = triton.cdiv(sq, cfg["BLOCK_M"])
    if FWD_PERSISTENT:
        grid = (min(n_tiles * b * h, FWD_PERSISTENT * _num_sms(q.device)),)
    else:
        grid = (n_tiles, b * h)
    head_group = min(FWD_PERSISTENT_HEAD_GROUP or b * h, b * h)
    if device_desc:
        _ensure_allocator(q.device)
        sources = (q, k, v)
    else:
        sources = (_source(q, cfg["BLOCK_M"], bd, tma), _source(k, cfg["BLOCK_N"], bd, tma),
                   _source(v, cfg["BLOCK_N"], bd, tma))
    _fwd_kernel[grid](
        *sources, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        b, h, h // hkv, sq, sk, softmax_scale * LOG2E, causal_offset or 0, head_group,
        HEAD_DIM=d, BLOCK_D=bd, CAUSAL=causal, ACCUMULATE=accumulate,
        PRECISION=_dot_precision(q.dtype), TMA=2 if device_desc else tma,
        LONGEST_FIRST=bool(FWD_LONGEST_FIRST) and causal, PERSISTENT=bool(FWD_PERSISTENT),
        WARP_SPECIALIZE=warp_specialize, EVEN_K=warp_specialize and sk % cfg["BLOCK_N"] == 0,
        **cfg)
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
               PRECISION: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    if LONGEST_FIRST:  # causal: the last query tile sees the most keys
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    else:
        start_m = tl.program_id(0) * BLOCK_M
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


def bwd(do, q, k, v, lse, delta, dq, dk, dv, *, softmax_scale: float, causal_offset: int | None,
        accumulate: bool):
    """dq (skipped when None) and dk, dv (skipped when None): two kernels, so a caller can
    run them apart. The backward reads through pointers: TMA descriptors measured slower
    here (benchmarks/NOTES.md). DQ_LONGEST_FIRST is read here, at every call."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dkdv_cfg, dq_cfg = bwd_config(d, q.dtype)
    common = dict(HEAD_DIM=d, BLOCK_D=block_d(d), CAUSAL=causal_offset is not None,
                  ACCUMULATE=accumulate, PRECISION=_dot_precision(q.dtype))
    scalars = (h // hkv, sq, sk, softmax_scale * LOG2E, softmax_scale, causal_offset or 0)
    qkv_strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    stat_strides = (lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1))
    if dk is not None:  # key tiles outer: q and do are read in BLOCK_M rows, k and v once
        _dkdv_kernel[(triton.cdiv(sk, dkdv_cfg["BLOCK_N"]), b * hkv)](
            q, k, v, do, lse, delta, dk, dv, *qkv_strides,
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            *stat_strides, hkv, *scalars, **common, **dkdv_cfg)
    if dq is not None:  # query tiles outer: k and v are read in BLOCK_N rows
        _dq_kernel[(triton.cdiv(sq, dq_cfg["BLOCK_M"]), b * h)](
            q, k, v, do, lse, delta, dq, *qkv_strides, dq.stride(0), dq.stride(1), dq.stride(2),
            *stat_strides, h, *scalars, **common, **dq_cfg,
            LONGEST_FIRST=bool(DQ_LONGEST_FIRST) and causal_offset is not None)
    return dq, dk, dv
