"""Two-dimensional sequence parallelism: an all-to-all over the grid's heads group (U
ranks) trades each rank's piece of the sequence for a share of the heads, the ring runs
over the grid's ring group (R ranks) on the reassembled ring shard, and out (and lse)
come back through the inverse all-to-all. The backward is the same path reversed: the
all-to-alls are differentiable (their adjoint is the opposite exchange) and the ring has
its own backward.

    rank (u, r):  q (B, L, H, D)  --to_heads-->  (B, U L, H / U, D)  -- the ring over r -->
                  out (B, U L, H / U, D)  --to_sequence-->  (B, L, H, D)

Rank (u, r) holds piece u of the layout's ring shard r (``groups.Grid``), so the pieces
the all-to-all gathers, in order of u, are exactly the ring shard: every mask on global
positions, segment ids, windows and block masks mean what they mean on the ring alone.

K/V: rank u's query heads [u H/U, (u+1) H/U) read kv heads h // (H / Hkv). When U divides
Hkv each rank receives its own Hkv / U; otherwise (MQA, or kv_heads < U) each receives
the kv heads its query heads need, replicated only in transit: the all-to-all sends a
head to every rank that reads it, and its gradient comes back summed from all of them.

Dropout is keyed by the global head: rank u's ring runs with ``dropout_head0 = u H / U``,
so a grid drops exactly what one device drops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from einops import rearrange

from .groups import Grid


def kv_index(heads: int, kv_heads: int, world: int) -> torch.Tensor:
    """(U, n) int64: row u lists the kv heads rank u receives, in the order its kernel reads
    them (query head j of the rank reads entry j // (H / U / n)). n = Hkv / U when U divides
    Hkv; one kv head a rank when a rank's query heads share one; otherwise one a query
    head (the rank runs them as MHA)."""
    per_rank, group = heads // world, heads // kv_heads
    needed = torch.arange(heads).view(world, per_rank) // group  # kv head of each query head
    if per_rank % group == 0:  # whole groups: each kv head once
        return needed[:, ::group]
    if group % per_rank == 0:  # a rank's heads within one group
        return needed[:, :1]
    return needed


class _ToHeads(torch.autograd.Function):
    """x (B, L, Hx, D) -> (B, U L, n, D): rank u gets heads index[u] of every rank's L
    tokens, in order of rank. The gradient goes back through the opposite exchange and
    sums over the ranks (and entries) that read a head."""

    @staticmethod
    def forward(ctx, x, index, group):
        ctx.group, ctx.index, ctx.heads = group, index, x.shape[2]
        picked = x[:, :, index.flatten().to(x.device)]
        return _exchange(picked, group, index.shape[0], "b l (u n) d -> u b l n d", "u b l n d -> b (u l) n d")

    @staticmethod
    def backward(ctx, grad):
        back = _exchange(grad, ctx.group, ctx.index.shape[0], "b (u l) n d -> u b l n d", "u b l n d -> b l (u n) d")
        dx = back.new_zeros(*back.shape[:2], ctx.heads, back.shape[3])
        return dx.index_add_(2, ctx.index.flatten().to(grad.device), back), None, None


class _ToSequence(torch.autograd.Function):
    """y (B, U L, h, ...) -> (B, L, U h, ...): the inverse of ``_ToHeads`` for tensors each
    rank holds its own heads of (out, lse); its adjoint is the forward exchange."""

    @staticmethod
    def forward(ctx, y, group, world):
        ctx.group, ctx.world = group, world
        return _exchange(y, group, world, "b (u l) h ... -> u b l h ...", "u b l h ... -> b l (u h) ...")

    @staticmethod
    def backward(ctx, grad):
        return (_exchange(grad, ctx.group, ctx.world, "b l (u h) ... -> u b l h ...",
                          "u b l h ... -> b (u l) h ..."), None, None)


def _exchange(t, group, world, split, join):
    """``t`` rearranged by ``split`` into (U, ...), piece u sent to heads rank u, the pieces
    received (one from each rank, in order) rearranged by ``join``."""
    send = rearrange(t, split, u=world).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return rearrange(recv, join)


def _gather_tokens(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """(B, L) per rank -> (B, U L), the pieces in order of rank (segment ids)."""
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def ring_over_heads(q, k, v, grid: Grid, segments, block_mask, attend):
    """out (B, L, H, D) and lse (B, H, L) of this rank's tokens: ``attend(q, k, v,
    segment_ids, block_mask)`` runs the ring on the head-split tensors and returns (out,
    lse) of them."""
    world, group = grid.heads_world, grid.heads
    heads, kv_heads = q.shape[2], k.shape[2]
    rank = grid.heads_rank
    q_index = torch.arange(heads).view(world, heads // world)
    kv = kv_index(heads, kv_heads, world)
    q2 = _ToHeads.apply(q, q_index, group)
    k2, v2 = _ToHeads.apply(k, kv, group), _ToHeads.apply(v, kv, group)
    segments2 = None if segments is None else _gather_tokens(segments, group, world)
    blocks2 = block_mask
    if block_mask is not None and block_mask.shape[0] > 1:  # per-head: this rank's heads' rows
        blocks2 = block_mask[q_index[rank].to(block_mask.device)]
    out2, lse2 = attend(q2, k2, v2, segments2, blocks2)
    out = _ToSequence.apply(out2, group, world)
    lse = _ToSequence.apply(rearrange(lse2, "b h s -> b s h"), group, world)
    return out, rearrange(lse, "b s h -> b h s")
