"""Argument checks, device dispatch and the differentiable single-device op.

Three thin layers, so torch.compile can trace through them:
``torch.library`` custom ops (forward, backward) -> their registered autograd ->
the public ``flash_attn``. The per-block entry points ``flash_attn_fwd`` and
``flash_attn_bwd`` are what the ring calls at every step.
"""

import math
from typing import Optional

import torch

from . import reference, triton_attn

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _backend(t: torch.Tensor):
    """Triton on CUDA tensors, the PyTorch twin elsewhere."""
    return triton_attn if t.is_cuda else reference


def check_qkv(q, k, v) -> None:
    """Validate q (B, Sq, H, D) and k, v (B, Sk, Hkv, D); raise TypeError/ValueError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    if not 1 <= q.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {q.shape[3]}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q's heads ({q.shape[2]}) must be a multiple of k's and v's heads ({k.shape[2]})")
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(f"seqlen must be at least 1, got q: {q.shape[1]}, k: {k.shape[1]}")


def resolve_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    return float(softmax_scale)


def check_causal(causal) -> bool:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return causal


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any strides but need the last dimension contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_outputs(**tensors) -> None:
    """Destinations the kernels write through strides: the last one must be 1."""
    for name, t in tensors.items():
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


# ----------------------------------------------------------------------------- per-block entry points


def flash_attn_fwd(q, k, v, *, softmax_scale: float, causal_offset: Optional[int] = None,
                   out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                   accumulate: bool = False):
    """Attention of one (query block, key block) pair, returning ``(out, lse)``.

    q (B, Sq, H, D); k, v (B, Sk, Hkv, D); Sq and Sk may differ.
    causal_offset: None for no mask, or o: key j is visible to query i iff j <= i + o
        (o = q_start - k_start for two contiguous blocks of one sequence).
    out (B, Sq, H, D), any float dtype, and lse (B, H, Sq) fp32: where to write; allocated
        when None. Views are fine (last dimension contiguous).
    accumulate: out/lse already hold a partial result for the same queries (normalized
        out and its lse; lse = -inf for none yet); the result is its exact merge with this
        block's, written in place. Keep such a running out in fp32.
    A row that sees no key has out 0 and lse -inf.
    """
    if accumulate and (out is None or lse is None):
        raise ValueError("accumulate=True needs the running out and lse")
    _check_outputs(out=out, lse=lse)
    b, sq, h, d = q.shape
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if lse is None:
        lse = torch.empty((b, h, sq), device=q.device, dtype=torch.float32)
    _backend(q).fwd(_rowmajor(q), _rowmajor(k), _rowmajor(v), out, lse, softmax_scale=softmax_scale,
                    causal_offset=causal_offset, accumulate=accumulate)
    return out, lse


def attn_delta(out: torch.Tensor, dout: torch.Tensor,
               dlse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """delta = rowsum(dout * out) (B, H, Sq) fp32, from the FINAL out.

    A gradient on lse folds in here: d lse_i / d s_ij = p_ij, which is the same as
    lowering delta_i by dlse_i.
    """
    delta = reference.delta(out, dout)
    if dlse is not None:
        delta = delta - dlse.float()
    return delta


def flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, *, softmax_scale: float,
                   causal_offset: Optional[int] = None, accumulate: bool = False,
                   deterministic: bool = False):
    """Gradients of one block pair, written (or, with accumulate, added) into dq, dk, dv.

    dout, q, dq (B, Sq, H, D); k, v, dk, dv (B, Sk, Hkv, D); lse, delta (B, H, Sq) fp32:
    the FINAL lse of these queries over every key block, and ``attn_delta`` of the FINAL
    out. Accumulators should be fp32; views are fine. dq=None skips dQ, and dk=dv=None
    skips dK and dV (they are separate passes, so a caller may run them apart).
    ``deterministic=True`` (or the environment variable RINGFLASH_DETERMINISTIC=1, read at
    every call) guarantees bit-identical results run to run. Today's default passes are
    deterministic already; the fused one-kernel backward (triton_attn.FUSED_BWD, opt-in:
    not faster on an H200) sums dQ in a varying order and is skipped when it is asked.
    The CPU twin is deterministic either way.
    """
    if (dk is None) != (dv is None):
        raise ValueError("dk and dv are computed together: pass both or neither")
    _check_outputs(lse=lse, delta=delta, dq=dq, dk=dk, dv=dv)
    _backend(q).bwd(_rowmajor(dout), _rowmajor(q), _rowmajor(k), _rowmajor(v), lse, delta, dq, dk,
                    dv, softmax_scale=softmax_scale, causal_offset=causal_offset,
                    accumulate=accumulate, deterministic=deterministic)
    return dq, dk, dv


# ----------------------------------------------------------------------------- differentiable op


@torch.library.custom_op("ringflash::flash_attn_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                causal_offset: Optional[int], deterministic: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic only travels to the backward, through the autograd context.
    return flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal_offset=causal_offset)


@_forward_op.register_fake
def _(q, k, v, softmax_scale, causal_offset, deterministic=False):
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("ringflash::flash_attn_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                 softmax_scale: float, causal_offset: Optional[int], deterministic: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    delta = attn_delta(out, dout, dlse)
    dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    return flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=softmax_scale,
                          causal_offset=causal_offset, deterministic=deterministic)


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, softmax_scale, causal_offset, deterministic=False):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal_offset, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal_offset = causal_offset
    ctx.deterministic = deterministic


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward_op(dout, q, k, v, out, lse, dlse, ctx.softmax_scale, ctx.causal_offset,
                              ctx.deterministic)
    return dq, dk, dv, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attn(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None,
               return_lse: bool = False, deterministic: bool = False):
    """Exact softmax attention on one device, FlashAttention-2 style.

    Args:
        q: (batch, seqlen_q, heads, head_dim), float16, bfloat16 or float32.
        k, v: (batch, seqlen_k, kv_heads, head_dim), heads a multiple of kv_heads
            (MHA, GQA, MQA; K/V are never repeated in memory).
        causal: key j is visible to query i iff j <= i (aligned top-left, as in
            torch's scaled_dot_product_attention).
        softmax_scale: a positive float; defaults to head_dim ** -0.5.
        return_lse: also return lse.
        deterministic: bit-identical gradients from run to run (never the fused backward,
            whose dQ summation order varies, should it be switched on); the environment
            variable RINGFLASH_DETERMINISTIC=1 does the same for every call.

    Returns:
        out (batch, seqlen_q, heads, head_dim) in q's dtype, and with return_lse the
        log-sum-exp of the scaled scores, lse (batch, heads, seqlen_q) fp32, natural log.
        A row that sees no key gets out 0 and lse -inf. Both are differentiable.
    """
    check_qkv(q, k, v)
    causal = check_causal(causal)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    out, lse = _forward_op(q, k, v, scale, 0 if causal else None, deterministic)
    return (out, lse) if return_lse else out
