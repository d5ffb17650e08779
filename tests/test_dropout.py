"""Attention dropout: the generator (Triton's Philox against its PyTorch twin, bit for bit),
the keep rate, and flash_attn with dropout against the float64 oracle applied with the
mask from ``dropout_keep_mask``, in the twin and the Triton kernels (interpreted on CPUs).
The ring with dropout is checked in test_ring_masks.py."""

import math

import pytest
import torch
import triton
import triton.language as tl
from oracle import F16, F32, TOL, global_mask, oracle_results, rel_err

from test_masks import _impl

from ringflash.kernels import (PairMask, attn_delta, dropout, dropout_keep_mask, flash_attn, flash_attn_bwd,
                               flash_attn_fwd)
from ringflash.kernels import triton as triton_kernels
from ringflash.kernels.triton import config, tiles
from ringflash.kernels.masks import pair_positions

HAS_CUDA = torch.cuda.is_available()


def dropped(keep, p):
    """The oracle's ``dropped`` for a keep mask applied at rate p (kernels/dropout.py's
    rounding): the kept probabilities scaled by keep_scale(p)."""
    return keep, dropout.keep_scale(p)


@triton.jit
def _keep_kernel(OUT, drop, q_pos0, k_pos0, stride, SQ: tl.constexpr, SK: tl.constexpr, GROUPED: tl.constexpr,
                 KEYS_MAJOR: tl.constexpr):
    """The kernels' keep decisions of one (batch 1, head 2) tile, written out as int8
    (``drop``: the kernels' ``tiles.Dropout`` record, as a launch passes it)."""
    rows = tl.arange(0, SQ)
    cols = tl.arange(0, SK)
    keep = tiles._keep(drop, tl.program_id(0) * 0 + 1, tl.program_id(0) * 0 + 2, q_pos0 + rows * stride,
                       k_pos0, k_pos0 + cols * stride, SQ, SK, GROUPED, KEYS_MAJOR)
    tl.store(OUT + rows[:, None] * SK + cols[None, :], keep.to(tl.int8))


@pytest.mark.parametrize("grouped, q0, k0, stride", [(True, 0, 0, 1), (True, 48, 1024, 1),
                                                      (False, 5, 3, 1), (False, 2, 7, 4)],
                         ids=["grouped", "grouped-offset", "unaligned", "strided"])
@pytest.mark.parametrize("keys_major", [False, True], ids=["q-major", "k-major"])
def test_triton_keep_bits_equal_the_twin(grouped, q0, k0, stride, keys_major):
    device = "cuda" if HAS_CUDA else "cpu"
    p, seed, sq, sk = 0.3, 2 ** 40 + 12345, 32, 64
    out = torch.empty(sq, sk, dtype=torch.int8, device=device)
    drop = tiles.Dropout(seed, dropout.threshold(p), dropout.keep_scale(p))
    _keep_kernel[(1,)](out, drop, q0, k0, stride, sq, sk, grouped, keys_major)
    want = dropout_keep_mask(seed, p, 2, 3, sq, sk, q_positions=q0 + torch.arange(sq) * stride,
                             k_positions=k0 + torch.arange(sk) * stride)[1, 2]
    assert torch.equal(out.cpu().bool(), want)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate(p):
    keep = dropout_keep_mask(7, p, 2, 4, 128, 256)
    n = keep.numel()
    rate = keep.float().mean().item()
    expected = 1 - dropout.applied_rate(p)
    assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / n), (rate, expected)


def test_bytes_are_independent():
    """Each of a call's 16 bytes keeps at the rate, and elements that share a call (or sit
    next to each other) agree no more often than independent coin flips."""
    keep = dropout_keep_mask(3, 0.5, 1, 2, 256, 512).float()
    q, k = torch.arange(256)[:, None], torch.arange(512)[None, :]
    slot = ((k & 1) | (k >> 2) & 2 | (k >> 2) & 4 | q & 8).expand_as(keep[0, 0])
    for s in range(16):
        rate = keep[..., slot == s].mean().item()
        assert abs(rate - 0.5) < 5 * math.sqrt(0.25 / keep[..., slot == s].numel()), (s, rate)
    for dq, dk in [(0, 1), (0, 8), (0, 16), (0, 2), (8, 0), (1, 0), (8, 1)]:
        a = keep[..., dq:, dk:]
        b = keep[..., :keep.shape[2] - dq, :keep.shape[3] - dk]
        agree = (a == b).float().mean().item()
        assert abs(agree - 0.5) < 5 * math.sqrt(0.25 / a.numel()), (dq, dk, agree)


