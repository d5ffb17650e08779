"""Feeding a sequence-parallel model from a data loader, the Hugging Face Trainer and
accelerate: every rank of a sequence-parallel group must get the SAME examples, and the
data-parallel replicas (the groups) different ones.

    sp = ringflash.SequenceParallel(group)               # the sp group of this rank
    collator = SequenceParallelCollator(sp, DataCollatorForLanguageModeling(tok, mlm=False,
                                                                            pad_to_multiple_of=2 * sp.world))
    trainer = ringflash.hf.SequenceParallelTrainer(model=model, args=args, sp=sp,
                                                   train_dataset=ds, data_collator=collator)

The Trainer and an ``accelerate`` prepared DataLoader hand batch k of a loader to rank
k mod W (W every rank, dp x sp). ``SequenceParallelSampler`` orders the examples so that
batch k is the batch of rank k's data-parallel replica: no rank of a group sees other
data, whichever rank the loader runs on. The loss needs no hook: the collator's
``shift_labels`` are this rank's, so the Trainer's token count (summed over every rank)
is the global batch's, it multiplies the loss by W and DDP averages the gradients over W:
the summed gradient of the global token mean. With ``accelerate`` in a loop of your own,
``prepare_batch`` counts the tokens of this replica's batch: multiply the loss by sp (DDP
averages over W; docs/integrations.md).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..exchange import Ring
from ..parallel import SequenceParallel
from .batch import prepare_batch

_BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "inputs_embeds")


def _replicas(sp: SequenceParallel) -> tuple[list[int], int]:
    """(the data-parallel replica of every global rank, this rank's): the replicas are the
    sp groups, numbered by their lowest rank (one all-gather of an int)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0], 0
    lowest = dist.get_rank()
    for group in sp.grid.groups():  # over the heads group, then the ring group: the grid's lowest
        lowest = min(row[0] for row in Ring(group).all_gather_ints([lowest]))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, lowest)
    groups = sorted(set(everyone))
    replicas = [groups.index(g) for g in everyone]
    return replicas, replicas[dist.get_rank()]


class SequenceParallelSampler(Sampler[int]):
    """Example indices for a loader whose batch k goes to rank k mod W (the Trainer's and
    accelerate's prepared loaders): batch k holds the examples of rank k's data-parallel
    replica, so every rank of a sequence-parallel group gets the same batches.

    Args:
        data_source: the dataset (only its length is used).
        sp: this rank's ``SequenceParallel``; the replicas are the sp groups (every rank
            must construct the sampler: one all-gather, over the default group).
        batch_size: the loader's batch size (per device).
        shuffle, seed: a permutation per epoch (``set_epoch``), the same on every rank.
        world: the ranks the loader deals batches to (default: every rank); ``1`` for a
            plain loader that yields every batch on this rank (it then gets its replica's).

    The steps of an epoch are len(data_source) // (dp * batch_size); the rest is dropped.
    """

    def __init__(self, data_source, sp: SequenceParallel, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, world: Optional[int] = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if world is not None and (not isinstance(world, int) or world < 1):
            raise ValueError(f"world must be a positive int or None, got {world!r}")
        self.n = len(data_source)
        self.batch_size, self.shuffle, self.seed, self.epoch = batch_size, shuffle, seed, 0
        replicas, mine = _replicas(sp)
        self.dp = max(replicas) + 1
        self.dealt = replicas if world is None else [mine] * world  # the replica of each batch in turn
        self.steps = self.n // (self.dp * batch_size)
        if self.steps == 0:
            raise ValueError(f"{self.n} examples make no step of {self.dp} replicas x batch_size {batch_size}")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps * len(self.dealt) * self.batch_size

    def __iter__(self):
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.n)
        for step in range(self.steps):
            for replica in self.dealt:
                first = (step * self.dp + replica) * self.batch_size
                yield from order[first:first + self.batch_size].tolist()


class SequenceParallelCollator:
    """``collate`` (default: stack the examples' tensors), then ``prepare_batch``: a loader
    of it yields this rank's part of each batch, ready for ``model(**batch)``.

    ``collate`` must give whole sequences whose length the layout can split (pad to a
    multiple of 2 x sp for zigzag, e.g. ``pad_to_multiple_of``). ``prepare_kwargs`` go to
    ``prepare_batch`` (``check_ranks`` compares the batch across the group with one
    collective: keep the loader in the main process, ``num_workers=0``, or pass
    ``check_ranks=False``).
    """

    def __init__(self, sp: SequenceParallel, collate: Optional[Callable] = None, **prepare_kwargs):
        self.sp = sp
        self.collate = collate if collate is not None else torch.utils.data.default_collate
        self.prepare_kwargs = prepare_kwargs

    def __call__(self, examples) -> dict:
        batch = self.collate(examples)
        unknown = set(batch) - set(_BATCH_KEYS)
        if unknown:
            raise ValueError(f"the collated batch has keys prepare_batch does not take: {sorted(unknown)}")
        return prepare_batch(self.sp, **batch, **self.prepare_kwargs)


@functools.cache
def _trainer_class():
    from transformers import Trainer

    class SequenceParallelTrainer(Trainer):
        """``transformers.Trainer`` whose loaders give every rank of a sequence-parallel group
        the same batches (``SequenceParallelSampler``, shuffled with ``args.seed``); give it
        a ``SequenceParallelCollator`` as ``data_collator``. ``sp``: this rank's
        ``SequenceParallel``. Keep ``args.average_tokens_across_devices`` (the default):
        it makes the loss the global token mean."""

        def __init__(self, *args, sp: SequenceParallel, **kwargs):
            self.sp = sp
            super().__init__(*args, **kwargs)
            if not self.args.average_tokens_across_devices:
                raise ValueError("SequenceParallelTrainer needs average_tokens_across_devices=True: "
                                 "each rank's loss is its part of the global token mean")

        def _get_train_sampler(self, train_dataset=None):
            dataset = self.train_dataset if train_dataset is None else train_dataset
            return SequenceParallelSampler(dataset, self.sp, self.args.per_device_train_batch_size,
                                           seed=self.args.seed)

        def _get_eval_sampler(self, eval_dataset):
            return SequenceParallelSampler(eval_dataset, self.sp, self.args.per_device_eval_batch_size,
                                           shuffle=False)

    return SequenceParallelTrainer


def __getattr__(name: str):
    if name == "SequenceParallelTrainer":  # built on first use: transformers is optional
        return _trainer_class()
    raise AttributeError(name)
