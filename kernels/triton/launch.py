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
from .tiles import QKV, Band, Dropout, Lists, Positions, Rows, Segments, Shape, Stats, Strides, Tail, Variant, Wait

LOG2E = math.log2(math.e)


_INT32 = 2 ** 31
_TILE_ROWS = 256  # the most rows a kernel's tile of a (B, S, H, D) tensor holds (config)


def _check_offsets(**tensors) -> bool:
    """Whether the launch needs 64-bit offsets (``Variant.LONG``): a tensor spans 2**31
    elements or more (its last element's offset). The kernels address a tile by an offset
    of its first element (64-bit then) plus 32-bit offsets inside it (``tiles._tile_ptrs``),
    so a tensor may span any number of elements, but the _TILE_ROWS rows of one tile must
    span fewer than 2**31 (a row stride below 2**23, which only a strided view with
    millions of elements between rows reaches; a stride of 2**31 or more is passed 64-bit
    and fits again). Rows, positions and the offsets of segment ids are 32-bit: fewer than
    2**31 rows in all the batch. A (B, S, H, D) tensor outside these raises, naming it."""
    long = False
    for name, t in tensors.items():
        if t is None:
            continue
        long = long or sum((n - 1) * st for n, st in zip(t.shape, t.stride())) >= _INT32
        if t.dim() == 4 and (t.shape[0] * t.shape[1] >= _INT32 or _INT32 // _TILE_ROWS <= t.stride(1) < _INT32):
            raise ValueError(f"{name} (shape {tuple(t.shape)}, strides {t.stride()}): the Triton kernels need "
                             f"fewer than 2**31 rows in all the batch and a row stride below 2**23 "
                             f"elements; pass a contiguous tensor")
    return long


def _rows(t: torch.Tensor) -> Rows:
    """A (B, S, H, D) tensor as the kernels read it through a pointer, with its strides."""
    return Rows(t, t.stride(0), t.stride(1), t.stride(2))


def _stats(t: torch.Tensor) -> Stats:
    return Stats(t, t.stride(0), t.stride(1))


def _strides(t: torch.Tensor) -> Strides:
    return Strides(t.stride(0), t.stride(1), t.stride(2))


def _source(t: torch.Tensor, block_rows: int, head_dim_block: int, tma: bool):
    """What the forward reads a (B, S, H, D) tensor through: a descriptor of
    (1, block_rows, 1, head_dim_block) boxes, or the tensor itself (a pointer)."""
    if not tma:
        return t
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_rows, 1, head_dim_block])


def _or(partial, dest):
    """The running sum an accumulating launch reads: ``partial``, or ``dest`` itself."""
    return dest if partial is None else partial


_STAND_INS: dict = {}


