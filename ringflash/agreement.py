"""The cross-rank agreement check: every rank of a ring must call with the same shapes and
options, or every rank raises (never a hang, never a silent wrong answer).

Set RINGFLASH_RANK_CHECK=0 to skip it (read once, at import). Without it nothing compares
the ranks' arguments: ranks that disagree on a shape fail inside the exchange with the
backend's error (gloo aborts: "Received data size doesn't match expected size"; NCCL may
hang until the group's timeout), and ranks that disagree on causal, layout or
softmax_scale return wrong results with no error.
"""

from __future__ import annotations

import os
import struct

import torch

from .exchange import TRANSPORTS, Ring
from .kernels import SUPPORTED_DTYPES
from .kernels.masks import BAND_INF, tensor_memo
from .layouts import LAYOUTS, layout_of

ENABLED = os.environ.get("RINGFLASH_RANK_CHECK", "1") != "0"

# The band's fields name what it is made of (causal, window_size): ranks that disagree on
# either disagree on the band, (lo, hi) of key - query positions (None: unbounded).
BAND_FIELDS = ("band_lo (from causal, window_size)", "band_hi (from causal, window_size)")
_SIGNATURE_FIELDS = ("batch", "seqlen_local", "heads", "head_dim", "kv_heads", "dtype", *BAND_FIELDS,
                     "layout", "softmax_scale", "requires_grad", "transport", "segment_ids given",
                     "dropout_p", "seed", "block_mask's nonzero blocks", "block_mask's checksum")
# What the ranks of a heads x ring grid compare before their all-to-all (ringflash.heads):
# the same, transport aside (the ring compares it in its own check).
GRID_FIELDS = _SIGNATURE_FIELDS


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _block_digest(blocks) -> list[int]:
    """(nonzero blocks, a position-weighted checksum) of a block mask; (-1, -1) for none.
    One reduction on the mask's device (a host synchronization) the first time a mask
    object is seen."""
    if blocks is None:
        return [-1, -1]

    def digest():
        flat = blocks.reshape(-1)
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) % 1_000_003
        return [int(flat.sum()), int((weights * flat).sum())]
    return tensor_memo(blocks, ("digest",), digest)


def signature(q, k, band, layout, scale, needs_grad, kind, segments, dropout, blocks=None) -> list[int]:
    """A few integers that every rank of the ring must agree on (``kind``: the transport,
    None where it is not chosen yet)."""
    lo, hi = band
    return [*q.shape, k.shape[2], SUPPORTED_DTYPES.index(q.dtype), -BAND_INF if lo is None else lo,
            BAND_INF if hi is None else hi, LAYOUTS.index(layout_of(layout).name), _float_bits(scale),
            int(needs_grad), -1 if kind is None else TRANSPORTS.index(kind), int(segments is not None), _float_bits(dropout[0]),
            dropout[1], *_block_digest(blocks)]


def _shown(field: str, values) -> list:
    if field in ("softmax_scale", "dropout_p"):
        return [struct.unpack("<d", struct.pack("<q", x))[0] for x in values]
    if field == "dtype":
        return [str(SUPPORTED_DTYPES[x]) for x in values]
    if field == "layout":
        return [LAYOUTS[x] for x in values]
    if field == "transport":
        return [TRANSPORTS[x] for x in values]
    if field in BAND_FIELDS:
        return [None if abs(x) == BAND_INF else x for x in values]
    return list(values)


def check_ranks_agree(ring: Ring, signature: list[int] | None, error: Exception | None) -> None:
    """Raise on every rank if any rank rejected its arguments or the ranks disagree.

    ``signature`` is None on a rank whose own checks failed with ``error``: it still joins
    the all-gather, so the other ranks learn of it instead of waiting in the ring.
    Costs one all-gather of 18 int64 per call on the host (``exchange.host_group``: gloo),
    which waits for the other ranks' hosts but not for the GPU (a block mask's checksum
    is reduced on its device the first time the mask is seen). It runs on every call
    rather than once per signature: a rank that skipped it because its own
    signature was cached, while another rank's changed, would leave that rank waiting in a
    collective nobody else joins.
    """
    mine = [1, *signature] if signature is not None else [0] * (1 + len(_SIGNATURE_FIELDS))
    everyone = ring.all_gather_ints(mine)
    rejected = [rank for rank, row in enumerate(everyone) if row[0] == 0]
    if error is not None:
        raise error
    if rejected:
        raise ValueError(f"rank(s) {rejected} of the ring rejected their arguments to ring_flash_attn "
                         "(see the error raised there); every rank must pass valid, matching arguments")
    for field, values in zip(_SIGNATURE_FIELDS, list(zip(*everyone))[1:]):
        if len(set(values)) > 1:
            raise ValueError(f"ranks disagree on {field}: {_shown(field, values)} (rank i's value at "
                             "index i); every rank must call ring_flash_attn with the same arguments and shapes")

