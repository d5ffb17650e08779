"""Public functions of the distributed layer, and their argument checks."""

from __future__ import annotations

import os
import struct

import torch
import torch.distributed as dist

from .exchange import TRANSPORTS, PeerRing, Ring, transport
from .kernels import SUPPORTED_DTYPES, check_causal, check_qkv, resolve_scale
from .layouts import LAYOUTS, check_layout, check_seqlen, global_positions, split_factor
from .ring import RingAttention

# Set RINGFLASH_RANK_CHECK=0 to skip the cross-rank agreement check (see _check_ranks_agree);
# read once, at import. Without it nothing compares the ranks' arguments: ranks that disagree
# on a shape fail inside the exchange with the backend's error (gloo aborts: "Received data
# size doesn't match expected size"; NCCL may hang until the group's timeout), and ranks
# that disagree on causal, layout or softmax_scale return wrong results with no error.
_RANK_CHECK = os.environ.get("RINGFLASH_RANK_CHECK", "1") != "0"


_SIGNATURE_FIELDS = ("batch", "seqlen_local", "heads", "head_dim", "kv_heads", "dtype", "causal",
                     "layout", "softmax_scale", "requires_grad", "transport")


def _signature(q, k, causal, layout, scale, needs_grad, kind) -> list[int]:
    """A few integers that every rank of the ring must agree on."""
    scale_bits = struct.unpack("<q", struct.pack("<d", scale))[0]
    return [*q.shape, k.shape[2], SUPPORTED_DTYPES.index(q.dtype), int(causal),
            LAYOUTS.index(layout), scale_bits, int(needs_grad), TRANSPORTS.index(kind)]


def _shown(field: str, values) -> list:
    if field == "softmax_scale":
        return [struct.unpack("<d", struct.pack("<q", x))[0] for x in values]
    if field == "dtype":
        return [str(SUPPORTED_DTYPES[x]) for x in values]
    if field == "layout":
        return [LAYOUTS[x] for x in values]
    if field == "transport":
        return [TRANSPORTS[x] for x in values]
    return list(values)


def _check_ranks_agree(ring: Ring, signature: list[int] | None, error: Exception | None,
                       device: torch.device) -> None:
    """Raise on every rank if any rank rejected its arguments or the ranks disagree.

    ``signature`` is None on a rank whose own checks failed with ``error``: it still joins
    the all-gather, so the other ranks learn of it instead of waiting in the ring.
    Costs one all-gather of 12 int64 and one host synchronization per call. It runs on
    every call rather than once per signature: a rank that skipped it because its own
    signature was cached, while another rank's changed, would leave that rank waiting in a
    collective nobody else joins.
    """
    mine = [1, *signature] if signature is not None else [0] * (1 + len(_SIGNATURE_FIELDS))
    everyone = ring.all_gather_ints(mine, device)
    rejected = [rank for rank, row in enumerate(everyone) if row[0] == 0]
    if error is not None:
        raise error
    if rejected:
        raise ValueError(f"rank(s) {rejected} of the ring rejected their arguments to ring_flash_attn "
                         "(see the error raised there); every rank must pass valid, matching arguments")
    for field, values in zip(_SIGNATURE_FIELDS, list(zip(*everyone))[1:]):
        if len(set(values)) > 1:
            raise ValueError(f"ranks disagree on {field}: {_shown(field, values)} (rank i's value at "
                             "index i); every rank must call ring_flash_attn with the same arguments and shapes")


def _check_local(q, k, v, causal, layout, softmax_scale):
    check_qkv(q, k, v)
    causal = check_causal(causal)
    layout = check_layout(layout)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold the same number of local tokens, got {q.shape[1]} and {k.shape[1]}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout 'zigzag' needs an even seqlen_local (two chunks a rank), got {q.shape[1]}")
    return causal, layout, scale


