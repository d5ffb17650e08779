"""The per-block entry points the ring calls at every step: attention of one (query block,
key block) pair (``flash_attn_fwd``), its gradients (``flash_attn_bwd``) and ``attn_delta``,
on the kernels kernels/dispatch.py chooses: Triton on CUDA tensors (the Gluon backward on
Hopper where it serves the call), the PyTorch twin elsewhere."""

from typing import NamedTuple, Optional

import torch

from . import dispatch
from .masks import BLOCK, NO_MASK, PairMask


def _unit_last(t: torch.Tensor) -> bool:
    """The last dimension is contiguous (a dimension of one element has any stride)."""
    return t.stride(-1) == 1 or t.shape[-1] == 1


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any strides but need the last dimension contiguous."""
    return t if _unit_last(t) else t.contiguous()


def _check_outputs(**tensors) -> None:
    """Destinations the kernels write through strides: the last one must be 1."""
    for name, t in tensors.items():
        if t is not None and not _unit_last(t):
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def _check_partials(accumulate: bool, **pairs) -> None:
    """Each (destination, partial): a partial needs accumulate and the destination's layout."""
    for name, (dest, partial) in pairs.items():
        if partial is None:
            continue
        if not accumulate:
            raise ValueError(f"{name}_partial needs accumulate=True")
        if dest is None or partial.shape != dest.shape or partial.stride() != dest.stride():
            raise ValueError(f"{name}_partial must have {name}'s shape and strides, got "
                             f"{tuple(partial.shape)} / {partial.stride()} for "
                             f"{None if dest is None else (tuple(dest.shape), dest.stride())}")


def _pair_mask(mask: Optional[PairMask], causal_offset: Optional[int]) -> PairMask:
    if causal_offset is None:
        return NO_MASK if mask is None else mask
    if mask is not None:
        raise ValueError("pass either mask or causal_offset, not both")
    return PairMask.causal(causal_offset)


def flash_attn_fwd(q, k, v, *, softmax_scale: float, mask: Optional[PairMask] = None,
                   causal_offset: Optional[int] = None, out: Optional[torch.Tensor] = None,
                   lse: Optional[torch.Tensor] = None, accumulate: bool = False,
                   out_partial: Optional[torch.Tensor] = None, arrival: Optional["Arrival"] = None):
    """Attention of one (query block, key block) pair, returning ``(out, lse)``.

    q (B, Sq, H, D); k, v (B, Sk, Hkv, D); Sq and Sk may differ.
    mask: a ``PairMask`` (band of local indices or global positions, segment ids, dropout,
        block mask), None for no mask.
    causal_offset: shorthand for ``PairMask.causal(o)``: key j is visible to query i iff
        j <= i + o (o = q_start - k_start for two contiguous blocks of one sequence).
    out (B, Sq, H, D), any float dtype, and lse (B, H, Sq) fp32: where to write; allocated
        when None. Views are fine (last dimension contiguous).
    accumulate: out/lse already hold a partial result for the same queries (normalized
        out and its lse; lse = -inf for none yet); the result is its exact merge with this
        block's, written in place. Keep such a running out in fp32.
    out_partial: with accumulate, the running output to merge with when it is not ``out``
        itself (same shape and strides as out): the last of several blocks can read fp32
        sums and write the final out in q's dtype, with no pass of its own.
    k and v may be a ``Joined`` pair (a sequence in two tensors, under a block mask), and
    then ``arrival`` may say that one part comes from another GPU (``Arrival``).
    A row that sees no key has out 0 and lse -inf.
    """
    if accumulate and (out is None or lse is None):
        raise ValueError("accumulate=True needs the running out and lse")
    _check_outputs(out=out, lse=lse)
    _check_partials(accumulate, out=(out, out_partial))
    mask = _pair_mask(mask, causal_offset)
    tail = _tails(dict(k=k, v=v))
    if tail is not None and mask.blocks is None:
        raise ValueError("a sequence Joined from two tensors needs a block mask (the kernels "
                         "list its blocks apart where the parts meet)")
    k, v = (t.first if isinstance(t, Joined) else t for t in (k, v))
    _check_arrival(arrival, tail, q, k)
    b, sq, h, d = q.shape
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if lse is None:
        lse = torch.empty((b, h, sq), device=q.device, dtype=torch.float32)
    dispatch.fwd(_rowmajor(q), _rowmajor(k), _rowmajor(v), out, lse, softmax_scale=softmax_scale, mask=mask,
                 accumulate=accumulate, out_partial=out_partial, tail=tail, arrival=arrival)
    return out, lse