@pytest.mark.parametrize("p, t", [(0.0, 0), (0.1, 26), (0.5, 128), (0.999, 255), (1e-3, 0)])
def test_rate_is_rounded_to_256ths(p, t):
    """The kernels drop a byte below round(256 p) (at most 255): the applied rate is that
    over 256, and kept probabilities are scaled by its complement."""
    assert dropout.threshold(p) == t
    assert dropout.applied_rate(p) == t / 256
    assert dropout.keep_scale(p) == 256 / (256 - t)


def test_seeds_and_positions():
    a = dropout_keep_mask(1, 0.5, 1, 2, 64)
    assert torch.equal(a, dropout_keep_mask(1, 0.5, 1, 2, 64)), "same seed, same bits"
    assert not torch.equal(a, dropout_keep_mask(2, 0.5, 1, 2, 64)), "another seed, other bits"
    assert not torch.equal(a[0, 0], a[0, 1]), "heads draw apart"
    # a sub-block at given positions is the same bits as the block of the full mask
    part = dropout_keep_mask(1, 0.5, 1, 2, 8, 16, q_positions=torch.arange(40, 48),
                             k_positions=torch.arange(3, 64, 4)[:16])
    assert torch.equal(part, a[:, :, 40:48, 3::4][..., :16])


@pytest.mark.parametrize("impl", ["twin", "triton"])
@pytest.mark.parametrize("case", ["full", "causal", "docs+window"])
def test_flash_attn_dropout_matches_oracle(impl, case, monkeypatch):
    device = _impl(impl, monkeypatch)
    dtype = F16 if impl == "triton" else F32
    b, s, h, hkv, d, p, seed = 2, 70, 2, 1, 16, 0.25, 99
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, n, d, generator=gen).to(dtype) for n in (h, hkv, hkv, h))
    kw, mask = {}, None
    if case == "causal":
        kw, mask = dict(causal=True), global_mask(s, True)
    if case == "docs+window":
        seg = torch.tensor([[0] * 30 + [1] * 40, [0] * 5 + [1] * 50 + [-1] * 15])
        kw = dict(causal=True, window_size=(9, -1), segment_ids=seg.to(device))
        mask = global_mask(s, True, (9, -1), seg)
    qd, kd, vd = (t.to(device).requires_grad_() for t in (q, k, v))
    out, lse = flash_attn(qd, kd, vd, dropout_p=p, seed=seed, return_lse=True, **kw)
    out.backward(dout.to(device))
    want = oracle_results(q, k, v, dout, mask, dropped(dropout_keep_mask(seed, p, b, h, s), p))
    for name, got in zip(want, (out, lse, qd.grad, kd.grad, vd.grad)):
        err = rel_err(got.cpu(), want[name])
        assert err <= TOL[dtype], f"{impl} {case}: {name} rel err {err:.3g}"


POSITION_CASES = [
    ((128, 0, 1, 128), (0, True)),    # block_stripe, W = 2: rank 1's queries, rank 0's keys
    ((0, 256, 1, 256), (0, True)),    # W = 3: rank 0's queries, rank 2's keys (strictly before)
    ((256, 256, 1, 256), (0, False)),  # W = 3, the own shard: plain causal
    ((5, 3, 1, 128), (None, False)),  # unaligned runs: one Philox call per element
]


# The interpreter skips W = 3's band on positions: W = 2's takes the same path.
@pytest.mark.parametrize("impl, pos, band", [
    pytest.param(impl, pos, band, id=f"{pos}-{band}-{impl}") for pos, band in POSITION_CASES
    for impl in ("twin", "triton") if impl == "twin" or pos != (0, 256, 1, 256)])
