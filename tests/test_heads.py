"""Two-dimensional sequence parallelism (ringflash.heads): an all-to-all over a heads group
of U ranks x the ring over R ranks, on CPU over gloo, against the float64 oracle on the
full sequence: out, lse and the three gradients of every rank's shard, for (U, R) in
(2, 1), (1, 2), (2, 2), (4, 1), (3, 1), (1, 4), every layout, causal and not, GQA with
kv_heads < U, MQA, segment ids, windows, block masks and dropout (bits keyed by the global
head: those of one device); heads split into chunks whose all-to-alls overlap the ring
giving the bits of the unchunked call; the layer, SequenceParallel and a Hugging Face
model on a 2 x 2 DeviceMesh; bad input raising on every rank."""

from __future__ import annotations

import pytest
import torch
from oracle import LAYOUTS, TOL, global_mask, oracle_grads, oracle_results, rel_err, with_blocks

import ringflash
from ringflash.groups import Grid
from ringflash.kernels import dropout, dropout_keep_mask
from ringflash.heads import kv_index

F32 = torch.float32
BLOCK = 128


def _grid(rank, world, heads, how="pair", device_type="cpu"):
    """The grid of this rank for U = heads: a 2-D DeviceMesh (U, R), or a pair of groups
    (every rank makes every group, as torch.distributed requires)."""
    ring = world // heads
    if how == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(device_type, (heads, ring), mesh_dim_names=("heads", "ring"))
    import torch.distributed as dist
    # ranks g = r * U + u: heads groups are consecutive ranks
    head_groups = [dist.new_group([r * heads + u for u in range(heads)]) for r in range(ring)]
    ring_groups = [dist.new_group([r * heads + u for r in range(ring)]) for u in range(heads)]
    return (head_groups[rank // heads], ring_groups[rank % heads])


CASES = [  # name, heads, kv_heads, causal, window, documents, block mask kind[, dropout p]
    ("mha-causal", 4, 4, True, (-1, -1), None, None),
    ("gqa-full", 4, 2, False, (-1, -1), None, None),
    ("mqa-causal", 4, 1, True, (-1, -1), None, None),
    ("gqa-docs", 4, 2, True, (-1, -1), [100, 300, 112], None),
    ("window", 4, 2, True, (150, 0), None, None),
    ("blocks", 4, 2, True, (-1, -1), None, "per-head"),
    ("dropout-gqa", 4, 2, True, (-1, -1), None, None, 0.25),  # bits keyed by the global head
]


def _case(i, case, seqlen, head_count=None):
    """The full-sequence inputs of case ``i`` of CASES (CPU, fp32) and the oracle's results."""
    name, h, hkv, causal, window, docs, blocks, *rest = case
    h = head_count or h
    p = rest[0] if rest else 0.0
    dropped = (dropout_keep_mask(5, p, 1, h, seqlen), dropout.keep_scale(p)) if p else None
    gen = torch.Generator().manual_seed(i)
    q, k, v, dout = (torch.randn(1, seqlen, n, 16, generator=gen) for n in (h, hkv, hkv, h))
    dlse = torch.randn(1, h, seqlen, generator=gen)
    seg = None
    if docs is not None:
        docs = [*docs[:-1], seqlen - sum(docs[:-1])]  # the last document takes the rest
        seg = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))[None].to(torch.int32)
    bm = None
    if blocks is not None:
        nb = seqlen // BLOCK
        bm = torch.rand(h, nb, nb, generator=gen) < 0.6
        bm |= torch.eye(nb, dtype=torch.bool)
    mask = global_mask(seqlen, causal, window, seg)
    if bm is not None:
        mask = with_blocks(mask, bm, seqlen)
    want = oracle_results(q, k, v, dout, mask, dropped)
    want["dq"], want["dk"], want["dv"] = oracle_grads(q, k, v, dout, dlse=dlse, mask=mask, dropped=dropped)
    inputs = dict(q=q, k=k, v=v, dout=dout, dlse=dlse, seg=seg, bm=bm, causal=causal, window=window, p=p)
    return inputs, want


