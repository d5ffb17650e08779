"""Public functions of the distributed layer, and their argument checks."""

from __future__ import annotations

import operator
import os
import struct

import torch
import torch.distributed as dist

from .exchange import TRANSPORTS, Ring, transport  # noqa: F401 - transport: part of this module's API
from .groups import resolve_group
from .kernels import (SUPPORTED_DTYPES, band_of_window, check_block_mask, check_causal,
                      check_deterministic, check_dropout, check_qkv, check_segment_ids, check_window,
                      resolve_scale)
from .kernels.masks import BLOCK, tensor_memo
from .layouts import DEFAULT_LAYOUT, LAYOUTS, check_block_layout, check_layout, global_positions
from .ops import ring_attn

# Set RINGFLASH_RANK_CHECK=0 to skip the cross-rank agreement check (see _check_ranks_agree);
# read once, at import. Without it nothing compares the ranks' arguments: ranks that disagree
# on a shape fail inside the exchange with the backend's error (gloo aborts: "Received data
# size doesn't match expected size"; NCCL may hang until the group's timeout), and ranks
# that disagree on causal, layout or softmax_scale return wrong results with no error.
_RANK_CHECK = os.environ.get("RINGFLASH_RANK_CHECK", "1") != "0"


_SIGNATURE_FIELDS = ("batch", "seqlen_local", "heads", "head_dim", "kv_heads", "dtype", "causal",
                     "layout", "softmax_scale", "requires_grad", "transport", "window_left",
                     "window_right", "segment_ids given", "dropout_p", "seed",
                     "block_mask's nonzero blocks", "block_mask's checksum")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _block_digest(blocks) -> list[int]:
    """(nonzero blocks, a position-weighted checksum) of a block mask; (-1, -1) for none.
    One reduction on the mask's device (a host synchronization) the first time a mask
    object is seen."""
    if blocks is None:
        return [-1, -1]

    def digest():
        flat = blocks.reshape(-1)
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) % 1_000_003
        return [int(flat.sum()), int((weights * flat).sum())]
    return tensor_memo(blocks, ("digest",), digest)


def _signature(q, k, causal, layout, scale, needs_grad, kind, window, segments, dropout,
               blocks=None) -> list[int]:
    """A few integers that every rank of the ring must agree on."""
    return [*q.shape, k.shape[2], SUPPORTED_DTYPES.index(q.dtype), int(causal),
            LAYOUTS.index(layout), _float_bits(scale), int(needs_grad), TRANSPORTS.index(kind),
            *window, int(segments is not None), _float_bits(dropout[0]), dropout[1],
            *_block_digest(blocks)]


def _shown(field: str, values) -> list:
    if field in ("softmax_scale", "dropout_p"):
        return [struct.unpack("<d", struct.pack("<q", x))[0] for x in values]
    if field == "dtype":
        return [str(SUPPORTED_DTYPES[x]) for x in values]
    if field == "layout":
        return [LAYOUTS[x] for x in values]
    if field == "transport":
        return [TRANSPORTS[x] for x in values]
    return list(values)


def _check_ranks_agree(ring: Ring, signature: list[int] | None, error: Exception | None) -> None:
    """Raise on every rank if any rank rejected its arguments or the ranks disagree.

    ``signature`` is None on a rank whose own checks failed with ``error``: it still joins
    the all-gather, so the other ranks learn of it instead of waiting in the ring.
    Costs one all-gather of 19 int64 per call on the host (``exchange.host_group``: gloo),
    which waits for the other ranks' hosts but not for the GPU (a block mask's checksum
    is reduced on its device the first time the mask is seen). It runs on every call
    rather than once per signature: a rank that skipped it because its own
    signature was cached, while another rank's changed, would leave that rank waiting in a
    collective nobody else joins.
    """
    mine = [1, *signature] if signature is not None else [0] * (1 + len(_SIGNATURE_FIELDS))
    everyone = ring.all_gather_ints(mine)
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


