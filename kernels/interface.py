"""Argument checks, device dispatch and the differentiable single-device op.

Three thin layers, so torch.compile can trace through them:
``torch.library`` custom ops (forward, backward) -> their registered autograd ->
the public ``flash_attn``. Outside torch.compile the public function runs the same
implementations through a plain ``torch.autograd.Function`` (``eager_function``), which
skips the custom ops' dispatch. The per-block entry points ``flash_attn_fwd`` and
``flash_attn_bwd`` are what the ring calls at every step.
"""

import math
from typing import NamedTuple, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import reference, triton_attn
from .masks import BAND_INF, BLOCK, NO_MASK, Blocks, PairMask, band_of_window, tensor_memo

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_INT32_MAX = 2 ** 31 - 1


def _backend(t: torch.Tensor):
    """Triton on CUDA tensors, the PyTorch twin elsewhere."""
    return triton_attn if t.is_cuda else reference


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
    """A bool; every backward here is deterministic already (two kernels that write each
    gradient once, without atomics), so both values give the same bits."""
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


def _unit_last(t: torch.Tensor) -> bool:
    """The last dimension is contiguous (a dimension of one element has any stride)."""
    return t.stride(-1) == 1 or t.shape[-1] == 1


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any strides but need the last dimension contiguous."""
    return t if _unit_last(t) else t.contiguous()


def _check_outputs(**tensors) -> None:
    """Destinations the kernels write through strides: the last one must be 1."""
    for name, t in tensors.items():
        if t is not None and not _unit_last(t):
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def _check_partials(accumulate: bool, **pairs) -> None:
    """Each (destination, partial): a partial needs accumulate and the destination's layout."""
    for name, (dest, partial) in pairs.items():
        if partial is None:
            continue
        if not accumulate:
            raise ValueError(f"{name}_partial needs accumulate=True")
        if dest is None or partial.shape != dest.shape or partial.stride() != dest.stride():
            raise ValueError(f"{name}_partial must have {name}'s shape and strides, got "
                             f"{tuple(partial.shape)} / {partial.stride()} for "
                             f"{None if dest is None else (tuple(dest.shape), dest.stride())}")


# ----------------------------------------------------------------------------- per-block entry points


def _pair_mask(mask: Optional[PairMask], causal_offset: Optional[int]) -> PairMask:
    if causal_offset is None:
        return NO_MASK if mask is None else mask
    if mask is not None:
        raise ValueError("pass either mask or causal_offset, not both")
    return PairMask.causal(causal_offset)


def flash_attn_fwd(q, k, v, *, softmax_scale: float, mask: Optional[PairMask] = None,
                   causal_offset: Optional[int] = None, out: Optional[torch.Tensor] = None,
                   lse: Optional[torch.Tensor] = None, accumulate: bool = False,
                   out_partial: Optional[torch.Tensor] = None, arrival: Optional["Arrival"] = None):
    """Attention of one (query block, key block) pair, returning ``(out, lse)``.

    q (B, Sq, H, D); k, v (B, Sk, Hkv, D); Sq and Sk may differ.
    mask: a ``PairMask`` (band of local indices or global positions, segment ids, dropout,
        block mask), None for no mask.
    causal_offset: shorthand for ``PairMask.causal(o)``: key j is visible to query i iff
        j <= i + o (o = q_start - k_start for two contiguous blocks of one sequence).
    out (B, Sq, H, D), any float dtype, and lse (B, H, Sq) fp32: where to write; allocated
        when None. Views are fine (last dimension contiguous).
    accumulate: out/lse already hold a partial result for the same queries (normalized
        out and its lse; lse = -inf for none yet); the result is its exact merge with this
        block's, written in place. Keep such a running out in fp32.
    out_partial: with accumulate, the running output to merge with when it is not ``out``
        itself (same shape and strides as out): the last of several blocks can read fp32
        sums and write the final out in q's dtype, with no pass of its own.
    k and v may be a ``Joined`` pair (a sequence in two tensors, under a block mask), and
    then ``arrival`` may say that one part comes from another GPU (``Arrival``).
    A row that sees no key has out 0 and lse -inf.
    """
    if accumulate and (out is None or lse is None):
        raise ValueError("accumulate=True needs the running out and lse")
    _check_outputs(out=out, lse=lse)
    _check_partials(accumulate, out=(out, out_partial))
    mask = _pair_mask(mask, causal_offset)
    tail = _tails(dict(k=k, v=v))
    if tail is not None and mask.blocks is None:
        raise ValueError("a sequence Joined from two tensors needs a block mask (the kernels "
                         "list its blocks apart where the parts meet)")
    k, v = (t.first if isinstance(t, Joined) else t for t in (k, v))
    _check_arrival(arrival, tail, q, k)
    b, sq, h, d = q.shape
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if lse is None:
        lse = torch.empty((b, h, sq), device=q.device, dtype=torch.float32)
    _backend(q).fwd(_rowmajor(q), _rowmajor(k), _rowmajor(v), out, lse, softmax_scale=softmax_scale,
                    mask=mask, accumulate=accumulate, out_partial=out_partial, tail=tail,
                    arrival=arrival)
    return out, lse


