"""Two-dimensional sequence parallelism: an all-to-all over the grid's heads group (U
ranks) trades each rank's piece of the sequence for a share of the heads, the ring runs
over the grid's ring group (R ranks) on the reassembled ring shard, and out (and lse)
come back through the inverse all-to-all. The backward is the same path reversed.

    rank (u, r):  q (B, L, H, D)  --to_heads-->  (B, U L, H / U, D)  -- the ring over r -->
                  out (B, U L, H / U, D)  --to_sequence-->  (B, L, H, D)

Rank (u, r) holds piece u of the layout's ring shard r (``groups.Grid``), so the pieces
the all-to-all gathers, in order of u, are exactly the ring shard: every mask on global
positions, segment ids, windows and block masks mean what they mean on the ring alone.

K/V: rank u's query heads [u H/U, (u+1) H/U) read kv heads h // (H / Hkv). When U divides
Hkv each rank receives its own Hkv / U; otherwise (MQA, or kv_heads < U) each receives
the kv heads its query heads need, replicated only in transit: the all-to-all sends a
head to every rank that reads it, and its gradient comes back summed from all of them.

Dropout is keyed by the global head: a ring over query heads [h0, h0 + n) runs with
``dropout_head0 = h0``, so a grid drops exactly what one device drops.

Overlap. A rank's heads split into C chunks (``head_chunks``), each a whole number of the
kv entries it receives, so every chunk keeps whole GQA groups and computes what the
unchunked call computes for its heads, bit for bit (except where the ring itself divides
work by a per-head block mask's blocks: a ring of two that keeps K/V cuts its dK/dV passes
where its heads' blocks balance, so the same terms may add in another order). The forward
posts the all-to-alls of every chunk's q, k, v at once (asynchronous: a wait makes the
compute stream, not the host, wait), runs chunk c's ring while later chunks travel, and
sends chunk c's out and lse home while chunk c + 1 computes; the backward posts every
chunk's dout (and dlse) at once and sends chunk c's dq, dk, dv home while chunk c + 1's
ring backward runs: one autograd Function (``_Overlapped``) that calls the ring op's
forward and backward itself, in its own order. The copies into the send buffers and from
the arrived results to their heads run on a side stream, beside the kernels, and where U
divides the kv heads no kv head is picked or summed, only rearranged. What stays exposed is
the first chunk's trip out, the last chunk's trip home, and a tail of each chunk's
launches, while the second chunk runs the ring's steps again. So C = 2 only where the
half of the all-to-alls it hides outweighs what the steps cost again (``chunks_pay``, the
cost model's rule: at (2, 2), 128k, 32 heads two chunks, 8 kv heads one). C = 1 (nothing to
split, chunks that would not pay, RINGFLASH_HEAD_CHUNKS=1, or under torch.compile, which
traces the exchanges as functional collectives and orders them itself) takes the composed
path: differentiable exchanges around the ring's autograd op.
RINGFLASH_HEAD_CHUNKS (read at each call) exists to compare the two paths: tests hold them
to the same bits, benchmarks time what the overlap hides.

Memory (U = 1). The ring's own buffers -- the fp32 dQ sum, the dK/dV sums in flight and
the slots visiting K/V land in -- grow with the heads a call runs: 56 KiB a local token at
32 heads / 8 kv heads, head_dim 128 (48 with the Triton backward), beside the 40 KiB that any exact attention keeps
(docs/performance.md, "Memory per token"). A ring alone whose buffers would take more
than ``MEMORY_SHARE`` of the GPU's memory runs its heads in C chunks one after another
(``memory_chunks``; ``_Sequential``): each chunk's ring holds 1/C of those buffers and
frees them before the next starts, and every chunk computes what the whole call computes
for its heads, bit for bit, on views of the call's tensors (its K/V sent from them, its
gradients written into them; about 4% of a light mask's time on 2 H200s at 512k,
docs/performance.md). RINGFLASH_HEAD_CHUNKS=k runs k chunks (the largest divisor of
kv_heads up to k) whatever the size; 1 never chunks. Eager calls only: under torch.compile
the ring op runs every head at once (README, support matrix).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from einops import rearrange

from .groups import Grid, group_name
from .kernels import eager, no_double_backward
from .kernels.masks import tensor_memo
from .layouts import active_steps
from .ops import ring_attn, ring_attn_backward_impl, ring_attn_forward_impl

CHUNKS_ENV = "RINGFLASH_HEAD_CHUNKS"
# Exposed exchange ~ 1/C of it, but every chunk's launches end on a tail of their own: on 4 x
# H200 at 128k, 2 chunks ran level with or ahead of 4 on every grid, mask and head count
# measured (docs/performance.md, "Copies aside").
MAX_CHUNKS = 2
MIN_CHUNK_ROWS = 1 << 16  # query rows x heads of one chunk's kernels (B U L H / U / C): a full GPU
# Whether two chunks pay (``chunks_pay``): they hide about half of the all-to-alls and run the
# ring's steps once more, each step's fixed costs again: the cost model's step_ms + 2 message_ms
# (cost.H100: 0.4031 + 2 x 0.2446 ms; tests/test_heads.py holds them equal). Measured on 4 x
# H200 in pairs, one chunk against two, the rule is right or level in 7 of 8 (128k, (2, 2) and
# (4, 1), 32/32 and 32/8 heads: benchmarks/research/chunk_rule.py; docs/performance.md, "One
# head chunk or two"): at (2, 2) with 8 kv heads one chunk is 9-18% faster on packed documents.
CHUNK_STEP_MS = 0.8923
# The all-to-alls within a node, as the cost model prices them (cost_grid.NVLINK, fitted to the
# unchunked calls' all-to-alls timed alone on 2 and 4 x H200).
ALLTOALL_GBPS, ALLTOALL_CALL_MS = 335.0, 0.0625
MEMORY_SHARE = 0.25  # of a GPU's memory, the most a ring alone's own buffers take before it chunks


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


def _wanted_chunks() -> Optional[int]:
    """RINGFLASH_HEAD_CHUNKS: None for "auto" (the default), else the chunks asked for."""
    wanted = os.environ.get(CHUNKS_ENV, "auto").strip().lower()
    if wanted == "auto":
        return None
    if wanted.isdigit() and int(wanted) > 0:
        return int(wanted)
    raise ValueError(f"{CHUNKS_ENV} must be 'auto' or a positive integer, got {wanted!r}")


def head_chunks(entries: int, rows: int, pays: Optional[Callable[[], bool]] = None) -> int:
    """How many chunks a rank's heads split into: a divisor of ``entries`` (the kv entries a
    rank receives, kv_index's n), so each chunk has whole GQA groups and at least one kv head.
    RINGFLASH_HEAD_CHUNKS=k asks for k (the largest such divisor up to k; 1: no overlap).
    By default the largest up to MAX_CHUNKS whose chunks keep MIN_CHUNK_ROWS of the ``rows``
    (B x U L x H / U) a rank's ring computes; 1 for a small call, which has nothing to hide,
    and where ``pays`` (asked only then) says chunks do not pay (``chunks_pay``)."""
    wanted = _wanted_chunks()
    cap, least = (MAX_CHUNKS, MIN_CHUNK_ROWS) if wanted is None else (wanted, 0)
    chunks = max(c for c in range(1, min(cap, entries) + 1) if entries % c == 0 and (c == 1 or rows // c >= least))
    return 1 if wanted is None and chunks > 1 and pays is not None and not pays() else chunks


def chunks_pay(alltoall_ms: float, steps: int) -> bool:
    """Whether a grid call's heads in two chunks beat one: half its all-to-alls
    (``unchunked_alltoall_ms``), which the chunks hide, against ``steps`` x CHUNK_STEP_MS,
    what the ring's ``steps`` cost again in the second chunk."""
    return alltoall_ms / 2 > steps * CHUNK_STEP_MS


