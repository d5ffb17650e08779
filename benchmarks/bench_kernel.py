"""Single-GPU kernel benchmark: ringflash ``flash_attn`` (its default backward, and with
deterministic=True) against torch SDPA (flash and cuDNN backends), forward and
forward+backward, side by side in one run.

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
from typing import Optional

import torch
import torch.nn.functional as F

from harness import checks, cli, plots, results, timing

IMPLS = ("ringflash", "ringflash_deterministic", "sdpa_flash", "sdpa_cudnn")
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}
# Defaults of a GPU run, and of a CPU smoke run (small enough to finish in seconds; no cuDNN).
GPU_DEFAULTS = dict(seqlens="2k,4k,8k,16k,32k,64k", head_dims="64,128", heads=32, dtype="bf16",
                    impls=",".join(IMPLS), warmup_ms=25.0, rep_ms=100.0)
CPU_DEFAULTS = dict(seqlens="256,512", head_dims="64", heads=4, dtype="fp32",
                    impls="ringflash,sdpa_flash", warmup_ms=2.0, rep_ms=10.0)
QUICK_SEQLENS = "4k,16k"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=cli.HelpFormatter)
    g, c = GPU_DEFAULTS, CPU_DEFAULTS
    p.add_argument("--seqlens", nargs="+", default=None,
                   help=f"sequence lengths, e.g. 2k,4k or 2048 4096 (default {g['seqlens']}; "
                        f"--quick {QUICK_SEQLENS}; on the cpu {c['seqlens']})")
    p.add_argument("--head-dims", nargs="+", default=None,
                   help=f"head dims (default {g['head_dims']}; on the cpu {c['head_dims']})")
    p.add_argument("--add-hd256", action="store_true", help="also benchmark head_dim 256")
    p.add_argument("--heads", type=int, default=None,
                   help=f"query (= key/value) heads (default {g['heads']}; on the cpu {c['heads']})")
    cli.add_problem_args(p, IMPLS, g, c)
    p.add_argument("--quick", action="store_true",
                   help=f"a short GPU run: seqlens {QUICK_SEQLENS}, head_dim 128 only, shorter timing; "
                        "results to a temporary directory unless --out-dir")
    p.add_argument("--out-name", default=None,
                   help="results file name without .json (default kernel_<device>, e.g. kernel_h200)")
    cli.add_run_args(p, g, c, max_reps=100)
    p.add_argument("--tol", type=float, default=2e-2, help="max relative error of out vs sdpa_flash")
    p.add_argument("--grad-tol", type=float, default=5e-2, help="max relative error of dq, dk, dv")
    p.add_argument("--no-grad-check", action="store_true", help="check the forward output only")
    p.add_argument("--device", default="cuda",
                   help="cuda, cuda:N, or cpu: a smoke test of the script (small sizes, fp32, seconds)")
    args = p.parse_args(argv)
    try:
        on_cpu = torch.device(args.device).type == "cpu"
    except RuntimeError as exc:
        p.error(f"--device: {exc}")
    cli.fill_defaults(args, CPU_DEFAULTS if on_cpu else GPU_DEFAULTS, lists=("seqlens", "head_dims", "impls"))
    try:
        args.impls = cli.parse_names(args.impls, IMPLS)
        if args.quick and not on_cpu:
            args.seqlens, args.head_dims = [QUICK_SEQLENS], ["128"]
            args.rep_ms, args.warmup_ms = min(args.rep_ms, 50.0), min(args.warmup_ms, 10.0)
        args.seqlens = cli.parse_sizes(args.seqlens)
        args.head_dims = cli.parse_sizes(args.head_dims)
        if args.add_hd256 and 256 not in args.head_dims:
            args.head_dims.append(256)
    except ValueError as exc:
        p.error(str(exc))
    if not args.impls:
        p.error("--impls is empty")
    return args


def make_impls(names) -> dict[str, tuple]:
    """name -> (input layout, call(q, k, v, causal), context it runs in)."""
    from ringflash.kernels import flash_attn

    impls = {}
    if "ringflash" in names:
        impls["ringflash"] = ("bshd", lambda q, k, v, causal: flash_attn(q, k, v, causal=causal),
                              contextlib.nullcontext)
    if "ringflash_deterministic" in names:  # the Triton backward wherever the default takes the Gluon one
        impls["ringflash_deterministic"] = (
            "bshd", lambda q, k, v, causal: flash_attn(q, k, v, causal=causal, deterministic=True),
            contextlib.nullcontext)
    for name in (n for n in SDPA_BACKENDS if n in names):
        impls[name] = ("bhsd", _sdpa_call, lambda name=name: _sdpa_backend(name))
    return impls


def _sdpa_call(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[name]))


def sampled_reference(q, k, v, causal: bool, n_rows: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of a few query rows against all keys (inputs (B, S, H, D)): (rows, out)."""
    b, s, h, d = q.shape
    rows = torch.unique(torch.linspace(0, s - 1, min(n_rows, s), device=q.device).round().long())
    qs = q[:, rows].float().transpose(1, 2)                    # (B, H, R, D)
    kk, vv = (t.float().transpose(1, 2).repeat_interleave(h // t.shape[2], dim=1) for t in (k, v))
    scores = qs @ kk.transpose(-1, -2) * d ** -0.5            # (B, H, R, S)
    if causal:
        keys = torch.arange(s, device=q.device)
        scores = scores.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
    return rows, (torch.softmax(scores, dim=-1) @ vv).transpose(1, 2)


def check_config(call, inputs, dout, causal, args) -> float:
    """A ringflash impl's out (and dq, dk, dv) against sdpa_flash's on the same inputs; its
    relative error of out, or WrongResult. Where SDPA's flash backend cannot run the
    configuration, an fp32 reference on sampled query rows (forward only)."""
    grads = not args.no_grad_check
    got = checks.out_and_grads(lambda q, k, v: call(q, k, v, causal), inputs["bshd"],
                               dout["bshd"], grads)
    try:
        with _sdpa_backend("sdpa_flash"):
            ref = checks.out_and_grads(lambda q, k, v: _sdpa_call(q, k, v, causal), inputs["bhsd"],
                                       dout["bhsd"], grads)
        errs = {n: checks.rel_err(got[n], ref[n].transpose(1, 2)) for n in got}
    except Exception as exc:  # noqa: BLE001 - fall back to the sampled fp32 reference
        print(f"    guard: sdpa_flash unavailable ({checks.short_error(exc)}); sampled fp32 reference, "
              "forward only", flush=True)
        rows, ref_rows = sampled_reference(*inputs["bshd"], causal)
        errs = {"out": checks.rel_err(got["out"][:, rows], ref_rows)}
    bad = checks.failed_checks(errs, args.tol, args.grad_tol)
    if bad:
        raise checks.WrongResult("; ".join(bad))
    return errs["out"]


def make_inputs(batch, seqlen, heads, head_dim, dtype, device, seed):
    """q, k, v, dout in (B, S, H, D) for ringflash and, as separate contiguous tensors holding
    the same values, in (B, H, S, D) for SDPA, so no impl pays for a transpose."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn((batch, seqlen, heads, head_dim), generator=gen, device=device, dtype=dtype)
                   for _ in range(4))
    bhsd = [t.transpose(1, 2).contiguous() for t in (q, k, v, do)]
    return {"bshd": (q, k, v), "bhsd": tuple(bhsd[:3])}, {"bshd": do, "bhsd": bhsd[3]}


def measure(name, impls, inputs, dout, causal, device, args, tag) -> tuple[dict, Optional[str]]:
    """fwd_ms, fwdbwd_ms, error of one impl (timing.time_phases), after ringflash's check."""
    layout, call, context = impls[name]
    guard = None
    if name.startswith("ringflash"):
        try:
            guard = check_config(call, inputs, dout, causal, args)
        except checks.WrongResult:
            raise
        except Exception as exc:  # noqa: BLE001 - ringflash cannot run it: null, go on
            note = f"guard: {checks.short_error(exc)}"
            print(f"  {tag} {name} failed in the correctness check: {note}", flush=True)
            return {"fwd_ms": None, "fwdbwd_ms": None, "error": note}, None
        finally:
            timing.free_memory(device)
    with context():
        res = timing.time_phases(lambda q, k, v: call(q, k, v, causal), inputs[layout], dout[layout],
                                 device=device, **timing.timing_opts(args))
    return res, guard


def run(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("ERROR: no CUDA device; use --device cpu for a smoke test of the script", file=sys.stderr)
            return 2
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = cli.DTYPES[args.dtype]
    impls = make_impls(args.impls)
    timing.init_l2_flush(device)
    meta = results.collect_meta(
        device, world_size=1, dtype=args.dtype, batch=args.batch, heads=args.heads, bench="kernel",
        impls=list(impls),
        timing=(f"median of >= {args.min_reps} reps "
                f"({'CUDA events, L2 flushed' if device.type == 'cuda' else 'wall clock'}); "
                f"warmup {args.warmup_ms} ms, rep {args.rep_ms} ms"),
        check=(f"before timing, ringflash out vs sdpa_flash out on the same inputs: rel err <= "
               f"{args.tol}" + ("" if args.no_grad_check else f", dq/dk/dv <= {args.grad_tol}")))
    unit, scale = timing.throughput_unit(device)
    meta["unit"] = "TFLOP/s (the *_tflops fields)"
    print(f"# {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | commit {meta['commit'][:10]}"
          + (" | smoke run: CPU, the PyTorch twin of the kernels" if device.type != "cuda" else ""),
          flush=True)

    records = []
    for head_dim in args.head_dims:
        for causal in cli.causal_modes(args.causal):
            for seqlen in args.seqlens:
                tag = f"hd={head_dim} {'causal' if causal else 'full'} S={cli.fmt_size(seqlen)}"
                inputs, dout = make_inputs(args.batch, seqlen, args.heads, head_dim, dtype, device,
                                           args.seed + seqlen + head_dim)
                flops = {m: timing.attn_flops(args.batch, args.heads, seqlen, seqlen, head_dim, causal=causal,
                                              mode=m) for m in ("fwd", "fwdbwd")}
                for name in impls:
                    try:
                        res, guard = measure(name, impls, inputs, dout, causal, device, args, tag)
                    except checks.WrongResult as exc:
                        print(checks.abort_banner(f"ringflash flash_attn gives a WRONG result at {tag}:\n  {exc}",
                                                  "a kernel"), file=sys.stderr, flush=True)
                        return 3
                    rec = {"impl": name, "seqlen": seqlen, "head_dim": head_dim, "causal": causal,
                           "fwd_tflops": timing.tflops(flops["fwd"], res["fwd_ms"]),
                           "fwdbwd_tflops": timing.tflops(flops["fwdbwd"], res["fwdbwd_ms"]),
                           "heads": args.heads, "batch": args.batch, "dtype": args.dtype,
                           "fwd_ms": res["fwd_ms"], "fwdbwd_ms": res["fwdbwd_ms"]}
                    if name.startswith("ringflash"):
                        rec["rel_err_vs_sdpa_flash"] = guard
                    if res["error"]:
                        rec["error"] = res["error"]
                    records.append(rec)
                    print(f"  {tag:<24} {name:<23} fwd {_f(rec['fwd_tflops'], scale)}  "
                          f"fwd+bwd {_f(rec['fwdbwd_tflops'], scale)} {unit}"
                          + (f"  ERROR {res['error']}" if res["error"] else ""), flush=True)
                del inputs, dout
                timing.free_memory(device)

    out_dir = results.results_dir(args.out_dir, results.is_smoke_run(device, args.quick))
    path = results.write_results(args.out_name or results.result_name("kernel", device), meta, records, out_dir)
    print(f"\nwrote {path}", flush=True)
    if not args.no_plot:
        plots.try_plot(path)
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
        row = rows.setdefault((r["head_dim"], r["causal"], r["seqlen"]),
                              {"head_dim": r["head_dim"], "causal": r["causal"], "seqlen": cli.fmt_size(r["seqlen"])})
        for phase in ("fwd", "fwdbwd"):
            value = r[f"{phase}_tflops"]
            row[f"{phase}:{r['impl']}"] = None if value is None else value * scale
    cols = [("head_dim", "hdim"), ("causal", "causal"), ("seqlen", "seqlen")]
    for phase, label in (("fwd", "fwd"), ("fwdbwd", "f+b")):
        cols += [(f"{phase}:{n}", f"{label} {n}", ".1f") for n in impl_names]
    return f"{unit} (higher is better)\n" + results.format_table(list(rows.values()), cols)


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
