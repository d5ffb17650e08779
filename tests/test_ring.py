"""The ring over gloo on CPU, against the float64 oracle on the gathered full sequence.

Each world size gets ONE spawned gloo world (the module-scoped ``worlds`` fixture) and
every case runs inside it, so the few seconds of process start-up are paid once per
world size: tests/conftest.py runs the module's tests grouped by the world size each one
declares (a ``world_size`` parameter or ``@pytest.mark.world(n)``). test_ring_matches_oracle is one test item per (world size, configuration),
e.g. ``test_ring_matches_oracle[W2-zigzag-causal-n26-h4kv2-d8-b2-lse-fp32-strided]``,
selectable with ``-k``. Every rank computes the ring; the full-sequence comparison of
configuration i is done by rank i mod W only, which spreads the float64 oracle over the
ranks.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ringflash
from dist_utils import raised
from oracle import (LAYOUTS, TOL, RingCase, attention_oracle, oracle_grads, rel_err, tokens_per_rank,
                    with_blocks)
from test_ring_masks import with_fused_backward, with_schedule

# ----------------------------------------------------------------------------- configurations


def _grid():
    """Every layout x causal x (MHA, GQA, MQA), ragged local lengths, lse in the loss."""
    cases = []
    heads = [(4, 4), (4, 2), (6, 1)]  # MHA, GQA, MQA
    for layout in LAYOUTS:
        for causal in (False, True):
            for i, (h, hkv) in enumerate(heads):
                cases.append(RingCase(layout, causal, tokens_per_rank(layout, 26), h, hkv, head_dim=(16, 8, 32)[i],
                                      batch=(1, 2, 1)[i], use_lse=(i != 1),
                                      scale=0.3 if i == 2 else None, strided=(i == 1)))
            if layout in ("contiguous", "stripe"):  # zigzag needs an even seqlen_local
                cases.append(RingCase(layout, causal, 13, 4, 2, head_dim=8, use_lse=True))
    return cases


def _long():
    """300 tokens per rank: the CPU twin tiles keys by 256, so one shard spans two tiles."""
    return [RingCase(layout, causal, tokens_per_rank(layout, 300), heads=2, kv_heads=1, head_dim=8, use_lse=True)
            for layout in LAYOUTS for causal in (False, True)]


def _half_precision():
    return [RingCase("zigzag", True, 26, 4, 2, head_dim=16, use_lse=True, dtype="bfloat16"),
            RingCase("stripe", False, 13, 4, 4, head_dim=16, use_lse=False, dtype="float16")]


ORACLE_CASES = _grid() + _long() + _half_precision()


def _describe(cfg: RingCase, world):
    return f"W={world} {cfg.id}"


# ----------------------------------------------------------------------------- worker side


def _full_inputs(cfg: RingCase, world, seed):
    """The same full-sequence q, k, v, dout, dlse on every rank."""
    gen = torch.Generator().manual_seed(seed)
    dtype = cfg.torch_dtype
    b, n, h, hkv, d = cfg.batch, cfg.n * world, cfg.heads, cfg.kv_heads, cfg.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = rand(b, n, h, d).to(dtype), rand(b, n, hkv, d).to(dtype), rand(b, n, hkv, d).to(dtype)
    dout = rand(b, n, h, d).to(dtype)
    dlse = rand(b, h, n)
    return q, k, v, dout, dlse


def _run_ring(cfg: RingCase, q, k, v, dout, dlse, group):
    """Ring forward + backward on this rank's shards; returns the gathered full tensors."""
    layout = cfg.layout
    ql, kl, vl = (ringflash.shard(t, dim=1, layout=layout, group=group) for t in (q, k, v))
    dout_l = ringflash.shard(dout, 1, layout, group)
    if cfg.strided:
        ql, dout_l = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (ql, dout_l))
        assert not ql.is_contiguous()
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
    kwargs = dict(causal=cfg.causal, softmax_scale=cfg.scale, group=group, layout=layout)
    if cfg.use_lse:  # the loss sum(out * dout) + sum(lse * dlse)
        out, lse = ringflash.ring_flash_attn(ql, kl, vl, return_lse=True, **kwargs)
        torch.autograd.backward([out, lse], [dout_l, ringflash.shard(dlse, 2, layout, group)])
    else:
        out = ringflash.ring_flash_attn(ql, kl, vl, **kwargs)
        assert isinstance(out, torch.Tensor), f"return_lse=False must return a tensor, got {type(out)}"
        lse = None
        out.backward(dout_l)
    b, n, h, _ = ql.shape
    assert out.dtype == q.dtype and out.shape == ql.shape, (out.dtype, out.shape)
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == (b, h, n), (lse.dtype, lse.shape)
    for t in (ql, kl, vl):
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
    gathered = {
        "out": ringflash.unshard(out.detach(), 1, layout, group),
        "dq": ringflash.unshard(ql.grad, 1, layout, group),
        "dk": ringflash.unshard(kl.grad, 1, layout, group),
        "dv": ringflash.unshard(vl.grad, 1, layout, group),
    }
    if lse is not None:
        gathered["lse"] = ringflash.unshard(lse.detach(), 2, layout, group)
    return gathered


def _compare(cfg: RingCase, q, k, v, dout, dlse, got, world) -> list[str]:
    offset = 0 if cfg.causal else None
    out, lse = attention_oracle(q, k, v, causal_offset=offset, softmax_scale=cfg.scale)
    dq, dk, dv = oracle_grads(q, k, v, dout, causal_offset=offset, softmax_scale=cfg.scale,
                              dlse=dlse if cfg.use_lse else None)
    want = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    tol = TOL[cfg.torch_dtype]
    failures = []
    for name, value in got.items():
        err = rel_err(value, want[name])
        if not err <= tol:  # also catches NaN
            failures.append(f"{_describe(cfg, world)}: {name} rel err {err:.3g} > {tol:g}")
    return failures


def check_configs(rank, world, configs, seed=0, group_ranks=None, first_index=0):
    """Ring vs oracle for every configuration; returns this rank's failure messages.

    Configuration i (counted from ``first_index``) gets inputs from seed + i and is
    compared with the oracle on rank i mod W. With ``group_ranks`` the ring runs on
    ``dist.new_group(group_ranks)`` (every rank of the world must create it; only members
    compute). Exceptions propagate: a rank that raises mid-ring would leave its peers
    waiting, and the World reports its traceback.
    """
    group, members = None, list(range(world))
    if group_ranks is not None:
        group = dist.new_group(group_ranks)
        members = list(group_ranks)
        if rank not in members:  # it must be told so, not join a ring it is not part of
            caught = raised(lambda: ringflash.ring_flash_attn(*_small(), group=group))
            if caught is None or caught[0] != "ValueError" or "group" not in caught[1]:
                return [f"a non-member calling ring_flash_attn on the group got {caught}"]
            return []
    ring_world, ring_rank = len(members), members.index(rank)
    failures = []
    for i, cfg in enumerate(configs, start=first_index):
        q, k, v, dout, dlse = _full_inputs(cfg, ring_world, seed + i)
        got = _run_ring(cfg, q, k, v, dout, dlse, group)
        if i % ring_world == ring_rank:
            failures += _compare(cfg, q, k, v, dout, dlse, got, ring_world)
    return failures


def check_concurrent_subgroups(rank, world, configs):
    """Two rings at once on disjoint groups: ranks [1, 3] and [0, 2] of a world of 4."""
    odd = [1, 3]
    groups = [dist.new_group(ranks) for ranks in (odd, [0, 2])]  # every rank creates both
    group = groups[0] if rank in odd else groups[1]
    members = odd if rank in odd else [0, 2]
    failures = []
    for i, cfg in enumerate(configs):
        # Different data on the two rings, so a message crossing rings would show.
        q, k, v, dout, dlse = _full_inputs(cfg, 2, 1000 * (rank in odd) + i)
        got = _run_ring(cfg, q, k, v, dout, dlse, group)
        if i % 2 == members.index(rank):
            failures += [f"group {members}: {f}" for f in _compare(cfg, q, k, v, dout, dlse, got, 2)]
    return failures