class Arrival(NamedTuple):
    """How ``flash_attn_fwd`` reads a ``Joined`` k, v whose part ``last`` (0: first, 1:
    second) comes from another GPU: that part's keys run after the other's. With
    ``flags``, the part is still on its way, in chunks of ``heads`` K/V heads: flags
    (int32, (Hkv / heads,), on q's device) holds ``epoch`` at [c] once heads
    [c * heads, (c + 1) * heads) have landed (the copy stream writes it after the chunk),
    and each query tile waits inside the kernel for its head's chunk, so the launch starts
    before the trip ends. The writer must not need this GPU's SMs to make progress.
    flags None: the part is there."""

    last: int
    flags: Optional[torch.Tensor] = None
    epoch: int = 0
    heads: int = 1


def _check_arrival(arrival, tail, q, k) -> None:
    if arrival is None:
        return
    if tail is None:
        raise ValueError("arrival is for a Joined k and v")
    if arrival.last not in (0, 1):
        raise ValueError(f"arrival.last must be 0 or 1, got {arrival.last!r}")
    if arrival.flags is None:
        return
    hkv = k.shape[2]
    if not q.is_cuda:
        raise ValueError("arrival.flags: waiting for a part to land needs the Triton kernel (CUDA)")
    if isinstance(arrival.heads, bool) or not isinstance(arrival.heads, int) or arrival.heads < 1 \
            or hkv % arrival.heads:
        raise ValueError(f"arrival.heads must divide the {hkv} K/V heads, got {arrival.heads!r}")
    flags = arrival.flags
    if flags.dtype != torch.int32 or flags.device != q.device or not flags.is_contiguous() \
            or flags.numel() != hkv // arrival.heads:
        raise ValueError(f"arrival.flags must be a contiguous int32 tensor of {hkv // arrival.heads} "
                         f"on {q.device}, got {flags.dtype} {tuple(flags.shape)} on {flags.device}")


