"""The grid's cost model (ringflash.cost_grid): its exchanges are the collectives
ringflash.heads posts, tensor for tensor (the grid's own code run on small CPU tensors, its
collectives and ring ops stubbed to record what they are given), chunked and not, with kv
heads replicated where U does not divide them; U = 1 is exactly the ring's model; R = 1
moves no ring bytes; the overlap rule in its limits; the ring's link across nodes; bad
input; and benchmarks/predict_scaling.py's grid tables on a tiny configuration."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.distributed as dist

from ringflash import cost, cost_grid, heads
from ringflash.cost_grid import NVLINK, GridCosts
from test_cost_model import _script

DOCS = cost.Mask.documents([300, 1200, 77, 2000, 519, 4096])  # 8192 tokens


class _Work:
    def wait(self):
        return None


def _recording(monkeypatch) -> list:
    """Stubs the collectives heads.py calls (each rank receives what it sends) and the ring
    ops (out = q, dq = dout, dK/dV = (k, v): the shapes the real ones return); returns the
    list each collective appends (kind, bytes of the send buffer) to."""
    sent = []

    def all_to_all_single(recv, send, group=None, async_op=False):
        sent.append(("a2a", send.numel() * send.element_size()))
        recv.copy_(send)
        return _Work() if async_op else None

    def all_gather(parts, t, group=None):
        sent.append(("gather", t.numel() * t.element_size()))
        for p in parts:
            p.copy_(t)

    def ring_attn(q2, k2, v2, segments, **_):
        lse = q2.float().sum(-1).transpose(1, 2).contiguous()
        return q2 + 0 * (k2.sum() + v2.sum()), lse

    def forward_impl(q2, k2, v2, *_):
        return q2.clone(), q2.float().sum(-1).transpose(1, 2).contiguous(), torch.empty(0), torch.empty(0)

    def backward_impl(into, dout2, q2, k2, v2, *_):  # the grid's chunks pass no into
        assert into is None
        return dout2.clone(), torch.stack([k2, v2])

    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(heads, "ring_attn", ring_attn)
    monkeypatch.setattr(heads, "ring_attn_forward_impl", forward_impl)
    monkeypatch.setattr(heads, "ring_attn_backward_impl", backward_impl)
    return sent


@pytest.mark.parametrize("h, hkv, u, chunks", [
    (4, 4, 2, 2), (4, 4, 2, 1), (8, 2, 2, 1),  # U divides the kv heads
    (8, 2, 4, 1),  # two ranks read one kv head: it travels to both
    (6, 2, 3, 2), (6, 2, 3, 1),  # a rank's two query heads read two kv heads: one entry each
])
@pytest.mark.parametrize("segments, lse_grad", [(False, False), (True, True)])
def test_exchanges_are_what_heads_moves(monkeypatch, h, hkv, u, chunks, segments, lse_grad):
    """``cost_grid.exchanges``' send buffers, in order, forward then backward, are those of
    the collectives ``heads.ring_over_heads`` posts (bf16 q, k, v; fp32 lse; int32 ids)."""
    ring_world, local, d = 3, 8, 4
    sent = _recording(monkeypatch)
    monkeypatch.setenv(heads.CHUNKS_ENV, str(chunks))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, local, n, d, generator=gen, dtype=torch.bfloat16).requires_grad_()
               for n in (h, hkv, hkv))
    ids = torch.zeros(1, local, dtype=torch.int32) if segments else None
    grid = types.SimpleNamespace(heads_world=u, heads_rank=1, heads=None, ring=None)
    out, lse = heads.ring_over_heads(q, k, v, grid, ids, None, softmax_scale=0.5, band=(None, 0),
                                     layout="contiguous", dropout=(0.0, 0))
    forward = len(sent)
    (out.float().sum() + (lse.sum() if lse_grad else 0)).backward()
    problem = cost.Problem(heads=h, kv_heads=hkv, head_dim=d, segments=segments)
    model = cost_grid.exchanges(u, ring_world, local * u * ring_world, problem, chunks, lse_grad)
    want = [("gather" if x.what == "segments" else "a2a", x.buffer) for x in model]
    assert [x.grad for x in model] == [False] * forward + [True] * (len(sent) - forward)
    if chunks > 1:  # posted in this order
        assert sent == want
    else:  # the unchunked backward's order is autograd's
        assert sent[:forward] == want[:forward] and sorted(sent[forward:]) == sorted(want[forward:])
    for x in model:
        assert x.sent == (x.buffer * (u - 1) // u if x.what != "segments" else x.buffer * (u - 1))


def test_kv_bytes_grow_where_kv_heads_are_replicated():
    """Each rank receives Hkv / U kv heads where U divides them, else one per rank whose
    query heads share one, or one per query head: the k, v and dK/dV bytes grow so."""
    local, d = 128, 128

    def kv_buffer(h, hkv, u):
        x = [x for x in cost_grid.exchanges(u, 1, local * u, cost.Problem(h, hkv, d)) if x.what == "k"]
        return x[0].buffer

    row = local * d * 2  # one kv head of the rank's tokens, bf16
    assert kv_buffer(32, 8, 4) == 8 * row and kv_buffer(32, 8, 8) == 8 * row  # no replica
    assert kv_buffer(32, 4, 8) == 8 * row and kv_buffer(32, 1, 8) == 8 * row  # each of 8 ranks one head
    assert kv_buffer(6, 2, 3) == 6 * row  # one entry per query head
    assert kv_buffer(32, 32, 8) == 32 * row and kv_buffer(32, 32, 2) == 32 * row
    q = [x for x in cost_grid.exchanges(8, 1, local * 8, cost.Problem(32, 1, d)) if x.what == "q"][0]
    assert q.buffer == 32 * row and q.sent == 28 * row


@pytest.mark.parametrize("world, layout, mask", [
    (2, "zigzag", cost.Mask()), (4, "block_stripe", DOCS), (4, "documents", DOCS), (8, "contiguous", cost.Mask())])
def test_one_heads_rank_is_the_ring(world, layout, mask):
    ring = cost_grid.grid_ring(world, 1, 8192, layout, mask)
    one = cost.ring_counts(1, 8192, "contiguous", mask)
    for problem in (cost.Problem(), cost.Problem(32, 8, segments=True)):
        times = cost_grid.grid_times(ring, 1, problem)
        assert torch.equal(times.rank_ms, cost.rank_times(ring, cost.H100, problem))
        assert times.exposed_ms == 0 and times.alltoall_ms == 0 and not times.exchanges
        assert cost_grid.grid_efficiency(ring, one, 1, problem) == cost.efficiency(ring, one, cost.H100, problem)
    assert cost_grid.exchanges(1, world, 8192, cost.Problem(segments=True)) == []


def test_forward_and_backward_add_up_to_the_ring():
    for world, layout in ((2, "zigzag"), (4, "block_stripe")):
        ring = cost.ring_counts(world, 8192, layout, DOCS)
        problem = cost.Problem(segments=True)
        forward, backward = cost_grid._passes(ring, cost.H100, problem)
        assert torch.allclose(forward + backward, cost.rank_times(ring, cost.H100, problem))
        assert bool((forward > 0).all()) and bool((backward > forward).all())


def test_one_ring_rank_moves_no_ring_bytes():
    """R = 1: the ring is one device computing H / U heads; all that moves is the all-to-all,
    whatever the ring's link."""
    ring = cost.ring_counts(1, 8192, "contiguous", DOCS)
    assert int(cost.link_bytes(ring).sum()) == 0
    assert all(float(t.abs().sum()) == 0 for t in cost.transfer_times(ring, cost.H100))
    problem = cost.Problem(32, 8, segments=True)
    times = cost_grid.grid_times(ring, 4, problem, chunks=2)
    assert torch.equal(times.ring_ms, cost.rank_times(ring, cost.H100, problem._replace(heads=8, kv_heads=2)))
    assert {x.what for x in times.exchanges} == {"segments", "q", "k", "v", "out", "lse", "dout", "dq", "dkv"}
    slow = cost_grid.grid_times(ring, 4, problem, cost.H100._replace(link_gbps=1e-3), chunks=2)
    assert torch.equal(slow.rank_ms, times.rank_ms)


