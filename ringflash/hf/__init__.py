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

- ``input_ids`` (or ``inputs_embeds``): this rank's tokens (``sp.shard``);
- ``position_ids``: their GLOBAL positions, which the model's rotary embeddings need; a
  model called without them would number every shard from 0 and be silently wrong, so
  the attention function refuses to run unless it receives these (or a copy: the batch
  may be moved to a device, by hand or by a framework);
- ``labels`` / ``shift_labels``: the labels shifted on the whole sequence, then sharded
  (the model's own shift, applied to a shard, would be wrong at every shard boundary),
  and ``num_items_in_batch``: the labelled tokens of the WHOLE batch, so the model's
  loss is this rank's sum over the global count. Summed over the group it is the
  unsharded model's loss, and so are the summed gradients;
- padding (``attention_mask``) and packed documents (``position_ids`` that restart) as
  ``segment_ids`` for ``ring_flash_attn``; transformers gives a custom attention function
  no mask of its own for them (``attention_mask=None``), so a mask the model is handed
  directly is rejected instead of being dropped. Padded queries and targets get no loss
  (``padded_labels``);
- the layout: with ``SequenceParallel``'s default layout "auto", a batch whose rows pack
  the same documents is split by the layout computed from them (``ringflash.document_layout``:
  whole documents on one rank, the ring moving only the ones that cross ranks), any other
  batch by zigzag; a layout given to SequenceParallel is used for every batch. The
  batch's own split is ``batch[CONTEXT_KEY].sp`` (gather outputs with its ``unshard``);
- ``use_cache=False`` and the context the attention function runs with (its key is
  ``CONTEXT_KEY``).

``prepare_batch`` checks that every rank of the group got the same batch (a fingerprint,
all-gathered). Generation and whole-sequence runs on one rank go inside
``with unsharded(model):``. The Trainer and accelerate: ``training.py``
(``SequenceParallelSampler``, ``SequenceParallelCollator``, ``SequenceParallelTrainer``).

Registering a mask function makes transformers run its mask preparation, which in eager
mode looks for packed rows in position_ids with one small host synchronization per
forward (none under torch.compile); the model compiles with fullgraph=True.
"""

from .batch import CONTEXT_KEY, RingContext, padded_labels, prepare_batch, segment_ids_of
from .model import ATTN_IMPLEMENTATION, register, ring_attention_forward, unsharded
from .training import SequenceParallelCollator, SequenceParallelSampler

__all__ = ["ATTN_IMPLEMENTATION", "CONTEXT_KEY", "RingContext", "padded_labels", "prepare_batch",
           "register", "ring_attention_forward", "segment_ids_of", "unsharded", "SequenceParallelCollator",
           "SequenceParallelSampler", "SequenceParallelTrainer"]


def __getattr__(name: str):
    if name == "SequenceParallelTrainer":  # a transformers.Trainer subclass, built on first use
        from . import training
        return training.SequenceParallelTrainer
    raise AttributeError(f"module 'ringflash.hf' has no attribute {name!r}")