def attn_delta(out: torch.Tensor, dout: torch.Tensor,
               dlse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """delta = rowsum(dout * out) (B, H, Sq) fp32, from the FINAL out.

    A gradient on lse folds in here: d lse_i / d s_ij = p_ij, which is the same as
    lowering delta_i by dlse_i.
    """
    delta = _backend(out).delta(_rowmajor(out), _rowmajor(dout))
    if dlse is not None:
        delta = delta - dlse.float()
    return delta


class Joined(NamedTuple):
    """One (B, S1 + S2, H, D) sequence held in two tensors: rows [0, S1) in ``first``, the
    rest in ``second``, of one dtype and device, with the same strides (those of dims of
    size one aside: they are never stepped) and S1 a multiple of 128. ``flash_attn_bwd``
    takes k and v so in a dQ pass (dk = dv = None), q and dout in a dK/dV pass (dq =
    None), under a block mask: a ring of two holds its own shard and the other rank's
    apart, and the kernels read both where they are, without a copy that joins them
    (their block lists are split where the parts meet)."""

    first: torch.Tensor
    second: torch.Tensor


def _tails(pair: dict) -> Optional[tuple]:
    """For two arguments given as ``Joined`` (by name, in ``pair``): their second parts, after
    checking them; None if neither is joined."""
    joined = [isinstance(t, Joined) for t in pair.values()]
    if not any(joined):
        return None
    names = " and ".join(pair)
    if not all(joined):
        raise ValueError(f"{names} must both be Joined or neither")
    for name, (first, second) in pair.items():
        if (first.dtype, first.device) != (second.dtype, second.device):
            raise ValueError(f"{name}: Joined parts must share dtype and device")
        same = first.shape[0] == second.shape[0] and first.shape[2:] == second.shape[2:]
        # the kernels step both parts by the first's strides: those of a dim of one (a batch
        # of one, a one-row second part) are never used
        strides = all(a == b for m, n, a, b in zip(first.shape, second.shape, first.stride(),
                                                   second.stride()) if m > 1 and n > 1)
        if not same or not strides:
            raise ValueError(f"{name}: Joined parts must differ only in rows and share strides, got "
                             f"{tuple(first.shape)} / {first.stride()} and "
                             f"{tuple(second.shape)} / {second.stride()}")
        if first.shape[1] % BLOCK:
            raise ValueError(f"{name}: a Joined first part's rows must be a multiple of {BLOCK}, "
                             f"got {first.shape[1]}")
    if len({t.first.shape[1] for t in pair.values()}) > 1:
        raise ValueError(f"{names}: Joined first parts must have the same rows")
    return tuple(t.second for t in pair.values())


def flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, *, softmax_scale: float,
                   mask: Optional[PairMask] = None, causal_offset: Optional[int] = None,
                   accumulate: bool = False, dq_partial: Optional[torch.Tensor] = None,
                   dk_partial: Optional[torch.Tensor] = None, dv_partial: Optional[torch.Tensor] = None):
    """Gradients of one block pair, written (or, with accumulate, added) into dq, dk, dv.

    dout, q, dq (B, Sq, H, D); k, v, dk, dv (B, Sk, Hkv, D); lse, delta (B, H, Sq) fp32:
    the FINAL lse of these queries over every key block, and ``attn_delta`` of the FINAL
    out. Accumulators should be fp32; views are fine. dq=None skips dQ, and dk=dv=None
    skips dK and dV (they are separate passes, so a caller may run them apart).
    mask / causal_offset: as in ``flash_attn_fwd``.
    dq_partial, dk_partial, dv_partial: with accumulate, the running sum a gradient adds to
        when it is not the gradient itself (same shape and strides), as ``out_partial``.
    q and dout (a dK/dV pass only), or k and v (a dQ pass only), may each be a ``Joined``:
        a sequence in two tensors.
    """
    if (dk is None) != (dv is None):
        raise ValueError("dk and dv are computed together: pass both or neither")
    _check_outputs(lse=lse, delta=delta, dq=dq, dk=dk, dv=dv)
    _check_partials(accumulate, dq=(dq, dq_partial), dk=(dk, dk_partial), dv=(dv, dv_partial))
    mask = _pair_mask(mask, causal_offset)
    q_tails, k_tails = _tails(dict(q=q, dout=dout)), _tails(dict(k=k, v=v))
    if (q_tails or k_tails) and mask.blocks is None:
        raise ValueError("a sequence Joined from two tensors needs a block mask (the kernels "
                         "list its blocks apart where the parts meet)")
    if q_tails is not None and dq is not None:
        raise ValueError("Joined q and dout are for a dK/dV pass: pass dq=None")
    if k_tails is not None and dk is not None:
        raise ValueError("Joined k and v are for a dQ pass: pass dk=dv=None")
    dout, q, k, v = (t.first if isinstance(t, Joined) else t for t in (dout, q, k, v))
    _backend(q).bwd(_rowmajor(dout), _rowmajor(q), _rowmajor(k), _rowmajor(v), lse, delta, dq, dk,
                    dv, softmax_scale=softmax_scale, mask=mask, accumulate=accumulate,
                    partials=(dq_partial, dk_partial, dv_partial), tails=(q_tails, k_tails))
    return dq, dk, dv


