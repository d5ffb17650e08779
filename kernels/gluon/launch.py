"""The host side of the Gluon Hopper kernels: for the backward (kernels/gluon/bwd.py) its
argument checks (``unsupported``), TMA descriptors and launch (``attn_bwd_sm90``) and its
compile for sm_90 on any machine (``compile_sm90``); the same for the forward
(kernels/gluon/fwd.py: ``fwd_unsupported``, ``attn_fwd_sm90``, ``compile_fwd_sm90``)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .. import dropout
from ..masks import BAND_INF, BLOCK, Blocks, segment_ranges, segment_tiles, tensor_memo
from ..triton.launch import _stand_in
from ..triton.segments import _ranges, segment_tiles as triton_segment_tiles
from . import fwd
from .bwd import BLOCK_M, BLOCK_N, DQ_COLS, HEAD_DIMS, _attn_bwd_sm90_kernel

LOG2E = math.log2(math.e)
NUM_WARPS = 4  # the default partition: consumer group 0
MAXNREG = 168  # 12 warps (4 + 4 + 1 + 1, padded to warp groups) share 64K registers
CONSUMER_REGS = 240  # 2 x 128 threads x 240 + 128 x 24 <= 65536
WORKER_REGS = 24
DET_ROUND = 16  # deterministic: K tiles of a head dispatched together (the kernel's grid)
FWD_STAGES = 2  # the forward's K and V stages


def _layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def _descriptors(q, k, v, dout, lse, delta, dq_acc):
    """TMA descriptors: (B, S, H, D) tensors through their own strides in boxes of one
    (batch, head) and BLOCK_M (q, dout, dq_acc) or BLOCK_N (k, v) rows; lse and delta
    (contiguous) as flat vectors read BLOCK_M at a time."""

    def rows(t, n, cols=q.shape[-1], dtype=gl.bfloat16):
        block = [1, n, 1, cols]
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _layout(block, dtype))

    def flat(t):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
        return TensorDescriptor(t, [t.numel()], [1], [BLOCK_M.value], layout)

    m, n = BLOCK_M.value, BLOCK_N.value
    return (rows(q, m), rows(k, n), rows(v, n), rows(dout, m), flat(lse), flat(delta),
            rows(dq_acc, m, DQ_COLS.value, gl.float32))


def _scalar_error(fn: str, softmax_scale, causal_offset, band_lo) -> Optional[Exception]:
    """The scale and the band's edges, as either kernel takes them (``fn`` names it)."""
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        return ValueError(f"{fn}: softmax_scale must be a positive finite number, got {softmax_scale!r}")
    for name, value, rule in (("causal_offset", causal_offset, "iff j <= i + causal_offset"),
                              ("band_lo", band_lo, "only if j >= i + band_lo")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return TypeError(f"{fn}: {name} must be an int or None (key j seen by query i {rule}), got "
                             f"{type(value).__name__}")
    return None


def _shape_error(fn: str, q, k, head_dims) -> Optional[Exception]:
    """q (B, Sq, H, D) and k (B, Sk, Hkv, D) as either kernel takes them: D in head_dims,
    a batch and heads, Sq and Sk positive multiples of 128, Hkv dividing H."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            return ValueError(f"{fn}: {name} must be (B, S, H, D), got shape {tuple(t.shape)}")
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if d not in head_dims:
        return ValueError(f"{fn}: q's head_dim must be one of {head_dims}, got {d}")
    if b == 0 or h == 0:
        return ValueError(f"{fn}: q must have a batch and heads, got shape {tuple(q.shape)}")
    for name, s in (("q", sq), ("k", sk)):
        if s == 0 or s % BLOCK_N.value:
            return ValueError(f"{fn}: {name}'s seqlen must be a positive multiple of {BLOCK_N.value}, got {s}")
    if k.shape[0] != b or k.shape[3] != d or hkv == 0 or h % hkv:
        return ValueError(f"{fn}: k must be (B, Sk, Hkv, D) with q's B = {b}, D = {d} and Hkv dividing H = {h}, got "
                          f"{tuple(k.shape)}")
    return None


def _tma_error(fn: str, name: str, t) -> Optional[Exception]:
    if t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
        return ValueError(f"{fn}: {name}'s address and strides {t.stride()} must be multiples of 16 bytes (TMA)")
    return None


def _device_error(fn: str, q) -> Optional[Exception]:
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return ValueError(f"{fn}: q is on {q.device}; this kernel runs on a Hopper (sm_90) GPU")
    return None


def _segments_error(fn: str, q, k, q_segments, k_segments) -> Optional[Exception]:
    """The segment ids, as either kernel takes them: both or neither, int32 (B, Sq) and
    (B, Sk) on q's device."""
    if (q_segments is None) != (k_segments is None):
        return ValueError(f"{fn}: q_segments and k_segments go together (both or neither)")
    if q_segments is None:
        return None
    for name, t, rows in (("q_segments", q_segments, q.shape[1]), ("k_segments", k_segments, k.shape[1])):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            return TypeError(f"{fn}: {name} must be int32, got {t.dtype}")
        if tuple(t.shape) != (q.shape[0], rows):
            return ValueError(f"{fn}: {name} must have shape {(q.shape[0], rows)}, got {tuple(t.shape)}")
        if t.device != q.device:
            return ValueError(f"{fn}: {name} is on {t.device}, q on {q.device}")
    return None


def _segment_args(q_segments, k_segments, seqlen_q: int, seqlen_k: int, device, keys_outer: bool) -> tuple:
    """A kernel's six segment arguments: two int32 (B, S) tensors with contiguous rows, their
    batch strides, and ``masks.segment_tiles`` with its batch stride. The forward's: the
    queries' and keys' ids, and tiles of 128 queries over 128 keys. The backward's
    (``keys_outer``): each key's hull of queries [lo, hi) (``masks.segment_ranges`` of the
    keys against the queries), and tiles of 128 keys over 64 queries. The ranges come from
    the Triton kernels' (on a GPU) and are kept while one tensor of ids for queries and
    keys is passed again; int32 stand-ins without segments."""
    if q_segments is None:
        none = _stand_in(device)
        return none, none, 0, 0, none, 0
    q_ids, k_ids = q_segments.contiguous(), k_segments.contiguous()
    rows, cols, n_cols, block = (k_ids, q_ids, seqlen_q, BLOCK_M.value) if keys_outer else (q_ids, k_ids, seqlen_k, 128)

    def build():
        if not rows.is_cuda:  # the compile's, on the CPU
            ranges = segment_ranges(rows, cols)
            return ranges, segment_tiles(ranges, n_cols, cols_block=block)
        ranges = _ranges(rows, cols, True)
        return ranges, triton_segment_tiles(ranges, n_cols, BLOCK, block)  # one launch, not ~20

    ranges, tiles = tensor_memo(q_ids, ("segment_tiles", n_cols, keys_outer), build) if q_ids is k_ids else build()
    a, b = (ranges[0], ranges[1]) if keys_outer else (q_ids, k_ids)
    return a, b, a.stride(0), b.stride(0), tiles, tiles.stride(0)


def _blocks_error(fn: str, q, k, blocks, deterministic: bool, segments: bool) -> Optional[Exception]:
    """A block mask as either kernel takes it (``fn`` names it): a ``masks.Blocks`` over (1
    or H, Sq / 128, Sk / 128) blocks on q's device, without segment ids or ``deterministic``."""
    if blocks is None:
        return None
    if not isinstance(blocks, Blocks):
        return TypeError(f"{fn}: blocks must be a kernels.masks.Blocks, got {type(blocks).__name__}")
    if segments or deterministic:
        return ValueError(f"{fn}: blocks with {'segment ids' if segments else 'deterministic'} is not "
                          f"served (the Triton kernels serve it)")
    shape = tuple(blocks.mask.shape)
    rows, cols = -(-q.shape[1] // BLOCK), -(-k.shape[1] // BLOCK)
    if len(shape) != 3 or shape[0] not in (1, q.shape[2]) or shape[1:] != (rows, cols):
        return ValueError(f"{fn}: blocks.mask must be (1 or heads, {rows}, {cols}) over blocks of {BLOCK}, "
                          f"got {shape}")
    if blocks.mask.dtype != torch.bool or blocks.mask.device != q.device:
        return ValueError(f"{fn}: blocks.mask must be bool on q's device {q.device}, got "
                          f"{blocks.mask.dtype} on {blocks.mask.device}")
    return None


def _block_args(blocks, causal_offset, band_lo, q, k, keys_outer: bool) -> tuple:
    """A kernel's block-list arguments: ``Blocks.lists`` under the band (the backward's,
    ``keys_outer``, transposed: a row a key block, its query blocks; the forward's a row a
    query block), its counts and indices, the counts' partial / full stride, a query
    head's rows apart in them (0: one mask for every head), the indices' row length; the
    forward's also the order its CTAs run in (``Blocks.order``: Q tiles of (batch, head),
    the long rows first, under the band the last tiles first). The backward keeps its
    grid's order: a tile number loaded from memory stays live in its consumers, which
    have no registers for it (tests/test_gluon_compile.py saw the block variants' loops
    spill). int32 stand-ins without a block mask."""
    if blocks is None:
        none = _stand_in(q.device)
        return (none, none, 0, 0, 0) + (() if keys_outer else (none,))
    b, sq, h = q.shape[:3]
    sk = k.shape[1]
    lo = -BAND_INF if band_lo is None else band_lo
    hi = BAND_INF if causal_offset is None else causal_offset
    if keys_outer:
        counts, index = blocks.lists(lo, hi, sk, sq, transpose=True)
        order = ()
    else:
        counts, index = blocks.lists(lo, hi, sq, sk)
        order = (blocks.order(lo, hi, sq, sk, False, BLOCK, b, h, reverse=causal_offset is not None),)
    heads, rows, cols = index.shape
    return (counts, index, counts.stride(0), rows if heads > 1 else 0, cols) + order


def unsupported(dout, q, k, v, lse, delta, dq_acc, dk, dv, softmax_scale, causal_offset,
                accumulate: bool = False, band_lo: Optional[int] = None, deterministic: bool = False,
                q_segments=None, k_segments=None, blocks=None, dropout_p: float = 0.0,
                pos=None) -> Optional[Exception]:
    """Why this kernel cannot take these arguments: a TypeError / ValueError naming the
    argument (the module's docstring says what it serves), or None. ``dq_acc`` None: not
    checked (a caller about to allocate it; ``kernels/dispatch.py``)."""
    named = dict(dout=dout, q=q, k=k, v=v, lse=lse, delta=delta, dq_acc=dq_acc, dk=dk, dv=dv)
    if dq_acc is None:
        del named["dq_acc"]
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            return TypeError(f"attn_bwd_sm90: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name in ("dout", "q", "k", "v"):
        if named[name].dtype != torch.bfloat16:
            return TypeError(f"attn_bwd_sm90: {name} must be bfloat16, got {named[name].dtype}")
    for name in ("dk", "dv"):
        allowed = (torch.float32,) if accumulate else (torch.bfloat16, torch.float32)
        if named[name].dtype not in allowed:
            return TypeError(f"attn_bwd_sm90: {name} must be {' or '.join(str(t) for t in allowed)}"
                             f"{' (accumulate adds into fp32 sums)' if accumulate else ''}, got {named[name].dtype}")
    for name in ("lse", "delta", "dq_acc"):
        if name in named and named[name].dtype != torch.float32:
            return TypeError(f"attn_bwd_sm90: {name} must be float32, got {named[name].dtype}")
    error = (_scalar_error("attn_bwd_sm90", softmax_scale, causal_offset, band_lo)
             or _shape_error("attn_bwd_sm90", q, k, HEAD_DIMS)
             or _segments_error("attn_bwd_sm90", q, k, q_segments, k_segments)
             or _blocks_error("attn_bwd_sm90", q, k, blocks, deterministic, q_segments is not None)
             or _dropout_error("attn_bwd_sm90", dropout_p, pos, deterministic, blocks))
    if error is not None:
        return error
    if deterministic and q_segments is not None:
        return ValueError("attn_bwd_sm90: deterministic with segment ids is not served (the Triton backward "
                          "repeats its bits)")
    b, sq, h, _ = q.shape
    hkv = k.shape[2]
    for name, like in (("dout", "q"), ("dq_acc", "q"), ("v", "k"), ("dk", "k"), ("dv", "k")):
        if name in named and tuple(named[name].shape) != tuple(named[like].shape):
            return ValueError(f"attn_bwd_sm90: {name} must have {like}'s shape {tuple(named[like].shape)}, got "
                              f"{tuple(named[name].shape)}")
    for name in ("lse", "delta"):
        if tuple(named[name].shape) != (b, h, sq):
            return ValueError(f"attn_bwd_sm90: {name} must be (B, H, Sq) = {(b, h, sq)}, got "
                              f"{tuple(named[name].shape)}")
    for name, t in named.items():
        if t.device != q.device:
            return ValueError(f"attn_bwd_sm90: {name} is on {t.device}, q on {q.device}")
        if t.stride(-1) != 1:
            return ValueError(f"attn_bwd_sm90: {name} must have a contiguous last dimension, strides {t.stride()}")
    for name in (name for name in ("dout", "q", "k", "v", "dq_acc", "dk", "dv") if name in named):
        t = named[name]
        if (error := _tma_error("attn_bwd_sm90", name, t)) is not None:
            return error
        if t.stride(1) * BLOCK_N.value >= 2 ** 31:
            return ValueError(f"attn_bwd_sm90: {name}'s row stride {t.stride(1)} is too large (offsets "
                              f"inside a tile are 32-bit)")
    if b * hkv > 65535:
        return ValueError(f"attn_bwd_sm90: batch x kv heads = {b * hkv}: the launch grid's y takes at most 65535")
    if b * h * sq >= 2 ** 31:
        return ValueError(f"attn_bwd_sm90: lse and delta hold {b * h * sq} elements, TMA takes < 2**31")
    return _device_error("attn_bwd_sm90", q)


def _dropout_error(kernel: str, dropout_p, pos, deterministic: bool, blocks) -> Optional[Exception]:
    """Dropout as the Gluon kernels take it (kernels/gluon/dropout.py): not with deterministic
    or a block mask, positions ``PairMask.pos`` = (q0, k0, 1, jump) with q0 % 16 == 0 and k0
    and jump multiples of 32 (runs whose bits lie in one thread's registers)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        return ValueError(f"{kernel}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_p == 0:
        return None
    if deterministic or blocks is not None:
        return ValueError(f"{kernel}: dropout with {'deterministic' if deterministic else 'blocks'} is not "
                          f"served (the Triton kernels serve it)")
    if pos is None or len(pos) != 4 or not all(isinstance(x, int) and not isinstance(x, bool) for x in pos):
        return ValueError(f"{kernel}: dropout needs pos = (q0, k0, stride, jump) ints (PairMask.pos), got {pos!r}")
    q0, k0, stride, jump = pos
    if stride != 1 or q0 % 16 or k0 % 32 or jump % 32 or min(q0, k0, jump) < 0:
        return ValueError(f"{kernel}: dropout needs pos with stride 1, q0 a multiple of 16, k0 and jump of 32 "
                          f"(every call's bits in one thread's registers), got {pos!r}")
    return None


def _dropout_args(dropout_p: float, seed: int, pos, head0: int) -> tuple:
    """The kernel's eight dropout arguments, int32 (one compile whatever the values): the
    seed's low and high words, the threshold, the kept scale, head0, q0, k0, jump."""
    if dropout_p == 0:
        return (0, 0, 0, 1.0, 0, 0, 0, 0)
    q0, k0, _, jump = pos

    def i32(x):
        x &= 0xFFFFFFFF
        return x - 2 ** 32 if x >= 2 ** 31 else x
    return (i32(seed), i32(seed >> 32), dropout.threshold(dropout_p), dropout.keep_scale(dropout_p), i32(head0),
            i32(q0), i32(k0), i32(jump))


def _check(*args) -> None:
    error = unsupported(*args)
    if error is not None:
        raise error


def _kernel_offset(causal_offset, seqlen_q, seqlen_k) -> int:
    """causal_offset (or band_lo) clamped to [-Sq, Sk] (the same visible pairs: j - i lies
    in [-(Sq - 1), Sk - 1]), so the kernel's int32 index arithmetic cannot overflow; 0
    without the edge (not read)."""
    return 0 if causal_offset is None else max(-seqlen_q, min(causal_offset, seqlen_k))


def attn_bwd_sm90(dout, q, k, v, lse, delta, dq_acc, dk, dv, softmax_scale: float,
                  causal_offset: Optional[int] = None, accumulate: bool = False, deterministic: bool = False,
                  band_lo: Optional[int] = None, q_segments=None, k_segments=None, blocks=None,
                  dropout_p: float = 0.0, seed: int = 0, pos=None, dropout_head0: int = 0):
    """The backward of one (query block, key block) pair (head_dim 64 or 128, bf16):
    ``dq_acc += scale * dQ`` (fp32), dk = scale * dK and dv = dV written (bf16 or fp32), or
    with ``accumulate`` added into dk and dv (fp32 sums). ``deterministic``: the dQ adds
    into each Q tile come in a fixed order of K tiles (counters in a (B, H, Sq / 64) int32
    buffer allocated here), so dq_acc's bits repeat run to run; dk and dv repeat theirs
    either way.

    q, dout, dq_acc (B, Sq, H, D); k, v, dk, dv (B, Sk, Hkv, D), D 64 or 128, Hkv dividing H.
    lse (natural log, the FINAL one of these queries) and delta (rowsum(out * dout),
    kernels.attn_delta) are (B, H, Sq) fp32 (copied if not contiguous). causal_offset:
    None sees every key; an int o lets query i see key j iff j <= i + o (PairMask.causal,
    o = q_start - k_start for two blocks of one sequence). band_lo: a window's lower edge,
    key j seen only if j >= i + band_lo (PairMask.band_lo). q_segments (B, Sq), k_segments
    (B, Sk) int32, both or neither (not with deterministic): key j seen only if its id
    equals query i's (``attn_fwd_sm90``'s). blocks (not with segment ids or deterministic):
    a ``kernels.masks.Blocks`` over (1 or H, Sq / 128, Sk / 128) blocks of 128 queries by 128
    keys; the pairs of a False block are never computed (block-sparse attention), those of
    a True one follow the band. dropout_p, seed, pos, dropout_head0: attention dropout as
    ``PairMask`` has it (kernels/dropout.py's bits; not with deterministic or blocks; pos
    (q0, k0, 1, jump) with q0 % 16 == k0 % 32 == jump % 32 == 0). Returns (dq_acc, dk, dv)."""
    _check(dout, q, k, v, lse, delta, dq_acc, dk, dv, softmax_scale, causal_offset, accumulate, band_lo,
           deterministic, q_segments, k_segments, blocks, dropout_p, pos)
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    lse, delta = lse.contiguous(), delta.contiguous()
    # the dQ adds' counters; without deterministic any pointer (not read)
    turns = torch.zeros(b * h * (sq // BLOCK_M.value), dtype=torch.int32, device=q.device) if deterministic else lse
    _attn_bwd_sm90_kernel[_grid(sk // BLOCK_N.value, b * hkv, deterministic)](
        *_descriptors(q, k, v, dout, lse, delta, dq_acc), dk, dv, dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), h, hkv, sq, _kernel_offset(causal_offset, sq, sk),
        _kernel_offset(band_lo, sq, sk), softmax_scale * LOG2E, softmax_scale, turns,
        *_segment_args(q_segments, k_segments, sq, sk, q.device, keys_outer=True),
        *_block_args(blocks, causal_offset, band_lo, q, k, keys_outer=True),
        *_dropout_args(dropout_p, seed, pos, dropout_head0), h // hkv,
        causal_offset is not None, band_lo is not None, q_segments is not None, bool(accumulate), bool(deterministic),
        blocks is not None, dropout_p > 0, CONSUMER_REGS, WORKER_REGS, num_warps=NUM_WARPS, maxnreg=MAXNREG)
    return dq_acc, dk, dv


def _grid(k_tiles: int, heads: int, deterministic: bool) -> tuple[int, int, int]:
    """(R, heads, k_tiles / R): rounds of R K tiles of every head (the kernel's docstring);
    one round by default, DET_ROUND or the largest power of two below it dividing k_tiles
    when deterministic."""
    rounds = DET_ROUND
    while k_tiles % rounds:
        rounds //= 2
    rounds = rounds if deterministic else k_tiles
    return rounds, heads, k_tiles // rounds


def _stand_in_ids(segments: bool, seqlen_q: int, seqlen_k: int) -> tuple:
    """The CPU compile's (q_segments, k_segments): int32 zeros, or None without segments."""
    if not segments:
        return None, None
    return torch.zeros(1, seqlen_q, dtype=torch.int32), torch.zeros(1, seqlen_k, dtype=torch.int32)


def _stand_in_blocks(blocks: bool, heads: int, seqlen_q: int, seqlen_k: int) -> Optional[Blocks]:
    """The CPU compile's block mask: every block of every head, or None without one."""
    return Blocks(torch.ones(heads, -(-seqlen_q // BLOCK), -(-seqlen_k // BLOCK), dtype=torch.bool)) if blocks else None


def compile_sm90(consumer_regs: int = CONSUMER_REGS, worker_regs: int = WORKER_REGS, maxnreg: int = MAXNREG,
                 causal_offset: Optional[int] = None, heads: int = 4, kv_heads: int = 4, seqlen_q: int = 1024,
                 seqlen_k: int = 1024, accumulate: bool = False, deterministic: bool = False,
                 band_lo: Optional[int] = None, head_dim: int = 128, segments: bool = False,
                 blocks: bool = False, dropout: bool = False):
    """The kernel compiled for sm_90 on any machine, no GPU needed (triton ships ptxas):
    its ``.asm`` holds "ttgir", "ptx", "cubin"; ``.metadata.shared`` its shared memory in
    bytes. Specialized as ``attn_bwd_sm90`` would specialize it on contiguous (1, seqlen_q,
    heads, head_dim) q and (1, seqlen_k, kv_heads, head_dim) k inputs with this causal_offset, band_lo,
    accumulate (dk, dv then fp32), deterministic, ``segments`` segment ids, ``blocks`` a
    block mask, one per head, and ``dropout`` (p = 0.1) (CPU stand-ins: only their types, alignments and strides are
    read; as in a launch, an int argument equal to 1, e.g. kv_heads, is compiled in as a
    constant, and those divisible by 16 are marked so)."""
    q = torch.zeros(1, seqlen_q, heads, head_dim, dtype=torch.bfloat16)
    k = torch.zeros(1, seqlen_k, kv_heads, head_dim, dtype=torch.bfloat16)
    stats = torch.zeros(1, heads, seqlen_q)
    dkv = k.float() if accumulate else k
    values = (*_descriptors(q, k, k, q, stats, stats, torch.zeros(q.shape)), dkv, dkv, *k.stride()[:3], *k.stride()[:3],
              heads, kv_heads, seqlen_q, _kernel_offset(causal_offset, seqlen_q, seqlen_k),
              _kernel_offset(band_lo, seqlen_q, seqlen_k), 0.1 * LOG2E, 0.1,
              torch.zeros(heads * seqlen_q // BLOCK_M.value, dtype=torch.int32) if deterministic else stats,
              *_segment_args(*_stand_in_ids(segments, seqlen_q, seqlen_k), seqlen_q, seqlen_k, q.device,
                             keys_outer=True),
              *_block_args(_stand_in_blocks(blocks, heads, seqlen_q, seqlen_k), causal_offset, band_lo, q, k,
                           keys_outer=True),
              *_dropout_args(0.1 if dropout else 0.0, 0x123456789AB, (4096, 8192, 1, 0), 0))
    consts = dict(GROUP=heads // kv_heads, CAUSAL=causal_offset is not None, LOWER=band_lo is not None,
                  SEGMENTS=segments, ADD=accumulate, DETERMINISTIC=deterministic, BLOCKS=blocks, DROPOUT=dropout,
                  CONSUMER_REGS=consumer_regs, WORKER_REGS=worker_regs)
    return _compile(_attn_bwd_sm90_kernel, values, consts, maxnreg)


def _compile(kernel, values, consts: dict, maxnreg: int):
    """``kernel`` compiled for sm_90 without a GPU, its arguments specialized from
    ``values`` as the JIT's launch would specialize them (an int equal to 1 compiled in as
    a constant, those divisible by 16 marked so)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, attrs, consts = {}, {}, dict(consts)
    for i, (name, value) in enumerate(zip(kernel.arg_names, values)):
        sig[name], spec = native_specialize_impl(CUDABackend, value, False, not kernel.params[i].do_not_specialize,
                                                 True)
        if sig[name] == "constexpr":
            consts[name] = spec  # an int equal to 1
        elif isinstance(spec, str) and spec:
            attrs[(i,)] = CUDABackend.parse_attr(spec)  # e.g. tt.divisibility 16
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=NUM_WARPS, maxnreg=maxnreg))


# ----------------------------------------------------------------------------- the forward


def _fwd_descriptors(q, k, v):
    """TMA descriptors of q (boxes of 64 rows: a consumer group's half) and k, v (128)."""

    def rows(t, n):
        block = [1, n, 1, t.shape[-1]]
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _layout(block, gl.bfloat16))

    return rows(q, 64), rows(k, fwd.BLOCK_N.value), rows(v, fwd.BLOCK_N.value)


def fwd_unsupported(q, k, v, out, lse, softmax_scale, causal_offset, accumulate: bool = False,
                    out_in=None, band_lo: Optional[int] = None, q_segments=None,
                    k_segments=None, blocks=None, dropout_p: float = 0.0, pos=None) -> Optional[Exception]:
    """Why the forward cannot take these arguments: a TypeError / ValueError naming the
    argument (kernels/gluon/fwd.py's docstring says what it serves), or None."""
    named = dict(q=q, k=k, v=v, out=out, lse=lse)
    if out_in is not None:
        named["out_partial"] = out_in
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            return TypeError(f"attn_fwd_sm90: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name in ("q", "k", "v"):
        if named[name].dtype != torch.bfloat16:
            return TypeError(f"attn_fwd_sm90: {name} must be bfloat16, got {named[name].dtype}")
    if lse.dtype != torch.float32:
        return TypeError(f"attn_fwd_sm90: lse must be float32, got {lse.dtype}")
    for name in ("out", "out_partial"):
        if name in named and not named[name].dtype.is_floating_point:
            return TypeError(f"attn_fwd_sm90: {name} must be a float tensor, got {named[name].dtype}")
    error = (_scalar_error("attn_fwd_sm90", softmax_scale, causal_offset, band_lo)
             or _shape_error("attn_fwd_sm90", q, k, fwd.HEAD_DIMS)
             or _segments_error("attn_fwd_sm90", q, k, q_segments, k_segments)
             or _blocks_error("attn_fwd_sm90", q, k, blocks, False, q_segments is not None)
             or _dropout_error("attn_fwd_sm90", dropout_p, pos, False, blocks))
    if error is not None:
        return error
    b, sq, h, _ = q.shape
    for name, want in (("v", k.shape), ("out", q.shape), ("out_partial", q.shape), ("lse", (b, h, sq))):
        if name in named and tuple(named[name].shape) != tuple(want):
            return ValueError(f"attn_fwd_sm90: {name} must have shape {tuple(want)}, got {tuple(named[name].shape)}")
    if out_in is not None and not accumulate:
        return ValueError("attn_fwd_sm90: out_partial is read only with accumulate=True")
    if out_in is not None and out_in.stride() != out.stride():
        return ValueError(f"attn_fwd_sm90: out_partial must have out's strides {out.stride()}, got {out_in.stride()}")
    for name, t in named.items():
        if t.device != q.device:
            return ValueError(f"attn_fwd_sm90: {name} is on {t.device}, q on {q.device}")
        if name != "lse" and t.stride(-1) != 1:
            return ValueError(f"attn_fwd_sm90: {name} must have a contiguous last dimension, strides {t.stride()}")
    for name in ("q", "k", "v"):
        if (error := _tma_error("attn_fwd_sm90", name, named[name])) is not None:
            return error
    if out.stride(1) * 64 >= 2 ** 31:
        return ValueError(f"attn_fwd_sm90: out's row stride {out.stride(1)} is too large (offsets inside a tile "
                          f"are 32-bit)")
    if b * h > 65535:
        return ValueError(f"attn_fwd_sm90: batch x heads = {b * h}: the launch grid's y takes at most 65535")
    return _device_error("attn_fwd_sm90", q)


def _fwd_args(q, k, v, out, lse, softmax_scale, causal_offset, out_in, band_lo, q_segments=None, k_segments=None,
              blocks=None, dropout_p: float = 0.0, seed: int = 0, pos=None, dropout_head0: int = 0):
    b, sq, h, _ = q.shape
    return (*_fwd_descriptors(q, k, v), out, out if out_in is None else out_in, lse, *out.stride()[:3], *lse.stride(),
            h, h // k.shape[2], k.shape[1], _kernel_offset(causal_offset, sq, k.shape[1]),
            _kernel_offset(band_lo, sq, k.shape[1]), softmax_scale * LOG2E,
            *_segment_args(q_segments, k_segments, sq, k.shape[1], q.device, keys_outer=False),
            *_block_args(blocks, causal_offset, band_lo, q, k, keys_outer=False),
            *_dropout_args(dropout_p, seed, pos, dropout_head0))


def attn_fwd_sm90(q, k, v, out, lse, softmax_scale: float, causal_offset: Optional[int] = None,
                  accumulate: bool = False, out_partial=None, band_lo: Optional[int] = None, q_segments=None,
                  k_segments=None, blocks=None, dropout_p: float = 0.0, seed: int = 0, pos=None,
                  dropout_head0: int = 0):
    """The forward of one (query block, key block) pair (head_dim 128, bf16): out and lse
    written, or with ``accumulate`` merged with the running ones (normalized out, its lse;
    -inf for none yet) and written in place; ``out_partial``: with accumulate, the running
    out to merge with when it is not ``out`` itself (same shape and strides).

    q, out (B, Sq, H, 128) (out any float dtype); k, v (B, Sk, Hkv, 128), Hkv dividing H;
    lse (B, H, Sq) fp32, natural log, any strides. causal_offset: None sees every key; an
    int o lets query i see key j iff j <= i + o (PairMask.causal). band_lo: a window's
    lower edge, key j seen only if j >= i + band_lo (PairMask.band_lo). q_segments (B, Sq)
    and k_segments (B, Sk) int32, both or neither: packed documents, key j seen by query i
    only if their ids are equal (ids < 0: padding, seeing and seen by nothing; the
    non-negative ids non-decreasing along each row, as ``masks.segment_ranges`` needs). A
    row that sees no key (and had none) gets out 0 and lse -inf. blocks (not with segment
    ids): a ``kernels.masks.Blocks``, as ``attn_bwd_sm90``'s. dropout_p, seed, pos,
    dropout_head0: attention dropout as ``PairMask`` has it and ``attn_bwd_sm90`` takes it
    (kernels/dropout.py's bits; not with blocks; pos (q0, k0, 1, jump) with q0 % 16 == k0 %
    32 == jump % 32 == 0): the kept probabilities scaled, the dropped ones zeroed before
    P V, lse that of the undropped scores. Returns (out, lse)."""
    error = fwd_unsupported(q, k, v, out, lse, softmax_scale, causal_offset, accumulate, out_partial, band_lo,
                            q_segments, k_segments, blocks, dropout_p, pos)
    if error is not None:
        raise error
    b, sq, h, _ = q.shape
    fwd._attn_fwd_sm90_kernel[(sq // fwd.BLOCK_M.value, b * h)](
        *_fwd_args(q, k, v, out, lse, softmax_scale, causal_offset, out_partial, band_lo, q_segments, k_segments,
                   blocks, dropout_p, seed, pos, dropout_head0),
        causal_offset is not None, band_lo is not None, q_segments is not None, bool(accumulate), blocks is not None,
        dropout_p > 0, FWD_STAGES, CONSUMER_REGS, WORKER_REGS, num_warps=NUM_WARPS, maxnreg=MAXNREG)
    return out, lse


def compile_fwd_sm90(causal_offset: Optional[int] = None, heads: int = 4, kv_heads: int = 4, seqlen_q: int = 1024,
                     seqlen_k: int = 1024, accumulate: bool = False, out_dtype=torch.bfloat16,
                     stages: Optional[int] = None, head_dim: int = 128, band_lo: Optional[int] = None,
                     segments: bool = False, consumer_regs: int = CONSUMER_REGS, maxnreg: int = MAXNREG,
                     blocks: bool = False, dropout: bool = False):
    """The forward compiled for sm_90 on any machine, as ``attn_fwd_sm90`` would specialize
    it on contiguous (1, seqlen_q, heads, 128) q and (1, seqlen_k, kv_heads, 128) k, v, an
    out of ``out_dtype`` and with ``segments`` segment ids or ``blocks`` a block mask, one
    per head, and ``dropout`` (p = 0.1) (CPU stand-ins: only their types, alignments and
    strides are read)."""
    stages = FWD_STAGES if stages is None else stages
    q = torch.zeros(1, seqlen_q, heads, head_dim, dtype=torch.bfloat16)
    k = torch.zeros(1, seqlen_k, kv_heads, head_dim, dtype=torch.bfloat16)
    out, lse = torch.zeros(q.shape, dtype=out_dtype), torch.zeros(1, heads, seqlen_q)
    values = _fwd_args(q, k, k, out, lse, 0.1, causal_offset, out if accumulate else None, band_lo,
                       *_stand_in_ids(segments, seqlen_q, seqlen_k),
                       _stand_in_blocks(blocks, heads, seqlen_q, seqlen_k), 0.1 if dropout else 0.0, 0x123456789AB,
                       (4096, 8192, 1, 0), 0)
    consts = dict(CAUSAL=causal_offset is not None, LOWER=band_lo is not None, SEGMENTS=segments,
                  ACCUMULATE=accumulate, BLOCKS=blocks, DROPOUT=dropout, STAGES=stages, CONSUMER_REGS=consumer_regs,
                  WORKER_REGS=WORKER_REGS)
    return _compile(fwd._attn_fwd_sm90_kernel, values, consts, maxnreg)
