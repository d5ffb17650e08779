"""Public functions of the distributed layer, and their argument checks."""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist

from . import agreement, heads
from .exchange import Ring, transport  # noqa: F401 - transport: part of this module's API
from .groups import Grid, resolve_grid
from .kernels import (band_of_window, check_block_mask, check_causal, check_deterministic, check_dropout,
                      check_qkv, check_segment_ids, check_window, eager, resolve_scale)
from .kernels.masks import BLOCK
from .layouts import (DEFAULT_LAYOUT, check_layout, check_local_length, global_positions, layout_code,
                      layout_name, layout_of)
from .ops import ring_attn


def _check_local(q, k, v, causal, layout, softmax_scale, window_size, segment_ids, dropout_p, seed,
                 block_mask, deterministic, world, heads_world=1):
    """The call's arguments, checked: (band, layout, scale, segments, dropout, blocks), the
    band being (lo, hi) of key - query positions (``kernels.band_of_window``). ``world``:
    the ring's ranks; ``heads_world``: U of a heads x ring grid (the ring then runs on
    U x seqlen_local tokens a rank)."""
    check_qkv(q, k, v)
    if world * heads_world > 1 and q.device.type == "meta":
        raise ValueError(f"q, k and v are on the meta device (shapes without data); the ring of "
                         f"{world * heads_world} ranks exchanges their data: pass tensors on a real device")
    check_deterministic(deterministic)
    causal = check_causal(causal)
    layout = check_layout(layout)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    window = check_window(window_size)
    band = band_of_window(causal, window)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold the same number of local tokens, got {q.shape[1]} and {k.shape[1]}")
    rules = layout_of(layout)
    ring_local = q.shape[1] * heads_world
    rules.check_local(ring_local)
    rules.check_seqlen(ring_local * world, world)
    segments = check_segment_ids(segment_ids, q.shape[0], q.shape[1], q.device)
    seqlen = ring_local * world
    blocks = check_block_mask(block_mask, q.shape[2], seqlen, seqlen, q.device,
                              "global seqlen (W x seqlen_local), global seqlen")
    if blocks is not None:
        rules.block_chunk(world, ring_local, BLOCK)
    rules.check_masks(band, window, blocks is not None, segments is not None)
    dropout = check_dropout(dropout_p, seed)
    if heads_world > 1:
        if q.shape[2] % heads_world:
            raise ValueError(f"heads ({q.shape[2]}) must be a multiple of the grid's heads dimension "
                             f"U = {heads_world} (each of its ranks takes heads / U of them)")
    # a layout computed at run time goes on as itself (ops.ring_attn takes its spec tensor)
    return band, rules if hasattr(rules, "spec") else layout_name(layout), scale, segments, dropout, blocks


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
            ``(mesh, dim)`` (see ``ringflash.groups``). Or a heads x ring grid (a 2-D
            DeviceMesh or ``(head_group, ring_group)``): the local shards are then the
            heads ranks' pieces of each ring shard (``shard`` with the same grid), and an
            all-to-all trades tokens for heads around the ring (``ringflash.heads``).
        layout: how the global sequence is split ("zigzag", the default, "contiguous",
            "stripe", "block_stripe"; see ``shard``); the same as the inputs were sharded
            with. Every mask is on GLOBAL positions, so the result does not depend on it;
            the work per rank and the hops K/V travel do (packed documents: a layout
            computed from them, ``ringflash.document_layout``, which needs segment_ids of
            those documents and takes no block_mask, or "block_stripe",
            ``ringflash.DOCUMENTS_LAYOUT``; sliding windows: "contiguous").
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
        deterministic: the backward's bits the same run to run. The default may add
            dQ in arrival order where the Gluon backward runs the ring's steps (Hopper,
            bf16, head_dim 64 or 128, no mask, causal, windows, segment ids): dQ may then
            differ in its last bits between runs (out, lse, dK and dV do not). True, or
            ``torch.use_deterministic_algorithms(True)``, makes the Gluon backward add
            them in a fixed order of key tiles, or with segment ids hands the backward to
            the Triton kernels (their sums always have one order).

    Returns:
        out (batch, seqlen_local, heads, head_dim) in q's dtype: rows of
        softmax(q K^T * scale) V over the whole sequence; with return_lse also
        lse (batch, heads, seqlen_local), fp32, natural log. Both are differentiable
        in q, k and v.

    Memory: beside q, k, v, out and their gradients the ring holds fp32 sums and visiting
    K/V (56 KiB a local token at 32 heads / 8 kv heads, head_dim 128). Where those would
    take more than a quarter of the GPU's memory, the ring runs the heads in chunks of
    whole GQA groups, one after another (the same bits; ``ringflash.heads.memory_chunks``,
    RINGFLASH_HEAD_CHUNKS).

    Invalid arguments raise ValueError/TypeError on every rank of the ring, including
    ranks whose own arguments were fine (see ``agreement.check_ranks_agree`` for the cost); the
    cross-rank check runs inside the ring's custom op (ops.py), so torch.compile traces
    this function without a graph break. Under torch.compile a rank whose own arguments
    are invalid raises while tracing, without telling the others.
    """
    grid = resolve_grid(group)
    args = (q, k, v, causal, layout, softmax_scale, window_size, segment_ids, dropout_p, seed,
            block_mask, deterministic)
    if grid.heads_world > 1:
        out, lse = _over_grid(args, grid)
        return (out, lse) if return_lse else out
    group = grid.ring
    if torch.compiler.is_compiling():
        checked = _check_local(*args, Ring(group).world)
    else:
        checked = _check_local_on_every_rank(*args, group=group)
    band, layout, scale, segments, dropout, blocks = checked
    chunks = heads.memory_chunks(q, k, Ring(group).world) if eager(q, k, v) else 1
    if chunks > 1:  # the ring's buffers of every head at once would not fit: heads in turn
        out, lse = heads.ring_in_chunks(q, k, v, chunks, group, segments, blocks, softmax_scale=scale, band=band,
                                        layout=layout, dropout=dropout, deterministic=deterministic)
    else:
        out, lse = ring_attn(q, k, v, segments, softmax_scale=scale, band=band, layout=layout, dropout=dropout,
                             blocks=blocks, group=group, deterministic=deterministic)
    return (out, lse) if return_lse else out


def _over_grid(args, grid: Grid):
    """ring_flash_attn on a heads x ring grid (``ringflash.heads``): (out, lse)."""
    q, k = args[0], args[1]
    compiling = torch.compiler.is_compiling()
    try:
        band, layout, scale, segments, dropout, blocks = _check_local(
            *args, grid.ring_world, grid.heads_world)
        mine = agreement.signature(q, k, band, layout, scale, torch.is_grad_enabled() and any(
            t.requires_grad for t in args[:3]), None, segments, dropout, blocks, args[11])
    except (TypeError, ValueError) as error:
        if not compiling and agreement.ENABLED:
            agreement.agree_on_grid(grid, None, error)
        raise
    if not compiling and agreement.ENABLED:
        agreement.agree_on_grid(grid, mine, None)
    return heads.ring_over_heads(q, k, args[2], grid, segments, blocks, softmax_scale=scale, band=band,
                                 layout=layout, dropout=dropout, deterministic=args[11])


def _check_local_on_every_rank(*args, group):
    """``_check_local``; if it fails on one rank of a ring, every rank raises (the failing
    rank joins the agreement all-gather that the others run inside the op)."""
    ring = Ring(group)
    try:
        return _check_local(*args, ring.world)
    except (TypeError, ValueError) as error:
        if not (ring.world > 1 and agreement.ENABLED):
            raise
        agreement.check_ranks_agree(ring, None, error)
        raise  # not reached: check_ranks_agree raises ``error``


def _int(value, name: str) -> int:
    """``value`` as an int (numpy integers too); TypeError naming ``name`` otherwise."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def positive_int(value, name: str) -> int:
    """``value`` as a positive int; TypeError / ValueError naming ``name`` otherwise."""
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


