"""The sequence-parallel self-attention layer, and the two collectives that go with it.

Sequence parallelism in one paragraph. Every rank of the sequence-parallel group holds
ALL the parameters and a slice of every sequence (``ringflash.shard`` with the layer's
``layout``). Projections, norms, MLPs and the loss are per token, so they run on the
local slice as they are; only attention needs the other ranks' tokens, and
``ring_flash_attn`` supplies them exactly. Rotary embeddings use the GLOBAL position
of each local token (``ringflash.positions``), so the result equals the same layer on
the whole sequence in one process.

Gradients. Let the loss be a mean over all N labelled tokens of the global sequence,
L = (1/N) * sum_r S_r, with S_r the sum of the token losses that live on rank r. Each
rank calls backward on its own term ``S_r / N`` (N is the GLOBAL count, not the local
one). The ring's backward sends every dK/dV back to the rank that owns those keys, so
after backward rank r holds dL/dtheta restricted to the uses of theta on its own
tokens, and the full gradient is the SUM over the group: call
``all_reduce_gradients(model.parameters(), group)`` (SUM, no division) before the
optimizer step. Every rank then holds the same gradient and, from the same initial
parameters (``broadcast_parameters``), takes the same step: the parameters stay
identical without DDP. If you prefer per-rank means (S_r / N_r with equal N_r),
divide the summed gradient by the group size instead: it is the same number.

With data parallelism (a 2-D mesh, dp x sp ranks; each dp replica sees other
sequences, each sp group splits one set of sequences):
- simplest: normalize each rank's loss by the token count of the WHOLE global batch
  (all dp replicas) and SUM the gradients over all dp*sp ranks in one all-reduce
  (``all_reduce_gradients(params, group=None)``). This is what launch/train.py does.
- with DDP over the dp group (``DDP(model, process_group=dp_group)``), which averages
  over dp: keep ``S_r / N_replica`` as each rank's loss (N_replica the token count of
  that replica's sequences) and call ``all_reduce_gradients(params, sp_group)`` after
  backward. Or wrap the model in DDP over the WHOLE world, which divides the summed
  gradient by dp*sp: then scale each rank's loss by sp, i.e. ``sp * S_r / N_replica``.
Both reductions are linear, so their order is free. The ring talks only within its own
group; DDP's bucketed all-reduce runs on its group's communicator. DDP broadcasts the
parameters of its group's rank 0 when it is built: over the dp group only, the sp ranks
must already agree (same seed, or ``broadcast_parameters`` over the world).
"""

from __future__ import annotations

import numbers
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import agreement, api
from .groups import resolve_grid
from .kernels import SUPPORTED_DTYPES, check_causal, check_deterministic, check_dropout, check_window
from .layouts import DEFAULT_LAYOUT, check_layout, check_local_length, layout_code


