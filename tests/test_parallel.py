"""SequenceParallel, DeviceMesh groups, one default layout, the differentiable unshard.

- Every function that takes a layout defaults to the same one (zigzag); SequenceParallel's
  "auto" is zigzag but for a sequence packing several documents (``for_documents``), which
  gets the layout computed from them; a layout given to it is pinned.
- A 2 x 2 DeviceMesh of a gloo world of 4 ("dp", "sp"): the mesh dimension, given as
  mesh["sp"] or (mesh, "sp"), works wherever a group does (ring_flash_attn, shard,
  unshard, positions, RingSelfAttention, all_reduce_gradients, SequenceParallel) and
  gives what the equivalent ProcessGroup gives.
- SequenceParallel's loss helpers reproduce the unsharded model's mean cross-entropy and
  its gradient: labels shifted on the whole sequence, the global token count, SUM over
  ranks. unshard's backward is the shard of the gradient.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringflash
from oracle import rel_err
from ringflash.documents import DocumentLayout


def test_one_default_layout():
    defaults = {
        "ring_flash_attn": inspect.signature(ringflash.ring_flash_attn).parameters["layout"].default,
        "shard": inspect.signature(ringflash.shard).parameters["layout"].default,
        "unshard": inspect.signature(ringflash.unshard).parameters["layout"].default,
        "positions": inspect.signature(ringflash.positions).parameters["layout"].default,
        "RingSelfAttention": ringflash.RingSelfAttention(16, 2).layout,
        "SequenceParallel": ringflash.SequenceParallel().layout,
    }
    assert set(defaults.values()) == {ringflash.DEFAULT_LAYOUT} == {"zigzag"}, defaults


def test_sequence_parallel_fixes_group_and_layout():
    sp = ringflash.SequenceParallel(layout="stripe")
    q = torch.randn(1, 8, 2, 8)
    for name, value in (("layout", "zigzag"), ("group", None)):
        with pytest.raises(TypeError, match=name):
            sp.attn(q, q, q, **{name: value})
        with pytest.raises(TypeError, match=name):
            sp.self_attention(16, 2, **{name: value})
    assert sp.self_attention(16, 2).layout == "stripe"
    assert (sp.world, sp.rank) == (1, 0)


def test_auto_layout_follows_the_documents_and_a_named_one_is_pinned():
    sp = ringflash.SequenceParallel()
    assert sp.auto and sp.layout == "zigzag" and "'auto'" in repr(sp)
    cu = torch.tensor([0, 5, 12])  # two documents, then padding
    docs = sp.for_documents(cu, 16)
    assert docs is not sp and not docs.auto and docs.group is sp.group
    assert isinstance(docs.layout, DocumentLayout) and docs.layout.bounds.tolist() == [0, 5, 12]
    assert docs.layout.name == ringflash.document_layout(cu, 16).name
    assert docs.for_documents(torch.tensor([0, 8, 16]), 16) is docs  # now pinned
    assert sp.for_documents(torch.tensor([0, 16]), 16) is sp  # one document: zigzag
    assert sp.for_documents(torch.tensor([0, 9]), 16) is sp  # one document and padding
    for layout in ("zigzag", "block_stripe", docs.layout):
        pinned = ringflash.SequenceParallel(layout=layout)
        assert not pinned.auto and pinned.for_documents(cu, 16) is pinned
    with pytest.raises(ValueError, match="'auto'.*diagonal"):
        ringflash.SequenceParallel(layout="diagonal")
    with pytest.raises(ValueError, match="cu_seqlens"):
        sp.for_documents(torch.tensor([0, 20]), 16)
    with pytest.raises(ValueError, match="seqlen"):
        sp.for_documents(cu, 0)


def test_unshard_backward_is_the_shard_of_the_gradient_world_of_one():
    x = torch.randn(2, 6, 3, requires_grad=True)
    full = ringflash.unshard(x)
    (full * torch.arange(6.0)[None, :, None]).sum().backward()
    assert torch.equal(x.grad, torch.arange(6.0)[None, :, None].expand(2, 6, 3))


# ----------------------------------------------------------------------------- a gloo world


def mesh_and_helpers(rank, world):
    """Everything on a 2 x 2 mesh; returns failure messages."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    pg = mesh.get_group("sp")
    failures = []

    def check(ok, what):
        if not ok:
            failures.append(f"rank {rank}: {what}")

    gen = torch.Generator().manual_seed(10 + mesh.get_local_rank("dp"))  # one batch per replica
    x = torch.randn(2, 16, 3, generator=gen)
    for group in (mesh["sp"], (mesh, "sp"), (mesh, 1)):
        check(torch.equal(ringflash.shard(x, group=group), ringflash.shard(x, group=pg)), f"shard {group}")
        check(torch.equal(ringflash.unshard(ringflash.shard(x, group=group), group=group), x), f"unshard {group}")
        check(torch.equal(ringflash.positions(16, group=group), ringflash.positions(16, group=pg)),
              f"positions {group}")
    grid = ringflash.groups.resolve_grid(mesh)  # a 2-D mesh whole: heads (dim 0) x ring (dim 1)
    check(grid.heads_world == 2 and grid.ring_world == 2, "a 2-D mesh is a heads x ring grid")
    try:
        ringflash.RingSelfAttention(16, 2, group=mesh).local_positions(4)
        ringflash.broadcast_parameters(torch.nn.Linear(2, 2), group=mesh, src=1)
        failures.append(f"rank {rank}: a grid broadcast from its rank 1")
    except ValueError as error:
        check("src" in str(error), f"grid broadcast error: {error}")

    # ring_flash_attn and the layer on the mesh dimension equal those on the ProcessGroup.
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(3))
    sp_mesh = ringflash.SequenceParallel((mesh, "sp"))
    a = sp_mesh.attn(*(sp_mesh.shard(t) for t in (q, k, v)), causal=True)
    b = ringflash.ring_flash_attn(*(ringflash.shard(t, group=pg) for t in (q, k, v)), causal=True, group=pg)
    check(torch.equal(a, b), "ring_flash_attn on (mesh, 'sp')")
    torch.manual_seed(0)
    layer = ringflash.RingSelfAttention(16, 2, group=mesh["sp"])
    check(layer.group.ring is pg and layer.group.heads is None, "RingSelfAttention resolves the mesh to its group")

    # Loss helpers: the unsharded mean cross-entropy and its gradient, by SUM over the ring.
    vocab, n = 11, 16
    logits_full = torch.randn(2, n, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (2, n), generator=gen)
    labels = tokens.clone()
    labels[1, :5] = -100
    want_logits = logits_full.clone().requires_grad_()
    want = F.cross_entropy(want_logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    want.backward()
    local_logits = sp_mesh.shard(logits_full).requires_grad_()
    local_labels = sp_mesh.shift_labels(labels)
    check(int(sp_mesh.num_tokens(local_labels)) == int((labels[:, 1:] != -100).sum()), "num_tokens")
    loss = sp_mesh.loss(local_logits, local_labels)
    loss.backward()
    check(rel_err(sp_mesh.reduce_loss(loss), want) <= 1e-6, "reduce_loss(loss) != unsharded loss")
    check(rel_err(sp_mesh.unshard(local_logits.grad), want_logits.grad) <= 1e-6, "loss gradient")

    # unshard is differentiable: its backward is this rank's shard of the gradient.
    y = sp_mesh.shard(x).requires_grad_()
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))  # same on all ranks
    (sp_mesh.unshard(y) * weight).sum().backward()
    check(torch.equal(y.grad, sp_mesh.shard(weight)), "unshard backward")

    # all_reduce_gradients over a mesh dimension sums over that group only.
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.tensor([float(rank)])
    ringflash.all_reduce_gradients([p], group=(mesh, "dp"))
    same_sp = [r for r in range(world) if r % 2 == rank % 2]
    check(p.grad.item() == sum(same_sp), f"all_reduce_gradients over dp: {p.grad.item()}")
    dist.barrier()
    return failures


