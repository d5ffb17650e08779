"""A cost model of the heads x ring grid (``ringflash.heads``), on the CPU: U ranks trade
their pieces of a ring shard for H / U of the heads by all-to-all, the ring runs over R
ranks on the reassembled shard, and out (and lse) come back; the backward the same way
reversed. Built on ``ringflash.cost``'s exact counts of that ring and its constants
(unchanged), plus the bytes heads.py exchanges and two constants of the all-to-all
(``GridCosts``). benchmarks/predict_scaling.py prints its calibration against the measured
grid rows and its predictions for 8-64 GPUs (docs/performance.md, "Cost model", "The grid
at 8-64 GPUs").

Rank (u, r) of a grid of W = U x R ranks over N tokens holds L = N / W of them. Counted:

- the ring: ring rank r of ``cost.ring_counts(R, N, layout, mask)`` (rank (u, r) runs, for
  its H / U query heads, what ring rank r runs alone: ``heads.py``'s pieces in order of u
  are the ring shard r), timed by ``cost.rank_times`` with the heads of one chunk
  (H / U / C; compute scales with them) and the kv entries it holds (E / C, E =
  ``heads.kv_index``'s per rank: Hkv / U where U divides Hkv, else the kv heads its query
  heads read, one per query head or one for all: the replicas travel, the bytes grow).
  Each chunk is a ring call of its own, paying the ring's costs a step and a message; its
  forward is ``cost``'s forward plus the forward's share of ``step_ms`` (``PASS_SHARES``),
  its backward the rest;
- the exchanges (``exchanges``), in the order heads.py posts them, each its bytes at
  ``alltoall_gbps`` plus ``alltoall_ms``: the bytes a rank sends to the U - 1 others (its
  own piece stays), equal to those it receives. Forward: the segment ids all-gathered
  once (packed documents), then per chunk q (L x H / U / C x D elements to each rank), k
  and v (L x E / C x D each), and home out (as q) and lse (L x H / U / C fp32). Backward:
  per chunk dout (and dlse where lse has a gradient), and home dq (as q) and dK/dV (one
  exchange of both where C > 1; dk and dv apart on the unchunked path);
- the overlap (``_pipeline``), each pass alike: every chunk's inputs are posted at once and
  travel one after another on the heads group's one stream; chunk c's ring starts once its
  inputs have come and chunk c - 1's ring is done; its results leave once it is done and
  the stream is free. So with C chunks the first chunk's trip out and the last chunk's
  trip home are exposed, the rest hidden where the rings are longer; C = 1 exposes all.
  Not priced: the copies into and out of the send buffers (beside the kernels, on a side
  stream), contention between the exchanges and the kernels for SMs and memory, and
  between the all-to-all and the ring's own copies on one node's NVLink.

U = 1 is the ring alone, ``cost.rank_times`` itself (a ring alone that runs its heads one
chunk after another for memory, ``heads.memory_chunks``, is not priced so).

Several nodes (``GridCosts``): a heads group lies within one node of ``node_gpus`` GPUs
(U <= node_gpus), its all-to-all over NVLink; where U x R > node_gpus the ring spans nodes,
and every hop of it runs at ``internode_gbps`` (the ring's steps hold its ranks together:
the slowest hop sets the pace; 50 GB/s = one 400 Gb/s InfiniBand NIC a GPU), its message
cost unchanged. Within a node the ring's link stays ``Costs.link_gbps`` (the copy engines).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from .cost import H100, PASS_SHARES, Costs, Mask, Problem, RingCounts, _schedule_times, rank_times, ring_counts
from .documents import document_layout
from .heads import ALLTOALL_CALL_MS, ALLTOALL_GBPS, chunks_pay, head_chunks, kv_index, unchunked_alltoall_ms


class GridCosts(NamedTuple):
    """The grid's constants beside the ring's (``cost.Costs``).

    alltoall_gbps: bytes a rank sends to (= receives from) the other ranks of its heads
        group in one all-to-all, GB/s, within a node (NVLink).
    alltoall_ms: per all-to-all (or all-gather) call, beside its bytes.
    node_gpus: GPUs of a node; a heads group lies within one.
    internode_gbps: the ring's link where its ranks span nodes, GB/s a GPU."""

    alltoall_gbps: float
    alltoall_ms: float
    node_gpus: int = 8
    internode_gbps: float = 50.0


