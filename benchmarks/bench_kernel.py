"""Single-GPU kernel benchmark: ringflash ``flash_attn`` against torch SDPA (flash and cuDNN
backends), forward and forward+backward, side by side in one run.

    python benchmarks/bench_kernel.py               # bf16, batch 1, 32 heads, head_dim 64/128,
                                                    # seqlen 2k..64k, causal and not
    python benchmarks/bench_kernel.py --quick       # a short GPU run (seqlen 4k, 16k)
    python benchmarks/bench_kernel.py --device cpu  # smoke test of the script, seconds

Writes <out-dir>/kernel_<gpu>.json (+ .png), e.g. benchmarks/results/kernel_h200.json, and
prints a TFLOP/s table. A smoke run (--device cpu: small sizes, fp32, the PyTorch twin of
the kernels; or --quick) writes to a new temporary directory unless --out-dir is given, so
it never replaces committed results. Before timing each configuration, ringflash's output
(and gradients) are checked against SDPA's flash backend on the same inputs; a mismatch
aborts the run, so a fast wrong kernel is never reported. A backend that raises for a
configuration (cuDNN unsupported, out of memory) gets null and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Callable, Optional

import torch

import _harness as H

IMPLS = ("ringflash", "sdpa_flash", "sdpa_cudnn")
# Defaults of a GPU run, and of a CPU smoke run (small enough to finish in seconds; no cuDNN).
GPU_DEFAULTS = dict(seqlens="2k,4k,8k,16k,32k,64k", head_dims="64,128", heads=32, dtype="bf16",
                    impls=",".join(IMPLS), warmup_ms=25.0, rep_ms=100.0)
CPU_DEFAULTS = dict(seqlens="256,512", head_dims="64", heads=4, dtype="fp32",
                    impls="ringflash,sdpa_flash", warmup_ms=2.0, rep_ms=10.0)
QUICK_SEQLENS = "4k,16k"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=H.HelpFormatter)
    g, c = GPU_DEFAULTS, CPU_DEFAULTS
    p.add_argument("--seqlens", nargs="+", default=None,
                   help=f"sequence lengths, e.g. 2k,4k or 2048 4096 (default {g['seqlens']}; "
                        f"--quick {QUICK_SEQLENS}; on the cpu {c['seqlens']})")
    p.add_argument("--head-dims", nargs="+", default=None,
                   help=f"head dims (default {g['head_dims']}; on the cpu {c['head_dims']})")
    p.add_argument("--add-hd256", action="store_true", help="also benchmark head_dim 256")
    p.add_argument("--heads", type=int, default=None,
                   help=f"query (= key/value) heads (default {g['heads']}; on the cpu {c['heads']})")
    p.add_argument("--batch", type=int, default=1, help="sequences per call")
    p.add_argument("--causal", choices=("both", "causal", "noncausal"), default="both",
                   help="which masks to run")
    p.add_argument("--impls", nargs="+", default=None,
                   help=f"subset of {','.join(IMPLS)} (default all; on the cpu {c['impls']})")
    p.add_argument("--dtype", choices=sorted(H.DTYPES), default=None,
                   help=f"input dtype (default {g['dtype']}; on the cpu {c['dtype']})")
    p.add_argument("--quick", action="store_true",
                   help=f"a short GPU run: seqlens {QUICK_SEQLENS}, head_dim 128 only, shorter timing; "
                        "results to a temporary directory unless --out-dir")
    p.add_argument("--out-name", default=None,
                   help="results file name without .json (default kernel_<device>, e.g. kernel_h200)")
    H.add_run_args(p, g, c, max_reps=100)
    p.add_argument("--tol", type=float, default=2e-2, help="max relative error of out vs sdpa_flash")
    p.add_argument("--grad-tol", type=float, default=5e-2, help="max relative error of dq, dk, dv")
    p.add_argument("--no-grad-check", action="store_true", help="check the forward output only")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--device", default="cuda",
                   help="cuda, cuda:N, or cpu: a smoke test of the script (small sizes, fp32, seconds)")
    args = p.parse_args(argv)
    try:
        on_cpu = torch.device(args.device).type == "cpu"
    except RuntimeError as exc:
        p.error(f"--device: {exc}")
    base = CPU_DEFAULTS if on_cpu else GPU_DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, [value] if key in ("seqlens", "head_dims", "impls") else value)
    try:
        args.impls = H.parse_names(args.impls, IMPLS)
        if args.quick and not on_cpu:
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
    for name, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
        if name in names:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            be = getattr(SDPBackend, backend)
            impls[name] = Impl(name, "bhsd", _sdpa_call, (lambda be=be: sdpa_kernel(be)))
    return impls


def _sdpa_call(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


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
            print("ERROR: no CUDA device; use --device cpu for a smoke test of the script", file=sys.stderr)
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
    unit, scale = H.throughput_unit(device)
    meta["unit"] = "TFLOP/s (the *_tflops fields)"
    print(f"# {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | commit {meta['commit'][:10]}"
          + (" | smoke run: CPU, the PyTorch twin of the kernels" if device.type != "cuda" else ""),
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
                    print(f"  {tag:<24} {name:<11} fwd {_f(rec['fwd_tflops'], scale)}  "
                          f"fwd+bwd {_f(rec['fwdbwd_tflops'], scale)} {unit}"
                          + (f"  ERROR {err}" if err else ""), flush=True)
                del inputs, dout
                H.free_memory(device)

    out_dir = H.results_dir(args.out_dir, H.is_smoke_run(device, args.quick))
    path = H.write_results(args.out_name or H.result_name("kernel", device), meta, records, out_dir)
    print(f"\nwrote {path}", flush=True)
    if not args.no_plot:
        H.try_plot(path)
    print()
    print(summary_table(records, list(impls), unit, scale))
    return 0


def _f(x: Optional[float], scale: float = 1.0) -> str:
    return "   -  " if x is None else f"{x * scale:6.1f}"


def summary_table(records: list[dict], impl_names: list[str], unit: str = "TFLOP/s",
                  scale: float = 1.0) -> str:
    """One row per configuration, throughput of every impl for fwd and fwd+bwd side by side."""
    rows: dict[tuple, dict] = {}
    for r in records:
        key = (r["head_dim"], r["causal"], r["seqlen"])
        row = rows.setdefault(key, {"head_dim": r["head_dim"], "causal": r["causal"], "seqlen": H.fmt_size(r["seqlen"])})
        for phase in ("fwd", "fwdbwd"):
            value = r[f"{phase}_tflops"]
            row[f"{phase}:{r['impl']}"] = None if value is None else value * scale
    cols = [("head_dim", "hdim"), ("causal", "causal"), ("seqlen", "seqlen")]
    for phase, label in (("fwd", "fwd"), ("fwdbwd", "f+b")):
        cols += [(f"{phase}:{n}", f"{label} {n}", ".1f") for n in impl_names]
    return f"{unit} (higher is better)\n" + H.format_table(list(rows.values()), cols)


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
