"""Attention dropout regenerated from a counter-based generator, the same at every world size.

Whether the probability of query i for key j is kept depends only on
(seed, batch b, query head h, GLOBAL query position qp, GLOBAL key position kp):

    words = Philox4x32-10(key = seed (64 bits), counter = (kp >> 3, qp, h, b))
    bits  = 16-bit half (kp & 1) of word ((kp & 7) >> 1)        (8 keys share one call)
    keep  = bits >= threshold,  threshold = round(p * 65536)

so no layout, world size or tile order can change a decision, the forward saves nothing
but the seed, and the backward regenerates the same bits. Kept probabilities are scaled
by 1 / (1 - threshold / 65536): the scale of the drop rate actually applied (p rounded
to 1/65536), which keeps the output unbiased. Dropout applies to the normalized
probabilities feeding the output; lse and the softmax statistics are those of the
undropped scores (FlashAttention's derivation).

This file is the PyTorch twin of the generator (int64 arithmetic on 32-bit words), used
by the CPU kernels and by ``dropout_keep_mask``; the Triton kernels run the same rounds
through ``tl.philox``.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10


def threshold(p: float) -> int:
    """The 16-bit drop threshold of rate p."""
    return int(round(p * 65536))


def keep_scale(p: float) -> float:
    """What a kept probability is multiplied by: 1 / (1 - applied drop rate)."""
    return 1.0 / (1.0 - threshold(p) / 65536)


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit words of the 64-bit product of the constant a and uint32 words b
    (int64 tensors), without overflowing int64."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    mid = (lo_lo >> 16) + (hi_lo & 0xFFFF) + (lo_hi & 0xFFFF)
    hi = hi_hi + (hi_lo >> 16) + (lo_hi >> 16) + (mid >> 16)
    lo = ((mid & 0xFFFF) << 16) | (lo_lo & 0xFFFF)
    return hi & _M32, lo


def philox(seed: int, c0, c1, c2, c3, rounds: int = ROUNDS):
    """Philox4x32 of counters (c0..c3, int64 tensors of uint32 values, broadcastable) under
    the 64-bit key ``seed``: four int64 tensors of uint32 words (as triton.language.philox)."""
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c).to(torch.int64) for c in (c0, c1, c2, c3)))
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def keep(seed: int, p: float, batch, head, q_pos, k_pos) -> torch.Tensor:
    """The keep decisions (bool) for broadcastable int64 tensors of batch, query head,
    global query position and global key position."""
    k_pos = torch.as_tensor(k_pos).to(torch.int64)
    words = philox(seed, k_pos >> 3, q_pos, head, batch)
    t = k_pos & 7
    word = torch.where(t < 4, torch.where(t < 2, words[0], words[1]),
                       torch.where(t < 6, words[2], words[3]))
    bits = torch.where(t % 2 == 0, word & 0xFFFF, word >> 16)
    return bits >= threshold(p)


def dropout_keep_mask(seed: int, p: float, batch: int, heads: int, seqlen_q: int,
                      seqlen_k: int | None = None, *, q_positions=None, k_positions=None,
                      device=None) -> torch.Tensor:
    """The dense keep mask (batch, heads, seqlen_q, seqlen_k) bool that ``flash_attn`` /
    ``ring_flash_attn`` with ``dropout_p=p, seed=seed`` apply: True = kept (its probability
    scaled by ``keep_scale(p)``). Positions default to 0..seqlen-1 (the full sequence);
    pass a shard's ``ringflash.positions`` to get that rank's rows or columns. For tests
    and for checking runs at small sizes: it is O(batch * heads * seqlen_q * seqlen_k)."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    qp = torch.arange(seqlen_q) if q_positions is None else torch.as_tensor(q_positions).cpu()
    kp = torch.arange(seqlen_k) if k_positions is None else torch.as_tensor(k_positions).cpu()
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    mask = keep(seed, p, b, h, qp[None, None, :, None], kp[None, None, None, :])
    return mask.to(device) if device is not None else mask