# ----------------------------------------------------------------------------- rotary embeddings


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, base: float = 10000.0):
    """cos, sin (seqlen, head_dim // 2) fp32 for the given global positions.

    Angles are formed in float64: at position 1e5 an fp32 angle is off by ~1e-2 rad.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
                        / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seqlen, heads, head_dim) by (seqlen, head_dim // 2) angles, "rotate
    half" convention (GPT-NeoX, Llama); computed in fp32, returned in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------- the layer


class RingSelfAttention(nn.Module):
    """Multi-head self-attention over a sequence sharded across a process group.

    Args:
        d_model: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA; defaults to num_heads, 1 is MQA); must divide
            num_heads.
        head_dim: defaults to d_model // num_heads; must be even (rotary).
        causal: causal mask on global positions.
        layout: how sequences are split over the group ("zigzag", the default of every
            ringflash function, "contiguous", "stripe", "block_stripe", or a
            ``ringflash.document_layout``); inputs must have been sharded
            with the same layout (``ringflash.shard(x, dim=1, layout=layout, group=group)``,
            or build the layer with ``SequenceParallel.self_attention``, which cannot differ),
            unless forward is given the layout of its shards (``layout=``).
        group: the sequence-parallel process group (None: the world; without an
            initialized process group the layer is plain single-device attention), or a
            DeviceMesh: 1-D, or ``(mesh, dim)``; or a heads x ring grid (a 2-D DeviceMesh
            or ``(head_group, ring_group)``, ``ringflash.heads``).
        rope_base: rotary base (theta); raise it for very long contexts.
        bias: biases on the projections.
        window_size: (left, right) sliding window on global positions, -1 = unbounded
            (see ``ring_flash_attn``).
        dropout_p: attention dropout, applied in training mode only.
        deterministic: the backward's bits the same run to run (``ring_flash_attn``'s: the
            default may add dQ in arrival order on Hopper).

    forward(x, positions=None, segment_ids=None, dropout_seed=None, block_mask=None, layout=None):
        x: (batch, seqlen_local, d_model), this rank's tokens; the same shape on every rank.
        positions: optional (seqlen_local,) int64 global positions of those tokens;
            default ``ringflash.positions(seqlen_local * world, layout, group)``. With
            packed documents, rotary positions may restart per document: pass them here.
        segment_ids: optional (batch, seqlen_local) document ids of those tokens, -1 for
            padding (``ring_flash_attn``'s rules), sharded with the layer's layout.
        dropout_seed: the dropout seed of this call (an int, the same on every rank); None
            draws one from torch's default generator (``ring_flash_attn``'s ``seed``).
        block_mask: optional bool (heads or 1, N / 128, N / 128) block-sparse mask over
            GLOBAL token blocks, the same tensor on every rank (``ring_flash_attn``'s).
        layout: the layout ``x`` was sharded with, for this call only (default: the
            layer's): a batch whose layout is computed from its own documents, e.g. one
            ``ringflash.document_layout`` per sequence length of a curriculum, or
            ``SequenceParallel.for_documents(...).layout``. It gives the default positions
            and the ring's schedule, over the layer's group.
        Returns (batch, seqlen_local, d_model).

    Parameters are NOT synchronized by the layer: start every rank from the same values
    (same seed, or ``broadcast_parameters``) and sum the gradients over the group after
    backward (``all_reduce_gradients``); the module docstring says why a SUM is exact.
    Every rank of the group must call forward and backward together (the ring is a
    collective).
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: Optional[int] = None, *,
                 head_dim: Optional[int] = None, causal: bool = True, layout: str = DEFAULT_LAYOUT,
                 group=None, rope_base: float = 10000.0, bias: bool = False,
                 window_size: tuple[int, int] = (-1, -1), dropout_p: float = 0.0,
                 deterministic: bool = False, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads}) "
                                 "unless head_dim is given")
            head_dim = d_model // num_heads
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = (
            d_model, num_heads, num_kv_heads, head_dim)
        self.causal = check_causal(causal)
        self.layout = check_layout(layout)
        self.window_size = check_window(window_size)
        self.dropout_p, _ = check_dropout(dropout_p, 0)
        self.deterministic = check_deterministic(deterministic)
        self.group = resolve_grid(group)
        self.rope_base = float(rope_base)
        factory = dict(device=device, dtype=dtype)
        # One matmul for q, k and v: columns [q heads | k heads | v heads].
        self.qkv_proj = nn.Linear(d_model, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias,
                                  **factory)
        self.out_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias, **factory)
        self._rotary_cache: tuple = (None, None, None)  # (key, cos, sin), last one only

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"causal={self.causal}, layout={self.layout!r}, window_size={self.window_size}, "
                f"dropout_p={self.dropout_p}")

    def local_positions(self, seqlen_local: int, device=None, layout=None) -> torch.Tensor:
        """Global positions of this rank's ``seqlen_local`` tokens under ``layout`` (default:
        the layer's)."""
        return api.positions(seqlen_local * self.group.world,
                             layout=self.layout if layout is None else layout, group=self.group,
                             device=device)

    def _rotary(self, seqlen_local: int, positions: Optional[torch.Tensor], device, layout=None):
        if positions is not None:
            if positions.shape != (seqlen_local,):
                raise ValueError(f"positions must have shape ({seqlen_local},), "
                                 f"got {tuple(positions.shape)}")
            return rotary_cos_sin(positions.to(device), self.head_dim, self.rope_base)
        layout = self.layout if layout is None else layout
        key = (seqlen_local, self.group.world, str(device), layout_code(layout))
        if self._rotary_cache[0] != key:
            pos = self.local_positions(seqlen_local, device, layout)
            self._rotary_cache = (key, *rotary_cos_sin(pos, self.head_dim, self.rope_base))
        return self._rotary_cache[1:]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                segment_ids: Optional[torch.Tensor] = None, dropout_seed: Optional[int] = None,
                block_mask: Optional[torch.Tensor] = None, layout=None) -> torch.Tensor:
        """(B, S_local, H, D) x (B, S_local, Hkv, D) -> (B, S_local, H, D) over the ring, whose
        shards follow ``layout`` (default: the layer's)."""
        dropout_p = self.dropout_p if self.training else 0.0
        return api.ring_flash_attn(q, k, v, causal=self.causal, group=self.group,
                                   layout=self.layout if layout is None else layout,
                                   segment_ids=segment_ids, window_size=self.window_size,
                                   dropout_p=dropout_p, seed=dropout_seed if dropout_p else None,
                                   block_mask=block_mask, deterministic=self.deterministic)

    def _check_input(self, x, layout) -> None:
        """TypeError/ValueError naming ``x`` unless it can be this rank's tokens of ``layout``."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"x must be float16, bfloat16 or float32 (the dtypes attention runs in), "
                            f"got {x.dtype}")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (batch, seqlen_local, {self.d_model}), got {tuple(x.shape)}")
        check_local_length(x.shape[1], layout, "x", self.group.heads_world)

    def _project(self, x: torch.Tensor, positions: Optional[torch.Tensor], layout):
        """q (B, S_local, H, D) and k, v (B, S_local, Hkv, D) of x (B, S_local, d_model), q and
        k rotated at their global positions (under ``layout`` unless ``positions`` are given)."""
        self._check_input(x, layout)
        b, n, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).view(b, n, h + 2 * hkv, d).split([h, hkv, hkv], dim=2)
        cos, sin = self._rotary(n, positions, x.device, layout)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.contiguous()

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None,
                segment_ids: Optional[torch.Tensor] = None, dropout_seed: Optional[int] = None,
                block_mask: Optional[torch.Tensor] = None, layout=None) -> torch.Tensor:
        try:
            layout = self.layout if layout is None else check_layout(layout)
            q, k, v = self._project(x, positions, layout)
        except Exception as error:  # noqa: BLE001 - whatever it is, the other ranks must hear of it
            # The other ranks are already in the ring's rank check: join it, as a rank that
            # rejected its arguments, so they raise too instead of waiting for this one.
            agreement.raise_on_every_rank(self.group, error)
        out = self._attend(q, k, v, segment_ids, dropout_seed, block_mask, layout=layout)
        return self.out_proj(out.flatten(2))


# ----------------------------------------------------------------------------- parameter sync


# What the ranks compare before broadcasting a module's tensors or reducing gradients.
_MODULE_FIELDS = agreement.tensors_fields("the module's parameters and buffers")
_GRAD_FIELDS = agreement.tensors_fields("the parameters' .grad")


def broadcast_parameters(module: nn.Module, group=None, src: int = 0) -> None:
    """Copy the parameters and buffers of ``group``'s rank ``src`` to every rank of it.

    The ranks first compare how many tensors they hold, of which dtypes and shapes (one
    all-gather of 4 int64, ``agreement.agree``): modules that differ make every rank raise
    a ValueError instead of a broadcast of mismatched tensors."""
    grid = resolve_grid(group)
    tensors = [*module.parameters(), *module.buffers()]

    def local_checks():
        world = grid.ring_world if grid.heads_world == 1 else 1  # a grid broadcasts from its rank 0
        if isinstance(src, bool) or not isinstance(src, numbers.Integral) or not 0 <= src < world:
            raise ValueError(f"src must be a rank of the group, in [0, {world}), got {src!r}"
                             + (" (a heads x ring grid broadcasts from its rank 0)" if world == 1 else ""))
        return agreement.tensors_row(tensors), None
    agreement.agree(grid, "broadcast_parameters", _MODULE_FIELDS, local_checks)
    with torch.no_grad():
        for g in grid.groups():  # on a grid: over the heads group, then the ring, from (0, 0)
            src_global = dist.get_global_rank(g, src) if g is not None else src
            for t in tensors:
                dist.broadcast(t.data, src_global, group=g)


def all_reduce_gradients(parameters: Iterable[torch.Tensor], group=None) -> None:
    """SUM every parameter's .grad over ``group`` in place (one all-reduce per dtype).

    With each rank's loss normalized by the GLOBAL token count this yields the exact
    gradient of the global loss on every rank. A parameter without a gradient on some
    rank must be without one on all (None is skipped): the ranks first compare how many
    gradients they hold, of which dtypes and shapes (one all-gather of 4 int64,
    ``agreement.agree``), and all raise a ValueError where they differ.
    """
    grid = resolve_grid(group)
    if grid.world == 1:
        return
    grads = [p.grad for p in parameters if p.grad is not None]
    agreement.agree(grid, "all_reduce_gradients", _GRAD_FIELDS, lambda: (agreement.tensors_row(grads), None))
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same_dtype in by_dtype.values():
        flat = grid.all_reduce(_flatten_dense_tensors(same_dtype))
        for g, synced in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            g.copy_(synced)
