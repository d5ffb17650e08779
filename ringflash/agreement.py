"""The cross-rank agreement check: every rank of a ring must call with the same shapes and
options, or every rank raises (never a hang, never a silent wrong answer).

``ring_flash_attn`` runs it inside its op (``check_ranks_agree``, ops.py), on a heads x
ring grid before its all-to-all (``agree_on_grid``); every other helper whose collective
has shapes that depend on its input (``unshard``, ``all_reduce_gradients``,
``broadcast_parameters``, ``SequenceParallel.reduce_loss``) runs it once before that
collective (``agree``). A rank whose own checks fail still joins the check, as a rank
that rejected its arguments, so the others raise too instead of waiting for it
(``raise_on_every_rank``, for a rank that fails before it reaches ``ring_flash_attn``).

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
from .groups import Grid
from .kernels import SUPPORTED_DTYPES
from .kernels.dispatch import capability
from .kernels.masks import BAND_INF, tensor_memo
from .layouts import layout_code, layout_shown
from .ring.plan import SCHEDULES, schedule_choice

ENABLED = os.environ.get("RINGFLASH_RANK_CHECK", "1") != "0"

# The band's fields name what it is made of (causal, window_size): ranks that disagree on
# either disagree on the band, (lo, hi) of key - query positions (None: unbounded).
BAND_FIELDS = ("band_lo (from causal, window_size)", "band_hi (from causal, window_size)")
_SIGNATURE_FIELDS = ("batch", "seqlen_local", "heads", "head_dim", "kv_heads", "dtype", *BAND_FIELDS,
                     "layout", "softmax_scale", "requires_grad", "transport", "segment_ids given",
                     "dropout_p", "seed", "block_mask's nonzero blocks", "block_mask's checksum",
                     "deterministic (or torch.use_deterministic_algorithms)", "GPU architecture",
                     "schedule (RINGFLASH_SCHEDULE)", "layout given as a spec (compiled)")
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


def signature(q, k, band, layout, scale, needs_grad, kind, segments, dropout, blocks=None,
              deterministic: bool = False, spec: bool = False) -> list[int]:
    """A few integers that every rank of the ring must agree on (``kind``: the transport,
    None where it is not chosen yet; ``deterministic``, or torch's deterministic mode, and
    the GPU's architecture: they choose the backward's schedule, ring/rotate.py;
    RINGFLASH_SCHEDULE, which chooses both passes' messages: a ValueError if it names no
    schedule; ``spec``: the layout came as a spec tensor, as under torch.compile, which
    decides whether the direct schedule keeps its K/V for the backward, ops.py)."""
    lo, hi = band
    return [*q.shape, k.shape[2], SUPPORTED_DTYPES.index(q.dtype), -BAND_INF if lo is None else lo,
            BAND_INF if hi is None else hi, layout_code(layout), _float_bits(scale),
            int(needs_grad), -1 if kind is None else TRANSPORTS.index(kind), int(segments is not None), _float_bits(dropout[0]),
            dropout[1], *_block_digest(blocks),
            int(deterministic or torch.are_deterministic_algorithms_enabled()), _arch(q),
            SCHEDULES.index(schedule_choice()), int(spec)]


def _arch(q: torch.Tensor) -> int:
    """q's GPU architecture as one integer (90: sm_90), -1 off CUDA."""
    arch = capability(q)
    return -1 if arch is None else 10 * arch[0] + arch[1]


# Every dtype torch has, in a fixed order: a tensor's dtype as one integer (``tensor_row``).
_DTYPES = tuple(sorted({t for t in vars(torch).values() if isinstance(t, torch.dtype)}, key=str))
_SHAPE_DIMS = 8  # a tensor's sizes compared one by one (``tensor_row``); numel covers the rest


def tensor_fields(name: str) -> tuple[str, ...]:
    """The fields of ``tensor_row`` for the argument ``name``."""
    return (f"{name}.dtype", f"{name}.dim()", *(f"{name}.shape[{i}]" for i in range(_SHAPE_DIMS)),
            f"{name}.numel()")


def tensor_row(t: torch.Tensor) -> list[int]:
    """dtype, number of dimensions, sizes (-1 past the last) and numel of ``t``: what a
    collective over copies of ``t`` needs every rank to agree on."""
    sizes = list(t.shape[:_SHAPE_DIMS])
    return [_DTYPES.index(t.dtype), t.dim(), *sizes, *[-1] * (_SHAPE_DIMS - len(sizes)), t.numel()]


def tensors_fields(name: str) -> tuple[str, ...]:
    """The fields of ``tensors_row`` for the tensors ``name``."""
    return (f"{name}: how many", f"{name}: elements", f"{name}: dtypes and shapes (checksum)")


def tensors_row(tensors) -> list[int]:
    """How many tensors, their elements, and a checksum of their dtypes and shapes in order:
    what a collective over a list of tensors (flattened together) needs ranks to agree on."""
    count, elements, digest = 0, 0, 0
    for t in tensors:
        for x in (_DTYPES.index(t.dtype), t.dim(), *t.shape):
            digest = (digest * 1_000_003 + x + 1) % (2 ** 61 - 1)
        count, elements = count + 1, elements + t.numel()
    return [count, elements, digest]


def _shown(field: str, values) -> list:
    if field in ("softmax_scale", "dropout_p"):
        return [struct.unpack("<d", struct.pack("<q", x))[0] for x in values]
    if field == "dtype":
        return [str(SUPPORTED_DTYPES[x]) for x in values]
    if field.endswith(".dtype"):
        return [str(_DTYPES[x]) for x in values]
    if field.endswith(".dim()") or ".shape[" in field:
        return [None if x < 0 else x for x in values]
    if field == "layout":
        return [layout_shown(x) for x in values]
    if field == "transport":
        return [TRANSPORTS[x] for x in values]
    if field.startswith("schedule"):
        return [SCHEDULES[x] for x in values]
    if field in BAND_FIELDS:
        return [None if abs(x) == BAND_INF else x for x in values]
    return list(values)