class TinyLM(torch.nn.Module):
    """Embedding -> attention over ``attend`` -> vocabulary logits."""

    def __init__(self, vocab=13, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, vocab)

    def forward(self, ids, attend):
        b, n = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(b, n, 3 * self.heads, -1).chunk(3, dim=2)
        return self.out(attend(q, k, v.contiguous()).reshape(b, n, -1))


def ddp_over_the_world(rank, world):
    """A 2 (dp) x 2 (sp) mesh, DDP over all four ranks (it averages over 4): each rank's
    loss is its token losses over the labelled tokens of the WHOLE global batch, times 4.
    The gradient equals the unsharded model's on the global batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    sp, dp_rank = ringflash.SequenceParallel((mesh, "sp")), mesh.get_local_rank("dp")
    torch.manual_seed(0)
    model = TinyLM()
    reference = TinyLM()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 13, (4, 16), generator=gen)  # the global batch: 2 rows a replica
    labels = ids.clone()
    labels[0, :7] = -100

    def attend_full(q, k, v):
        return ringflash.flash_attn(q, k, v, causal=True)

    logits = reference(ids, attend_full)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).backward()

    ddp = DDP(model, process_group=dist.new_group(list(range(world))))  # its own communicator
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)
    n_global = (labels[:, 1:] != -100).sum()
    local_logits = ddp(sp.shard(ids[rows]), lambda q, k, v: sp.attn(q, k, v, causal=True))
    loss = sp.loss(local_logits, sp.shift_labels(labels[rows]), num_tokens=n_global) * world
    loss.backward()
    want = dict(reference.named_parameters())
    return [f"rank {rank}: {name} rel err {rel_err(p.grad, want[name].grad):.3g}"
            for name, p in model.named_parameters() if not rel_err(p.grad, want[name].grad) <= 1e-5]



@pytest.mark.world(4)
def test_device_mesh_and_sequence_parallel_helpers(worlds):
    failures = [f for fs in worlds(4).run(mesh_and_helpers, timeout=120) for f in fs]
    assert not failures, "\n".join(failures)


@pytest.mark.world(4)
def test_ddp_over_every_rank_with_loss_times_world(worlds):
    failures = [f for fs in worlds(4).run(ddp_over_the_world, timeout=120) for f in fs]
    assert not failures, "\n".join(failures)
