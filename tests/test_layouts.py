"""Sequence layouts: shard / unshard / positions, and the causal schedule of step_pairs.

Pure Python, no process group: W ranks are simulated inside this process by replacing
the ring that ringflash.api sees (its rank and world size) and, for unshard, the
all-gather. The same round trip on a real gloo group is in test_ring.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ringflash
from oracle import LAYOUTS, tokens_per_rank
from ringflash import agreement, api
from ringflash.kernels import band_of_window
from ringflash.kernels.masks import PairMask, pair_positions, visible
from ringflash.layouts import (active_steps, global_positions, remote_share, step_pairs, step_pieces,
                               writes_first)

WORLDS = (1, 2, 3, 4, 5)


def test_every_layout_is_tested():
    """tests/oracle.py's LAYOUTS, which every layout test iterates over, is the library's."""
    assert LAYOUTS == tuple(ringflash.LAYOUTS)


class SimulatedRing:
    """Makes ringflash.api believe it is rank ``rank`` of ``world``; ``gathered`` is what
    its all-gather returns (every rank's local tensor, by rank). The simulated ranks run one
    after another, so unshard's rank check (a collective of its own) is off."""

    def __init__(self, monkeypatch, world):
        self.world, self.rank, self.gathered = world, 0, None
        monkeypatch.setattr(api, "Ring", lambda group=None: SimpleNamespace(
            group=None, rank=self.rank, world=self.world))
        monkeypatch.setattr(api, "resolve_grid", lambda group=None: SimpleNamespace(
            heads=None, ring=None, heads_world=1, heads_rank=0, ring_rank=self.rank, ring_world=self.world))
        monkeypatch.setattr(api, "dist", SimpleNamespace(all_gather=self._all_gather))
        monkeypatch.setattr(agreement, "ENABLED", False)

    def _all_gather(self, parts, local, group=None):
        assert len(parts) == self.world and torch.equal(self.gathered[self.rank], local)
        for part, theirs in zip(parts, self.gathered):
            part.copy_(theirs)

    def shard_all(self, x, dim, layout):
        """Every rank's shard of ``x``."""
        shards = []
        for self.rank in range(self.world):
            shards.append(ringflash.shard(x, dim=dim, layout=layout))
        return shards

    def unshard_all(self, shards, dim, layout):
        """What unshard returns on every rank."""
        self.gathered = shards
        fulls = []
        for self.rank in range(self.world):
            fulls.append(ringflash.unshard(shards[self.rank], dim=dim, layout=layout))
        return fulls


# ----------------------------------------------------------------------------- shard / unshard


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("dim", [1, 0, 2, -1, -3])
def test_unshard_of_shard_is_identity(monkeypatch, layout, world, dim):
    ring = SimulatedRing(monkeypatch, world)
    seqlen = tokens_per_rank(layout, 6) * world
    x = torch.randn(2, seqlen, 3, 5).movedim(1, dim)  # the sequence along ``dim``
    shards = ring.shard_all(x, dim, layout)
    for rank, part in enumerate(shards):
        expected = list(x.shape)
        expected[dim] = seqlen // world
        assert list(part.shape) == expected, f"rank {rank}"
    # Every token lands on exactly one rank.
    ids = torch.cat(ring.shard_all(torch.arange(seqlen), 0, layout))
    assert sorted(ids.tolist()) == list(range(seqlen))
    for rank, full in enumerate(ring.unshard_all(shards, dim, layout)):
        assert torch.equal(full, x), f"rank {rank}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"W{w}")
def test_positions_agree_with_shard(monkeypatch, layout, world):
    ring = SimulatedRing(monkeypatch, world)
    seqlen = tokens_per_rank(layout, 4) * world
    shards = ring.shard_all(torch.arange(seqlen), 0, layout)
    for ring.rank in range(world):
        pos = ringflash.positions(seqlen, layout)
        assert pos.dtype == torch.int64
        assert torch.equal(pos, shards[ring.rank]), f"rank {ring.rank}"
        assert torch.equal(pos, global_positions(seqlen, layout, ring.rank, world))


def test_layouts_hold_the_documented_tokens(monkeypatch):
    ring = SimulatedRing(monkeypatch, 3)
    x = torch.arange(12)
    assert [s.tolist() for s in ring.shard_all(x, 0, "contiguous")] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [s.tolist() for s in ring.shard_all(x, 0, "zigzag")] == [
        [0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    assert [s.tolist() for s in ring.shard_all(x, 0, "stripe")] == [
        [0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    blocks = ring.shard_all(torch.arange(6 * 128), 0, "block_stripe")  # 128-token blocks
    assert [(s.view(-1, 128)[:, 0] // 128).tolist() for s in blocks] == [[0, 3], [1, 4], [2, 5]]
    assert all(torch.equal(s.view(-1, 128), s.view(-1, 128)[:, :1] + torch.arange(128)) for s in blocks)


def test_world_of_one_without_process_group():
    for layout in LAYOUTS:
        n = tokens_per_rank(layout, 10)
        x = torch.randn(1, n, 2, 4)
        assert torch.equal(ringflash.shard(x, layout=layout), x)
        assert torch.equal(ringflash.unshard(x, layout=layout), x)
        assert torch.equal(ringflash.positions(n, layout), torch.arange(n))


@pytest.mark.parametrize("layout,world,seqlen,needs", [
    ("contiguous", 4, 10, "multiple of the world size 4"),
    ("stripe", 3, 10, "multiple of the world size 3"),
    ("zigzag", 4, 12, "multiple of 2 x world size = 8"),
    ("zigzag", 3, 9, "multiple of 2 x world size = 6"),
    ("block_stripe", 2, 384, "multiple of 128 x world size = 256"),
])
def test_seqlen_the_layout_cannot_split(monkeypatch, layout, world, seqlen, needs):
    SimulatedRing(monkeypatch, world)
    for call in (lambda: ringflash.shard(torch.zeros(1, seqlen, 2), dim=1, layout=layout),
                 lambda: ringflash.positions(seqlen, layout)):
        with pytest.raises(ValueError, match=str(seqlen)) as info:
            call()
        assert needs in str(info.value) and layout in str(info.value)


@pytest.mark.parametrize("bad, error", [
    (dict(layout="spiral"), ValueError), (dict(dim=4), ValueError), (dict(dim=-5), ValueError),
    (dict(dim=1.0), TypeError), (dict(dim=True), TypeError)])
def test_shard_bad_arguments(bad, error):
    with pytest.raises(error, match="layout" if "layout" in bad else "dim"):
        ringflash.shard(torch.zeros(1, 8, 2, 4), **bad)
    with pytest.raises(error, match="layout" if "layout" in bad else "dim"):
        ringflash.unshard(torch.zeros(1, 8, 2, 4), **bad)
    with pytest.raises(TypeError, match="x_local"):
        ringflash.unshard([0] * 8)


@pytest.mark.parametrize("seqlen, error", [(0, ValueError), (-4, ValueError), (4.0, TypeError),
                                           (True, TypeError), ("8", TypeError)])
def test_positions_bad_seqlen(seqlen, error):
    with pytest.raises(error, match="seqlen"):
        ringflash.positions(seqlen)


def test_positions_takes_numpy_ints():
    np = pytest.importorskip("numpy")
    assert torch.equal(ringflash.positions(np.int64(8), "contiguous"), torch.arange(8))


# ----------------------------------------------------------------------------- step_pairs


def _band(causal, window=(-1, -1)):
    return band_of_window(causal, window)


def _computed(layout, world, rank, local_len, causal, window=(-1, -1), merge=True, cuts=None):
    """{step: (N, N) int tensor counting the global (query, key) pairs the rank computes at
    that step}. A pair computes the elements its band keeps (all of them without one):
    band_lo <= j - i <= band_hi on its local indices, or on its positions (on_positions).
    With ``cuts``, the step's pairs are ``step_pieces``' (each piece's keys checked to lie
    in it).
    """
    seqlen = local_len * world
    q_pos = global_positions(seqlen, layout, rank, world)
    steps = {}
    for step in range(world):
        src = (rank - step) % world
        k_pos = global_positions(seqlen, layout, src, world)
        done = torch.zeros(seqlen, seqlen, dtype=torch.int64)
        if cuts is None:
            pairs = step_pairs(layout, rank, src, world, local_len, _band(causal, window), merge)
        else:
            pieces = step_pieces(layout, rank, src, world, local_len, _band(causal, window), merge,
                                 cuts=cuts)
            bounds = (0, *cuts, local_len)
            assert len(pieces) == len(bounds) - 1
            for (lo, hi), piece in zip(zip(bounds, bounds[1:]), pieces):
                keys = [range(local_len)[pair.k] for pair in piece]
                assert all(lo <= r.start and r.stop <= hi for r in keys), (lo, hi, piece)
            pairs = [pair for piece in pieces for pair in piece]
        for pair in pairs:
            qs, ks = q_pos[pair.q], k_pos[pair.k]
            if pair.pos is not None:  # the positions a pair claims are the real ones
                claimed = pair_positions(pair.pos, torch.arange(len(qs)), torch.arange(len(ks)))
                assert torch.equal(qs, claimed[0]) and torch.equal(ks, claimed[1]), (layout, pair)
            else:  # only merging (no dropout, no block mask) gives up a pair's positions
                assert merge, (layout, pair)
            keep = visible(torch.arange(len(qs)), torch.arange(len(ks)), PairMask(
                pair.band_lo, pair.band_hi, pos=pair.pos, band_on_positions=pair.on_positions))
            if keep is None:
                keep = torch.ones(len(qs), len(ks), dtype=torch.bool)
            done.index_put_((qs[:, None].expand_as(keep)[keep], ks[None, :].expand_as(keep)[keep]),
                            torch.ones(int(keep.sum()), dtype=torch.int64), accumulate=True)
        steps[step] = done
    return steps


WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 2), (5, 4), (9, 1), (200, -1), (140, 300)]  # the last two
# cross block_stripe's blocks of 128 (on the other layouts' few tokens a rank, wide windows)


def layouts_and_worlds(worlds, block_stripe_worlds):
    """(layout, world) parameters: block_stripe's shards of whole 128-token blocks take
    seconds a case, so it runs on fewer world sizes."""
    return [pytest.param(layout, world, id=f"W{world}-{layout}") for world in worlds for layout in LAYOUTS
            if layout != "block_stripe" or world in block_stripe_worlds]


@pytest.mark.parametrize("layout,world", layouts_and_worlds(WORLDS, (1, 2, 3, 4)))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"win{w[0]}_{w[1]}")
@pytest.mark.parametrize("merge", [True, False], ids=["merged", "unmerged"])
def test_step_pairs_cover_the_mask_exactly_once(layout, world, causal, window, merge):
    """The union over ranks and steps is exactly the visible (query, key) set, no twice;
    and no visible pair is left for the steps active_steps cuts off."""
    left, right = window
    for local_len in (128, 256) if layout == "block_stripe" else (2, 4, 6):
        seqlen = local_len * world
        total = torch.zeros(seqlen, seqlen, dtype=torch.int64)
        steps = active_steps(layout, world, local_len, _band(causal, window))
        for rank in range(world):
            for step, done in _computed(layout, world, rank, local_len, causal, window, merge).items():
                assert step < steps or not done.any(), f"n={local_len}: step {step} of {steps} computes"
                total += done
        assert total.max() <= 1, f"n={local_len}: computed more than once: {(total > 1).nonzero()[:5].tolist()}"
        i, j = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
        visible = ((j <= i) | (not causal)) & ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))
        assert not (total.bool() & ~visible).any(), f"n={local_len}: masked pairs computed"
        assert not (visible & ~total.bool()).any(), f"n={local_len}: visible pairs never computed"


@pytest.mark.parametrize("layout,world", layouts_and_worlds((2, 3), (2,)))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"win{w[0]}_{w[1]}")
@pytest.mark.parametrize("merge", [True, False], ids=["merged", "unmerged"])
def test_step_pieces_compute_what_the_step_does(layout, world, causal, window, merge):
    """A step cut along its key rows (the ring of two's dK/dV passes and trip home) computes
    the same elements as the whole step, each piece's pairs keep to its keys, and their
    positions are the real ones (dropout and block masks read them). (block_stripe at
    W = 2 only, the one ring that cuts; at W = 3 its positions only jump further.)"""
    if layout == "block_stripe":  # positions jump every BLOCK rows: cuts on block bounds
        sizes = {256: [(128,)], 384: [(128,), (128, 256)]}
    else:
        sizes = {6: [(1,), (3,), (2, 5)], 8: [(4,), (1, 2, 7)]}
    for local_len, all_cuts in sizes.items():
        for rank in range(world):
            whole = _computed(layout, world, rank, local_len, causal, window, merge)
            for cuts in all_cuts:
                cut = _computed(layout, world, rank, local_len, causal, window, merge, cuts)
                for step in whole:
                    assert torch.equal(whole[step], cut[step]), (local_len, rank, step, cuts)


def test_step_pieces_refuse_a_cut_inside_a_block_of_jumping_positions():
    with pytest.raises(ValueError, match="jump"):
        step_pieces("block_stripe", 0, 1, 2, 256, cuts=(100,))


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"W{w}")
def test_contiguous_causal_rank_r_computes_r_plus_1_steps(world):
    for rank in range(world):
        busy = [step for step in range(world)
                if step_pairs("contiguous", rank, (rank - step) % world, world, 8, _band(True))]
        assert len(busy) == rank + 1, f"rank {rank}: computing steps {busy}"