def test_the_overlap_rule_in_its_limits():
    """Unchunked, every exchange adds; chunked behind long rings, each pass exposes its
    first chunk's inputs and its last chunk's results, beside the chunks' own ring costs."""
    ring = cost.ring_counts(2, 1 << 16, "zigzag", cost.Mask())
    problem = cost.Problem(32, 8)
    serial = cost_grid.grid_times(ring, 2, problem, chunks=1)
    assert serial.exposed_ms == pytest.approx(serial.alltoall_ms, rel=1e-9)
    chunked = cost_grid.grid_times(ring, 2, problem, chunks=2)
    ms = {(x.grad, x.what, x.chunk): cost_grid.exchange_ms(x) for x in chunked.exchanges}
    edges = sum(ms[(False, w, 0)] for w in "qkv") + ms[(False, "out", 1)] + ms[(False, "lse", 1)]
    edges += ms[(True, "dout", 0)] + ms[(True, "dq", 1)] + ms[(True, "dkv", 1)]
    halves = 2 * cost.rank_times(ring, cost.H100, problem._replace(heads=8, kv_heads=2))
    assert float(chunked.rank_ms.max()) == pytest.approx(float(halves.max()) + edges, rel=1e-9)
    free = cost_grid.grid_times(ring, 2, problem, grid=NVLINK._replace(alltoall_gbps=math.inf, alltoall_ms=0.0),
                                chunks=2)
    assert torch.allclose(free.rank_ms, halves)