def unchunked_alltoall_ms(tokens: int, heads: int, entries: int, head_dim: int, element_size: int,
                          world: int) -> float:
    """ms of the all-to-alls of one unchunked forward+backward of a grid rank holding
    ``tokens`` tokens (batch x local length) of ``heads`` query heads, receiving ``entries``
    kv entries (``kv_index``), over a heads group of ``world`` ranks, as the cost model prices
    them (``cost_grid.exchanges`` and ``exchange_ms`` at ``cost_grid.NVLINK``): q, k, v out,
    out and lse home, dout out, dq, dk, dv home; each sends (U - 1) pieces, one a rank, and
    costs ALLTOALL_CALL_MS besides. Segment ids (all-gathered once) and dlse left out."""
    q_piece = tokens * heads // world * head_dim * element_size
    kv_piece, lse_piece = tokens * entries * head_dim * element_size, tokens * heads // world * 4
    sent = (world - 1) * (4 * q_piece + 4 * kv_piece + lse_piece)
    return sent / (ALLTOALL_GBPS * 1e6) + 9 * ALLTOALL_CALL_MS


def grid_chunks(q: torch.Tensor, entries: int, grid: Grid, layout, band) -> int:
    """The chunks of heads a grid call on q (B, L, H, D) runs in, a rank receiving
    ``entries`` kv entries (``kv_index``'s n): ``head_chunks``, its rule fed with the call's
    all-to-alls and the steps its ring runs over ring shards of U L rows
    (``layouts.active_steps``). Shapes, layout and band alone decide, which every rank of
    the grid agrees on, as the chunks must be the same on all."""
    batch, local, heads, head_dim = q.shape

    def pays() -> bool:
        alltoall = unchunked_alltoall_ms(batch * local, heads, entries, head_dim, q.element_size(), grid.heads_world)
        if getattr(layout, "kind", None) == "documents" and tuple(band) == (None, 0):
            steps = layout.steps  # its own count, the same, which its ring's plan asks for anyway
        else:
            steps = active_steps(layout, grid.ring_world, grid.heads_world * local, band)
        return chunks_pay(alltoall, steps)
    return head_chunks(entries, batch * local * heads, pays)