# ----------------------------------------------------------------------------- differentiable op


def _op_mask(band_lo, band_hi, segment_ids, dropout_p, seed, block_mask) -> PairMask:
    blocks = None if block_mask is None else tensor_memo(
        block_mask, ("blocks",), lambda: Blocks(block_mask.clone()))
    return PairMask(band_lo, band_hi, segment_ids, segment_ids, dropout_p, seed, (0, 0, 1, 0), blocks)


def eager(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a differentiable call on ``tensors`` may run its implementations through a
    plain autograd.Function (``eager_function``) instead of its custom ops: outside
    torch.compile and torch.export, with no torch_dispatch mode (fake tensors, make_fx) or
    functorch transform active, on plain tensors. The custom ops' dispatch (schema
    checks, the autograd wrapper, dynamo's guard around the implementation) costs the
    host ~0.2 ms a forward+backward on a 2-core CPU and 0.2-0.6 ms on the GPU machines'
    hosts (benchmarks/NOTES.md, "The host's time of a call")."""
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and not torch._C._are_functorch_transforms_active()
            and all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors))


def eager_function(name: str, forward, setup_context, backward) -> type:
    """A torch.autograd.Function over a custom op's implementation ``forward`` and the
    ``setup_context`` / ``backward`` registered for it: the same inputs, outputs, saved
    tensors and gradients, without the op's dispatch."""
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward)})


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
             band_lo: Optional[int], band_hi: Optional[int],
             segment_ids: Optional[torch.Tensor], dropout_p: float, seed: int,
             block_mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_fwd(q, k, v, softmax_scale=softmax_scale,
                          mask=_op_mask(band_lo, band_hi, segment_ids, dropout_p, seed, block_mask))


def _backward_grads(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                    softmax_scale: float, band_lo: Optional[int], band_hi: Optional[int],
                    segment_ids: Optional[torch.Tensor], dropout_p: float, seed: int,
                    block_mask: Optional[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    delta = attn_delta(out, dout, dlse)
    dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    return flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=softmax_scale,
                          mask=_op_mask(band_lo, band_hi, segment_ids, dropout_p, seed, block_mask))


_forward_op = torch.library.custom_op("ringflash::flash_attn_forward", mutates_args=())(_forward)
_backward_op = torch.library.custom_op("ringflash::flash_attn_backward", mutates_args=())(_backward_grads)


@_forward_op.register_fake
def _(q, k, v, softmax_scale, band_lo, band_hi, segment_ids, dropout_p, seed, block_mask):
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, softmax_scale, band_lo, band_hi, segment_ids, dropout_p, seed,
      block_mask):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, band_lo, band_hi, segment_ids, dropout_p, seed, block_mask = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, segment_ids, block_mask)
    ctx.args = (softmax_scale, band_lo, band_hi, dropout_p, seed)
    ctx.set_materialize_grads(False)  # an unused lse's gradient stays None, not zeros


def no_double_backward() -> None:
    """Backward passes run under grad mode only for create_graph=True, which they do not support."""
    if torch.is_grad_enabled():
        raise NotImplementedError("ringflash attention has no double backward: its backward is not "
                                  "differentiable (torch.autograd.grad(..., create_graph=True) "
                                  "is unsupported)")


