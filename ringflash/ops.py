"""The ring as two ``torch.library`` custom ops, so torch.compile traces it whole.

FlashAttention-3's layering: custom ops (forward, backward) -> their registered autograd
-> the public ``ring_flash_attn`` (api.py). Outside torch.compile, ``ring_attn`` runs the
same implementations through a plain autograd.Function instead, without the ops' dispatch
(``kernels.op.eager``). To the compiler each op is one opaque call
with a fake (meta) implementation giving its output shapes; everything the ring does at
run time -- point-to-point exchanges, the cross-rank agreement check and its host
synchronization, the choice of transport -- happens inside, where it cannot break a
graph. So ``torch.compile(fullgraph=True)`` compiles a function that calls the ring into
one graph, forward and backward, with any backend.

Op arguments are what a schema can carry: tensors and scalars. The process group travels
by name (``group.group_name``, "" for a ring of one without a process group) and is
looked up again inside the op, the layout by name; the masks as segment ids and the
global block mask (optional tensors) and the band of causal and window_size (its two
optional ints, as the kernels' op takes it), dropout as its rate and seed (a Python int:
under torch.compile each new seed value is a new specialization, so pass a fixed seed, or
None outside compiled regions).

The ops are functional (they return new tensors) and tagged ``cudagraph_unsafe``:
inductor's CUDA-graph mode (mode="reduce-overhead") runs them outside its graphs, since
the agreement check is a host-side collective that a graph cannot replay
(docs/integrations.md, "CUDA graphs").
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from . import agreement
from .exchange import PeerRing, Ring, transport
from .ring.plan import schedule_choice
from .groups import group_name as name_of
from .kernels import eager, eager_function, no_double_backward
from .layouts import layout_from_spec
from .ring import fuses, keeps_kv, ring_backward, ring_forward

# Older torch has neither the tag nor custom_op's tags argument.
_TAGS = ({"tags": (torch.Tag.cudagraph_unsafe,)}
         if hasattr(torch.Tag, "cudagraph_unsafe")
         and "tags" in inspect.signature(torch.library.custom_op).parameters else {})


class _RingOfOne(Ring):
    """The ring of a call made without a process group (group name "")."""

    def __init__(self):  # noqa: D107 - no group to look at
        self.group, self.rank, self.world = None, 0, 1


def ring_of(group_name: str) -> Ring:
    """The ring over the process group registered as ``group_name``."""
    if not group_name:
        return _RingOfOne()
    from torch.distributed.distributed_c10d import _resolve_process_group
    return Ring(_resolve_process_group(group_name))


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _agreed_ring(q, k, segments, blocks, band, layout, softmax_scale, dropout, requires_grad,
                 group_name, deterministic: bool = False, spec: bool = False) -> Ring:
    """The ring this call runs on, with its transport, once every rank agrees on the call.

    The agreement check (``agreement.check_ranks_agree``: one all-gather of 22 int64 on the
    host, never waiting for the GPU) runs here, inside the op, on every call of a ring of
    more than one rank unless RINGFLASH_RANK_CHECK=0, and except while a CUDA graph is
    being captured: a graph replays GPU work only, and the eager warm-up iterations that
    every capture of NCCL work needs anyway ran the check on the same calls.
    """
    ring = ring_of(group_name)
    check = ring.world > 1 and agreement.ENABLED and not _capturing(q)
    try:
        kind = transport(ring.group)
        schedule_choice()  # RINGFLASH_SCHEDULE: a bad value fails on every rank, as a bad transport
    except ValueError as error:
        if not check:
            raise
        agreement.check_ranks_agree(ring, None, error)
    if check:
        signature = agreement.signature(q, k, band, layout, softmax_scale, requires_grad, kind, segments,
                                        dropout, blocks, deterministic, spec)
        agreement.check_ranks_agree(ring, signature, None)
    if kind == "peer" and ring.world > 1:
        ring = PeerRing(ring.group)
    return ring


# ----------------------------------------------------------------------------- forward


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             segments: Optional[torch.Tensor], blocks: Optional[torch.Tensor],
             softmax_scale: float, band_lo: Optional[int], band_hi: Optional[int],
             layout: str, layout_spec: Optional[torch.Tensor], group_name: str, dropout_p: float = 0.0, seed: int = 0,
             dropout_head0: int = 0, requires_grad: bool = False,
             deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (B, S, H, D) in q's dtype and lse (B, H, S) fp32 of this rank's queries against
    every rank's keys, and what the backward keeps (``_kept_shapes``; empty tensors when
    nothing). ``requires_grad`` (will a backward follow?) also enters the agreement check:
    a rank that skips the backward would leave the others waiting; so does
    ``deterministic`` (the backward's: it chooses the backward's schedule). ``layout_spec``:
    a layout computed at run time, as a CPU tensor (``layouts.layout_from_spec``)."""
    band, dropout = (band_lo, band_hi), (dropout_p, seed, dropout_head0)
    keep_received = _keeps_received(requires_grad, layout)
    layout = layout_from_spec(layout, layout_spec)
    ring = _agreed_ring(q, k, segments, blocks, band, layout, softmax_scale, dropout, requires_grad,
                        group_name, deterministic, layout_spec is not None)
    keep = blocks is not None and keeps_kv(layout, ring.world, requires_grad, True,
                                           fuses(q, k, segments, blocks, dropout_p, deterministic))
    out, lse, kept = ring_forward(q, k, v, segments, softmax_scale=softmax_scale,
                                  band=band, dropout=dropout, layout=layout, ring=ring, blocks=blocks, keep=keep,
                                  keep_received=keep_received and not isinstance(ring, PeerRing))
    # Nothing kept though asked for (a ring whose shards never travel) still returns the
    # shapes the fake gives, uninitialized.
    kv_shape, seg_shape = _kept_shapes(k, segments, keep)
    kv, seg = (None, None) if kept is None else kept
    return (out, lse, k.new_empty(kv_shape) if kv is None else kv,
            q.new_empty(seg_shape, dtype=torch.int32) if seg is None else seg)