# Fitted by ``python benchmarks/predict_scaling.py --fit`` (2026-11-27) to the all-to-alls of
# every measured grid configuration of mesh_h200x4.json and mesh_h200x2.json (``alltoall_ms``:
# the 9 exchanges of one unchunked forward+backward timed alone, 1-9 GB a rank; U = 2 and 4):
# least squares on the relative error, every one within 6%.
NVLINK = GridCosts(alltoall_gbps=ALLTOALL_GBPS, alltoall_ms=ALLTOALL_CALL_MS)  # (heads.py's: its chunks' rule)


class Exchange(NamedTuple):
    """One collective of a grid call, per rank. ``grad``: in the backward; ``what``: the
    tensor ("q", "k", "v", "out", "lse", "dout", "dlse", "dq", "dk", "dv", "dkv",
    "segments"); ``chunk``: its chunk of heads (-1: the whole call); ``home``: results going
    back to the ranks that hold the tokens (after the chunk's ring), else inputs (before
    it); ``sent``: bytes the rank sends to the other ranks of its heads group (= those it
    receives); ``buffer``: bytes of its send buffer: an all-to-all's holds every rank's
    piece (its own stays), the segment ids' all-gather its one piece, sent to each."""

    grad: bool
    what: str
    chunk: int
    home: bool
    sent: int
    buffer: int


class GridTimes(NamedTuple):
    """A grid call's model, per ring rank r (every rank of a heads group alike): ``world``
    W = U x R; ``rank_ms`` (R,) ms of a forward+backward; ``ring_ms`` (R,) the same ring on
    tensors split by heads beforehand, unchunked (what bench_ring.py's
    ``ring_only_fwdbwd_ms`` times); ``alltoall_ms``, the call's exchanges back to back;
    ``chunks``; ``exchanges``."""

    world: int
    rank_ms: torch.Tensor
    ring_ms: torch.Tensor
    alltoall_ms: float
    chunks: int
    exchanges: tuple

    @property
    def exposed_ms(self) -> float:
        """The grid's time over its ring's alone (slowest rank of each): bench_ring.py's
        ``exposed_comm_ms``."""
        return float(self.rank_ms.max() - self.ring_ms.max())