def _backward(ctx, dout, dlse):
    no_double_backward()
    q, k, v, out, lse, segment_ids, block_mask = ctx.saved_tensors
    softmax_scale, band_lo, band_hi, dropout_p, seed = ctx.args
    dout = torch.zeros_like(out) if dout is None else dout  # only lse was used
    grads = _backward_grads if eager(dout, q) else _backward_op
    dq, dk, dv = grads(dout, q, k, v, out, lse, dlse, softmax_scale, band_lo, band_hi,
                       segment_ids, dropout_p, seed, block_mask)
    return dq, dk, dv, None, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_FlashAttn = eager_function("_FlashAttn", _forward, _setup_context, _backward)


def flash_attn(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None,
               return_lse: bool = False, segment_ids: Optional[torch.Tensor] = None,
               window_size: tuple[int, int] = (-1, -1), dropout_p: float = 0.0,
               seed: Optional[int] = None, block_mask: Optional[torch.Tensor] = None,
               deterministic: bool = False):
    """Exact softmax attention on one device, FlashAttention-2 style.

    Args:
        q: (batch, seqlen_q, heads, head_dim), float16, bfloat16 or float32.
        k, v: (batch, seqlen_k, kv_heads, head_dim), heads a multiple of kv_heads
            (MHA, GQA, MQA; K/V are never repeated in memory).
        causal: key j is visible to query i iff j <= i (aligned top-left, as in
            torch's scaled_dot_product_attention).
        softmax_scale: a positive float; defaults to head_dim ** -0.5.
        return_lse: also return lse.
        segment_ids: (batch, seqlen) integer ids (self-attention: seqlen_q == seqlen_k).
            Query i sees key j only if both carry the same id; -1 marks padding (never
            seen; a padding query sees nothing). Outside padding, ids must not decrease
            along the sequence (packed documents, each one contiguous run).
        window_size: (left, right): query i sees keys i - left <= j <= i + right; -1 is
            unbounded on that side. Combines with causal and segment_ids.
        dropout_p: attention dropout rate in [0, 1). Whether key j's probability for query
            i is kept depends only on (seed, batch, head, i, j) (kernels/dropout.py;
            ``dropout_keep_mask`` returns the dense mask), so the backward regenerates it
            and the ring with the same seed drops exactly the same elements. The rate
            applied is p rounded to 1/256 (``dropout.applied_rate``).
        seed: an int, or None to draw one from torch's default generator.
        block_mask: block-sparse attention: bool (heads or 1, cdiv(seqlen_q, 128),
            cdiv(seqlen_k, 128)); block (a, c) covers queries [128a, 128a + 128) and keys
            [128c, 128c + 128). False blocks are never computed (no load, no FLOP);
            the elements of a True block follow causal, window_size and segment_ids.
            Helpers: ``ringflash.kernels.block_sparse``.
        deterministic: accepted for compatibility: the backward is always deterministic.

    Returns:
        out (batch, seqlen_q, heads, head_dim) in q's dtype, and with return_lse the
        log-sum-exp of the scaled scores, lse (batch, heads, seqlen_q) fp32, natural log.
        A row that sees no key gets out 0 and lse -inf (and zero gradients). Both are
        differentiable in q, k and v.
    """
    check_qkv(q, k, v)
    causal = check_causal(causal)
    check_deterministic(deterministic)
    block_mask = check_block_mask(block_mask, q.shape[2], q.shape[1], k.shape[1], q.device)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    band_lo, band_hi = band_of_window(causal, check_window(window_size))
    if segment_ids is not None and q.shape[1] != k.shape[1]:
        raise ValueError(f"segment_ids needs seqlen_q == seqlen_k (self-attention), got "
                         f"{q.shape[1]} and {k.shape[1]}")
    segment_ids = check_segment_ids(segment_ids, q.shape[0], q.shape[1], q.device)
    dropout_p, seed = check_dropout(dropout_p, seed)
    forward = _FlashAttn.apply if eager(q, k, v) else _forward_op
    out, lse = forward(q, k, v, scale, band_lo, band_hi, segment_ids, dropout_p, seed, block_mask)
    return (out, lse) if return_lse else out