def _fits(layout, grid, seqlen, inputs) -> bool:
    """Whether ``layout`` takes the case's block mask (whole blocks a chunk) on this grid."""
    ring_local = seqlen // grid.ring_world
    chunk = {"contiguous": ring_local, "zigzag": ring_local // 2, "block_stripe": BLOCK}.get(layout, 1)
    return inputs["bm"] is None or chunk % BLOCK == 0


def _run_grid(group, layout, inputs, device=None) -> dict:
    """out, lse and the three gradients of this rank's shards, for ``inputs`` (``_case``)."""
    def on(t):
        return t if t is None or device is None else t.to(device)
    sh = lambda t, dim=1: ringflash.shard(on(t), dim, layout, group)  # noqa: E731
    ql, kl, vl = (sh(inputs[n]).requires_grad_() for n in "qkv")
    seg = inputs["seg"]
    out, lse = ringflash.ring_flash_attn(
        ql, kl, vl, causal=inputs["causal"], window_size=inputs["window"], layout=layout, group=group,
        return_lse=True, segment_ids=None if seg is None else sh(seg), block_mask=on(inputs["bm"]),
        dropout_p=inputs["p"], seed=5)
    (out * sh(inputs["dout"])).sum().add((lse * sh(inputs["dlse"], 2)).sum()).backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def _errors(got, want, group, layout, tol, where) -> list[str]:
    failures = []
    for key, value in got.items():
        err = rel_err(value.cpu(), ringflash.shard(want[key], 2 if key == "lse" else 1, layout, group))
        if not err <= tol:
            failures.append(f"{where}: {key} rel err {err:.3g}")
    return failures


def check_grid(rank, world, heads_world, layouts, how="pair", seqlen=512, cases=CASES, head_count=None,
               device=None, tol=TOL[F32]):
    """Failures (str) of every case and layout on this rank; the inputs on ``device`` (the
    oracle's on the CPU), errors at most ``tol``."""
    group = _grid(rank, world, heads_world, how, "cpu" if device is None else device.type)
    grid = ringflash.groups.resolve_grid(group)
    failures = []
    for i, case in enumerate(cases):
        inputs, want = _case(i, case, seqlen, head_count)
        for layout in layouts:
            if not _fits(layout, grid, seqlen, inputs):
                continue
            if inputs["p"] and layout != layouts[0]:  # the twin's Philox is slow; dropout's bits are by position
                continue
            got = _run_grid(group, layout, inputs, device)
            failures += _errors(got, want, group, layout, tol,
                                f"rank {rank} {grid.heads_world}x{grid.ring_world} {case[0]} {layout}")
    return failures


@pytest.mark.parametrize("world_size,heads_world", [(2, 2), (2, 1), (4, 2), (4, 4), (4, 1)],
                         ids=["U2xR1", "U1xR2", "U2xR2", "U4xR1", "U1xR4"])
def test_grid_matches_oracle(worlds, world_size, heads_world):
    layouts = ("contiguous",) if world_size // heads_world == 1 else LAYOUTS
    # U = 1 is the ring alone (test_ring's ground): its path through the grid, two cases
    cases = CASES if heads_world > 1 else [CASES[0], CASES[-1]]
    per_rank = worlds(world_size).run(check_grid, heads_world, layouts, "pair", 512, cases, timeout=600)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.world(3)
def test_grid_of_three_heads_ranks(worlds):
    """U = 3 (heads 6, kv_heads 3: a rank's heads read two kv heads unevenly, run as MHA)."""
    cases = [("u3-gqa", 6, 3, True, (-1, -1), None, None), ("u3-mqa", 6, 1, False, (-1, -1), None, None)]
    per_rank = worlds(3).run(check_grid, 3, ("contiguous",), "pair", 384, cases, timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures)


# Heads enough for several chunks a rank (ringflash.heads.head_chunks): GQA 16/8 has 4 kv
# entries a rank at U = 2 and 2 at U = 4; MQA has one, so it never splits; 12/3 is uneven (a
# rank's heads read kv heads unevenly, run as MHA), and at U = 4 has kv_heads < U.
CHUNK_CASES = [
    ("mha-causal", 8, 8, True, (-1, -1), None, None),
    ("gqa-full", 16, 8, False, (-1, -1), None, None),
    ("mqa-causal", 8, 1, True, (-1, -1), None, None),
    ("uneven-gqa", 12, 3, True, (-1, -1), None, None),
    ("gqa-docs", 16, 8, True, (-1, -1), [60, 150, 46], None),
    ("blocks", 16, 8, True, (-1, -1), None, "per-head"),
    ("dropout-mha", 8, 8, True, (-1, -1), None, None, 0.25),
]
# The chunks each case runs in when 4 are asked for, by U.
CHUNKS_RUN = {2: {"mha-causal": 4, "gqa-full": 4, "mqa-causal": 1, "uneven-gqa": 3, "gqa-docs": 4,
                  "blocks": 4, "dropout-mha": 4},
              4: {"mha-causal": 2, "gqa-full": 2, "mqa-causal": 1, "uneven-gqa": 3, "gqa-docs": 2,
                  "blocks": 2, "dropout-mha": 2},
              # U = 1: the ring alone, its heads one chunk after another (heads.memory_chunks)
              1: {"mha-causal": 4, "gqa-full": 4, "mqa-causal": 1, "uneven-gqa": 3, "gqa-docs": 4,
                  "blocks": 4, "dropout-mha": 4, "gqa-docs-cut": 4, "gqa-docs-whole": 4}}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32)  # fp32: the bits (-0.0 differs from 0.0)


