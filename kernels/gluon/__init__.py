"""Gluon kernels (``triton.experimental.gluon``) for Hopper, by role:

    fwd.py     a warp-specialized forward (head_dim 64 and 128, bf16, MHA and GQA,
               unmasked, a band: causal with an offset, a window; segment ids or a block
               mask with or without the band; out written or merged into the ring's
               running out and lse), the default forward of flash_attn and the ring's
               steps on sm_90 at head_dim 128 (kernels/dispatch.py)
    bwd.py     a warp-specialized backward (head_dim 64 and 128, bf16, MHA and GQA, the
               same masks and dropout; dQ's adds in arrival order or, deterministic, in a
               fixed one), the default backward of flash_attn and of the ring's steps on
               sm_90
    walk.py    the backward's loader and dQ writer partitions
    dropout.py the backward's dropout bits, drawn in its keys-by-queries tiles
    tiles.py   what narrows either kernel's walk: the tile bounds from the host (segment
               ids), the rows of the block lists (a block mask)
    ptx.py     inline PTX both use: the TMA reduce-add, signals, selects
    ordered.py the backward's deterministic dQ: its adds in a fixed order of K tiles
    launch.py  their host side: ``attn_fwd_sm90`` and ``attn_bwd_sm90`` check and launch
               them; ``compile_fwd_sm90`` and ``compile_sm90`` build them for sm_90
               without a GPU
"""

from .launch import attn_bwd_sm90, attn_fwd_sm90, compile_fwd_sm90, compile_sm90

__all__ = ["attn_bwd_sm90", "attn_fwd_sm90", "compile_fwd_sm90", "compile_sm90"]