# ----------------------------------------------------------------------------- tests



def _assert_no_failures(per_rank):
    failures = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not failures, f"{len(failures)} mismatch(es) vs the float64 oracle:\n" + "\n".join(failures)


# World size outermost: the items of one size run back to back in the same spawned world.
ORACLE_ITEMS = [(w, i) for w in (1, 2, 3, 4) for i in range(len(ORACLE_CASES))]


@pytest.mark.parametrize("world_size,index", ORACLE_ITEMS,
                         ids=[f"W{w}-{ORACLE_CASES[i].id}" for w, i in ORACLE_ITEMS])
def test_ring_matches_oracle(worlds, world_size, index):
    """out, lse, dq, dk, dv for every layout, causal and not, MHA/GQA/MQA, ragged local
    lengths (13, 26, and 300 > the CPU twin's key tile of 256), lse in the loss, fp32 and
    a bf16/fp16 case each."""
    _assert_no_failures(worlds(world_size).run(check_configs, [ORACLE_CASES[index]],
                                               first_index=index, timeout=120))


# The direct schedule differs from the rotation from three steps on: worlds of 3 and 4.
DIRECT_ITEMS = [(w, i) for w in (3, 4) for i in range(len(ORACLE_CASES))]


@pytest.mark.parametrize("world_size,index", DIRECT_ITEMS,
                         ids=[f"W{w}-{ORACLE_CASES[i].id}" for w, i in DIRECT_ITEMS])
def test_direct_schedule_matches_oracle(worlds, world_size, index):
    """``test_ring_matches_oracle``'s cases through the direct schedule (RINGFLASH_SCHEDULE=
    direct: whole shards sent straight to every rank that computes them, partial dK/dV
    sums straight home), with the two-kernel and the fused backward."""
    for check in ((check_configs,), (with_fused_backward, check_configs)):
        _assert_no_failures(worlds(world_size).run(with_schedule, "direct", *check, [ORACLE_CASES[index]],
                                                   first_index=index, timeout=120))


@pytest.mark.world(4)
def test_ring_on_subgroup(worlds):
    """A ring over ranks 1 and 3 of a world of 4 (ranks 0 and 2 stay out of it)."""
    configs = [RingCase(layout, causal, tokens_per_rank(layout, 26), 4, 2, use_lse=True)
               for layout in LAYOUTS for causal in (False, True)]
    _assert_no_failures(worlds(4).run(check_configs, configs, seed=7, group_ranks=[1, 3]))


@pytest.mark.world(4)
def test_direct_schedule_on_subgroup(worlds):
    """The direct schedule's messages go s ranks ahead and back within the ring's own group:
    a ring over ranks 1, 2 and 3 of a world of 4 (rank 0 stays out of it)."""
    configs = [RingCase(layout, True, tokens_per_rank(layout, 26), 4, 2, use_lse=True) for layout in LAYOUTS]
    _assert_no_failures(worlds(4).run(with_schedule, "direct", check_configs, configs, seed=5,
                                      group_ranks=[1, 2, 3]))


@pytest.mark.world(4)
def test_ring_on_two_subgroups_at_once(worlds):
    configs = [RingCase("zigzag", True, 26, 4, 1, use_lse=True), RingCase("stripe", True, 13, 2, 2)]
    _assert_no_failures(worlds(4).run(check_concurrent_subgroups, configs))


class _RecordingRing:
    """Rank ``rank`` (0) of ``world`` to ring_backward, moving no data: records the messages
    it posts, the waits and the kernel passes in between."""

    def __init__(self, world, rank=0):
        self.rank, self.world, self.events, self.messages = rank, world, [], []

    def buffer(self, name, shape, dtype, device):
        return torch.zeros(shape, dtype=dtype, device=device)

    def exchange(self, *pairs, shift=1):
        self.events.append(("post", shift))
        self.messages += [tuple(t.shape for t in pair) for pair in pairs]
        return [object()]

    def wait(self, pending):
        self.events += [("wait",)] * len(pending)


def _early_tail(n: int) -> list:
    """The events that end a ring of two's backward whose remote dK/dV pass runs first: per
    piece of key rows its dK/dV pass and that piece's trip home, the remote dQ pass, then
    per piece the wait for its sums and the own dK/dV pass adding them."""
    from ringflash.ring.rows import home_cuts
    parts = len(home_cuts(n)) + 1
    return [("dkv",), ("post", -1)] * parts + [("dq",)] + [("wait",), ("dkv",)] * parts