def ring_buffer_bytes(q: torch.Tensor, k: torch.Tensor) -> int:
    """The ring's own buffers at their peak, in the backward of a ring of three ranks or
    more (``ring/rotate.py``), for q (B, S, H, D) and k (B, S, Hkv, D): the fp32 dQ sum,
    four fp32 dK/dV sums (the running one, the one sent on, the own shard's, and with the
    fused Gluon kernel a visiting step's own; three with the Triton kernels) and two slots
    of visiting K/V in k's dtype."""
    tokens, head_dim, kv_heads = q.shape[0] * q.shape[1], q.shape[3], k.shape[2]
    return tokens * head_dim * (4 * q.shape[2] + 32 * kv_heads + 4 * kv_heads * k.element_size())


def memory_chunks(q: torch.Tensor, k: torch.Tensor, world: int, total_memory: Optional[int] = None) -> int:
    """How many chunks a ring alone of ``world`` ranks runs a call's heads in, one after
    another (the module's docstring, "Memory"): a divisor of kv_heads, so each chunk has
    whole GQA groups. RINGFLASH_HEAD_CHUNKS=k asks for k (the largest such divisor up to
    k). By default the fewest whose share of ``ring_buffer_bytes`` fits ``MEMORY_SHARE``
    of the GPU's memory: 1 for a ring of one, on the CPU, and for every shape that fits,
    which at 32 heads / 8 kv heads, head_dim 128, bf16, on an 80 GB GPU is up to 256k
    local tokens (14 GiB of buffers; 2 chunks at 512k, 4 at 1M). The choice depends on
    shapes and the GPU's total memory only; ranks whose GPUs differ in memory may choose
    differently, and the ring's rank check then raises on every rank (the chunks' head
    counts differ). ``total_memory``: the GPU's bytes
    (default: q's device's; tensors on the meta device need it)."""
    wanted = _wanted_chunks()
    if wanted is None and (world == 1 or (total_memory is None and not q.is_cuda)):
        return 1
    if wanted is None and total_memory is None:
        total_memory = torch.cuda.get_device_properties(q.device).total_memory
    return chunks_for(ring_buffer_bytes(q, k), total_memory, k.shape[2], wanted)