def _keeps_received(requires_grad: bool, layout) -> bool:
    """Whether ``ring_forward`` may keep the K/V rows the direct schedule receives for the
    backward (``ring_forward``'s keep_received: where shards travel cut, which only a layout
    computed from documents does), so that the backward receives none again: where a
    backward follows and the layout came as itself, not by name (eager: a compiled call
    passes a computed layout as its spec, whose rows the fake cannot know), and, the
    caller adds, the messages go through torch.distributed (across nodes under
    RINGFLASH_TRANSPORT=auto), where that second trip is slow beside the kernels; not on
    the copy engines within a node, which carry it beside them at NVLink speed (the
    memory is better left free). The ranks agree on each (the rank check's
    requires_grad, layout given as a spec, and transport)."""
    return requires_grad and not isinstance(layout, str)


def _kept_shapes(k: torch.Tensor, segments: Optional[torch.Tensor], keep: bool) -> tuple:
    """The shapes of the kept K/V (the other rank's, (2, B, S, Hkv, D)) and segment ids
    (both ranks', (B, 2 S)), (0,) where not kept (``ring.keeps_kv``). (Received rows that
    the direct schedule keeps come only in eager calls: ``_keeps_received``.)"""
    b, n, *rest = k.shape
    return (((2, *k.shape) if keep else (0,)),
            ((b, 2 * n) if keep and segments is not None else (0,)))


ring_attn_forward = torch.library.custom_op("ringflash::ring_attn_forward", mutates_args=(),
                                            **_TAGS)(_forward)


@ring_attn_forward.register_fake
def _(q, k, v, segments, blocks, softmax_scale, band_lo, band_hi, layout, layout_spec, group_name, dropout_p=0.0,
      seed=0, dropout_head0=0, requires_grad=False, deterministic=False):
    b, n, h, _ = q.shape
    # a layout given by its spec (documents) never keeps K/V: it takes no block mask
    keep = layout_spec is None and blocks is not None and keeps_kv(
        layout, ring_of(group_name).world, requires_grad, True, fuses(q, k, segments, blocks, dropout_p, deterministic))
    kv, seg = _kept_shapes(k, segments, keep)  # a layout by name keeps no received rows: _keeps_received
    return (q.new_empty(q.shape), q.new_empty((b, h, n), dtype=torch.float32), k.new_empty(kv),
            q.new_empty(seg, dtype=torch.int32))


# ----------------------------------------------------------------------------- backward


