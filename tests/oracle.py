"""The float64 oracle: naive attention on the full sequence, a few lines of plain torch.

Layout as everywhere in ringflash: q (B, Sq, H, D); k, v (B, Sk, Hkv, D), H a multiple
of Hkv (query head h reads kv head h // (H // Hkv)); lse (B, H, Sq), natural log.
Masks: ``causal_offset`` None sees every key; an integer o lets query i see key j iff
j <= i + o. A row that sees no key has out 0 and lse -inf, and gradients 0 (no NaN).
Dropout: ``dropped`` = (keep (B, H, Sq, Sk) bool, scale): the probabilities entering the
output are keep ? p * scale : 0; lse stays that of the undropped scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


def visible_mask(seqlen_q: int, seqlen_k: int, causal_offset: int | None, device=None):
    """(Sq, Sk) bool, True where query i sees key j; None when every key is visible."""
    if causal_offset is None:
        return None
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + causal_offset


def global_mask(seqlen: int, causal: bool = False, window_size=(-1, -1), segment_ids=None):
    """(Sq, Sk) or, with segment ids (B, S), (B, S, S) bool over GLOBAL positions, written
    from docs/design.md's definitions (not from the kernels' band form); None if nothing is masked."""
    i = torch.arange(seqlen)[:, None]
    j = torch.arange(seqlen)[None, :]
    mask = torch.ones(seqlen, seqlen, dtype=torch.bool)
    if causal:
        mask &= j <= i
    left, right = window_size
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    if segment_ids is not None:
        seg = segment_ids.cpu()
        mask = mask[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    elif not causal and left < 0 and right < 0:
        return None
    return mask


def block_elements(block_mask: torch.Tensor, seqlen_q: int, seqlen_k: int, block: int = 128):
    """(heads or 1, Sq, Sk) bool: every element of a block mask's True blocks, written with
    repeat_interleave (not the library's indexing)."""
    dense = block_mask.cpu().repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)
    return dense[:, :seqlen_q, :seqlen_k]


def with_blocks(mask: Optional[torch.Tensor], block_mask: torch.Tensor, seqlen: int) -> torch.Tensor:
    """global_mask's (Sq, Sk) / (B, Sq, Sk) / None, and a block mask: (B or 1, H or 1, S, S)."""
    blocks = block_elements(block_mask, seqlen, seqlen)[None]
    if mask is None:
        return blocks
    return (mask[None, None] if mask.dim() == 2 else mask[:, None]) & blocks


def attention_oracle(q, k, v, causal_offset: int | None = None, softmax_scale: float | None = None,
                     mask: torch.Tensor | None = None, dropped: tuple | None = None):
    """(out (B, Sq, H, D), lse (B, H, Sq)), both float64; differentiable without NaN.
    ``mask`` (Sq, Sk), (B, Sq, Sk) or (B or 1, H or 1, Sq, Sk) bool, True = visible,
    replaces ``causal_offset``; ``dropped`` as in the module's docstring."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if mask is None:
        mask = visible_mask(q.shape[1], k.shape[1], causal_offset, q.device)
    if mask is None:
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., None])
    else:
        # (Sq, Sk), (B, 1, Sq, Sk) or (B|1, H|1, Sq, Sk) against scores (B, H, Sq, Sk).
        mask = mask.to(q.device)[:, None] if mask.dim() == 3 else mask.to(q.device)
        # Rows that see nothing get finite stand-in scores, then are zeroed: logsumexp of an
        # all -inf row is fine forward but its backward is NaN.
        seen = mask.any(dim=-1, keepdim=True)
        s = torch.where(mask, s, torch.where(seen, -math.inf, 0.0))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., None]) * seen
        lse = torch.where(seen[..., 0], lse, -math.inf)
    if dropped is not None:
        keep, keep_scale = dropped
        p = torch.where(keep.to(p.device), p * keep_scale, 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def oracle_grads(q, k, v, dout, causal_offset: int | None = None, softmax_scale: float | None = None,
                 dlse=None, mask: torch.Tensor | None = None, dropped: tuple | None = None):
    """(dq, dk, dv) in float64 of sum(out * dout) [+ sum(lse * dlse) over rows that see a key]."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = attention_oracle(q, k, v, causal_offset, softmax_scale, mask=mask, dropped=dropped)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + torch.where(torch.isinf(lse), 0.0, lse * dlse.double()).sum()
    return torch.autograd.grad(loss, (q, k, v))


def oracle_results(q, k, v, dout, mask: torch.Tensor | None = None,
                   dropped: tuple | None = None) -> dict[str, torch.Tensor]:
    """{"out", "lse", "dq", "dk", "dv"} of the oracle under ``mask`` (and ``dropped``), the
    gradients those of sum(out * dout)."""
    out, lse = attention_oracle(q, k, v, mask=mask, dropped=dropped)
    grads = oracle_grads(q, k, v, dout, mask=mask, dropped=dropped)
    return dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)))