@pytest.mark.parametrize("layout", ["zigzag", "stripe"])
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"W{w}")
def test_balanced_layouts_do_equal_work_every_step(layout, world):
    """Every step of every rank computes half a block pair, n^2/2 elements, up to the
    diagonal (n/2 either way: a causal block with offset 0 or -1 keeps n(n+-1)/2)."""
    n = 8
    for rank in range(world):
        for step, done in _computed(layout, world, rank, n, True).items():
            work = int(done.sum())
            assert abs(work - n * n / 2) <= n / 2, f"rank {rank} step {step}: {work} elements"


def test_contiguous_causal_is_unbalanced():
    """The contrast that motivates zigzag and stripe: rank W-1 does W times rank 0's work."""
    world, n = 4, 8
    work = [sum(int(d.sum()) for d in _computed("contiguous", world, r, n, True).values())
            for r in range(world)]
    assert work[0] == n * (n + 1) // 2 and work[-1] == (world - 1) * n * n + n * (n + 1) // 2


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_own_shard_is_one_pair_over_every_row(layout, causal):
    """The ring's first step writes its results instead of adding them (nothing to zero
    first), which needs the own-shard step to be a single pair over all rows."""
    for world in WORLDS:
        for rank in range(world):
            pairs = step_pairs(layout, rank, rank, world, 12, _band(causal))
            assert writes_first(pairs), (layout, world, rank, pairs)


