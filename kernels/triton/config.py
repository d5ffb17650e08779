"""Tile shapes and launch parameters of the Triton kernels, per head_dim and dtype, and the
switches that depend on where they run (interpreter, TMA, the fp32 product precision)."""

from __future__ import annotations

import functools

import torch
import triton


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1: CPU tensors)."""
    return triton.knobs.runtime.interpret


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def fwd_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile shape and launch parameters of the forward kernel, from tools/tune_kernel.py
    on an H200 (bf16, 32 heads, TMA loads; docs/notes/kernel.md). fp32 tiles take twice
    the shared memory, so fp32 runs small unpipelined tiles: it is the exact path, not the
    fast one."""
    if interpreting():
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    if head_dim <= 128:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=4)


def bwd_config(head_dim: int, dtype: torch.dtype, sparse: bool = False,
               dropout_only: bool = False) -> tuple[dict, dict]:
    """Tiles of the two backward kernels, (dK/dV kernel, dQ kernel): BLOCK_M query rows by
    BLOCK_N key rows in each, tuned apart. Same provenance as fwd_config. Under a block
    mask (sparse) dK/dV takes 128 keys a program: the listed query blocks sit apart in
    memory and each load of one then serves twice the keys (-2-8% dK/dV time at 128k,
    densities 0.05-0.5; docs/notes/block-sparse.md, "Block-sparse, second round"). Under dropout
    with no other mask (dropout_only) the dK/dV kernel computes its scores queries by keys
    (QUERY_MAJOR), the layout the dropout bits are drawn in without redundant Philox calls,
    and passes P and dS to its products transposed: at head_dim 128, 16k, dK/dV 21.6 ->
    18.6 ms; no gain under a causal band, and 3% slower without dropout (docs/notes/dropout.md,
    "Dropout, fourth round"). The results are the same either way."""
    if interpreting():
        cfg = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
        return dict(cfg, QUERY_MAJOR=dropout_only), cfg
    if dtype == torch.float32:
        cfg = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
        return cfg, cfg
    if head_dim <= 64:
        return (dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3))
    if head_dim <= 128:
        dkdv = dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2) if sparse else \
            dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, QUERY_MAJOR=dropout_only)
        return dkdv, dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return (dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
            dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3))


def list_stages(cfg: dict, sparse: bool, column_ids: bool = False) -> int | None:
    """Pipeline stages of a kernel's loop over the full blocks a block mask lists (None:
    the launch's). The list entry is a load the tile loads' addresses wait on, and Triton's
    pipeliner shares the stages out between the two levels, (stages - 1) // 2 of prefetch
    each: 2 s - 1 stages keep the tiles' prefetch distance of the dense loop, s - 1.
    With s, the forward's tiles were prefetched one step ahead instead of two (-14%).
    Not when the loop also reads the key tiles' segment ids (column_ids: the forward and
    dQ with segments): the pipeliner then gives every stage its own K and V buffers, and
    2 s - 1 = 5 stages of 128 x 128 tiles ask 320 KB of shared memory, past the 227 KB a
    Hopper block can have (the launch fails); those keep s."""
    stages = cfg["num_stages"]
    return 2 * stages - 1 if sparse and stages > 1 and not column_ids else None


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: plain fp32 products, or with torch's TF32 switch on, three TF32 passes
    (error ~1e-6 rather than single TF32's ~1e-3, which the probabilities of long rows
    pile up past the contract). Half types ignore it."""
    if dtype != torch.float32:
        return "tf32"
    return "tf32x3" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


@functools.lru_cache(maxsize=None)
def has_tma(device: torch.device) -> bool:
    """The interpreter (CPU tensors) emulates descriptors; on CUDA they need Hopper or later."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def use_tma(*tensors: torch.Tensor) -> bool:
    """Descriptors need a 16-byte-aligned base and 16-byte-aligned strides."""
    return has_tma(tensors[0].device) and all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in tensors)