def ring_flash_attn(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                    group=None, layout: str = "contiguous", return_lse: bool = False):
    """Exact attention of this rank's queries over the keys of every rank in ``group``.

    Args:
        q: (batch, seqlen_local, heads, head_dim), this rank's shard of the queries.
        k, v: (batch, seqlen_local, kv_heads, head_dim), this rank's shards; heads a
            multiple of kv_heads. Same shapes and dtype (fp16, bf16, fp32) on every rank.
        causal: causal mask on GLOBAL positions, as given by ``layout``.
        softmax_scale: a positive float; defaults to head_dim ** -0.5.
        group: the process group forming the ring (default: the world; without an
            initialized process group, a ring of one).
        layout: how the global sequence is split ("contiguous", "zigzag", "stripe"; see
            ``shard``). It only matters with causal=True.
        return_lse: also return lse.

    Returns:
        out (batch, seqlen_local, heads, head_dim) in q's dtype: rows of
        softmax(q K^T * scale) V over the whole sequence; with return_lse also
        lse (batch, heads, seqlen_local), fp32, natural log. Both are differentiable
        in q, k and v.

    Invalid arguments raise ValueError/TypeError on every rank of the ring, including
    ranks whose own arguments were fine (see ``_check_ranks_agree`` for the cost).
    """
    ring = Ring(group)
    check_everywhere = ring.world > 1 and _RANK_CHECK
    try:
        causal, layout, scale = _check_local(q, k, v, causal, layout, softmax_scale)
        kind = transport(ring.group)
    except (TypeError, ValueError) as error:
        if not check_everywhere:
            raise
        device = q.device if isinstance(q, torch.Tensor) and q.is_cuda else ring.collective_device()
        _check_ranks_agree(ring, None, error, device)
    if check_everywhere:
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        signature = _signature(q, k, causal, layout, scale, needs_grad, kind)
        _check_ranks_agree(ring, signature, None, q.device)
    if kind == "peer" and ring.world > 1:
        ring = PeerRing(ring.group)
    out, lse = RingAttention.apply(q, k, v, scale, causal, layout, ring)
    return (out, lse) if return_lse else out


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}), got {dim!r}")
    return dim % x.dim()


def positions(seqlen: int, layout: str = "contiguous", group=None, *, device=None) -> torch.Tensor:
    """Global token ids of this rank's tokens, in local order (int64, (seqlen // W,)).

    For rotary embeddings, labels and masks. ``seqlen`` is the GLOBAL length; it must
    be a multiple of W (2W for zigzag).
    """
    if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < 1:
        raise ValueError(f"seqlen must be a positive int, got {seqlen!r}")
    layout = check_layout(layout)
    ring = Ring(group)
    return global_positions(seqlen, layout, ring.rank, ring.world).to(device)


def shard(x: torch.Tensor, dim: int = 1, layout: str = "contiguous", group=None) -> torch.Tensor:
    """This rank's part of the full-sequence tensor ``x`` along ``dim`` (a new tensor)."""
    dim = _check_dim(x, dim)
    layout = check_layout(layout)
    ring = Ring(group)
    check_seqlen(x.shape[dim], layout, ring.world)
    if layout == "stripe":  # rank r takes every W-th token from r
        return x.unflatten(dim, (-1, ring.world)).select(dim + 1, ring.rank).contiguous()
    chunks = x.chunk(split_factor(layout, ring.world), dim=dim)
    if layout == "contiguous":
        return chunks[ring.rank].contiguous()
    return torch.cat([chunks[ring.rank], chunks[2 * ring.world - 1 - ring.rank]], dim=dim)


def unshard(x_local: torch.Tensor, dim: int = 1, layout: str = "contiguous", group=None) -> torch.Tensor:
    """Gather every rank's shard along ``dim`` back into the full sequence, in order.

    The inverse of ``shard``; every rank gets the whole tensor. Not differentiable.
    """
    dim = _check_dim(x_local, dim)
    layout = check_layout(layout)
    ring = Ring(group)
    if ring.world == 1:
        return x_local.clone()
    local = x_local.contiguous()
    parts = [torch.empty_like(local) for _ in range(ring.world)]
    dist.all_gather(parts, local, group=ring.group)
    n = local.shape[dim]
    seqlen = n * ring.world
    full = torch.empty((*local.shape[:dim], seqlen, *local.shape[dim + 1:]),
                       device=local.device, dtype=local.dtype)
    for rank, part in enumerate(parts):
        index = global_positions(seqlen, layout, rank, ring.world).to(local.device)
        full.index_copy_(dim, index, part)
    return full
