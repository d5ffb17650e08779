"""The one place that chooses which kernels run a block pair.

Delta and ``add_rounded``: the Triton kernels on CUDA tensors, the PyTorch twin elsewhere
(``backend``).

The forward takes the first route that serves the call (``fwd_route``):

- ``reference``: tensors off CUDA; the PyTorch twin (CPU, tests).
- ``gluon_sm90`` (kernels/gluon/fwd.py): a Hopper GPU (sm_90), bf16, head_dim 128, Sq and
  Sk multiples of 128, no mask, a band on local indices (causal, a window, or both),
  segment ids (packed documents, padding) or a band with them, a block mask or a band
  with one (not with segment ids), MHA, GQA or MQA, k and v
  in one tensor each (not ``Joined``); out written, or with ``accumulate`` merged with
  the running out (or ``out_partial``) and lse: ``flash_attn``'s forward and the ring's
  steps alike.
  Why: on one H100 (2026-11-27, benchmarks/research/forward_alone.py, 8k-32k tokens, 32
  heads, 32 or 8 kv heads, causal and not) 586-684 TFLOP/s against the Triton forward's
  526-575 and SDPA cuDNN's 559-639: 1.00-1.11x cuDNN, with out and lse bit-equal to the
  Triton forward's; through ``flash_attn`` on one H200 1.02-1.08x cuDNN's forward
  (benchmarks/results/kernel_h200.json). Causal windows of 1k and 4k keys at 16k-32k, one
  H200 (same script, ``--windows``): 1.07-1.11x the Triton forward in 3 of 4, 0.98x at
  32k with 4k keys, out and lse bit-equal. head_dim 64 stays on Triton: the Gluon forward
  compiles and passes its tests there but measured level with it (0.99-1.03x, one H200,
  8k-32k, ``--head-dim 64``), so it would add a route for no gain. Causal packed documents
  (bench_masks.py's draw, log-normal lengths, median 2k) at 16k-64k, 32 or 8 kv heads, one
  H200 (2026-11-27, ``--documents``): 572-664 TFLOP/s against the Triton forward's 497-555,
  1.14-1.20x, out and lse bit-equal. Block masks, non-causal, 32k tokens, 32 heads, one
  H100 (2026-11-27, benchmarks/bench_blocksparse.py beside the tree before this route, same
  machine, blocksparse_h100.json runs 2-3): the forward 1.05-1.18x faster at densities 1 to
  0.05 in 8 of 10 rows, level at local_global 0.10, 0.92x at local_global 0.05 (1.71 ->
  1.86 ms: its global row ran last); with the CTAs launched long rows first
  (``masks.program_order``, runs 4-7, one H100) level or faster than the Triton forward in
  every row (1.00-1.13x; local_global 0.05 1.68 ms).
  Not routed: dropout. The Gluon forward takes it (``attn_fwd_sm90(dropout_p=...)``, the
  same bits, tests/test_gluon_fwd_gpu.py) but ran slower than the Triton forward: one
  H200, 2026-11-28, bench_dropout.py at 32k, p = 0.1, both trees in one call
  (benchmarks/results/dropout_h200_gluon_fwd.json against dropout_h200_triton_fwd.json):
  forward 39.59 against 38.75 ms non-causal, 20.60 against 19.68 causal.
- ``triton``: every other CUDA call.

The backward takes the first route that serves the call (``bwd_route``):

- ``reference``: tensors off CUDA.
- ``gluon_sm90`` (kernels/gluon/bwd.py): a Hopper GPU (sm_90), bf16, head_dim 64 or 128,
  Sq and Sk multiples of 128, no mask, a band on local indices (causal, a window, or
  both: ``band_lo <= j - i <= band_hi``), segment ids or a band with them, a block mask
  or a band with one, and dropout with any of these but a block mask, on positions of
  stride 1 starting at multiples of 16 (queries) and 32 (keys) (not stripe's; neither
  segment ids, a block mask nor dropout with ``deterministic``: the Triton backward
  serves those, and repeats its bits), MHA, GQA or MQA; dq, dk and dv
  in one call (``flash_attn``'s backward, and the ring's block pairs where its fused
  schedule runs: ringflash/ring/rotate.py), written or, with
  ``accumulate``, added to fp32 sums (dq and dk/dv alike: fp32 running sums, not
  ``*_partial`` ones).
  Why: on one H100 (2026-11-27, 8k-64k tokens, 32 heads, causal and not, with the Gluon
  forward) forward + backward 0.96-1.07x SDPA cuDNN's, and 0.88-0.97x with
  ``deterministic``, against 0.73-0.82x with the Triton backward
  (benchmarks/results/kernel_h100.json; docs/performance.md, "The Hopper kernels, one
  H100"). The backward alone
  (benchmarks/research/backward_alone.py, one H100, 2026-11-27): causal windows of 1k and
  4k keys at 16k-32k 1.16-1.38x the Triton pair's speed, head_dim 64 at 8k-16k 1.13-1.36x
  (and 0.97-1.06x cuDNN's). Causal packed documents at 16k-64k, 32 or 8 kv heads, one
  H200 (2026-11-27, ``--documents``): 519-556 TFLOP/s against the Triton pair's 333-405,
  1.34-1.62x. Block masks, non-causal, 32k tokens, 32 heads, one H100 (2026-11-27,
  benchmarks/bench_blocksparse.py beside the tree before this route, same machine):
  forward+backward 1.10-1.34x faster at densities 1 to 0.05 (benchmarks/results/
  blocksparse_h100.json). Dropout 0.1, 32 heads, 16k-32k tokens, one H100 (2026-11-27,
  backward_alone.py ``--dropout 0.1``): the backward alone 1.04x the Triton pair's speed
  non-causal and 1.16-1.20x causal; through ``flash_attn`` at 32k on one H200
  (bench_dropout.py, the tree before beside this one, dropout_h200_gluon_bwd.json)
  forward+backward 165.0 -> 159.0 ms non-causal and 89.9 -> 81.7 causal, and through a
  ring of 2 H200s (dropout_h200x2_gluon_bwd.json) 84.4 -> 82.9 and 46.2 -> 42.6 (all
  with each thread running 8 Philox calls; the kernel since, two lanes sharing them, level
  to 4% faster than that one on one H100: docs/notes/dropout.md, "Dropout, ninth round").
- ``triton``: every other CUDA call: every mask, dtype, head_dim and GPU.

By default the Gluon kernel adds each CTA's dQ tile into the running dQ in arrival order
(fp32 adds in L2), so its dQ may differ in the last bits from run to run.
``deterministic=True`` or ``torch.use_deterministic_algorithms(True)`` makes it add them
in a fixed order of K tiles (``attn_bwd_sm90(deterministic=True)``): the same bits run to
run. The Triton backward writes every gradient once (a dQ kernel and a dK/dV kernel) and
repeats its bits either way; dK and dV are bit-stable on both routes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from . import reference
from . import triton as triton_kernels
from .masks import PairMask

GLUON = "gluon_sm90"


def backend(t: torch.Tensor):
    """Triton on CUDA tensors, the PyTorch twin elsewhere."""
    return triton_kernels if t.is_cuda else reference


def capability(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """The compute capability of t's GPU, None off CUDA (read once a GPU: the ring asks at
    every block pair)."""
    return _capability(t.device.index) if t.is_cuda else None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


class Route(NamedTuple):
    """``name``: "reference", "gluon_sm90" or "triton"; ``why``: on the Triton route of a
    CUDA call, why the Gluon kernel does not take it (None otherwise)."""

    name: str
    why: Optional[str] = None


MASK_WHY = "mask: only no mask, a band on local indices, segment ids and a block mask (not with segment ids)"
DROPOUT_WHY = ("dropout: the Gluon backward's needs positions of stride 1 and no block mask or deterministic; the "
               "Gluon forward's measured slower than the Triton forward")


def gluon_mask(mask: PairMask, backward: bool = False) -> bool:
    """Whether the Gluon kernels are routed for ``mask``: no mask, a band on local indices
    (causal, a window, both), segment ids, a block mask, or a band with either (not segment
    ids with a block mask; no band on global positions); dropout in the ``backward`` only,
    on positions of stride 1 (``PairMask.pos``: what every rank of a ring agrees on, its
    layout; their alignment is checked per call, kernels/gluon/launch.py) without a block
    mask (the Gluon forward takes dropout too, measured slower than the Triton forward:
    the module's docstring)."""
    if mask.band_on_positions or not (mask.blocks is None or mask.q_segments is None):
        return False
    return mask.dropout_p == 0 or (backward and mask.blocks is None and mask.pos is not None and mask.pos[2] == 1)


def deterministic_mode(deterministic: bool) -> bool:
    """``deterministic`` or torch's deterministic mode (``torch.use_deterministic_algorithms``)."""
    return bool(deterministic) or torch.are_deterministic_algorithms_enabled()


def gluon_serves(q: torch.Tensor, k: torch.Tensor, rows_q: int, rows_k: int, mask: PairMask,
                 deterministic: bool = False) -> bool:
    """Whether the Gluon backward serves a block pair of ``rows_q`` query and ``rows_k`` key
    rows of q's and k's heads, dtype and GPU under ``mask`` (and ``deterministic``, with
    torch's mode), judged only from what every rank of a ring agrees on (not strides or
    addresses, which ``bwd_route`` checks per call): the ring chooses its schedule from
    this (ringflash/ring/rotate.py), and every rank must choose alike."""
    return (capability(q) == (9, 0) and gluon_mask(mask, backward=True) and q.dtype == torch.bfloat16
            and q.shape[-1] in (64, 128)
            and not ((mask.q_segments is not None or mask.blocks is not None or mask.dropout_p != 0)
                     and deterministic_mode(deterministic))
            and k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0
            and rows_q > 0 and rows_k > 0 and rows_q % 128 == 0 and rows_k % 128 == 0)


def fwd_route(q, k, v, out, lse, *, softmax_scale: float, mask: PairMask, accumulate: bool, out_partial=None,
              tail=None, arrival=None) -> Route:
    """The route of one ``flash_attn_fwd`` call (arguments as there; tail: the Joined second
    parts, or None)."""
    arch = capability(q)
    if arch is None:
        return Route("reference")
    if mask.dropout_p != 0:
        why = DROPOUT_WHY
    elif not gluon_mask(mask):
        why = MASK_WHY
    elif tail is not None or arrival is not None:
        why = "k, v Joined from two tensors"
    elif q.shape[-1] != 128:
        why = f"head_dim {q.shape[-1]}: the Gluon forward is routed at 128 (level with Triton at 64)"
    elif arch != (9, 0):
        why = f"sm_{arch[0]}{arch[1]}, not sm_90"
    else:
        from .gluon import launch as kernel  # imported on Hopper only; it compiles nothing at import

        error = kernel.fwd_unsupported(q, k, v, out, lse, softmax_scale, mask.band_hi, accumulate, out_partial,
                                       mask.band_lo, mask.q_segments, mask.k_segments, mask.blocks, mask.dropout_p,
                                       mask.pos)
        why = None if error is None else str(error)
    return Route("triton", why) if why else Route(GLUON)


def fwd(q, k, v, out, lse, *, softmax_scale: float, mask: PairMask, accumulate: bool, out_partial=None, tail=None,
        arrival=None) -> None:
    """One forward call (``kernels.pair.flash_attn_fwd``'s, its tensors row-major) on its
    route (``fwd_route``)."""
    route = fwd_route(q, k, v, out, lse, softmax_scale=softmax_scale, mask=mask, accumulate=accumulate,
                      out_partial=out_partial, tail=tail, arrival=arrival)
    if route.name == GLUON:
        from .gluon import attn_fwd_sm90

        attn_fwd_sm90(q, k, v, out, lse, softmax_scale, causal_offset=mask.band_hi, accumulate=accumulate,
                      out_partial=out_partial, band_lo=mask.band_lo, q_segments=mask.q_segments,
                      k_segments=mask.k_segments, blocks=mask.blocks, dropout_p=mask.dropout_p, seed=mask.seed,
                      pos=mask.pos, dropout_head0=mask.dropout_head0)
    else:
        backend(q).fwd(q, k, v, out, lse, softmax_scale=softmax_scale, mask=mask, accumulate=accumulate,
                       out_partial=out_partial, tail=tail, arrival=arrival)


def bwd_route(dout, q, k, v, lse, delta, dq, dk, dv, *, softmax_scale: float, mask: PairMask,
              accumulate: bool, partials=(None, None, None), tails=(None, None),
              deterministic: bool = False, accumulate_dkv: Optional[bool] = None) -> Route:
    """The route of one ``flash_attn_bwd`` call (arguments as there; tails: the Joined
    second parts, or None)."""
    arch = capability(q)
    if arch is None:
        return Route("reference")
    if not gluon_mask(mask, backward=True):
        why = DROPOUT_WHY if gluon_mask(mask._replace(dropout_p=0.0)) else MASK_WHY
    elif dq is None or dk is None:
        why = "dq or dk/dv skipped: the Gluon kernel computes them together"
    elif any(p is not None for p in partials) or any(t is not None for t in tails):
        why = "adds to *_partial sums or reads Joined parts"
    elif accumulate and dq.dtype != torch.float32:
        why = "accumulate: the Gluon kernel adds dQ into fp32 sums only"
    elif arch != (9, 0):
        why = f"sm_{arch[0]}{arch[1]}, not sm_90"
    elif q.shape[-1] not in (64, 128):
        why = f"head_dim {q.shape[-1]}: the Gluon kernel serves 64 and 128"
    else:
        from .gluon import launch as kernel  # imported on Hopper only; it compiles nothing at import

        error = kernel.unsupported(dout, q, k, v, lse, delta, dq if dq.dtype == torch.float32 else None, dk, dv,
                                   softmax_scale, mask.band_hi,
                                   accumulate if accumulate_dkv is None else accumulate_dkv, mask.band_lo,
                                   deterministic_mode(deterministic), mask.q_segments, mask.k_segments,
                                   mask.blocks, mask.dropout_p, mask.pos)
        why = None if error is None else str(error)
    return Route("triton", why) if why else Route(GLUON)


def gluon_bwd(dout, q, k, v, lse, delta, dq, dk, dv, *, softmax_scale: float, mask: PairMask,
              accumulate: bool = False, deterministic: bool = False, accumulate_dkv: Optional[bool] = None) -> None:
    """The ``gluon_sm90`` route: dq written through an fp32 sum the kernel adds into (dq
    itself when fp32: zeroed first unless ``accumulate``), dk and dv (bf16 or fp32)
    written, or with ``accumulate`` all three added to (fp32 sums; ``bwd_route``);
    ``accumulate_dkv`` (None: as accumulate) False: dk and dv written all the same.
    deterministic (or ``torch.use_deterministic_algorithms(True)``): dQ's adds in a fixed
    order."""
    from .gluon import attn_bwd_sm90

    if dq.dtype == torch.float32:
        acc = dq if accumulate else dq.zero_()
    else:
        acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    attn_bwd_sm90(dout, q, k, v, lse, delta, acc, dk, dv, softmax_scale, causal_offset=mask.band_hi,
                  band_lo=mask.band_lo, accumulate=accumulate if accumulate_dkv is None else accumulate_dkv,
                  deterministic=deterministic_mode(deterministic),
                  q_segments=mask.q_segments, k_segments=mask.k_segments, blocks=mask.blocks,
                  dropout_p=mask.dropout_p, seed=mask.seed, pos=mask.pos, dropout_head0=mask.dropout_head0)
    if acc is not dq:
        dq.copy_(acc)