@pytest.mark.parametrize("schedule", ["rotate", "direct"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("band", [(None, None), (-2, 0)], ids=["full", "window2"])
def test_backward_ends_on_the_own_shard_under_the_last_trip(monkeypatch, world, layout, band, schedule):
    """The own shard's dQ pass runs first, while the first K/V trip is in flight, and its
    dK/dV pass last. The last remote dK/dV sum goes home under a kernel pass: the own
    dK/dV pass, or, on a ring of two whose remote step is at least half its own step
    (full attention; not a window of 2), the remote dQ pass, the own dK/dV pass then
    adding the arrived sum as it writes. No transfer waits behind the last kernel pass
    but one. The direct schedule (three steps or more) posts every K/V trip first, one to
    each rank s ahead, and after each remote step's passes its partial sums' trip home
    (s ranks back), in step order; every message is waited for once."""
    from ringflash.layouts import active_steps, remote_share
    from ringflash.ring import ring_backward
    monkeypatch.setenv("RINGFLASH_SCHEDULE", schedule)
    fake = _RecordingRing(world)
    monkeypatch.setattr(ringflash.kernels, "flash_attn_bwd", lambda *args, **kw: fake.events.append(
        ("dq" if args[6] is not None else "dkv",)))  # (dout, q, k, v, lse, delta, dq, dk, dv)
    n = tokens_per_rank(layout, 4 * world)
    q, k, v, out, dout = (torch.randn(1, n, 2, 8) for _ in range(5))
    lse = torch.randn(1, 2, n)
    ring_backward(dout, q, k, v, out, lse, None, None, softmax_scale=0.3,
                           band=band, dropout=(0.0, 0), layout=layout, ring=fake)
    ev = fake.events
    steps = active_steps(layout, world, n, band)
    last_post = max(i for i, e in enumerate(ev) if e[0] == "post")
    assert ev[last_post] == ("post", 1 - steps), ev
    assert ev.count(("wait",)) == sum(e[0] == "post" for e in ev), ev
    if schedule == "direct" and steps >= 3:
        posts = [e for e in ev if e[0] == "post"]
        assert posts == [("post", s) for s in range(1, steps)] + [("post", -s) for s in range(1, steps)], ev
        assert ev[:steps - 1] == posts[:steps - 1] and ev[steps - 1] == ("dq",), ev
    if steps == 2 and remote_share(layout, world, n, band) >= 0.5:
        tail = _early_tail(n)
        assert ev[-len(tail):] == tail, ev
    else:
        assert ("dkv",) in ev[last_post:] and ("dq",) not in ev[last_post:] and ev[-1] == ("wait",), ev
    first_wait = ev.index(("wait",))
    assert ev[:first_wait].count(("dq",)) >= 1 and ("dkv",) not in ev[:first_wait], ev


@pytest.mark.parametrize("world, seed", [(3, 10), (4, 17), (8, 12)])
def test_direct_schedule_sends_each_rank_what_it_sees(world, seed):
    """Under the direct schedule each exchange carries the rows of the source's shard that
    the receiving rank's pairs see (``plan.routes``), inside what the rotation carries
    (``travelling_rows``); where they see none, one row travels and no pair runs. Every
    rank's step pairs read only key rows of its route, and every key its pairs see before
    the cut is still seen after it (packed documents of median 300, 1024 tokens a rank:
    draws that take the direct schedule with routes of both kinds)."""
    from ringflash.layouts import step_pairs, visible_keys
    from ringflash.ring.plan import schedule_of
    from test_documents import _lognormal
    n = 1024
    layout = ringflash.document_layout(_lognormal(n * world - 100, 300, seed=seed), n * world, world=world)
    band, empty, shorter = (None, 0), 0, 0
    for rank in range(world):
        sched = schedule_of(_RecordingRing(world, rank), layout, n, band, (0.0, 0), None)
        assert sched.direct and sched.steps >= 3, (rank, sched.steps)
        for s in range(1, sched.steps):
            src = (rank - s) % world
            route, sent = sched.routes[src][s - 1], sched.sent[src]
            before = [visible_keys(p, n) for p in step_pairs(layout, rank, src, world, n, band, True, None)]
            seen = [r for r in before if len(r)]
            if route is None:
                empty += 1
                assert not seen and sched.pairs[s] == (), (rank, s)
                continue
            lo, hi = route
            assert sent[0] <= lo < hi <= sent[1], (rank, s, route, sent)
            shorter += hi - lo < sent[1] - sent[0]
            assert min(r.start for r in seen) == lo and max(r.stop for r in seen) == hi, (rank, s)
            assert all(0 <= p.k.start < p.k.stop <= hi - lo for p in sched.pairs[s]), (rank, s)
            # Back in the shard's rows (a pair's band counts from its own first key row):
            after = [visible_keys(p._replace(k=slice(p.k.start + lo, p.k.stop + lo)), n) for p in sched.pairs[s]]
            assert sorted((r.start, r.stop) for r in after if len(r)) == sorted((r.start, r.stop) for r in seen)
    assert empty and shorter, (empty, shorter)  # the draw exercises both


@pytest.mark.parametrize("keep", [False, True], ids=["received-again", "kept"])
def test_direct_schedule_keeps_what_it_received(monkeypatch, keep):
    """Asked to (``keep_received``), the direct schedule's forward keeps the rows every
    step received (every travelling row of the shards it computes), and its backward posts no K/V
    trip: only the partial sums home, one a remote step, the remote steps running first and
    the own step's passes last; else it receives them again, under the own dQ pass.
    Packed documents on their layout, 4 ranks, one split over all of them (1024 tokens a
    rank: widened to whole tiles, its pieces leave most of each shard home)."""
    from ringflash.ring import ring_backward, ring_forward
    from ringflash.ring.plan import schedule_of
    from test_documents import _lognormal
    monkeypatch.setenv("RINGFLASH_SCHEDULE", "auto")
    world, n = 4, 1024
    layout = ringflash.document_layout(_lognormal(n * world - 100, 600, seed=17), n * world, world=world)
    fake = _RecordingRing(world)
    sched = schedule_of(fake, layout, n, (None, 0), (0.0, 0), None)
    assert sched.direct and sched.sent is not None and sched.steps == 4
    # Rank 0 receives from ranks 3, 2, 1 (steps 1-3) the rows its own pairs see: each
    # inside what that shard sends any rank, and together fewer here.
    got = [sched.routes[world - s][s - 1] or (sched.sent[world - s][0], sched.sent[world - s][0] + 1)
           for s in (1, 2, 3)]
    assert all(sent[0] <= lo < hi <= sent[1] for (lo, hi), sent in zip(got, sched.sent[:0:-1]))
    rows = sum(hi - lo for lo, hi in got)
    assert rows < sum(hi - lo for lo, hi in sched.sent[1:])
    monkeypatch.setattr(ringflash.kernels, "flash_attn_fwd", lambda *args, **kw: fake.events.append(("fwd",)))
    monkeypatch.setattr(ringflash.kernels, "flash_attn_bwd", lambda *args, **kw: fake.events.append(
        ("dq" if args[6] is not None else "dkv",)))
    q, k, v, dout = (torch.randn(1, n, 2, 8) for _ in range(4))
    ids = torch.zeros(1, n, dtype=torch.int32)
    kw = dict(softmax_scale=0.3, band=(None, 0), dropout=(0.0, 0), layout=layout, ring=fake)
    out, lse, kept = ring_forward(q, k, v, ids, keep_received=keep, **kw)
    assert [e for e in fake.events if e[0] == "post"] == [("post", s) for s in (1, 2, 3)]
    if keep:
        assert kept[0].shape == (2 * 2 * 8 * rows,) and kept[1].shape == (rows,)
    else:
        assert kept is None
    fake.events.clear()
    mine = k.untyped_storage().data_ptr()
    monkeypatch.setattr(ringflash.kernels, "flash_attn_bwd", lambda *args, **kw: fake.events.append(
        ("dq" if args[6] is not None else "dkv", args[2].untyped_storage().data_ptr() == mine)))
    ring_backward(dout, q, k, v, out, lse, None, ids, kept=kept, **kw)
    ev = fake.events
    posts = [e for e in ev if e[0] == "post"]
    assert posts == [("post", s) for s in (1, 2, 3) if not keep] + [("post", -s) for s in (1, 2, 3)], ev
    assert ev.count(("wait",)) == len(posts)
    own = [i for i, e in enumerate(ev) if e[0] in ("dq", "dkv") and e[1]]
    if keep:  # nothing to wait for: the remote steps first, the own step's dQ and dK/dV passes last
        assert own and own[0] > ev.index(("post", -3)) and ev[own[0]][0] == "dq" and ev[own[-1]][0] == "dkv", ev
    else:  # the own dQ pass under the K/V trips, its dK/dV pass last
        assert ev[own[0]] == ("dq", True) and own[0] < ev.index(("post", -1)) < own[-1], ev


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("band", [(None, None), (None, 0)], ids=["full", "causal"])
def test_fused_backward_hides_every_trip(monkeypatch, world, layout, band):
    """Where one kernel computes a pair's dQ and dK/dV together (the Gluon backward on
    Hopper; ``dispatch.gluon_serves`` patched here) every call is fused ("both"): the own
    step's first piece of key rows runs while the first K/V trip is in flight, each
    visiting step's kernels run before the wait for the running sum they add to (they
    write into a buffer of their own), the last sums go home under the own step's second
    piece. (A ring of two posts other messages than its unfused schedule: every rank
    chooses alike, from what the rank check compares.)"""
    from ringflash.kernels import dispatch
    from ringflash.layouts import active_steps, step_pairs
    from ringflash.ring import ring_backward
    n = tokens_per_rank(layout, 1024) if layout != "block_stripe" else 1024
    q, k, v, out, dout = (torch.randn(1, n, 2, 8) for _ in range(5))
    lse = torch.randn(1, 2, n)
    runs = {}
    for fused in (False, True):
        fake = _RecordingRing(world)
        monkeypatch.setattr(dispatch, "gluon_serves", lambda *args, fused=fused: fused)
        monkeypatch.setattr(ringflash.kernels, "flash_attn_bwd", lambda *args, fake=fake, **kw: fake.events.append(
            ("both" if args[6] is not None and args[7] is not None else "dq" if args[6] is not None else "dkv",)))
        dq, dkv = ring_backward(dout, q, k, v, out, lse, None, None, softmax_scale=0.3, band=band, dropout=(0.0, 0),
                                layout=layout, ring=fake)
        assert dq.shape == q.shape and dkv.shape == (2, *k.shape)
        runs[fused] = fake
    ev, steps = runs[True].events, active_steps(layout, world, n, band)
    assert {e for e in ev if e[0] != "post" and e[0] != "wait"} == {("both",)}, ev
    if steps == 1:
        assert ev == [("both",)] * len(ev), ev
        return
    assert ev[:2] == [("post", 1), ("both",)], ev  # the first K/V trip under the own step's first piece
    last_post = max(i for i, e in enumerate(ev) if e[0] == "post")
    assert ev[last_post] == ("post", 1 - steps) and ev[last_post + 1] == ("both",) and ev[-1] == ("wait",), ev
    if all(step_pairs(layout, 0, -s % world, world, n, band) for s in range(steps)):  # rank 0 busy every step
        for i, e in enumerate(ev):  # every wait follows a kernel: none waits with nothing running
            if e == ("wait",) and i < len(ev) - 1:
                assert ev[i - 1] in (("both",), ("wait",)), (i, ev)


@pytest.mark.parametrize("rows", [(84, 3174, 0, 1000), (0, 512, 0, 256), (256, 100, 0, 700), (5, 300, 130, 641)],
                         ids=lambda r: f"q{r[0]}+{r[1]}-k{r[2]}+{r[3]}")
@pytest.mark.parametrize("band", [(None, None), (None, 0), (-300, 40), (None, -2000)], ids=str)
@pytest.mark.parametrize("jump", [0, 3 * 128])
def test_tile_pieces_hold_every_element_of_the_pair_once(rows, band, jump):
    """``plan.tile_pieces``: a pair whose rows are not whole tiles of 128 is cut into the
    part of whole tiles (rows of both sides multiples of 128) and the rest; each element
    the pair sees lies in exactly one piece, seen there under the piece's own band, at the
    same global positions (dropout's key)."""
    from ringflash.kernels.masks import BLOCK, PairMask, pair_positions, visible
    from ringflash.layouts import Pair
    from ringflash.ring.plan import tile_pieces
    q0, nq, k0, nk = rows
    n = 4096
    pair = Pair(slice(q0, q0 + nq), slice(k0, k0 + nk), *band, (7000, 123, 1, jump))

    def seen(p: Pair) -> torch.Tensor:  # (n, n): the elements p sees, at shard rows
        qi, kj = torch.arange(p.q.stop - p.q.start), torch.arange(p.k.stop - p.k.start)
        ok = visible(qi, kj, PairMask(p.band_lo, p.band_hi))
        grid = torch.zeros(n, n, dtype=torch.int32)
        grid[p.q, p.k] = 1 if ok is None else ok.int()
        return grid

    pieces = tile_pieces(pair, n)
    whole = nq >= BLOCK and nk >= BLOCK and (nq % BLOCK or nk % BLOCK)
    assert len(pieces) == (1 + bool(nq % BLOCK) + bool(nk % BLOCK) + bool(nq % BLOCK and nk % BLOCK) if whole else 1)
    first = pieces[0]
    assert not whole or ((first.q.stop - first.q.start) % BLOCK, (first.k.stop - first.k.start) % BLOCK) == (0, 0)
    assert torch.equal(sum(seen(p) for p in pieces), seen(pair))
    for p in pieces:
        qi, kj = torch.arange(p.q.stop - p.q.start), torch.arange(p.k.stop - p.k.start)
        qp, kp = pair_positions(p.pos, qi, kj)
        want_q, want_k = pair_positions(pair.pos, qi + p.q.start - q0, kj + p.k.start - k0)
        assert torch.equal(qp, want_q) and torch.equal(kp, want_k), p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_on_hopper_cuts_pairs_into_whole_tiles(monkeypatch, dtype):
    """On Hopper (``dispatch.capability`` patched) the ring's forward runs a pair that is not
    whole tiles as its whole tiles and the rest: one rank, 300 rows, causal, runs
    (256, 256), (256, 44), (44, 256), (44, 44) query x key rows, the first writing (bf16:
    into the fp32 out, the last of each query rows writing the result), and gives the
    uncut call's out and lse (fp32: to rounding)."""
    from ringflash.kernels import dispatch
    from ringflash.ring import ring_forward
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 300, 2, 8, generator=gen).to(dtype) for _ in range(3))
    args = dict(softmax_scale=0.3, band=(None, 0), dropout=(0.0, 0), layout="contiguous")
    want_out, want_lse, _ = ring_forward(q, k, v, None, ring=_RecordingRing(1), **args)
    calls = []
    forward = ringflash.kernels.flash_attn_fwd
    monkeypatch.setattr(dispatch, "capability", lambda t: (9, 0))
    monkeypatch.setattr(ringflash.kernels, "flash_attn_fwd", lambda q, k, *a, **kw: (
        calls.append((q.shape[1], k.shape[1], kw["accumulate"], kw["out"].dtype)), forward(q, k, *a, **kw)))
    out, lse, _ = ring_forward(q, k, v, None, ring=_RecordingRing(1), **args)
    last = dtype  # the last piece of each query rows writes the result in q's dtype
    assert calls == [(256, 256, False, torch.float32), (256, 44, True, last), (44, 256, False, torch.float32),
                     (44, 44, True, last)], calls
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(out, want_out) <= tol and rel_err(lse, want_lse) <= 1e-6


