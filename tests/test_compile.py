"""torch.compile(fullgraph=True) over the ring on CPU (gloo): one graph, forward and backward.

A small attention block (q/k/v projections -> ring_flash_attn -> output projection, lse in
the loss) is compiled with fullgraph=True, which raises at the first graph break, behind
a counting backend (one frame, one graph), with the backends eager, aot_eager and
inductor; its outputs and every gradient must equal the uncompiled block's on the same
rank. RingSelfAttention traces into one graph too. The cross-rank agreement check runs
inside the ring's custom op, so it still catches ranks that disagree when the caller is
compiled.

One spawned gloo world per size (worlds fixture, as in test_ring.py). Every backend runs
at W=2; eager and aot_eager at W=1; aot_eager alone at W=4 (the same Dynamo trace as
eager, plus the traced backward). Inductor compiles C++ on every rank, and the op is
opaque to it whatever W is, so once over a real exchange (W=2) is enough on a 2-core
machine.
"""

from __future__ import annotations

import pytest
import torch

import ringflash
from oracle import rel_err

BACKENDS = ("eager", "aot_eager", "inductor")


def _block(sp: ringflash.SequenceParallel, causal: bool, block_mask=None):
    """x (B, S_local, 32) -> attention over the ring -> (B, S_local, 32), and the loss."""

    def block(x, w_qkv, w_out):
        b, n, _ = x.shape
        q, k, v = (x @ w_qkv).view(b, n, 8, 8).split([4, 2, 2], dim=2)  # 4 heads, 2 kv heads
        out, lse = sp.attn(q, k, v.contiguous(), causal=causal, return_lse=True, block_mask=block_mask)
        y = out.reshape(b, n, 32) @ w_out
        return y, (y * y).sum() + lse.sum()

    return block


def _inputs(world, n_local=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, n_local * world, 32, generator=gen)
    w_qkv = torch.randn(32, 64, generator=gen) / 32 ** 0.5
    w_out = torch.randn(32, 32, generator=gen) / 32 ** 0.5
    return x, w_qkv, w_out


def _run(fn, sp, x, w_qkv, w_out):
    leaves = [sp.shard(x).requires_grad_(), w_qkv.clone().requires_grad_(),
              w_out.clone().requires_grad_()]
    y, loss = fn(*leaves)
    loss.backward()
    return [y.detach(), loss.detach(), *(t.grad for t in leaves)]


def compile_matches_eager(rank, world, backends, cases=(("zigzag", True),), n_local=12, block_mask=None,
                          heads_world=1):
    """Per (layout, causal, backend): frames compiled and the largest relative difference
    to eager over the outputs, the loss and the gradients (inductor reorders fp32 sums).
    heads_world > 1: on a heads x ring grid of U = heads_world (test_heads._grid)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    group = None
    if heads_world > 1:
        from test_heads import _grid
        group = _grid(rank, world, heads_world)
    results = {}
    for layout, causal in cases:
        sp = ringflash.SequenceParallel(group, layout=layout)
        x, w_qkv, w_out = _inputs(world, n_local)
        eager = _run(_block(sp, causal, block_mask), sp, x, w_qkv, w_out)
        for backend in backends:
            torch._dynamo.reset()
            counter = CompileCounterWithBackend(backend)
            compiled = torch.compile(_block(sp, causal, block_mask), fullgraph=True, backend=counter)
            got = _run(compiled, sp, x, w_qkv, w_out)
            got_again = _run(compiled, sp, x, w_qkv, w_out)  # no recompilation either
            diff = max(rel_err(a, b) for a, b in zip(got + got_again, eager + eager))
            results[(layout, causal, backend)] = (counter.frame_count, diff)
    return results


def layer_graph_breaks(rank, world):
    """Graphs and graph breaks of RingSelfAttention's forward under Dynamo."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    sp = ringflash.SequenceParallel()
    layer = sp.self_attention(32, 4, 2)
    explained = torch._dynamo.explain(layer)(sp.shard(torch.randn(2, 16 * world, 32)))
    return explained.graph_count, explained.graph_break_count


