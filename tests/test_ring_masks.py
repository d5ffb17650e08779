"""Masks and dropout through the ring over gloo on CPU: segment ids and sliding windows on
GLOBAL positions, every layout, world sizes 1-4, against the float64 oracle with the full
boolean mask (and dropout's keep mask), and against single-device ``flash_attn`` with the
same mask and seed.

Like test_ring.py, one spawned world per world size runs many configurations; the
items are (world size, layout) so that ``-k zigzag`` selects a layout.
"""

from __future__ import annotations

import pytest
import torch

import ringflash
from oracle import LAYOUTS, NOISE_FLOOR, TOL, global_mask, oracle_results, rel_err
from test_dropout import dropped




def _documents(seqlen: int, kind: str, seed: int) -> torch.Tensor:
    """(1, seqlen) segment ids of one packed row."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "one":
        return torch.zeros(1, seqlen, dtype=torch.int64)
    ids, doc, pos = [], 0, 0
    while pos < seqlen:
        n = int(torch.randint(1, max(2, seqlen // 3), (1,), generator=gen))
        if kind == "tiny" and doc % 2 == 0:
            n = 1  # one-token documents between longer ones
        ids += [doc] * n
        doc, pos = doc + 1, pos + n
    ids = torch.tensor(ids[:seqlen])
    if kind == "padded":  # the last third is padding: a whole shard of it on some layouts
        ids[-(seqlen // 3):] = -1
        ids[:2] = -1  # and two tokens of left padding
    return ids[None]


def _configs(world: int, layout: str, n: int):
    """(name, causal, window, segment kind or None, n local, heads, kv_heads, dtype, dropout_p)."""
    seq = n * world
    cases = [
        ("docs", True, (-1, -1), "random", n, 4, 2, "float32", 0.0),
        ("docs-full", False, (-1, -1), "tiny", n, 2, 2, "float32", 0.0),
        ("padded", True, (-1, -1), "padded", n, 2, 1, "float32", 0.0),
        ("one-doc", True, (-1, -1), "one", n, 2, 2, "float32", 0.0),
        ("window-short", True, (5, -1), None, n, 4, 2, "float32", 0.0),
        ("window-across", True, (n + n // 2, -1), None, n, 2, 2, "float32", 0.0),
        ("window-both", False, (4, 7), None, n, 2, 1, "float32", 0.0),
        ("window-0", False, (0, 0), None, n, 2, 2, "float32", 0.0),
        ("window-wide", True, (seq, seq), None, n, 2, 2, "float32", 0.0),
        ("window+docs", True, (n, -1), "random", n, 4, 2, "float32", 0.0),
        ("docs-bf16", True, (-1, -1), "random", n, 4, 2, "bfloat16", 0.0),
        # dropout with few heads: the twin's Philox takes seconds at block_stripe's 256 tokens a rank
        ("dropout", False, (-1, -1), None, n, 2, 1, "float32", 0.2),
        ("dropout+docs", True, (-1, -1), "random", n, 1, 1, "float32", 0.1),
    ]
    return cases


def _err(got, want) -> float:
    """rel_err, but 0 where both are rounding noise around an exact zero (window 0: every
    query sees only itself, so dq and dk vanish)."""
    finite = torch.isfinite(want)
    a, b = got[finite].double(), want[finite].double()
    if a.numel() and (a - b).abs().max() <= NOISE_FLOOR and b.abs().max() <= NOISE_FLOOR:
        return 0.0
    return rel_err(got, want)


def ring_results(local, dout, layout, group=None, **kwargs) -> dict:
    """{"out", "lse", "dq", "dk", "dv"} of ``ring_flash_attn`` on this rank's shards ``local``
    (q, k, v requiring grad) and the full ``dout``, gathered back to the whole sequence on
    the CPU (every rank takes part: unshard is a collective)."""
    out, lse = ringflash.ring_flash_attn(*local, layout=layout, group=group, return_lse=True, **kwargs)
    out.backward(ringflash.shard(dout.to(out.device), dim=1, layout=layout, group=group))
    got = {"out": out.detach(), "lse": lse.detach(), "dq": local[0].grad, "dk": local[1].grad,
           "dv": local[2].grad}
    return {key: ringflash.unshard(val, dim=2 if key == "lse" else 1, layout=layout, group=group).cpu()
            for key, val in got.items()}


def check_masked_ring(rank, world, layout, seed=0, n=None, device="cpu", names=None):
    """The configurations of _configs (those in ``names``, or all) on this layout, ``n``
    tokens per rank, the ring on ``device`` (the oracle and flash_attn on the CPU);
    returns this rank's failures."""
    failures = []
    n = n or {"stripe": 11, "block_stripe": 256}.get(layout, 12)  # block_stripe: 2 blocks a rank
    configs = [c for c in _configs(world, layout, n) if names is None or c[0] in names]
    for i, (name, causal, window, docs, n, h, hkv, dtype, p) in enumerate(configs):
        seqlen = n * world
        gen = torch.Generator().manual_seed(seed + i)
        dt = getattr(torch, dtype)
        q, k, v, dout = (torch.randn(1, seqlen, hh, 16, generator=gen).to(dt) for hh in (h, hkv, hkv, h))
        seg = None if docs is None else _documents(seqlen, docs, seed + i)
        local = [ringflash.shard(t.to(device), dim=1, layout=layout).requires_grad_() for t in (q, k, v)]
        kwargs = dict(causal=causal, window_size=window)
        drop = dict(dropout_p=p, seed=1000 + i) if p else {}
        kwargs.update(drop)
        if seg is not None:
            kwargs["segment_ids"] = ringflash.shard(seg.to(device), dim=1, layout=layout)
        got = ring_results(local, dout, layout, **kwargs)
        if i % world != rank:
            continue
        # with dropout, the oracle applies the mask that dropout_keep_mask documents
        keep = dropped(ringflash.dropout_keep_mask(drop["seed"], p, 1, h, seqlen), p) if p else None
        want = oracle_results(q, k, v, dout, global_mask(seqlen, causal, window, seg), keep)
        # The single-device kernel with the same mask (and seed), on the full sequence.
        full = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = ringflash.flash_attn(*full, causal=causal, window_size=window,
                                                segment_ids=seg, return_lse=True, **drop)
        ref_out.backward(dout)
        single = dict(zip(("out", "lse", "dq", "dk", "dv"),
                          (ref_out.detach(), ref_lse.detach(), *(t.grad for t in full))))
        tol = TOL[dt]
        for key in got:
            err, err_single = (_err(got[key], want[key]), _err(got[key], single[key]))
            if not (err <= tol and err_single <= tol):
                failures.append(f"W={world} {layout} {name}: {key} rel err {err:.3g} vs oracle, "
                                f"{err_single:.3g} vs flash_attn (tol {tol:g})")
        if seg is not None:  # padding rows: exactly zero output and gradient, lse -inf
            pad = seg[0] < 0
            if not (torch.isneginf(got["lse"][0, :, pad]).all() and (got["out"][0, pad] == 0).all()
                    and (got["dq"][0, pad] == 0).all() and (got["dk"][0, pad] == 0).all()):
                failures.append(f"W={world} {layout} {name}: padding rows not exactly empty")
    return failures