def check_chunks(rank, world, heads_world, layout, cases, seqlen=256, device=None, tol=TOL[F32]):
    """Per case: (the chunks the call ran in with RINGFLASH_HEAD_CHUNKS=4, the results whose
    bits differ from the unchunked call's (=1), the largest relative difference between the
    two, failures against the oracle: errors above ``tol``); the inputs on ``device``."""
    import os

    from ringflash import heads

    group = _grid(rank, world, heads_world, "pair", "cpu" if device is None else device.type)
    ran, chunked_fn = [], heads._Overlapped if heads_world > 1 else heads._Sequential
    overlapped = chunked_fn.forward

    def counted(ctx, q, k, v, call, requires_grad):
        ran.append(call.chunks)
        return overlapped(ctx, q, k, v, call, requires_grad)
    chunked_fn.forward = staticmethod(counted)
    report = {}
    try:
        for i, case in enumerate(cases):
            inputs, want = _case(i, case, seqlen)
            runs = {}
            for chunks in ("1", "4"):
                ran.clear()
                os.environ[heads.CHUNKS_ENV] = chunks
                runs[chunks] = _run_grid(group, layout, inputs, device)
            used = ran[0] if ran else 1
            chunked, whole = runs["4"], runs["1"]
            differ = [key for key, t in chunked.items() if not torch.equal(_bits(t), _bits(whole[key]))]
            apart = max(rel_err(t.cpu(), whole[key].cpu()) for key, t in chunked.items())
            where = f"rank {rank} {heads_world}x{world // heads_world} {case[0]} {layout} chunked"
            report[case[0]] = (used, differ, apart, _errors(chunked, want, group, layout, tol, where))
    finally:
        chunked_fn.forward = staticmethod(overlapped)
        os.environ.pop(heads.CHUNKS_ENV, None)
    return report


def _chunk_failures(per_rank, heads_world, bits=True) -> list[str]:
    failures = []
    for rank, report in enumerate(per_rank):
        for name, (used, differ, _apart, errors) in report.items():
            if used != CHUNKS_RUN[heads_world][name]:
                failures.append(f"rank {rank} {name}: ran in {used} chunks, not {CHUNKS_RUN[heads_world][name]}")
            if differ and bits:
                failures.append(f"rank {rank} {name}: {differ} differ from the unchunked call's bits")
            failures += errors
    return failures


