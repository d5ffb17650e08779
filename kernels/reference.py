"""The PyTorch twin of the Triton kernels.

Same contract as the Triton launchers ``triton.fwd`` / ``triton.bwd`` (see ``ringflash.kernels``),
written blockwise over key tiles so extra memory is O(seqlen_q * BLOCK_N), never the full
N x N score matrix. It is the path for CPU tensors (the gloo ring) and an
implementation independent of the Triton code for the tests.

Shapes: q (B, Sq, H, D); k, v (B, Sk, Hkv, D) with H = G * Hkv; lse, delta (B, H, Sq).
Grouped heads are handled by viewing q as (B, Sq, Hkv, G, D): K/V are never repeated.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange

from . import dropout
from .masks import PairMask, pair_positions, visible

BLOCK_N = 256


def _key_blocks(seqlen_q: int, seqlen_k: int, mask: PairMask):
    """Yield (start, end) of key tiles that the band may leave a visible key in (a band on
    positions: every tile, the caller tests each)."""
    local = not mask.band_on_positions
    lo = 0 if mask.band_lo is None or not local else max(0, mask.band_lo)  # row 0 sees j >= band_lo
    hi = seqlen_k if mask.band_hi is None or not local else min(seqlen_k, seqlen_q + mask.band_hi)
    for start in range(lo // BLOCK_N * BLOCK_N, max(hi, 0), BLOCK_N):
        yield start, min(start + BLOCK_N, hi)


def _key_tiles(qg, k, v, softmax_scale: float, mask: PairMask):
    """Yield (start, end, k tile, v tile, masked scores (B, Hkv, G, Sq, end-start)) in fp32
    for every key tile that holds at least one visible key."""
    seqlen_q = qg.shape[1]
    rows = torch.arange(seqlen_q, device=qg.device)
    for start, end in _key_blocks(seqlen_q, k.shape[1], mask):
        ok = visible(rows, torch.arange(start, end, device=qg.device), mask)
        if ok is not None and not ok.any():
            continue
        kb = k[:, start:end].float()
        vb = v[:, start:end].float()
        s = torch.einsum("bqhgd,bkhd->bhgqk", qg, kb) * softmax_scale
        if ok is not None:  # (Sq, n), (B, Sq, n) or (B|1, H|1, Sq, n) -> (B, Hkv, G, Sq, n)
            if ok.dim() == 3:
                ok = ok[:, None, None]
            elif ok.dim() == 4:
                ok = ok.unflatten(1, (k.shape[2], -1) if ok.shape[1] > 1 else (1, 1))
            s = s.masked_fill(~ok, -math.inf)
        yield start, end, kb, vb, s


def _dropped(p, mask: PairMask, start: int, end: int, kv_heads: int):
    """p (B, Hkv, G, Sq, n) with dropout applied (dropped 0, kept scaled), or p itself."""
    if mask.dropout_p == 0:
        return p
    b, _, g, sq, _ = p.shape
    qpos, kpos = pair_positions(mask.pos, torch.arange(sq), torch.arange(start, end))
    heads = (torch.arange(kv_heads * g) + mask.dropout_head0).view(1, kv_heads, g, 1, 1)
    keep = dropout.keep(mask.seed, mask.dropout_p, torch.arange(b).view(b, 1, 1, 1, 1), heads,
                        qpos.view(1, 1, 1, sq, 1), kpos.view(1, 1, 1, 1, -1)).to(p.device)
    return torch.where(keep, p * dropout.keep_scale(mask.dropout_p), torch.zeros_like(p))


def _grouped(q, kv_heads):
    """(B, S, H, D) as (B, S, Hkv, G, D): query head h is in group h // G of kv head h // G."""
    return rearrange(q, "b s (h g) d -> b s h g d", h=kv_heads)


# The twin computes in fp32 whatever autocast says, as the Triton kernels ignore it: under
# torch.autocast("cpu", torch.bfloat16) its einsums would otherwise run in bf16.
_FP32 = torch.autocast("cpu", enabled=False)