def _positive(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _checked(heads_world: int, ring_world: int, seqlen: int, problem: Problem,
             grid: Optional[GridCosts] = None) -> int:
    """E, the kv entries a rank receives (``heads.kv_index``), once the grid's sizes are checked."""
    _positive(heads_world, "heads_world")
    _positive(ring_world, "ring_world")
    if problem.heads % heads_world:
        raise ValueError(f"heads_world {heads_world} must divide the {problem.heads} query heads")
    if problem.kv_heads < 1 or problem.heads % problem.kv_heads:
        raise ValueError(f"kv_heads {problem.kv_heads} must divide the {problem.heads} query heads")
    if seqlen % (heads_world * ring_world):
        raise ValueError(f"seqlen {seqlen} must be a multiple of the grid's {heads_world} x {ring_world} ranks")
    if grid is not None and heads_world > grid.node_gpus:
        raise ValueError(f"heads_world {heads_world}: a heads group lies within one node of {grid.node_gpus} GPUs")
    return kv_index(problem.heads, problem.kv_heads, heads_world).shape[1]


def exchanges(heads_world: int, ring_world: int, seqlen: int, problem: Problem = Problem(), chunks: int = 1,
              lse_grad: bool = False) -> list[Exchange]:
    """The collectives of one forward+backward of a rank of the (heads_world, ring_world)
    grid over ``seqlen`` tokens (batch 1), in the order ``heads.ring_over_heads`` posts
    them: ``chunks`` > 1 its overlapped path, 1 its composed one. ``lse_grad``: lse has a
    gradient (dlse travels too). U = 1: none."""
    entries = _checked(heads_world, ring_world, seqlen, problem)
    if chunks < 1 or entries % chunks:
        raise ValueError(f"chunks {chunks!r} must divide the {entries} kv entries a rank receives")
    u, d, size = heads_world, problem.head_dim, problem.dtype_bytes
    local, heads = seqlen // (heads_world * ring_world), problem.heads // heads_world // chunks
    kv = entries // chunks

    def a2a(grad: bool, what: str, chunk: int, home: bool, piece: int) -> Exchange:
        return Exchange(grad, what, chunk, home, (u - 1) * piece, u * piece)

    q_piece, kv_piece, lse_piece = local * heads * d * size, local * kv * d * size, local * heads * 4
    out = []
    if u > 1 and problem.segments:  # int32 ids, all-gathered before anything else
        out.append(Exchange(False, "segments", -1, False, (u - 1) * local * 4, local * 4))
    if u == 1:
        return out
    each = range(chunks)
    out += [a2a(False, what, c, False, piece) for c in each for what, piece in
            (("q", q_piece), ("k", kv_piece), ("v", kv_piece))]
    out += [a2a(False, what, c, True, piece) for c in each for what, piece in (("out", q_piece), ("lse", lse_piece))]
    out += [a2a(True, what, c, False, piece) for c in each for what, piece in
            (("dout", q_piece), ("dlse", lse_piece)) if what == "dout" or lse_grad]
    grads = (("dq", q_piece), ("dkv", 2 * kv_piece)) if chunks > 1 else (("dq", q_piece), ("dk", kv_piece),
                                                                         ("dv", kv_piece))
    out += [a2a(True, what, c, True, piece) for c in each for what, piece in grads]
    return out


def exchange_ms(exchange: Exchange, grid: GridCosts = NVLINK) -> float:
    """ms of one exchange: its bytes at ``alltoall_gbps`` plus ``alltoall_ms``."""
    return exchange.sent / (grid.alltoall_gbps * 1e6) + grid.alltoall_ms


def _pipeline(start: float, ins: Sequence[float], rings: Sequence[torch.Tensor],
              homes: Sequence[float]) -> torch.Tensor:
    """(R,) ms of one pass through C chunks (the module's docstring, the overlap): after
    ``start`` ms, the inputs of chunk c take ins[c] ms in turn on the one stream, its ring
    rings[c] (R,) ms once they are in and the ring before it is done, and its results
    homes[c] ms on the stream once the ring is done and the stream free."""
    stream = start + torch.tensor(list(ins), dtype=torch.float64).cumsum(0)
    done, end = torch.zeros_like(rings[0]), torch.full_like(rings[0], float(stream[-1]))
    for c, (ring, home) in enumerate(zip(rings, homes)):
        done = torch.maximum(done, stream[c]) + ring
        end = torch.maximum(end, done) + home
    return end


def ring_link(costs: Costs, world: int, ring_world: int, grid: GridCosts = NVLINK) -> Costs:
    """``costs`` with the ring's link of a grid of ``world`` ranks: ``grid.internode_gbps``
    where the ring spans nodes (world > node_gpus and R > 1), through torch.distributed
    (``keeps_received``), else unchanged."""
    if world > grid.node_gpus and ring_world > 1:
        return costs._replace(link_gbps=grid.internode_gbps, keeps_received=True)
    return costs


def _passes(ring: RingCounts, costs: Costs, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """(forward, backward), each (R,) ms of ``cost.rank_times``'s forward+backward: the
    forward as the ring's schedule lays it out (``cost._schedule_times``: the rotation's or
    the direct schedule's) plus its share of ``step_ms`` (``PASS_SHARES``), the backward the
    rest."""
    total = rank_times(ring, costs, problem)
    forward = _schedule_times(ring, costs, problem)[0] + PASS_SHARES[0] * ring.steps * costs.step_ms
    return forward, total - forward


def grid_times(ring: RingCounts, heads_world: int, problem: Problem = Problem(), costs: Costs = H100,
               grid: GridCosts = NVLINK, chunks: Optional[int] = None, lse_grad: bool = False,
               world: Optional[int] = None) -> GridTimes:
    """The model of a grid call (``GridTimes``): ``ring``, the counts of its ring
    (``cost.ring_counts(R, N, layout, mask)``, whatever U: reuse them across U);
    ``heads_world`` U; ``problem``, the whole call's heads, kv heads, head_dim, dtype and
    segment ids; ``chunks``: C (None: what ``heads.head_chunks`` takes, as the library does,
    RINGFLASH_HEAD_CHUNKS included); ``world``: W, checked to be U x R where given. U = 1 is
    the ring alone, exactly ``cost.rank_times`` (over nodes: ``ring_link``)."""
    r, seqlen = ring.world, ring.seqlen
    entries = _checked(heads_world, r, seqlen, problem, grid)
    if world is not None and world != heads_world * r:
        raise ValueError(f"world {world} is not heads_world x ring_world = {heads_world} x {r}")
    costs = ring_link(costs, heads_world * r, r, grid)
    whole = problem._replace(heads=problem.heads // heads_world, kv_heads=entries)
    if chunks is None:  # the library's choice, its rule's all-to-alls at NVLINK whatever ``grid``
        alltoall = unchunked_alltoall_ms(seqlen // (heads_world * r), problem.heads, entries, problem.head_dim,
                                         problem.dtype_bytes, heads_world)
        chunks = head_chunks(entries, seqlen // r * whole.heads,
                             lambda: chunks_pay(alltoall, ring.steps)) if heads_world > 1 else 1
    calls = exchanges(heads_world, r, seqlen, problem, chunks, lse_grad)
    ring_ms = rank_times(ring, costs, whole)
    if heads_world == 1:
        return GridTimes(r, ring_ms, ring_ms, 0.0, 1, ())
    forward, backward = _passes(ring, costs, whole._replace(heads=whole.heads // chunks,
                                                            kv_heads=entries // chunks))
    ms = [exchange_ms(x, grid) for x in calls]
    start = sum(t for t, x in zip(ms, calls) if x.chunk < 0)

    def per_chunk(grad: bool, home: bool) -> list[float]:
        return [sum(t for t, x in zip(ms, calls) if (x.grad, x.home, x.chunk) == (grad, home, c))
                for c in range(chunks)]

    rank_ms = sum(_pipeline(start if not grad else 0.0, per_chunk(grad, False), [ring_pass] * chunks,
                            per_chunk(grad, True)) for grad, ring_pass in ((False, forward), (True, backward)))
    return GridTimes(heads_world * r, rank_ms, ring_ms, sum(ms), chunks, tuple(calls))


def efficiency_of(times: GridTimes, one: RingCounts, costs: Costs = H100, problem: Problem = Problem()) -> float:
    """One device's time (``one``: the counts at world 1; ``problem``: all heads) over W x
    the grid's (``times``: its slowest rank), both from the model."""
    return float(rank_times(one, costs, problem)[0] / (times.world * times.rank_ms.max()))


def grid_efficiency(ring: RingCounts, one: RingCounts, heads_world: int, problem: Problem = Problem(),
                    costs: Costs = H100, grid: GridCosts = NVLINK, chunks: Optional[int] = None) -> float:
    """``efficiency_of`` the grid of ``grid_times``' arguments; U = 1 is ``cost.efficiency``
    (over nodes, with ``ring_link``'s link)."""
    return efficiency_of(grid_times(ring, heads_world, problem, costs, grid, chunks), one, costs, problem)


def grid_ring(world: int, heads_world: int, seqlen: int, layout, mask: Mask = Mask(),
              schedule: str = "auto") -> RingCounts:
    """The counts of the ring of a grid of ``world`` ranks, ``heads_world`` U of them a heads
    group: ``cost.ring_counts`` over R = world / U ranks (``schedule`` its own); ``layout`` a
    name, or "documents": the layout ``ringflash.document_layout`` computes from the mask's
    documents over R."""
    _positive(world, "world")
    _positive(heads_world, "heads_world")
    if world % heads_world:
        raise ValueError(f"heads_world {heads_world} must divide world {world}")
    r = world // heads_world
    if layout == "documents":
        if mask.cu_seqlens is None:
            raise ValueError("layout 'documents' needs the mask's cu_seqlens")
        layout = document_layout(torch.tensor(mask.cu_seqlens), seqlen, world=r)
    return ring_counts(r, seqlen, layout, mask, schedule)


def fit_alltoall(measured: Sequence[tuple[Sequence[Exchange], float]], grid: GridCosts = NVLINK) -> tuple:
    """(``grid`` with alltoall_gbps and alltoall_ms fitted, the rms relative error): least
    squares on the relative error of measured (exchanges, ms) pairs, each a set of
    exchanges timed back to back (bench_ring.py's ``alltoall_ms``); linear in 1 / gbps and
    the per-call ms, so solved exactly."""
    a = torch.tensor([[sum(x.sent for x in calls) / 1e6 / ms, len(calls) / ms] for calls, ms in measured],
                     dtype=torch.float64)
    per_mb, per_call = torch.linalg.lstsq(a, torch.ones(len(measured), 1, dtype=torch.float64)).solution.flatten()
    fitted = grid._replace(alltoall_gbps=float(1 / per_mb), alltoall_ms=float(per_call))
    errors = torch.tensor([sum(exchange_ms(x, fitted) for x in calls) / ms - 1 for calls, ms in measured])
    return fitted, float(errors.square().mean().sqrt())