def check_ranks_agree(ring: Ring, signature: list[int] | None, error: Exception | None, *,
                      fields: tuple[str, ...] = _SIGNATURE_FIELDS, call: str = "ring_flash_attn") -> None:
    """Raise on every rank if any rank rejected its arguments or the ranks disagree.

    ``signature`` is None on a rank whose own checks failed with ``error``: it still joins
    the all-gather, so the other ranks learn of it instead of waiting in the ring.
    Costs one all-gather of 22 int64 per call on the host (``exchange.host_group``: gloo),
    which waits for the other ranks' hosts but not for the GPU (a block mask's checksum
    is reduced on its device the first time the mask is seen). It runs on every call
    rather than once per signature: a rank that skipped it because its own
    signature was cached, while another rank's changed, would leave that rank waiting in a
    collective nobody else joins. ``fields`` name the signature's integers, ``call`` the
    function the ranks called (other helpers' checks, ``agree``).
    """
    mine = [1, *signature] if signature is not None else [0] * (1 + len(fields))
    everyone = ring.all_gather_ints(mine)
    rejected = [rank for rank, row in enumerate(everyone) if row[0] == 0]
    if error is not None:
        raise error
    if rejected:
        raise ValueError(f"rank(s) {rejected} of the ring rejected their arguments to {call} "
                         "(see the error raised there); every rank must pass valid, matching arguments")
    for field, values in zip(fields, list(zip(*everyone))[1:]):
        if len(set(values)) > 1:
            raise ValueError(f"ranks disagree on {field}: {_shown(field, values)} (rank i's value at "
                             f"index i); every rank must call {call} with the same arguments and shapes")


def gather_rows(grid: Grid, mine: list[int]) -> tuple[bool, list[list[int]]]:
    """(whether every rank of the grid passed the same row, the rows this rank saw): an
    all-gather over the heads group, then one over the ring group carrying each heads
    group's verdict (every ring group meets every heads group, so every rank learns)."""
    same, seen = True, []
    if grid.heads_world > 1:
        seen = Ring(grid.heads).all_gather_ints(mine)
        same = all(row == seen[0] for row in seen)
    rows = Ring(grid.ring).all_gather_ints([int(same), *mine])
    seen += [row[1:] for row in rows]
    return all(row[0] for row in rows) and all(row == seen[0] for row in seen), seen


def agree_on_grid(grid: Grid, signature: list[int] | None, error: Exception | None, *,
                  fields: tuple[str, ...] = GRID_FIELDS, call: str = "ring_flash_attn") -> None:
    """``check_ranks_agree`` over a heads x ring grid (``gather_rows``: two all-gathers):
    every rank raises before any rank starts an all-to-all its peers would not join."""
    same, rows = gather_rows(grid, [1, *signature] if signature is not None else [0] * (1 + len(fields)))
    if error is not None:
        raise error
    if same:
        return
    valid = [row for row in rows if row[0] == 1]
    for i, field in enumerate(fields, start=1):
        if len(valid) == len(rows) and len({row[i] for row in valid}) > 1:
            raise ValueError(f"ranks of the heads x ring grid disagree on {field} (values seen here: "
                             f"{_shown(field, sorted({row[i] for row in valid}))}); every rank must call "
                             f"{call} with the same arguments and shapes")
    raise ValueError(f"ranks of the heads x ring grid rejected their arguments to {call} or "
                     "disagree on them (see the error raised there); every rank must pass valid, "
                     "matching arguments")


def _check(grid: Grid, row: list[int] | None, error: Exception | None, fields, call: str) -> None:
    """The check over ``grid`` (a 1-D group is the grid with U = 1), where it runs: on more
    than one rank, with RINGFLASH_RANK_CHECK on, outside torch.compile's tracing."""
    if ENABLED and not torch.compiler.is_compiling() and grid.world > 1:
        if grid.heads_world > 1:
            agree_on_grid(grid, row, error, fields=fields, call=call)
        else:
            check_ranks_agree(Ring(grid.ring), row, error, fields=fields, call=call)
    if error is not None:
        raise error


def agree(grid: Grid, call: str, fields: tuple[str, ...], local_checks):
    """What ``local_checks()`` returns beside its row, once every rank of ``grid`` agrees.

    ``local_checks()`` runs this rank's own checks of a call to ``call`` and returns (row,
    result): ``row``, integers named by ``fields``, is what the ranks must agree on before
    ``call``'s collective. If it raises TypeError/ValueError here, or another rank's does,
    or two rows differ, every rank raises (a ValueError naming the field and every rank's
    value where they differ). One all-gather of len(fields) + 1 int64 on the host (two on a
    heads x ring grid); none on one rank, with RINGFLASH_RANK_CHECK=0 or under torch.compile.
    """
    try:
        row, result = local_checks()
    except (TypeError, ValueError) as error:
        _check(grid, None, error, fields, call)
        raise  # not reached: _check raises ``error``
    _check(grid, row, None, fields, call)
    return result


def raise_on_every_rank(grid: Grid, error: Exception):
    """Raise ``error`` here, and make the ranks already inside ``ring_flash_attn`` raise too:
    this rank joins their check (over the grid, or the ring's own) as one that rejected
    its arguments, instead of leaving them waiting for it."""
    _check(grid, None, error, _SIGNATURE_FIELDS, "ring_flash_attn")  # GRID_FIELDS are the same