def _token_index(seqlen: int, layout, grid: Grid) -> torch.Tensor:
    """Global positions of this rank's tokens: the layout's shard of the ring rank, and of
    it, on a heads x ring grid, the heads rank's piece (``groups.Grid``)."""
    ring_shard = global_positions(seqlen, layout, grid.ring_rank, grid.ring_world)
    pieces = grid.heads_world
    if ring_shard.numel() % pieces:
        raise ValueError(f"seqlen {seqlen}: a ring shard of {ring_shard.numel()} tokens does not split "
                         f"over the grid's {pieces} heads ranks")
    n = ring_shard.numel() // pieces
    return ring_shard[grid.heads_rank * n:(grid.heads_rank + 1) * n]


def positions(seqlen: int, layout: str = DEFAULT_LAYOUT, group=None, *, device=None) -> torch.Tensor:
    """Global token ids of this rank's tokens, in local order (int64, (seqlen // W,)).

    For rotary embeddings, labels and masks. ``seqlen`` is the GLOBAL length; it must
    be a multiple of W (2W for zigzag, 128 W for block_stripe; on a heads x ring grid W
    is R and each ring shard splits over U). Local, like ``shard``: no collective.
    """
    seqlen = positive_int(seqlen, "seqlen")
    layout = check_layout(layout)
    return _token_index(seqlen, layout, resolve_grid(group)).to(device)


