"""The cost model (ringflash.cost) against brute force: every count it makes per rank and
ring step equals a dense boolean mask's (tests/oracle.py's ``global_mask`` on the global
positions each rank holds, ``layouts.global_positions``), its steps equal the ring's
(``layouts.active_steps``), its kernel calls and their rows the ring's own schedule's
(``ring.plan.schedule_of``) and cover every visible pair; bytes per link, the time model's
schedule in its limits (free transfers, free kernels), efficiency 1 on one rank, the
document bound, benchmarks/predict_scaling.py on a tiny configuration, and the direct
schedule: taken where the ring takes it (``ring.plan.takes_direct``), timed as laid out by
hand, and leaving the rotation's numbers as they were."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from oracle import global_mask
import ringflash
from ringflash import cost, cost_bound
from ringflash.kernels.masks import BLOCK, band_of_window
from ringflash.layouts import LAYOUTS, active_steps, global_positions, remote_share
from ringflash.ring import plan
from ringflash.ring.plan import schedule_of

ROOT = Path(__file__).resolve().parents[1]

MASKS = {
    "causal": cost.Mask(causal=True),
    "full": cost.Mask(causal=False),
    "window": cost.Mask(causal=True, window=(300, 0)),
    "window_both": cost.Mask(causal=False, window=(200, 50)),
    # one-token documents, one longer than any shard, padding after the last
    "documents": cost.Mask.documents([1, 700, 1, 1, 130, 1500, 5]),
    "documents_full_window": cost.Mask.documents([1000, 1, 300], causal=False, window=(100, -1)),
    "documents_on_blocks": cost.Mask.documents([128, 256, 128, 1, 127]),
}


def _dense(seqlen: int, mask: cost.Mask) -> torch.Tensor:
    segments = None
    if mask.cu_seqlens is not None:
        bounds, tokens = torch.tensor(mask.cu_seqlens), torch.arange(seqlen)
        ids = torch.searchsorted(bounds[1:], tokens, right=True)
        segments = torch.where(tokens < bounds[-1], ids, -1)[None]
    dense = global_mask(seqlen, mask.causal, mask.window, segments)
    return torch.ones(seqlen, seqlen, dtype=torch.bool) if dense is None else dense.reshape(seqlen, seqlen)


def _brute(world: int, seqlen: int, layout: str, mask: cost.Mask):
    """(visible, touched, full), (W, W) [rank, step], from the dense mask."""
    dense = _dense(seqlen, mask)
    pos = [global_positions(seqlen, layout if world > 1 else "contiguous", r, world) for r in range(world)]
    n = seqlen // world
    tiles = -(-n // BLOCK)
    out = [torch.zeros(world, world, dtype=torch.long) for _ in range(3)]
    for r in range(world):
        for s in range(world):
            part = dense[pos[r]][:, pos[(r - s) % world]]
            seen, real = (torch.zeros(tiles * BLOCK, tiles * BLOCK, dtype=torch.bool) for _ in range(2))
            seen[:n, :n], real[:n, :n] = part, True
            seen, real = (t.view(tiles, BLOCK, tiles, BLOCK) for t in (seen, real))
            touched = seen.any(3).any(1)
            out[0][r, s], out[1][r, s] = part.sum(), touched.sum()
            out[2][r, s] = (touched & (seen | ~real).all(3).all(1)).sum()
    return out


class _Rank(NamedTuple):
    """What ``schedule_of`` reads of a ring: its size and the rank."""

    world: int
    rank: int


def _schedule(world: int, seqlen: int, layout, mask: cost.Mask):
    """(calls, q_blocks, k_blocks) (W, W) [rank, step] and whether ``rotate.ring_backward``
    takes the early trip home (the Triton backward, no block mask), from the ring's own
    schedule rank by rank."""
    n, band = seqlen // world, band_of_window(mask.causal, mask.window)
    out = [torch.zeros(world, world, dtype=torch.long) for _ in range(3)]
    for rank in range(world):
        schedule = schedule_of(_Rank(world, rank), layout, n, band, (0.0, 0), None)
        for s, pairs in enumerate(schedule.pairs):
            out[0][rank, s] = len(pairs)
            out[1][rank, s] = sum(-(-len(range(n)[pair.q]) // BLOCK) for pair in pairs)
            out[2][rank, s] = sum(-(-len(range(n)[pair.k]) // BLOCK) for pair in pairs)
    early = (schedule.steps == 2 and schedule.own_apart and schedule.sent is None
             and remote_share(layout, world, n, band) >= 0.5)
    return (*out, early)


def _check_schedule(counts: cost.RingCounts, world: int, seqlen: int, layout, mask: cost.Mask, name: str) -> None:
    """The counts' kernel calls and rows are the ring's schedule's, and cover what the dense
    mask shows visible at each step (a step without calls sees nothing)."""
    if world == 1:
        assert counts.calls.tolist() == [[1]] and counts.early_home is False, name
        assert counts.q_blocks.tolist() == counts.k_blocks.tolist() == [[-(-seqlen // BLOCK)]], name
        return
    calls, q_blocks, k_blocks, early = _schedule(world, seqlen, layout, mask)
    assert torch.equal(counts.calls, calls) and counts.early_home == early, name
    assert torch.equal(counts.q_blocks, q_blocks) and torch.equal(counts.k_blocks, k_blocks), name
    dense = _dense(seqlen, mask)
    pos = [global_positions(seqlen, layout, r, world) for r in range(world)]
    for r in range(world):
        for s in range(world):
            part = dense[pos[r]][:, pos[(r - s) % world]]
            assert counts.calls[r, s] > 0 or not part.any(), name
            assert counts.q_blocks[r, s] >= -(-int(part.any(1).sum()) // BLOCK), name
            assert counts.k_blocks[r, s] >= -(-int(part.any(0).sum()) // BLOCK), name


def _cases():
    for world in (1, 2, 3, 4):
        for layout in LAYOUTS:
            aligned = world * 512  # whole 128-token tiles on every layout (zigzag: 2 x 256)
            lengths = [aligned] + ([] if layout in ("zigzag", "block_stripe") else [aligned + 6 * world])
            for seqlen in lengths:
                yield world, layout, seqlen


@pytest.mark.parametrize("world,layout,seqlen", list(_cases()))
def test_counts_equal_the_dense_mask(world, layout, seqlen):
    for name, mask in MASKS.items():
        if mask.cu_seqlens is not None:
            mask = mask._replace(cu_seqlens=tuple(min(b, seqlen) for b in mask.cu_seqlens))
        counts = cost.ring_counts(world, seqlen, layout, mask)
        visible, touched, full = _brute(world, seqlen, layout, mask)
        assert torch.equal(counts.visible, visible), name
        assert torch.equal(counts.touched, touched), name
        assert torch.equal(counts.full, full), name
        band = band_of_window(mask.causal, mask.window)
        assert counts.steps == (active_steps(layout, world, seqlen // world, band) if world > 1 else 1), name
        _check_schedule(counts, world, seqlen, layout, mask, name)


def test_layouts_differ_in_where_the_tiles_go_not_how_many():
    """Every layout of whole tiles touches the same global tiles in all (the mask's), and the
    pairs add up to the mask's whatever the split."""
    mask = cost.Mask.documents([1000, 17, 900, 1, 2178])
    seqlen = 4096
    one = cost.ring_counts(1, seqlen, "contiguous", mask)
    for layout in ("contiguous", "zigzag", "block_stripe"):
        ring = cost.ring_counts(4, seqlen, layout, mask)
        assert int(ring.visible.sum()) == int(one.visible.sum()) == int(_dense(seqlen, mask).sum())
        assert int(ring.touched.sum()) == int(one.touched.sum())


def test_packed_tiles_equal_the_counts():
    for lengths in ([5, 300, 1, 1, 1000, 229], [128, 256], [1, 127], [4000, 3, 3165]):
        counts = cost.ring_counts(1, sum(lengths), "contiguous", cost.Mask.documents(lengths))
        assert cost_bound._packed_tiles(lengths) == (int(counts.touched.sum()), int(counts.full.sum()))


def test_bytes_per_link():
    seqlen, world = 8192, 4
    problem = cost.Problem(heads=8, kv_heads=2, head_dim=64, dtype_bytes=2, segments=True)
    n = seqlen // world
    assert cost.kv_bytes(n, problem) == n * 2 * 64 * 2 * 2
    causal = cost.ring_counts(world, seqlen, "zigzag", cost.Mask())
    per_step = 2 * cost.kv_bytes(n, problem) + n * 2 * 64 * 2 * 4 + 2 * n * 4
    assert cost.link_bytes(causal, problem).tolist() == [per_step] * (world - 1) + [0]
    window = cost.ring_counts(world, seqlen, "contiguous", cost.Mask(window=(1000, 0)))
    assert window.steps == 2  # the window reaches one shard back: one hop
    # shards travel cut: rank r receives the last 1000 rows of rank r - 1's (rank 0: one row)
    per_row = per_step // n
    assert cost.link_bytes(window, problem).tolist() == [[per_row * rows, 0, 0, 0] for rows in (1, 1000, 1000, 1000)]
    assert cost.link_bytes(cost.ring_counts(1, seqlen, "zigzag", cost.Mask()), problem).tolist() == [0]


def test_efficiency_and_times():
    for mask in MASKS.values():
        one = cost.ring_counts(1, 4096, "zigzag", mask)
        assert cost.efficiency(one, one) == pytest.approx(1.0)
    seqlen = 65536
    mask = cost.Mask.documents([20000, 1, 9000, 30000, 6535])
    one = cost.ring_counts(1, seqlen, "contiguous", mask)
    bs = cost.ring_counts(4, seqlen, "block_stripe", mask)
    contiguous = cost.ring_counts(4, seqlen, "contiguous", mask)
    assert 0 < cost.efficiency(contiguous, one) < cost.efficiency(bs, one) < 1
    passes = cost.pass_times(bs, cost.H100)
    kv, sums, home = cost.transfer_times(bs, cost.H100)
    assert all(p.shape == (4, 4) for p in passes) and kv.shape == sums.shape == (4, 4) and home.shape == (4,)
    assert bool((kv[:, -1] == 0).all()) and bool((sums[:, :2] == 0).all()) and bool((sums[:, 2:] > 0).all())
    slow = cost.H100._replace(link_gbps=1.0)  # every step waits for its transfer
    assert cost.efficiency(bs, one, slow) < 0.1


@pytest.mark.parametrize("world,layout,mask", [(4, "block_stripe", "causal"), (4, "contiguous", "window"),
                                               (3, "zigzag", "documents"), (2, "zigzag", "causal"),
                                               (2, "contiguous", "window")])
def test_the_schedule_in_its_limits(world, layout, mask):
    """Free transfers: a rank's time is its passes' and a fixed cost a step. Free kernels:
    its transfers', as the rotation waits for them: every forward hop, in the backward the
    first hop, then each step's running sum followed by the next shard, then the trip home;
    a ring of two taking its sums home early (whole shards): the hop each way and the trip
    home in two messages."""
    seqlen = 1536 * world
    mask = MASKS[mask]
    counts = cost.ring_counts(world, seqlen, layout, mask)
    problem = cost.Problem(segments=mask.cu_seqlens is not None)
    free = cost.H100._replace(link_gbps=float("inf"), message_ms=0.0)
    compute = sum(cost.pass_times(counts, free, problem)).sum(1) + counts.steps * free.step_ms
    assert torch.allclose(cost.rank_times(counts, free, problem), compute)
    idle = cost.H100._replace(tile_ms=0.0, row_ms=0.0, step_ms=0.0)
    kv, sums, home = cost.transfer_times(counts, idle, problem)
    steps = counts.steps
    if counts.early_home:
        want = 2 * kv[:, 0] + home + idle.message_ms
    else:
        want = kv.sum(1) + kv[:, 0] + (sums + kv)[:, 1:steps].sum(1) + home
    assert steps > 1 and torch.allclose(cost.rank_times(counts, idle, problem), want)
    assert counts.early_home == (world == 2 and layout == "zigzag")


def test_document_bound():
    """Many short documents and one longer than a shard: the short ones stay whole, the long
    one is split; never below block_stripe's ring, which the layout can fall back to."""
    cases = (([20000] + [1000] * 45 + [1, 535], True), ([40000, 1, 5000, 3000, 2000, 1000, 14535], False))
    for lengths, splits in cases:
        seqlen = sum(lengths)
        bound = cost_bound.document_bound(4, seqlen, lengths)
        one = cost.ring_counts(1, seqlen, "contiguous", cost.Mask.documents(lengths))
        ring = cost.ring_counts(4, seqlen, "block_stripe", cost.Mask.documents(lengths))
        ours = cost.efficiency(ring, one, problem=cost.Problem(segments=True))
        assert len(bound["rank_ms"]) == 4 and bound["efficiency"] >= ours
        assert (bound["spread"] is not None) == splits
        if splits:
            split = [length for length, _ in bound["split"]]
            assert 20000 in split and len(split) <= 3, split  # a few more where no rank had room


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="layout"):
        cost.ring_counts(2, 1024, "diagonal")
    with pytest.raises(ValueError, match="world"):
        cost.ring_counts(0, 1024, "zigzag")
    with pytest.raises(ValueError, match="seqlen"):
        cost.ring_counts(3, 1024, "zigzag")  # not a multiple of 2 x 3
    with pytest.raises(ValueError, match="cu_seqlens"):
        cost.ring_counts(2, 1024, "zigzag", cost.Mask(cu_seqlens=(0, 2000)))
    with pytest.raises(ValueError, match="window"):
        cost.ring_counts(2, 1024, "zigzag", cost.Mask(window=(-5, 0)))
    with pytest.raises(ValueError, match="world x seqlen"):
        cost.ring_counts(128, 1 << 20, "stripe")
    with pytest.raises(ValueError, match="schedule"):
        cost.ring_counts(2, 1024, "zigzag", schedule="fast")


