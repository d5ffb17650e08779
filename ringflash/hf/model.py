"""transformers' side: the attention function ring attention runs as, its registration,
and running a model unsharded (generation)."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..agreement import raise_on_every_rank
from .batch import CONTEXT_KEY, RingContext

# The name under which ``register`` installs the attention function. It must not contain
# "flash": transformers treats any attn_implementation whose name contains "flash" as a
# FlashAttention build or a hub kernel (utils.generic.is_flash_attention_requested), and
# for a name it does not know as such it tries to load a kernel from the Hugging Face hub,
# failing with "Could not find the currently requested flash attention implementation"
# (transformers 5.23) although the function is registered.
ATTN_IMPLEMENTATION = "ring_attn"
def _transformers():
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:  # transformers missing, or one without these interfaces
        raise ImportError("ringflash.hf needs transformers >= 4.56 (pip install 'ringflash[hf]')"
                          ) from error
    return transformers, AttentionInterface, AttentionMaskInterface


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register ring attention with transformers under ``name``; returns the name to give
    as ``attn_implementation``. Also registers a mask function under the same name, which
    rejects any attention mask the model is given directly (``prepare_batch`` turns padding
    and packing into segment ids instead)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(f"name {name!r} contains 'flash', which transformers reserves for "
                         "FlashAttention builds and hub kernels (it would try to download one); "
                         f"use another name, e.g. {ATTN_IMPLEMENTATION!r}")
    _, attention_interface, mask_interface = _transformers()
    attention_interface.register(name, ring_attention_forward)
    mask_interface.register(name, _reject_model_mask)
    return name


@contextlib.contextmanager
def unsharded(model: torch.nn.Module, attn_implementation: str = "sdpa"):
    """Inside the block, ``model`` runs transformers' ``attn_implementation`` on whole
    sequences, as an unsharded model: for ``model.generate(...)`` and for evaluation on
    one rank without ``prepare_batch``. The ring attention comes back on leaving it.

        with ringflash.hf.unsharded(model):
            tokens = model.generate(input_ids, max_new_tokens=32)
    """
    previous = model.config._attn_implementation
    model.set_attn_implementation(attn_implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


# ----------------------------------------------------------------------------- the hooks


def _reject_model_mask(*, attention_mask=None, **_):
    """transformers' mask hook for ring attention: masks come from ``prepare_batch``."""
    if attention_mask is not None:
        raise ValueError("an attention_mask was passed to a model that runs ring attention; pass "
                         "it to ringflash.hf.prepare_batch instead, which turns padding and "
                         "packing into segment ids (transformers would drop it)")
    return None


# What transformers may hand an attention function that ring attention does not compute,
# and where it comes from.
_UNSUPPORTED = {"softcap": "logit softcapping (the config's attn_logit_softcapping; set it to None)",
                "s_aux": "attention sinks (s_aux)", "head_mask": "a head_mask",
                "position_bias": "a position_bias"}


def _raise_on_every_rank(context: RingContext, error: Exception):
    """Raise ``error`` on every rank of the model's group (``agreement.raise_on_every_rank``)."""
    raise_on_every_rank(context.sp.grid, error)


def ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                           scaling: Optional[float] = None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function signature over ``ring_flash_attn``: query (batch,
    heads, seqlen_local, head_dim), key and value (batch, kv_heads, seqlen_local,
    head_dim); returns (batch, seqlen_local, heads, head_dim) and no weights."""
    context = kwargs.get(CONTEXT_KEY)
    if context is None:
        raise RuntimeError(
            "ring attention needs the batch from ringflash.hf.prepare_batch: call "
            "model(**ringflash.hf.prepare_batch(sp, input_ids, labels=...)) on every rank; "
            "to generate, or to run the model on whole sequences, use "
            "`with ringflash.hf.unsharded(model):`")
    if not context.positions_match(kwargs.get("position_ids")):
        _raise_on_every_rank(context, ValueError(
            "the model was called without the position_ids of prepare_batch (the global "
            "positions of this rank's tokens): without them rotary embeddings number every "
            "shard from 0. Pass the whole prepared batch, model(**batch)"))
    if attention_mask is not None:
        _raise_on_every_rank(context, ValueError(
            "ring attention got a prepared attention mask from the model; masks come from "
            "prepare_batch (padding, packing) only"))
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            _raise_on_every_rank(context, NotImplementedError(
                f"ring attention does not support {what}; the model passed {name}"))
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    extra = {}
    if context.segment_ids is not None:
        extra["segment_ids"] = context.segments_on(query.device)
    if dropout:  # the seed from torch's default generator: seed every rank alike
        extra["dropout_p"] = dropout
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if window is not None:  # transformers' causal sliding window: keys j > i - window
        if not causal:
            raise NotImplementedError("bidirectional sliding-window layers are not supported by "
                                      "ring attention (transformers' eager and flash paths "
                                      "disagree on their width)")
        if int(window) < 1:
            raise ValueError(f"sliding_window must be a positive number of keys, got {window}")
        extra["window_size"] = (int(window) - 1, 0)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if torch.is_autocast_enabled(q.device.type):  # as autocast does for sdpa: one low precision
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    out = context.sp.attn(q, k, v, causal=bool(causal), softmax_scale=scaling, **extra)
    return out, None