def _check_local(q, k, v, causal, layout, softmax_scale, window_size, segment_ids, dropout_p, seed,
                 block_mask, deterministic, world):
    check_qkv(q, k, v)
    check_deterministic(deterministic)
    causal = check_causal(causal)
    layout = check_layout(layout)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    window = check_window(window_size)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold the same number of local tokens, got {q.shape[1]} and {k.shape[1]}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout 'zigzag' needs an even seqlen_local (two chunks a rank), got {q.shape[1]}")
    segments = check_segment_ids(segment_ids, q.shape[0], q.shape[1], q.device)
    seqlen = q.shape[1] * world
    if layout == "block_stripe" and q.shape[1] % BLOCK:
        raise ValueError(f"layout 'block_stripe' needs seqlen_local a multiple of {BLOCK} (whole "
                         f"blocks a rank), got {q.shape[1]}")
    blocks = check_block_mask(block_mask, q.shape[2], seqlen, seqlen, q.device,
                              "global seqlen (W x seqlen_local), global seqlen")
    if blocks is not None:
        check_block_layout(layout, world, q.shape[1], BLOCK)
        if layout == "block_stripe" and band_of_window(causal, window) not in ((None, None), (None, 0)):
            raise ValueError(f"block_mask with layout 'block_stripe' takes causal or full attention, "
                             f"not window_size {window}: a window cuts the shards' blocks (layouts "
                             "'contiguous' and 'zigzag' take both)")
    dropout = check_dropout(dropout_p, seed)
    return causal, layout, scale, window, segments, dropout, blocks


