"""Block masks for block-sparse attention: the common patterns, and one from a mask_mod.

A block mask is a bool tensor (heads or 1, cdiv(seqlen_q, BLOCK), cdiv(seqlen_k, BLOCK))
over token blocks of BLOCK = 128: block (a, c) covers queries [a * BLOCK, (a + 1) * BLOCK)
and keys [c * BLOCK, (c + 1) * BLOCK). ``flash_attn(..., block_mask=)`` and
``ring_flash_attn(..., block_mask=)`` (where the blocks are over GLOBAL positions and the
mask is the same tensor on every rank) never compute a False block; inside a True block
the elements follow ``causal``, ``window_size`` and ``segment_ids``. So a block mask
only ever removes whole blocks: element-level structure belongs in those arguments.

Every helper returns a CPU tensor unless ``device`` says otherwise, and draws nothing
from torch's global generator: the same arguments give the same mask on every rank.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .masks import BLOCK

__all__ = ["BLOCK", "block_mask_from_mask_mod", "density", "expand_block_mask",
           "local_global_block_mask", "random_block_mask", "strided_block_mask"]


def _blocks(seqlen: int, name: str = "seqlen") -> int:
    if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < 1:
        raise ValueError(f"{name} must be a positive int, got {seqlen!r}")
    return -(-seqlen // BLOCK)


def _count(x, name: str, low: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise ValueError(f"{name} must be an int >= {low}, got {x!r}")
    return x


def _finish(mask: torch.Tensor, heads: int, causal: bool, device) -> torch.Tensor:
    """(heads, n, n) from a (n, n) or (heads, n, n) pattern, lower triangle kept if causal."""
    if causal:
        mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
    return mask.expand(heads, *mask.shape[-2:]).contiguous().to(device)


def local_global_block_mask(seqlen: int, *, local_blocks: int, global_blocks: int = 0,
                            heads: int = 1, causal: bool = False, device=None) -> torch.Tensor:
    """Local + global attention (Longformer, BigBird): block a sees the blocks within
    ``local_blocks`` - 1 of it on each side (its own block at least), and the first
    ``global_blocks`` blocks see, and are seen by, every block. (heads, n, n)."""
    n = _blocks(seqlen)
    _count(local_blocks, "local_blocks", 1)
    _count(global_blocks, "global_blocks")
    a = torch.arange(n)[:, None]
    c = torch.arange(n)[None, :]
    mask = ((a - c).abs() < local_blocks) | (a < global_blocks) | (c < global_blocks)
    return _finish(mask, _count(heads, "heads", 1), causal, device)


def strided_block_mask(seqlen: int, *, stride: int, local_blocks: int = 1, heads: int = 1,
                       causal: bool = False, device=None) -> torch.Tensor:
    """Fixed strided attention (the Sparse Transformer's pattern): block a sees the blocks
    within ``local_blocks`` - 1 of it and every block c with (a - c) a multiple of
    ``stride``. (heads, n, n)."""
    n = _blocks(seqlen)
    _count(stride, "stride", 1)
    _count(local_blocks, "local_blocks", 1)
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    mask = (d.abs() < local_blocks) | (d % stride == 0)
    return _finish(mask, _count(heads, "heads", 1), causal, device)


def random_block_mask(seqlen: int, density: float, *, heads: int = 1, seed: int = 0,
                      diagonal: bool = True, device=None) -> torch.Tensor:
    """round(density * n * n) blocks per head drawn uniformly without replacement (an exact
    density, so benchmarks at a density compare like with like), from a generator seeded
    with ``seed``; with ``diagonal`` the diagonal blocks are drawn first, so every query
    block sees something. (heads, n, n)."""
    n = _blocks(seqlen)
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 <= density <= 1:
        raise ValueError(f"density must be a float in [0, 1], got {density!r}")
    heads = _count(heads, "heads", 1)
    gen = torch.Generator().manual_seed(_count(seed, "seed"))
    want = round(density * n * n)
    mask = torch.zeros(heads, n * n, dtype=torch.bool)
    for h in range(heads):
        order = torch.randperm(n * n, generator=gen)
        if diagonal:  # diagonal blocks (flat index a * (n + 1)) first, the rest after
            on_diag = order % (n + 1) == 0
            order = torch.cat([order[on_diag], order[~on_diag]])
        mask[h, order[:want]] = True
    return mask.view(heads, n, n).to(device)


def block_mask_from_mask_mod(mask_mod: Callable, *, heads: int, seqlen_q: int,
                             seqlen_k: Optional[int] = None, partial: bool = False,
                             device=None) -> torch.Tensor:
    """The block mask of a FlexAttention-style ``mask_mod(b, h, q_idx, k_idx) -> bool``
    (broadcasting int64 tensors; b is 0: block masks are shared across the batch): a block
    is True iff the mask_mod leaves some element of it visible. Evaluated one row of blocks
    at a time on ``device``, O(heads * seqlen_q * seqlen_k) calls' worth of elements.

    The kernels apply a block mask to whole blocks only. A block that the mask_mod leaves
    partly visible is computed whole unless causal / window_size / segment_ids mask its
    elements, so by default such blocks raise ValueError; pass ``partial=True`` once those
    arguments express the element-level part (e.g. a causal mask_mod with causal=True).
    (heads, cdiv(seqlen_q, BLOCK), cdiv(seqlen_k, BLOCK)).
    """
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    nq, nk = _blocks(seqlen_q, "seqlen_q"), _blocks(seqlen_k, "seqlen_k")
    heads = _count(heads, "heads", 1)
    h = torch.arange(heads, device=device)[:, None, None]
    b = torch.zeros((), dtype=torch.int64, device=device)
    kv = torch.arange(nk * BLOCK, device=device)
    some = torch.empty(heads, nq, nk, dtype=torch.bool, device=device)
    every = torch.empty_like(some)
    kv_ids = kv.clamp(max=seqlen_k - 1)  # the mask_mod sees real positions only; ``inside``
    for a in range(nq):                   # drops the ragged last blocks' padding
        q = torch.arange(a * BLOCK, (a + 1) * BLOCK, device=device)
        ok = torch.as_tensor(mask_mod(b, h, q.clamp(max=seqlen_q - 1)[None, :, None],
                                      kv_ids[None, None, :]), device=device)
        ok = ok.expand(heads, BLOCK, nk * BLOCK)
        inside = (q[:, None] < seqlen_q) & (kv[None, :] < seqlen_k)  # ragged last blocks
        ok = (ok & inside).view(heads, BLOCK, nk, BLOCK)
        some[:, a] = ok.any(3).any(1)
        every[:, a] = (ok | ~inside.view(BLOCK, nk, BLOCK)).all(3).all(1)
    if not partial and bool((some & ~every).any()):
        raise ValueError("mask_mod leaves some blocks partly visible, and a block mask computes "
                         "whole blocks: express the element-level part with causal, window_size "
                         "or segment_ids and pass partial=True")
    return some


def expand_block_mask(block_mask: torch.Tensor, seqlen_q: int, seqlen_k: Optional[int] = None):
    """The element mask (heads or 1, seqlen_q, seqlen_k) bool of a block mask
    (heads or 1, cdiv(seqlen_q, BLOCK), cdiv(seqlen_k, BLOCK))."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    want = (_blocks(seqlen_q, "seqlen_q"), _blocks(seqlen_k, "seqlen_k"))
    if not isinstance(block_mask, torch.Tensor) or block_mask.dim() != 3 or tuple(block_mask.shape[1:]) != want:
        raise ValueError(f"block_mask must be (heads or 1, {want[0]}, {want[1]}) for seqlen_q {seqlen_q} "
                         f"and seqlen_k {seqlen_k} over blocks of {BLOCK}, got "
                         f"{tuple(getattr(block_mask, 'shape', ())) or type(block_mask).__name__}")
    rows = torch.arange(seqlen_q, device=block_mask.device) // BLOCK
    cols = torch.arange(seqlen_k, device=block_mask.device) // BLOCK
    return block_mask[:, rows][:, :, cols]


def density(block_mask: torch.Tensor) -> float:
    """Fraction of True blocks."""
    return block_mask.float().mean().item()
