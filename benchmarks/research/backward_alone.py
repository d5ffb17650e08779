"""The backward kernels alone on one Hopper GPU: the Gluon backward (kernels/gluon/bwd.py),
default and ``deterministic``, the Triton pair (kernels/triton) and SDPA cuDNN's backward,
on the same inputs, with lse and delta given (docs/notes/gluon-backward.md, "First timing"
and "A deterministic order for dQ"):

    python benchmarks/research/backward_alone.py [--seqlens 8192 16384] [--kv-heads 32 8] [--det-rounds 16]
        [--head-dim 128] [--windows 4096] [--documents] [--dropout 0.1]

bf16, batch 1, 32 heads, head_dim 128 (or ``--head-dim``), causal and not, and with
``--windows`` causal sliding windows of those many keys (no cuDNN nor deterministic row: SDPA
has no window, and the deterministic order takes no window); with ``--documents`` causal
packed documents instead (bench_masks.py's draw: log-normal lengths, median 2k; no cuDNN
nor deterministic row; FLOPs over the visible pairs). Prints one JSON line per
configuration: milliseconds (triton.testing.do_bench medians), backward TFLOP/s (2.5x the
forward's FLOPs, halved when causal), the Gluon gradients' relative error against the
Triton pair's, and whether two deterministic runs gave the same dQ bits (``det_repeats``).
``--det-rounds``: the deterministic kernel timed at each of these ``launch.DET_ROUND``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_masks import documents as draw_documents  # noqa: E402
from ringflash.kernels import PairMask
from ringflash.kernels import triton as triton_kernels
from ringflash.kernels.gluon import attn_bwd_sm90
from ringflash.kernels.gluon import launch as gluon_launch

HEADS = 32


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def segment_ids(seqlen: int) -> tuple[torch.Tensor, int]:
    """(ids (1, seqlen) int32 on the GPU, visible causal pairs) of bench_masks.py's documents."""
    lengths = draw_documents(seqlen)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[None].int().cuda(), sum(n * (n + 1) // 2 for n in lengths)


def one(seqlen: int, kv_heads: int, causal: bool, det_rounds=(16,), head_dim: int = 128, window: int = 0,
        documents: bool = False, dropout: float = 0.0) -> dict:
    """One configuration's timings; ``window`` > 0: causal, each query seeing its last
    ``window`` keys; ``documents``: causal packed documents; ``dropout`` > 0: that rate
    (the library's bits, seed 1234; no deterministic nor cuDNN row)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(heads):
        return torch.randn(1, seqlen, heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)

    q, dout, k, v = randn(HEADS), randn(HEADS), randn(kv_heads), randn(kv_heads)
    scale, offset = head_dim ** -0.5, 0 if causal or window else None
    band_lo = -(window - 1) if window else None
    ids, pairs = segment_ids(seqlen) if documents else (None, 0)
    drop = dict(dropout_p=dropout, seed=1234, pos=(0, 0, 1, 0)) if dropout else {}
    mask = PairMask(band_lo=band_lo, band_hi=offset, q_segments=ids, k_segments=ids, **drop)
    segs = dict(q_segments=ids, k_segments=ids, **drop)
    out, lse = torch.empty_like(q), torch.empty(1, HEADS, seqlen, device="cuda")
    triton_kernels.fwd(q, k, v, out, lse, softmax_scale=scale, mask=mask, accumulate=False)
    delta = triton_kernels.delta(out, dout)
    dq_acc, dk, dv = torch.zeros(q.shape, device="cuda"), torch.empty_like(k), torch.empty_like(v)
    attn_bwd_sm90(dout, q, k, v, lse, delta, dq_acc, dk, dv, scale, causal_offset=offset, band_lo=band_lo, **segs)
    ref = [torch.empty(t.shape, device="cuda") for t in (q, k, v)]
    triton_kernels.bwd(dout, q, k, v, lse, delta, *ref, softmax_scale=scale, mask=mask, accumulate=False)
    errors = {name: rel(got, want) for name, got, want in zip(("dq", "dk", "dv"), (dq_acc, dk, dv), ref)}
    grads = [torch.empty_like(t) for t in (q, k, v)]
    ms = {"gluon": do_bench(lambda: attn_bwd_sm90(dout, q, k, v, lse, delta, dq_acc, dk, dv, scale,
                                                  causal_offset=offset, band_lo=band_lo, **segs)),
          "triton": do_bench(lambda: triton_kernels.bwd(dout, q, k, v, lse, delta, *grads, softmax_scale=scale,
                                                        mask=mask, accumulate=False))}
    repeats = []
    for det_round in det_rounds if not (window or documents or dropout) else ():
        gluon_launch.DET_ROUND = det_round
        runs = [torch.zeros(q.shape, device="cuda") for _ in range(2)]
        for acc in runs:
            attn_bwd_sm90(dout, q, k, v, lse, delta, acc, dk, dv, scale, causal_offset=offset, deterministic=True)
        repeats.append(bool(torch.equal(runs[0], runs[1])))
        errors[f"dq_det{det_round}"] = rel(runs[0], ref[0])
        ms[f"gluon_det{det_round}"] = do_bench(lambda: attn_bwd_sm90(dout, q, k, v, lse, delta, dq_acc, dk, dv, scale,
                                                                     causal_offset=offset, deterministic=True))
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    if not (window or documents or dropout):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=kv_heads != HEADS)
            ms["cudnn"] = do_bench(lambda: torch.autograd.grad(o, leaves, dout.transpose(1, 2), retain_graph=True))
    if not documents:
        pairs = seqlen * window - window * (window - 1) / 2 if window else seqlen * seqlen / (2 if causal else 1)
    flops = 2.5 * 4 * HEADS * pairs * head_dim
    return dict(seqlen=seqlen, heads=HEADS, kv_heads=kv_heads, head_dim=head_dim, causal=causal, window=window,
                documents=documents, dropout=dropout, ms=ms,
                bwd_tflops={name: round(flops / t / 1e9, 1) for name, t in ms.items()},
                gluon_rel_err_vs_triton=errors, det_repeats=all(repeats))


def case_args(p: argparse.ArgumentParser) -> None:
    """The problem flags this script and forward_alone.py share."""
    p.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8])
    p.add_argument("--head-dim", type=int, default=128, choices=gluon_launch.HEAD_DIMS)
    p.add_argument("--windows", type=int, nargs="+", default=[],
                   help="time causal sliding windows of these many keys (instead of causal and not)")
    p.add_argument("--documents", action="store_true", help="time causal packed documents (instead of the above)")


def run_cases(args, time_one) -> None:
    """Prints the device, then ``time_one(seqlen, kv_heads, causal, window)``'s JSON line for
    every configuration of ``case_args``' flags."""
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    cases = [(causal, 0) for causal in (False, True)] if not args.windows else [(True, w) for w in args.windows]
    for kv_heads in args.kv_heads:
        for seqlen in args.seqlens:
            for causal, window in [(True, 0)] if args.documents else cases:
                print(json.dumps(time_one(seqlen, kv_heads, causal, window)), flush=True)
                torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    case_args(p)
    p.add_argument("--det-rounds", type=int, nargs="+", default=[gluon_launch.DET_ROUND])
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout at this rate (kernels/dropout.py)")
    args = p.parse_args()
    run_cases(args, lambda seqlen, kv_heads, causal, window: one(seqlen, kv_heads, causal, args.det_rounds,
                                                                 args.head_dim, window, args.documents, args.dropout))


if __name__ == "__main__":
    main()
