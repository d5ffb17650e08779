"""The prepared batch: this rank's part of a full batch for ``model(**batch)``
(``prepare_batch``), and the ``RingContext`` it carries down to the attention function."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..agreement import gather_rows
from ..parallel import IGNORE_INDEX, SequenceParallel

# The keyword that carries the RingContext through the model's forward(**kwargs) down to
# the attention function.
CONTEXT_KEY = "ringflash_context"


class RingContext:
    """What the attention function needs beyond q, k, v (the batch's ``CONTEXT_KEY``): the
    sharding (``sp``: the SequenceParallel this batch was split by, whose layout may be the
    one computed from the batch's documents), the position_ids the model must be called
    with, and the segment ids of padding and packed documents (None: one unpadded sequence
    per row).

    It survives the batch being moved or copied (``batch.to(device)``, the Trainer's
    ``_prepare_inputs``, accelerate's dataloader): frameworks pass the object through and
    copy the tensors, so the model's position_ids are compared by value (one small host
    synchronization for each new position_ids tensor, none when they are the prepared
    tensor itself) and the segment ids follow q to its device (copied once).
    """

    __slots__ = ("sp", "position_ids", "segment_ids", "_verified", "_moved", "__weakref__")

    def __init__(self, sp: SequenceParallel, position_ids: torch.Tensor,
                 segment_ids: Optional[torch.Tensor] = None):
        self.sp = sp
        self.position_ids = position_ids
        self.segment_ids = segment_ids
        self._verified = None  # weakref to the last position_ids found equal by value
        self._moved = None  # the segment ids on the device last asked for

    def __repr__(self) -> str:
        return (f"RingContext({self.sp!r}, position_ids {tuple(self.position_ids.shape)}, "
                f"segment_ids {'None' if self.segment_ids is None else tuple(self.segment_ids.shape)})")

    def positions_match(self, position_ids) -> bool:
        """Whether the model was called with the prepared positions (or a copy of them)."""
        if position_ids is self.position_ids:
            return True
        if not isinstance(position_ids, torch.Tensor) or position_ids.shape != self.position_ids.shape:
            return False
        if torch.compiler.is_compiling():  # no cache while tracing: the value test traces once
            return bool(torch.equal(position_ids, self.position_ids.to(position_ids.device)))
        if self._verified is not None and self._verified() is position_ids:
            return True  # every layer after the first of a forward
        if not torch.equal(position_ids, self.position_ids.to(position_ids.device)):
            return False
        self._verified = weakref.ref(position_ids)
        return True

    def segments_on(self, device: torch.device) -> Optional[torch.Tensor]:
        """The segment ids on ``device`` (where the model's q is)."""
        if self.segment_ids is None or self.segment_ids.device == device:
            return self.segment_ids
        if self._moved is None or self._moved.device != device:
            self._moved = self.segment_ids.to(device)
        return self._moved


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


def _shared_documents(segments: torch.Tensor) -> Optional[torch.Tensor]:
    """cu_seqlens (int64, CPU) of the documents that every row of a batch packs, from its
    segment ids (batch, seqlen) (``segment_ids_of``: -1 at padding), or None when no row
    packs more than one document. A boundary wherever some row starts a document; the
    padding that ends every row is the layout's padding. A row may be padded where
    another holds a document (padding sees nothing, whatever the layout). ValueError
    naming position_ids when a row starts a document inside another row's document: the
    rows pack different documents, which one layout computed from documents cannot serve.
    One host synchronization when the ids are on a GPU."""
    seg = segments.cpu()
    real = seg >= 0
    continues = torch.zeros_like(real)  # token p belongs to the document of token p - 1
    continues[:, 1:] = real[:, 1:] & (seg[:, 1:] == seg[:, :-1])
    starts = real & ~continues
    if not bool((starts.sum(-1) > 1).any()):
        return None
    cuts = starts.any(0)
    cuts[0] = False
    crossed = continues & cuts
    if bool(crossed.any()):
        inside, at = (int(i) for i in crossed.nonzero()[0])
        starter = int(starts[:, at].nonzero()[0])
        raise ValueError(
            f"position_ids: row {starter} starts a document at token {at}, inside a document of "
            f"row {inside}: the rows pack different documents. SequenceParallel's layout 'auto' "
            "splits a packed batch by the layout computed from its documents "
            "(ringflash.document_layout), which serves rows that pack the same documents: pack "
            "every row alike (or one row a batch), or pin a layout, e.g. "
            "SequenceParallel(group, layout=ringflash.DOCUMENTS_LAYOUT) ('block_stripe', "
            "balanced whatever the documents)")
    end = int(real.any(0).nonzero().max()) + 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), cuts.nonzero().flatten(),
                      torch.tensor([end])])