@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"W{w}")
def test_masked_ring_matches_oracle(worlds, world_size, layout):
    per_rank = worlds(world_size).run(check_masked_ring, layout, timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures)


@pytest.mark.world(2)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_masked_ring_of_two_cuts_its_keys(worlds, layout):
    """260 tokens a rank: a ring of two cuts its dK/dV passes and the trip home at key row
    128 (ring.rows.home_cuts), inside zigzag's first chunk of 130 rows, so the bands, documents
    and dropout positions of cut pairs are checked too (block_stripe's 256 rows above are
    cut on their block bound). Under the short window zigzag's own pairs overlap in key
    rows on rank 1 (chunks 1 and 2 side by side), not on rank 0: both ranks must still
    take the same backward schedule, whose messages pair up."""
    from ringflash.ring.rows import home_cuts
    assert home_cuts(260) == (128,)
    per_rank = worlds(2).run(check_masked_ring, layout, 0, 260, timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures)


def with_fused_backward(rank, world, check, *args, **kwargs) -> list[str]:
    """``check(rank, world, *args, **kwargs)``'s failures with the fused backward schedule
    (every pair's dQ and dK/dV in one call, as the Gluon backward runs them on Hopper), here
    on the CPU twin: ``dispatch.gluon_serves`` patched on; one failure more if no fused
    pass ran."""
    from ringflash.kernels import dispatch
    from ringflash.ring import rotate
    calls = []
    serves, fused_pass = dispatch.gluon_serves, rotate._Grads.fused_pass
    dispatch.gluon_serves = lambda *args: True
    rotate._Grads.fused_pass = lambda self, *args, **kwargs: (calls.append(1), fused_pass(self, *args, **kwargs))
    try:
        failures = check(rank, world, *args, **kwargs)
    finally:
        dispatch.gluon_serves, rotate._Grads.fused_pass = serves, fused_pass
    return failures + ([] if calls else [f"rank {rank}: no fused pass ran"])