def test_fused_schedule_is_chosen_from_the_shard_not_its_pairs(monkeypatch):
    """The fused schedule's choice reads the shard's rows, the same on every rank, not each
    pair's: under a document layout ranks share pieces of documents of any length (whose
    calls then run the Triton kernels, inside the fused schedule), yet every rank chooses
    it where the Gluon backward serves the masks (bf16, head_dim 128, causal documents),
    and none with ``deterministic`` (segment ids then take the Triton backward)."""
    from ringflash.kernels import dispatch
    from ringflash.ring.rotate import _fuses
    from test_documents import _lognormal
    monkeypatch.setattr(dispatch, "capability", lambda t: (9, 0))
    world, n = 4, 512
    layout = ringflash.document_layout(_lognormal(n * world - 200, 300, seed=3), n * world, world=world)
    q, k = torch.zeros(1, n, 4, 128, dtype=torch.bfloat16), torch.zeros(1, n, 2, 128, dtype=torch.bfloat16)
    ids = torch.zeros(1, n, dtype=torch.int32)
    ragged = 0
    for rank in range(world):
        steps = [layout.pairs(rank, (rank - s) % world, world, n, (None, 0), True, None) for s in range(world)]
        ragged += sum(len(range(n)[p.q]) % 128 != 0 or len(range(n)[p.k]) % 128 != 0 for st in steps for p in st)
        assert _fuses(q, k, steps, ids, (0.0, 0), None, None, False), rank
        assert not _fuses(q, k, steps, ids, (0.0, 0), None, None, True), rank
        assert not _fuses(q.float(), k.float(), steps, ids, (0.0, 0), None, None, False), rank
    assert ragged > 0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fused_schedule_matches_oracle(worlds, world_size):
    """The fused backward's schedule (own step in two pieces, each visiting step's dK/dV
    added through a buffer of its own, dQ cast once at the end) against the float64
    oracle: every layout, causal and not, GQA, lse in the loss, 300 tokens a rank (two
    pieces of key rows on the own step)."""
    configs = [RingCase(layout, causal, tokens_per_rank(layout, 300), 4, 2, head_dim=8, use_lse=True)
               for layout in LAYOUTS for causal in (False, True)]
    _assert_no_failures(worlds(world_size).run(with_fused_backward, check_configs, configs, seed=31, timeout=120))


@pytest.mark.parametrize("mask, early", [("ones", True), ("local", False)])
def test_ring_of_two_weighs_its_steps_by_the_mask(monkeypatch, mask, early):
    """Under a block mask the ring of two counts each step's work in the mask's blocks: a
    local band on contiguous shards leaves the remote step a sliver (1 block against 4),
    too little to hide the trip home behind its dQ pass, so the own dK/dV pass does;
    an all-ones mask keeps the early order the band alone would choose."""
    from ringflash.ring import ring_backward
    from ringflash.kernels import block_sparse
    from ringflash.kernels.masks import BLOCK
    fake = _RecordingRing(2)
    monkeypatch.setattr(ringflash.kernels, "flash_attn_bwd", lambda *args, **kw: fake.events.append(
        ("dq" if args[6] is not None else "dkv",)))
    n = 2 * BLOCK
    bm = (torch.ones(1, 4, 4, dtype=torch.bool) if mask == "ones"
          else block_sparse.local_global_block_mask(2 * n, local_blocks=2))
    q, k, v, out, dout = (torch.randn(1, n, 2, 8) for _ in range(5))
    ring_backward(dout, q, k, v, out, torch.randn(1, 2, n), None, None, softmax_scale=0.3,
                           band=(None, None), dropout=(0.0, 0), layout="contiguous", ring=fake,
                           blocks=bm)
    ev = fake.events
    last_post = max(i for i, e in enumerate(ev) if e[0] == "post")
    if early:
        tail = _early_tail(n)
        assert ev[-len(tail):] == tail, ev
    else:
        assert ("dkv",) in ev[last_post:] and ("dq",) not in ev[last_post:], ev