def _script():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        path = ROOT / "benchmarks" / "predict_scaling.py"
        spec = importlib.util.spec_from_file_location("predict_scaling", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_predict_scaling_runs_on_a_tiny_configuration(tmp_path, capsys, monkeypatch):
    module = _script()
    monkeypatch.setattr(module, "QUOTED_H100X4", module.QUOTED_H100X4[:1])
    monkeypatch.setattr(module, "GLUON_MEASURED", ())  # test_gluon_rows_are_checked_against_their_constants
    monkeypatch.setattr(module, "measured_rows", lambda: [dict(
        source="4 x H100, quoted", device="4 x H100", gpus=4, mask="documents", seqlen=32768,
        layout="block_stripe", one_ms=31.5, measured=0.74)])
    out = tmp_path / "pred.json"
    module.main(["--worlds", "2,4", "--seqlens", "16k", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "calibration" in printed and "documents (bound)" in printed
    records = json.loads(out.read_text())["records"]
    assert all(r["impl"] == "cost_model" and 0 < r["predicted_efficiency"] for r in records)
    assert {(r["gpus"], r["layout"]) for r in records if r["seqlen"] == 16384} >= {(2, "zigzag"), (4, "documents")}


def test_gluon_rows_are_checked_against_their_constants(capsys, monkeypatch):
    """predict_scaling.py checks the rows measured on the Gluon kernels against
    ``cost.H100_GLUON``, each on its own documents' draw and schedule: on 4 x H100 at 128k
    (a heavy draw, seed 1), the rotation's and the direct schedule's rows of the document
    layout and zigzag, within 11%; the Triton constants put block_stripe's rows of a
    window, whose ring keeps the Triton kernels against a Gluon 1-GPU kernel, 20% high, the
    Gluon ones within 5% (4 x H100 at 128k)."""
    module = _script()
    monkeypatch.setattr(module, "GLUON_MEASURED", ("masks_h100x4_direct_128k.json",))
    rows = module.gluon_calibration()
    assert "rms" in capsys.readouterr().out
    assert [(r["layout"], r["schedule"]) for r in rows] == [
        ("documents", "rotate"), ("documents", "direct"), ("zigzag", "rotate"), ("zigzag", "direct")]
    assert all(r["kernels"] == "gluon" and abs(r["predicted_efficiency"] / r["measured_efficiency"] - 1) < 0.11
               for r in rows)
    window = cost.Mask(causal=True, window=(module.WINDOW, 0))
    one, ring = (cost.ring_counts(w, 131072, layout, window) for w, layout in ((1, "contiguous"), (4, "block_stripe")))
    assert bool(ring.triton[:, 1:ring.steps].all()) and not bool(cost.ring_counts(4, 131072, "contiguous", window).triton.any())
    measured = 0.529  # masks_h100x4_window.json, block_stripe at 128k
    assert cost.efficiency(ring, one, cost.H100) / measured - 1 > 0.2
    assert abs(cost.efficiency(ring, one, cost.H100_GLUON) / measured - 1) < 0.05


@pytest.mark.parametrize("world", [2, 3, 4])
def test_document_layout_counts_its_own_steps_and_rows(world):
    """A layout computed from the documents: the ring runs the steps its crossing documents
    need, each over the rows of its pairs, and receives the rows that travel; what the
    queries see is what one device computes."""
    from ringflash.ring.plan import travelling_rows
    seqlen = 2048 * world
    lengths = [30, 900, 5, 1200, 77, 3] + [64] * 20
    lengths.append(seqlen - sum(lengths))
    mask = cost.Mask.documents(lengths)
    layout = ringflash.document_layout(torch.tensor(mask.cu_seqlens), seqlen, world=world)
    ring, one = cost.ring_counts(world, seqlen, layout, mask), cost.ring_counts(1, seqlen, "contiguous", mask)
    n = seqlen // world
    assert ring.steps == active_steps(layout, world, n, (None, 0)) and ring.steps > 1
    assert int(ring.visible.sum()) == int(one.visible.sum())
    _check_schedule(ring, world, seqlen, layout, mask, "documents")
    assert bool((ring.calls[:, 0] == 1).all()) and bool((ring.q_blocks[:, 0] == n // BLOCK).all())
    sent = travelling_rows(layout, world, n, (None, 0), True, ring.steps)
    want = [[0 if sent is None and s >= ring.steps - 1 else (n if sent is None else
             sent[(r - s - 1) % world][1] - sent[(r - s - 1) % world][0]) if s < ring.steps - 1 else 0
             for s in range(world)] for r in range(world)]
    assert ring.received.tolist() == want
    assert 0 < cost.efficiency(ring, one, problem=cost.Problem(segments=True)) <= 1


def _documents_layout(world: int, long: float):
    """(seqlen, layout, mask): a document of ``long`` shards of 2048 tokens, then 64-token
    ones, on the layout ``ringflash.document_layout`` computes from them (1.5 shards: its
    rows travel cut from three ranks on; 2.6: whole shards)."""
    seqlen = 2048 * world
    first = int(long * 2048)
    mask = cost.Mask.documents([first] + [64] * ((seqlen - first) // 64))
    return seqlen, ringflash.document_layout(torch.tensor(mask.cu_seqlens), seqlen, world=world), mask


def _direct_cases():
    for world in (2, 3, 4):
        seqlen = 2048 * world
        yield world, seqlen, "zigzag", cost.Mask(causal=True)
        yield world, seqlen, "contiguous", cost.Mask(causal=True, window=(300, 0))
        yield world, seqlen, "contiguous", cost.Mask(causal=True, window=(3000, 0))  # over a shard: 3 steps
        yield world, seqlen, "block_stripe", cost.Mask(causal=True, window=(300, 0))
        for long in (1.5, 2.6)[:world - 1]:
            yield (world, *_documents_layout(world, long))


@pytest.mark.parametrize("choice", plan.SCHEDULES)
def test_direct_is_taken_where_the_ring_takes_it(choice, monkeypatch):
    """The model's ``direct`` is ``ring.plan.takes_direct`` on the ring's own schedule (its
    steps and the rows that travel, every rank), RINGFLASH_SCHEDULE set as the model is asked."""
    assert cost.SCHEDULES == plan.SCHEDULES
    monkeypatch.setenv("RINGFLASH_SCHEDULE", choice)
    seen = set()
    for world, seqlen, layout, mask in _direct_cases():
        counts = cost.ring_counts(world, seqlen, layout, mask, schedule=choice)
        n, band = seqlen // world, band_of_window(mask.causal, mask.window)
        for rank in range(world):
            schedule = schedule_of(_Rank(world, rank), layout, n, band, (0.0, 0), None)
            assert counts.steps == schedule.steps
            assert counts.direct == plan.takes_direct(schedule.steps, schedule.sent), (world, layout, mask, rank)
            assert counts.cut == (schedule.sent is not None)  # where the direct schedule may keep its K/V
        assert not (counts.direct and counts.early_home)
        seen.add((counts.direct, counts.steps >= 3, counts.received is not None))
    # taken and not where the choice allows it (auto: on the cut documents), never below three steps
    assert {direct for direct, _, _ in seen} == ({False} if choice == "rotate" else {False, True})
    assert all(steps for direct, steps, _ in seen if direct)


def test_the_direct_timeline_by_hand():
    """Three ranks, three steps, full tiles only, scale 1 (32 heads of 128), one kv head: a
    K/V row of 512 bytes, a partial sum's of 1024; a link of one K/V row a ms and 0.5 ms a
    message, 0.5 ms a step: each rank's forward and backward as the direct schedule runs them."""
    world = 3
    full = torch.tensor([[100, 10, 20]] * world)  # forward 23, 2.3, 4.6; dQ 29, 2.9, 5.8; dK/dV 48, 4.8, 9.6
    zeros = torch.zeros(world, world, dtype=torch.long)
    received = torch.tensor([[30, 5, 0], [2, 1, 0], [30, 5, 0]])  # the rows of step 1's, step 2's shard
    counts = cost.RingCounts(world, 3 * 1024, "contiguous", zeros, full, full, 3, zeros + 1, zeros, zeros,
                             received, False, True)
    costs = cost.Costs(tile_ms=1.0, partial=1.0, row_ms=0.0, step_ms=0.5, link_gbps=512e-6, message_ms=0.5)
    problem = cost.Problem(heads=32, kv_heads=1, head_dim=128)
    # rank 0: the K/V of steps 1 and 2 in at 30.5 and 36 ms (in each pass). Forward: 23, then
    # 30.5 + 2.3, then 36 + 4.6 = 40.6. Backward: dQ 29, step 1 from 30.5: 38.2, its sum home at
    # 38.2 + 60.5 = 98.7; step 2: 53.6, its sum at 98.7 + 10.5 = 109.2; the own dK/dV done at
    # 101.6. 40.6 + 109.2 + 3 x 0.5. Rank 1: in at 2.5 and 4: forward 29.9; backward 36.7 (sum
    # home at 41.2), 52.1 (sum at 54.6), the own dK/dV at 100.1: 29.9 + 100.1 + 1.5.
    want = [151.3, 131.5, 151.3]
    assert cost.rank_times(counts, costs, problem).tolist() == pytest.approx(want)
    rotation = cost.rank_times(counts._replace(direct=False), costs, problem)
    assert not torch.allclose(rotation, torch.tensor(want, dtype=torch.float64))
    # The K/V kept from the forward (``keeps_received``, cut shards only): the backward's
    # remote steps at once, the own dQ and dK/dV passes last. Rank 0: step 1 done at 7.7, its
    # sum home at 68.2; step 2 at 23.1, its sum at 78.7; the own passes done at 100.1: 40.6 +
    # 100.1 + 1.5. Rank 1: steps done at 7.7 and 23.1, sums home at 10.2 and 24.6, own at 100.1.
    kept = costs._replace(keeps_received=True)
    assert cost.rank_times(counts, kept, problem).tolist() == pytest.approx(want)  # whole shards: not kept
    assert cost.rank_times(counts._replace(cut=True), kept, problem).tolist() == pytest.approx(
        [142.2, 131.5, 142.2])


def test_rows_the_direct_schedule_leaves_keep_their_numbers():
    """Where the direct schedule is not taken (or "rotate" is asked), every number is as
    before it was modelled (ms per rank, 32/8 heads with segment ids, computed then): causal
    zigzag, a ring of two taking its sums home early, a window of one hop, documents on
    block_stripe, a two-sided window on stripe, and the document layout whose rows travel
    cut, through the rotation; "auto" counts a ring that does not take it as "rotate" does."""
    problem = cost.Problem(heads=32, kv_heads=8, segments=True)
    rows = [((4, 8192, "zigzag", cost.Mask()),
             [4.35174049166275, 4.3386730516627505, 4.3386730516627505, 4.321479051662751]),
            ((2, 4096, "zigzag", MASKS["documents"]), [1.9638953576559741, 2.003668497655974]),
            ((4, 8192, "contiguous", cost.Mask(window=(1000, 0))),
             [1.5608656428468137, 1.758429437655974, 1.758429437655974, 1.737605498724676]),
            ((4, 8192, "block_stripe", cost.Mask.documents([3000, 17, 900, 1, 4274])),
             [4.2303638729679225, 4.241752272967922, 4.244599372967922, 4.250293572967921]),
            ((3, 6144, "stripe", cost.Mask(causal=False, window=(200, 50))), [3.0108890553119476] * 3),
            ((3, *_documents_layout(3, 1.5)), [2.8381247023857394, 2.838114279993882, 2.8188447507317953]),
            ((4, *_documents_layout(4, 1.5)),
             [3.958210439151128, 3.9582026223572346, 3.95019822541067, 3.94375047541067])]
    for (world, seqlen, layout, mask), want in rows:
        auto, rotate = (cost.ring_counts(world, seqlen, layout, mask, schedule=s) for s in ("auto", "rotate"))
        got = cost.rank_times(rotate, cost.H100, problem)
        assert not rotate.direct and got.tolist() == pytest.approx(want, rel=1e-12, abs=0)
        if isinstance(layout, str):
            assert not auto.direct and torch.equal(cost.rank_times(auto, cost.H100, problem), got)
        else:  # the cut documents take it, faster by the model
            assert auto.direct and float(cost.rank_times(auto, cost.H100, problem).max()) < float(got.max())