def rel_err(a, b) -> float:
    """Relative Frobenius error ||a - b|| / ||b|| in float64 (absolute when b is all zero).

    -inf entries (lse of rows that see nothing) must sit at the same places in both; the
    finite parts are then compared. Any NaN, or a -inf mismatch, gives inf.
    """
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if torch.isnan(a).any() or torch.isnan(b).any():
        return math.inf
    ninf_a, ninf_b = torch.isneginf(a), torch.isneginf(b)
    if not torch.equal(ninf_a, ninf_b) or torch.isposinf(a).any() or torch.isposinf(b).any():
        return math.inf
    a, b = a[~ninf_b], b[~ninf_b]
    diff = torch.linalg.vector_norm(a - b).item()
    norm = torch.linalg.vector_norm(b).item()
    return diff / norm if norm > 0 else diff


def torch_attention(q, k, v, dout, causal_offset: int | None = None,
                    softmax_scale: float | None = None):
    """torch's own attention (scaled_dot_product_attention) in q's dtype, on q's device:
    (out, dq, dk, dv), the yardstick of the "no worse than 2x torch" rule.

    Rows that see no key are left out of the call (torch's backends disagree on them)
    and get out 0 and dq 0, as in the contract. K/V are repeated for grouped heads
    rather than passed with enable_gqa, so every backend accepts them.
    """
    b, sq, h, d = q.shape
    sk, group = k.shape[1], h // k.shape[2]
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    first = 0 if causal_offset is None else max(0, -causal_offset)  # first row that sees a key
    if first >= sq:
        return out, dq, torch.zeros_like(k), torch.zeros_like(v)
    qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q[:, first:], k, v))
    mask, is_causal = None, False
    if causal_offset is not None:
        if causal_offset + first == 0:
            is_causal = True  # top-left aligned, as torch's is_causal
        else:
            mask = visible_mask(sq - first, sk, causal_offset + first, q.device)
    o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(group, dim=1),
                                       vs.repeat_interleave(group, dim=1), attn_mask=mask,
                                       is_causal=is_causal, scale=softmax_scale)
    o.backward(dout[:, first:].transpose(1, 2).to(o.dtype))
    out[:, first:] = o.detach().transpose(1, 2)
    dq[:, first:] = qs.grad.transpose(1, 2)
    return out, dq, ks.grad.transpose(1, 2), vs.grad.transpose(1, 2)


# ----------------------------------------------------------------------------- shared cases

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPE_ID = {F32: "fp32", F16: "fp16", BF16: "bf16"}
TOL = {F32: 1e-5, F16: 2e-2, BF16: 2e-2}  # relative Frobenius error against the oracle
LSE_TOL = 1e-5  # lse is fp32 whatever the inputs: scores of half inputs are exact in fp32
# An error below this is rounding noise on a quantity that is (almost) exactly zero, e.g. dq
# with a single key, where the softmax is constant; comparing it with torch's is meaningless.
NOISE_FLOOR = 1e-5


@dataclass(frozen=True)
class Case:
    """One block pair: batch, query and key lengths, heads, kv heads, head_dim, causal
    diagonal offset (None: no mask) and softmax scale (None: head_dim ** -0.5)."""

    b: int
    sq: int
    sk: int
    h: int
    hkv: int
    d: int
    offset: Optional[int] = None
    scale: Optional[float] = None

    @property
    def id(self) -> str:
        mask = "full" if self.offset is None else f"causal{self.offset:+d}"
        scale = "" if self.scale is None else f"-scale{self.scale:g}"
        return f"b{self.b}-q{self.sq}-k{self.sk}-h{self.h}kv{self.hkv}-d{self.d}-{mask}{scale}"

    @property
    def softmax_scale(self) -> float:
        return self.d ** -0.5 if self.scale is None else self.scale


# ----------------------------------------------------------------------------- shared by the ring and layer tests

LAYOUTS = ("contiguous", "zigzag", "stripe", "block_stripe")  # every sequence layout, in ringflash's order


def tokens_per_rank(layout: str, n: int) -> int:
    """``n``, or for block_stripe (whole 128-token blocks a rank) at least two blocks, so
    that the blocks of one shard meet the blocks of another on both sides."""
    return 128 * max(2, -(-n // 128)) if layout == "block_stripe" else n


@dataclass(frozen=True)
class RingCase:
    """One ring configuration: ``n`` tokens per rank (the global length is n * W), heads and
    kv heads, head_dim, batch, softmax scale (None: head_dim ** -0.5), whether lse enters
    the loss (sum(out * dout) + sum(lse * dlse)), the dtype's name in torch, and whether q
    and dout are non-contiguous views (heads outermost in memory)."""

    layout: str
    causal: bool
    n: int
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 16
    batch: int = 1
    scale: Optional[float] = None
    use_lse: bool = False
    dtype: str = "float32"
    strided: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def id(self) -> str:
        parts = [self.layout, "causal" if self.causal else "full", f"n{self.n}",
                 f"h{self.heads}kv{self.kv_heads}", f"d{self.head_dim}", f"b{self.batch}"]
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if self.use_lse:
            parts.append("lse")
        parts.append(DTYPE_ID[self.torch_dtype])
        if self.strided:
            parts.append("strided")
        return "-".join(parts)
