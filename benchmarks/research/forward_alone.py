"""The forward kernels alone on one Hopper GPU: the Gluon forward (kernels/gluon/fwd.py) at
each number of K/V stages, the Triton forward (kernels/triton) and SDPA cuDNN's forward, on
the same inputs (docs/notes/gluon-backward.md, "The Gluon forward"):

    python benchmarks/research/forward_alone.py [--seqlens 8192 16384] [--kv-heads 32 8] [--stages 2 3] \
        [--head-dim 128] [--windows 4096] [--documents]

bf16, batch 1, 32 heads, head_dim 128 (or ``--head-dim``), causal and not, and with
``--windows`` causal sliding windows of those many keys instead (no cuDNN row: SDPA has no
window); with ``--documents`` causal packed documents instead (backward_alone.py's; no
cuDNN row). Prints one JSON line per configuration: milliseconds (triton.testing.do_bench
medians), forward TFLOP/s (over the visible pairs), and the Gluon out's and lse's relative
error against the Triton forward's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backward_alone import case_args, run_cases, segment_ids  # noqa: E402
from ringflash.kernels import PairMask
from ringflash.kernels import triton as triton_kernels
from ringflash.kernels.gluon import attn_fwd_sm90
from ringflash.kernels.gluon import launch as gluon_launch

HEADS = 32


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def one(seqlen: int, kv_heads: int, causal: bool, stages=(2,), head_dim: int = 128, window: int = 0,
        documents: bool = False) -> dict:
    """One configuration's timings; ``window`` > 0: causal, each query seeing its last
    ``window`` keys; ``documents``: causal packed documents."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(heads):
        return torch.randn(1, seqlen, heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)

    q, k, v = randn(HEADS), randn(kv_heads), randn(kv_heads)
    scale, offset = head_dim ** -0.5, 0 if causal or window else None
    band_lo = -(window - 1) if window else None
    ids, pairs = segment_ids(seqlen) if documents else (None, 0)
    mask = PairMask(band_lo=band_lo, band_hi=offset, q_segments=ids, k_segments=ids)
    segs = dict(q_segments=ids, k_segments=ids)
    ref, ref_lse = torch.empty_like(q), torch.empty(1, HEADS, seqlen, device="cuda")
    out, lse = torch.empty_like(q), torch.empty_like(ref_lse)
    ms, errors = {}, {}
    ms["triton"] = do_bench(lambda: triton_kernels.fwd(q, k, v, ref, ref_lse, softmax_scale=scale, mask=mask,
                                                       accumulate=False))
    for n in stages:
        gluon_launch.FWD_STAGES = n
        attn_fwd_sm90(q, k, v, out, lse, scale, causal_offset=offset, band_lo=band_lo, **segs)
        errors[f"out_stages{n}"], errors[f"lse_stages{n}"] = rel(out, ref), rel(lse, ref_lse)
        ms[f"gluon_stages{n}"] = do_bench(lambda: attn_fwd_sm90(q, k, v, out, lse, scale, causal_offset=offset,
                                                                band_lo=band_lo, **segs))
    leaves = [t.transpose(1, 2) for t in (q, k, v)]
    if not (window or documents):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms["cudnn"] = do_bench(lambda: F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                                                          enable_gqa=kv_heads != HEADS))
    if not documents:
        pairs = seqlen * window - window * (window - 1) / 2 if window else seqlen * seqlen / (2 if causal else 1)
    flops = 4 * HEADS * pairs * head_dim
    return dict(seqlen=seqlen, heads=HEADS, kv_heads=kv_heads, head_dim=head_dim, causal=causal, window=window,
                documents=documents, ms=ms,
                fwd_tflops={name: round(flops / t / 1e9, 1) for name, t in ms.items()},
                gluon_rel_err_vs_triton=errors)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    case_args(p)
    p.add_argument("--stages", type=int, nargs="+", default=[gluon_launch.FWD_STAGES])
    args = p.parse_args()
    run_cases(args, lambda seqlen, kv_heads, causal, window: one(seqlen, kv_heads, causal, args.stages,
                                                                 args.head_dim, window, args.documents))


if __name__ == "__main__":
    main()