@pytest.mark.parametrize("world_size,heads_world", [(2, 2), (4, 2), (4, 4), (2, 1), (4, 1)],
                         ids=["U2xR1", "U2xR2", "U4xR1", "U1xR2", "U1xR4"])
def test_chunked_heads_give_the_unchunked_bits(worlds, world_size, heads_world):
    """Chunks of heads overlapped with their all-to-alls, or on the ring alone (U = 1) run
    one after another to bound its buffers: the same bits as one call (out, lse, dq, dk,
    dv), every case exact against the oracle (256 tokens; the rest of this module covers
    the layouts). On a ring (R > 1) the layout is block_stripe: a ring of two
    on contiguous shards under a block mask divides its dK/dV work by the mask's blocks
    (``plan.SparsePlan.key_cut``), so a chunk's heads may cut elsewhere than all of them do,
    adding the same terms in another order; that case is held to the oracle alone."""
    layout = "contiguous" if world_size == heads_world else "block_stripe"
    seqlen = 128 * world_size if heads_world == 1 else 256  # block_stripe: whole blocks a rank
    # the ring of four alone: documents, per-head block masks and dropout keyed by the
    # global head (MHA, GQA, MQA and uneven GQA run on the ring of two; CPU time)
    cases = [case for case in CHUNK_CASES if world_size == 2 or heads_world > 1
             or case[0] in ("gqa-docs", "blocks", "dropout-mha")]
    per_rank = worlds(world_size).run(check_chunks, heads_world, layout, cases, seqlen, timeout=300)
    failures = _chunk_failures(per_rank, heads_world)
    if world_size == 2 * heads_world:
        blocks = [case for case in CHUNK_CASES if case[0] == "blocks"]
        per_rank = worlds(world_size).run(check_chunks, heads_world, "contiguous", blocks, seqlen, timeout=300)
        failures += _chunk_failures(per_rank, heads_world, bits=False)
    assert not failures, "\n".join(failures[:20])


def check_chunks_fused(rank, world, layout, cases, seqlen) -> list[str]:
    """``check_chunks``' failures of the ring alone (U = 1) under the fused backward schedule
    (the Gluon backward's, on the CPU twin: ``test_ring_masks.with_fused_backward``), where
    a chunk's dq and dK/dV are written straight into its heads of the call's gradients."""
    from test_ring_masks import with_fused_backward

    if layout == "documents":  # documents that end where the shards do: one step, no travel
        lengths = [100, 156] * world
        layout = ringflash.document_layout(torch.tensor([0, *lengths]).cumsum(0), seqlen, world=world)
        cases = [("gqa-docs-whole", 16, 8, True, (-1, -1), lengths, None)]

    def failures(rank, world):
        return _chunk_failures([check_chunks(rank, world, 1, layout, cases, seqlen)], 1)
    return [f"rank {rank}: {f}" for f in with_fused_backward(rank, world, failures)]


@pytest.mark.parametrize("world_size,layout", [(2, "block_stripe"), (2, "zigzag"), (3, "block_stripe"),
                                               (2, "documents")])
def test_chunks_under_the_fused_backward_give_the_unchunked_bits(worlds, world_size, layout):
    """Heads in chunks on the ring alone, the backward fused (each chunk's gradients go
    straight into their heads: ``ring_backward``'s into): the unchunked call's bits, exact
    against the oracle; MHA, GQA with and without a mask, packed documents, and documents
    that never cross a rank (one step)."""
    cases = [case for case in CHUNK_CASES if case[0] in ("mha-causal", "gqa-full", "gqa-docs")]
    per_rank = worlds(world_size).run(check_chunks_fused, layout, cases, 256 * world_size, timeout=300)
    failures = [f for rank in per_rank for f in rank]
    assert not failures, "\n".join(failures[:20])


