"""Masks on one device: segment ids (packed documents, padding) and sliding windows, in the
PyTorch twin and the Triton kernels (interpreted on CPUs), against the float64 oracle
with the full boolean mask written from docs/design.md's definitions (oracle.global_mask).

Outputs are NaN-filled first where the kernels write into given buffers; every case
checks out, lse, dq, dk, dv, and that rows seeing nothing get out 0, lse -inf and zero
gradients.
"""

import math

import pytest
import torch
from oracle import F16, F32, TOL, attention_oracle, global_mask, oracle_grads, rel_err

from ringflash.kernels import PairMask, attn_delta, dispatch, flash_attn, flash_attn_bwd, flash_attn_fwd, masks
from ringflash.kernels import triton as triton_kernels
from ringflash.kernels.triton import segments as triton_segments
from ringflash.kernels.masks import pair_positions

HAS_CUDA = torch.cuda.is_available()


def segments(batch_lengths, seqlen):
    """(B, seqlen) int ids from per-row lists of document lengths; a length given as a
    negative number is that much padding (-1). Rows are filled with padding at the end."""
    rows = []
    for lengths in batch_lengths:
        ids, doc = [], 0
        for n in lengths:
            if n < 0:
                ids += [-1] * -n
            else:
                ids += [doc] * n
                doc += 1
        ids += [-1] * (seqlen - len(ids))
        assert len(ids) == seqlen, (lengths, seqlen)
        rows.append(ids)
    return torch.tensor(rows, dtype=torch.int64)


SEQLEN = 77  # not a multiple of any tile: every kernel's bounds are exercised
DOCS = {
    "one-doc": [[SEQLEN]],
    "docs": [[1, 20, 1, 30, 25]],
    "docs-pad-end": [[10, 33, 3, -31]],
    "pad-front-mid": [[-5, 12, -9, 40, 11]],
    "all-pad": [[-SEQLEN]],
    "batch2": [[40, 37], [-3, 1, 1, 50, -22]],
}
WINDOWS = [(-1, -1), (0, 0), (5, -1), (-1, 3), (16, 16), (100, 100), (1, 33)]


def _impl(name, monkeypatch):
    """Device of implementation ``name``; routes CPU tensors to Triton's interpreter."""
    if name == "triton":
        if not HAS_CUDA:
            monkeypatch.setattr(dispatch, "backend", lambda t: triton_kernels)
        return "cuda" if HAS_CUDA else "cpu"
    return "cpu"


def _inputs(b, s, h, hkv, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, s, n, d, generator=gen) for n in (h, hkv, hkv, h))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def _check(q, k, v, dout, mask, dtype, got, label):
    """Compare (out, lse, dq, dk, dv) with the oracle under ``mask``; rows seeing nothing
    must be exactly zero (out, dq) with lse -inf."""
    out, lse, dq, dk, dv = got
    want_out, want_lse = attention_oracle(q, k, v, mask=mask)
    want = (want_out, want_lse, *oracle_grads(q, k, v, dout, mask=mask))
    tol = TOL[dtype]
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want):
        err = rel_err(a, w)
        assert err <= tol, f"{label}: {name} rel err {err:.3g} > {tol:g}"
    if mask is not None:
        blind = ~mask.any(dim=-1)  # (Sq,) or (B, Sq)
        blind = blind.expand(q.shape[0], -1) if blind.dim() == 1 else blind
        if blind.any():
            assert torch.isneginf(lse.transpose(1, 2)[blind.to(lse.device)]).all(), label
            assert (out[blind.to(out.device)] == 0).all(), label
            assert (dq[blind.to(dq.device)] == 0).all(), label