def _backward_grads(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                    segments: Optional[torch.Tensor], blocks: Optional[torch.Tensor],
                    kept_kv: torch.Tensor, kept_segments: torch.Tensor,
                    softmax_scale: float, band_lo: Optional[int], band_hi: Optional[int],
                    layout: str, layout_spec: Optional[torch.Tensor], group_name: str, dropout_p: float = 0.0,
                    seed: int = 0, dropout_head0: int = 0,
                    deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """dq (like q) and dK/dV packed as one (2, *k.shape) tensor: an op may not return two
    views of one buffer, which is what the ring's last hop delivers. kept_kv, kept_segments:
    what the forward kept (empty: nothing). The transport is chosen again here, from the
    same RINGFLASH_TRANSPORT as the forward's. deterministic: the same bits run to run."""
    return _backward_into(None, dout, q, k, v, out, lse, dlse, segments, blocks, kept_kv, kept_segments,
                          softmax_scale, band_lo, band_hi, layout, layout_spec, group_name, dropout_p, seed,
                          dropout_head0, deterministic)


def _backward_into(into: Optional[tuple], dout, q, k, v, out, lse, dlse, segments, blocks, kept_kv, kept_segments,
                   softmax_scale, band_lo, band_hi, layout, layout_spec, group_name, dropout_p=0.0, seed=0,
                   dropout_head0=0, deterministic=False) -> tuple[torch.Tensor, torch.Tensor]:
    """``_backward_grads``, its gradients in ``into`` where given: (dq like q, dkv (2,
    *k.shape) in k's dtype), views such as a chunk's heads of larger tensors, which the
    ring writes where it can and copies into elsewhere (``ring_backward``'s into)."""
    ring = ring_of(group_name)
    if ring.world > 1 and transport(ring.group) == "peer":
        ring = PeerRing(ring.group)
    kept = (kept_kv, kept_segments if kept_segments.numel() else None) if kept_kv.numel() else None
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()  # the kernels read any other strides
    grads = ring_backward(dout, q, k, v, out, lse, dlse, segments,
                          softmax_scale=softmax_scale, band=(band_lo, band_hi),
                          dropout=(dropout_p, seed, dropout_head0), layout=layout_from_spec(layout, layout_spec),
                          ring=ring, blocks=blocks, kept=kept, deterministic=deterministic, into=into)
    if into is None:
        return grads
    for dest, got in zip(into, grads):
        if got is not dest:
            dest.copy_(got)
    return into


ring_attn_backward = torch.library.custom_op("ringflash::ring_attn_backward", mutates_args=(),
                                             **_TAGS)(_backward_grads)


@ring_attn_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, segments, blocks, kept_kv, kept_segments, softmax_scale, band_lo, band_hi,
      layout, layout_spec, group_name, dropout_p=0.0, seed=0, dropout_head0=0, deterministic=False):
    return q.new_empty(q.shape), k.new_empty((2, *k.shape))


# ----------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    q, k, v, segments, blocks, scale, band_lo, band_hi, layout, spec, *args, _requires_grad, deterministic = inputs
    out, lse, kept_kv, kept_segments = output
    ctx.save_for_backward(q, k, v, out, lse, segments, blocks, kept_kv, kept_segments, spec)
    ctx.mark_non_differentiable(kept_kv, kept_segments)
    ctx.args = (scale, band_lo, band_hi, layout)
    ctx.rest = (*args, deterministic)  # group_name, dropout (p, seed, head 0), deterministic
    ctx.set_materialize_grads(False)  # an unused lse's gradient stays None, not zeros


def _backward(ctx, dout, dlse, _dkv=None, _dseg=None):
    no_double_backward()
    q, k, v, out, lse, segments, blocks, kept_kv, kept_segments, spec = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout  # only lse was used
    grads = _backward_grads if eager(dout, q) else ring_attn_backward
    dq, dkv = grads(dout, q, k, v, out, lse, dlse, segments, blocks, kept_kv, kept_segments, *ctx.args, spec,
                    *ctx.rest)
    return (dq, dkv[0], dkv[1]) + (None,) * 13


ring_attn_forward.register_autograd(_backward, setup_context=_setup_context)
_RingAttn = eager_function("_RingAttn", _forward, _setup_context, _backward)

# The implementations behind the two ops, for eager callers that run several rings inside an
# autograd Function of their own and order their forwards and backwards themselves
# (ringflash.heads: chunks of heads overlapped with their all-to-alls).
ring_attn_forward_impl, ring_attn_backward_impl = _forward, _backward_into


def ring_attn(q, k, v, segments=None, *, softmax_scale: float, band=(None, None), layout,
              dropout=(0.0, 0), blocks=None, group=None, deterministic: bool = False):
    """Differentiable (out, lse) over the ring of ``group`` (already resolved); arguments
    already checked. What ``ring_flash_attn`` calls once its checks passed. ``layout``: a
    layout name, or a layout computed at run time (``ringflash.document_layout``), which the
    ops take as its kind and spec tensor under torch.compile (one graph for every such
    layout of the same sizes) and as itself in eager mode. ``dropout``: (p, seed) or (p,
    seed, the global index of head 0). ``deterministic``: the backward's bits the same run to
    run (it keeps the Triton kernels where the default would take the Gluon one)."""
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    now = eager(q, k, v)
    forward = _RingAttn.apply if now else ring_attn_forward
    spec = getattr(layout, "spec", None)
    if spec is not None and not now:  # a layout computed at run time, as a graph input
        layout = layout.kind
    else:
        spec = None
    p, seed, *head0 = dropout
    out, lse, *_kept = forward(q, k, v, segments, blocks, softmax_scale, *band, layout, spec, name_of(group),
                               p, seed, head0[0] if head0 else 0, requires_grad, deterministic)
    return out, lse


__all__ = ["ring_attn", "ring_attn_backward", "ring_attn_backward_impl", "ring_attn_forward",
           "ring_attn_forward_impl", "ring_of"]
