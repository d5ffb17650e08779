"""Single-device FlashAttention: Triton kernels on CUDA, a blockwise PyTorch twin elsewhere.

Knows nothing of torch.distributed. By role:

    op.py          ``flash_attn``, the differentiable op (custom op -> autograd -> function)
    pair.py        ``flash_attn_fwd`` / ``flash_attn_bwd`` / ``attn_delta``: one (query block,
                   key block) pair, what the ring calls at every step; ``add_rounded``
    dispatch.py    which kernels run a call: the one place that chooses
    checks.py      argument checks shared by every entry point
    masks.py       what a pair masks (``PairMask``), block lists, segment ranges
    block_sparse.py, dropout.py   block-mask helpers; the Philox dropout contract
    reference.py   the PyTorch twin of the kernels (CPU)
    triton/        the Triton kernels and their launchers
    gluon/         Hopper kernels in Gluon (the backward)
"""

from .checks import (SUPPORTED_DTYPES, check_block_mask, check_causal, check_deterministic,
                     check_dropout, check_qkv, check_segment_ids, check_window, resolve_scale)
from .dropout import dropout_keep_mask
from .masks import PairMask, band_of_window
from .op import eager, eager_function, flash_attn, no_double_backward
from .pair import Arrival, Joined, add_rounded, attn_delta, flash_attn_bwd, flash_attn_fwd

__all__ = [
    "SUPPORTED_DTYPES",
    "Arrival",
    "Joined",
    "PairMask",
    "add_rounded",
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
    "eager",
    "eager_function",
    "flash_attn",
    "flash_attn_bwd",
    "flash_attn_fwd",
    "no_double_backward",
    "resolve_scale",
]