def test_pair_positions_in_runs_of_blocks(impl, pos, band, monkeypatch):
    """A pair whose rows are runs of 128 positions ``jump`` apart (PairMask.pos, the
    block_stripe layout) drops what ``dropout_keep_mask`` gives at those positions, in the
    per-pair entry points of both implementations, forward and backward. One head (the
    heads' bits are apart in test_flash_attn_dropout_matches_oracle): the interpreter
    draws every bit in numpy."""
    device = _impl(impl, monkeypatch)
    b, s, h, hkv, d, p, seed = 1, 160, 1, 1, 16, 0.3, 7  # a run of 128 rows, then 32 after the jump
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(b, s, n, d, generator=gen) for n in (h, hkv, hkv, h))
    hi, on_positions = band
    dense = None
    if hi is not None:
        qp, kp = pair_positions(pos, torch.arange(s), torch.arange(s)) if on_positions else (
            torch.arange(s), torch.arange(s))
        dense = kp[None, :] - qp[:, None] <= hi
    mask = PairMask(band_hi=hi, dropout_p=p, seed=seed, pos=pos, band_on_positions=on_positions)
    qd, kd, vd, dod = (t.to(device) for t in (q, k, v, dout))
    kw = dict(softmax_scale=d ** -0.5, mask=mask)
    out, lse = flash_attn_fwd(qd, kd, vd, **kw)
    grads = [torch.zeros(t.shape, device=device) for t in (qd, kd, vd)]
    flash_attn_bwd(dod, qd, kd, vd, lse, attn_delta(out, dod), *grads, **kw)
    qpos, kpos = pair_positions(pos, torch.arange(s), torch.arange(s))
    assert int(qpos[128] - qpos[127]) == 1 + pos[3]  # the rows really jump
    keep = dropout_keep_mask(seed, p, b, h, s, q_positions=qpos, k_positions=kpos)
    want = oracle_results(q, k, v, dout, dense, dropped(keep, p))
    for name, got in zip(want, (out, lse, *grads)):
        err = rel_err(got.cpu(), want[name])
        assert err <= TOL[F32], f"{impl} pos={pos}: {name} rel err {err:.3g}"


@pytest.mark.parametrize("p, causal", [(0.3, False), (0.3, True), (0.0, True)], ids=str)
def test_dkdv_tile_orientations_agree(p, causal, monkeypatch):
    """The dK/dV kernel's scores keys by queries or queries by keys (QUERY_MAJOR, which
    bwd_config takes under dropout with no other mask) give the same dk and dv."""
    device = _impl("triton", monkeypatch)
    dtype = F16 if device == "cuda" else F32
    b, s, h, hkv, d = (1, 64, 2, 1, 16) if device == "cpu" else (1, 128, 2, 1, 128)  # several tiles either way
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(b, s, n, d, generator=gen).to(device, dtype) for n in (h, hkv, hkv, h))
    mask = PairMask(band_hi=0 if causal else None, dropout_p=p, seed=11, pos=(0, 0, 1, 0))
    kw = dict(softmax_scale=d ** -0.5, mask=mask, accumulate=False)
    out, lse = torch.empty_like(q), torch.empty(b, h, s, device=device)
    triton_kernels.fwd(q, k, v, out, lse, **kw)
    delta = attn_delta(out, dout)
    assert config.bwd_config(d, dtype, False, True)[0].get("QUERY_MAJOR") is True
    assert not config.bwd_config(d, dtype, False, False)[0].get("QUERY_MAJOR")
    tiles_of, grads = config.bwd_config, []
    for query_major in (False, True):
        monkeypatch.setattr(config, "bwd_config", lambda *a, qm=query_major: (
            dict(tiles_of(*a)[0], QUERY_MAJOR=qm), tiles_of(*a)[1]))
        dk, dv = (torch.zeros(t.shape, device=device) for t in (k, v))
        triton_kernels.bwd(dout, q, k, v, lse, delta, None, dk, dv, **kw)
        grads.append((dk, dv))
    for a, w in zip(*grads):
        assert a.abs().sum() > 0
        assert rel_err(a.cpu(), w.cpu()) <= 1e-6