def chunks_for(need: int, total_memory: Optional[int], kv_heads: int, wanted: Optional[int] = None) -> int:
    """``memory_chunks``'s rule: the largest divisor of ``kv_heads`` up to ``wanted``, or
    (wanted None) the fewest chunks whose share of ``need`` bytes fits ``MEMORY_SHARE`` of
    ``total_memory`` (all of them when none does)."""
    divisors = [c for c in range(1, kv_heads + 1) if kv_heads % c == 0]
    if wanted is not None:
        return max(c for c in divisors if c <= wanted)
    return next((c for c in divisors if need <= MEMORY_SHARE * total_memory * c), divisors[-1])


def ring_over_heads(q, k, v, grid: Grid, segments, block_mask, *, softmax_scale: float, band, layout: str,
                    dropout: tuple, deterministic: bool = False):
    """out (B, L, H, D) and lse (B, H, L) of this rank's tokens: the ring (``ops.ring_attn``'s
    arguments: softmax_scale, band, layout, dropout (p, seed), deterministic) over grid.ring on the
    head-split tensors, chunked and overlapped with the exchanges where it can be."""
    world, heads, rank = grid.heads_world, q.shape[2], grid.heads_rank
    per_rank, kv = heads // world, kv_index(heads, k.shape[2], world)
    chunks = grid_chunks(q, kv.shape[1], grid, layout, band) if eager(q, k, v) else 1
    segments2 = None if segments is None else _gather_tokens(segments, grid.heads, world)
    blocks = [_head_rows(block_mask, rank * per_rank + c * per_rank // chunks, per_rank // chunks)
              for c in range(chunks)]
    if chunks == 1:
        whole_groups = per_rank % (heads // k.shape[2]) == 0  # each kv head to one rank, in order
        q2 = _ToHeads.apply(q, torch.arange(heads).view(world, per_rank), grid.heads, True)
        k2, v2 = (_ToHeads.apply(x, kv, grid.heads, whole_groups) for x in (k, v))
        out2, lse2 = ring_attn(q2, k2, v2, segments2, softmax_scale=softmax_scale, band=band, layout=layout,
                               dropout=(*dropout, rank * per_rank), blocks=blocks[0], group=grid.ring,
                               deterministic=deterministic)
        out = _ToSequence.apply(out2, grid.heads, world)
        lse = _ToSequence.apply(rearrange(lse2, "b h s -> b s h"), grid.heads, world)
        return out, rearrange(lse, "b s h -> b h s")
    entries = rearrange(kv, "u (c n) -> u c n", c=chunks).tolist()
    call = _Call(grid.heads, world, tuple(tuple(map(tuple, row)) for row in entries), segments2, blocks,
                 [rank * per_rank + c * per_rank // chunks for c in range(chunks)],
                 (softmax_scale, *band, layout, None, group_name(grid.ring)), dropout[:2], deterministic)
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _Overlapped.apply(q, k, v, call, requires_grad)


def ring_in_chunks(q, k, v, chunks: int, group, segments, block_mask, *, softmax_scale: float, band,
                   layout, dropout: tuple, deterministic: bool = False):
    """out (B, S, H, D) and lse (B, H, S) of the ring alone over ``group`` (``ops.ring_attn``'s
    arguments), its heads in ``chunks`` chunks run one after another (``memory_chunks``)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    m, e = heads // chunks, kv_heads // chunks
    call = _Call(None, 1, (tuple(tuple(range(c * e, (c + 1) * e)) for c in range(chunks)),), segments,
                 [_head_rows(block_mask, c * m, m) for c in range(chunks)], [c * m for c in range(chunks)],
                 (softmax_scale, *band, layout, None, group_name(group)), dropout[:2], deterministic)
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _Sequential.apply(q, k, v, call, requires_grad)


def _head_rows(block_mask: Optional[torch.Tensor], start: int, count: int) -> Optional[torch.Tensor]:
    """A per-head block mask's rows of query heads [start, start + count) (a shared one as
    it is), the same tensor object every call while the mask is, so the ring's checksum of
    it is computed once (``tensor_memo``)."""
    if block_mask is None or block_mask.shape[0] == 1:
        return block_mask
    if torch.compiler.is_compiling():  # a graph takes the rows as an op of its own
        return block_mask[start:start + count]
    return tensor_memo(block_mask, ("heads", start, count), lambda: block_mask[start:start + count].clone())


# ----------------------------------------------------------------------------- composed (C = 1)


class _ToHeads(torch.autograd.Function):
    """x (B, L, Hx, D) -> (B, U L, n, D): rank u gets heads index[u] of every rank's L
    tokens, in order of rank. The gradient goes back through the opposite exchange and
    sums over the ranks (and entries) that read a head. ``in_order``: index lists every
    head once, in order (query heads; kv heads where every rank reads whole GQA groups), so
    nothing is picked or summed (a Python bool: torch.compile traces no comparison)."""

    @staticmethod
    def forward(ctx, x, index, group, in_order: bool):
        ctx.group, ctx.index, ctx.heads = group, index, x.shape[2]
        ctx.in_order = in_order
        picked = x if ctx.in_order else x[:, :, index.flatten().to(x.device)]
        return _exchange(picked, group, index.shape[0], "b l (u n) d -> u b l n d", "u b l n d -> b (u l) n d")

    @staticmethod
    def backward(ctx, grad):
        back = _exchange(grad, ctx.group, ctx.index.shape[0], "b (u l) n d -> u b l n d", "u b l n d -> b l (u n) d")
        if ctx.in_order:
            return back, None, None, None
        dx = back.new_zeros(*back.shape[:2], ctx.heads, back.shape[3])
        return dx.index_add_(2, ctx.index.flatten().to(grad.device), back), None, None, None


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


# ----------------------------------------------------------------------------- overlapped (C > 1)


@dataclass
class _Call:
    """One chunked call: the heads group and its size U, the kv entries of each rank and
    chunk (U, C, n), the ring shard's segment ids, each chunk's block mask and first global
    query head, and the ring op's other arguments (softmax_scale, band_lo, band_hi, layout,
    its spec (None: eager callers pass the layout itself), ring group name; dropout p, seed), and whether the backward
    must repeat its bits (``deterministic``)."""

    group: object
    world: int
    kv: tuple
    segments: Optional[torch.Tensor]
    blocks: list
    head0: list
    ring: tuple
    dropout: tuple
    deterministic: bool = False

    @property
    def chunks(self) -> int:
        return len(self.kv[0])

    def forward(self, c: int, q2, k2, v2, requires_grad: bool):
        return ring_attn_forward_impl(q2, k2, v2, self.segments, self.blocks[c], *self.ring, *self.dropout,
                                      self.head0[c], requires_grad, self.deterministic)

    def backward(self, c: int, dout2, q2, k2, v2, out2, lse2, dlse2, kept_kv, kept_segments, into=None):
        return ring_attn_backward_impl(into, dout2, q2, k2, v2, out2, lse2, dlse2, self.segments, self.blocks[c],
                                       kept_kv, kept_segments, *self.ring, *self.dropout, self.head0[c],
                                       self.deterministic)


@functools.lru_cache(maxsize=64)
def _kv_picks(kv: tuple, device: torch.device) -> Optional[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """None where the kv entries (U, C, n) are the kv heads in order (u, c, n): each kv head
    goes to one rank and a chunk's are consecutive (U divides Hkv), so a rearrangement sends
    them and puts their gradients back. Else (per chunk, the kv heads it sends in order
    (u, n); all entries in order (u, c, n), where the returned gradients add, in one pass as
    the unchunked call adds them), on ``device``, made once: a host-to-device copy waits
    for the GPU."""
    index = torch.tensor(kv)
    if torch.equal(index.flatten(), torch.arange(index.numel())):
        return None
    return (tuple(rearrange(index[:, c], "u n -> (u n)").to(device) for c in range(index.shape[1])),
            rearrange(index, "u c n -> (u c n)").to(device))


def _chunk_of(x: torch.Tensor, c: int, call: "_Call", picks=None) -> torch.Tensor:
    """Chunk c of x (B, L, Hx, D) for every heads rank, (U, B, L, n, D) contiguous: its query
    heads (``picks`` None on query heads), or the kv entries it sends (``_kv_picks``)."""
    if picks is None:
        return rearrange(x, "b l (u c n) d -> c u b l n d", u=call.world, c=call.chunks)[c].contiguous()
    return rearrange(x.index_select(2, picks[0][c]), "b l (u n) d -> u b l n d", u=call.world).contiguous()


def _post(send: torch.Tensor, recv: torch.Tensor, group) -> tuple:
    """Start the all-to-all of ``send`` (U, ...) into ``recv``: (its work, and the two
    tensors, kept alive until ``_wait``)."""
    return dist.all_to_all_single(recv, send, group=group, async_op=True), send, recv


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def _aside(device: torch.device):
    """Work queued within on a stream of its own (CUDA), after the current stream's work so
    far: the copies into and out of the all-to-alls' buffers, which then run beside the
    attention kernels instead of between them. ``_rejoin`` orders the current stream after
    it. On the CPU, the work runs in order."""
    if device.type != "cuda":
        yield
        return
    side, current = _side_stream(device), torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield


def _rejoin(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).wait_stream(_side_stream(device))


def _post_chunks(sends: Callable[[int], list], device: torch.device, call: "_Call") -> tuple[list, list]:
    """Post every chunk's all-to-alls, chunk 0's first: ``sends`` makes chunk c's tensors,
    copied out aside (``_aside``) so that chunk 0 leaves before the later chunks are
    copied and its kernels start while they are. Returns (what each chunk posted, each
    chunk's received tensors, for the current stream once it has waited for them)."""
    posted, recvs = [], []
    current = torch.cuda.current_stream(device) if device.type == "cuda" else None
    with _aside(device):
        for c in range(call.chunks):
            out = sends(c)
            recvs.append([torch.empty_like(s) for s in out])
            for r in recvs[-1] if current is not None else ():
                r.record_stream(current)  # made aside, read by the kernels
            posted.append([_post(s, r, call.group) for s, r in zip(out, recvs[-1])])
    return posted, recvs


def _send_home(t: torch.Tensor, split: str, recv: torch.Tensor, call: "_Call") -> tuple:
    """``_post`` of a chunk's result (ring layout, rows of every heads rank) split by rank."""
    return _post(rearrange(t, split, u=call.world).contiguous(), recv, call.group)


def _wait(posted) -> None:
    for work, *_ in posted:
        work.wait()


def _land(posted: list, place, device: torch.device) -> list:
    """Once ``posted`` has arrived, ``place()`` copies what it brought to where it belongs,
    aside: the current stream goes on with the next chunk's kernels. Returns ``posted``,
    whose tensors the caller keeps until it has called ``_rejoin`` (the current stream may
    reuse their memory only once the transfers are done)."""
    with _aside(device):
        _wait(posted)
        place()
    return posted


class _Overlapped(torch.autograd.Function):
    """out (B, L, H, D), lse (B, H, L) of ``ring_over_heads``, chunk by chunk (the module's
    docstring): chunk c holds query heads [c m, (c + 1) m) of every rank's share, m = H / U / C."""

    @staticmethod
    def forward(ctx, q, k, v, call: _Call, requires_grad: bool):
        world, chunks = call.world, call.chunks
        picks = _kv_picks(call.kv, q.device)
        posted, recvs = _post_chunks(lambda c: (_chunk_of(q, c, call), *(_chunk_of(x, c, call, picks)
                                                                             for x in (k, v))), q.device, call)
        b, n, h, d = q.shape
        out = q.new_empty(q.shape)
        lse = q.new_empty((b, h, n), dtype=torch.float32)
        out_at = rearrange(out, "b l (u c m) d -> c u b l m d", u=world, c=chunks)
        lse_at = rearrange(lse, "b (u c m) l -> c u b m l", u=world, c=chunks)
        saved, homes = [], []
        for c in range(chunks):
            _wait(posted[c])
            q2, k2, v2 = (rearrange(r, "u b l n d -> b (u l) n d") for r in recvs[c])
            out2, lse2, kept_kv, kept_segments = call.forward(c, q2, k2, v2, requires_grad)
            out_home = out2.new_empty(out_at[c].shape)
            lse_home = lse2.new_empty(lse_at[c].shape)
            homes += _land([_send_home(out2, "b (u l) m d -> u b l m d", out_home, call),
                            _send_home(lse2, "b m (u l) -> u b m l", lse_home, call)],
                           functools.partial(_copy_pairs, ((out_at[c], out_home), (lse_at[c], lse_home))), q.device)
            saved += [q2, k2, v2, out2, lse2, kept_kv, kept_segments]
        _rejoin(q.device)
        ctx.save_for_backward(*saved)
        ctx.call, ctx.shape, ctx.kv_heads = call, q.shape, k.shape[2]
        ctx.set_materialize_grads(False)  # an unused lse's gradient stays None, as the ring op's
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        no_double_backward()
        call, saved = ctx.call, ctx.saved_tensors
        world, chunks = call.world, call.chunks
        q2, k2 = saved[:2]  # chunk 0's: the shapes and dtypes of every chunk's
        dout = q2.new_zeros(ctx.shape) if dout is None else dout  # only lse was used
        posted, recvs = _post_chunks(lambda c: [_chunk_of(dout, c, call)] + (
            [] if dlse is None else
            [rearrange(dlse, "b (u c m) l -> c u b m l", u=world, c=chunks)[c].contiguous()]), dout.device, call)
        b, n = ctx.shape[:2]
        picks = _kv_picks(call.kv, dout.device)
        dq = q2.new_empty(ctx.shape)
        dq_at = rearrange(dq, "b l (u c m) d -> c u b l m d", u=world, c=chunks)
        dkv = k2.new_empty((2, b, n, ctx.kv_heads, k2.shape[-1]))
        dkv_homes = None if picks is None else k2.new_empty((chunks, world, 2, b, n, *k2.shape[2:]))
        homes = []
        for c in range(chunks):
            _wait(posted[c])
            dout2 = rearrange(recvs[c][0], "u b l m d -> b (u l) m d")
            dlse2 = None if dlse is None else rearrange(recvs[c][1], "u b m l -> b m (u l)")
            q2, k2, v2, out2, lse2, kept_kv, kept_segments = saved[7 * c:7 * c + 7]
            dq2, dkv2 = call.backward(c, dout2, q2, k2, v2, out2, lse2, dlse2, kept_kv, kept_segments)
            dq_home = dq2.new_empty(dq_at[c].shape)
            dkv_home = dkv2.new_empty((world, *dkv2.shape[:2], n, *dkv2.shape[3:])) if picks is None else dkv_homes[c]
            homes += _land([_send_home(dq2, "b (u l) m d -> u b l m d", dq_home, call),
                            _send_home(dkv2, "t b (u l) n d -> u t b l n d", dkv_home, call)],
                           functools.partial(_place_chunk, c, dq_at, dq_home, dkv, dkv_home, picks is None, call),
                           dout.device)
        _rejoin(dout.device)
        if picks is not None:  # kv heads read on several ranks: their gradients summed
            dkv.zero_().index_add_(3, picks[1], rearrange(dkv_homes, "c u t b l n d -> t b l (u c n) d"))
        return dq, dkv[0], dkv[1], None, None


def _copy_pairs(pairs) -> None:
    for dst, src in pairs:
        dst.copy_(src)


def _place_chunk(c: int, dq_at, dq_home, dkv, dkv_home, in_order: bool, call: _Call) -> None:
    """Chunk c's gradients, arrived from every heads rank: dq into its heads, and where each
    kv head went to one rank (``_kv_picks``), dK/dV into the kv heads the chunk read."""
    dq_at[c].copy_(dq_home)
    if in_order:
        rearrange(dkv, "t b l (u c n) d -> c u t b l n d", u=call.world, c=call.chunks)[c].copy_(dkv_home)


# ----------------------------------------------------------------------------- one after another (U = 1)


def _chunk_slices(call: _Call, q: torch.Tensor, k: torch.Tensor) -> list[tuple[slice, slice]]:
    """(query heads, kv heads) of each chunk of ``ring_in_chunks``."""
    m, e = q.shape[2] // call.chunks, k.shape[2] // call.chunks
    return [(slice(c * m, (c + 1) * m), slice(c * e, (c + 1) * e)) for c in range(call.chunks)]


def _copy_aside(pairs, device: torch.device) -> None:
    """dst.copy_(src) for each (dst, src), aside (``_aside``): a chunk's results into its
    heads while the next chunk's kernels run. Each src stays allocated until its copy is
    done; the caller ``_rejoin``s before the destinations are read."""
    with _aside(device):
        for dst, src in pairs:
            dst.copy_(src)
            if device.type == "cuda":
                src.record_stream(torch.cuda.current_stream(device))


class _Sequential(torch.autograd.Function):
    """out (B, S, H, D), lse (B, H, S) of ``ring_in_chunks``: chunk c's ring runs on views
    of q, k, v (its heads; the copy engines send its K/V from those views in place); its
    out is copied into the whole tensor beside the next chunk's kernels, its gradients go
    into theirs (where the ring writes them, else copied: ``ring_backward``'s into), so
    the ring's buffers and a chunk's results are all that is alive beside them. What a chunk
    costs beyond its kernels (out's copy, dout's strided reads, its own ring's trips):
    docs/performance.md, "Masks through the ring, 2 × H200"."""

    @staticmethod
    def forward(ctx, q, k, v, call: _Call, requires_grad: bool):
        b, n, h, _ = q.shape
        out = q.new_empty(q.shape)
        lse = q.new_empty((b, h, n), dtype=torch.float32)
        kept = []
        for c, (hs, ks) in enumerate(_chunk_slices(call, q, k)):
            out_c, lse_c, kept_kv, kept_segments = call.forward(c, q[:, :, hs], k[:, :, ks], v[:, :, ks],
                                                                requires_grad)
            _copy_aside([(out[:, :, hs], out_c), (lse[:, hs], lse_c)], q.device)
            kept += [kept_kv, kept_segments]
        _rejoin(q.device)
        ctx.save_for_backward(q, k, v, out, lse, *kept)
        ctx.call = call
        ctx.set_materialize_grads(False)  # an unused lse's gradient stays None, as the ring op's
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        no_double_backward()
        q, k, v, out, lse, *kept = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout  # only lse was used
        dq, dkv = torch.empty_like(q), k.new_empty((2, *k.shape))
        for c, (hs, ks) in enumerate(_chunk_slices(ctx.call, q, k)):
            ctx.call.backward(c, dout[:, :, hs], q[:, :, hs], k[:, :, ks], v[:, :, ks], out[:, :, hs], lse[:, hs],
                              None if dlse is None else dlse[:, hs], *kept[2 * c:2 * c + 2],
                              into=(dq[:, :, hs], dkv[:, :, :, ks]))
        return dq, dkv[0], dkv[1], None, None
