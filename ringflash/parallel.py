"""``SequenceParallel``: the sequence sharding of a model in one object.

    sp = ringflash.SequenceParallel(group)          # group: None, a ProcessGroup, a 1-D
                                                    # DeviceMesh or (mesh, "sp"); layout "auto"
    ids = sp.shard(input_ids)                       # this rank's tokens (dim 1)
    pos = sp.positions(input_ids.shape[1])          # their global positions (rotary)
    labels = sp.shift_labels(input_ids)             # shifted on the WHOLE sequence, then sharded
    out = sp.attn(q, k, v, causal=True)             # ring_flash_attn over sp's group and layout
    loss = sp.loss(logits, labels)                  # this rank's term of the global mean
    loss.backward(); sp.reduce_gradients(model.parameters())   # SUM over the group

Everything that depends on which tokens a rank holds takes the group and the layout
from the object, so data and attention cannot be split two different ways.

The layout. ``layout="auto"`` (the default) is zigzag, except for a sequence that packs
several documents: ``sp.for_documents(cu_seqlens, seqlen)`` (which ``ringflash.hf.prepare_batch``
calls for packed ``position_ids``) then gives a SequenceParallel over the same group with
the layout computed from those documents (``ringflash.document_layout``), to shard that
sequence and run its attention. A layout named here (``"zigzag"``, ``"block_stripe"``, ...,
or a document layout) is pinned: ``for_documents`` returns the object itself.

The loss. The unsharded model's loss is the mean over the N labelled tokens of the
global batch, L = (1/N) sum_r S_r, S_r being the sum of the token losses on rank r.
``sp.loss`` returns S_r / N with N counted over the whole group (``num_tokens``), so the
SUM of the ranks' losses is L (``reduce_loss`` gives it, for logging), and after each
rank's backward the SUM of the ranks' gradients is dL/dtheta (``reduce_gradients``). With
a wrapper that AVERAGES gradients over the W ranks instead (DDP, FSDP2 over the sp
ranks), multiply the loss by W. Labels must be shifted before sharding: the label of a
rank's last token is the first token of another rank's shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import agreement, api
from .documents import document_layout
from .groups import resolve_grid
from .layer import RingSelfAttention, all_reduce_gradients
from .layouts import DEFAULT_LAYOUT, LAYOUTS, check_layout

IGNORE_INDEX = -100
# SequenceParallel's default layout: zigzag, or for a sequence packing several documents
# the layout computed from them (``SequenceParallel.for_documents``).
AUTO_LAYOUT = "auto"
_LOSS_FIELDS = agreement.tensor_fields("loss")  # what reduce_loss's ranks compare


class SequenceParallel:
    """The sequence-parallel group of a model and the layout its sequences are split by.

    Args:
        group: None (the world; a ring of one without an initialized process group), a
            ProcessGroup, a 1-D DeviceMesh, or ``(mesh, dim)`` with a dimension name or
            index of an n-D mesh: the ring. Or two dimensions, a 2-D DeviceMesh or a pair
            ``(head_group, ring_group)``: an all-to-all over heads (U ranks) x the ring (R
            ranks), the sequence split over U x R (``ringflash.heads``).
        layout: "auto" (the default): "zigzag" (the default of every ringflash function),
            except for a sequence that packs several documents, which ``for_documents``
            (and ``ringflash.hf.prepare_batch`` with packed position_ids) splits by the
            layout computed from them. Or a pinned layout, used for every sequence:
            "zigzag", "contiguous", "stripe", "block_stripe" (``ringflash.DOCUMENTS_LAYOUT``:
            rows packing different documents), or a layout computed from one packed
            sequence's documents (``ringflash.document_layout``); see ``ringflash.shard``.

    ``layout`` is the layout the methods use ("zigzag" for "auto"), ``auto`` whether it was
    left to the data. Tensors are split along ``dim`` (default 1, the sequence of (batch,
    seq, ...)); the global length must be a multiple of W (2W for zigzag, 128 W for
    block_stripe).
    """

    def __init__(self, group=None, layout=AUTO_LAYOUT):
        self.grid = resolve_grid(group)
        self.group = self.grid if self.grid.heads_world > 1 else self.grid.ring
        self.auto = isinstance(layout, str) and layout == AUTO_LAYOUT
        try:
            self.layout = DEFAULT_LAYOUT if self.auto else check_layout(layout)
        except ValueError:
            raise ValueError(f"layout must be {AUTO_LAYOUT!r}, one of {LAYOUTS} or a "
                             f"ringflash.document_layout, got {layout!r}") from None
        self.grid.world  # noqa: B018 - a rank outside the group(s) is told now

    def __repr__(self) -> str:
        layout = f"{AUTO_LAYOUT!r} ({self.layout!r} unless documents)" if self.auto else repr(self.layout)
        return f"SequenceParallel(world={self.world}, rank={self.rank}, layout={layout})"

    def for_documents(self, cu_seqlens, seqlen: int) -> "SequenceParallel":
        """The SequenceParallel of one sequence of ``seqlen`` GLOBAL tokens that packs the
        documents of ``cu_seqlens`` (flash_attn's varlen format: document d holds tokens
        [cu_seqlens[d], cu_seqlens[d + 1]); tokens from cu_seqlens[-1] on are padding), or
        rows that all pack them.

        With layout "auto" and more than one document: a new SequenceParallel over the same
        group whose layout is ``ringflash.document_layout(cu_seqlens, seqlen, group)``;
        shard that sequence with it and run its attention with it (``attn``, or
        ``RingSelfAttention(...)(x, layout=its.layout)``), with segment ids that split its
        documents at least as finely. Otherwise (a pinned layout, or one document) this
        object itself. Local: every rank computes the same layout from the same arguments.
        Raises ValueError for invalid cu_seqlens or a seqlen not a multiple of the ring's
        size."""
        if not self.auto:
            return self
        bounds = api.check_cu_seqlens(cu_seqlens, api.positive_int(seqlen, "seqlen"))
        if bounds.numel() <= 2:  # one document (and padding): nothing to keep whole
            return self
        return SequenceParallel(self.group, document_layout(bounds, seqlen, self.group))

    @property
    def rank(self) -> int:
        """This rank's place in the order of the sequence's shards."""
        return self.grid.rank

    @property
    def world(self) -> int:
        """The ranks the sequence is split over (U x R on a heads x ring grid)."""
        return self.grid.world

    # ------------------------------------------------------------------------- sharding

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of the full-sequence tensor ``x`` (differentiable)."""
        return api.shard(x, dim, self.layout, self.group)

    def unshard(self, x_local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's part of ``x_local``, gathered in sequence order. Differentiable:
        the gradient of ``x_local`` is this rank's shard of the full tensor's gradient."""
        return api.unshard(x_local, dim, self.layout, self.group)

    def positions(self, seqlen: int, *, device=None) -> torch.Tensor:
        """Global positions (int64, (seqlen // W,)) of this rank's tokens of a sequence of
        ``seqlen`` tokens (the GLOBAL length)."""
        return api.positions(seqlen, self.layout, self.group, device=device)

    # ------------------------------------------------------------------------- attention

    def attn(self, q, k, v, **kwargs):
        """``ring_flash_attn(q, k, v, group=sp's group, layout=sp's layout, **kwargs)``;
        every other keyword (causal, softmax_scale, return_lse, masks, ...) passes on."""
        try:
            self._fixed(kwargs)
        except TypeError as error:  # the other ranks may already be in the ring's check
            agreement.raise_on_every_rank(self.grid, error)
        return api.ring_flash_attn(q, k, v, group=self.group, layout=self.layout, **kwargs)

    def self_attention(self, d_model: int, num_heads: int, num_kv_heads=None, **kwargs):
        """A ``RingSelfAttention`` over sp's group and layout."""
        self._fixed(kwargs)
        return RingSelfAttention(d_model, num_heads, num_kv_heads, group=self.group,
                                 layout=self.layout, **kwargs)

    @staticmethod
    def _fixed(kwargs) -> None:
        for name in ("group", "layout"):
            if name in kwargs:
                raise TypeError(f"{name} is fixed by the SequenceParallel object; make another "
                                "SequenceParallel for a different one")

    # ------------------------------------------------------------------------- loss

    def shift_labels(self, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """This rank's labels for next-token prediction: ``labels`` (batch, seqlen) of the
        WHOLE sequence shifted left by one (the last position gets ``ignore_index``),
        then sharded. Shifting after sharding would be wrong at every shard boundary."""
        if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
            raise ValueError("labels must be a (batch, seqlen, ...) tensor of the whole sequence")
        shifted = F.pad(labels[:, 1:], (0, 0) * (labels.dim() - 2) + (0, 1), value=ignore_index)
        return self.shard(shifted, dim=1)

    def num_tokens(self, labels_local: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """The number of labelled tokens on every rank together (an all-reduce; int64
        tensor on the labels' device)."""
        count = (labels_local != ignore_index).sum().to(torch.int64)
        return self.grid.all_reduce(count)

    def loss(self, logits: torch.Tensor, labels_local: torch.Tensor, *, num_tokens=None,
             ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """This rank's term of the unsharded model's mean cross-entropy: the sum of its
        token losses (fp32) over the global token count ``num_tokens`` (counted with
        ``num_tokens()`` when None, one all-reduce). The SUM over the group of these terms,
        and of their gradients, are the unsharded model's loss and gradient."""
        if num_tokens is None:
            num_tokens = self.num_tokens(labels_local, ignore_index)
        total = F.cross_entropy(logits.float().flatten(0, -2), labels_local.flatten(),
                                ignore_index=ignore_index, reduction="sum")
        return total / num_tokens

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The SUM over the group of each rank's ``loss`` (detached): the global loss. The
        ranks first compare the losses' shapes and dtypes (one all-gather of 12 int64,
        ``agreement.agree``) and all raise a ValueError naming ``loss`` where they differ."""
        def local_checks():
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
            return agreement.tensor_row(loss), None
        agreement.agree(self.grid, "reduce_loss", _LOSS_FIELDS, local_checks)
        return self.grid.all_reduce(loss.detach().clone())

    def reduce_gradients(self, parameters) -> None:
        """SUM every parameter's .grad over the group (``all_reduce_gradients``)."""
        all_reduce_gradients(parameters, self.group)