def ring_flash_attn(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                    group=None, layout: str = DEFAULT_LAYOUT, return_lse: bool = False,
                    segment_ids: torch.Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
                    dropout_p: float = 0.0, seed: int | None = None,
                    block_mask: torch.Tensor | None = None, deterministic: bool = False):
    """Exact attention of this rank's queries over the keys of every rank in ``group``.

    Args:
        q: (batch, seqlen_local, heads, head_dim), this rank's shard of the queries.
        k, v: (batch, seqlen_local, kv_heads, head_dim), this rank's shards; heads a
            multiple of kv_heads. Same shapes and dtype (fp16, bf16, fp32) on every rank.
        causal: causal mask on GLOBAL positions, as given by ``layout``.
        softmax_scale: a positive float; defaults to head_dim ** -0.5.
        group: the process group forming the ring (default: the world; without an
            initialized process group, a ring of one), or a DeviceMesh: 1-D, or
            ``(mesh, dim)`` (see ``ringflash.groups``).
        layout: how the global sequence is split ("zigzag", the default, "contiguous",
            "stripe", "block_stripe"; see ``shard``); the same as the inputs were sharded
            with. Every mask is on GLOBAL positions, so the result does not depend on it;
            the work per rank and the hops K/V travel do (packed documents:
            "block_stripe", ``ringflash.DOCUMENTS_LAYOUT``; sliding windows: "contiguous").
            "block_stripe" needs seqlen_local a multiple of 128; it takes every mask, but
            not window_size together with block_mask.
        return_lse: also return lse.
        segment_ids: (batch, seqlen_local) integer ids of this rank's tokens, sharded like
            q (``shard(ids, dim=1, layout=...)``, or ``segment_ids_from_cu_seqlens`` /
            ``segment_ids_from_position_ids``). A query sees a key only if both carry the
            same id; -1 marks padding (never seen; a padding query sees nothing: out 0,
            lse -inf, zero gradients). Outside padding, ids must not decrease along the
            sequence (each document one contiguous run). The visiting shard's ids travel
            with its K/V.
        window_size: (left, right): the query at global position i sees keys at
            i - left <= j <= i + right; -1 is unbounded on that side. Combines with causal
            and segment_ids. Shards travel only as far as some rank needs them: with
            layout "contiguous" and a causal window w, about ceil(w / seqlen_local) hops.
        dropout_p, seed: attention dropout, keyed by (seed, batch, head, global query
            position, global key position), so the ring drops exactly what ``flash_attn``
            with the same seed drops on the whole sequence (``dropout_keep_mask``). seed
            None draws one from torch's default generator: seed it alike on every rank (the
            rank check compares the seeds). The rate applied is p rounded to 1/256
            (``ringflash.kernels.dropout.applied_rate``). Queries in aligned runs of 16 and
            keys in aligned runs of 32 (layouts contiguous and block_stripe, and zigzag with
            seqlen_local a multiple of 64) share Philox calls; stripe runs one per element.
        block_mask: block-sparse attention over GLOBAL token blocks of 128: bool
            (heads or 1, N / 128, N / 128), N the global length, the same tensor on every
            rank (the rank check compares checksums). Block (a, c) covers global queries
            [128a, 128a + 128) and keys [128c, 128c + 128); False blocks are never computed,
            a ring step whose pairs are all False computes nothing, and K/V stop travelling
            once no rank further on needs them. The elements of a True block follow causal,
            window_size and segment_ids. Layouts "contiguous" and "zigzag" with chunks
            (seqlen_local, or seqlen_local / 2 for zigzag) a multiple of 128, and
            "block_stripe" (its shards are whole blocks); "stripe" raises. Helpers:
            ``ringflash.kernels.block_sparse``.
        deterministic: accepted for compatibility: the ring's backward is always
            deterministic (fixed summation order, no atomics).

    Returns:
        out (batch, seqlen_local, heads, head_dim) in q's dtype: rows of
        softmax(q K^T * scale) V over the whole sequence; with return_lse also
        lse (batch, heads, seqlen_local), fp32, natural log. Both are differentiable
        in q, k and v.

    Invalid arguments raise ValueError/TypeError on every rank of the ring, including
    ranks whose own arguments were fine (see ``_check_ranks_agree`` for the cost); the
    cross-rank check runs inside the ring's custom op (ops.py), so torch.compile traces
    this function without a graph break. Under torch.compile a rank whose own arguments
    are invalid raises while tracing, without telling the others.
    """
    group = resolve_group(group)
    args = (q, k, v, causal, layout, softmax_scale, window_size, segment_ids, dropout_p, seed,
            block_mask, deterministic)
    if torch.compiler.is_compiling():
        checked = _check_local(*args, Ring(group).world)
    else:
        checked = _check_local_on_every_rank(*args, group=group)
    causal, layout, scale, window, segments, dropout, blocks = checked
    out, lse = ring_attn(q, k, v, segments, softmax_scale=scale, causal=causal, layout=layout,
                         window=window, dropout=dropout, blocks=blocks, group=group)
    return (out, lse) if return_lse else out


def _check_local_on_every_rank(*args, group):
    """``_check_local``; if it fails on one rank of a ring, every rank raises (the failing
    rank joins the agreement all-gather that the others run inside the op)."""
    ring = Ring(group)
    try:
        return _check_local(*args, ring.world)
    except (TypeError, ValueError) as error:
        if not (ring.world > 1 and _RANK_CHECK):
            raise
        _check_ranks_agree(ring, None, error)
        raise  # not reached: _check_ranks_agree raises ``error``


def _int(value, name: str) -> int:
    """``value`` as an int (numpy integers too); TypeError naming ``name`` otherwise."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _positive_int(value, name: str) -> int:
    value = _int(value, name)
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _check_dim(x: torch.Tensor, dim: int, name: str = "x") -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dim = _int(dim, "dim")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim()}) for {name} of {x.dim()} dimensions, got {dim}")
    return dim % x.dim()


def positions(seqlen: int, layout: str = DEFAULT_LAYOUT, group=None, *, device=None) -> torch.Tensor:
    """Global token ids of this rank's tokens, in local order (int64, (seqlen // W,)).

    For rotary embeddings, labels and masks. ``seqlen`` is the GLOBAL length; it must
    be a multiple of W (2W for zigzag, 128 W for block_stripe).
    """
    seqlen = _positive_int(seqlen, "seqlen")
    layout = check_layout(layout)
    ring = Ring(group)
    return global_positions(seqlen, layout, ring.rank, ring.world).to(device)


def shard(x: torch.Tensor, dim: int = 1, layout: str = DEFAULT_LAYOUT, group=None) -> torch.Tensor:
    """This rank's part of the full-sequence tensor ``x`` along ``dim`` (a new tensor)."""
    dim = _check_dim(x, dim)
    layout = check_layout(layout)
    ring = Ring(group)
    index = global_positions(x.shape[dim], layout, ring.rank, ring.world).to(x.device)
    return x.index_select(dim, index)