def with_schedule(rank, world, schedule: str, check, *args, **kwargs) -> list[str]:
    """``check(rank, world, *args, **kwargs)``'s failures with RINGFLASH_SCHEDULE set to
    ``schedule`` on this rank (the ring's schedule, ``ring.plan.takes_direct``)."""
    import os
    before = os.environ.get("RINGFLASH_SCHEDULE")
    os.environ["RINGFLASH_SCHEDULE"] = schedule
    try:
        return check(rank, world, *args, **kwargs)
    finally:
        if before is None:
            del os.environ["RINGFLASH_SCHEDULE"]
        else:
            os.environ["RINGFLASH_SCHEDULE"] = before


def as_on_hopper(rank, world, check, *args, **kwargs) -> list[str]:
    """``check(rank, world, *args, **kwargs)`` with ``dispatch.capability`` saying sm_90, so
    that the ring's forward cuts pairs that are not whole tiles as on Hopper
    (``plan.tile_pieces``; the calls still run on the twin: CPU tensors)."""
    from ringflash.kernels import dispatch
    capability = dispatch.capability
    dispatch.capability = lambda t: (9, 0)
    try:
        return check(rank, world, *args, **kwargs)
    finally:
        dispatch.capability = capability


# What the Gluon backward serves on Hopper: windows on local indices and segment ids.
FUSED = ("window-short", "window-across", "window-both", "window-0", "window-wide", "docs", "docs-full", "padded",
         "window+docs")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [2, 3, 4], ids=lambda w: f"W{w}")
def test_fused_schedule_matches_oracle(worlds, world_size, layout):
    """Windows (short, across ranks, two-sided, zero-width, wider than the sequence) and
    packed documents (causal and not, padding, with a window) through the fused backward
    schedule against the float64 oracle."""
    per_rank = worlds(world_size).run(with_fused_backward, check_masked_ring, layout, seed=7, names=FUSED,
                                      timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda w: f"W{w}")
def test_hopper_schedule_on_ragged_shards_matches_oracle(worlds, world_size, layout):
    """300 tokens a rank (zigzag: chunks of 150), as the ring runs them on Hopper: pairs that
    are not whole tiles of 128 cut into their whole tiles and the rest in the forward (the
    first step's pieces writing, later ones merging, the last step's last piece writing the
    result in bf16) and in the fused backward, windows and documents, fp32 and bf16."""
    per_rank = worlds(world_size).run(with_fused_backward, as_on_hopper, check_masked_ring, layout, seed=3, n=300,
                                      names=FUSED + ("docs-bf16",), timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", [3, 4], ids=lambda w: f"W{w}")
def test_masked_ring_on_the_direct_schedule_matches_oracle(worlds, world_size, layout):
    """Every mask of ``_configs`` through the direct schedule (RINGFLASH_SCHEDULE=direct),
    the two-kernel backward, and on contiguous and zigzag shards the fused one too, with the
    masks it serves."""
    per_rank = worlds(world_size).run(with_schedule, "direct", check_masked_ring, layout, timeout=300)
    if layout in ("contiguous", "zigzag"):
        per_rank += worlds(world_size).run(with_schedule, "direct", with_fused_backward, check_masked_ring, layout,
                                           seed=7, names=FUSED, timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures)