def check_chunks_keeping_kv(rank, world):
    """``check_chunks`` of the ring alone (U = 1) on a layout computed from documents whose
    ring of four takes the direct schedule on cut shards (3 steps), which through
    torch.distributed keeps the K/V each chunk's forward received; and how many slots were
    kept on this rank."""
    from ringflash.ring.slots import Slots
    lengths = [48, 16, 6, 58, 8, 47, 31, 42]
    layout = ringflash.document_layout(torch.tensor([0, *lengths]).cumsum(0), 256, world=world)
    kept, keep = [], Slots.keep
    Slots.keep = lambda self, *args: (kept.append(args[-1]), keep(self, *args))[1]
    try:
        report = check_chunks(rank, world, 1, layout, [("gqa-docs-cut", 16, 8, True, (-1, -1), lengths, None)])
    finally:
        Slots.keep = keep
    return report, len(kept)


def test_a_chunks_heads_are_sent_and_summed_where_they_lie():
    """What the chunks run on without copies: the copy engines send some heads of each row
    in place (``exchange._pitched``: rows of contiguous heads a fixed pitch apart), and the
    travelling rows' dK/dV sums land in some heads of wider tensors with the same bits as
    in a contiguous one (``rows.sum_rows``)."""
    from ringflash.exchange import _pitched
    from ringflash.ring.rows import sum_rows
    k = torch.randn(2, 64, 8, 16)
    assert _pitched(k[:, :, 2:4]) and _pitched(k[:, 10:30, 4:8]) and _pitched(k[:, :, 3:4])
    assert not _pitched(k[..., :8]) and not _pitched(k.transpose(1, 2)) and not _pitched(k[:, ::2, :, :].mT)
    mine, home = torch.randn(2, 2, 64, 2, 16), torch.randn(2, 2, 24, 2, 16)
    rows = slice(20, 44)
    whole = torch.zeros(2, 2, 64, 8, 16, dtype=torch.bfloat16)
    alone = torch.zeros(2, 2, 64, 2, 16, dtype=torch.bfloat16)
    sum_rows(whole[:, :, :, 4:6], mine, home, rows)
    sum_rows(alone, mine, home, rows)
    assert torch.equal(whole[:, :, :, 4:6], alone)
    assert torch.equal(alone[:, :, rows], (mine[:, :, rows] + home).bfloat16())
    assert not whole[:, :, :, :4].any() and not whole[:, :, :, 6:].any() and not whole[:, :, :20].any()


@pytest.mark.world(4)
def test_ring_alone_in_chunks_keeps_each_chunks_kv(worlds):
    """Chunks of heads on the ring alone, each call keeping the K/V its forward received
    for its own backward (the direct schedule through torch.distributed): the same bits as
    one call, exact against the oracle, and every rank kept its two steps' slots each call
    (one call unchunked, four chunked)."""
    per_rank = worlds(4).run(check_chunks_keeping_kv, timeout=300)
    failures = _chunk_failures([report for report, _ in per_rank], 1)
    assert not failures, "\n".join(failures[:20])
    assert [kept for _, kept in per_rank] == [2 * (1 + 4)] * 4


def test_kv_heads_are_picked_only_where_a_rank_shares_them():
    """Where U divides the kv heads, every kv head goes to one rank and a chunk's are
    consecutive: the chunked path only rearranges them (no pick, no summed gradient)."""
    from einops import rearrange
    from ringflash.heads import _kv_picks, kv_index
    cpu = torch.device("cpu")

    def entries(kv):  # (U, C, n) as the call keeps them: nested tuples
        return tuple(tuple(map(tuple, row)) for row in kv.tolist())

    for heads, kv_heads, u, chunks in [(32, 32, 4, 2), (32, 8, 4, 2), (32, 8, 2, 4), (8, 8, 2, 1)]:
        kv = rearrange(kv_index(heads, kv_heads, u), "u (c n) -> u c n", c=chunks)
        assert _kv_picks(entries(kv), cpu) is None, (heads, kv_heads, u)
    for heads, kv_heads, u in [(8, 1, 2), (8, 2, 4), (4, 1, 4), (12, 2, 4)]:  # MQA, kv_heads < U
        kv = kv_index(heads, kv_heads, u)[:, None]
        picks = _kv_picks(entries(kv), cpu)
        assert picks is not None and picks[1].tolist() == kv.flatten().tolist(), (heads, kv_heads, u)


