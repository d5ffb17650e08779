"""Attention dropout regenerated from a counter-based generator, the same at every world size.

Whether the probability of query i for key j is kept depends only on
(seed, batch b, query head h, GLOBAL query position qp, GLOBAL key position kp).
One Philox call serves a block of 16 elements, 2 queries by 8 keys (query bit 3; key
bits 0, 3 and 4), one byte each:

    counter = (kp without bits 0, 3, 4:  (kp >> 5) << 2 | (kp >> 1) & 3,
               qp without bit 3:         (qp >> 4) << 3 | qp & 7,   h, b)
    words   = Philox4x32-7(key = seed (64 bits), counter)
    byte    = byte (kp & 1) | ((kp >> 4) & 1) << 1  of word  (kp >> 3) & 1 | ((qp >> 3) & 1) << 1
    keep    = byte >= threshold,  threshold = min(round(p * 256), 255)

so no layout, world size or tile order can change a decision, the forward saves nothing
but the seed, and the backward regenerates the same bytes. The rate applied is therefore
p rounded to a multiple of 1/256 (``applied_rate``; 0.1 -> 26/256 = 0.1016, at most
255/256), and kept probabilities are scaled by 1 / (1 - applied rate) (``keep_scale``),
which keeps the output unbiased. Dropout applies to the normalized probabilities feeding
the output; lse and the softmax statistics are those of the undropped scores
(FlashAttention's derivation).

Why this layout of bytes: in the Hopper MMA accumulator a thread holds, per row, pairs of
adjacent columns every 8 columns, and rows r and r + 8. Query bit 3 and key bits 0, 3, 4
are register bits of the query-by-key tiles (forward, dQ), so a call's 16 bytes land in
the thread that uses them and are joined into place without data movement; in the
key-by-query tiles of the dK/dV kernel only key bit 3 and query bit 3 are, and the word
index is made of those two, so a thread there takes one byte (by its lane and warp) of
each word of the calls it runs. Why 7 rounds: FlashAttention's dropout uses
Philox4x32-7 (csrc/flash_attn/src/philox.cuh: 6 rounds in a loop and a last one), and
Random123's authors report Philox4x32-7 passing TestU01's BigCrush (their default, 10,
keeps a safety margin).

This file is the PyTorch twin of the generator (int64 arithmetic on 32-bit words), used
by the CPU kernels and by ``dropout_keep_mask``; the Triton kernels run the same rounds
through ``tl.philox``.
"""

from __future__ import annotations

import torch

from .checks import check_dropout

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 7


def threshold(p: float) -> int:
    """The 8-bit drop threshold of rate p: a key is dropped iff its byte is below it."""
    return min(int(round(p * 256)), 255)


def applied_rate(p: float) -> float:
    """The drop rate the kernels apply for ``dropout_p=p``: p rounded to 1/256."""
    return threshold(p) / 256