def shard(x: torch.Tensor, dim: int = 1, layout: str = DEFAULT_LAYOUT, group=None) -> torch.Tensor:
    """This rank's part of the full-sequence tensor ``x`` along ``dim`` (a new tensor).

    Local: no collective, so nothing compares the ranks' ``x`` here; shards of different
    lengths are reported by the next collective that takes them (``ring_flash_attn``'s and
    ``unshard``'s rank checks)."""
    dim = _check_dim(x, dim)
    layout = check_layout(layout)
    index = _token_index(x.shape[dim], layout, resolve_grid(group)).to(x.device)
    return x.index_select(dim, index)


# What the ranks of an unshard compare before the gather (``agreement.agree``).
_UNSHARD_FIELDS = ("dim", "layout", *agreement.tensor_fields("x_local"))


def unshard(x_local: torch.Tensor, dim: int = 1, layout: str = DEFAULT_LAYOUT, group=None) -> torch.Tensor:
    """Gather every rank's shard along ``dim`` back into the full sequence, in order.

    The inverse of ``shard``; every rank gets the whole tensor. Differentiable: the
    gradient of the local shard is this rank's ``shard`` of the full tensor's gradient,
    i.e. a loss computed from the gathered tensor counts once, as on one device (every
    rank computes the same loss; gradients summed over the group, as ever).

    A collective: every rank of the group calls it with ``x_local`` of the same shape and
    dtype, and the same ``dim`` and ``layout``. Before the gather the ranks compare these
    (one all-gather of 14 int64 on the host, ``agreement.agree``); a rank whose arguments
    are invalid, or ranks that differ, make every rank raise a ValueError naming the
    argument and each rank's value.
    """
    grid = resolve_grid(group)

    def local_checks():
        d, lay = _check_dim(x_local, dim, "x_local"), check_layout(layout)
        check_local_length(x_local.shape[d], lay, "x_local", grid.heads_world)
        return [d, layout_code(lay), *agreement.tensor_row(x_local)], (d, lay)
    dim, layout = agreement.agree(grid, "unshard", _UNSHARD_FIELDS, local_checks)
    if torch.is_grad_enabled() and x_local.requires_grad:
        return _Unshard.apply(x_local, dim, layout, grid)
    return _gather(x_local, dim, layout, grid)


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
    grid = resolve_grid(group)
    local = x_local.contiguous()
    if grid.heads_world > 1:  # the heads ranks' pieces, in order: the ring shard
        pieces = [torch.empty_like(local) for _ in range(grid.heads_world)]
        dist.all_gather(pieces, local, group=grid.heads)
        local = torch.cat(pieces, dim=dim)
    ring = Ring(grid.ring)
    if ring.world == 1:
        return local.clone() if local is x_local else local
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


def check_cu_seqlens(cu_seqlens, seqlen: int) -> torch.Tensor:
    """``cu_seqlens`` (flash_attn's varlen format) as an int64 CPU tensor, checked against
    ``seqlen``; ValueError / TypeError naming it otherwise."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor [0, end_0, end_1, ...]")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    bounds = cu_seqlens.cpu().long()
    if bounds[0] != 0 or (bounds[1:] < bounds[:-1]).any() or bounds[-1] > seqlen:
        raise ValueError(f"cu_seqlens must start at 0, not decrease and end at most at seqlen "
                         f"({seqlen}), got {bounds.tolist()[:8]}{'...' if bounds.numel() > 8 else ''}")
    return bounds


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seqlen: int, layout: str = DEFAULT_LAYOUT,
                                group=None) -> torch.Tensor:
    """This rank's (1, seqlen // W) segment ids of one packed sequence of ``seqlen`` tokens
    whose documents are given in flash_attn's varlen format: document d holds tokens
    [cu_seqlens[d], cu_seqlens[d + 1]); tokens from cu_seqlens[-1] on are padding (-1).
    Shard the token tensors with the same ``layout`` and ``group``."""
    seqlen = positive_int(seqlen, "seqlen")
    bounds = check_cu_seqlens(cu_seqlens, seqlen)
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
