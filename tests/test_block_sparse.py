"""Block-sparse attention: the block mask on one device (PyTorch twin and Triton kernels,
interpreted on CPUs), through the ring over gloo (world sizes 1-4, the layouts that can
serve it), the index lists the kernels iterate over, the pattern helpers, and bad input.

The oracle expands the block mask to elements with repeat_interleave (oracle.block_elements)
and combines it with the mask written from docs/design.md's definitions (oracle.global_mask).
"""

from __future__ import annotations

import pytest
import torch
from oracle import F32, TOL, global_mask, oracle_results, rel_err, with_blocks

import ringflash
from ringflash.kernels import block_sparse, flash_attn
from ringflash.kernels.masks import BAND_INF, BLOCK, block_lists, program_order
from ringflash.layouts import active_steps, occupied_chunks
from test_dropout import dropped
from test_masks import _impl, _inputs, _run_flash_attn, segments

SEQLEN = 300  # three blocks, the last one ragged


def _mask_of(kind: str, heads: int, seqlen: int = SEQLEN) -> torch.Tensor:
    n = -(-seqlen // BLOCK)
    if kind == "random":
        return block_sparse.random_block_mask(seqlen, 0.5, seed=3)
    if kind == "per-head":
        return block_sparse.random_block_mask(seqlen, 0.4, heads=heads, seed=4)
    if kind == "local-global":
        return block_sparse.local_global_block_mask(seqlen, local_blocks=1, global_blocks=1)
    if kind == "empty-row":  # query block 1 sees nothing; key block 2 is never seen
        m = torch.ones(1, n, n, dtype=torch.bool)
        m[:, 1] = False
        m[:, :, 2] = False
        return m
    if kind == "zeros":
        return torch.zeros(1, n, n, dtype=torch.bool)
    return torch.ones(1, n, n, dtype=torch.bool)


CASES = [  # (name, block mask kind, causal, window, documents)
    ("random", "random", False, (-1, -1), None),
    ("per-head-causal", "per-head", True, (-1, -1), None),
    ("local-global-window", "local-global", True, (70, -1), None),
    ("documents", "random", True, (-1, -1), [[100, 1, 120, -79]]),
    ("empty-row", "empty-row", False, (-1, -1), None),
    ("zeros", "zeros", True, (-1, -1), None),
]


# The interpreter skips "random": a mask without a band is test_long_rows_first_matches_oracle's.
@pytest.mark.parametrize("impl, name, kind, causal, window, docs", [
    pytest.param(impl, *case, id=f"{case[0]}-{impl}") for case in CASES for impl in ("twin", "triton")
    if impl == "twin" or case[0] != "random"])
def test_block_mask_matches_oracle(impl, name, kind, causal, window, docs, monkeypatch):
    device = _impl(impl, monkeypatch)
    # The interpreter: two heads for the per-head mask; a mask shared by grouped heads is
    # test_long_rows_first_matches_oracle's.
    h, hkv = (2, 1) if impl == "twin" or kind == "per-head" else (1, 1)
    dtype = F32
    q, k, v, dout = _inputs(1, SEQLEN, h, hkv, 16, dtype, device, seed=7)
    bm = _mask_of(kind, h)
    seg = None if docs is None else segments(docs, SEQLEN)
    out, lse, dq, dk, dv = _run_flash_attn(q, k, v, dout, causal=causal, window_size=window,
                                           block_mask=bm.to(device),
                                           segment_ids=None if seg is None else seg.to(device))
    mask = with_blocks(global_mask(SEQLEN, causal, window, seg), bm, SEQLEN)
    want = oracle_results(q, k, v, dout, mask)
    for key, a in zip(want, (out, lse, dq, dk, dv)):
        err = rel_err(a, want[key])
        assert err <= TOL[dtype], f"{impl} {name}: {key} rel err {err:.3g}"
    blind = ~mask.expand(1, h, SEQLEN, SEQLEN).any(-1)  # (1, H, S): rows that see nothing
    assert torch.isneginf(lse.cpu()[blind]).all()
    assert (out.cpu().transpose(1, 2)[blind] == 0).all()
    assert (dq.cpu().transpose(1, 2)[blind] == 0).all()
    assert not any(torch.isnan(t).any() for t in (out, lse, dq, dk, dv))


@pytest.mark.parametrize("impl", ["twin", "triton"])
def test_all_ones_is_dense(impl, monkeypatch):
    """An all-True block mask computes what no block mask computes (up to summation order)."""
    device = _impl(impl, monkeypatch)
    # The interpreter is slow: two blocks, the last ragged, one head.
    s, h = (SEQLEN, 2) if impl == "twin" else (200, 1)
    q, k, v, dout = _inputs(1, s, h, 1, 16, F32, device, seed=8)
    for causal in (False, True) if impl == "twin" else (True,):
        dense = _run_flash_attn(q, k, v, dout, causal=causal)
        ones = _run_flash_attn(q, k, v, dout, causal=causal, block_mask=_mask_of("ones", h, s).to(device))
        for a, b in zip(dense, ones):
            assert rel_err(a, b) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("s", [2000, 2048])
@pytest.mark.parametrize("kind", ["random", "per-head", "local-global"])
def test_gpu_block_mask(kind, s, monkeypatch):
    """bf16 on the GPU's own tiles (hd 128, GQA, causal) against the oracle: 2000 tokens
    (the Triton kernels), 2048 (on Hopper the forward and the backward are the Gluon
    kernels': counted)."""
    from ringflash.kernels import dispatch
    calls, run, route = [], dispatch.gluon_bwd, dispatch.fwd_route

    def counted_route(*args, **kwargs):
        chosen = route(*args, **kwargs)
        if chosen.name == dispatch.GLUON:
            calls.append("fwd")
        return chosen

    monkeypatch.setattr(dispatch, "gluon_bwd", lambda *a, **kw: calls.append("bwd") or run(*a, **kw))
    monkeypatch.setattr(dispatch, "fwd_route", counted_route)
    h, hkv = 8, 2
    q, k, v, dout = _inputs(1, s, h, hkv, 128, torch.bfloat16, "cuda", seed=9)
    bm = _mask_of(kind, h, s)
    got = _run_flash_attn(q, k, v, dout, causal=True, block_mask=bm.cuda())
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert calls == (["fwd", "bwd"] if hopper and s % 128 == 0 else [])
    mask = with_blocks(global_mask(s, True), bm, s).cuda()
    want = oracle_results(q, k, v, dout, mask)
    for key, a in zip(want, got):
        err = rel_err(a, want[key])
        assert err <= 2e-2, f"{kind}: {key} rel err {err:.3g}"


def test_block_lists_classify_and_order():
    """A causal band over 2.5 blocks. Row block 0: block 0 partial (diagonal), block 1
    empty; row block 1: block 0 full, block 1 partial, block 2 empty; row block 2 (ragged):
    both listed blocks partial. False blocks are never listed; indices ascend."""
    blocks = torch.tensor([[[True, True, False], [True, True, True], [True, False, True]]])
    counts, index = block_lists(blocks, -BAND_INF, 0, 300, 300)
    assert counts.tolist() == [[[1, 1, 2]], [[0, 1, 0]]]  # (partial, full) per row block
    assert index[0, 0, :1].tolist() == [0] and index[0, 1, :2].tolist() == [1, 0]
    assert index[0, 2, :2].tolist() == [0, 2]
    # no band: ragged rows and columns are partial, the whole ones full (partial listed first)
    counts, index = block_lists(blocks, -BAND_INF, BAND_INF, 300, 300)
    assert counts.tolist() == [[[0, 1, 2]], [[2, 2, 0]]]
    assert index[0, 0, :2].tolist() == [0, 1] and index[0, 1, :3].tolist() == [2, 0, 1]
    assert index[0, 2, :2].tolist() == [0, 2]


def test_program_order_runs_long_rows_first():
    """A launch's programs, permuted: those whose rows list more than twice the mean blocks
    first (local + global's global row), the rest in the natural order (tiles reversed when
    asked); dK/dV programs count the lists of every query head they loop over."""
    n = 6
    lg = block_sparse.local_global_block_mask(n * BLOCK, local_blocks=1, global_blocks=1)
    counts, _ = block_lists(lg, -BAND_INF, BAND_INF, n * BLOCK, n * BLOCK)  # rows: 6, 2, 2, ...
    order = program_order(counts, 2 * n, BLOCK // 2, batch=2, heads=3).tolist()  # 64-row tiles
    first = [bh * 2 * n + t for bh in range(6) for t in (0, 1)]  # row block 0's two tiles
    assert order == first + [p for p in range(6 * 2 * n) if p not in first]
    assert program_order(counts, n, BLOCK, 1, 1, reverse=True).tolist() == [0, 5, 4, 3, 2, 1]
    even, _ = block_lists(torch.ones(1, n, n, dtype=torch.bool), -BAND_INF, BAND_INF, n * BLOCK, n * BLOCK)
    assert program_order(even, n, BLOCK, 1, 2).tolist() == list(range(2 * n))
    # per-head lists: only head 1's global row is long; a kv head of 2 query heads sums them
    per_head = torch.stack([torch.eye(n, dtype=torch.bool), lg[0]])
    counts, _ = block_lists(per_head, -BAND_INF, BAND_INF, n * BLOCK, n * BLOCK)
    assert program_order(counts, n, BLOCK, 1, 2).tolist() == [6] + [p for p in range(2 * n) if p != 6]
    counts, _ = block_lists(torch.stack([lg[0], lg[0]]), -BAND_INF, BAND_INF, n * BLOCK, n * BLOCK)
    assert program_order(counts, n, BLOCK, 1, 1, group=2).tolist()[:1] == [0]
    assert program_order(counts[:, :1], n, BLOCK, 1, 1, group=2).tolist()[:1] == [0]


@pytest.mark.parametrize("causal", [False, True])
def test_long_rows_first_matches_oracle(causal, monkeypatch):
    """The Triton kernels (interpreted) with programs out of their natural order, four
    blocks (the last one 20 rows). Without a band: query block 0 sees every block, the
    others their own, so the forward's and dQ's programs of block 0's rows run first, head
    1's before head 0's short ones (two query heads, one kv head). Causal: local + global
    attention, whose key block 0 every row sees, so the dK/dV programs of its key rows run
    first, kv head 1's before kv head 0's short ones."""
    from ringflash.kernels.masks import Blocks
    device = _impl("triton", monkeypatch)
    s, n = 3 * BLOCK + 20, 4
    h, hkv = (2, 2) if causal else (2, 1)
    q, k, v, dout = _inputs(1, s, h, hkv, 16, F32, device, seed=11)
    if causal:
        bm = block_sparse.local_global_block_mask(s, local_blocks=1, global_blocks=1)
    else:
        bm = torch.eye(n, dtype=torch.bool)[None]
        bm[:, 0] = True
    # The launch order with one program a block (the kernels' tiles are smaller): over query
    # rows without a band, over key rows (dK/dV) under the causal one.
    order = Blocks(bm).order(-BAND_INF, 0 if causal else BAND_INF, s, s, causal, BLOCK, 1, hkv if causal else h)
    assert order.tolist()[:2] == [0, n]  # reordered
    got = _run_flash_attn(q, k, v, dout, causal=causal, block_mask=bm.to(device))
    want = oracle_results(q, k, v, dout, with_blocks(global_mask(s, causal), bm, s))
    for key, a in zip(want, got):
        assert rel_err(a, want[key]) <= TOL[F32], key


def test_helpers():
    n = 8
    m = block_sparse.random_block_mask(n * BLOCK, 0.25, heads=3, seed=1)
    assert m.shape == (3, n, n) and m.dtype == torch.bool
    assert (m.sum((1, 2)) == round(0.25 * n * n)).all()
    assert m.diagonal(dim1=1, dim2=2).all()
    assert torch.equal(m, block_sparse.random_block_mask(n * BLOCK, 0.25, heads=3, seed=1))
    assert not torch.equal(m, block_sparse.random_block_mask(n * BLOCK, 0.25, heads=3, seed=2))
    a = torch.arange(n)[:, None]
    c = torch.arange(n)[None, :]
    lg = block_sparse.local_global_block_mask(n * BLOCK, local_blocks=2, global_blocks=1, causal=True)
    assert torch.equal(lg[0], (((a - c).abs() <= 1) | (a == 0) | (c == 0)) & (c <= a))
    st = block_sparse.strided_block_mask(n * BLOCK, stride=3, heads=2)
    assert st.shape == (2, n, n) and torch.equal(st[1], (a - c) % 3 == 0)
    docs = block_sparse.block_mask_from_mask_mod(lambda b, h, q, k: q // 256 == k // 256,
                                                 heads=1, seqlen_q=600)
    assert torch.equal(docs[0], a[:5, :1] // 2 == c[:1, :5] // 2)
    with pytest.raises(ValueError, match="partly visible"):
        block_sparse.block_mask_from_mask_mod(lambda b, h, q, k: q >= k, heads=1, seqlen_q=300)
    causal = block_sparse.block_mask_from_mask_mod(lambda b, h, q, k: q >= k, heads=2,
                                                   seqlen_q=300, partial=True)
    assert torch.equal(causal, torch.ones(2, 3, 3, dtype=torch.bool).tril())
    assert torch.equal(block_sparse.expand_block_mask(m, 1000)[:, ::BLOCK, ::BLOCK], m)
    for seqlen in (100, 2000):  # 1 or 16 blocks, not m's 8
        with pytest.raises(ValueError, match="block_mask must be"):
            block_sparse.expand_block_mask(m, seqlen)
    # a mask_mod that indexes tensors of seqlen entries: called on real positions only
    doc = torch.tensor([0] * 100 + [1] * 200)
    ragged = block_sparse.block_mask_from_mask_mod(lambda b, h, q, k: doc[q] == doc[k], heads=1,
                                                   seqlen_q=300, partial=True)
    assert torch.equal(ragged, torch.ones(1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="density"):
        block_sparse.random_block_mask(1024, 1.5)


@pytest.mark.parametrize("bad, error, match", [
    (torch.ones(1, 3, 3), TypeError, "bool"),
    (torch.ones(1, 3, 2, dtype=torch.bool), ValueError, "shape"),
    (torch.ones(3, 3, 3, dtype=torch.bool), ValueError, "heads"),
    (torch.ones(3, 3, dtype=torch.bool), ValueError, "shape"),
    ([[True]], TypeError, "Tensor"),
], ids=["float", "blocks", "heads", "2d", "list"])
def test_bad_block_mask(bad, error, match):
    q, k, v, _ = _inputs(1, SEQLEN, 2, 1, 16, F32, "cpu")
    with pytest.raises(error, match=match):
        flash_attn(q, k, v, block_mask=bad)


def test_ring_refuses_what_it_cannot_serve():
    q, k, v, _ = _inputs(1, 256, 2, 1, 16, F32, "cpu")
    bm = torch.ones(1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="stripe"):
        ringflash.ring_flash_attn(q, k, v, block_mask=bm, layout="stripe")
    q, k, v, _ = _inputs(1, 384, 2, 1, 16, F32, "cpu")
    with pytest.raises(ValueError, match="multiple of the block size"):  # zigzag chunks of 192
        ringflash.ring_flash_attn(q, k, v, block_mask=torch.ones(1, 3, 3, dtype=torch.bool))


def test_local_mask_stops_the_ring_early():
    """A block mask that only looks one chunk back needs 2 of 8 steps on contiguous shards;
    an all-zero mask needs one step that computes nothing."""
    world, n = 8, BLOCK
    local = block_sparse.local_global_block_mask(world * n, local_blocks=2, causal=True)
    occupied = occupied_chunks(local, "contiguous", world, n, BLOCK)
    assert occupied == {(a, c) for a in range(world) for c in (a - 1, a) if c >= 0}
    assert active_steps("contiguous", world, n, (None, 0), occupied) == 2
    assert active_steps("contiguous", world, n, (None, 0)) == world
    assert active_steps("contiguous", world, n, (None, None), frozenset()) == 1
    # block_stripe deals the blocks round-robin: block b = 3 W + r is rank r's; it sees
    # b - 1, rank r - 1's, so each rank's queries need its own shard and the one before
    n = 4 * BLOCK
    local = block_sparse.local_global_block_mask(world * n, local_blocks=2, causal=True)
    occupied = occupied_chunks(local, "block_stripe", world, n, BLOCK)
    assert occupied == {(r, s) for r in range(world) for s in (r, (r - 1) % world)}
    assert active_steps("block_stripe", world, n, (None, 0), occupied) == 2
    diagonal = block_sparse.local_global_block_mask(world * n, local_blocks=1, causal=True)
    assert active_steps("block_stripe", world, n, (None, 0),
                        occupied_chunks(diagonal, "block_stripe", world, n, BLOCK)) == 1


def test_ring_sees_a_mask_changed_in_place():
    """The ring and flash_attn keep what they derive from a block mask (chunk pairs, index
    lists) while the same tensor comes back unmodified; an in-place change must be seen at
    once."""
    q, k, v, _ = _inputs(1, 4 * BLOCK, 2, 1, 16, F32, "cpu", seed=11)
    bm = torch.ones(1, 4, 4, dtype=torch.bool)
    for step in range(3):
        got = ringflash.ring_flash_attn(q, k, v, block_mask=bm, layout="contiguous")
        want = flash_attn(q, k, v, block_mask=bm.clone())
        assert rel_err(got, want) <= 1e-6, step
        assert rel_err(flash_attn(q, k, v, block_mask=bm), want) <= 1e-6, step  # flash_attn's memo too
        bm[:, step + 1, : step + 1] = False  # in place: the version counter moves


def test_strided_mask_is_copied_once():
    """A mask expanded over the heads is copied to contiguous memory once while it returns
    unmodified, so the caches keyed on the copy hold across calls; an in-place change of
    its base gives a fresh copy, and the copy goes with the mask."""
    import gc
    import weakref

    from ringflash.kernels.checks import check_block_mask
    base = torch.ones(1, 4, 4, dtype=torch.bool)
    bm = base.expand(2, 4, 4)
    first = check_block_mask(bm, 2, 4 * BLOCK, 4 * BLOCK, torch.device("cpu"))
    assert first.is_contiguous() and check_block_mask(bm, 2, 4 * BLOCK, 4 * BLOCK, torch.device("cpu")) is first
    base[0, 0, 1] = False  # the view shares its base's version counter
    second = check_block_mask(bm, 2, 4 * BLOCK, 4 * BLOCK, torch.device("cpu"))
    assert second is not first and not second[:, 0, 1].any()
    assert check_block_mask(base, 1, 4 * BLOCK, 4 * BLOCK, torch.device("cpu")) is base
    copy = weakref.ref(second)
    del bm, first, second
    gc.collect()
    assert copy() is None


# ----------------------------------------------------------------------------- the ring


def check_block_sparse_ring(rank, world, layout, seed=0, device="cpu", chunk=BLOCK):
    """Block masks through the ring on ``device`` (CPU: the twin kernels over gloo) against
    the oracle and single-device flash_attn (on the CPU) with the same global mask, chunks
    of ``chunk`` tokens (zigzag: two a rank; block_stripe: two blocks a rank, and no window,
    which it does not take); returns this rank's failures."""
    failures = []
    n = chunk * (1 if layout == "contiguous" else 2)
    seqlen = n * world
    window = (-1, -1) if layout == "block_stripe" else (150, -1)
    configs = [  # (name, mask, causal, window, documents, heads, kv heads, dropout_p)
        ("random", block_sparse.random_block_mask(seqlen, 0.4, seed=seed + 1), False, (-1, -1), None, 2, 1, 0.0),
        ("per-head-causal", block_sparse.random_block_mask(seqlen, 0.5, heads=2, seed=seed + 2),
         True, (-1, -1), None, 2, 2, 0.0),
        ("local-window", block_sparse.local_global_block_mask(seqlen, local_blocks=2), True,
         window, None, 2, 1, 0.0),
        ("documents", block_sparse.strided_block_mask(seqlen, stride=2), True, (-1, -1),
         [[seqlen // 3, 5, seqlen - seqlen // 3 - 5]], 2, 1, 0.0),
        ("dropout-causal", block_sparse.random_block_mask(seqlen, 0.6, seed=seed + 5), True, (-1, -1),
         None, 1, 1, 0.25),  # one head: the twin's Philox is slow (grouped heads: test_ring_masks)
    ]
    for i, (name, bm, causal, window, docs, h, hkv, p) in enumerate(configs):
        gen = torch.Generator().manual_seed(seed + 10 + i)
        q, k, v, dout = (torch.randn(1, seqlen, x, 16, generator=gen) for x in (h, hkv, hkv, h))
        seg = None if docs is None else segments(docs, seqlen)
        local = [ringflash.shard(t.to(device), dim=1, layout=layout).requires_grad_() for t in (q, k, v)]
        kwargs = dict(causal=causal, window_size=window)
        if p:
            kwargs.update(dropout_p=p, seed=500 + i)
        seg_local = None if seg is None else ringflash.shard(seg.to(device), dim=1, layout=layout)
        out, lse = ringflash.ring_flash_attn(*local, return_lse=True, layout=layout, block_mask=bm.to(device),
                                             segment_ids=seg_local, **kwargs)
        out.backward(ringflash.shard(dout.to(device), dim=1, layout=layout))
        got = dict(zip(("out", "lse", "dq", "dk", "dv"),
                       (out.detach(), lse.detach(), *(t.grad for t in local))))
        got = {key: ringflash.unshard(val, dim=2 if key == "lse" else 1, layout=layout).cpu()
               for key, val in got.items()}
        if i % world != rank:
            continue
        # with dropout, the oracle applies the mask that dropout_keep_mask documents
        keep = dropped(ringflash.dropout_keep_mask(kwargs["seed"], p, 1, h, seqlen), p) if p else None
        want = oracle_results(q, k, v, dout, with_blocks(global_mask(seqlen, causal, window, seg), bm, seqlen),
                              keep)
        full = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = flash_attn(*full, return_lse=True, segment_ids=seg, block_mask=bm, **kwargs)
        ref_out.backward(dout)
        single = dict(zip(("out", "lse", "dq", "dk", "dv"),
                          (ref_out.detach(), ref_lse.detach(), *(t.grad for t in full))))
        for key in got:
            err, err_single = rel_err(got[key], want[key]), rel_err(got[key], single[key])
            if not (err <= TOL[F32] and err_single <= TOL[F32]):
                failures.append(f"W={world} {layout} {name}: {key} rel err {err:.3g} vs oracle, "
                                f"{err_single:.3g} vs flash_attn")
    return failures



@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "block_stripe"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"W{w}")
def test_block_sparse_ring_matches_oracle(worlds, world_size, layout):
    per_rank = worlds(world_size).run(check_block_sparse_ring, layout, timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size,layout", [(2, "contiguous"), (2, "zigzag"), (3, "contiguous"),
                                               (4, "block_stripe")],
                         ids=["W2-contiguous", "W2-zigzag", "W3-contiguous", "W4-block_stripe"])
def test_block_sparse_fused_schedule_matches_oracle(worlds, world_size, layout):
    """The same masks through the fused backward schedule (each pair's dQ and dK/dV in one
    call, as the Gluon backward serves block masks on Hopper), on the CPU twin; the ring of
    two over contiguous shards then rotates too, keeping no K/V (``ring.keeps_kv``)."""
    from test_ring_masks import with_fused_backward
    per_rank = worlds(world_size).run(with_fused_backward, check_block_sparse_ring, layout, timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures)


@pytest.mark.world(4)
@pytest.mark.parametrize("fused", [False, True], ids=["two-kernel", "fused"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "block_stripe"])
def test_block_sparse_direct_schedule_matches_oracle(worlds, layout, fused):
    """The same masks over 4 ranks through the direct schedule (RINGFLASH_SCHEDULE=direct),
    with the two-kernel and the fused backward."""
    from test_ring_masks import with_fused_backward, with_schedule
    check = (with_fused_backward, check_block_sparse_ring) if fused else (check_block_sparse_ring,)
    per_rank = worlds(4).run(with_schedule, "direct", *check, layout, timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures)


def test_ring_of_two_keeps_kv_only_where_the_gluon_backward_does_not_serve(monkeypatch):
    """``ring.keeps_kv`` with ``ring.fuses``: on Hopper (capability patched; CPU stand-ins)
    a bf16 head_dim-128 call over shards of whole tiles rotates, fused; segment ids,
    dropout, ``deterministic``, fp16, head_dim 96 or shards of 200 rows keep the other
    rank's K/V, as does any call off Hopper."""
    from ringflash.kernels import dispatch
    from ringflash.ring import fuses, keeps_kv

    def keeps(n=256, d=128, dtype=torch.bfloat16, segments=None, dropout_p=0.0, deterministic=False):
        q, k = torch.zeros(1, n, 4, d, dtype=dtype), torch.zeros(1, n, 2, d, dtype=dtype)
        blocks = torch.ones(1, 4, 4, dtype=torch.bool)
        return keeps_kv("contiguous", 2, True, True, fuses(q, k, segments, blocks, dropout_p, deterministic))

    assert keeps()  # off Hopper: the gathered backward
    monkeypatch.setattr(dispatch, "capability", lambda t: (9, 0))
    assert not keeps()
    ids = torch.zeros(1, 256, dtype=torch.int32)
    for kwargs in (dict(segments=ids), dict(dropout_p=0.1), dict(deterministic=True), dict(dtype=torch.float16),
                   dict(d=96), dict(n=200)):
        assert keeps(**kwargs), kwargs
    assert not keeps_kv("zigzag", 2, True, True, False) and not keeps_kv("contiguous", 3, True, True, False)


@pytest.mark.world(2)
def test_block_sparse_ring_of_two_cuts_its_keys(worlds):
    """Contiguous shards of 2 blocks: the ring of two cuts its dK/dV passes and the trip
    home between them (ring.rows.home_cuts), so each piece's rectangle of the block mask is
    checked too."""
    per_rank = worlds(2).run(check_block_sparse_ring, "contiguous", 0, "cpu", 2 * BLOCK, timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures)


@pytest.mark.world(2)
def test_ranks_must_agree_on_the_block_mask(worlds):
    per_rank = worlds(2).run(_disagree, timeout=120)
    assert all("block_mask" in msg for msg in per_rank), per_rank


def _disagree(rank, world):
    q, k, v, _ = _inputs(1, 2 * BLOCK, 2, 1, 16, F32, "cpu")
    bm = torch.ones(1, 2 * world, 2 * world, dtype=torch.bool)
    bm[0, 0, rank] = False  # the same count of blocks, in different places
    try:
        ringflash.ring_flash_attn(q, k, v, block_mask=bm, layout="zigzag")
    except ValueError as error:
        return str(error)
    return "no error"


def test_ring_memo_lets_the_mask_go():
    """What the ring keeps of a block mask goes when the mask does (no GPU memory held for
    masks that are gone)."""
    import gc
    import weakref

    from ringflash.kernels import masks
    q, k, v, _ = _inputs(1, 2 * BLOCK, 2, 1, 16, F32, "cpu", seed=12)
    bm = torch.ones(1, 2, 2, dtype=torch.bool)
    ringflash.ring_flash_attn(q, k, v, block_mask=bm, layout="contiguous")
    flash_attn(q, k, v, block_mask=bm)
    gone = weakref.ref(bm)
    mine = [slot for slot in masks._MEMO if slot[0] == id(bm)]
    assert len(mine) == 2  # the ring's plan (a ring of one runs no rank check) and flash_attn's Blocks
    del bm
    gc.collect()
    assert gone() is None and not any(slot in masks._MEMO for slot in mine)


def test_layer_takes_a_block_mask():
    """RingSelfAttention passes block_mask to the ring: all-True is the dense layer, and a
    local mask changes the output of the blocks it removes only."""
    torch.manual_seed(0)
    layer = ringflash.RingSelfAttention(32, 2, causal=True, layout="contiguous")
    x = torch.randn(1, 3 * BLOCK, 32)
    dense = layer(x)
    assert rel_err(layer(x, block_mask=torch.ones(1, 3, 3, dtype=torch.bool)), dense) <= 1e-6
    local = layer(x, block_mask=torch.eye(3, dtype=torch.bool)[None])
    assert rel_err(local[:, :BLOCK], dense[:, :BLOCK]) <= 1e-6  # block 0 sees only itself anyway
    assert rel_err(local[:, BLOCK:], dense[:, BLOCK:]) > 1e-3


@pytest.mark.parametrize("impl", ["twin", "triton"])
def test_block_mask_with_dropout(impl, monkeypatch):
    """Dropout inside the computed blocks: the same keep bits as without a block mask.
    (The interpreter: one head and a shared mask; dropout under a per-head mask is
    test_kernels' test_backward_reads_a_sequence_joined_from_two_tensors.)"""
    device = _impl(impl, monkeypatch)
    h = 2 if impl == "twin" else 1
    q, k, v, dout = _inputs(1, SEQLEN, h, 1, 16, F32, device, seed=13)
    if impl == "twin":
        bm = _mask_of("per-head", h)
    else:  # the diagonal and one block below it (the last block's 44 rows)
        bm = torch.eye(3, dtype=torch.bool)[None]
        bm[:, 2, 0] = True
    p, seed = 0.2, 77
    out, _, dq, dk, dv = _run_flash_attn(q, k, v, dout, causal=True, block_mask=bm.to(device),
                                         dropout_p=p, seed=seed)
    mask = with_blocks(global_mask(SEQLEN, True), bm, SEQLEN).to(device)
    want = oracle_results(q, k, v, dout, mask, dropped(ringflash.dropout_keep_mask(seed, p, 1, h, SEQLEN), p))
    for key, a in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv)):
        err = rel_err(a, want[key])
        assert err <= TOL[F32], f"{impl}: {key} rel err {err:.3g}"
