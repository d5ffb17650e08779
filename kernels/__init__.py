"""Single-device FlashAttention: Triton kernels on CUDA, a blockwise PyTorch twin elsewhere.

Knows nothing of torch.distributed. ``flash_attn`` is the differentiable op;
``flash_attn_fwd`` / ``flash_attn_bwd`` / ``attn_delta`` are the per-block entry
points of one (query block, key block) pair that the ring calls at every step.
"""

from .interface import (
    SUPPORTED_DTYPES,
    Arrival,
    Joined,
    attn_delta,
    check_block_mask,
    check_causal,
    check_deterministic,
    check_dropout,
    check_qkv,
    check_segment_ids,
    check_window,
    flash_attn,
    flash_attn_bwd,
    flash_attn_fwd,
    no_double_backward,
    resolve_scale,
)
from .dropout import dropout_keep_mask
from .masks import PairMask, band_of_window

__all__ = [
    "SUPPORTED_DTYPES",
    "Arrival",
    "Joined",
    "PairMask",
    "attn_delta",
    "band_of_window",
    "check_block_mask",
    "check_causal",
    "check_deterministic",
    "check_dropout",
    "check_qkv",
    "check_segment_ids",
    "check_window",
    "dropout_keep_mask",
    "flash_attn",
    "flash_attn_bwd",
    "flash_attn_fwd",
    "no_double_backward",
    "resolve_scale",
]