@pytest.mark.parametrize("world", [2, 4, 8], ids=lambda w: f"W{w}")
def test_window_hops_follow_the_window(world):
    """Contiguous, causal window w over shards of n: K/V travel ceil(w / n) hops."""
    n = 16
    for w in (0, 1, 15, 16, 17, 40):
        want = min(world, -(-w // n) + 1)
        assert active_steps("contiguous", world, n, _band(True, (w, -1))) == want, w


def test_remote_share_counts_the_band_area():
    """Least (remote step elements) / (own step elements) over the ranks: what decides
    whether a ring of two hides its dK/dV trip home under the remote step."""
    n = 1024
    assert remote_share("contiguous", 2, n, _band(False)) == 1.0
    assert remote_share("contiguous", 2, n, _band(True)) == 0.0  # rank 0 sees nothing remote
    assert remote_share("zigzag", 2, n, _band(True)) == pytest.approx(1.0, abs=0.01)
    assert remote_share("stripe", 2, n, _band(True)) == pytest.approx(1.0, abs=0.01)
    # block_stripe, causal: rank 0's query block a sees the a remote blocks before it, and
    # its own causal triangle
    own = sum(min(i + 1, n) for i in range(n))
    remote0 = sum((i // 128) * 128 for i in range(n))
    assert remote_share("block_stripe", 2, n, _band(True)) == pytest.approx(remote0 / own)
    assert remote_share("zigzag", 2, n, _band(True, (64, 0))) < 0.5  # a window's sliver