def test_the_ring_spans_nodes_beyond_one():
    assert cost_grid.ring_link(cost.H100, 8, 8).link_gbps == cost.H100.link_gbps
    assert cost_grid.ring_link(cost.H100, 16, 8).link_gbps == NVLINK.internode_gbps
    assert cost_grid.ring_link(cost.H100, 16, 1).link_gbps == cost.H100.link_gbps
    seqlen = 1 << 16
    mask = cost.Mask()
    one = cost.ring_counts(1, seqlen, "contiguous", mask)
    ring = cost_grid.grid_ring(16, 2, seqlen, "zigzag", mask)  # R = 8 over 2 nodes
    fast, slow = (cost_grid.grid_efficiency(ring, one, 2, grid=NVLINK._replace(internode_gbps=gbps))
                  for gbps in (cost.H100.link_gbps, 5.0))
    assert 0 < slow < fast <= 1
    assert cost_grid.grid_efficiency(ring, one, 2, grid=GridCosts(335.0, 0.0625, node_gpus=16)) == fast


def test_bad_input_names_the_argument():
    ring = cost.ring_counts(2, 8192, "zigzag")
    with pytest.raises(ValueError, match="heads_world"):
        cost_grid.grid_times(ring, 3, cost.Problem(32, 8))  # 3 does not divide 32 heads
    with pytest.raises(ValueError, match="heads_world"):
        cost_grid.grid_times(ring, 0)
    with pytest.raises(ValueError, match="heads_world"):
        cost_grid.grid_times(ring, 16, cost.Problem(32, 32))  # more than a node
    with pytest.raises(ValueError, match="world"):
        cost_grid.grid_times(ring, 2, world=8)  # 2 x 2 is not 8
    with pytest.raises(ValueError, match="heads_world"):
        cost_grid.grid_ring(8, 3, 8192, "zigzag")
    with pytest.raises(ValueError, match="world"):
        cost_grid.grid_ring(0, 1, 8192, "zigzag")
    with pytest.raises(ValueError, match="seqlen"):
        cost_grid.exchanges(4, 3, 8192 + 6)
    with pytest.raises(ValueError, match="kv_heads"):
        cost_grid.exchanges(2, 1, 8192, cost.Problem(32, 3))
    with pytest.raises(ValueError, match="chunks"):
        cost_grid.exchanges(8, 1, 8192, cost.Problem(32, 8), chunks=2)  # one kv entry a rank
    with pytest.raises(ValueError, match="cu_seqlens"):
        cost_grid.grid_ring(4, 2, 8192, "documents")


def test_alltoall_fit_recovers_its_constants():
    grid = GridCosts(300.0, 0.05)
    measured = [(calls, sum(cost_grid.exchange_ms(x, grid) for x in calls)) for calls in (
        cost_grid.exchanges(u, 1, n * u, cost.Problem(32, hkv)) for u in (2, 4) for n in (1 << 14, 1 << 17)
        for hkv in (8, 32))]
    fitted, rms = cost_grid.fit_alltoall(measured, NVLINK)
    assert fitted.alltoall_gbps == pytest.approx(300.0) and fitted.alltoall_ms == pytest.approx(0.05)
    assert rms < 1e-9


def test_predict_scaling_grid_tables(capsys, monkeypatch):
    module = _script()
    rows = module.grid_rows(lambda r: r["seqlen"] == 131072 and r["mask"] == "documents")
    assert {(r["heads_parallel"], r["ring_world"]) for r in rows} == {(2, 1), (2, 2), (4, 1)}
    grid, records = module.grid_calibration(rows, cost.H100, NVLINK, refit=True)
    assert abs(grid.alltoall_gbps / NVLINK.alltoall_gbps - 1) < 0.1
    assert all(abs(r["predicted_efficiency"] / r["measured_efficiency"] - 1) < 0.15 for r in records)
    assert all(abs(r["predicted_alltoall_ms"] / r["measured_alltoall_ms"] - 1) < 0.1 for r in records)
    records = module.grid_predictions([2, 4], [16384], cost.H100, NVLINK)
    printed = capsys.readouterr().out
    assert "grid calibration" in printed and "best" in printed
    assert {(r["gpus"], r["heads_parallel"]) for r in records} == {(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)}
    assert all(0 < r["predicted_efficiency"] <= 1 for r in records)


@pytest.mark.parametrize("u, h, hkv", [(2, 32, 32), (2, 32, 8), (4, 32, 8), (8, 32, 8), (4, 8, 1),
                                                (4, 12, 3), (8, 64, 8)])
def test_the_chunks_rule_prices_the_all_to_alls_as_the_model(u, h, hkv):
    """heads.unchunked_alltoall_ms, which the library's chunk rule reads, is cost_grid's price
    of an unchunked call's exchanges at NVLINK (no segment ids, no dlse)."""
    r, seqlen = 2, 65536 * u
    problem = cost.Problem(heads=h, kv_heads=hkv, head_dim=128)
    entries = heads.kv_index(h, hkv, u).shape[1]
    model = sum(cost_grid.exchange_ms(x) for x in cost_grid.exchanges(u, r, seqlen, problem, 1))
    got = heads.unchunked_alltoall_ms(seqlen // (u * r), h, entries, 128, problem.dtype_bytes, u)
    assert got == pytest.approx(model, rel=1e-12)