def unshard(x_local: torch.Tensor, dim: int = 1, layout: str = DEFAULT_LAYOUT, group=None) -> torch.Tensor:
    """Gather every rank's shard along ``dim`` back into the full sequence, in order.

    The inverse of ``shard``; every rank gets the whole tensor. Differentiable: the
    gradient of the local shard is this rank's ``shard`` of the full tensor's gradient,
    i.e. a loss computed from the gathered tensor counts once, as on one device (every
    rank computes the same loss; gradients summed over the group, as ever).
    """
    dim = _check_dim(x_local, dim, "x_local")
    layout = check_layout(layout)
    if torch.is_grad_enabled() and x_local.requires_grad:
        return _Unshard.apply(x_local, dim, layout, group)
    return _gather(x_local, dim, layout, group)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, dim, layout, group):
        ctx.args = (dim, layout, group)
        return _gather(x_local, dim, layout, group)

    @staticmethod
    def backward(ctx, grad):
        dim, layout, group = ctx.args
        return shard(grad, dim, layout, group), None, None, None


def _gather(x_local: torch.Tensor, dim: int, layout: str, group) -> torch.Tensor:
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


# ----------------------------------------------------------------------------- packed documents


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seqlen: int, layout: str = DEFAULT_LAYOUT,
                                group=None) -> torch.Tensor:
    """This rank's (1, seqlen // W) segment ids of one packed sequence of ``seqlen`` tokens
    whose documents are given in flash_attn's varlen format: document d holds tokens
    [cu_seqlens[d], cu_seqlens[d + 1]); tokens from cu_seqlens[-1] on are padding (-1).
    Shard the token tensors with the same ``layout`` and ``group``."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor [0, end_0, end_1, ...]")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    seqlen = _positive_int(seqlen, "seqlen")
    bounds = cu_seqlens.cpu().long()
    if bounds[0] != 0 or (bounds[1:] < bounds[:-1]).any() or bounds[-1] > seqlen:
        raise ValueError(f"cu_seqlens must start at 0, not decrease and end at most at seqlen "
                         f"({seqlen}), got {bounds.tolist()}")
    tokens = torch.arange(seqlen)
    ids = torch.searchsorted(bounds[1:], tokens, right=True)
    ids = torch.where(tokens < bounds[-1], ids, -1)
    return shard(ids[None].to(torch.int32).to(cu_seqlens.device), dim=1, layout=layout, group=group)


def segment_ids_from_position_ids(position_ids: torch.Tensor, layout: str = DEFAULT_LAYOUT,
                                  group=None) -> torch.Tensor:
    """This rank's (batch, seqlen // W) segment ids from FULL-sequence position ids
    (batch, seqlen) that restart at 0 at every document (Hugging Face packing): a new
    document starts wherever the position is 0. Shard the tokens with the same layout.
    (``ringflash.hf.segment_ids_of`` takes transformers' wider rule: a document starts
    wherever the position does not grow by one, so [0 1 2 7 8] is two documents there and
    one here.)"""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        raise ValueError("position_ids must be a (batch, seqlen) tensor of the full sequence")
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    ids = torch.cumsum((position_ids == 0).to(torch.int32), dim=1) - 1
    if (ids < 0).any():
        raise ValueError("position_ids must start every row at 0 (a document's first token)")
    return shard(ids.to(torch.int32), dim=1, layout=layout, group=group)
