"""Rows of the ring's buffers: which rows a step's pairs cover, contiguous row copies, and
copies run beside the kernels on a side stream."""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import add_rounded
from ..kernels.masks import BLOCK


def _spans(slices, n: int) -> list[range]:
    """The rows of each slice of [0, n), in order of their first row."""
    return sorted((range(n)[part] for part in slices), key=lambda r: r.start)


def uncovered(slices, n: int, within: Optional[range] = None) -> Optional[list[slice]]:
    """The rows of ``within`` (all n rows) that none of ``slices`` (rows inside it) covers,
    as slices; None if two overlap."""
    within = range(n) if within is None else within
    spans = _spans(slices, n)
    if any(a.stop > b.start for a, b in zip(spans, spans[1:])):
        return None
    bounds = zip([within.start] + [r.stop for r in spans], [r.start for r in spans] + [within.stop])
    return [slice(lo, hi) for lo, hi in bounds if lo < hi]


def copy_rows(dst: torch.Tensor, src: torch.Tensor, rows: slice, dim: int) -> None:
    """dst[rows] = src[rows] along ``dim`` (0 where src is None), in contiguous pieces: a
    strided copy or zero_ runs ~3x slower."""
    lead = dst.flatten(0, dim - 1) if dim > 1 else dst
    pieces = lead[:, rows] if dim > 1 else [lead[:, rows]]
    sources = [None] * len(pieces) if src is None else (
        src.flatten(0, dim - 1)[:, rows] if dim > 1 else [src[:, rows]])
    for piece, source in zip(pieces, sources):
        if source is None:
            piece.zero_()
        else:
            piece.copy_(source)


def add_rows(dst: torch.Tensor, src: torch.Tensor, rows: slice, dim: int) -> None:
    """dst[rows] += src[rows] along ``dim``, in contiguous pieces (as ``copy_rows``)."""
    for piece, source in zip(dst.flatten(0, dim - 1)[:, rows], src.flatten(0, dim - 1)[:, rows]):
        piece.add_(source)


def sum_rows(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: slice) -> None:
    """dst[:, :, rows] = a[:, :, rows] + b, rounded once to dst's dtype: packed (2, B, n,
    Hkv, D) dst and a, b holding only those rows (2, B, rows, Hkv, D), contiguous (dst's
    heads may be a view's: then a second pass places them); one pass over the 2 B pieces
    (``kernels.add_rounded``)."""
    def pieces(t: torch.Tensor, part: slice) -> torch.Tensor:
        return t.flatten(0, 1)[:, part].flatten(2)  # (2 B, rows, Hkv D): rows x Hkv D contiguous

    out, first = pieces(dst, rows), pieces(a, rows)
    if out[0].is_contiguous():
        add_rounded(out.flatten(1), first.flatten(1), b.flatten(0, 1).flatten(1))
    else:  # dst's rows are some heads of wider rows (``ring_backward``'s into): rounded, then placed
        whole = torch.empty(out.shape, device=out.device, dtype=out.dtype)
        add_rounded(whole.flatten(1), first.flatten(1), b.flatten(0, 1).flatten(1))
        out.copy_(whole)


def home_cuts(n: int) -> tuple[int, ...]:
    """Where a ring of two cuts its dK/dV passes and the trip home: at the multiple of BLOCK
    nearest half the rank's n rows (not below 2 BLOCK rows)."""
    half = round(n / 2 / BLOCK) * BLOCK
    return (half,) if BLOCK <= half <= n - BLOCK else ()


def key_rows(send: torch.Tensor, recv: torch.Tensor, rows: range) -> list:
    """(send, recv) message pairs of key rows ``rows`` of two packed (2, B, n, H, D)
    buffers: one contiguous piece for each of dk, dv and each batch row."""
    return [(s[rows.start:rows.stop], r[rows.start:rows.stop])
            for s, r in zip(send.flatten(0, 1), recv.flatten(0, 1))]


def rows_of(rows: range, start: int = 0) -> slice:
    """``rows`` as a slice of a tensor whose first row is ``start``."""
    return slice(rows.start - start, rows.stop - start)


def overlap(a: range, b: range) -> range:
    """The rows two ranges share (an empty range if none)."""
    return range(max(a.start, b.start), max(min(a.stop, b.stop), max(a.start, b.start)))


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


class Aside:
    """Copies that run beside the kernels, on a side stream of the device that starts once
    the work queued so far is done; ``join`` makes the current stream wait for them (and
    does nothing if none was made: under CUDA graph capture, waiting on a stream the
    capture never forked into is an error). On the CPU, at once."""

    def __init__(self, device: torch.device):
        self.device, self.stream = device, None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.device.type != "cuda":
            dst.copy_(src)
            return
        if self.stream is None:
            if self.device.index not in _SIDE_STREAMS:
                _SIDE_STREAMS[self.device.index] = torch.cuda.Stream(self.device, priority=-1)
            self.stream = _SIDE_STREAMS[self.device.index]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            dst.copy_(src)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
