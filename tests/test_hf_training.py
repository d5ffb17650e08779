"""Training loops people use around a ring model, on CPU over gloo: the Hugging Face
Trainer (ringflash.hf.SequenceParallelTrainer with a SequenceParallelCollator) and an
accelerate loop (a prepared DataLoader with a SequenceParallelSampler), at sp = 2 and
dp 2 x sp 2, against the unsharded model trained on the same global batches in one
process: parameters after three steps (and the Trainer's evaluate() loss) equal to rounding."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[test]')")

import ringflash  # noqa: E402
import ringflash.hf  # noqa: E402
from oracle import rel_err  # noqa: E402
from test_hf import tiny_models  # noqa: E402

TOL = 1e-5
SEQLEN, BATCH, EXAMPLES, STEPS = 16, 2, 12, 3


def dataset():
    """Examples of SEQLEN tokens, a few unlabelled (uneven token counts per rank)."""
    gen = torch.Generator().manual_seed(3)
    examples = []
    for i in range(EXAMPLES):
        ids = torch.randint(0, 64, (SEQLEN,), generator=gen)
        labels = ids.clone()
        labels[: i % 5] = -100
        examples.append({"input_ids": ids, "labels": labels})
    return examples


def _sp(rank, world, sp_size):
    """This rank's SequenceParallel: groups of sp_size consecutive ranks (every rank makes
    every group, as torch.distributed requires)."""
    if sp_size == world:
        return ringflash.SequenceParallel()
    groups = [torch.distributed.new_group(list(range(g, g + sp_size))) for g in range(0, world, sp_size)]
    return ringflash.SequenceParallel(groups[rank // sp_size])


def _args(out_dir, batch_size):
    return transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size,
        max_steps=STEPS, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo", seed=0,
        disable_tqdm=True, dataloader_num_workers=0)


def _env(rank, world):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")


def trainer_reference(rank, world, dps):
    """The unsharded model under a plain Trainer in one process, batches of dp x BATCH in
    the order SequenceParallelSampler deals them: final parameters per dp."""
    _env(0, 1)
    out = {}
    for dp in dps:
        reference, _ = tiny_models(attn="sdpa")

        class Reference(transformers.Trainer):
            def _get_train_sampler(self, train_dataset=None):
                return ringflash.hf.SequenceParallelSampler(self.train_dataset, ringflash.SequenceParallel(),
                                                            dp * BATCH, seed=self.args.seed, world=1)

        with tempfile.TemporaryDirectory() as tmp:
            trainer = Reference(model=reference, args=_args(tmp, dp * BATCH), train_dataset=dataset())
            trainer.train()
            out[dp] = {n: p.detach().clone() for n, p in reference.named_parameters()}
            out[dp]["eval_loss"] = torch.tensor(trainer.evaluate(dataset()[:8])["eval_loss"])
    return out


def trainer_ring(rank, world, sp_size):
    _env(rank, world)
    sp = _sp(rank, world, sp_size)
    _, model = tiny_models()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = ringflash.hf.SequenceParallelTrainer(
            model=model, args=_args(tmp, BATCH), sp=sp, train_dataset=dataset(),
            data_collator=ringflash.hf.SequenceParallelCollator(sp))
        trainer.train()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        params["eval_loss"] = torch.tensor(trainer.evaluate(dataset()[:8])["eval_loss"])
    return params


def accelerate_loop(rank, world, sp_size):
    """(ring params, unsharded params) after STEPS of SGD: the ring model in an accelerate
    loop (loss x sp: DDP averages over every rank), the unsharded one on the same global
    batches (the mean over replicas of each replica's token mean, as DDP over dp)."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    _env(rank, world)
    sp = _sp(rank, world, sp_size)
    dp = world // sp_size
    reference, model = tiny_models()
    accelerator = Accelerator(cpu=True)
    examples = dataset()
    sampler = ringflash.hf.SequenceParallelSampler(examples, sp, BATCH, seed=1)
    loader = DataLoader(examples, batch_size=BATCH, sampler=sampler,
                        collate_fn=ringflash.hf.SequenceParallelCollator(sp))
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5), loader)
    for step, batch in zip(range(STEPS), loader):
        accelerator.backward(model(**batch).loss * sp.world)
        optimizer.step()
        optimizer.zero_grad()
    # the reference: the same permutation, dp batches a step
    order = torch.randperm(EXAMPLES, generator=torch.Generator().manual_seed(1)).tolist()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(STEPS):
        loss = 0
        for d in range(dp):
            chunk = [examples[i] for i in order[(step * dp + d) * BATCH:(step * dp + d + 1) * BATCH]]
            ids = torch.stack([e["input_ids"] for e in chunk])
            labels = torch.stack([e["labels"] for e in chunk])
            loss = loss + reference(input_ids=ids, labels=labels).loss / dp
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    unwrapped = accelerator.unwrap_model(model)
    return max(rel_err(p, dict(reference.named_parameters())[n]) for n, p in unwrapped.named_parameters())


@pytest.fixture(scope="module")
def references(worlds):
    return worlds(1).run(trainer_reference, (1, 2), timeout=300)[0]


@pytest.mark.parametrize("world_size,sp_size", [(2, 2), (4, 2)], ids=["sp2", "dp2xsp2"])
def test_trainer_trains_like_the_unsharded_trainer(worlds, references, world_size, sp_size):
    """SequenceParallelTrainer at sp and dp x sp: every rank's parameters after three AdamW
    steps, and then evaluate()'s loss, equal those of the plain Trainer on the unsharded
    model and the whole batches."""
    want = references[world_size // sp_size]
    per_rank = worlds(world_size).run(trainer_ring, sp_size, timeout=300)
    failures = [f"rank {rank}: {n} rel err {rel_err(p, want[n]):.3g}" for rank, params in enumerate(per_rank)
                for n, p in params.items() if not rel_err(p, want[n]) <= TOL]
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("world_size,sp_size", [(2, 2), (4, 2)], ids=["sp2", "dp2xsp2"])
def test_accelerate_loop_trains_like_unsharded(worlds, world_size, sp_size):
    errors = worlds(world_size).run(accelerate_loop, sp_size, timeout=300)
    assert all(err <= TOL for err in errors), errors


def test_sampler_deals_each_replica_its_batches():
    """Batch k of the stream goes to rank k mod W: the ranks of a group get the same."""
    class Fixed(ringflash.hf.SequenceParallelSampler):
        def __init__(self, replicas, **kwargs):
            self.n, self.batch_size, self.shuffle, self.seed, self.epoch = 10, 2, False, 0, 0
            self.dp, self.dealt = max(replicas) + 1, replicas
            self.steps = self.n // (self.dp * self.batch_size)

    indices = list(Fixed([0, 0, 1, 1]))  # dp 2 x sp 2
    batches = [indices[i:i + 2] for i in range(0, len(indices), 2)]
    assert batches == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]]
    with pytest.raises(ValueError, match="batch_size"):
        ringflash.hf.SequenceParallelSampler(range(8), ringflash.SequenceParallel(), 0)
    with pytest.raises(ValueError, match="no step"):
        ringflash.hf.SequenceParallelSampler(range(1), ringflash.SequenceParallel(), 2)