def _stand_in(device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A one-element tensor for the pointer arguments of a feature a launch leaves off
    (segment ids, block lists; int64: the status word of a wait, ``_wait``): never read,
    so one per device and dtype is made and kept. A fresh one per launch cost an
    allocation and a fill kernel each, six to twelve in a ring of two's forward+backward
    (docs/notes/ring-of-two.md, "The ring of two at 32k: the trace, what a split launch
    costs, the host's time": the launches' host time 1.62 -> 1.35-1.44 ms a call)."""
    if (device, dtype) not in _STAND_INS:
        _STAND_INS[device, dtype] = torch.zeros(1, dtype=dtype, device=device)
    return _STAND_INS[device, dtype]


def _wait(arrival, chunk: int, device: torch.device) -> Wait:
    """The forward's ``Wait`` for a ``pair.Arrival`` with flags, or stand-ins (never read)
    for a launch that does not wait. Without a status tensor of the caller's, a tile that
    gives up writes into a stand-in: its NaN output is then the only trace."""
    if arrival is None or arrival.flags is None:
        return Wait(_stand_in(device), 0, chunk, 0.0, _stand_in(device, torch.int64))
    status = arrival.status if arrival.status is not None else _stand_in(device, torch.int64)
    return Wait(arrival.flags, arrival.epoch, chunk, float(arrival.timeout) * 1e9, status)


def _band(mask) -> Band:
    return Band(-BAND_INF if mask.band_lo is None else mask.band_lo, BAND_INF if mask.band_hi is None else mask.band_hi)


def _positions(mask) -> Positions:
    """The pair's global positions, read by dropout and by a band on positions."""
    return Positions(*(mask.pos if mask.dropout_p > 0 or mask.band_on_positions else (0, 0, 1, 0)))


def _dropout(mask) -> Dropout:
    if mask.dropout_p == 0:
        return Dropout(0, 0, 1.0, 0)
    return Dropout(mask.seed, dropout.threshold(mask.dropout_p), dropout.keep_scale(mask.dropout_p),
                   mask.dropout_head0)


def _variant(mask, pos: Positions, accumulate: bool, list_stages=None, parts: int = 1, last: int = 1,
             wait: bool = False, long: bool = False) -> Variant:
    """What a launch over ``mask`` compiles for (``tiles.Variant``)."""
    grouped = pos.stride == 1 and pos.q0 % 16 == 0 and pos.k0 % 32 == 0 and pos.jump % 32 == 0
    return Variant(BAND=mask.band_lo is not None or mask.band_hi is not None, POSITIONAL=mask.band_on_positions,
                   SEGMENTS=mask.q_segments is not None, DROPOUT=mask.dropout_p > 0,
                   GROUPED=mask.dropout_p > 0 and grouped, SPARSE=mask.blocks is not None,
                   LIST_STAGES=list_stages, PARTS=parts, LAST=last, WAIT=wait, ACCUMULATE=accumulate, LONG=long)


def _segment_ids(mask, device: torch.device):
    """(query ids, key ids), one-element stand-ins without segments."""
    if mask.q_segments is None:
        return _stand_in(device), _stand_in(device)
    return mask.q_segments, mask.k_segments


def _segments(rows_seg: torch.Tensor, cols_seg: torch.Tensor, on: bool) -> Segments:
    """The ``Segments`` of a kernel whose rows carry ``rows_seg`` and columns ``cols_seg``."""
    ranges = _ranges(rows_seg, cols_seg, on)
    return Segments(cols_seg, cols_seg.stride(0), ranges, ranges.stride(0), ranges.stride(1))


def _lists(mask, band: Band, n_rows: int, n_cols: int, transpose: bool, device, grid: tuple[int, int, int, int],
           reverse: bool = False, split: Optional[int] = None, chunk: int = 0) -> Lists:
    """A block mask's ``Lists`` for one kernel (stand-ins without one). Rows are queries
    (forward, dQ) or, with transpose, keys (dK/dV, band negated). ``grid`` is the launch's
    (tile rows, batch, heads, list heads a program loops over), ``reverse`` its tiles'
    natural order reversed, ``chunk`` the heads of a chunk the programs run in order of
    (``masks.program_order``); ``split``: the column where the columns' second part starts
    (lists split there), or None."""
    if mask.blocks is None:
        return Lists(_stand_in(device), _stand_in(device), _stand_in(device), 0, 0, 0)
    if mask.band_on_positions:
        raise ValueError("a block mask cannot be combined with a band on positions")
    counts, index = mask.blocks.lists(band.lo, band.hi, n_rows, n_cols, transpose, split)
    order = mask.blocks.order(band.lo, band.hi, n_rows, n_cols, transpose, *grid, reverse, chunk)
    heads, n_row_blocks, n_col_blocks = index.shape
    return Lists(counts, index, order, counts.stride(0), n_row_blocks if heads > 1 else 0, n_col_blocks)


def fwd(q, k, v, out, lse, *, softmax_scale: float, mask, accumulate: bool, out_partial=None,
        tail=None, arrival=None):
    """``tail``: the keys' and values' rows that follow k and v when held apart
    (``pair.Joined``, under a block mask), or None; ``arrival``: with a tail, a
    ``pair.Arrival`` (which part runs last, and whether the kernel waits for it, for how
    long, and where a tile that gives up records it)."""
    long = _check_offsets(q=q, k=k, v=v, out=out, lse=lse, out_partial=out_partial,
                          **dict(zip(("k_tail", "v_tail"), tail or ())))
    b, sq, h, d = q.shape
    split, hkv = k.shape[1], k.shape[2]
    sk = split + (0 if tail is None else tail[0].shape[1])
    cfg = config.fwd_config(d, q.dtype)
    bd = config.block_d(d)
    tma = config.use_tma(q, k, v, *(tail or ()))
    band, pos = _band(mask), _positions(mask)
    qseg, kseg = _segment_ids(mask, q.device)
    segments = _segments(qseg, kseg, mask.q_segments is not None)
    waits = arrival is not None and arrival.flags is not None
    chunk = arrival.heads if waits else hkv
    variant = _variant(mask, pos, accumulate,
                       config.list_stages(cfg, mask.blocks is not None, mask.q_segments is not None),
                       1 if tail is None else 2, 1 if arrival is None else arrival.last, waits,
                       long)
    lists = _lists(mask, band, sq, sk, False, q.device, (cfg["BLOCK_M"], b, h, 1), variant.BAND,
                   split=None if tail is None else split, chunk=chunk * (h // hkv) if waits else 0)
    wait = _wait(arrival, chunk, q.device)
    keys = [_source(t, cfg["BLOCK_N"], bd, tma) for t in (k, v, *(tail or ()))]
    _fwd_kernel[(triton.cdiv(sq, cfg["BLOCK_M"]), b * h)](
        Q=_source(q, cfg["BLOCK_M"], bd, tma), K=keys[0], V=keys[1], K2=keys[-2], V2=keys[-1],
        strides=QKV(_strides(q), _strides(k), _strides(v)), o=_rows(out), o_in=_or(out_partial, out),
        lse=_stats(lse), shape=Shape(h, h // hkv, sq, sk), qk_scale=softmax_scale * LOG2E, band=band, pos=pos,
        segments=segments, drop=_dropout(mask), lists=lists, tail=Tail(None, None, split), wait=wait,
        VARIANT=variant, HEAD_DIM=d, BLOCK_D=bd, PRECISION=config.dot_precision(q.dtype), TMA=tma, **cfg)
    return out, lse


def delta(out: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """rowsum(do * out) in fp32, (B, H, S), in one pass over the two (B, S, H, D) tensors
    (last dimension contiguous); the twin's fp32 products take three more."""
    long = _check_offsets(out=out, dout=do)
    b, s, h, d = out.shape
    res = torch.empty((b, h, s), device=out.device, dtype=torch.float32)
    block_s = 16 if config.interpreting() else 64
    _delta_kernel[(triton.cdiv(s, block_s), b * h)](
        o=_rows(out), do=_rows(do), delta=_stats(res), seqlen=s, heads=h, HEAD_DIM=d, BLOCK_D=config.block_d(d),
        BLOCK_S=block_s, LONG=long or _check_offsets(delta=res))
    return res


def bwd(do, q, k, v, lse, delta, dq, dk, dv, *, softmax_scale: float, mask, accumulate: bool,
        partials=(None, None, None), tails=(None, None)):
    """dq (skipped when None) and dk, dv (skipped when None): two kernels, so a caller can
    run them apart. The backward reads through pointers: TMA descriptors measured slower
    here (docs/notes/kernel.md). ``tails``: the rows that follow (q, do) and (k, v) when
    held apart (``pair.Joined``: same strides, under a block mask), or None; the
    kernels read both parts where they are."""
    held_apart = {f"{name}_tail": t for tail, names in zip(tails, (("q", "dout"), ("k", "v")))
                  for name, t in zip(names, tail or ())}
    long = _check_offsets(dout=do, q=q, k=k, v=v, dq=dq, dk=dk, dv=dv, lse=lse, delta=delta,
                          **dict(zip(("dq_in", "dk_in", "dv_in"), partials)), **held_apart)
    b, h, d = q.shape[0], q.shape[2], q.shape[3]
    hkv = k.shape[2]
    (q_split, sq), (k_split, sk) = ((t.shape[1], t.shape[1] + (0 if tail is None else tail[0].shape[1]))
                                    for t, tail in zip((q, k), tails))
    band, pos = _band(mask), _positions(mask)
    qseg, kseg = _segment_ids(mask, q.device)
    has_segments, sparse = mask.q_segments is not None, mask.blocks is not None
    plain = _variant(mask, pos, accumulate, long=long)
    dkdv_cfg, dq_cfg = config.bwd_config(d, q.dtype, sparse, plain.DROPOUT and not (plain.BAND or has_segments or sparse))
    inputs = dict(q=_rows(q), k=_rows(k), v=_rows(v), do=_rows(do), lse=_stats(lse), delta=_stats(delta),
                  qk_scale=softmax_scale * LOG2E, sm_scale=softmax_scale, band=band, pos=pos, drop=_dropout(mask),
                  HEAD_DIM=d, BLOCK_D=config.block_d(d), PRECISION=config.dot_precision(q.dtype))

    def parts(tail, whole: tuple, split: int) -> Tail:  # the whole tensors stand in for no tail
        return Tail(*(tail or whole), split)

    if dk is not None:  # key tiles outer: q and do are read in BLOCK_M rows, k and v once
        lists = _lists(mask, band, sk, sq, True, q.device, (dkdv_cfg["BLOCK_N"], b, hkv, h // hkv),
                       split=None if tails[0] is None else q_split)
        variant = plain._replace(LIST_STAGES=config.list_stages(dkdv_cfg, sparse),
                                 PARTS=1 if tails[0] is None else 2,
                                 QUERY_MAJOR=dkdv_cfg.get("QUERY_MAJOR", False))
        tiles = {name: value for name, value in dkdv_cfg.items() if name != "QUERY_MAJOR"}
        _dkdv_kernel[(triton.cdiv(sk, dkdv_cfg["BLOCK_N"]), b * hkv)](
            dk=_rows(dk), dv=_rows(dv), dk_in=_or(partials[1], dk), dv_in=_or(partials[2], dv),
            shape=Shape(hkv, h // hkv, sq, sk), segments=_segments(kseg, qseg, has_segments), lists=lists,
            tail=parts(tails[0], (q, do), q_split), VARIANT=variant, **inputs, **tiles)
    if dq is not None:  # query tiles outer: k and v are read in BLOCK_N rows
        lists = _lists(mask, band, sq, sk, False, q.device, (dq_cfg["BLOCK_M"], b, h, 1), plain.BAND,
                       split=None if tails[1] is None else k_split)
        variant = plain._replace(LIST_STAGES=config.list_stages(dq_cfg, sparse, has_segments),
                                 PARTS=1 if tails[1] is None else 2)
        _dq_kernel[(triton.cdiv(sq, dq_cfg["BLOCK_M"]), b * h)](
            dq=_rows(dq), dq_in=_or(partials[0], dq), shape=Shape(h, h // hkv, sq, sk),
            segments=_segments(qseg, kseg, has_segments), lists=lists, tail=parts(tails[1], (k, v), k_split),
            VARIANT=variant, **inputs, **dq_cfg)
    return dq, dk, dv
