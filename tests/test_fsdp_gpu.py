"""FSDP2 (``fully_shard``) with the ring on GPUs over NCCL, against DDP and the unsharded model.

Run on 2 GPUs (any W works), every process running pytest:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node=2 -m pytest tests/test_fsdp_gpu.py -q -p no:cacheprovider

(add ``-s`` to see the measured errors, printed by rank 0). Skipped without CUDA or
outside torchrun (the ``nccl`` fixture of tests/test_ring_gpu.py).

The model is launch/train.py's ``RingLM`` (embedding tied to the output head, 2 blocks of
RMSNorm, ``RingSelfAttention`` with GQA and rotary, MLP; d_model 128), fp32 with TF32 off
(IEEE dots in cuBLAS and in the Triton kernels), built from seed 0 on the CPU on every
rank, so every rank and every run below starts from the same weights. Each step trains
on one global batch (2 sequences of 256 x W tokens, two packed documents each, a third of
one row's and a fifth of the other's labels -100, so the ranks hold different numbers of
labelled tokens), the same on every rank, sequence-parallel over ALL W ranks (zigzag).
Four runs of STEPS AdamW steps from the same weights on the same batches:

- ``reference``: the unsharded model on the whole sequences in one process (each rank
  runs it alone: its attention is a ring of one, ``dist.new_group([rank])``), with the
  plain mean cross-entropy over the batch's labelled tokens;
- ``sum``: the ring, no wrapper, each rank's loss ``sp.loss`` = S_r / N (N: the labelled
  tokens of the WHOLE batch), gradients SUMMED over the ranks (``sp.reduce_gradients``);
- ``ddp``: the ring inside ``DistributedDataParallel`` over all W ranks (its own group),
  which AVERAGES the gradients: loss = S_r / N x W;
- ``fsdp``: the ring inside FSDP2 (``fully_shard`` on every block, then on the root, over a
  1-D DeviceMesh of its own group): it reduce-scatters and AVERAGES, so again x W.

That is the rule of docs/integrations.md ("loss x W with a global token count" for a
wrapper that averages over W ranks; a SUM needs no factor). The test asserts, on every
rank, for both ring transports (NCCL send/recv and the copy-engine ring):

1. the first step's gradients (FSDP2's DTensor grads gathered with ``.full_tensor()``):
   FSDP2 equal to DDP within TOL_WRAPPERS, and FSDP2, DDP and the SUM rule equal to the
   unsharded reference within TOL_REFERENCE; all finite;
2. the per-step losses (``sp.reduce_loss``) equal the reference's within TOL_REFERENCE;
3. after STEPS optimizer steps (AdamW on FSDP2's sharded DTensor parameters and state,
   on whole tensors for the others), each run's parameter update (final - initial,
   FSDP2's gathered): FSDP2 vs DDP within TOL_WRAPPERS_UPDATE, each ring run vs the
   reference within TOL_REFERENCE_UPDATE.

A wrong factor (no x W under DDP or FSDP2, or x W under the SUM) is off by 1 - 1/W (0.5 at
W = 2) in every gradient; a local instead of global token count is off by the ranks'
unequal shares of labelled tokens. Every collective (the ring, DDP's and FSDP2's
reductions, ``full_tensor``) runs before any assertion, in the same order on every rank,
and the verdict is agreed by an all-reduce (``_agree``), so a failure on one rank fails
the test on every rank instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringflash
from oracle import rel_err
from test_ring_gpu import _agree, nccl  # noqa: F401 - the NCCL world fixture

pytestmark = pytest.mark.gpu

TRAIN = Path(__file__).resolve().parents[1] / "launch" / "train.py"
MODEL_ARGS = ["--d-model", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
              "--mlp-ratio", "4"]
VOCAB, BATCH, N_LOCAL, STEPS = 96, 2, 256, 3
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
IGNORE = -100

# FSDP2 and DDP compute the same per-rank gradients on the same gathered weights; they
# differ only in how the W per-rank gradients are reduced (reduce-scatter with AVG vs
# all-reduce of pre-divided buckets: the order of W - 1 fp32 additions and where the
# 1/W is applied), i.e. a few ulps of fp32 (1.2e-7) per element. At W = 2 (a + b is
# commutative, 1/2 exact) they are expected bitwise equal (they are on 2 gloo ranks).
TOL_WRAPPERS = 1e-6
# The ring vs one device on the whole sequence: blockwise softmax rescaling and the
# summation over ranks reorder fp32 arithmetic everywhere; tests/test_ring_gpu.py allows
# 1e-4 for the fp32 ring against the float64 oracle (the GPU's exp2 is approximate).
# On 2 gloo ranks (CPU) the gradients differ by 6e-7 and the losses by 1e-7. A wrong
# loss scale is off by 1 - 1/W = 0.5 at W = 2, 5000 times this.
TOL_REFERENCE = 1e-4
# Parameter updates after STEPS AdamW steps. AdamW divides each gradient component by
# its own RMS, so a component near eps (1e-8) or of tiny magnitude carries its rounding
# error into a step of size ~lr: measured on gloo ranks (CPU), fsdp vs ddp 0 at W = 2 and
# 6.1e-6 at W = 3 (gradients 7e-8 apart), ring vs reference 3.2e-5 at W = 2 and 1.2e-4 at
# W = 3 (gradients 6e-7 and 8e-7 apart): up to ~150x. Hence 100x the gradient
# tolerances. (AdamW is scale-invariant: the loss-scaling rule shows in the gradients and
# losses; these catch the sharded optimizer state or step going wrong, an O(1) error.)
TOL_WRAPPERS_UPDATE = 1e-4
TOL_REFERENCE_UPDATE = 1e-2


def train_module():
    """launch/train.py, imported once (as tests/test_train.py does)."""
    name = "ringflash_launch_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TRAIN)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def build_model(group, device) -> torch.nn.Module:
    """launch/train.py's RingLM from seed 0, drawn on the CPU: the same weights everywhere."""
    launch = train_module()
    args = launch.parse_args(MODEL_ARGS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = launch.RingLM(args, VOCAB, group)
    return model.to(device)


def global_batch(step: int, world: int):
    """(ids, labels, segment_ids), each (BATCH, N_LOCAL * W) of whole sequences, drawn on the
    CPU from the step alone: the same on every rank."""
    n = N_LOCAL * world
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, n), generator=gen)
    labels = ids.clone()
    labels[0, : n // 3] = IGNORE      # unlabelled tokens, unevenly spread over the ranks'
    labels[1, n - n // 5:] = IGNORE   # shards: only a GLOBAL token count gives the mean
    segments = torch.zeros(BATCH, n, dtype=torch.int32)
    segments[:, n // 2 + 7:] = 1      # two packed documents, the boundary inside a shard
    return ids, labels, segments


def make_groups(device) -> dict:
    """The ring on the world (zigzag); DDP and FSDP2 each on a group of their own (no
    communicator shared with the ring); a ring of one per rank for the reference. Every
    rank creates every group, in the same order."""
    from torch.distributed.device_mesh import DeviceMesh

    world, rank = dist.get_world_size(), dist.get_rank()
    solo = [dist.new_group([r]) for r in range(world)][rank]
    ddp = dist.new_group(list(range(world)))
    fsdp = dist.new_group(list(range(world)))
    mesh = DeviceMesh.from_group(fsdp, device.type, mesh_dim_names=("fsdp",))
    return {"sp": ringflash.SequenceParallel(), "solo": solo, "ddp": ddp, "mesh": mesh}


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter or gradient (FSDP2's are sharded DTensors: an
    all-gather over the mesh, a collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().clone()


def run_training(kind: str, device, groups: dict) -> dict:
    """STEPS AdamW steps of one run; its per-step losses (the global mean cross-entropy),
    the first step's gradients and the final parameters, all whole tensors by name."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    world, sp = dist.get_world_size(), groups["sp"]
    model = build_model(groups["solo"] if kind == "reference" else sp.group, device)
    forward = model
    if kind == "ddp":
        forward = DDP(model, process_group=groups["ddp"],
                      device_ids=[device.index] if device.type == "cuda" else None)
    elif kind == "fsdp":
        for block in model.blocks:
            fully_shard(block, mesh=groups["mesh"])
        fully_shard(model, mesh=groups["mesh"])  # the root: embedding, tied head, final norm
    elif kind not in ("reference", "sum"):
        raise ValueError(kind)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, grads = [], None
    for step in range(STEPS):
        ids, labels, segments = (t.to(device) for t in global_batch(step, world))
        optimizer.zero_grad(set_to_none=True)
        if kind == "reference":
            logits = forward(ids, segments)
            shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
            loss = F.cross_entropy(logits.float().flatten(0, 1), shifted.flatten(),
                                   ignore_index=IGNORE)  # the mean over labelled tokens
            loss.backward()
            losses.append(loss.detach())
        else:
            logits = forward(sp.shard(ids), sp.shard(segments))
            loss = sp.loss(logits, sp.shift_labels(labels))  # S_r / N, N over the whole batch
            (loss * (1 if kind == "sum" else world)).backward()  # DDP, FSDP2 average: x W
            if kind == "sum":
                sp.reduce_gradients(model.parameters())
            losses.append(sp.reduce_loss(loss))
        if step == 0:
            grads = {name: _full(p.grad) for name, p in model.named_parameters()}
        optimizer.step()
    params = {name: _full(p) for name, p in model.named_parameters()}
    return {"loss": torch.stack(losses), "grads": grads, "params": params}


def compare(runs: dict, start: dict) -> tuple[list[str], dict]:
    """Failures (empty if all pass) and the largest error of each comparison."""
    failures, worst = [], {}

    def check(what, got, want, tol):
        err = rel_err(got, want)
        worst[what] = max(worst.get(what, 0.0), err)
        if not err <= tol:
            failures.append(f"{what}: rel err {err:.3g} > {tol:g}")

    ref = runs["reference"]
    for kind, run in runs.items():
        for name, g in run["grads"].items():
            if not torch.isfinite(g).all():
                failures.append(f"{kind}: gradient of {name} has NaN or inf")
        if set(run["grads"]) != set(ref["grads"]):
            failures.append(f"{kind}: parameters {sorted(run['grads'])} != {sorted(ref['grads'])}")
            return failures, worst
    for name in ref["grads"]:
        check(f"grad fsdp vs ddp [{name}]", runs["fsdp"]["grads"][name], runs["ddp"]["grads"][name],
              TOL_WRAPPERS)
        for kind in ("fsdp", "ddp", "sum"):
            check(f"grad {kind} vs reference [{name}]", runs[kind]["grads"][name], ref["grads"][name],
                  TOL_REFERENCE)
        update = {kind: run["params"][name] - start[name] for kind, run in runs.items()}
        check(f"update fsdp vs ddp [{name}]", update["fsdp"], update["ddp"], TOL_WRAPPERS_UPDATE)
        for kind in ("fsdp", "ddp", "sum"):
            check(f"update {kind} vs reference [{name}]", update[kind], update["reference"],
                  TOL_REFERENCE_UPDATE)
    for kind in ("fsdp", "ddp", "sum"):
        check(f"losses {kind} vs reference", runs[kind]["loss"], ref["loss"], TOL_REFERENCE)
    return failures, worst


def fsdp_against_ddp(device, groups: dict) -> tuple[list[str], dict]:
    """Every run (all their collectives), then the comparisons (none)."""
    initial = build_model(groups["solo"], device)
    start = {name: p.detach().clone() for name, p in initial.named_parameters()}
    runs = {kind: run_training(kind, device, groups) for kind in ("reference", "sum", "ddp", "fsdp")}
    return compare(runs, start)


def summary(worst: dict) -> str:
    """The largest error of each kind of comparison, over the parameters."""
    kinds: dict = {}
    for what, err in worst.items():
        key = what.split(" [")[0]
        kinds[key] = max(kinds.get(key, 0.0), err)
    return ", ".join(f"{key} {err:.2e}" for key, err in kinds.items())


@pytest.fixture(scope="module")
def groups(nccl):  # noqa: F811 - the fixture
    return make_groups(nccl)


@pytest.mark.parametrize("transport", ["nccl", "peer"])
def test_fsdp2_matches_ddp_and_the_unsharded_model(nccl, groups, transport, monkeypatch):  # noqa: F811
    monkeypatch.setenv("RINGFLASH_TRANSPORT", transport)
    failures, worst = fsdp_against_ddp(nccl, groups)
    if dist.get_rank() == 0:
        print(f"\nW={dist.get_world_size()} {transport}: {summary(worst)}")
    _agree([f"{transport}: {f}" for f in failures])