def disagree_under_compile(rank, world):
    """Rank 1 compiles a causal call, the others a non-causal one: every rank raises."""
    import torch._dynamo

    torch._dynamo.reset()
    sp = ringflash.SequenceParallel()
    x, w_qkv, w_out = _inputs(world, seed=1)
    compiled = torch.compile(_block(sp, causal=(rank == 1)), fullgraph=True, backend="aot_eager")
    try:
        _run(compiled, sp, x, w_qkv, w_out)
    except ValueError as error:
        caught = str(error)
    else:
        caught = None
    after = _run(torch.compile(_block(sp, True), fullgraph=True, backend="aot_eager"), sp, x, w_qkv, w_out)
    return caught, torch.isfinite(after[1]).item()



@pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda w: f"W{w}")
def test_fullgraph_compile_matches_eager(worlds, world_size):
    backends = {1: ("eager", "aot_eager"), 2: BACKENDS, 4: ("aot_eager",)}[world_size]
    per_rank = worlds(world_size).run(compile_matches_eager, backends, timeout=400)
    failures = []
    for rank, results in enumerate(per_rank):
        for (layout, causal, backend), (frames, diff) in results.items():
            case = f"rank {rank} W={world_size} {layout} causal={causal} {backend}"
            if frames != 1:
                failures.append(f"{case}: {frames} frames compiled (graph breaks or recompiles)")
            if not diff <= 1e-5:
                failures.append(f"{case}: differs from eager by {diff:.3g}")
    assert not failures, "\n".join(failures)


@pytest.mark.world(4)
def test_fullgraph_compile_on_a_heads_x_ring_grid(worlds):
    """A heads x ring grid, (U, R) = (2, 2): the all-to-alls over the heads group trace into
    the one graph with the ring's op (Dynamo turns ``dist.all_to_all_single`` into its
    functional collective; the exchange's autograd Function is traced, backward too), and
    a second call does not recompile."""
    per_rank = worlds(4).run(compile_matches_eager, ("aot_eager",), (("zigzag", True),), 12, None, 2,
                             timeout=300)
    for rank, results in enumerate(per_rank):
        for case, (frames, diff) in results.items():
            assert frames == 1 and diff <= 1e-5, (rank, case, frames, diff)


@pytest.mark.world(2)
def test_fullgraph_compile_of_a_ring_of_two_that_keeps_its_kv(worlds):
    """A block mask on contiguous shards of a ring of two: the forward op also returns the
    K/V it keeps for the backward (ring.keeps_kv), whose shapes its fake implementation
    must give the same way."""
    from ringflash.kernels.block_sparse import random_block_mask
    mask = random_block_mask(256, 0.5, heads=4, seed=1)
    per_rank = worlds(2).run(compile_matches_eager, ("aot_eager",), (("contiguous", True),), 128, mask,
                             timeout=300)
    for rank, results in enumerate(per_rank):
        for case, (frames, diff) in results.items():
            assert frames == 1 and diff <= 1e-5, (rank, case, frames, diff)


@pytest.mark.world(4)
def test_ring_self_attention_compiles_without_graph_break(worlds):
    assert worlds(4).run(layer_graph_breaks, timeout=120) == [(1, 0)] * 4


@pytest.mark.world(4)
def test_ranks_disagreeing_under_compile_all_raise(worlds):
    for rank, (caught, after_ok) in enumerate(worlds(4).run(disagree_under_compile, timeout=200)):
        assert caught is not None and "disagree on band_hi (from causal" in caught, f"rank {rank}: {caught}"
        assert after_ok, f"rank {rank}: the next call is not finite"


def compile_without_process_group(rank, world):
    """(frames, errors of out and of the three gradients) of the compiled ring of one
    against flash_attn, in a process that never initializes a process group."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounter

    dist.destroy_process_group()  # the spawned world's; this check wants none at all
    torch._dynamo.reset()
    counter = CompileCounter()
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        return ringflash.ring_flash_attn(q, k, v, causal=True, layout="contiguous")

    out = torch.compile(fn, fullgraph=True, backend=counter)(q, k, v)
    out.sum().backward()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    want = ringflash.flash_attn(*leaves, causal=True)
    want.sum().backward()
    return counter.frame_count, [rel_err(out, want)] + [rel_err(t.grad, w.grad) for t, w in zip((q, k, v), leaves)]


@pytest.mark.world(1)
def test_fullgraph_compile_without_process_group(worlds):
    """No process group: the ring of one compiles and equals flash_attn. In a spawned
    process: compiled state left in pytest's own crashed later eager calls of the kernels'
    custom ops (torch 2.13, CPU)."""
    frames, errors = worlds(1).run(compile_without_process_group, timeout=180)[0]
    assert frames == 1
    assert max(errors) <= 1e-6, errors
