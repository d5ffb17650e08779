"""Host side of the Triton kernels: what a launch passes for a ``PairMask`` and a block
mask, and the launchers ``fwd``, ``bwd`` and ``delta`` (the backend interface that
``kernels/pair.py`` calls; ``kernels/reference.py`` is its PyTorch twin).

Layouts: q, o, do (B, Sq, H, D); k, v, dk, dv (B, Sk, Hkv, D), H a multiple of Hkv;
lse, delta (B, H, Sq). Any of them may be a strided view (last dim contiguous).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import dropout
from ..masks import BAND_INF
from . import config
from .bwd import _delta_kernel, _dkdv_kernel, _dq_kernel
from .fwd import _fwd_kernel
from .segments import _ranges

LOG2E = math.log2(math.e)


def _source(t: torch.Tensor, block_rows: int, head_dim_block: int, tma: bool):
    """What the kernels read a (B, S, H, D) tensor through: a descriptor of
    (1, block_rows, 1, head_dim_block) boxes, or the tensor itself (a pointer)."""
    if not tma:
        return t
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_rows, 1, head_dim_block])



def _or(partial, dest):
    """The running sum an accumulating launch reads: ``partial``, or ``dest`` itself."""
    return dest if partial is None else partial


_STAND_INS: dict = {}


def _stand_in(device: torch.device) -> torch.Tensor:
    """A one-element int32 tensor for the pointer arguments of a feature a launch leaves
    off (segment ids, block lists): never read, so one per device is made and kept. A
    fresh one per launch cost an allocation and a fill kernel each, six to twelve in a
    ring of two's forward+backward (benchmarks/NOTES.md, "The ring of two at 32k": the
    launches' host time 1.62 -> 1.35-1.44 ms a call)."""
    if device not in _STAND_INS:
        _STAND_INS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _STAND_INS[device]


def _mask_args(mask, device: torch.device):
    """Kernel arguments of a PairMask: (band_lo, band_hi, qseg, kseg, BAND, SEGMENTS) and the
    dropout arguments (seed, threshold, scale, q_pos0, k_pos0, stride, jump, DROPOUT, GROUPED),
    whose positions a band on positions reads too. Without segments, the segment pointers
    are a one-element stand-in."""
    band = mask.band_lo is not None or mask.band_hi is not None
    lo = -BAND_INF if mask.band_lo is None else mask.band_lo
    hi = BAND_INF if mask.band_hi is None else mask.band_hi
    positions = mask.pos if mask.dropout_p > 0 or mask.band_on_positions else (0, 0, 1, 0)
    if mask.dropout_p > 0:
        q_pos0, k_pos0, stride, jump = positions
        grouped = stride == 1 and q_pos0 % 16 == 0 and k_pos0 % 32 == 0 and jump % 32 == 0
        drop = (mask.seed, dropout.threshold(mask.dropout_p), dropout.keep_scale(mask.dropout_p),
                *positions, True, grouped)
    else:
        drop = (0, 0, 1.0, *positions, False, False)
    if mask.q_segments is None:
        return (lo, hi, _stand_in(device), _stand_in(device), band, False), drop
    return (lo, hi, mask.q_segments, mask.k_segments, band, True), drop


def _sparse_args(mask, lo: int, hi: int, n_rows: int, n_cols: int, transpose: bool, device,
                 grid: tuple[int, int, int, int], reverse: bool = False, split: Optional[int] = None,
                 chunk: int = 0):
    """Kernel arguments of a block mask for one kernel: (counts, indices, program order,
    counts' plane stride, head stride of the lists, index row length) and SPARSE. Rows are
    queries (forward, dQ) or, with transpose, keys (dK/dV, band negated). ``grid`` is the
    launch's (tile rows, batch, heads, list heads a program loops over), ``reverse`` its
    tiles' natural order reversed, ``chunk`` the heads of a chunk the programs run in
    order of (``masks.program_order``); ``split``: the column where the columns' second
    part starts (lists split there), or None."""
    if mask.blocks is None:
        return (_stand_in(device), _stand_in(device), _stand_in(device), 0, 0, 0), False
    if mask.band_on_positions:
        raise ValueError("a block mask cannot be combined with a band on positions")
    counts, index = mask.blocks.lists(lo, hi, n_rows, n_cols, transpose, split)
    order = mask.blocks.order(lo, hi, n_rows, n_cols, transpose, *grid, reverse, chunk)
    heads, n_row_blocks, n_col_blocks = index.shape
    return (counts, index, order, counts.stride(0), n_row_blocks if heads > 1 else 0,
            n_col_blocks), True



