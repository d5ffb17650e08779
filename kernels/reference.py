"""The PyTorch twin of the Triton kernels.

Same contract as ``triton_fwd`` / ``triton_bwd`` (see ``ringflash.kernels``), written
blockwise over key tiles so extra memory is O(seqlen_q * BLOCK_N), never the full
N x N score matrix. It is the path for CPU tensors (the gloo ring) and an
implementation independent of the Triton code for the tests.

Shapes: q (B, Sq, H, D); k, v (B, Sk, Hkv, D) with H = G * Hkv; lse, delta (B, H, Sq).
Grouped heads are handled by viewing q as (B, Sq, Hkv, G, D): K/V are never repeated.
"""

from __future__ import annotations

import math

import torch

BLOCK_N = 256


def _key_blocks(seqlen_q: int, seqlen_k: int, causal_offset: int | None):
    """Yield (start, end) of key tiles that hold at least one visible key."""
    hi = seqlen_k if causal_offset is None else min(seqlen_k, seqlen_q + causal_offset)
    for start in range(0, max(hi, 0), BLOCK_N):
        yield start, min(start + BLOCK_N, hi)


def _key_tiles(qg, k, v, softmax_scale: float, causal_offset: int | None):
    """Yield (start, end, k tile, v tile, masked scores (B, Hkv, G, Sq, end-start)) in fp32
    for every key tile that holds at least one visible key."""
    seqlen_q = qg.shape[1]
    for start, end in _key_blocks(seqlen_q, k.shape[1], causal_offset):
        kb = k[:, start:end].float()
        vb = v[:, start:end].float()
        s = torch.einsum("bqhgd,bkhd->bhgqk", qg, kb) * softmax_scale
        if causal_offset is not None and end - 1 > causal_offset:  # not every key visible
            rows = torch.arange(seqlen_q, device=qg.device)[:, None]
            cols = torch.arange(start, end, device=qg.device)[None, :]
            s = s.masked_fill(cols > rows + causal_offset, -math.inf)
        yield start, end, kb, vb, s


def _grouped(q, kv_heads):
    b, s, h, d = q.shape
    return q.view(b, s, kv_heads, h // kv_heads, d)


def fwd(q, k, v, out, lse, *, softmax_scale: float, causal_offset: int | None, accumulate: bool):
    """Write (or merge into) out (B, Sq, H, D) and lse (B, H, Sq) for this block pair."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qg = _grouped(q, hkv).float()
    # Running state in the layout (B, Hkv, G, Sq[, D]).
    if accumulate:
        m = lse.view(b, hkv, g, sq).clone()
        l = torch.ones_like(m)
        acc = out.float().view(b, sq, hkv, g, d).permute(0, 2, 3, 1, 4).clone()
    else:
        m = torch.full((b, hkv, g, sq), -math.inf, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros((b, hkv, g, sq, d), device=q.device)
    for _, _, _, vb, s in _key_tiles(qg, k, v, softmax_scale, causal_offset):
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe[..., None])
        l = l * alpha + p.sum(dim=-1)
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


def bwd(do, q, k, v, lse, delta_, dq, dk, dv, *, softmax_scale: float,
        causal_offset: int | None, accumulate: bool, deterministic: bool = False):
    """Write (or add into) dq, dk, dv for this block pair, from the FINAL lse and delta;
    a gradient passed as None is skipped. Deterministic whatever ``deterministic`` says."""
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
    for start, end, kb, vb, s in _key_tiles(qg, k, v, softmax_scale, causal_offset):
        p = torch.exp(s - lse_safe[..., None])
        dp = torch.einsum("bqhgd,bkhd->bhgqk", dog, vb)
        ds = p * (dp - delta_g[..., None]) * softmax_scale
        dq_acc += torch.einsum("bhgqk,bkhd->bqhgd", ds, kb)
        dk_acc[:, start:end] = torch.einsum("bhgqk,bqhgd->bkhd", ds, qg)
        dv_acc[:, start:end] = torch.einsum("bhgqk,bqhgd->bkhd", p, dog)
    for grad, new in ((dq, dq_acc.view(b, sq, h, d)), (dk, dk_acc), (dv, dv_acc)):
        if grad is None:
            continue
        if accumulate:
            grad.add_(new)
        else:
            grad.copy_(new)
    return dq, dk, dv
