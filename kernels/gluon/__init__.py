"""Gluon kernels (``triton.experimental.gluon``) for Hopper, by role:

    bwd.py     a warp-specialized backward (head_dim 128, bf16, MHA and GQA, unmasked or
               a causal band with an offset; dQ's adds in arrival order or, deterministic,
               in a fixed one), the default backward of flash_attn and of the ring's steps
               on sm_90 (kernels/dispatch.py)
    launch.py  its host side: ``attn_bwd_sm90`` checks and launches it; ``compile_sm90``
               builds it for sm_90 without a GPU
"""

from .launch import attn_bwd_sm90, compile_sm90

__all__ = ["attn_bwd_sm90", "compile_sm90"]