def test_head_chunks_keep_whole_kv_entries(monkeypatch):
    from ringflash.heads import CHUNKS_ENV, MIN_CHUNK_ROWS, head_chunks
    monkeypatch.delenv(CHUNKS_ENV, raising=False)
    big = 4 * MIN_CHUNK_ROWS
    assert [head_chunks(n, big) for n in (1, 2, 3, 4, 6, 8, 16)] == [1, 2, 1, 2, 2, 2, 2]
    assert head_chunks(16, MIN_CHUNK_ROWS) == 1 and head_chunks(16, 2 * MIN_CHUNK_ROWS) == 2  # small calls
    monkeypatch.setenv(CHUNKS_ENV, "8")
    assert head_chunks(16, 0) == 8 and head_chunks(6, 0) == 6 and head_chunks(1, 0) == 1
    monkeypatch.setenv(CHUNKS_ENV, "1")
    assert head_chunks(16, big) == 1
    monkeypatch.setenv(CHUNKS_ENV, "two")
    with pytest.raises(ValueError, match=CHUNKS_ENV):
        head_chunks(4, big)


def test_two_chunks_only_where_they_pay(monkeypatch):
    """heads.chunks_pay, the cost model's rule, on the settings measured in pairs on 4 x H200
    at 128k (benchmarks/research/chunk_rule.py): two chunks for 32/32 heads on (2, 2) and
    (4, 1) and for 32/8 on (4, 1), one for 32/8 on (2, 2), whose all-to-alls are smaller than
    what its two steps cost again; head_chunks asks the rule only where its default would
    split, and not at all under RINGFLASH_HEAD_CHUNKS."""
    import itertools
    import types

    from ringflash import cost
    from ringflash.layouts import active_steps
    from ringflash.heads import CHUNK_STEP_MS, CHUNKS_ENV, MIN_CHUNK_ROWS, grid_chunks, head_chunks
    monkeypatch.delenv(CHUNKS_ENV, raising=False)
    assert CHUNK_STEP_MS == pytest.approx(cost.H100.step_ms + 2 * cost.H100.message_ms, abs=1e-12)
    for (u, r, kv_heads), chunks in {(2, 2, 32): 2, (4, 1, 32): 2, (2, 2, 8): 1, (4, 1, 8): 2}.items():
        q = torch.empty(1, 131072 // (u * r), 32, 128, dtype=torch.bfloat16, device="meta")
        grid, entries = types.SimpleNamespace(heads_world=u, ring_world=r), kv_index(32, kv_heads, u).shape[1]
        assert grid_chunks(q, entries, grid, "zigzag", (None, 0)) == chunks, (u, r, kv_heads)
        q_small = q[:, :1024]  # too few rows to split (MIN_CHUNK_ROWS)
        assert grid_chunks(q_small, entries, grid, "zigzag", (None, 0)) == 1
    # a document layout's steps, its own count (2 over a ring of two), as active_steps counts them
    lengths = [5000, 40000, 300, 70000, 15772]
    bounds = torch.tensor([0, *itertools.accumulate(lengths)])
    layout = ringflash.document_layout(bounds, 131072, world=2)
    assert layout.steps == active_steps(layout, 2, 65536, (None, 0))
    for entries, chunks in ((16, 2), (4, 1)):  # 32 and 8 kv heads over U = 2
        q = torch.empty(1, 32768, 32, 128, dtype=torch.bfloat16, device="meta")
        assert grid_chunks(q, entries, types.SimpleNamespace(heads_world=2, ring_world=2), layout, (None, 0)) == chunks
    big = 4 * MIN_CHUNK_ROWS

    def never():
        raise AssertionError("asked")
    assert head_chunks(16, big, lambda: False) == 1 and head_chunks(16, big, lambda: True) == 2
    assert head_chunks(16, MIN_CHUNK_ROWS, never) == 1 and head_chunks(1, big, never) == 1  # nothing to split
    monkeypatch.setenv(CHUNKS_ENV, "2")
    assert head_chunks(16, big, never) == 2


def test_ring_alone_chunks_its_heads_only_when_its_buffers_would_not_fit(monkeypatch):
    """memory_chunks: the ring's own buffers (56 KiB a local token at 32 / 8 heads, head_dim
    128, bf16) within a quarter of an 80 GB GPU: none up to 256k local tokens, 2 chunks at
    512k, 4 at 1M (4M tokens over 4 GPUs); never on the CPU or for a ring of one."""
    from ringflash.heads import CHUNKS_ENV, chunks_for, memory_chunks, ring_buffer_bytes
    monkeypatch.delenv(CHUNKS_ENV, raising=False)
    gpu = 81559 * 2 ** 20  # an H100 80GB's total memory
    q, k = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16), torch.empty(1, 1, 8, 128, dtype=torch.bfloat16)
    assert ring_buffer_bytes(q, k) == 56 * 1024  # fp32 dQ 16 KiB, four fp32 dK/dV sums 32, two K/V slots 8
    per_token = ring_buffer_bytes(q, k)
    assert [chunks_for(n * per_token, gpu, 8) for n in (2 ** 18, 2 ** 19, 2 ** 20, 2 ** 23)] == [1, 2, 4, 8]
    assert chunks_for(2 ** 20 * per_token, gpu, 1) == 1  # MQA: one kv head, nothing to split
    assert chunks_for(2 ** 20 * per_token, gpu, 6) == 3  # the fewest of the divisors 1, 2, 3, 6 that fits
    big = torch.empty(1, 2 ** 20, 32, 128, dtype=torch.bfloat16, device="meta")
    assert memory_chunks(big, big[:, :, :8], 4) == 1  # not on a GPU
    monkeypatch.setenv(CHUNKS_ENV, "3")
    assert memory_chunks(q, k, 4) == 2 and memory_chunks(q, k[:, :, :6], 1) == 3  # asked: divisors up to 3


