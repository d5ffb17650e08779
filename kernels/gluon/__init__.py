"""Gluon kernels (``triton.experimental.gluon``) for Hopper, by role:

    bwd.py   ``attn_bwd_sm90``: a warp-specialized backward (head_dim 128, bf16, MHA and
             GQA, unmasked or a causal band with an offset), the default backward of
             flash_attn and of the ring's steps on sm_90 (kernels/dispatch.py);
             ``compile_sm90`` builds it for sm_90 without a GPU
"""

from .bwd import attn_bwd_sm90, compile_sm90

__all__ = ["attn_bwd_sm90", "compile_sm90"]