class Arrival(NamedTuple):
    """How ``flash_attn_fwd`` reads a ``Joined`` k, v whose part ``last`` (0: first, 1:
    second) comes from another GPU: that part's keys run after the other's. With
    ``flags``, the part is still on its way, in chunks of ``heads`` K/V heads: flags
    (int32, (Hkv / heads,), on q's device) holds ``epoch`` at [c] once heads
    [c * heads, (c + 1) * heads) have landed (the copy stream writes it after the chunk),
    and each query tile waits inside the kernel for its head's chunk, so the launch starts
    before the trip ends. The writer must not need this GPU's SMs to make progress.
    flags None: the part is there.

    No wait is without an end: a tile whose chunk has not landed within ``timeout``
    seconds (on the GPU's clock, from its first look at the flag) gives up. It writes
    c + 1 into ``status[0]`` (int64; pinned host memory lets the host read it without a
    synchronization: ``exchange.PeerRing`` does), raises every flag to a value past any
    epoch so that the launch's other tiles stop waiting too, and out and lse of the
    tiles that gave up or found the flags so are NaN. status None: NaN is the only trace.
    Flags left raised are the caller's to clear, as after a trip that landed."""

    last: int
    flags: Optional[torch.Tensor] = None
    epoch: int = 0
    heads: int = 1
    timeout: float = 60.0
    status: Optional[torch.Tensor] = None


def _check_arrival(arrival, tail, q, k) -> None:
    if arrival is None:
        return
    if tail is None:
        raise ValueError("arrival is for a Joined k and v")
    if arrival.last not in (0, 1):
        raise ValueError(f"arrival.last must be 0 or 1, got {arrival.last!r}")
    if arrival.flags is None:
        return
    hkv = k.shape[2]
    if not q.is_cuda:
        raise ValueError("arrival.flags: waiting for a part to land needs the Triton kernel (CUDA)")
    if isinstance(arrival.heads, bool) or not isinstance(arrival.heads, int) or arrival.heads < 1 \
            or hkv % arrival.heads:
        raise ValueError(f"arrival.heads must divide the {hkv} K/V heads, got {arrival.heads!r}")
    flags = arrival.flags
    if flags.dtype != torch.int32 or flags.device != q.device or not flags.is_contiguous() \
            or flags.numel() != hkv // arrival.heads:
        raise ValueError(f"arrival.flags must be a contiguous int32 tensor of {hkv // arrival.heads} "
                         f"on {q.device}, got {flags.dtype} {tuple(flags.shape)} on {flags.device}")
    timeout = arrival.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"arrival.timeout must be a positive number of seconds, got {timeout!r}")
    status = arrival.status
    if status is not None and (status.dtype != torch.int64 or status.numel() < 1
                               or not (status.device == q.device or status.is_pinned())):
        raise ValueError(f"arrival.status must be an int64 tensor on {q.device} or in pinned host memory, got "
                         f"{status.dtype} {tuple(status.shape)} on {status.device}")


