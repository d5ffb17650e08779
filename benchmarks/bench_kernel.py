"""Single-GPU kernel benchmark: ringflash ``flash_attn`` against torch SDPA (flash and cuDNN
backends), forward and forward+backward, side by side in one run.

    python benchmarks/bench_kernel.py            # bf16, batch 1, 32 heads, head_dim 64/128,
                                                 # seqlen 2k..64k, causal and not
    python benchmarks/bench_kernel.py --quick    # a smoke run (about half a minute)

Writes benchmarks/results/<out-name>.json (+ .png) and prints a TFLOP/s table. Before timing
each configuration, ringflash's output (and gradients) are checked against SDPA's flash
backend on the same inputs; a mismatch aborts the run, so a fast wrong kernel is never
reported. A backend that raises for a configuration (cuDNN unsupported, out of memory) gets
null and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Callable, Optional

import torch

import _harness as H

IMPLS = ("ringflash", "ringflash_fused", "sdpa_flash", "sdpa_cudnn")
DEFAULT_SEQLENS = "2k,4k,8k,16k,32k,64k"
QUICK_SEQLENS = "4k,16k"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seqlens", nargs="+", default=[DEFAULT_SEQLENS],
                   help="sequence lengths, e.g. 2k,4k or 2048 4096")
    p.add_argument("--head-dims", nargs="+", default=["64,128"], help="head dims")
    p.add_argument("--add-hd256", action="store_true", help="also benchmark head_dim 256")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--causal", choices=("both", "causal", "noncausal"), default="both")
    p.add_argument("--impls", nargs="+", default=[",".join(IMPLS)], help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--dtype", choices=sorted(H.DTYPES), default="bf16")
    p.add_argument("--quick", action="store_true",
                   help=f"seqlens {QUICK_SEQLENS}, head_dim 128 only, shorter timing")
    p.add_argument("--out-name", default="kernel_h200", help="results/<out-name>.json and .png")
    p.add_argument("--out-dir", default=None, help="directory for the results (default benchmarks/results)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0, help="timed time per measurement")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=100)
    p.add_argument("--tol", type=float, default=2e-2, help="max relative error of out vs sdpa_flash")
    p.add_argument("--grad-tol", type=float, default=5e-2, help="max relative error of dq, dk, dv")
    p.add_argument("--no-grad-check", action="store_true", help="check the forward output only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke test of the script")
    args = p.parse_args(argv)
    try:
        args.impls = H.parse_names(args.impls, IMPLS)
        if args.quick:
            args.seqlens, args.head_dims = [QUICK_SEQLENS], ["128"]
            args.rep_ms, args.warmup_ms = min(args.rep_ms, 50.0), min(args.warmup_ms, 10.0)
        args.seqlens = H.parse_sizes(args.seqlens)
        args.head_dims = H.parse_sizes(args.head_dims)
        if args.add_hd256 and 256 not in args.head_dims:
            args.head_dims.append(256)
    except ValueError as exc:
        p.error(str(exc))
    if not args.impls:
        p.error("--impls is empty")
    return args


# ----------------------------------------------------------------------------- implementations


class Impl:
    """One contender: how its inputs are laid out and how it is called."""

    def __init__(self, name: str, layout: str, call: Callable, context: Callable[[], contextlib.AbstractContextManager]):
        self.name, self.layout, self.call, self.context = name, layout, call, context


def make_impls(names) -> dict[str, Impl]:
    impls = {}
    if "ringflash" in names:
        from ringflash.kernels import flash_attn

        impls["ringflash"] = Impl("ringflash", "bshd",
                                  lambda q, k, v, causal: flash_attn(q, k, v, causal=causal),
                                  contextlib.nullcontext)
    if "ringflash_fused" in names:  # the opt-in one-kernel backward (triton_attn.FUSED_BWD)
        from ringflash.kernels import flash_attn

        impls["ringflash_fused"] = Impl("ringflash_fused", "bshd",
                                        lambda q, k, v, causal: flash_attn(q, k, v, causal=causal),
                                        _fused_backward)
    for name, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
        if name in names:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            be = getattr(SDPBackend, backend)
            impls[name] = Impl(name, "bhsd", _sdpa_call, (lambda be=be: sdpa_kernel(be)))
    return impls


@contextlib.contextmanager
def _fused_backward():
    from ringflash.kernels import triton_attn

    saved, triton_attn.FUSED_BWD = triton_attn.FUSED_BWD, True
    try:
        yield
    finally:
        triton_attn.FUSED_BWD = saved


def _sdpa_call(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _to_bshd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "bshd" else x.transpose(1, 2)


# ----------------------------------------------------------------------------- correctness guard


def sampled_reference(q, k, v, causal: bool, n_rows: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of a few query rows against all keys (inputs (B, S, H, D)): (rows, out)."""
    b, s, h, d = q.shape
    rows = torch.unique(torch.linspace(0, s - 1, min(n_rows, s), device=q.device).round().long())
    qs = q[:, rows].float().transpose(1, 2)                    # (B, H, R, D)
    kk = k.float().transpose(1, 2)
    vv = v.float().transpose(1, 2)
    if kk.shape[1] != h:
        kk = kk.repeat_interleave(h // kk.shape[1], dim=1)
        vv = vv.repeat_interleave(h // vv.shape[1], dim=1)
    scores = qs @ kk.transpose(-1, -2) * d ** -0.5            # (B, H, R, S)
    if causal:
        keys = torch.arange(s, device=q.device)
        scores = scores.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vv                   # (B, H, R, D)
    return rows, out.transpose(1, 2)


class WrongResult(RuntimeError):
    pass


def check_config(impls, inputs, dout, causal, args) -> Optional[float]:
    """Compare ringflash with sdpa_flash (out, and dq/dk/dv) on the same inputs.

    Returns ringflash's relative error of out; raises WrongResult on a mismatch. When SDPA's
    flash backend cannot run this configuration, falls back to an fp32 reference on sampled
    query rows (forward only).
    """
    rf = impls["ringflash"]
    q, k, v = inputs["bshd"]
    want_grads = not args.no_grad_check
    leaves = [t.detach().requires_grad_(want_grads) for t in (q, k, v)]
    with torch.set_grad_enabled(want_grads):
        out = rf.call(*leaves, causal)
        if want_grads:
            out.backward(dout["bshd"])
    got = [out.detach()] + ([t.grad for t in leaves] if want_grads else [])
    del leaves, out

    ref = None
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qs, ks, vs = (t.detach().requires_grad_(want_grads) for t in inputs["bhsd"])
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.set_grad_enabled(want_grads):
            o = _sdpa_call(qs, ks, vs, causal)
            if want_grads:
                o.backward(dout["bhsd"])
        ref = [o.detach().transpose(1, 2)] + ([t.grad.transpose(1, 2) for t in (qs, ks, vs)] if want_grads else [])
        del qs, ks, vs, o
    except Exception as exc:  # noqa: BLE001 - fall back to the sampled fp32 reference
        print(f"    guard: sdpa_flash unavailable ({H.short_error(exc)}); sampled fp32 reference, forward only",
              flush=True)
    if ref is None:
        rows, ref_rows = sampled_reference(q, k, v, causal)
        err = H.rel_err(got[0][:, rows], ref_rows)
        names, errs, tols = ["out"], [err], [args.tol]
    else:
        names = ["out", "dq", "dk", "dv"][: len(got)]
        errs = [H.rel_err(a, b) for a, b in zip(got, ref)]
        tols = [args.tol] + [args.grad_tol] * (len(errs) - 1)
    bad = [f"{n} rel err {e:.3g} > {t:g}" for n, e, t in zip(names, errs, tols) if not e <= t]
    if bad:
        raise WrongResult("; ".join(bad))
    return errs[0]


# ----------------------------------------------------------------------------- timing


def time_impl(impl: Impl, inputs, dout, causal, device, args) -> tuple[Optional[float], Optional[float], Optional[str]]:
    """(fwd ms, fwd+bwd ms, error). Each phase may fail on its own."""
    q, k, v = inputs[impl.layout]
    g = dout[impl.layout]
    opts = dict(device=device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                min_reps=args.min_reps, max_reps=args.max_reps)
    fwd_ms = fwdbwd_ms = None
    errors = []
    with impl.context():
        try:
            with torch.no_grad():
                fwd_ms = H.bench_ms(lambda: impl.call(q, k, v, causal), **opts)
        except Exception as exc:  # noqa: BLE001 - record null, keep going
            errors.append(f"fwd: {H.short_error(exc)}")
            H.free_memory(device)
        # Fresh leaves over the same storage: no copies, grads reset to None before every call.
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        try:
            fwdbwd_ms = H.bench_ms(lambda: impl.call(*leaves, causal).backward(g), grad_to_none=leaves, **opts)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"fwd+bwd: {H.short_error(exc)}")
        leaves = None  # drop the grads' owners before the next impl
        H.free_memory(device)
    return fwd_ms, fwdbwd_ms, ("; ".join(errors) or None)


def make_inputs(batch, seqlen, heads, head_dim, dtype, device, seed):
    """q, k, v, dout in (B, S, H, D) for ringflash and, as separate contiguous tensors holding
    the same values, in (B, H, S, D) for SDPA, so no impl pays for a transpose."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, seqlen, heads, head_dim)
    q, k, v, do = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(4))
    bhsd = [t.transpose(1, 2).contiguous() for t in (q, k, v, do)]
    inputs = {"bshd": (q, k, v), "bhsd": tuple(bhsd[:3])}
    dout = {"bshd": do, "bhsd": bhsd[3]}
    return inputs, dout


# ----------------------------------------------------------------------------- main




def run(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("ERROR: no CUDA device; use --device cpu for a smoke test", file=sys.stderr)
            return 2
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = H.DTYPES[args.dtype]
    impls = make_impls(args.impls)
    H.init_l2_flush(device)
    meta = H.collect_meta(device, world_size=1, dtype=args.dtype, batch=args.batch, heads=args.heads,
                          bench="kernel", impls=list(impls),
                          timing=(f"median of >= {args.min_reps} reps "
                                  f"({'CUDA events, L2 flushed' if device.type == 'cuda' else 'wall clock'}); "
                                  f"warmup {args.warmup_ms} ms, rep {args.rep_ms} ms"),
                          check=(f"before timing, ringflash out vs sdpa_flash out on the same inputs: rel err <= "
                                 f"{args.tol}" + ("" if args.no_grad_check else f", dq/dk/dv <= {args.grad_tol}")))
    print(f"# {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | commit {meta['commit'][:10]}",
          flush=True)

    records = []
    for head_dim in args.head_dims:
        for causal in H.causal_modes(args.causal):
            for seqlen in args.seqlens:
                tag = f"hd={head_dim} {'causal' if causal else 'full'} S={H.fmt_size(seqlen)}"
                inputs, dout = make_inputs(args.batch, seqlen, args.heads, head_dim, dtype, device,
                                           args.seed + seqlen + head_dim)
                flops = {m: H.attn_flops(args.batch, args.heads, seqlen, seqlen, head_dim, causal=causal, mode=m)
                         for m in ("fwd", "fwdbwd")}
                guard_err, guard_note = None, None
                if "ringflash" in impls:
                    try:
                        guard_err = check_config(impls, inputs, dout, causal, args)
                    except WrongResult as exc:
                        print("\n" + "!" * 78 + f"\nABORT: ringflash flash_attn gives a WRONG result at {tag}:"
                              f"\n  {exc}\nNo numbers are reported for a kernel that is not correct.\n"
                              + "!" * 78, file=sys.stderr, flush=True)
                        return 3
                    except Exception as exc:  # noqa: BLE001 - ringflash cannot run it: null, go on
                        guard_note = f"guard: {H.short_error(exc)}"
                        print(f"  {tag} ringflash failed in the correctness check: {guard_note}", flush=True)
                    H.free_memory(device)
                for name, impl in impls.items():
                    if name == "ringflash" and guard_note is not None:
                        fwd_ms = fwdbwd_ms = None
                        err = guard_note
                    else:
                        fwd_ms, fwdbwd_ms, err = time_impl(impl, inputs, dout, causal, device, args)
                    rec = {
                        "impl": name, "seqlen": seqlen, "head_dim": head_dim, "causal": causal,
                        "fwd_tflops": H.tflops(flops["fwd"], fwd_ms),
                        "fwdbwd_tflops": H.tflops(flops["fwdbwd"], fwdbwd_ms),
                        "heads": args.heads, "batch": args.batch, "dtype": args.dtype,
                        "fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms,
                    }
                    if name == "ringflash":
                        rec["rel_err_vs_sdpa_flash"] = guard_err
                    if err:
                        rec["error"] = err
                    records.append(rec)
                    print(f"  {tag:<24} {name:<11} fwd {_f(rec['fwd_tflops'])}  fwd+bwd {_f(rec['fwdbwd_tflops'])}"
                          " TFLOP/s" + (f"  ERROR {err}" if err else ""), flush=True)
                del inputs, dout
                H.free_memory(device)

    path = H.write_results(args.out_name, meta, records, args.out_dir)
    print(f"\nwrote {path}", flush=True)
    if not args.no_plot:
        H.try_plot(path)
    print()
    print(summary_table(records, list(impls)))
    return 0


def _f(x: Optional[float]) -> str:
    return "   -  " if x is None else f"{x:6.1f}"


def summary_table(records: list[dict], impl_names: list[str]) -> str:
    """One row per configuration, TFLOP/s of every impl for fwd and fwd+bwd side by side."""
    rows: dict[tuple, dict] = {}
    for r in records:
        key = (r["head_dim"], r["causal"], r["seqlen"])
        row = rows.setdefault(key, {"head_dim": r["head_dim"], "causal": r["causal"], "seqlen": H.fmt_size(r["seqlen"])})
        row[f"fwd:{r['impl']}"] = r["fwd_tflops"]
        row[f"fwdbwd:{r['impl']}"] = r["fwdbwd_tflops"]
    cols = [("head_dim", "hdim"), ("causal", "causal"), ("seqlen", "seqlen")]
    for phase, label in (("fwd", "fwd"), ("fwdbwd", "f+b")):
        cols += [(f"{phase}:{n}", f"{label} {n}", ".1f") for n in impl_names]
    return "TFLOP/s (higher is better)\n" + H.format_table(list(rows.values()), cols)


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