def _run_flash_attn(q, k, v, dout, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attn(q, k, v, return_lse=True, **kwargs)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("impl", ["twin", "triton"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("docs", list(DOCS), ids=list(DOCS))
def test_segment_ids(impl, causal, docs, monkeypatch):
    device = _impl(impl, monkeypatch)
    seg = segments(DOCS[docs], SEQLEN)
    b = seg.shape[0]
    dtype = F32
    q, k, v, dout = _inputs(b, SEQLEN, 2, 1, 16, dtype, device)
    got = _run_flash_attn(q, k, v, dout, causal=causal, segment_ids=seg.to(device))
    _check(q, k, v, dout, global_mask(SEQLEN, causal, segment_ids=seg), dtype, got,
           f"{impl} {docs} causal={causal}")


@pytest.mark.parametrize("impl", ["twin", "triton"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"win{w[0]}_{w[1]}")
def test_window(impl, causal, window, monkeypatch):
    device = _impl(impl, monkeypatch)
    dtype = F16 if impl == "triton" else F32
    q, k, v, dout = _inputs(1, SEQLEN, 2, 1, 32, dtype, device, seed=1)
    got = _run_flash_attn(q, k, v, dout, causal=causal, window_size=window)
    _check(q, k, v, dout, global_mask(SEQLEN, causal, window), dtype, got,
           f"{impl} window={window} causal={causal}")


@pytest.mark.parametrize("impl", ["twin", "triton"])
def test_window_and_documents(impl, monkeypatch):
    device = _impl(impl, monkeypatch)
    seg = segments(DOCS["pad-front-mid"], SEQLEN)
    q, k, v, dout = _inputs(1, SEQLEN, 4, 1, 16, F32, device, seed=2)
    got = _run_flash_attn(q, k, v, dout, causal=True, window_size=(7, -1), segment_ids=seg.to(device))
    _check(q, k, v, dout, global_mask(SEQLEN, True, (7, -1), seg), F32, got, f"{impl} window+docs")


def test_wide_window_is_no_window():
    q, k, v, dout = _inputs(1, SEQLEN, 2, 2, 16, F32, "cpu", seed=3)
    for causal in (False, True):
        plain = _run_flash_attn(q, k, v, dout, causal=causal)
        wide = _run_flash_attn(q, k, v, dout, causal=causal, window_size=(SEQLEN, SEQLEN))
        for a, b in zip(plain, wide):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_one_document_is_no_mask():
    q, k, v, dout = _inputs(2, SEQLEN, 2, 2, 16, F32, "cpu", seed=4)
    plain = _run_flash_attn(q, k, v, dout, causal=True)
    one = _run_flash_attn(q, k, v, dout, causal=True, segment_ids=torch.zeros(2, SEQLEN, dtype=torch.int32))
    for a, b in zip(plain, one):
        assert rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("impl", ["twin", "triton"])
@pytest.mark.parametrize("band", [(-3, 4), (-40, -20), (10, 200), (None, -30), (-200, -100), (5, 2)],
                         ids=str)
def test_pair_band(impl, band, monkeypatch):
    """The per-block entry points with a raw band of local indices (what the ring passes),
    Sq != Sk, accumulating into NaN-free running buffers, including bands that see
    nothing at all (lo > hi, or entirely outside the keys)."""
    device = _impl(impl, monkeypatch)
    sq, sk = 45, 70
    q, k, v, dout = _inputs(1, max(sq, sk), 2, 1, 16, F32, device, seed=5)
    q, dout = q[:, :sq], dout[:, :sq]
    k, v = k[:, :sk], v[:, :sk]
    mask = PairMask(*band)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    dense = torch.ones(sq, sk, dtype=torch.bool)
    if band[0] is not None:
        dense &= j - i >= band[0]
    if band[1] is not None:
        dense &= j - i <= band[1]
    _check_pair(q, k, v, dout, mask, dense, f"{impl} band={band}")


def _check_pair(q, k, v, dout, mask, dense, label):
    """The per-block entry points under ``mask`` (into NaN-filled buffers) against the
    oracle under the dense mask."""
    kw = dict(softmax_scale=16 ** -0.5, mask=mask)
    out, lse = flash_attn_fwd(q, k, v, out=torch.full(q.shape, math.nan, device=q.device),
                              lse=torch.full((q.shape[0], q.shape[2], q.shape[1]), math.nan,
                                             device=q.device), **kw)
    grads = [torch.full(t.shape, math.nan, device=q.device) for t in (q, k, v)]
    flash_attn_bwd(dout, q, k, v, lse, attn_delta(out, dout), *grads, **kw)
    _check(q, k, v, dout, dense, F32, (out, lse, *grads), label)


@pytest.mark.parametrize("impl", ["twin", "triton"])
@pytest.mark.parametrize("pos, band, docs", [
    ((128, 0, 1, 128), (None, 0), False),     # block_stripe, W = 2: rank 1's queries, rank 0's keys
    ((0, 256, 1, 256), (None, 0), True),      # W = 3: rank 0's queries, rank 2's keys
    ((256, 0, 1, 256), (-300, 0), True),      # W = 3, a causal window across blocks
    ((0, 128, 1, 128), (-200, 70), False),    # a window both ways
    ((128, 0, 1, 128), (-400, -150), False),  # keys only well behind
    ((3, 0, 2, 0), (-40, 9), False),          # evenly spaced rows (stride 2, no jump)
], ids=str)
def test_band_on_positions(impl, pos, band, docs, monkeypatch):
    """A band on the pair's global positions (PairMask.band_on_positions: the block_stripe
    layout, whose local rows jump by (W - 1) * 128 positions every 128 rows), Sq != Sk, with
    and without segment ids, against the oracle under the dense mask."""
    device = _impl(impl, monkeypatch)
    sq, sk = 200, 170  # a jump in the rows and in the columns, the last runs ragged
    heads = (2, 1) if impl == "twin" else (1, 1)  # the interpreter: one head (GQA: test_segment_ids)
    q, k, v, dout = _inputs(1, max(sq, sk), *heads, 16, F32, device, seed=6)
    q, dout = q[:, :sq], dout[:, :sq]
    k, v = k[:, :sk], v[:, :sk]
    qp, kp = pair_positions(pos, torch.arange(sq), torch.arange(sk))
    diff = kp[None, :] - qp[:, None]
    dense = diff <= band[1]
    if band[0] is not None:
        dense &= diff >= band[0]
    seg = None
    if docs:
        ids = segments([[90, 2, 80]], sq)
        seg = (ids.to(torch.int32).to(device), ids[:, :sk].to(torch.int32).to(device))
        dense &= (ids[0, :, None] == ids[0, None, :sk]) & (ids[0, :, None] >= 0)
    assert dense.any() and not dense.all()
    mask = PairMask(*band, *(seg or (None, None)), pos=pos, band_on_positions=True)
    _check_pair(q, k, v, dout, mask, dense, f"{impl} pos={pos} band={band} docs={docs}")


@pytest.mark.parametrize("pos, on_positions", [
    ((128, 0, 1, 128), True), ((0, 384, 1, 384), True), ((3, 1, 4, 0), True), ((0, 0, 1, 0), False)],
    ids=str)
@pytest.mark.parametrize("band", [(None, 0), (-300, 0), (-200, 70), (-400, -150), (5, None)], ids=str)
def test_band_interval_is_the_band(pos, on_positions, band):
    """masks.band_interval, the kernels' per-row interval in torch ops, read either way
    (query rows, or key rows: transposed) is exactly the set ``visible`` keeps."""
    mask = PairMask(*band, pos=pos, band_on_positions=on_positions)
    sq, sk = 300, 270
    want = masks.visible(torch.arange(sq), torch.arange(sk), mask)
    for rows, n_cols, ok in ((sq, sk, want), (sk, sq, want.T)):
        first, stop = masks.band_interval(torch.arange(rows), mask, n_cols, transposed=ok is not want)
        cols = torch.arange(n_cols)[None, :]
        assert torch.equal((cols >= first[:, None]) & (cols < stop[:, None]), ok), (pos, band)


@pytest.mark.parametrize("bad, error, match", [
    (torch.zeros(1, SEQLEN), TypeError, "integer"),
    (torch.zeros(2, SEQLEN, dtype=torch.int64), ValueError, "shape"),
    (torch.zeros(1, SEQLEN - 1, dtype=torch.int64), ValueError, "shape"),
    (torch.full((1, SEQLEN), -2), ValueError, ">= -1"),
    (torch.tensor([[1] * 40 + [0] * (SEQLEN - 40)]), ValueError, "decrease"),
    # would wrap to 0 in int32 and join the first document
    (torch.tensor([[0] * 40 + [2 ** 32] * (SEQLEN - 40)]), ValueError, "int32"),
    ([0] * SEQLEN, TypeError, "Tensor"),
], ids=["float", "batch", "seqlen", "below-1", "decreasing", "past-int32", "list"])
def test_bad_segment_ids(bad, error, match):
    q, k, v, _ = _inputs(1, SEQLEN, 2, 2, 16, F32, "cpu")
    with pytest.raises(error, match=match):
        flash_attn(q, k, v, segment_ids=bad)


@pytest.mark.parametrize("impl", ["twin", "triton"])
def test_window_past_any_sequence_is_unbounded(impl, monkeypatch):
    """A side of 2**30 tokens or more is -1 (unbounded): the kernels' band arithmetic is
    int32, and a window of 2**31 - 1 used to wrap there (dK/dV all zero under causal)."""
    device = _impl(impl, monkeypatch)
    q, k, v, dout = _inputs(1, 40, 2, 1, 16, F32, device, seed=5)
    for causal, huge, same in ((True, (2 ** 31 - 1, 0), (-1, 0)), (False, (0, 2 ** 31 - 1), (0, -1)),
                               (False, (10 ** 30, 2 ** 30), (-1, -1))):
        want = _run_flash_attn(q, k, v, dout, causal=causal, window_size=same)
        got = _run_flash_attn(q, k, v, dout, causal=causal, window_size=huge)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (causal, huge)


@pytest.mark.parametrize("bad, error", [((-2, 0), ValueError), ((0,), TypeError), (5, TypeError),
                                        ((1.0, 2), TypeError), ((0, -3), ValueError)], ids=str)
def test_bad_window(bad, error):
    q, k, v, _ = _inputs(1, 8, 2, 2, 16, F32, "cpu")
    with pytest.raises(error, match="window_size"):
        flash_attn(q, k, v, window_size=bad)


@pytest.mark.parametrize("impl", ["twin", "triton"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padding_inside_a_document(impl, causal, monkeypatch):
    """Padding between a document's tokens is allowed; the kernels' per-row intervals hold
    it, so only the per-column id test keeps it out (``holes``)."""
    device = _impl(impl, monkeypatch)
    ids = [0] * 10 + [-1] * 5 + [0] * 20 + [1] * 7 + [-1] * 3 + [1] * 20 + [2] * 12
    seg = torch.tensor([ids])
    q, k, v, dout = _inputs(1, SEQLEN, 2, 1, 16, F32, device)
    got = _run_flash_attn(q, k, v, dout, causal=causal, segment_ids=seg.to(device))
    _check(q, k, v, dout, global_mask(SEQLEN, causal, segment_ids=seg), F32, got,
           f"{impl} mid-document padding causal={causal}")


def test_no_double_backward():
    q, k, v, _ = (t.requires_grad_() for t in _inputs(1, 8, 1, 1, 16, F32, "cpu"))
    out = flash_attn(q, k, v)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(out.sum(), (q,), create_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["documents", "window", "window+documents", "padding"])
def test_gpu_masks_at_scale(case):
    """bf16 at 3000 tokens on the GPU's own tiles, GQA: the Triton kernels against the
    oracle (fp64 on the GPU) and within 2x of torch's SDPA error with the same mask."""
    torch.manual_seed(0)
    s, h, hkv, d = 3000, 8, 2, 128
    lengths = [700, 1, 1, 300, 1500, 498]
    seg = segments([lengths], s) if "documents" in case else None
    if case == "padding":
        seg = segments([[-100, 1200, 1000, -700]], s)
    window = (256, -1) if "window" in case else (-1, -1)
    q, k, v, dout = _inputs(1, s, h, hkv, d, torch.bfloat16, "cuda")
    got = _run_flash_attn(q, k, v, dout, causal=True, window_size=window,
                          segment_ids=None if seg is None else seg.cuda())
    mask = global_mask(s, True, window, seg).cuda()
    want_out, want_lse = attention_oracle(q, k, v, mask=mask)
    want = (want_out, want_lse, *oracle_grads(q, k, v, dout, mask=mask))
    # torch's own bf16 attention with the same boolean mask, rows that see nothing left out
    rows = mask.any(-1)[0] if mask.dim() == 3 else mask.any(-1)
    qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    m = mask[0] if mask.dim() == 3 else mask
    o = torch.nn.functional.scaled_dot_product_attention(
        qs[:, :, rows], ks.repeat_interleave(h // hkv, 1), vs.repeat_interleave(h // hkv, 1),
        attn_mask=m[rows])
    o.backward(dout.transpose(1, 2)[:, :, rows])
    theirs = {"out": o.detach().transpose(1, 2), "dq": qs.grad.transpose(1, 2)[:, rows]}
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        err = rel_err(a, w)
        assert err <= 2e-2, f"{case}: {name} rel err {err:.3g}"
        if name in theirs:
            ref = rel_err(theirs[name], w[:, rows])
            assert rel_err(a[:, rows], w[:, rows]) <= max(2 * ref, 1e-3), f"{case}: {name} {err:.3g} vs torch {ref:.3g}"


def test_deterministic_keyword():
    """deterministic is accepted (the backward is deterministic anyway: same bits twice)."""
    q, k, v, dout = _inputs(1, 40, 2, 1, 16, F32, "cpu")
    runs = [_run_flash_attn(q, k, v, dout, causal=True, deterministic=True) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="deterministic"):
        flash_attn(q, k, v, deterministic=1)
    import ringflash
    with pytest.raises(TypeError, match="deterministic"):
        ringflash.ring_flash_attn(q, k, v, deterministic=1)


def test_zero_heads_are_named():
    q = torch.randn(1, 8, 0, 16)
    k = torch.randn(1, 8, 1, 16)
    with pytest.raises(ValueError, match="heads must be at least 1"):
        flash_attn(q, k, k)


def _monotone_ids(gen, batch, n, pad):
    """(batch, n) int32 ids that never decrease apart from padding (-1) scattered at rate
    ``pad``: documents of random lengths, some ids skipped."""
    ids = torch.cumsum(torch.randint(0, 3, (batch, n), generator=gen) * (torch.rand(batch, n, generator=gen) < 0.15), 1)
    return torch.where(torch.rand(batch, n, generator=gen) < pad, -1, ids).int()


@pytest.mark.parametrize("pad", [0.0, 0.1, 0.6])
@pytest.mark.parametrize("n_rows,n_cols", [(50, 77), (77, 50), (130, 130), (1, 9)])
def test_segment_ranges_kernel_matches_definition(pad, n_rows, n_cols):
    """The two-launch Triton segment_ranges equals masks.segment_ranges (torch ops), rows
    and columns drawn apart (ids on one side the other lacks), padding inside documents."""
    gen = torch.Generator().manual_seed(n_rows * 1000 + n_cols + int(pad * 10))
    rows, cols = _monotone_ids(gen, 2, n_rows, pad), _monotone_ids(gen, 2, n_cols, pad)
    device = "cuda" if HAS_CUDA else "cpu"
    got = triton_kernels.segment_ranges(rows.to(device), cols.to(device)).cpu()
    assert torch.equal(got, masks.segment_ranges(rows, cols))
    same = triton_kernels.segment_ranges(cols.to(device), cols.to(device)).cpu()
    assert torch.equal(same, masks.segment_ranges(cols, cols))


@pytest.mark.parametrize("pad", [0.0, 0.1, 0.6])
@pytest.mark.parametrize("n_rows,n_cols,cols_block", [(1024, 768, 128), (768, 1024, 64), (512, 512, 128)])
def test_segment_tiles_kernel_matches_definition(pad, n_rows, n_cols, cols_block):
    """The one-launch Triton segment_tiles (the Gluon kernels' tile bounds on a GPU) equals
    masks.segment_tiles (torch ops), over the ranges of ids drawn apart on each side."""
    gen = torch.Generator().manual_seed(n_rows + n_cols + int(pad * 10))
    rows, cols = _monotone_ids(gen, 2, n_rows, pad), _monotone_ids(gen, 2, n_cols, pad)
    # and documents of 200-700 tokens on both sides, whose tiles hold whole runs (u0 < u1),
    # the last tokens padding
    lengths = torch.randint(200, 700, (64,), generator=gen)
    docs = torch.repeat_interleave(torch.arange(64), lengths)[:max(n_rows, n_cols)].int()
    docs[len(docs) - int(pad * len(docs) / 2):] = -1
    docs = docs.expand(2, -1)
    device = "cuda" if HAS_CUDA else "cpu"
    for r, c in ((rows, cols), (docs[:, :n_rows], docs[:, :n_cols])):
        ranges = masks.segment_ranges(r, c)
        want = masks.segment_tiles(ranges, n_cols, cols_block=cols_block)
        got = triton_segments.segment_tiles(ranges.to(device), n_cols, masks.BLOCK, cols_block).cpu()
        assert torch.equal(got, want)
    assert bool((want[..., 2] > want[..., 1]).any()), "some tile inside one run of columns"


def test_segment_ranges_once_per_tensor(monkeypatch):
    """flash_attn's three kernels share one tensor of segment ids on both sides: its ranges
    are computed once, kept while the tensor lives unmodified, and recomputed after an
    in-place change."""
    device = _impl("triton", monkeypatch)
    calls = []
    real = triton_segments.segment_ranges
    monkeypatch.setattr(triton_segments, "segment_ranges", lambda r, c: calls.append(1) or real(r, c))
    q, k, v, dout = _inputs(1, 40, 2, 2, 16, F32, device)
    ids = segments([[15, 25]], 40).to(device)
    for _ in range(2):
        qq = q.clone().requires_grad_()
        flash_attn(qq, k, v, causal=True, segment_ids=ids).backward(dout)
    assert len(calls) == 1
    ids[0, 20:] = 2  # in place: the documents changed
    flash_attn(q, k, v, causal=True, segment_ids=ids)
    assert len(calls) == 2