def test_p_zero_is_no_dropout():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 33, 2, 16, generator=gen) for _ in range(3))
    assert torch.equal(flash_attn(q, k, v, dropout_p=0.0, seed=4), flash_attn(q, k, v))


@pytest.mark.parametrize("p, seed, error", [(1.0, 1, ValueError), (-0.1, 1, ValueError),
                                             ("0.1", 1, TypeError), (0.1, 1.5, TypeError),
                                             (0.1, -1, ValueError), (0.1, 2 ** 63, ValueError)],
                         ids=str)
def test_bad_dropout_arguments(p, seed, error):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(error, match="dropout_p|seed"):
        flash_attn(q, q, q, dropout_p=p, seed=seed)
    with pytest.raises(error, match="dropout_p|seed"):  # the helper refuses what the kernels do
        dropout_keep_mask(seed, p, 1, 2, 8)


def test_keep_mask_positions_must_match_lengths():
    with pytest.raises(ValueError, match="q_positions"):
        dropout_keep_mask(1, 0.1, 1, 2, 8, q_positions=torch.arange(4))
    with pytest.raises(TypeError, match="seed"):
        dropout_keep_mask(None, 0.1, 1, 2, 8)


@pytest.mark.parametrize("impl", ["twin", "triton"])
def test_dropout_merged_over_key_ranges_is_one_call(impl, monkeypatch):
    """The ring's forward under dropout: two key ranges merged into a running fp32 (out,
    lse), each keyed by its own positions, equal one call over all keys with the same seed."""
    device = _impl(impl, monkeypatch)
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 96, 2, 16, generator=gen).to(device) for _ in range(3))
    drop = dict(dropout_p=0.3, seed=21)
    whole = PairMask(band_hi=40, pos=(0, 0, 1, 0), **drop)
    want, want_lse = flash_attn_fwd(q, k, v, softmax_scale=0.25, mask=whole)
    out = torch.zeros(q.shape, device=device)
    lse = torch.full((1, 2, 96), -math.inf, device=device)
    for start, end in ((64, 96), (0, 64)):  # the later keys first, as a ring may visit them
        mask = PairMask(band_hi=40 - start, pos=(0, start, 1, 0), **drop)
        flash_attn_fwd(q, k[:, start:end], v[:, start:end], softmax_scale=0.25, mask=mask, out=out, lse=lse,
                       accumulate=True)
    assert rel_err(out.cpu(), want.cpu()) <= 1e-5 and rel_err(lse.cpu(), want_lse.cpu()) <= 1e-6


@pytest.mark.parametrize("impl", ["twin", "triton"])
def test_head_offset_keys_the_global_heads(impl, monkeypatch):
    """PairMask.dropout_head0 = h0: the pair's heads are global heads h0, h0 + 1, ... (a
    rank of a heads x ring grid), so heads [2, 4) of a call with h0 = 2 drop what heads
    [2, 4) of dropout_keep_mask drop, forward and backward; GQA (one kv head)."""
    device = _impl(impl, monkeypatch)
    b, s, h, d, p, seed, h0 = 1, 48, 2, 16, 0.3, 11, 2
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(b, s, n, d, generator=gen) for n in (h, 1, 1, h))
    mask = PairMask(dropout_p=p, seed=seed, pos=(0, 0, 1, 0), dropout_head0=h0)
    qd, kd, vd, dod = (t.to(device) for t in (q, k, v, dout))
    kw = dict(softmax_scale=d ** -0.5, mask=mask)
    out, lse = flash_attn_fwd(qd, kd, vd, **kw)
    grads = [torch.zeros(t.shape, device=device) for t in (qd, kd, vd)]
    flash_attn_bwd(dod, qd, kd, vd, lse, attn_delta(out, dod), *grads, **kw)
    keep = dropout_keep_mask(seed, p, b, h0 + h, s)[:, h0:]
    want = oracle_results(q, k, v, dout, None, dropped(keep, p))
    for name, got in zip(want, (out, lse, *grads)):
        err = rel_err(got.cpu(), want[name])
        assert err <= TOL[F32], f"{impl}: {name} rel err {err:.3g}"