def keep_scale(p: float) -> float:
    """What a kept probability is multiplied by: 1 / (1 - applied drop rate)."""
    return 1.0 / (1.0 - applied_rate(p))


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit words of the 64-bit product of the 32-bit constant a and uint32 words
    b (int64 tensors), without overflowing int64: a * b = (a * b_hi) 2^16 + a * b_lo with
    both partial products below 2^48."""
    low = a * (b & 0xFFFF)
    top = a * (b >> 16) + (low >> 16)  # the product >> 16
    return top >> 16, ((top & 0xFFFF) << 16) | (low & 0xFFFF)


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


def _counters(qp: torch.Tensor, kp: torch.Tensor):
    """Philox's counter words (c1, c0) of query and key positions, and which of its 16
    output bytes, 4 * word + byte, decides each pair (qp, kp broadcastable)."""
    return ((qp >> 4) << 3 | qp & 7, (kp >> 5) << 2 | (kp >> 1) & 3,
            4 * ((kp >> 3) & 1 | (qp >> 2) & 2) + ((kp & 1) | (kp >> 3) & 2))


def keep(seed: int, p: float, batch, head, q_pos, k_pos) -> torch.Tensor:
    """The keep decisions (bool) for broadcastable int64 tensors of batch, query head,
    global query position and global key position."""
    kp, qp, b, h = (torch.as_tensor(x).to(torch.int64) for x in (k_pos, q_pos, batch, head))
    if _rows_and_columns(qp, kp, b, h):
        return _keep_deduplicated(seed, p, b, h, qp.flatten(), kp.flatten())
    c1, c0, pick = _counters(qp, kp)
    words = philox(seed, c0, c1, h, b)
    w = pick >> 2
    word = torch.where(w < 2, torch.where(w == 0, words[0], words[1]),
                       torch.where(w == 2, words[2], words[3]))
    return (word >> (8 * (pick & 3))) & 0xFF >= threshold(p)


def _rows_and_columns(qp, kp, b, h) -> bool:
    """q positions a column (..., Sq, 1), k positions a row (..., n), batch and head constant
    along both: the shapes the twin and ``dropout_keep_mask`` ask for."""
    return (qp.dim() >= 2 and qp.shape[-1] == 1 and qp.shape[-2] == qp.numel() and kp.shape[-1] == kp.numel()
            and all(t.dim() < 2 or t.shape[-2:] == (1, 1) for t in (b, h)))


def _keep_deduplicated(seed, p, b, h, qp, kp) -> torch.Tensor:
    """``keep`` for q positions qp (Sq,) down the rows and k positions kp (n,) along the
    columns: (*lead, Sq, n). One Philox call decides 16 pairs (those differing only in key
    bits 0, 3, 4 and query bit 3), so each distinct counter is drawn once and its 16 bytes
    are picked from: 1/16 of the arithmetic of drawing one per pair, the same bits."""
    c1, c0, pick = _counters(qp[:, None], kp[None, :])
    rows, row_of = torch.unique(c1, return_inverse=True)  # (R,), (Sq, 1)
    cols, col_of = torch.unique(c0, return_inverse=True)  # (C,), (1, n)
    words = philox(seed, cols, rows[:, None], h, b)  # 4 x (*lead, R, C)
    kept = torch.stack([(w >> s) & 0xFF for w in words for s in (0, 8, 16, 24)], -1) >= threshold(p)
    return kept[..., row_of, col_of, pick]


def dropout_keep_mask(seed: int, p: float, batch: int, heads: int, seqlen_q: int,
                      seqlen_k: int | None = None, *, q_positions=None, k_positions=None,
                      device=None) -> torch.Tensor:
    """The dense keep mask (batch, heads, seqlen_q, seqlen_k) bool that ``flash_attn`` /
    ``ring_flash_attn`` with ``dropout_p=p, seed=seed`` apply: True = kept (its probability
    scaled by ``keep_scale(p)``). Positions default to 0..seqlen-1 (the full sequence);
    pass a shard's ``ringflash.positions`` to get that rank's rows or columns. For tests
    and for checking runs at small sizes: it is O(batch * heads * seqlen_q * seqlen_k)."""
    if seed is None:
        raise TypeError("seed must be an int: the one a run used (flash_attn's seed=)")
    p, seed = check_dropout(p, seed)
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    qp = torch.arange(seqlen_q) if q_positions is None else torch.as_tensor(q_positions).cpu()
    kp = torch.arange(seqlen_k) if k_positions is None else torch.as_tensor(k_positions).cpu()
    for name, pos, n in (("q_positions", qp, seqlen_q), ("k_positions", kp, seqlen_k)):
        if pos.shape != (n,):
            raise ValueError(f"{name} must be ({n},) for seqlen {n}, got {tuple(pos.shape)}")
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    mask = keep(seed, p, b, h, qp[None, None, :, None], kp[None, None, None, :])
    return mask.to(device) if device is not None else mask
