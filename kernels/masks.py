"""What a block pair masks: a small description the kernels evaluate per tile.

One mechanism for every mask (docs/design.md, Masks). Key j of a pair is visible to query i iff

    band_lo <= j - i <= band_hi          (local indices; None = unbounded on that side;
                                          with band_on_positions, global positions)
    and, with segment ids, q_segments[b, i] == k_segments[b, j] >= 0
    and, with a block mask, blocks[h, i // BLOCK, j // BLOCK]

The causal diagonal with offset o is ``band_hi = o``. A sliding window on global
positions becomes a band of local indices wherever the pair's global positions are an
affine function of its local indices with one common stride (ringflash.layouts does that
conversion); on one device the band is the window itself. Segment ids mark packed
documents (equal id: may attend) and padding (-1: sees nothing, never seen). Within a
pair, the ids that are not -1 must not decrease along the rows (documents are contiguous
runs): that is what lets a row find the keys of its document as one interval. A block
mask (block-sparse attention) marks which (BLOCK x BLOCK) blocks of the pair are computed
at all; the elements of a computed block follow the band and the segment ids.

Where the pair's positions are not affine in its local indices (the block_stripe layout,
whose rows are runs of BLOCK consecutive positions W * BLOCK apart), the band is kept on
global positions (``band_on_positions``): band_lo <= kpos(j) - qpos(i) <= band_hi. Positions
increase along the rows either way, so each row still sees one interval of columns
(``band_interval``), which is all the kernels need.
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional

import torch

# An unbounded band side, as the kernels see it: far past any sequence length.
BAND_INF = 1 << 30
# The side of a block-mask block, in tokens (docs/design.md, Masks: B). Kernel tiles divide it.
BLOCK = 128


class PairMask(NamedTuple):
    """The mask of one (query block, key block) pair.

    band_lo, band_hi: key j visible to query i only if band_lo <= j - i <= band_hi (None:
        unbounded). ``PairMask.causal(o)`` is j <= i + o.
    q_segments (B, Sq), k_segments (B, Sk): int32 contiguous segment ids, or both None.
    dropout_p, seed: attention dropout (kernels/dropout.py), keyed by global positions:
    pos = (q_pos, k_pos, stride, jump): query i of the pair is at global position
        q_pos + i * stride + (i // BLOCK) * jump, key j at k_pos + j * stride
        + (j // BLOCK) * jump (needed with dropout or band_on_positions). jump is 0 but for
        the block_stripe layout, whose rows are runs of BLOCK positions W * BLOCK apart.
    blocks: a ``Blocks`` over (heads or 1, cdiv(Sq, BLOCK), cdiv(Sk, BLOCK)), or None:
        block (a, c) holds queries [a * BLOCK, (a + 1) * BLOCK) and keys
        [c * BLOCK, (c + 1) * BLOCK) of the pair; False blocks are never computed.
    band_on_positions: the band compares global positions instead of local indices,
        band_lo <= kpos(j) - qpos(i) <= band_hi (not combined with blocks).
    dropout_head0: the global index of head 0 (dropout is keyed by the global head: on a
        heads x ring grid a rank holds heads [dropout_head0, dropout_head0 + H)).
    """

    band_lo: Optional[int] = None
    band_hi: Optional[int] = None
    q_segments: Optional[torch.Tensor] = None
    k_segments: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    seed: int = 0
    pos: Optional[tuple[int, int, int, int]] = None
    blocks: Optional["Blocks"] = None
    band_on_positions: bool = False
    dropout_head0: int = 0

    @classmethod
    def causal(cls, offset: Optional[int]) -> "PairMask":
        """Key j visible to query i iff j <= i + offset (None: no mask)."""
        return cls(band_hi=offset)


NO_MASK = PairMask()


def pair_positions(pos: tuple[int, int, int, int], q_rows: torch.Tensor, k_rows: torch.Tensor):
    """(global positions of the pair's query rows q_rows, of its key rows k_rows), for
    ``PairMask.pos`` = (q_pos, k_pos, stride, jump)."""
    q0, k0, stride, jump = pos
    return (q0 + q_rows * stride + q_rows // BLOCK * jump,
            k0 + k_rows * stride + k_rows // BLOCK * jump)


def first_at_or_after(t: torch.Tensor, pos0: int, stride: int, jump: int) -> torch.Tensor:
    """The first local index whose global position (pos0 + c * stride + (c // BLOCK) * jump,
    ``PairMask.pos``) is >= t, elementwise over integer t (0 for t <= pos0; past the end
    for t past the last position)."""
    period = BLOCK * stride + jump
    u = (t - pos0).clamp(min=0)
    blocks = u // period
    offset = u - blocks * period
    return blocks * BLOCK + torch.clamp(-(-offset // stride), max=BLOCK)


def band_interval(rows: torch.Tensor, mask: PairMask, n_cols: int, transposed: bool = False):
    """(first, stop): the columns [first, stop) the band of ``mask`` leaves each of ``rows``
    (query rows; key rows with ``transposed``), both clamped to [0, n_cols]. The kernels' interval
    (kernels/triton/tiles.py, ``_band_interval``) in torch ops."""
    lo, hi = mask.band_lo, mask.band_hi
    if mask.band_on_positions:
        q0, k0, stride, jump = mask.pos
        row0, col0 = (k0, q0) if transposed else (q0, k0)
        at = row0 + rows * stride + rows // BLOCK * jump
        def col(t): return first_at_or_after(t, col0, stride, jump)
    else:
        at = rows
        def col(t): return t
    if transposed:
        lo, hi = (None if hi is None else -hi), (None if lo is None else -lo)
    first = torch.zeros_like(rows) if lo is None else col(at + lo)
    stop = torch.full_like(rows, n_cols) if hi is None else col(at + hi + 1)
    return first.clamp(0, n_cols), stop.clamp(0, n_cols)


def band_of_window(causal: bool, window_size: tuple[int, int]) -> tuple[Optional[int], Optional[int]]:
    """(lo, hi) of kp - qp for causal and window_size (left, right), -1 = unbounded."""
    left, right = window_size
    lo = None if left < 0 else -left
    hi = None if right < 0 else right
    if causal:
        hi = 0 if hi is None else min(hi, 0)
    return lo, hi


def visible(qi: torch.Tensor, kj: torch.Tensor, mask: PairMask):
    """The element predicate, None when every key is visible; otherwise bool of shape
    (len(qi), len(kj)), or (B, len(qi), len(kj)) with segment ids, or with a block mask
    (B or 1, heads or 1, len(qi), len(kj)). qi, kj: local row indices."""
    ok = None
    if mask.band_on_positions:
        qp, kp = pair_positions(mask.pos, qi, kj)
        diff = kp[None, :] - qp[:, None]
    else:
        diff = kj[None, :] - qi[:, None]
    if mask.band_lo is not None:
        ok = diff >= mask.band_lo
    if mask.band_hi is not None:
        hi = diff <= mask.band_hi
        ok = hi if ok is None else ok & hi
    if mask.q_segments is not None:
        qs = mask.q_segments[:, qi][:, :, None]
        ks = mask.k_segments[:, kj][:, None, :]
        seg = (qs == ks) & (qs >= 0)
        ok = seg if ok is None else ok[None] & seg
    if mask.blocks is not None:
        blocks = mask.blocks.mask.to(qi.device)[:, qi // BLOCK][:, :, kj // BLOCK][None]
        if ok is not None:
            ok = ok[None, None] if ok.dim() == 2 else ok[:, None]
        ok = blocks if ok is None else ok & blocks
    return ok


class Blocks:
    """A pair's block mask (``mask``: (heads or 1, row blocks, column blocks) bool) and the
    index lists the kernels iterate over, built on first use for each band and shape and
    kept: a ring that reuses its pairs' Blocks builds them once for every call."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self._lists: dict = {}

    def lists(self, lo: int, hi: int, n_rows: int, n_cols: int, transpose: bool = False,
              split: Optional[int] = None):
        """``block_lists`` (counts, indices) of the mask (transposed: rows are keys, band
        negated), the columns split at ``split`` when given."""
        key = (lo, hi, n_rows, n_cols, transpose, split)
        if key not in self._lists:
            mask = self.mask.transpose(1, 2) if transpose else self.mask
            self._lists[key] = block_lists(mask, -hi, -lo, n_rows, n_cols, split) if transpose \
                else block_lists(mask, lo, hi, n_rows, n_cols, split)
        return self._lists[key]

    def order(self, lo: int, hi: int, n_rows: int, n_cols: int, transpose: bool, tile: int,
              batch: int, heads: int, group: int = 1, reverse: bool = False,
              chunk: int = 0) -> torch.Tensor:
        """``program_order`` of a launch over these lists, kept like them."""
        key = ("order", lo, hi, n_rows, n_cols, transpose, tile, batch, heads, group, reverse, chunk)
        if key not in self._lists:
            counts = self.lists(lo, hi, n_rows, n_cols, transpose)[0]
            self._lists[key] = program_order(counts, -(-n_rows // tile), tile, batch, heads, group,
                                             reverse, chunk)
        return self._lists[key]


_MEMO: dict = {}


def tensor_memo(t: torch.Tensor, key: tuple, build: Callable[[], object]):
    """``build()``, kept for as long as ``t`` is the same tensor object, unmodified in place
    (its version counter unchanged), and asked for with the same ``key``. What a block
    mask gives the ring (its checksum, the chunk pairs it occupies, each pair's index
    lists) is then computed, and synchronized with the host, once for a training run that
    passes the same mask every step; ``flash_attn`` keeps its Blocks (and index lists) the
    same way."""
    slot = (id(t), key)
    hit = _MEMO.get(slot)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    value = build()  # must not hold t itself, or t would never be freed
    _MEMO[slot] = (weakref.ref(t, lambda _, slot=slot: _MEMO.pop(slot, None)), t._version, value)
    return value


def _classify(blocks: torch.Tensor, lo: int, hi: int, n_rows: int, n_cols: int):
    """(live, every): the blocks computed (nonzero, and the band leaves them something)
    and those the band and the lengths leave whole, over blocks' (Hm, R, C)."""
    _, n_r, n_c = blocks.shape
    dev = blocks.device
    r0 = torch.arange(n_r, device=dev) * BLOCK
    c0 = torch.arange(n_c, device=dev) * BLOCK
    r1, c1 = (r0 + BLOCK).clamp(max=n_rows), (c0 + BLOCK).clamp(max=n_cols)
    diff_min = c0[None, :] - (r1[:, None] - 1)
    diff_max = (c1[None, :] - 1) - r0[:, None]
    some = (diff_max >= lo) & (diff_min <= hi)
    whole = (r1 - r0 == BLOCK)[:, None] & (c1 - c0 == BLOCK)[None, :]
    return blocks & some, (diff_min >= lo) & (diff_max <= hi) & whole


def computed_blocks(blocks: torch.Tensor, lo: int, hi: int, n_rows: int, n_cols: int) -> torch.Tensor:
    """How many (head, row block, column block) a kernel computes under ``blocks`` and the
    band [lo, hi] (as ``block_lists``): an int64 scalar tensor on the mask's device."""
    return _classify(blocks, lo, hi, n_rows, n_cols)[0].sum()


def block_work(blocks: torch.Tensor, lo: int, hi: int, n_rows: int, n_cols: int):
    """The blocks a kernel computes under ``blocks`` and the band [lo, hi] (as
    ``block_lists``), counted over the heads per row block (R,) and per column block (C,):
    int64 tensors on the mask's device."""
    live = _classify(blocks, lo, hi, n_rows, n_cols)[0]
    return live.sum((0, 2)), live.sum((0, 1))


def block_lists(blocks: torch.Tensor, lo: int, hi: int, n_rows: int, n_cols: int,
                split: Optional[int] = None):
    """What a kernel iterates over under a block mask: for every (head, row block), the
    column blocks it computes, partial ones (the band crosses them, or they run past
    n_rows / n_cols: element predicate) first, then full ones (no mask arithmetic).

    blocks (Hm, R, C) bool over row blocks and column blocks of BLOCK; a column c is
    visible to row r only if lo <= c - r <= hi (lo, hi: ints, +-BAND_INF when unbounded).
    Returns counts (2, Hm, R) int32 (partial, full) and indices (Hm, R, C) int32: a row's
    first counts[0] indices are its partial blocks, the next counts[1] its full blocks,
    each group ascending. One pass over the mask per launch, so a kernel's work follows
    the nonzero blocks. With ``split`` (a column, a multiple of BLOCK: columns held in two
    tensors, ``pair.Joined``) the columns before it are listed first and then the
    rest, each part partial then full: counts (4, Hm, R).
    """
    live, every = _classify(blocks, lo, hi, n_rows, n_cols)
    full = live & every
    # sort key: partial, full, ... of each part, not computed last; stable, so each group
    # stays ascending
    parts = 1 if split is None else 2
    part = torch.zeros_like(full) if split is None else \
        (torch.arange(blocks.shape[-1], device=blocks.device) >= split // BLOCK).expand_as(full)
    key = torch.where(live, 2 * part.to(torch.uint8) + full.to(torch.uint8), 2 * parts)
    order = torch.argsort(key, dim=-1, stable=True)
    counts = torch.stack([(key == k).sum(-1, dtype=torch.int32) for k in range(2 * parts)])
    return counts.contiguous(), order.to(torch.int32).contiguous()


def program_order(counts: torch.Tensor, n_tiles: int, tile: int, batch: int, heads: int,
                  group: int = 1, reverse: bool = False, chunk: int = 0) -> torch.Tensor:
    """The order a block-sparse launch runs its programs in: the long ones first.

    A launch's programs are (batch b, head h of ``heads``, tile t of ``tile`` rows), numbered
    (b * heads + h) * n_tiles + t (its grid (n_tiles, batch * heads), tiles fastest). A
    program's work is the blocks its row block lists (``block_lists``' counts (2, Hm, R)),
    summed over the ``group`` list heads it loops over (dK/dV: the query heads of a kv head;
    Hm is heads * group, or 1 for a mask shared by the heads). Launched in that order, a
    row that sees many more blocks than the rest (local + global attention's global rows
    and columns) may start last and run alone at the end of the launch; so the programs
    with more than twice the mean work run first, and the rest keep the natural order
    (tiles reversed with ``reverse``: a causal band's longest tiles first), which keeps a
    head's programs together for the cache. With ``chunk``, the heads arrive in chunks of
    that many (``pair.Arrival``): a chunk's programs (of every batch) run before the
    next chunk's, the long ones first within each. Returns int32 (batch * heads *
    n_tiles): the number of the program to run at each launch position. Built on the
    device, without a host synchronization (a CUDA graph may capture it)."""
    dev = counts.device
    t = torch.arange(n_tiles, device=dev)
    if reverse:
        t = t.flip(0)
    listed = counts.sum(0)[:, t * tile // BLOCK]  # (Hm, T) in launch order
    if listed.shape[0] > 1:
        work = listed.view(heads, group, n_tiles).sum(1)
    else:
        work = (listed * group).expand(heads, n_tiles)
    work = work.repeat(batch, 1).flatten()
    natural = (torch.arange(batch * heads, device=dev)[:, None] * n_tiles + t[None, :]).flatten()
    key = (work.float() <= 2 * work.float().mean()).to(torch.int64)  # the short ones after
    if chunk:
        key = key + 2 * (natural // n_tiles % heads // chunk)  # every batch's first chunk first
    return natural[torch.argsort(key, stable=True)].to(torch.int32).contiguous()


def segment_ranges(rows_seg: torch.Tensor, cols_seg: torch.Tensor) -> torch.Tensor:
    """(3, B, S_rows) int32: for every row, the hull [lo, hi) of the columns that carry its
    segment id (from its first such column to one past its last) and run_end, where the
    run of columns from lo that all carry it ends (run_end < hi: padding columns sit inside
    the hull). Rows whose id no column carries, and padding rows (-1), get lo = S_cols,
    hi = run_end = 0. Needs the non-padding ids of both sides to be non-decreasing; the
    kernels turn these into each row's interval of columns (triton/tiles.py, ``_row_bounds``)."""
    n_cols = cols_seg.shape[1]
    cols = cols_seg.contiguous()
    rows = rows_seg.contiguous()
    # Non-decreasing stand-ins for the columns: padding takes the id before it (ahead) or
    # the id after it (behind; past the last id, the largest int). The first column of id
    # >= a in the one and the first of id > a in the other bound a's columns.
    ahead = torch.cummax(cols, dim=1).values.contiguous()
    behind = torch.where(cols < 0, torch.iinfo(cols.dtype).max, cols)
    behind = torch.flip(torch.cummin(torch.flip(behind, (1,)), dim=1).values, (1,)).contiguous()
    lo = torch.searchsorted(ahead, rows, side="left")
    hi = torch.searchsorted(behind, rows, side="right")
    # Where each column's run of equal raw ids ends, read at the row's first column.
    idx = torch.arange(n_cols, device=cols.device).expand_as(cols)
    last_of_run = torch.ones_like(cols, dtype=torch.bool)
    last_of_run[:, :-1] = cols[:, 1:] != cols[:, :-1]
    run_end = torch.where(last_of_run, idx + 1, n_cols)
    run_end = torch.flip(torch.cummin(torch.flip(run_end, (1,)), dim=1).values, (1,))
    run_end = torch.gather(run_end, 1, lo.clamp(max=n_cols - 1))
    some = (lo < hi) & (rows >= 0)
    lo = torch.where(some, lo, n_cols)
    hi = torch.where(some, hi, 0)
    return torch.stack([lo, hi, torch.where(some, run_end, 0)]).to(torch.int32).contiguous()


def segment_tiles(ranges: torch.Tensor, n_cols: int, rows_block: int = BLOCK, cols_block: int = BLOCK) -> torch.Tensor:
    """(B, S_rows / rows_block, 4) int32 [start, u0, u1, end] per tile of ``rows_block``
    rows, from ``segment_ranges``' (3, B, S_rows) and the columns' count (a multiple of
    ``cols_block``), in tiles of ``cols_block`` columns: the column tiles [start, end) hold a
    column some row of the tile sees, and every row sees every column of tiles [u0, u1) (all
    inside its first run: no mask needed there); start <= u0 <= u1 <= end, and start = end
    where no row sees anything. The Gluon kernels narrow their band's walk with them
    (kernels/gluon/tiles.py): the forward's rows are queries, the backward's keys."""
    lo, hi, run_end = (x.reshape(x.shape[0], -1, rows_block).long() for x in ranges)
    n_tiles = n_cols // cols_block
    start = (lo.amin(-1) // cols_block).clamp(max=n_tiles)
    end = torch.maximum((hi.amax(-1) + cols_block - 1) // cols_block, start)
    u0 = torch.minimum(torch.maximum((lo.amax(-1) + cols_block - 1) // cols_block, start), end)
    u1 = torch.minimum(torch.maximum(run_end.amin(-1) // cols_block, u0), end)
    return torch.stack([start, u0, u1, end], dim=-1).to(torch.int32).contiguous()
