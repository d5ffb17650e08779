"""Gluon kernels (``triton.experimental.gluon``) for Hopper, by role:

    bwd.py   ``attn_bwd_sm90``: a warp-specialized backward (head_dim 128, bf16, MHA and
             GQA, unmasked or a causal band with an offset), compiled for sm_90 on CPU, not
             yet run on a GPU, not used by flash_attn or the ring yet; ``compile_sm90``
             builds it for sm_90 without a GPU
"""

from .bwd import attn_bwd_sm90, compile_sm90

__all__ = ["attn_bwd_sm90", "compile_sm90"]
