"""The differentiable single-device op, in three thin layers so torch.compile can trace
through them: ``torch.library`` custom ops (forward, backward) -> their registered
autograd -> the public ``flash_attn``. Outside torch.compile the public function runs the
same implementations through a plain ``torch.autograd.Function`` (``eager_function``),
which skips the custom ops' dispatch."""

import inspect
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .checks import (check_block_mask, check_causal, check_deterministic, check_dropout, check_qkv,
                     check_segment_ids, check_window, resolve_scale)
from .masks import Blocks, PairMask, band_of_window, tensor_memo
from .pair import attn_delta, flash_attn_bwd, flash_attn_fwd


def _op_mask(band_lo, band_hi, segment_ids, dropout_p, seed, block_mask) -> PairMask:
    blocks = None if block_mask is None else tensor_memo(
        block_mask, ("blocks",), lambda: Blocks(block_mask.clone()))
    return PairMask(band_lo, band_hi, segment_ids, segment_ids, dropout_p, seed, (0, 0, 1, 0), blocks)


def eager(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a differentiable call on ``tensors`` may run its implementations through a
    plain autograd.Function (``eager_function``) instead of its custom ops: outside
    torch.compile and torch.export, with no torch_dispatch mode (fake tensors, make_fx) or
    functorch transform active, on plain tensors. The custom ops' dispatch (schema
    checks, the autograd wrapper, dynamo's guard around the implementation) costs the
    host ~0.2 ms a forward+backward on a 2-core CPU and 0.2-0.6 ms on the GPU machines'
    hosts (docs/notes/host-time.md, "The host's time of a call")."""
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and not torch._C._are_functorch_transforms_active()
            and all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors))


def eager_function(name: str, forward, setup_context, backward) -> type:
    """A torch.autograd.Function over a custom op's implementation ``forward`` and the
    ``setup_context`` / ``backward`` registered for it: the same inputs, outputs, saved
    tensors and gradients, without the op's dispatch. ``forward`` keeps its signature made
    once (``__signature__``): Function.apply binds every call's arguments to it (with a
    setup_context), and ``inspect.signature`` would make it again each time."""
    forward.__signature__ = inspect.signature(forward)
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward)})


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
             band_lo: Optional[int], band_hi: Optional[int],
             segment_ids: Optional[torch.Tensor], dropout_p: float, seed: int,
             block_mask: Optional[torch.Tensor], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic is the backward's (kept by _setup_context)
    return flash_attn_fwd(q, k, v, softmax_scale=softmax_scale,
                          mask=_op_mask(band_lo, band_hi, segment_ids, dropout_p, seed, block_mask))


def _backward_grads(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                    softmax_scale: float, band_lo: Optional[int], band_hi: Optional[int],
                    segment_ids: Optional[torch.Tensor], dropout_p: float, seed: int,
                    block_mask: Optional[torch.Tensor], deterministic: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    delta = attn_delta(out, dout, dlse)
    dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    return flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=softmax_scale,
                          mask=_op_mask(band_lo, band_hi, segment_ids, dropout_p, seed, block_mask),
                          deterministic=deterministic)


_forward_op = torch.library.custom_op("ringflash::flash_attn_forward", mutates_args=())(_forward)
_backward_op = torch.library.custom_op("ringflash::flash_attn_backward", mutates_args=())(_backward_grads)


@_forward_op.register_fake
def _(q, k, v, softmax_scale, band_lo, band_hi, segment_ids, dropout_p, seed, block_mask, deterministic):
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, softmax_scale, band_lo, band_hi, segment_ids, dropout_p, seed,
      block_mask, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, band_lo, band_hi, segment_ids, dropout_p, seed, block_mask, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, segment_ids, block_mask)
    ctx.args = (softmax_scale, band_lo, band_hi, dropout_p, seed, deterministic)
    ctx.set_materialize_grads(False)  # an unused lse's gradient stays None, not zeros


def no_double_backward() -> None:
    """Backward passes run under grad mode only for create_graph=True, which they do not support."""
    if torch.is_grad_enabled():
        raise NotImplementedError("ringflash attention has no double backward: its backward is not "
                                  "differentiable (torch.autograd.grad(..., create_graph=True) "
                                  "is unsupported)")


def _backward(ctx, dout, dlse):
    no_double_backward()
    q, k, v, out, lse, segment_ids, block_mask = ctx.saved_tensors
    softmax_scale, band_lo, band_hi, dropout_p, seed, deterministic = ctx.args
    dout = torch.zeros_like(out) if dout is None else dout  # only lse was used
    grads = _backward_grads if eager(dout, q) else _backward_op
    dq, dk, dv = grads(dout, q, k, v, out, lse, dlse, softmax_scale, band_lo, band_hi,
                       segment_ids, dropout_p, seed, block_mask, deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_FlashAttn = eager_function("_FlashAttn", _forward, _setup_context, _backward)


def flash_attn(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None,
               return_lse: bool = False, segment_ids: Optional[torch.Tensor] = None,
               window_size: tuple[int, int] = (-1, -1), dropout_p: float = 0.0,
               seed: Optional[int] = None, block_mask: Optional[torch.Tensor] = None,
               deterministic: bool = False):
    """Exact softmax attention on one device, FlashAttention-2 style.

    Args:
        q: (batch, seqlen_q, heads, head_dim), float16, bfloat16 or float32.
        k, v: (batch, seqlen_k, kv_heads, head_dim), heads a multiple of kv_heads
            (MHA, GQA, MQA; K/V are never repeated in memory).
        causal: key j is visible to query i iff j <= i (aligned top-left, as in
            torch's scaled_dot_product_attention).
        softmax_scale: a positive float; defaults to head_dim ** -0.5.
        return_lse: also return lse.
        segment_ids: (batch, seqlen) integer ids (self-attention: seqlen_q == seqlen_k).
            Query i sees key j only if both carry the same id; -1 marks padding (never
            seen; a padding query sees nothing). Outside padding, ids must not decrease
            along the sequence (packed documents, each one contiguous run).
        window_size: (left, right): query i sees keys i - left <= j <= i + right; -1 is
            unbounded on that side. Combines with causal and segment_ids.
        dropout_p: attention dropout rate in [0, 1). Whether key j's probability for query
            i is kept depends only on (seed, batch, head, i, j) (kernels/dropout.py;
            ``dropout_keep_mask`` returns the dense mask), so the backward regenerates it
            and the ring with the same seed drops exactly the same elements. The rate
            applied is p rounded to 1/256 (``dropout.applied_rate``).
        seed: an int, or None to draw one from torch's default generator.
        block_mask: block-sparse attention: bool (heads or 1, cdiv(seqlen_q, 128),
            cdiv(seqlen_k, 128)); block (a, c) covers queries [128a, 128a + 128) and keys
            [128c, 128c + 128). False blocks are never computed (no load, no FLOP);
            the elements of a True block follow causal, window_size and segment_ids.
            Helpers: ``ringflash.kernels.block_sparse``.
        deterministic: gradients with the same bits run to run. The default may use, on
            Hopper, the Gluon backward (kernels/dispatch.py), whose dQ adds tiles in
            arrival order (last-bit differences run to run; dK, dV are stable); True, or
            ``torch.use_deterministic_algorithms(True)``, makes it add them in a fixed
            order of key tiles.

    Returns:
        out (batch, seqlen_q, heads, head_dim) in q's dtype, and with return_lse the
        log-sum-exp of the scaled scores, lse (batch, heads, seqlen_q) fp32, natural log.
        A row that sees no key gets out 0 and lse -inf (and zero gradients). Both are
        differentiable in q, k and v.
    """
    check_qkv(q, k, v)
    causal = check_causal(causal)
    check_deterministic(deterministic)
    block_mask = check_block_mask(block_mask, q.shape[2], q.shape[1], k.shape[1], q.device)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    band_lo, band_hi = band_of_window(causal, check_window(window_size))
    if segment_ids is not None and q.shape[1] != k.shape[1]:
        raise ValueError(f"segment_ids needs seqlen_q == seqlen_k (self-attention), got "
                         f"{q.shape[1]} and {k.shape[1]}")
    segment_ids = check_segment_ids(segment_ids, q.shape[0], q.shape[1], q.device)
    dropout_p, seed = check_dropout(dropout_p, seed)
    forward = _FlashAttn.apply if eager(q, k, v) else _forward_op
    out, lse = forward(q, k, v, scale, band_lo, band_hi, segment_ids, dropout_p, seed, block_mask, deterministic)
    return (out, lse) if return_lse else out