def test_ring_of_two_that_kept_its_kv_swaps_queries_under_its_dq_pass(monkeypatch):
    """A ring of two over the contiguous layout whose forward kept the other rank's K/V
    (``keeps_kv``): its backward moves no K/V and no gradient. The ranks' Q, dO, lse and
    delta travel (three messages) under the dQ pass over every key, its own and the kept
    ones joined in global order; then one dK/dV pass over every query, joined the same way."""
    from ringflash.ring import ring_backward
    calls = []
    fake = _RecordingRing(2)
    monkeypatch.setattr(ringflash.kernels, "flash_attn_bwd", lambda *args, **kw: (
        fake.events.append(("dq" if args[6] is not None else "dkv",)), calls.append(args)))
    n, batch = 16, 2
    q, k, v, out, dout = (torch.randn(batch, n, 2, 8) for _ in range(5))
    kept = (torch.randn(2, batch, n, 2, 8), None)
    for band in ((None, None), (None, 0), (-3, 0)):
        fake.events.clear()
        fake.messages.clear()
        calls.clear()
        ring_backward(dout, q, k, v, out, torch.randn(batch, 2, n), None, None, softmax_scale=0.3,
                               band=band, dropout=(0.0, 0), layout="contiguous", ring=fake, kept=kept)
        assert fake.events == [("post", 1), ("dq",), ("wait",), ("dkv",)], (band, fake.events)
        assert len(fake.messages) == 3, fake.messages
        dq_call, dkv_call = calls
        first, second = dq_call[2]  # every key: rank 0's own, then the kept ones
        assert first is k and torch.equal(second, kept[0][0]), band
        first, second = dkv_call[1]  # every query: its own, then the received ones
        assert first is q and second.shape == q.shape, band