def padded_labels(labels: torch.Tensor, attention_mask: torch.Tensor,
                  ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels`` (batch, seqlen, unshifted) with no loss where a query or its target is
    padding: ``ignore_index`` at the padded tokens and at the token after each padded one.

    The model's shift pairs query i with target i + 1. HF's collators put -100 at padded
    tokens only, which still scores the padding query just before a left-padded row's
    first token; its output is an artefact (eager attention spreads a masked row
    uniformly over every key, ring attention gives it 0), so the two would disagree.
    ``prepare_batch`` applies this to the labels it is given with an attention_mask; give
    the unsharded model the same labels to compare the two.
    """
    pad = attention_mask == 0
    after_pad = torch.nn.functional.pad(pad[:, :-1], (1, 0), value=False)
    return labels.masked_fill(pad | after_pad, ignore_index)


def _fingerprint(t: Optional[torch.Tensor]) -> torch.Tensor:
    """Five int64 of an integer tensor: its rank, first two sizes, the sum of its values and
    a position-weighted sum (int64 wraps alike on every device); -1s for None."""
    if t is None:
        return torch.full((5,), -1, dtype=torch.int64)
    flat = t.reshape(-1).to(torch.int64)
    weights = (torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) * 2654435761) % 2 ** 31 + 1
    sums = torch.stack([flat.sum(), (flat * weights).sum()]).cpu()
    return torch.cat([torch.tensor([t.dim(), *t.shape[:2]]), sums])


def _check_same_batch(sp: SequenceParallel, tensors: dict) -> None:
    """Raise on every rank of ``sp`` unless every rank passed equal tensors: all-gathers of
    five integers a tensor over the group's host (gloo) groups."""
    if sp.world == 1:
        return
    mine = torch.cat([_fingerprint(t) for t in tensors.values()]).tolist()
    same, rows = gather_rows(sp.grid, mine)
    if not same:
        everyone = torch.tensor(rows).view(len(rows), len(tensors), 5)
        differ = [name for i, name in enumerate(tensors) if not (everyone[:, i] == everyone[0, i]).all()]
        raise ValueError(f"the ranks of the sequence-parallel group passed different {', '.join(differ) or 'batches'} "
                         "to prepare_batch; every rank of the group must pass the SAME full batch "
                         "(shard the data over the data-parallel ranks only: docs/integrations.md)")


def prepare_batch(sp: SequenceParallel, input_ids: Optional[torch.Tensor] = None, *,
                  labels: Optional[torch.Tensor] = None,
                  attention_mask: Optional[torch.Tensor] = None,
                  position_ids: Optional[torch.Tensor] = None,
                  inputs_embeds: Optional[torch.Tensor] = None,
                  num_items_in_batch=None, ignore_index: int = IGNORE_INDEX,
                  device=None, check_ranks: bool = True) -> dict:
    """This rank's keyword arguments for ``model(**batch)``; see the module docstring.

    Args:
        sp: the sequence-parallel group and layout. With its layout "auto" (the
            default) and ``position_ids`` that pack several documents in a row, the batch
            is split by the layout computed from those documents
            (``sp.for_documents``, ``ringflash.document_layout``): every row must then
            pack the same documents (ValueError naming position_ids otherwise; padding
            may differ). A layout given to SequenceParallel is used as it is.
        input_ids: (batch, seqlen) of the WHOLE sequences, the same on every rank;
            seqlen a multiple of W (2W for zigzag, 128 W for block_stripe; W for a
            layout computed from the documents).
        labels: (batch, seqlen) unshifted, as for the unsharded model (``ignore_index``
            where no loss is wanted), or None for no loss. With an attention_mask, padded
            queries and targets get no loss (``padded_labels``).
        attention_mask: (batch, seqlen), 0 at padding; None for no padding.
        position_ids: (batch or 1, seqlen) of the whole sequences; a position that does
            not follow its predecessor starts a new document (packing). Default 0..seqlen-1.
        inputs_embeds: (batch, seqlen, hidden) instead of input_ids.
        num_items_in_batch: the labelled tokens the loss is normalized by; default those of
            this batch. With data parallelism, give the count of the whole global batch
            (and sum gradients over every rank), or that of this replica's batch (sum over
            sp, average over dp).
        device: where the returned tensors go (default: input_ids').
        check_ranks: compare a digest of the batch across the group (one all-gather of a
            few integers): ranks given different batches raise, on every rank.

    A padded or packed batch is never run without its mask: it reaches the ring as
    segment ids. The batch's ``CONTEXT_KEY`` holds the SequenceParallel it was split by
    (``batch[CONTEXT_KEY].sp``: ``sp`` itself, or one with the layout computed from the
    documents); gather the model's outputs with it, e.g.
    ``batch[CONTEXT_KEY].sp.unshard(out.logits)``.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids (batch, seqlen) and inputs_embeds "
                         "(batch, seqlen, hidden)")
    tokens, name = (input_ids, "input_ids") if inputs_embeds is None else (inputs_embeds, "inputs_embeds")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != (2 if inputs_embeds is None else 3):
        raise ValueError(f"{name} must be a {'(batch, seqlen)' if inputs_embeds is None else '(batch, seqlen, hidden)'} "
                         f"tensor of the whole sequences, got {getattr(tokens, 'shape', type(tokens).__name__)}")
    batch, seqlen = tokens.shape[:2]
    device = tokens.device if device is None else torch.device(device)
    if position_ids is None:
        position_ids = torch.arange(seqlen, device=tokens.device)
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2) or \
            position_ids.shape[-1] != seqlen or (position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch)):
        raise ValueError(f"position_ids must be (batch or 1, {seqlen}) or ({seqlen},), got "
                         f"{tuple(getattr(position_ids, 'shape', ())) or type(position_ids).__name__}")
    position_ids = position_ids.expand(batch, seqlen)
    if attention_mask is not None and attention_mask.shape != (batch, seqlen):
        raise ValueError(f"attention_mask must be {(batch, seqlen)} (batch, seqlen), "
                         f"got {tuple(attention_mask.shape)}")
    if labels is not None and labels.shape != (batch, seqlen):
        raise ValueError(f"labels must be {(batch, seqlen)}, got {tuple(labels.shape)}")
    if check_ranks:
        _check_same_batch(sp, {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask,
                               "position_ids": position_ids})
    segments = segment_ids_of(position_ids, attention_mask)
    if sp.auto and segments is not None:  # a pinned layout is used as it is
        documents = _shared_documents(segments)
        if documents is not None:
            sp = sp.for_documents(documents, seqlen)

    local_positions = sp.shard(position_ids).to(device)
    context = RingContext(sp, local_positions,
                          None if segments is None else sp.shard(segments).to(device))
    prepared = {name: sp.shard(tokens).to(device), "position_ids": local_positions,
                "use_cache": False, CONTEXT_KEY: context}
    if labels is not None:
        if attention_mask is not None:
            labels = padded_labels(labels, attention_mask, ignore_index)
        shifted = sp.shift_labels(labels, ignore_index).to(device)
        if num_items_in_batch is None:
            num_items_in_batch = (labels[:, 1:] != ignore_index).sum()
        prepared.update(labels=shifted, shift_labels=shifted,
                        num_items_in_batch=torch.as_tensor(num_items_in_batch, device=device))
    return prepared