@pytest.mark.world(4)
def test_grid_from_a_2d_device_mesh(worlds):
    per_rank = worlds(4).run(check_grid, 2, ("zigzag",), "mesh", 512, CASES[:2], timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures)


def test_kv_index_reads_each_query_heads_kv_head():
    assert kv_index(8, 8, 2).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert kv_index(8, 2, 4).tolist() == [[0], [0], [1], [1]]  # kv_heads < U: replicated in transit
    assert kv_index(8, 1, 2).tolist() == [[0], [0]]  # MQA
    assert kv_index(6, 3, 2).tolist() == [[0, 0, 1], [1, 2, 2]]  # uneven: one a query head
    for h, hkv, u in [(8, 8, 2), (8, 2, 4), (8, 4, 2), (16, 4, 8), (6, 3, 2), (8, 1, 8)]:
        index = kv_index(h, hkv, u)
        per_rank, n = h // u, index.shape[1]
        for rank in range(u):
            for j in range(per_rank):  # the kernel's grouping: query head j reads entry j // (per_rank / n)
                assert index[rank, j // (per_rank // n)] == (rank * per_rank + j) // (h // hkv)


def grid_training_step(rank, world):
    """A RingSelfAttention step on a 2 x 2 grid through SequenceParallel against the same
    layer on the whole sequence (a ring of one: a group of this rank alone): errors of
    the loss and of the summed gradients, and what positions and rank say."""
    import torch.distributed as dist
    alone = [dist.new_group([r]) for r in range(world)][rank]
    sp = ringflash.SequenceParallel(_grid(rank, world, 2), layout="zigzag")
    torch.manual_seed(0)
    layer = sp.self_attention(32, 4, 2, causal=True)
    reference = ringflash.RingSelfAttention(32, 4, 2, causal=True, group=alone)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(1))
    target = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(2))
    want = ((reference(x) - target) ** 2).sum()
    want.backward()
    loss = ((layer(sp.shard(x)) - sp.shard(target)) ** 2).sum()
    loss.backward()
    sp.reduce_gradients(layer.parameters())
    ranks = [None] * world
    dist.all_gather_object(ranks, sp.rank)
    ref_params = dict(reference.named_parameters())
    return {"loss": rel_err(sp.reduce_loss(loss), want),
            "grads": max(rel_err(p.grad, ref_params[n].grad) for n, p in layer.named_parameters()),
            "positions": float((sp.unshard(sp.positions(64)[None]) != torch.arange(64)).sum()),
            "world": sp.world, "ranks": sorted(ranks)}