class _NaNRing(_RecordingRing):
    """A ring whose buffers start as NaN and whose every rank sends what this one does (a
    message lands at once; where the shards' travelling rows differ in number, a message of
    halves): a row of a running dK/dV sum that no pass writes and nothing zeroes shows up in
    the result."""

    def buffer(self, name, shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    def exchange(self, *pairs, shift=1):
        for send, recv, *_at in pairs:
            recv.copy_(send) if recv.shape == send.shape else recv.fill_(0.5)
        return []


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_running_dkv_rows_are_written_or_zeroed(monkeypatch, world, layout, causal):
    """A step's first dK/dV passes write the key rows of their pairs and only the rows no
    pair covers are zeroed: every row of the result is finite, and a pass that writes never
    meets a row another pass of its step wrote."""
    from ringflash.ring import ring_backward

    def bwd(dout, q, k, v, lse, delta, dq, dk, dv, *, accumulate, dq_partial=None, dk_partial=None,
            dv_partial=None, **kw):
        for g, partial in ((dq, dq_partial), (dk, dk_partial), (dv, dv_partial)):
            if g is not None:
                g.copy_((g if partial is None else partial) + 1 if accumulate else torch.ones_like(g))
    monkeypatch.setattr(ringflash.kernels, "flash_attn_bwd", bwd)
    n = tokens_per_rank(layout, 4 * world)
    q, k, v, out, dout = (torch.randn(1, n, 2, 8) for _ in range(5))
    lse = torch.randn(1, 2, n)
    for rank in range(world):
        fake = _NaNRing(world)
        fake.rank = rank
        dq, dkv = ring_backward(dout, q, k, v, out, lse, None, None, softmax_scale=0.3,
                                         band=(None, 0) if causal else (None, None),
                                         dropout=(0.0, 0), layout=layout, ring=fake)
        assert torch.isfinite(dkv).all() and torch.isfinite(dq).all(), rank


class _FlaggingRing(_RecordingRing):
    """A ring of two whose transport streams the shard in chunks (``PeerRing``'s contract
    for ``arriving``): every flag is already up, as the peer's copy stream leaves them."""
    streams_chunks = True

    def arriving(self, send, recv, heads):
        self.flags = torch.ones(send[0].shape[2] // heads, dtype=torch.int32)
        self.events.append(("post", 1))
        return [object()], self.flags


@pytest.mark.parametrize("fails", [False, True], ids=["runs", "launch-raises"])
def test_one_launch_forward_lowers_its_arrival_flags(monkeypatch, fails):
    """The one-launch forward of a ring of two (``gathered.gathered_forward``) waits for the whole
    trip and lowers the flags that said its chunks had landed, also when the launch
    raised (out of memory, say, caught by the caller): flags left up would let the next
    call's tiles read a shard still in flight."""
    from ringflash.ring import gathered
    launches = []

    def fwd(q, k, v, *, out, lse, arrival, **kw):
        launches.append(arrival)
        if fails:
            raise torch.OutOfMemoryError("simulated")
    monkeypatch.setattr(ringflash.kernels, "flash_attn_fwd", fwd)
    monkeypatch.setattr(gathered, "pair_mask", lambda *args: None)
    fake = _FlaggingRing(2)
    q, k, v = (torch.randn(1, 256, 4, 64) for _ in range(3))
    recv = torch.zeros(2, *k.shape)
    call = lambda: gathered.gathered_forward(q, k, v, recv, softmax_scale=0.125, band=(None, None),
                                              dropout=(0.0, 0), ring=fake, plan=None, blocks=None)
    if fails:
        with pytest.raises(torch.OutOfMemoryError):
            call()
    else:
        call()
    assert launches[0].flags is fake.flags and launches[0].heads == 4 and launches[0].last == 1
    assert fake.events == [("post", 1), ("wait",)] and not fake.flags.any()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_world_of_one_without_process_group_equals_flash_attn(layout, causal, dtype):
    """No init_process_group in this (pytest) process: a ring of one is flash_attn."""
    assert not (dist.is_available() and dist.is_initialized())
    gen = torch.Generator().manual_seed(3)
    n = tokens_per_rank(layout, 38)
    q = torch.randn(2, n, 4, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, n, 2, 16, generator=gen).to(dtype) for _ in range(2))
    dout = torch.randn(2, n, 4, 16, generator=gen).to(dtype)
    dlse = torch.randn(2, 4, n, generator=gen)
    results = []
    for attn in ("ring", "flash"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        if attn == "ring":
            out, lse = ringflash.ring_flash_attn(qq, kk, vv, causal=causal, layout=layout,
                                                 return_lse=True)
        else:
            out, lse = ringflash.flash_attn(qq, kk, vv, causal=causal, return_lse=True)
        ((out * dout).sum() + (lse * dlse).sum()).backward()
        results.append((out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert rel_err(got, want) <= tol, f"{name}: {rel_err(got, want):.3g}"


# ----------------------------------------------------------------------------- bad input


def _small(dtype=torch.float32, n=8, heads=4, kv_heads=2, head_dim=16, batch=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, n, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, n, kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v


# Cross-rank disagreements: what rank 1 (only) changes. Every rank must raise.
DISAGREEMENTS = {
    "seqlen_local": dict(shape=dict(n=10)),
    "heads": dict(shape=dict(heads=2)),
    "kv_heads": dict(shape=dict(kv_heads=1)),
    "head_dim": dict(shape=dict(head_dim=8)),
    "batch": dict(shape=dict(batch=2)),
    "dtype": dict(shape=dict(dtype=torch.float16)),
    "band_hi (from causal, window_size)": dict(kwargs=dict(causal=False)),
    "layout": dict(kwargs=dict(layout="stripe")),
    "softmax_scale": dict(kwargs=dict(softmax_scale=0.125)),
    "requires_grad": dict(requires_grad=False),
    "deterministic (or torch.use_deterministic_algorithms)": dict(kwargs=dict(deterministic=True)),
    "schedule (RINGFLASH_SCHEDULE)": dict(env=dict(RINGFLASH_SCHEDULE="direct")),
    "layout given as a spec (compiled)": dict(spec=True),
}


def _document_call(q, k, v, as_spec: bool):
    """A causal call of the ring's op on a layout computed from documents (as ``ring_attn``
    makes it), the layout given as itself (eager) or ``as_spec`` (as compiled)."""
    from ringflash import ops
    seqlen = q.shape[1] * dist.get_world_size()
    cu = torch.tensor([0, 5, seqlen])
    layout = ringflash.document_layout(cu, seqlen)
    ids = ringflash.segment_ids_from_cu_seqlens(cu, seqlen, layout=layout)
    return ops.ring_attn_forward_impl(q, k, v, ids, None, 0.25, None, 0, layout.kind if as_spec else layout,
                                      layout.spec if as_spec else None, dist.group.WORLD.group_name, 0.0, 0, 0, True)


def _ring_still_works(rank, world) -> str | None:
    """After an error every rank saw, the next (valid) call must run and be right."""
    q, k, v = _small(n=6, seed=11)
    full_q, full_k, full_v = (ringflash.unshard(t, 1, "zigzag") for t in (q, k, v))
    out = ringflash.ring_flash_attn(q, k, v, causal=True, layout="zigzag")
    want = ringflash.shard(attention_oracle(full_q, full_k, full_v, causal_offset=0)[0], 1, "zigzag")
    err = rel_err(out, want)
    return None if err <= 1e-5 else f"rank {rank}: the call after the error is off by {err:.3g}"


def disagreeing_call(rank, world, field):
    change = DISAGREEMENTS[field] if rank == 1 else {}
    q, k, v = _small(**change.get("shape", {}))
    if change.get("requires_grad", True):
        q.requires_grad_()
    kwargs = dict(causal=True, layout="zigzag", softmax_scale=None)
    kwargs.update(change.get("kwargs", {}))
    os.environ.update(change.get("env", {}))
    try:
        caught = raised(lambda: _document_call(q, k, v, change.get("spec", False)) if field.startswith("layout given")
                        else ringflash.ring_flash_attn(q, k, v, **kwargs))
    finally:
        for name in change.get("env", {}):
            del os.environ[name]
    return caught, _ring_still_works(rank, world)


def local_bad_call(rank, world, case):
    """The same invalid call on every rank: each must raise locally, before any collective."""
    args, kwargs = _bad_inputs(case, world)
    caught = raised(lambda: ringflash.ring_flash_attn(*args, **kwargs))
    return caught, _ring_still_works(rank, world)


def one_rank_bad_call(rank, world, case):
    """Only rank 1 passes an invalid call; the others' arguments are fine."""
    if rank == 1:
        args, kwargs = _bad_inputs(case, world)
    else:
        args, kwargs = _small(), dict(causal=True, layout="contiguous")
    caught = raised(lambda: ringflash.ring_flash_attn(*args, **kwargs))
    return caught, _ring_still_works(rank, world)


def _bad_inputs(case, world=1):
    q, k, v = _small()
    kwargs = dict(causal=True, layout="contiguous")
    if case == "qkv_dtypes":
        k = k.half()
    elif case == "qkv_devices":
        v = v.to("meta")
    elif case == "heads_not_multiple_of_kv_heads":
        q, k, v = _small(heads=6, kv_heads=4)
    elif case == "unknown_layout":
        kwargs["layout"] = "spiral"
    elif case == "zigzag_odd_seqlen_local":
        q, k, v = _small(n=7)
        kwargs["layout"] = "zigzag"
    elif case == "q_k_local_lengths_differ":
        k, v = k[:, :5], v[:, :5]
    elif case == "block_stripe_partial_block":
        kwargs["layout"] = "block_stripe"
    elif case.startswith("block_stripe_"):
        q, k, v = _small(n=128)
        kwargs["layout"] = "block_stripe"
        kwargs.update(dict(block_stripe_window_and_block_mask=dict(
            window_size=(16, 0), block_mask=torch.ones(1, world, world, dtype=torch.bool)))[case])
    else:
        raise KeyError(case)
    return (q, k, v), kwargs


LOCAL_CASES = {  # case -> (exception types allowed, words the message must contain)
    "qkv_dtypes": ((TypeError, ValueError), ["dtype"]),
    "qkv_devices": ((ValueError, TypeError), ["device"]),
    "heads_not_multiple_of_kv_heads": ((ValueError,), ["heads", "multiple"]),
    "unknown_layout": ((ValueError,), ["layout", "spiral"]),
    "zigzag_odd_seqlen_local": ((ValueError,), ["zigzag", "seqlen_local"]),
    "q_k_local_lengths_differ": ((ValueError,), ["q", "k"]),
    "block_stripe_partial_block": ((ValueError,), ["block_stripe", "seqlen_local", "128"]),
    "block_stripe_window_and_block_mask": ((ValueError,), ["window_size", "block_mask", "block_stripe"]),
}


@pytest.mark.world(4)
@pytest.mark.parametrize("field", list(DISAGREEMENTS))
def test_ranks_disagree_every_rank_raises(worlds, field):
    """Rank 1 alone differs; every rank gets the same ValueError naming the field, within
    seconds, and the ring still works afterwards."""
    per_rank = worlds(4).run(disagreeing_call, field, timeout=30)
    for rank, (caught, after) in enumerate(per_rank):
        assert caught is not None, f"rank {rank} raised nothing"
        kind, message = caught
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert f"disagree on {field}:" in message, f"rank {rank}: does not name {field!r}: {message}"
        assert after is None, after


def check_on_a_host_group(rank, world):
    """The world group taken for NCCL: the rank check must gather on a gloo twin of its
    own (made once, then reused), never on the ring's group itself."""
    from ringflash import exchange
    on_ring, hosts = [], []
    real_is_nccl, real_gather, real_host = exchange._is_nccl, dist.all_gather, exchange.host_group

    def all_gather(tensors, tensor, group=None, **kw):
        if tensor.dtype == torch.int64:  # not unshard's gathers of the data
            on_ring.append(group)
        return real_gather(tensors, tensor, group=group, **kw)

    def host_group(group):
        hosts.append(real_host(group))
        return hosts[-1]
    exchange._is_nccl, dist.all_gather, exchange.host_group = (lambda group: True), all_gather, host_group
    try:
        calls = [disagreeing_call(rank, world, "band_hi (from causal, window_size)") for _ in range(2)]
    finally:
        exchange._is_nccl, dist.all_gather, exchange.host_group = real_is_nccl, real_gather, real_host
    host = exchange._HOST_GROUPS.pop(dist.group.WORLD.group_name, (None, None))[1]
    # a twin kept for another group of the same name (the process group destroyed and made
    # again) is not taken: a new one is made
    exchange._is_nccl = lambda group: True
    try:
        exchange._HOST_GROUPS[dist.group.WORLD.group_name] = (object(), host)
        fresh = exchange.host_group(dist.group.WORLD)
    finally:
        exchange._is_nccl = real_is_nccl
        exchange._HOST_GROUPS.pop(dist.group.WORLD.group_name, None)
    return (calls, host is not None and host is not dist.group.WORLD and fresh is not host, type(host).__name__,
            len(on_ring), [h is host for h in hosts])


@pytest.mark.world(2)
def test_rank_check_of_an_nccl_group_gathers_on_a_host_group(worlds):
    """An NCCL group's agreement check is a host all-gather over a gloo twin of the group
    (no GPU synchronization), made once and reused (not for a new group of the same name);
    disagreements still raise everywhere and the ring works after them."""
    for rank, (calls, own_group, kind, on_ring, on_host) in enumerate(worlds(2).run(check_on_a_host_group,
                                                                                      timeout=60)):
        for caught, after in calls:
            assert caught is not None and caught[0] == "ValueError", (rank, caught)
            assert "disagree on band_hi (from causal, window_size):" in caught[1], (rank, caught)
            assert after is None, after
        assert own_group and kind == "ProcessGroupGloo", (rank, own_group, kind)
        assert on_ring == 0, (rank, on_ring)
        # each of the 2 calls: its check, then _ring_still_works's 3 unshard checks and valid call
        assert len(on_host) == 2 * 5 and all(on_host), (rank, on_host)


class _KeysSet(dist.Store):
    """A store that passes every call on to ``inner`` and remembers the keys this rank set."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.keys = inner, set()

    def set(self, key, value):
        self.keys.add(key)
        return self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def wait(self, keys, *timeout):
        return self.inner.wait(keys, *timeout)

    def check(self, keys):
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def host_group_of_a_world_made_again(rank, world):
    """Make the world three times on one store (as torchrun's agent keeps it), taking it
    for NCCL; each time, an all-gather on its host group. Rank 1 comes late to each, so
    that a twin that found its peer's address of the world before (the keys
    ``dist.new_group`` would reuse) fails. The world's own gloo group would too, so each
    rank deletes the keys it set while the world was made before it is made again (the
    twins' stay). Leaves a world of the same ranks."""
    from ringflash import exchange
    tcp = dist.distributed_c10d._get_default_store().underlying_store
    store = _KeysSet(dist.PrefixStore("made again", tcp))
    real_is_nccl, gathered = exchange._is_nccl, []
    exchange._is_nccl = lambda group: True
    made = set()  # the keys this rank set while the world was made
    try:
        for again in range(3):
            for key in made:
                store.delete_key(key)
            dist.barrier()  # no rank makes the world again before every rank's keys are gone
            dist.destroy_process_group()
            store.keys.clear()
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=20))
            made = set(store.keys)
            if rank == 1:
                time.sleep(0.5)
            mine, everyone = torch.tensor([rank, again]), [torch.empty(2, dtype=torch.int64) for _ in range(world)]
            exchange.host_all_gather(everyone, mine, dist.group.WORLD)
            gathered.append(torch.stack(everyone).tolist())
    finally:
        exchange._is_nccl = real_is_nccl
        exchange._HOST_GROUPS.pop(dist.group.WORLD.group_name, None)
    return gathered


@pytest.mark.world(2)
def test_a_world_made_again_gets_a_host_group_that_works(worlds):
    """The process group destroyed and made again on the same store (as a test module's
    fixture does under torchrun): the NCCL group's host twin is made anew
    under keys of its own, and its all-gather works (``dist.new_group``'s twin failed
    here: "Connection reset by peer", 2 x H200 and on the CPU)."""
    for rank, gathered in enumerate(worlds(2).run(host_group_of_a_world_made_again, timeout=90)):
        assert gathered == [[[0, again], [1, again]] for again in range(3)], (rank, gathered)


@pytest.mark.world(4)
@pytest.mark.parametrize("case", list(LOCAL_CASES))
def test_bad_local_input_every_rank_raises(worlds, case):
    per_rank = worlds(4).run(local_bad_call, case, timeout=30)
    kinds, words = LOCAL_CASES[case]
    for rank, (caught, after) in enumerate(per_rank):
        assert caught is not None, f"rank {rank} raised nothing"
        kind, message = caught
        assert kind in {k.__name__ for k in kinds}, f"rank {rank}: {kind}: {message}"
        for word in words:
            assert word in message, f"rank {rank}: {word!r} not in {message!r}"
        assert after is None, after


@pytest.mark.world(4)
@pytest.mark.parametrize("case", ["qkv_dtypes", "unknown_layout", "zigzag_odd_seqlen_local"])
def test_bad_input_on_one_rank_every_rank_raises(worlds, case):
    """Rank 1 alone fails its local checks: it raises its own error, and the ranks whose
    arguments were fine raise a ValueError naming rank 1 instead of waiting for it."""
    per_rank = worlds(4).run(one_rank_bad_call, case, timeout=30)
    kinds, words = LOCAL_CASES[case]
    for rank, (caught, after) in enumerate(per_rank):
        assert caught is not None, f"rank {rank} raised nothing"
        kind, message = caught
        if rank == 1:
            assert kind in {k.__name__ for k in kinds}, f"rank 1: {kind}: {message}"
            assert all(word in message for word in words), message
        else:
            assert kind == "ValueError" and "rank(s) [1]" in message, f"rank {rank}: {kind}: {message}"
        assert after is None, after


def env_on_one_rank_call(rank, world, name, value):
    """Only rank 1 sets the environment variable ``name``; every argument is fine."""
    if rank == 1:
        os.environ[name] = value
    try:
        caught = raised(lambda: ringflash.ring_flash_attn(*_small(), causal=True))
    finally:
        os.environ.pop(name, None)
    return caught, _ring_still_works(rank, world)


@pytest.mark.world(4)
@pytest.mark.parametrize("name,value", [("RINGFLASH_TRANSPORT", "peer"), ("RINGFLASH_TRANSPORT", "pigeon"),
                                        ("RINGFLASH_SCHEDULE", "sideways")])
def test_bad_transport_on_one_rank_every_rank_raises(worlds, name, value):
    """gloo has no peer transport, "pigeon" is no transport and "sideways" no schedule:
    rank 1 says so, and the others raise naming rank 1 instead of waiting for it."""
    per_rank = worlds(4).run(env_on_one_rank_call, name, value, timeout=30)
    for rank, (caught, after) in enumerate(per_rank):
        assert caught is not None, f"rank {rank} raised nothing"
        kind, message = caught
        if rank == 1:
            assert kind == "ValueError" and name in message, f"rank 1: {kind}: {message}"
        else:
            assert kind == "ValueError" and "rank(s) [1]" in message, f"rank {rank}: {kind}: {message}"
        assert after is None, after


@pytest.mark.parametrize("case", list(LOCAL_CASES))
def test_bad_local_input_without_process_group(case):
    kinds, words = LOCAL_CASES[case]
    args, kwargs = _bad_inputs(case)
    with pytest.raises(kinds) as info:
        ringflash.ring_flash_attn(*args, **kwargs)
    for word in words:
        assert word in str(info.value)


# ----------------------------------------------------------------------------- shard / unshard


def roundtrip(rank, world) -> list[str]:
    """shard -> unshard is the identity, and positions agree with shard, on a real group."""
    failures = []
    for group_ranks in (None, [0, 1, world - 1]) if world >= 3 else (None,):
        group = dist.new_group(group_ranks) if group_ranks is not None else None
        if group_ranks is not None and rank not in group_ranks:
            continue
        w = world if group_ranks is None else len(group_ranks)
        for layout in LAYOUTS:
            n = tokens_per_rank(layout, 6) * w
            x = torch.randn(2, n, 3, 5, generator=torch.Generator().manual_seed(5))
            for dim in (1, 0, 3, -1, -2):
                y = x.movedim(1, dim)
                part = ringflash.shard(y, dim=dim, layout=layout, group=group)
                back = ringflash.unshard(part, dim=dim, layout=layout, group=group)
                if not torch.equal(back, y):
                    failures.append(f"group {group_ranks} {layout} dim={dim}: unshard(shard(x)) != x")
            ids = ringflash.shard(torch.arange(n), dim=0, layout=layout, group=group)
            if not torch.equal(ids, ringflash.positions(n, layout, group)):
                failures.append(f"group {group_ranks} {layout}: shard(arange) != positions")
    return failures


@pytest.mark.world(4)
def test_shard_unshard_roundtrip_on_group(worlds):
    _assert_no_failures(worlds(4).run(roundtrip))


def kept_kv(rank, world):
    """What a ring of two's forward keeps and how many kernel passes its backward runs, per
    layout, with and without a block mask, with and without a backward to follow; the
    kept K/V against the whole sequence's, and the gradients against the oracle's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringflash import ops
    from ringflash.kernels.block_sparse import random_block_mask
    passes = []
    bwd = ringflash.kernels.flash_attn_bwd

    def counting(*args, **kwargs):
        passes.append(1)
        return bwd(*args, **kwargs)

    ringflash.kernels.flash_attn_bwd = counting
    failures, report = [], {}
    n = 512  # blocks of 128 tokens: zigzag's chunks hold one each
    full = _small(n=n, heads=2, kv_heads=1, head_dim=8, seed=7)
    mask = random_block_mask(n, 0.5, heads=2, seed=3)
    try:
        for layout in ("contiguous", "zigzag"):
            q, k, v = (ringflash.shard(t, 1, layout) for t in full)
            for blocks in (None, mask):
                for grad in (False, True):
                    args = (0.25, None, None, layout, None, dist.group.WORLD.group_name)  # scale, band, layout, spec, group
                    real = ops._forward(q, k, v, None, blocks, *args, requires_grad=grad)
                    with FakeTensorMode() as mode:  # what torch.compile traces with
                        fake = ops.ring_attn_forward(
                            *(None if t is None else mode.from_tensor(t) for t in (q, k, v, None, blocks)),
                            *args, requires_grad=grad)
                    if [t.shape for t in fake] != [t.shape for t in real]:
                        failures.append(f"{layout}: fake shapes {[t.shape for t in fake]}")
                    kv = real[2]
                    report[layout, blocks is not None, grad] = tuple(kv.shape)
                    other = torch.stack(full[1:])[:, :, (1 - rank) * n // 2:(2 - rank) * n // 2]
                    if kv.numel() and not torch.equal(kv, other):  # only contiguous keeps
                        failures.append(f"{layout}: the kept K/V is not the other rank's")
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            dout = torch.randn(qq.shape, generator=torch.Generator().manual_seed(rank))
            passes.clear()
            ringflash.ring_flash_attn(qq, kk, vv, layout=layout, block_mask=mask).backward(dout)
            report[layout] = len(passes)
            dq, dk, dv = oracle_grads(*full, ringflash.unshard(dout, 1, layout),
                                      mask=with_blocks(None, mask, n))
            for name, got, want in (("dq", qq.grad, dq), ("dk", kk.grad, dk), ("dv", vv.grad, dv)):
                err = rel_err(got, ringflash.shard(want, 1, layout))
                if not err <= TOL[torch.float32]:
                    failures.append(f"{layout} {name} rel err {err:.3g}")
    finally:
        ringflash.kernels.flash_attn_bwd = bwd
    return failures, report


@pytest.mark.world(2)
def test_ring_of_two_keeps_its_kv_for_the_backward(worlds):
    """Only a ring of two over the contiguous layout under a block mask keeps K/V, and only
    when a backward follows: (2, B, n, Hkv, D), the other rank's K/V. Its backward
    then runs two kernel passes (dQ over every key, dK/dV over every query) where zigzag's
    runs one dQ and one dK/dV pass per pair of chunks a block mask occupies (twelve here).
    Both rings' gradients match the oracle's."""
    for failures, report in worlds(2).run(kept_kv, timeout=120):
        assert failures == [], failures
        kept = {key: shape for key, shape in report.items() if isinstance(key, tuple) and shape != (0,)}
        assert kept == {("contiguous", True, True): (2, 1, 256, 1, 8)}, report
        assert report["contiguous"] == 2 and report["zigzag"] == 12, report


def kept_kv_moves_keys(rank, world):
    """A ring of two that kept its K/V, under masks that leave one rank more work
    (local + global: rank 0 holds the global rows and keys; flipped: rank 1), causal or
    not, with dropout, with documents and dropout (the forward in one launch but for
    documents, ``_gathered_forward``): the dK/dV cut (``key_cut``) and how far the out and
    gradients are from flash_attn's on the whole sequence with the same arguments."""
    from test_masks import segments as documents

    from ringflash.ring.plan import SparsePlan
    from ringflash.kernels.block_sparse import local_global_block_mask
    n = 512  # four blocks: rank 0 holds the global row block and key block
    full = _small(n=n, heads=2, kv_heads=1, head_dim=8, batch=2, seed=11)
    lg = local_global_block_mask(n, local_blocks=1, global_blocks=1)
    docs = documents([[150, 362], [n]], n)
    results = []
    for name, mask, causal, extra in (("lg", lg, False, {}), ("flipped-causal", lg.flip(1).flip(2), True, {}),
                                      ("lg-dropout", lg, False, dict(dropout_p=0.2, seed=5)),
                                      ("lg-docs-dropout", lg, False,
                                       dict(segment_ids=docs, dropout_p=0.2, seed=5))):
        band = (None, 0) if causal else (None, None)
        cut = SparsePlan(mask, "contiguous", 2, n // 2).key_cut(band, mask)
        kw = dict(causal=causal, block_mask=mask, **extra)
        local = dict(kw, segment_ids=ringflash.shard(docs, 1, "contiguous")) if "segment_ids" in extra else kw
        qq, kk, vv = (ringflash.shard(t, 1, "contiguous").requires_grad_() for t in full)
        dout = torch.randn(full[0].shape, generator=torch.Generator().manual_seed(3))
        out = ringflash.ring_flash_attn(qq, kk, vv, layout="contiguous", **local)
        out.backward(ringflash.shard(dout, 1, "contiguous"))
        ref = [t.clone().requires_grad_() for t in full]
        want = ringflash.flash_attn(*ref, **kw)
        want.backward(dout)
        errors = [rel_err(ringflash.unshard(got, 1, "contiguous"), ref_t)
                  for got, ref_t in ((out.detach(), want.detach()), (qq.grad, ref[0].grad),
                                     (kk.grad, ref[1].grad), (vv.grad, ref[2].grad))]
        results.append((name, cut, max(errors)))
    return results


@pytest.mark.world(2)
def test_ring_of_two_that_kept_its_kv_evens_out_its_dkv_work(worlds):
    """Where the mask gives one rank more work, the busier rank leaves the other some of
    its keys' dK/dV (rank 0 under local + global: the cut below n; rank 1 when flipped:
    above), and the gradients that come home equal flash_attn's on the whole sequence."""
    for results in worlds(2).run(kept_kv_moves_keys, timeout=120):
        cuts = {name: cut for name, cut, _ in results}
        assert cuts["lg"] < 256 < cuts["flipped-causal"] and cuts["lg-docs-dropout"] < 256, cuts
        for name, cut, err in results:
            assert err <= 1e-5, (name, err)


# ----------------------------------------------------------------------------- eager calls


def eager_and_op_paths(rank, world, uses):
    """The ring called eagerly (no custom op reached) and through its custom ops: out, lse
    and the gradients of each path, for a loss on ``uses`` ("out", "lse" or "both")."""
    from ringflash import ops
    q, k, v = (ringflash.shard(t, 1, "zigzag") for t in _small(n=8 * world, seed=4))
    gen = torch.Generator().manual_seed(9 + rank)
    dout = torch.randn(q.shape, generator=gen) * (uses != "lse")
    dlse = torch.randn(q.shape[0], q.shape[2], q.shape[1], generator=gen) * (uses != "out")

    def run():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = ringflash.ring_flash_attn(qq, kk, vv, causal=True, return_lse=True)
        loss = {"out": (out * dout).sum(), "lse": (lse * dlse).sum(),
                "both": (out * dout).sum() + (lse * dlse).sum()}[uses]
        loss.backward()
        return [out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad]

    def refuse(*args, **kwargs):
        raise AssertionError("an eager call reached a custom op")

    real = ops.ring_attn_forward, ops.ring_attn_backward, ops.eager
    ops.ring_attn_forward = ops.ring_attn_backward = refuse
    try:
        eager = run()
    finally:
        ops.ring_attn_forward, ops.ring_attn_backward, ops.eager = real
    ops.eager = lambda *tensors: False
    try:
        through_ops = run()
    finally:
        ops.eager = real[2]
    return [name for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), eager, through_ops)
            if not torch.equal(a, b)]


@pytest.mark.world(4)
@pytest.mark.parametrize("uses", ["out", "lse", "both"])
def test_eager_ring_skips_the_custom_ops_and_agrees_with_them(worlds, uses):
    """Outside torch.compile the ring runs as a plain autograd.Function over the ops'
    implementations: bit for bit the ops' results, an unused output's gradient None."""
    for rank, differ in enumerate(worlds(4).run(eager_and_op_paths, uses, timeout=60)):
        assert differ == [], (rank, differ)