def fwd(q, k, v, out, lse, *, softmax_scale: float, mask, accumulate: bool, out_partial=None,
        tail=None, arrival=None):
    """``tail``: the keys' and values' rows that follow k and v when held apart
    (``pair.Joined``, under a block mask), or None; ``arrival``: with a tail, an
    ``pair.Arrival`` (which part runs last, and whether the kernel waits for it)."""
    b, sq, h, d = q.shape
    split, hkv = k.shape[1], k.shape[2]
    sk = split + (0 if tail is None else tail[0].shape[1])
    k2, v2 = tail or (k, v)  # stand-ins if whole
    cfg = config.fwd_config(d, q.dtype)
    bd = config.block_d(d)
    tma = config.use_tma(q, k, v, k2, v2)
    (lo, hi, qseg, kseg, band, segments), drop = _mask_args(mask, q.device)
    ranges = _ranges(qseg, kseg, segments)
    wait = arrival is not None and arrival.flags is not None
    chunk = arrival.heads if wait else hkv
    (counts, index, order, *sparse_strides), sparse = _sparse_args(
        mask, lo, hi, sq, sk, False, q.device, (cfg["BLOCK_M"], b, h, 1), band,
        split=None if tail is None else split, chunk=chunk * (h // hkv) if wait else 0)
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]), b * h)
    _fwd_kernel[grid](
        _source(q, cfg["BLOCK_M"], bd, tma), _source(k, cfg["BLOCK_N"], bd, tma),
        _source(v, cfg["BLOCK_N"], bd, tma), out, _or(out_partial, out), lse, kseg, ranges, counts,
        index, order,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), kseg.stride(0), ranges.stride(0), ranges.stride(1),
        h, h // hkv, sq, sk, softmax_scale * LOG2E, lo, hi, *drop[:7], *sparse_strides,
        _source(k2, cfg["BLOCK_N"], bd, tma), _source(v2, cfg["BLOCK_N"], bd, tma), split,
        arrival.flags if wait else _stand_in(q.device), arrival.epoch if wait else 0, chunk,
        HEAD_DIM=d, BLOCK_D=bd, BAND=band, SEGMENTS=segments, DROPOUT=drop[7], GROUPED=drop[8],
        SPARSE=sparse, LIST_STAGES=config.list_stages(cfg, sparse, segments), ACCUMULATE=accumulate,
        PRECISION=config.dot_precision(q.dtype), TMA=tma, POSITIONAL=mask.band_on_positions,
        PARTS=1 if tail is None else 2, LAST=1 if arrival is None else arrival.last, WAIT=wait,
        **cfg)
    return out, lse