@pytest.mark.world(4)
def test_layer_training_step_on_a_grid(worlds):
    per_rank = worlds(4).run(grid_training_step, timeout=300)
    for rank, errs in enumerate(per_rank):
        assert errs["world"] == 4 and errs["ranks"] == [0, 1, 2, 3], errs
        assert errs["positions"] == 0, errs
        assert errs["loss"] <= TOL[F32] and errs["grads"] <= TOL[F32], (rank, errs)


def grid_bad_calls(rank, world):
    """What each bad call raised on this rank (None: nothing)."""
    group = _grid(rank, world, 2)

    def call(q_heads=4, kv_heads=2, dropout_p=0.0, seqlen_local=64, causal=True):
        q = torch.randn(1, seqlen_local, q_heads, 16)
        k = torch.randn(1, seqlen_local, kv_heads, 16)
        try:
            ringflash.ring_flash_attn(q, k, k, causal=causal, group=group, dropout_p=dropout_p, seed=0)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None

    from torch.distributed.device_mesh import init_device_mesh
    cube = init_device_mesh("cpu", (1, 2, 2))

    def raised(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None

    return {
        "3-D mesh": raised(lambda: ringflash.SequenceParallel(cube)),
        "seqlen not splitting": raised(lambda: ringflash.shard(torch.zeros(1, 6), 1, "contiguous", group)),
        "heads not divisible": call(q_heads=3, kv_heads=1),
        "one rank's heads": call(q_heads=8 if rank == 3 else 4),
        "one rank's causal": call(causal=rank != 1),
        "still works": call(),
    }


@pytest.mark.world(4)
def test_bad_input_on_a_grid_raises_on_every_rank(worlds):
    per_rank = worlds(4).run(grid_bad_calls, timeout=300)
    for rank, got in enumerate(per_rank):
        assert "3 dimensions" in (got["3-D mesh"] or ""), (rank, got)
        assert "does not split" in (got["seqlen not splitting"] or ""), (rank, got)
        assert "multiple of the grid's heads" in (got["heads not divisible"] or ""), (rank, got)
        assert got["one rank's heads"] is not None, (rank, got)
        assert got["one rank's causal"] is not None, (rank, got)
        assert got["still works"] is None, (rank, got)
    # the ranks that see the differing rank's row name the field
    assert "band_hi" in per_rank[1]["one rank's causal"] and "band_hi" in per_rank[0]["one rank's causal"]


def test_grids_of_one_dimension_and_too_many():
    grid = ringflash.groups.resolve_grid(None)
    assert isinstance(grid, Grid) and grid.heads is None and grid.world == 1 and grid.rank == 0
    assert ringflash.groups.resolve_grid(grid) is grid


def hf_on_a_grid(rank, world):
    """A tiny Llama through prepare_batch on a 2 x 2 DeviceMesh (heads x ring): errors of
    logits, loss and summed gradients against the unsharded eager model."""
    from test_hf import _batch, ring_errors, tiny_models
    reference, model = tiny_models()
    sp = ringflash.SequenceParallel(_grid(rank, world, 2, "mesh"), layout="zigzag")
    return ring_errors(reference, model, sp, *_batch(seqlen=32))[0]


@pytest.mark.world(4)
def test_hf_model_on_a_2x2_mesh_matches_unsharded(worlds):
    pytest.importorskip("transformers")
    per_rank = worlds(4).run(hf_on_a_grid, timeout=300)
    failures = [f"rank {rank}: {what} rel err {err:.3g}" for rank, errs in enumerate(per_rank)
                for what, err in errs.items() if not err <= 1e-5]
    assert not failures, "\n".join(failures)