@_FP32
def fwd(q, k, v, out, lse, *, softmax_scale: float, mask: PairMask, accumulate: bool,
        out_partial=None, tail=None, arrival=None):
    """Write (or merge into) out (B, Sq, H, D) and lse (B, H, Sq) for this block pair;
    accumulating, the running output is read from ``out_partial`` when given. ``tail``:
    the rows that follow k and v when held apart (``pair.Joined``), or None; the
    twin reads its keys in order, whichever part ``arrival`` runs last."""
    if tail is not None:
        k, v = (torch.cat([t, rest], 1) for t, rest in zip((k, v), tail))
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qg = _grouped(q, hkv).float()
    # Running state in the layout (B, Hkv, G, Sq[, D]).
    if accumulate:
        m = lse.view(b, hkv, g, sq).clone()
        l = torch.ones_like(m)
        acc = (out if out_partial is None else out_partial).float().view(b, sq, hkv, g, d)
        acc = acc.permute(0, 2, 3, 1, 4).clone()
    else:
        m = torch.full((b, hkv, g, sq), -math.inf, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros((b, hkv, g, sq, d), device=q.device)
    for start, end, _, vb, s in _key_tiles(qg, k, v, softmax_scale, mask):
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe[..., None])
        l = l * alpha + p.sum(dim=-1)  # statistics of the undropped scores
        p = _dropped(p, mask, start, end, hkv)
        acc = acc * alpha[..., None] + torch.einsum("bhgqk,bkhd->bhgqd", p, vb)
        m = m_new
    empty = l == 0
    o = acc / torch.where(empty, torch.ones_like(l), l)[..., None]
    new_lse = torch.where(empty, torch.full_like(m, -math.inf), m + torch.log(l))
    out.copy_(o.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d))
    lse.copy_(new_lse.view(b, h, sq))
    return out, lse


def delta(out, do):
    """rowsum(dO * O) in fp32, (B, H, Sq)."""
    return (out.float() * do.float()).sum(dim=-1).transpose(1, 2).contiguous()


def add_rounded(out, a, b) -> None:
    """out = a + b, rounded once to out's dtype ((P, m) views)."""
    torch.add(a, b, out=out)


@_FP32
def bwd(do, q, k, v, lse, delta_, dq, dk, dv, *, softmax_scale: float, mask: PairMask,
        accumulate: bool, partials=(None, None, None), tails=(None, None)):
    """Write (or add into) dq, dk, dv for this block pair, from the FINAL lse and delta;
    a gradient passed as None is skipped. Accumulating, a gradient's running sum is read
    from its entry of ``partials`` when given (else from the gradient itself). ``tails``:
    the rows that follow (q, do) and (k, v) when held apart (``pair.Joined``), or None."""
    if tails[0] is not None:
        q, do = (torch.cat([t, tail], 1) for t, tail in zip((q, do), tails[0]))
    if tails[1] is not None:
        k, v = (torch.cat([t, tail], 1) for t, tail in zip((k, v), tails[1]))
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    qg = _grouped(q, hkv).float()
    dog = _grouped(do, hkv).float()
    lse_g = lse.view(b, hkv, g, sq)
    delta_g = delta_.view(b, hkv, g, sq)
    # A row with lse = -inf saw no key: its P row is zero.
    lse_safe = torch.where(torch.isinf(lse_g), torch.full_like(lse_g, math.inf), lse_g)
    dq_acc = torch.zeros((b, sq, hkv, g, d), device=q.device)
    dk_acc = torch.zeros((b, sk, hkv, d), device=q.device)
    dv_acc = torch.zeros_like(dk_acc)
    for start, end, kb, vb, s in _key_tiles(qg, k, v, softmax_scale, mask):
        p = torch.exp(s - lse_safe[..., None])
        # With dropout, dV takes the dropped probabilities and dP the dropped gradient.
        dp = _dropped(torch.einsum("bqhgd,bkhd->bhgqk", dog, vb), mask, start, end, hkv)
        ds = p * (dp - delta_g[..., None]) * softmax_scale
        dq_acc += torch.einsum("bhgqk,bkhd->bqhgd", ds, kb)
        dk_acc[:, start:end] = torch.einsum("bhgqk,bqhgd->bkhd", ds, qg)
        dv_acc[:, start:end] = torch.einsum("bhgqk,bqhgd->bkhd", _dropped(p, mask, start, end, hkv), dog)
    for grad, new, partial in zip((dq, dk, dv), (dq_acc.view(b, sq, h, d), dk_acc, dv_acc), partials):
        if grad is None:
            continue
        if accumulate:
            grad.copy_((grad if partial is None else partial).float() + new)
        else:
            grad.copy_(new)
    return dq, dk, dv