def delta(out: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """rowsum(do * out) in fp32, (B, H, S), in one pass over the two (B, S, H, D) tensors
    (last dimension contiguous); the twin's fp32 products take three more."""
    b, s, h, d = out.shape
    res = torch.empty((b, h, s), device=out.device, dtype=torch.float32)
    block_s = 16 if config.interpreting() else 64
    _delta_kernel[(triton.cdiv(s, block_s), b * h)](
        out, do, res, s, h, out.stride(0), out.stride(1), out.stride(2), do.stride(0), do.stride(1),
        do.stride(2), res.stride(0), res.stride(1), HEAD_DIM=d, BLOCK_D=config.block_d(d), BLOCK_S=block_s)
    return res



def bwd(do, q, k, v, lse, delta, dq, dk, dv, *, softmax_scale: float, mask, accumulate: bool,
        partials=(None, None, None), tails=(None, None)):
    """dq (skipped when None) and dk, dv (skipped when None): two kernels, so a caller can
    run them apart. The backward reads through pointers: TMA descriptors measured slower
    here (benchmarks/NOTES.md). ``tails``: the rows that follow (q, do) and (k, v) when
    held apart (``pair.Joined``: same strides, under a block mask), or None; the
    kernels read both parts where they are."""
    b, h, d = q.shape[0], q.shape[2], q.shape[3]
    hkv = k.shape[2]
    (q_split, sq), (k_split, sk) = ((t.shape[1], t.shape[1] + (0 if tail is None else tail[0].shape[1]))
                                    for t, tail in zip((q, k), tails))
    q_tails, k_tails = (tail or t for t, tail in zip(((q, do), (k, v)), tails))  # stand-ins if whole
    (lo, hi, qseg, kseg, band, segments), drop = _mask_args(mask, q.device)
    sparse = mask.blocks is not None
    dkdv_cfg, dq_cfg = config.bwd_config(d, q.dtype, sparse, drop[7] and not (band or segments or sparse))
    common = dict(HEAD_DIM=d, BLOCK_D=config.block_d(d), BAND=band, SEGMENTS=segments, DROPOUT=drop[7],
                  GROUPED=drop[8], SPARSE=sparse, ACCUMULATE=accumulate,
                  PRECISION=config.dot_precision(q.dtype), POSITIONAL=mask.band_on_positions)
    scalars = (h // hkv, sq, sk, softmax_scale * LOG2E, softmax_scale, lo, hi, *drop[:7])
    qkv_strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    stat_strides = (lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1))
    if dk is not None:  # key tiles outer: q and do are read in BLOCK_M rows, k and v once
        ranges = _ranges(kseg, qseg, segments)
        (counts, index, order, *sparse_strides), _ = _sparse_args(
            mask, lo, hi, sk, sq, True, q.device, (dkdv_cfg["BLOCK_N"], b, hkv, h // hkv),
            split=None if tails[0] is None else q_split)
        _dkdv_kernel[(triton.cdiv(sk, dkdv_cfg["BLOCK_N"]), b * hkv)](
            q, k, v, do, lse, delta, dk, dv, _or(partials[1], dk), _or(partials[2], dv), ranges,
            counts, index, order, *qkv_strides,
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            *stat_strides, ranges.stride(0), ranges.stride(1), hkv, *scalars, *sparse_strides,
            *q_tails, q_split, LIST_STAGES=config.list_stages(dkdv_cfg, common["SPARSE"]),
            PARTS=1 if tails[0] is None else 2, **common, **dkdv_cfg)
    if dq is not None:  # query tiles outer: k and v are read in BLOCK_N rows
        ranges = _ranges(qseg, kseg, segments)
        (counts, index, order, *sparse_strides), _ = _sparse_args(
            mask, lo, hi, sq, sk, False, q.device, (dq_cfg["BLOCK_M"], b, h, 1), band,
            split=None if tails[1] is None else k_split)
        _dq_kernel[(triton.cdiv(sq, dq_cfg["BLOCK_M"]), b * h)](
            q, k, v, do, lse, delta, dq, _or(partials[0], dq), kseg, ranges, counts, index, order,
            *qkv_strides,
            dq.stride(0), dq.stride(1), dq.stride(2), *stat_strides, kseg.stride(0),
            ranges.stride(0), ranges.stride(1), h,
            *scalars, *sparse_strides, *k_tails, k_split,
            LIST_STAGES=config.list_stages(dq_cfg, common["SPARSE"], segments),
            PARTS=1 if tails[1] is None else 2, **common, **dq_cfg)
    return dq, dk, dv
