"""RingSelfAttention against a single-process float64 reference on the full sequence.

The reference is written here from the layer's weights alone (its own rotary, plain
softmax attention with repeated K/V heads), so it shares no code with the layer. The
distributed cases run in one spawned gloo world per world size (tests/dist_utils.py):
every rank shards the same full input, runs the layer, backpropagates its shard of
the same upstream gradient and sums the parameter gradients over the group
(``all_reduce_gradients``); the gathered output, input gradient and parameter
gradients must match the reference for every layout, causal or not. A layout given per
call (``layer(x, layout=...)``) computes what a layer built with it does.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import ringflash
from oracle import F32, LAYOUTS, TOL as DTYPE_TOL, rel_err as _rel, tokens_per_rank
from ringflash.layer import (RingSelfAttention, all_reduce_gradients, apply_rotary,
                             broadcast_parameters, rotary_cos_sin)

TOL = DTYPE_TOL[F32]  # fp32 against float64, relative Frobenius error
CASES = [(layout, causal) for layout in LAYOUTS for causal in (True, False)]


# ----------------------------------------------------------------------------- the reference


def _reference_rotary(x, base):
    """Rotate-half rotary embedding at positions 0..S-1, float64, from its definition."""
    s, d = x.shape[1], x.shape[-1]
    theta = base ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * theta[None, :]
    rot = torch.polar(torch.ones_like(ang), ang)[None, :, None, :]  # e^{i * angle}
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * rot
    return torch.cat([z.real, z.imag], dim=-1)


def reference_forward(layer: RingSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer's function on the full sequence x (B, S, d_model), in float64."""
    b, s, _ = x.shape
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    w_qkv = layer.qkv_proj.weight.double()
    qkv = x.double() @ w_qkv.T
    if layer.qkv_proj.bias is not None:
        qkv = qkv + layer.qkv_proj.bias.double()
    q, k, v = qkv.view(b, s, h + 2 * hkv, d).split([h, hkv, hkv], dim=2)
    q, k = _reference_rotary(q, layer.rope_base), _reference_rotary(k, layer.rope_base)
    k, v = k.repeat_interleave(h // hkv, dim=2), v.repeat_interleave(h // hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if layer.causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v).reshape(b, s, h * d)
    out = out @ layer.out_proj.weight.double().T
    if layer.out_proj.bias is not None:
        out = out + layer.out_proj.bias.double()
    return out


def reference_grads(layer, x, dout):
    """(out, dx, {param name: grad}) of sum(out * dout), float64."""
    ref = RingSelfAttention(layer.d_model, layer.num_heads, layer.num_kv_heads,
                            head_dim=layer.head_dim, causal=layer.causal,
                            bias=layer.qkv_proj.bias is not None, rope_base=layer.rope_base)
    ref.load_state_dict(layer.state_dict())
    ref.double()
    x = x.detach().double().requires_grad_()
    out = reference_forward(ref, x)
    (out * dout.double()).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in ref.named_parameters()}


def _make(layout, causal, seed=0, d_model=48, heads=6, kv_heads=2, bias=True, group=None):
    torch.manual_seed(seed)
    return RingSelfAttention(d_model, heads, kv_heads, causal=causal, layout=layout, group=group,
                             bias=bias)


def _inputs(batch, seqlen, d_model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, seqlen, d_model, generator=gen),
            torch.randn(batch, seqlen, d_model, generator=gen))


# ----------------------------------------------------------------------------- one process


def test_rotary_matches_complex_definition():
    x = torch.randn(2, 37, 3, 16, dtype=torch.float64)
    cos, sin = rotary_cos_sin(torch.arange(37), 16, 500.0)
    got = apply_rotary(x, cos.double(), sin.double())
    assert _rel(got, _reference_rotary(x, 500.0)) < 1e-6


def test_rotary_keeps_fp32_angles_exact_at_long_positions():
    # fp32 angles would be off by ~1e-2 rad at position 1e5; ours come from float64.
    pos = torch.tensor([131071])
    cos, sin = rotary_cos_sin(pos, 8)
    want = torch.tensor([131071.0], dtype=torch.float64).cos()
    assert abs(cos[0, 0].item() - want.item()) < 1e-6


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_world_of_one_matches_reference(causal):
    layer = _make("zigzag", causal)
    x, dout = _inputs(2, 40, layer.d_model)
    x = x.requires_grad_()
    out = layer(x)
    (out * dout).sum().backward()
    ref_out, ref_dx, ref_grads = reference_grads(layer, x, dout)
    assert _rel(out, ref_out) < TOL
    assert _rel(x.grad, ref_dx) < TOL
    for name, p in layer.named_parameters():
        assert _rel(p.grad, ref_grads[name]) < TOL, name


