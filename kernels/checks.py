"""Argument checks shared by every entry point (flash_attn, the ring, the layer): each
raises TypeError/ValueError naming the argument and what was expected."""

import math
from typing import Optional

import torch

from .masks import BAND_INF, BLOCK, tensor_memo

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_INT32_MAX = 2 ** 31 - 1


def check_qkv(q, k, v) -> None:
    """Validate q (B, Sq, H, D) and k, v (B, Sk, Hkv, D); raise TypeError/ValueError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[0] == 0:
        raise ValueError("batch must be at least 1, got 0")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    if not 1 <= q.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {q.shape[3]}")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(f"heads must be at least 1, got q: {q.shape[2]}, k and v: {k.shape[2]}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q's heads ({q.shape[2]}) must be a multiple of k's and v's heads ({k.shape[2]})")
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(f"seqlen must be at least 1, got q: {q.shape[1]}, k: {k.shape[1]}")


def resolve_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    return float(softmax_scale)


def check_causal(causal) -> bool:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return causal


def check_window(window_size) -> tuple[int, int]:
    """(left, right), each an int >= -1 (-1: unbounded on that side). A side of 2**30
    tokens or more reaches past any sequence the kernels take and becomes -1: the kernels'
    band arithmetic is int32."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size values must be >= -1 (-1: unbounded), got {tuple(window_size)}")
    return tuple(-1 if w >= BAND_INF else int(w) for w in (left, right))


def check_segment_ids(segment_ids, batch: int, seqlen: int, device: torch.device,
                      name: str = "segment_ids") -> Optional[torch.Tensor]:
    """None, or (batch, seqlen) integer ids as contiguous int32: ids >= 0 name documents,
    -1 padding; outside padding they must not decrease along the sequence (each document
    one contiguous run). The values are checked with one host synchronization, once per
    tensor (tensor_memo), and not in torch.compile'd regions and CUDA-graph captures."""
    if segment_ids is None:
        return None
    if not isinstance(segment_ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(segment_ids).__name__}")
    if segment_ids.dtype.is_floating_point or segment_ids.dtype.is_complex or segment_ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {segment_ids.dtype}")
    if tuple(segment_ids.shape) != (batch, seqlen):
        raise ValueError(f"{name} must have shape (batch, seqlen) = ({batch}, {seqlen}), "
                         f"got {tuple(segment_ids.shape)}")
    if segment_ids.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {segment_ids.device}")
    if torch.compiler.is_compiling() or (segment_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return segment_ids.to(torch.int32).contiguous()

    def checked():
        # Range first, on the ids as given: an int64 id past int32 would wrap in the cast.
        wide = segment_ids.long()
        low, high = bool((wide < -1).any()), bool((wide > _INT32_MAX).any())
        if low or high:
            raise ValueError(f"{name} must be >= -1 (-1 marks padding) and fit in int32 "
                             f"(<= {_INT32_MAX}), got {'a smaller' if low else 'a larger'} id")
        ids = segment_ids.to(torch.int32).contiguous()
        if bool(((ids >= 0) & (ids < torch.cummax(ids, dim=1).values)).any()):
            raise ValueError(f"{name} must not decrease along the sequence outside padding "
                             "(every document one contiguous run of equal ids)")
        return None if ids is segment_ids else ids  # never a reference to the key itself

    # Checked and converted once while the same tensor returns unmodified (a training loop
    # passing one batch's ids to every layer), so the kernels also see one tensor of ids
    # and keep its segment ranges.
    kept = tensor_memo(segment_ids, ("segment_ids",), checked)
    return segment_ids if kept is None else kept


def check_deterministic(deterministic) -> bool:
    """A bool: True asks for gradients with the same bits run to run (kernels/dispatch.py)."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    return deterministic


def check_block_mask(block_mask, heads: int, seqlen_q: int, seqlen_k: int,
                     device: torch.device, lengths: str = "seqlen_q, seqlen_k") -> Optional[torch.Tensor]:
    """None, or a bool (heads or 1, cdiv(seqlen_q, BLOCK), cdiv(seqlen_k, BLOCK)) tensor on
    ``device`` (seqlen_* GLOBAL lengths, called ``lengths`` in the error), returned
    contiguous. Block (a, c) covers queries [a * BLOCK, (a + 1) * BLOCK) and keys
    [c * BLOCK, (c + 1) * BLOCK); BLOCK = 128."""
    if block_mask is None:
        return None
    if not isinstance(block_mask, torch.Tensor):
        raise TypeError(f"block_mask must be a torch.Tensor or None, got {type(block_mask).__name__}")
    if block_mask.dtype != torch.bool:
        raise TypeError(f"block_mask must be a bool tensor, got {block_mask.dtype}")
    want = (-(-seqlen_q // BLOCK), -(-seqlen_k // BLOCK))
    if block_mask.dim() != 3 or block_mask.shape[0] not in (1, heads) or tuple(block_mask.shape[1:]) != want:
        first, second = lengths.split(", ")
        raise ValueError(f"block_mask must have shape (heads or 1, {first} / {BLOCK}, {second} / {BLOCK}) "
                         f"= ({heads} or 1, {want[0]}, {want[1]}) over blocks of {BLOCK} tokens, "
                         f"got {tuple(block_mask.shape)}")
    if block_mask.device != device:
        raise ValueError(f"block_mask must be on q's device {device}, got {block_mask.device}")
    if block_mask.is_contiguous():
        return block_mask
    # A strided mask (say one head's expanded to every head) is copied once while the same
    # tensor returns unmodified: the caches keyed on the copy (checksum, ring plan, index
    # lists, each with a host synchronization) then hold from call to call.
    return tensor_memo(block_mask, ("contiguous",), block_mask.contiguous)


def check_dropout(dropout_p, seed) -> tuple[float, int]:
    """(p, seed): p a float in [0, 1); seed an int in [0, 2**63), or None for one drawn from
    torch's default (CPU) generator, which advances it: under torch.manual_seed the draws
    repeat, so a run is reproducible and ranks seeded alike draw alike."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if seed is None:
        seed = int(torch.randint(0, 2 ** 62, (1,)).item()) if dropout_p > 0 else 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return float(dropout_p), seed

