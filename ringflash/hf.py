"""Hugging Face transformers models over the ring (the optional extra ``ringflash[hf]``).

    import ringflash, ringflash.hf
    name = ringflash.hf.register()                              # "ring_attn"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    sp = ringflash.SequenceParallel(group)                      # group / DeviceMesh, layout
    batch = ringflash.hf.prepare_batch(sp, input_ids, labels=input_ids)
    loss = model(**batch).loss                                  # this rank's term of the global mean
    loss.backward(); sp.reduce_gradients(model.parameters())    # SUM over the group

Every rank passes the SAME full batch to ``prepare_batch``, which returns this rank's
part of everything the model needs:

- ``input_ids``: this rank's tokens (``sp.shard``);
- ``position_ids``: their GLOBAL positions, which the model's rotary embeddings need; a
  model called without them would number every shard from 0 and be silently wrong, so
  the attention function refuses to run unless it receives exactly these;
- ``labels`` / ``shift_labels``: the labels shifted on the whole sequence, then sharded
  (the model's own shift, applied to a shard, would be wrong at every shard boundary),
  and ``num_items_in_batch``: the labelled tokens of the WHOLE batch, so the model's
  loss is this rank's sum over the global count. Summed over the group it is the
  unsharded model's loss, and so are the summed gradients;
- padding (``attention_mask``) and packed documents (``position_ids`` that restart) as
  ``segment_ids`` for ``ring_flash_attn``; transformers gives a custom attention function
  no mask of its own for them (``attention_mask=None``), so a mask the model is handed
  directly is rejected instead of being dropped;
- ``use_cache=False`` and the context the attention function runs with (its key is
  ``CONTEXT_KEY``).

Registering a mask function makes transformers run its mask preparation, which in eager
mode looks for packed rows in position_ids with one small host synchronization per
forward (none under torch.compile); the model compiles with fullgraph=True.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .parallel import IGNORE_INDEX, SequenceParallel

# The name under which ``register`` installs the attention function. It must not contain
# "flash": transformers treats any attn_implementation whose name contains "flash" as a
# FlashAttention build or a hub kernel (utils.generic.is_flash_attention_requested), and
# for a name it does not know as such it tries to load a kernel from the Hugging Face hub,
# failing with "Could not find the currently requested flash attention implementation"
# (transformers 5.23) although the function is registered.
ATTN_IMPLEMENTATION = "ring_attn"
# The keyword that carries the RingContext through the model's forward(**kwargs) down to
# the attention function.
CONTEXT_KEY = "ringflash_context"


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


@dataclass(eq=False, frozen=True)
class RingContext:
    """What the attention function needs beyond q, k, v: the sharding, the position_ids
    the model must have been given (checked by identity), and the segment ids of padding
    and packed documents (None: one unpadded sequence per row)."""

    sp: SequenceParallel
    position_ids: torch.Tensor
    segment_ids: Optional[torch.Tensor] = None


def segment_ids_of(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
                   ) -> Optional[torch.Tensor]:
    """Segment ids (batch, seqlen) int32 of a full batch, or None when every row is one
    unpadded sequence.

    A new document starts wherever the position does not grow by one (the rule
    transformers uses for packed rows, ``find_packed_sequence_indices``); documents of a
    row are numbered 0, 1, ... Padding (``attention_mask == 0``) gets -1: it attends to
    nothing and nothing attends to it.
    """
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    segments = starts.cumsum(-1, dtype=torch.int32)
    if attention_mask is not None:
        segments = torch.where(attention_mask.bool(), segments, torch.full_like(segments, -1))
    if not (segments != 0).any():
        return None
    return segments


def prepare_batch(sp: SequenceParallel, input_ids: torch.Tensor, *,
                  labels: Optional[torch.Tensor] = None,
                  attention_mask: Optional[torch.Tensor] = None,
                  position_ids: Optional[torch.Tensor] = None,
                  num_items_in_batch=None, ignore_index: int = IGNORE_INDEX,
                  device=None) -> dict:
    """This rank's keyword arguments for ``model(**batch)``; see the module docstring.

    Args:
        sp: the sequence-parallel group and layout.
        input_ids: (batch, seqlen) of the WHOLE sequences, the same on every rank;
            seqlen a multiple of W (2W for zigzag, 128 W for block_stripe).
        labels: (batch, seqlen) unshifted, as for the unsharded model (``ignore_index``
            where no loss is wanted), or None for no loss.
        attention_mask: (batch, seqlen), 0 at padding; None for no padding.
        position_ids: (batch or 1, seqlen) of the whole sequences; a position that does
            not follow its predecessor starts a new document (packing). Default 0..seqlen-1.
        num_items_in_batch: the labelled tokens the loss is normalized by; default those of
            this batch. With data parallelism, give the count of the whole global batch
            (and sum gradients over every rank), or that of this replica's batch (sum over
            sp, average over dp).
        device: where the returned tensors go (default: input_ids').

    A padded or packed batch is never run without its mask: it reaches the ring as
    segment ids.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a (batch, seqlen) tensor of the whole sequences, "
                         f"got {getattr(input_ids, 'shape', type(input_ids).__name__)}")
    batch, seqlen = input_ids.shape
    device = input_ids.device if device is None else torch.device(device)
    if position_ids is None:
        position_ids = torch.arange(seqlen, device=input_ids.device)
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2) or \
            position_ids.shape[-1] != seqlen or (position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch)):
        raise ValueError(f"position_ids must be (batch or 1, {seqlen}) or ({seqlen},), got "
                         f"{tuple(getattr(position_ids, 'shape', ())) or type(position_ids).__name__}")
    position_ids = position_ids.expand(batch, seqlen)
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be {tuple(input_ids.shape)} (batch, seqlen), "
                         f"got {tuple(attention_mask.shape)}")
    segments = segment_ids_of(position_ids, attention_mask)

    local_positions = sp.shard(position_ids).to(device)
    context = RingContext(sp, local_positions,
                          None if segments is None else sp.shard(segments).to(device))
    prepared = {"input_ids": sp.shard(input_ids).to(device), "position_ids": local_positions,
                "use_cache": False, CONTEXT_KEY: context}
    if labels is not None:
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must be {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        shifted = sp.shift_labels(labels, ignore_index).to(device)
        if num_items_in_batch is None:
            num_items_in_batch = (labels[:, 1:] != ignore_index).sum()
        prepared.update(labels=shifted, shift_labels=shifted,
                        num_items_in_batch=torch.as_tensor(num_items_in_batch, device=device))
    return prepared


# ----------------------------------------------------------------------------- the hooks


def _reject_model_mask(*, attention_mask=None, **_):
    """transformers' mask hook for ring attention: masks come from ``prepare_batch``."""
    if attention_mask is not None:
        raise ValueError("an attention_mask was passed to a model that runs ring attention; pass "
                         "it to ringflash.hf.prepare_batch instead, which turns padding and "
                         "packing into segment ids (transformers would drop it)")
    return None


_UNSUPPORTED = ("softcap", "s_aux", "head_mask", "position_bias")


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
            "model(**ringflash.hf.prepare_batch(sp, input_ids, labels=...)) on every rank")
    if kwargs.get("position_ids") is not context.position_ids:
        raise ValueError(
            "the model was called without the position_ids of prepare_batch (the global "
            "positions of this rank's tokens): without them rotary embeddings number every "
            "shard from 0. Pass the whole prepared batch, model(**batch)")
    if attention_mask is not None:
        raise ValueError("ring attention got a prepared attention mask from the model; masks "
                         "come from prepare_batch (padding, packing) only")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"ring attention does not support {name}")
    extra = {}
    if context.segment_ids is not None:
        extra["segment_ids"] = context.segment_ids
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