def attn_delta(out: torch.Tensor, dout: torch.Tensor,
               dlse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """delta = rowsum(dout * out) (B, H, Sq) fp32, from the FINAL out.

    A gradient on lse folds in here: d lse_i / d s_ij = p_ij, which is the same as
    lowering delta_i by dlse_i.
    """
    delta = dispatch.backend(out).delta(_rowmajor(out), _rowmajor(dout))
    if dlse is not None:
        delta = delta - dlse.float()
    return delta


class Joined(NamedTuple):
    """One (B, S1 + S2, H, D) sequence held in two tensors: rows [0, S1) in ``first``, the
    rest in ``second``, of one dtype and device, with the same strides (those of dims of
    size one aside: they are never stepped) and S1 a multiple of 128. ``flash_attn_bwd``
    takes k and v so in a dQ pass (dk = dv = None), q and dout in a dK/dV pass (dq =
    None), under a block mask: a ring of two holds its own shard and the other rank's
    apart, and the kernels read both where they are, without a copy that joins them
    (their block lists are split where the parts meet)."""

    first: torch.Tensor
    second: torch.Tensor


def _tails(pair: dict) -> Optional[tuple]:
    """For two arguments given as ``Joined`` (by name, in ``pair``): their second parts, after
    checking them; None if neither is joined."""
    joined = [isinstance(t, Joined) for t in pair.values()]
    if not any(joined):
        return None
    names = " and ".join(pair)
    if not all(joined):
        raise ValueError(f"{names} must both be Joined or neither")
    for name, (first, second) in pair.items():
        if (first.dtype, first.device) != (second.dtype, second.device):
            raise ValueError(f"{name}: Joined parts must share dtype and device")
        same = first.shape[0] == second.shape[0] and first.shape[2:] == second.shape[2:]
        # the kernels step both parts by the first's strides: those of a dim of one (a batch
        # of one, a one-row second part) are never used
        strides = all(a == b for m, n, a, b in zip(first.shape, second.shape, first.stride(),
                                                   second.stride()) if m > 1 and n > 1)
        if not same or not strides:
            raise ValueError(f"{name}: Joined parts must differ only in rows and share strides, got "
                             f"{tuple(first.shape)} / {first.stride()} and "
                             f"{tuple(second.shape)} / {second.stride()}")
        if first.shape[1] % BLOCK:
            raise ValueError(f"{name}: a Joined first part's rows must be a multiple of {BLOCK}, "
                             f"got {first.shape[1]}")
    if len({t.first.shape[1] for t in pair.values()}) > 1:
        raise ValueError(f"{names}: Joined first parts must have the same rows")
    return tuple(t.second for t in pair.values())


def add_rounded(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a + b, rounded once to out's dtype: fp32 sums finished in one pass (the ring's
    dK/dV: the own shard's sum and the one that came home). (P, m) views, each row
    contiguous; the Triton kernel on CUDA, torch elsewhere."""
    if not (out.shape == a.shape == b.shape and out.dim() == 2):
        raise ValueError(f"add_rounded: out, a and b must be (P, m) views of one shape, got "
                         f"{tuple(out.shape)}, {tuple(a.shape)}, {tuple(b.shape)}")
    if any(t.shape[1] > 1 and t.stride(1) != 1 for t in (out, a, b)):
        raise ValueError("add_rounded: each row of out, a and b must be contiguous")
    dispatch.backend(out).add_rounded(out, a, b)


def flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, *, softmax_scale: float,
                   mask: Optional[PairMask] = None, causal_offset: Optional[int] = None,
                   accumulate: bool = False, dq_partial: Optional[torch.Tensor] = None,
                   dk_partial: Optional[torch.Tensor] = None, dv_partial: Optional[torch.Tensor] = None,
                   deterministic: bool = False, accumulate_dkv: Optional[bool] = None):
    """Gradients of one block pair, written (or, with accumulate, added) into dq, dk, dv.

    dout, q, dq (B, Sq, H, D); k, v, dk, dv (B, Sk, Hkv, D); lse, delta (B, H, Sq) fp32:
    the FINAL lse of these queries over every key block, and ``attn_delta`` of the FINAL
    out. Accumulators should be fp32; views are fine. dq=None skips dQ, and dk=dv=None
    skips dK and dV (they are separate passes, so a caller may run them apart).
    mask / causal_offset: as in ``flash_attn_fwd``.
    dq_partial, dk_partial, dv_partial: with accumulate, the running sum a gradient adds to
        when it is not the gradient itself (same shape and strides), as ``out_partial``.
    q and dout (a dK/dV pass only), or k and v (a dQ pass only), may each be a ``Joined``:
        a sequence in two tensors.
    deterministic: the same bits run to run (kernels/dispatch.py: the Gluon backward's dQ
        adds in arrival order by default; this, or ``torch.use_deterministic_algorithms(True)``,
        makes it add them in a fixed order).
    accumulate_dkv: None (as ``accumulate``), or False with accumulate: dQ is added into
        dq while dK and dV are written (every key row of the pair: zeros where no query
        sees it), so a caller whose dK/dV sums start at this pair need not zero them.
    """
    if (dk is None) != (dv is None):
        raise ValueError("dk and dv are computed together: pass both or neither")
    if accumulate_dkv is not None and not isinstance(accumulate_dkv, bool):
        raise TypeError(f"accumulate_dkv must be a bool or None, got {type(accumulate_dkv).__name__}")
    if accumulate_dkv is not None and accumulate_dkv != accumulate and (not accumulate or dk_partial is not None):
        raise ValueError("accumulate_dkv=False goes with accumulate=True (dQ added, dK/dV written) and "
                         "no dk_partial / dv_partial; accumulate_dkv=True needs accumulate=True")
    add_dkv = accumulate if accumulate_dkv is None else accumulate_dkv
    _check_outputs(lse=lse, delta=delta, dq=dq, dk=dk, dv=dv)
    _check_partials(accumulate, dq=(dq, dq_partial), dk=(dk, dk_partial), dv=(dv, dv_partial))
    mask = _pair_mask(mask, causal_offset)
    q_tails, k_tails = _tails(dict(q=q, dout=dout)), _tails(dict(k=k, v=v))
    if (q_tails or k_tails) and mask.blocks is None:
        raise ValueError("a sequence Joined from two tensors needs a block mask (the kernels "
                         "list its blocks apart where the parts meet)")
    if q_tails is not None and dq is not None:
        raise ValueError("Joined q and dout are for a dK/dV pass: pass dq=None")
    if k_tails is not None and dk is not None:
        raise ValueError("Joined k and v are for a dQ pass: pass dk=dv=None")
    dout, q, k, v = (_rowmajor(t.first if isinstance(t, Joined) else t) for t in (dout, q, k, v))
    partials, tails = (dq_partial, dk_partial, dv_partial), (q_tails, k_tails)
    route = dispatch.bwd_route(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=softmax_scale, mask=mask,
                               accumulate=accumulate, partials=partials, tails=tails, deterministic=deterministic,
                               accumulate_dkv=add_dkv)
    if route.name == dispatch.GLUON:
        dispatch.gluon_bwd(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=softmax_scale, mask=mask,
                           accumulate=accumulate, deterministic=deterministic, accumulate_dkv=add_dkv)
    else:
        if dk is not None and accumulate and not add_dkv:  # the other kernels add all three or none
            dk.zero_()
            dv.zero_()
        dispatch.backend(q).bwd(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=softmax_scale, mask=mask,
                                accumulate=accumulate, partials=partials, tails=tails)
    return dq, dk, dv