def test_explicit_positions_equal_default():
    layer = _make("stripe", True)
    x, _ = _inputs(1, 16, layer.d_model)
    torch.testing.assert_close(layer(x, positions=torch.arange(16)), layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(d_model=48, num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    (dict(d_model=50, num_heads=6), "divisible by num_heads"),
    (dict(d_model=48, num_heads=3, num_kv_heads=3, head_dim=15), "even"),
    (dict(d_model=48, num_heads=6, layout="diagonal"), "layout"),
], ids=["kv-heads", "d-model", "odd-head-dim", "layout"])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RingSelfAttention(**kwargs)


def test_bad_input_shape_raises():
    layer = _make("zigzag", True)
    with pytest.raises(ValueError, match="batch, seqlen_local"):
        layer(torch.randn(2, 8, 47))
    with pytest.raises(ValueError, match="positions"):
        layer(torch.randn(1, 8, 48), positions=torch.arange(9))


# ----------------------------------------------------------------------------- spawned worlds


def check_layer_cases(rank, world, cases, seqlen_local=24, batch=2, group_ranks=None):
    """Run every (layout, causal) case on this rank; return {case: {what: rel error}}.

    Only rank 0 of the group compares (the float64 reference is the expensive part)."""
    group = None
    if group_ranks is not None:
        group = dist.new_group(group_ranks)
        if rank not in group_ranks:
            return {}
        world = len(group_ranks)
    g_rank = dist.get_rank(group)
    results = {}
    for layout, causal in cases:
        layer = _make(layout, causal, seed=rank + 10, group=group)  # deliberately different...
        broadcast_parameters(layer, group=group)  # ...until broadcast from the group's rank 0
        x, dout = _inputs(batch, tokens_per_rank(layout, seqlen_local) * world, layer.d_model)
        x_local = ringflash.shard(x, dim=1, layout=layout, group=group).requires_grad_()
        out_local = layer(x_local)
        (out_local * ringflash.shard(dout, dim=1, layout=layout, group=group)).sum().backward()
        all_reduce_gradients(layer.parameters(), group=group)
        out = ringflash.unshard(out_local.detach(), dim=1, layout=layout, group=group)
        dx = ringflash.unshard(x_local.grad, dim=1, layout=layout, group=group)
        # Parameters and their summed gradients must be the same on every rank.
        flat = torch.cat([torch.cat([p.detach().flatten(), p.grad.flatten()])
                          for p in layer.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat, group=group)
        if g_rank != 0:
            continue
        ref_out, ref_dx, ref_grads = reference_grads(layer, x, dout)
        errs = {"out": _rel(out, ref_out), "dx": _rel(dx, ref_dx)}
        for name, p in layer.named_parameters():
            errs[f"d{name}"] = _rel(p.grad, ref_grads[name])
        errs["rank_spread"] = max((e - flat).abs().max().item() for e in everyone)
        results[(layout, causal)] = errs
    return results



@pytest.fixture(scope="module")
def world2_results(worlds):
    return worlds(2).run(check_layer_cases, CASES, timeout=120)[0]


@pytest.mark.world(2)
@pytest.mark.parametrize("layout, causal", CASES,
                         ids=[f"{l}-{'causal' if c else 'full'}" for l, c in CASES])
def test_layer_matches_reference_world2(world2_results, layout, causal):
    errs = world2_results[(layout, causal)]
    assert errs.pop("rank_spread") == 0.0, "ranks ended with different parameters or gradients"
    bad = {k: v for k, v in errs.items() if not v < TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"


def per_call_layouts(rank, world, seqlen=48):
    """One layer built with zigzag, called on shards of a document layout and of zigzag in
    turn (``layout=`` per call): {case: (equal to a layer built with that layout, bitwise;
    gathered output)}, and the output when the layout is left out for the document shards."""
    cu = torch.tensor([0, 7, 30, 48])
    docs = ringflash.document_layout(cu, seqlen)
    x, _ = _inputs(2, seqlen, 48)
    layer = _make("zigzag", True)
    out = {}
    for case, layout in (("zigzag", None), ("documents", docs), ("zigzag again", "zigzag")):
        built = layout or "zigzag"
        seg = ringflash.segment_ids_from_cu_seqlens(cu, seqlen, layout=built).expand(2, -1)
        x_local = ringflash.shard(x, layout=built)
        got = layer(x_local, segment_ids=seg, layout=layout)
        want = _make(built, True)(x_local, segment_ids=seg)
        out[case] = (torch.equal(got, want), ringflash.unshard(got.detach(), layout=built))
    seg = ringflash.segment_ids_from_cu_seqlens(cu, seqlen, layout=docs).expand(2, -1)
    wrong = layer(ringflash.shard(x, layout=docs), segment_ids=seg)  # shards of docs, run as zigzag
    return out, ringflash.unshard(wrong.detach(), layout=docs)


@pytest.mark.world(2)
def test_layout_given_per_call(worlds):
    """The per-call layout reaches the positions, the checks and the ring (and the rotary
    cache does not serve one layout's angles to another at the same length); leaving it
    out for shards of another layout changes the answer, so the comparison is not vacuous."""
    for rank, (out, wrong) in enumerate(worlds(2).run(per_call_layouts, timeout=120)):
        assert all(same for same, _ in out.values()), (rank, {k: v[0] for k, v in out.items()})
        zigzag = out["zigzag"][1]
        assert _rel(out["documents"][1], zigzag) < TOL and torch.equal(out["zigzag again"][1], zigzag)
        assert _rel(wrong, zigzag) > 1e-2, rank


@pytest.mark.world(4)
def test_layer_on_subgroup_world4(worlds):
    """A ring on ranks [1, 3] of a world of 4 (the group argument is honoured)."""
    cases = [("zigzag", True), ("stripe", True)]
    per_rank = worlds(4).run(check_layer_cases, cases, seqlen_local=18, batch=1,
                             group_ranks=[1, 3], timeout=120)
    results = per_rank[1]
    assert set(results) == set(cases)
    for case, errs in results.items():
        assert errs.pop("rank_spread") == 0.0, case
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"{case}: relative errors above {TOL}: {bad}"


def check_ddp_recipe(rank, world, seqlen_local=12, batch=2):
    """The documented 2-D recipe: DDP over the dp group, SUM over the sp group.

    World 4 = 2 replicas x rings of 2; replica i trains on rows [i*batch, (i+1)*batch)
    of the global batch. Returns the gradients' relative errors (rank 0) against the
    mean over every token of the global batch, and their spread over the 4 ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    groups = [dist.new_group(r) for r in ([0, 2], [1, 3], [0, 1], [2, 3])]
    dp_group, sp_group = groups[rank % 2], groups[2 + rank // 2]
    replica, sp = rank // 2, 2
    layer = _make("zigzag", True, seed=rank, group=sp_group)  # DDP broadcasts over dp only:
    broadcast_parameters(layer)                                # make the world agree first
    model = DDP(layer, process_group=dp_group)
    x, dout = _inputs(2 * batch, seqlen_local * sp, layer.d_model)
    rows = slice(replica * batch, (replica + 1) * batch)
    shard = dict(dim=1, layout="zigzag", group=sp_group)
    out = model(ringflash.shard(x[rows], **shard))
    tokens_per_replica = batch * seqlen_local * sp
    ((out * ringflash.shard(dout[rows], **shard)).sum() / tokens_per_replica).backward()
    all_reduce_gradients(layer.parameters(), group=sp_group)
    flat = torch.cat([p.grad.flatten() for p in layer.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    if rank != 0:
        return None
    _, _, ref = reference_grads(layer, x, dout / dout[:, :, 0].numel())  # mean over all tokens
    errs = {name: _rel(p.grad, ref[name]) for name, p in layer.named_parameters()}
    errs["rank_spread"] = max((e - flat).abs().max().item() for e in everyone)
    return errs


@pytest.mark.world(4)
def test_ddp_over_data_parallel_group_world4(worlds):
    errs = worlds(4).run(check_ddp_recipe, timeout=120)[0]
    assert errs.pop("rank_spread") == 0.0
    bad = {k: v for k, v in errs.items() if not v < TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"
