"""Kernel round 3 on one H200: launch variants of ringflash's Triton forward (and the causal
dQ order) against the default launch and cuDNN's SDPA, in one process.

    pip install -e . && python3 benchmarks/kernel_variants.py --out $OUT     # ~4-5 minutes
    python3 benchmarks/kernel_variants.py --quick --out $OUT                   # seqlen 16k only
    python3 benchmarks/kernel_variants.py --cpu-smoke                          # tiny, Triton's interpreter

bf16, batch 1, 32 heads, head_dim 128, seqlen 8k/16k/32k/64k, causal and not. Variants are
the module-level switches of ringflash.kernels.triton_attn (FWD_*, DQ_LONGEST_FIRST):

  lf            causal forward: query tiles launched last-first (longest first)
  persist       persistent forward grid (one program per SM looping over (tile, head) items,
                causal items longest-first), heads one after the other
  persist-g8    the same, items of 8 heads interleaved (tile-major within each group of 8)
  persist-all   the same, every head's longest tile first (globally longest-first)
  ddesc         per-head 2-D TMA descriptors made in the kernel (what WS needs), no WS
  ws            tl.range(warp_specialize=True): one masked key loop, 4 warps -> 1 producer
                + 2 consumer warp groups, 2 stages, 128x128 tiles
  ws-bn64       the same with 128x64 tiles and 3 stages
  lf+ws, persist+ws, persist-all+ws   combinations
Forward+backward (autograd through flash_attn): base, lf (forward and dQ last-first), lf-dq
(dQ only), and best (the fastest correct forward variant of that row, with the dQ last-first
when causal).

Every variant is first compiled and run at seqlen 1k in a child process (a compiler crash
or hang there cannot take this process down), then here checked against the default
launch's output (max abs diff; over --tol is a FAILURE: printed, recorded, not timed, exit
status 1), then timed with triton.testing.do_bench (median; at least --min-reps reps).
TFLOP/s count the forward as 4*B*H*S*S*D (halved when causal), forward+backward as 3.5x.
Results: <out>/kernel_variants_h200.json (rewritten after every row), a table printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SEQLENS = "8k,16k,32k,64k"
PROBE_SEQLEN = 1024  # same compile-time specialization as 8k..64k (multiples of 16 and 128)

# name -> (triton_attn settings, forward tile override or None, causal only)
VARIANTS = {
    "base": ({}, None, False),
    "lf": (dict(FWD_LONGEST_FIRST=True), None, True),
    "persist": (dict(FWD_PERSISTENT=1, FWD_PERSISTENT_HEAD_GROUP=1), None, False),
    "persist-g8": (dict(FWD_PERSISTENT=1, FWD_PERSISTENT_HEAD_GROUP=8), None, False),
    "persist-all": (dict(FWD_PERSISTENT=1, FWD_PERSISTENT_HEAD_GROUP=0), None, False),
    "ddesc": (dict(FWD_DEVICE_DESCRIPTORS=True), None, False),
    "ws": (dict(FWD_WARP_SPECIALIZE=True, FWD_WS_STAGES=2), None, False),
    "ws-bn64": (dict(FWD_WARP_SPECIALIZE=True, FWD_WS_STAGES=3),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3), False),
    "lf+ws": (dict(FWD_LONGEST_FIRST=True, FWD_WARP_SPECIALIZE=True, FWD_WS_STAGES=2), None, True),
    "persist+ws": (dict(FWD_PERSISTENT=1, FWD_PERSISTENT_HEAD_GROUP=1, FWD_WARP_SPECIALIZE=True,
                        FWD_WS_STAGES=2), None, False),
    "persist-all+ws": (dict(FWD_PERSISTENT=1, FWD_PERSISTENT_HEAD_GROUP=0,
                            FWD_WARP_SPECIALIZE=True, FWD_WS_STAGES=2), None, True),
}
BWD_VARIANTS = {  # name -> (settings, causal only); "best" is built per row
    "base": ({}, False),
    "lf": (dict(FWD_LONGEST_FIRST=True, DQ_LONGEST_FIRST=True), True),
    "lf-dq": (dict(DQ_LONGEST_FIRST=True), True),
}


def parse_size(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=None,
                   help="directory for kernel_variants_h200.json (or a .json path); default: print only")
    p.add_argument("--quick", action="store_true", help="seqlen 16k only (a smoke run)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny sizes on the CPU through Triton's interpreter (exercises the script)")
    p.add_argument("--seqlens", default=DEFAULT_SEQLENS)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="forward variants to run (base is always run)")
    p.add_argument("--no-fwdbwd", action="store_true", help="forward only")
    p.add_argument("--rep", type=float, default=50.0, help="do_bench rep (ms)")
    p.add_argument("--warmup", type=float, default=10.0, help="do_bench warmup (ms)")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--tol", type=float, default=2e-2, help="max abs diff of out vs the base kernel")
    p.add_argument("--grad-tol", type=float, default=5e-2, help="max abs diff of dq, dk, dv")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="after this many seconds no new measurement starts (results so far are kept)")
    p.add_argument("--no-probe", action="store_true", help="compile the variants in this process")
    p.add_argument("--probe-timeout-s", type=float, default=200.0)
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # child: variants to compile
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if "base" not in args.variants:
        args.variants.insert(0, "base")
    args.seqlens = [parse_size(s) for s in args.seqlens.split(",") if s]
    if args.quick:
        args.seqlens = [16384]
    if args.cpu_smoke:
        args.seqlens = [96] if args.quick else [64, 96]
        args.heads, args.head_dim = 2, 64
        args.min_reps = 1
        args.budget_s = max(args.budget_s, 1800.0)
    return args


# ----------------------------------------------------------------------------- setup


def import_kernels(cpu_smoke: bool):
    """(triton_attn, interface) of ringflash (main() has set TRITON_INTERPRET by then)."""
    try:
        from ringflash.kernels import interface, triton_attn
    except ImportError:  # not pip-installed: the kernels package straight from the checkout
        sys.path.insert(0, str(REPO))
        for name in [m for m in sys.modules if m == "ringflash" or m.startswith("ringflash.")]:
            del sys.modules[name]
        from kernels import interface, triton_attn
    if cpu_smoke:  # the dispatcher sends CPU tensors to the PyTorch twin: send them to Triton
        interface._backend = lambda t: triton_attn
    return triton_attn, interface


class Env:
    """What every phase needs: the modules, the device, the defaults of the switches."""

    def __init__(self, args):
        import torch
        import triton
        self.args, self.torch, self.triton = args, torch, triton
        self.ta, self.interface = import_kernels(args.cpu_smoke)
        self.device = torch.device("cpu" if args.cpu_smoke else "cuda")
        # The interpreter gets bf16 tl.dot wrong (tests/test_kernels.py): fp16 there.
        self.dtype = torch.float16 if args.cpu_smoke else torch.bfloat16
        names = {k for s, _, _ in VARIANTS.values() for k in s} | {"DQ_LONGEST_FIRST"}
        missing = [n for n in names if not hasattr(self.ta, n)]
        if missing:
            raise SystemExit(f"triton_attn has no {missing}: is this the round-3 checkout?")
        self.defaults = {n: getattr(self.ta, n) for n in names}
        self.fwd_config = self.ta.fwd_config

    @contextlib.contextmanager
    def variant(self, settings: dict, tiles: dict | None = None):
        """The switches (and forward tiles) of one variant, restored afterwards."""
        for n, v in {**self.defaults, **settings}.items():
            setattr(self.ta, n, v)
        if tiles is not None:
            self.ta.fwd_config = lambda head_dim, dtype: dict(tiles)
        try:
            yield
        finally:
            for n, v in self.defaults.items():
                setattr(self.ta, n, v)
            self.ta.fwd_config = self.fwd_config

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def inputs(self, seqlen: int, seed: int = 0):
        torch, a = self.torch, self.args
        gen = torch.Generator(device=self.device).manual_seed(seed)
        shape = (a.batch, seqlen, a.heads, a.head_dim)
        q, k, v, do = (torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype)
                       for _ in range(4))
        bhsd = [t.transpose(1, 2).contiguous() for t in (q, k, v, do)]
        return (q, k, v, do), bhsd

    def fwd(self, q, k, v, out, lse, causal):
        self.ta.fwd(q, k, v, out, lse, softmax_scale=q.shape[-1] ** -0.5,
                    causal_offset=0 if causal else None, accumulate=False)
        return out

    def fwdbwd(self, q, k, v, do, causal):
        """(out, dq, dk, dv) through the library's autograd op."""
        torch = self.torch
        out = self.interface.flash_attn(q, k, v, causal=causal)
        return (out, *torch.autograd.grad(out, (q, k, v), do))


def sdpa_context(env):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if env.args.cpu_smoke:
        return sdpa_kernel(SDPBackend.MATH)
    return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)


def max_abs(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def short(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " | ")
    return text if len(text) <= limit else text[:limit] + " ..."


# ----------------------------------------------------------------------------- compile probe


def probe_child(args) -> int:
    """Child: compile and run each listed variant at PROBE_SEQLEN, both masks; one line each."""
    env = Env(args)
    torch = env.torch
    (q, k, v, _), _ = env.inputs(PROBE_SEQLEN if not args.cpu_smoke else args.seqlens[0])
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=env.device)
    ref = {}
    with env.variant({}):
        for causal in (False, True):
            ref[causal] = env.fwd(q, k, v, out, lse, causal).clone()
    env.sync()
    for item in args.probe.split(";"):
        name, causal = item.rsplit(":", 1)
        causal = causal == "1"
        settings, tiles, _ = VARIANTS[name]
        print(f"PROBE-START {name}:{int(causal)}", flush=True)
        t0 = time.time()
        try:
            with env.variant(settings, tiles):
                got = env.fwd(q, k, v, out, lse, causal)
                env.sync()
            diff = max_abs(got, ref[causal])
            print(f"PROBE-OK {name}:{int(causal)} {time.time() - t0:.1f}s maxdiff={diff:.3g}", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            print(f"PROBE-FAIL {name}:{int(causal)} {short(exc)}", flush=True)
    return 0


def run_probes(args, items: list[str]) -> dict[str, str]:
    """Compile items ("name:causal") in child processes; {item: "ok" | error}. A child that
    crashes or hangs is charged to the item it was on; the rest go to a fresh child."""
    results: dict[str, str] = {}
    todo = list(items)
    while todo:
        cmd = [sys.executable, os.path.abspath(__file__), "--probe", ";".join(todo),
               "--head-dim", str(args.head_dim), "--heads", str(args.heads),
               "--batch", str(args.batch)]
        if args.cpu_smoke:
            cmd.append("--cpu-smoke")
        current, lines = None, []
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.probe_timeout_s)
            lines, tail, rc = proc.stdout.splitlines(), proc.stderr[-2000:], proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            lines, tail, rc = out.splitlines(), f"timed out after {args.probe_timeout_s:.0f}s", None
        for line in lines:
            parts = line.split(" ", 2)
            if parts[0] == "PROBE-START":
                current = parts[1]
            elif parts[0] in ("PROBE-OK", "PROBE-FAIL"):
                results[parts[1]] = "ok" if parts[0] == "PROBE-OK" else (parts[2] if len(parts) > 2 else "failed")
                print(f"  probe {line[6:]}", flush=True)
                current = None
        todo = [i for i in todo if i not in results]
        if todo:
            victim = current if current in todo else todo[0]
            reason = tail.strip().splitlines()[-1] if tail.strip() else f"child exit {rc}"
            results[victim] = f"child died or hung (rc={rc}): {reason}"[:400]
            print(f"  probe FAIL {victim}: {results[victim]}", flush=True)
            todo.remove(victim)
        print(f"  probe child done in {time.time() - t0:.0f}s", flush=True)
    return results


# ----------------------------------------------------------------------------- timing


def bench(env, fn) -> float:
    """Median ms of fn(): triton.testing.do_bench (L2 flushed, warm-up included), with rep
    raised so that at least --min-reps calls are timed. On the CPU smoke run: wall clock."""
    args = env.args
    if args.cpu_smoke:
        times = []
        for _ in range(max(1, args.min_reps)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    torch = env.torch
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    est = start.elapsed_time(end)
    rep = max(args.rep, args.min_reps * est * 1.05)
    return env.triton.testing.do_bench(fn, warmup=args.warmup, rep=rep, return_mode="median")


def flops(args, seqlen: int, causal: bool, mode: str) -> float:
    f = 4.0 * args.batch * args.heads * seqlen * seqlen * args.head_dim
    f = f / 2 if causal else f
    return f * (3.5 if mode == "fwdbwd" else 1.0)


class Run:
    def __init__(self, env, out_path):
        self.env, self.args, self.out_path = env, env.args, out_path
        self.t0 = time.time()
        self.records: list[dict] = []
        self.failures: list[str] = []
        self.probe: dict[str, str] = {}
        self.meta = self._meta()

    def _meta(self):
        torch, triton = self.env.torch, self.env.triton
        meta = dict(script="benchmarks/kernel_variants.py", argv=sys.argv[1:], torch=torch.__version__,
                    triton=triton.__version__, python=platform.python_version(),
                    started=time.strftime("%Y-%m-%d %H:%M:%S"), batch=self.args.batch,
                    heads=self.args.heads, head_dim=self.args.head_dim, dtype="bf16",
                    timing=f"triton.testing.do_bench median, rep>={self.args.rep}ms, "
                           f">={self.args.min_reps} reps, warmup {self.args.warmup}ms",
                    flops="fwd 4*B*H*S*S*D (/2 causal); fwd+bwd 3.5x fwd",
                    variants={n: dict(settings=s, tiles=t, causal_only=c)
                              for n, (s, t, c) in VARIANTS.items() if n in self.args.variants})
        if self.env.device.type == "cuda":
            meta["gpu"] = torch.cuda.get_device_name()
            meta["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
            meta["cudnn"] = torch.backends.cudnn.version()
        try:
            meta["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                            capture_output=True, text=True).stdout.strip()
            meta["dirty_files"] = subprocess.run(
                ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True, text=True).stdout.split("\n")[:40]
        except OSError:
            pass
        return meta

    def over_budget(self) -> bool:
        return time.time() - self.t0 > self.args.budget_s

    def save(self):
        if self.out_path is None:
            return
        data = dict(meta={**self.meta, "elapsed_s": round(time.time() - self.t0, 1)},
                    probe=self.probe, failures=self.failures, records=self.records)
        tmp = self.out_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.out_path)

    def record(self, seqlen, causal, mode, impl, ms=None, diff=None, error=None, cudnn_ms=None,
               settings=None):
        tf = flops(self.args, seqlen, causal, mode) / (ms * 1e-3) / 1e12 if ms else None
        ratio = (cudnn_ms / ms) if (ms and cudnn_ms) else None
        rec = dict(seqlen=seqlen, causal=causal, mode=mode, impl=impl, ms=ms, tflops=tf,
                   ratio_cudnn=ratio, max_abs_diff=diff, error=error, settings=settings)
        self.records.append(rec)
        text = f"{seqlen // 1024 if seqlen >= 1024 else seqlen:>4}{'k' if seqlen >= 1024 else ' '} " \
               f"{'causal' if causal else 'full  '} {mode:6} {impl:15}"
        if ms is not None:
            text += f" {ms:9.3f} ms {tf:7.1f} TFLOP/s"
            text += f"  x{ratio:.3f} cuDNN" if ratio else ""
        if diff is not None:
            text += f"  maxdiff {diff:.2e}"
        if error:
            text += f"  [{error}]"
        print(text, flush=True)
        return rec

    def fail(self, text):
        self.failures.append(text)
        print(f"!!! CHECK FAILED: {text}", flush=True)


def run_row(run: Run, seqlen: int, causal: bool, usable: set, qkv, bhsd):
    env, args, torch = run.env, run.args, run.env.torch
    q, k, v, do = qkv
    qh, kh, vh, doh = bhsd
    F = torch.nn.functional

    # cuDNN, the yardstick
    cudnn = {}
    for mode in ("fwd", "fwdbwd"):
        if mode == "fwdbwd" and args.no_fwdbwd:
            continue
        if run.over_budget():
            run.record(seqlen, causal, mode, "sdpa-cudnn", error="skipped: time budget")
            continue
        try:
            with sdpa_context(env):
                if mode == "fwd":
                    with torch.no_grad():
                        fn = lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
                        cudnn_out = fn()
                        ms = bench(env, fn)
                else:
                    leaves = [t.detach().requires_grad_() for t in (qh, kh, vh)]

                    def fn():
                        o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                        return torch.autograd.grad(o, leaves, doh)
                    ms = bench(env, fn)
                    leaves = None
            cudnn[mode] = ms
            run.record(seqlen, causal, mode, "sdpa-cudnn", ms=ms, cudnn_ms=ms)
        except Exception as exc:  # noqa: BLE001 - no yardstick: ratios stay null
            run.record(seqlen, causal, mode, "sdpa-cudnn", error=short(exc))

    # forward variants
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=env.device)
    with env.variant({}):
        base_out = env.fwd(q, k, v, out, lse, causal).clone()
    if "fwd" in cudnn:
        print(f"      (base vs cuDNN forward: max abs diff "
              f"{max_abs(base_out, cudnn_out.transpose(1, 2)):.2e})", flush=True)
    cudnn_out = None
    fwd_ms = {}
    for name in args.variants:
        settings, tiles, causal_only = VARIANTS[name]
        if causal_only and not causal:
            continue
        if name != "base" and f"{name}:{int(causal)}" not in usable:
            run.record(seqlen, causal, "fwd", name, error=f"probe: {run.probe.get(f'{name}:{int(causal)}')}",
                       settings=settings)
            continue
        if run.over_budget():
            run.record(seqlen, causal, "fwd", name, error="skipped: time budget", settings=settings)
            continue
        try:
            with env.variant(settings, tiles):
                got = env.fwd(q, k, v, out, lse, causal)
                env.sync()
                diff = max_abs(got, base_out)
                if not diff <= args.tol:
                    run.fail(f"fwd {name} seqlen {seqlen} causal {causal}: max abs diff {diff:.3e}")
                    run.record(seqlen, causal, "fwd", name, diff=diff, error="wrong output: not timed",
                               settings=settings)
                    continue
                ms = bench(env, lambda: env.fwd(q, k, v, out, lse, causal))
            fwd_ms[name] = ms
            run.record(seqlen, causal, "fwd", name, ms=ms, diff=diff, cudnn_ms=cudnn.get("fwd"),
                       settings=settings)
        except Exception as exc:  # noqa: BLE001 - a variant that fails here is reported, not fatal
            run.record(seqlen, causal, "fwd", name, error=short(exc), settings=settings)
    out = lse = base_out = None

    # forward + backward
    if args.no_fwdbwd:
        return
    best = min((n for n in fwd_ms if n != "base"), key=fwd_ms.get, default=None)
    plans = {n: s for n, (s, c) in BWD_VARIANTS.items() if causal or not c}
    if best is not None and fwd_ms[best] < fwd_ms.get("base", math.inf):
        settings, tiles, _ = VARIANTS[best]
        plans["best"] = (dict(settings, DQ_LONGEST_FIRST=True) if causal else dict(settings), tiles)
        print(f"      (fwd+bwd 'best' = forward {best}{' + dQ last-first' if causal else ''})", flush=True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    base = None
    for name, plan in plans.items():
        settings, tiles = plan if isinstance(plan, tuple) else (plan, None)
        if run.over_budget():
            run.record(seqlen, causal, "fwdbwd", name, error="skipped: time budget", settings=settings)
            continue
        try:
            with env.variant(settings, tiles):
                got = env.fwdbwd(*leaves, do, causal)
                env.sync()
                if base is None:
                    base, diff = got, None
                else:
                    diffs = [max_abs(g, b) for g, b in zip(got, base)]
                    diff = max(diffs)
                    if not (diffs[0] <= args.tol and max(diffs[1:]) <= args.grad_tol):
                        run.fail(f"fwdbwd {name} seqlen {seqlen} causal {causal}: max abs diff "
                                 f"out/dq/dk/dv {', '.join(f'{d:.3e}' for d in diffs)}")
                        run.record(seqlen, causal, "fwdbwd", name, diff=diff,
                                   error="wrong output: not timed", settings=settings)
                        continue
                got = None
                ms = bench(env, lambda: env.fwdbwd(*leaves, do, causal))
            rec = run.record(seqlen, causal, "fwdbwd", name, ms=ms, diff=diff,
                             cudnn_ms=cudnn.get("fwdbwd"), settings=settings)
            if name == "best":
                rec["best_forward"] = best
        except Exception as exc:  # noqa: BLE001
            run.record(seqlen, causal, "fwdbwd", name, error=short(exc), settings=settings)
            if name == "base":
                break  # nothing to check the others against
    base = leaves = None


def print_tables(run: Run):
    recs = run.records
    rows = sorted({(r["seqlen"], r["causal"]) for r in recs})

    def cell(seqlen, causal, mode, impl, what):
        for r in recs:
            if (r["seqlen"], r["causal"], r["mode"], r["impl"]) == (seqlen, causal, mode, impl):
                if r[what] is None:
                    return "fail" if r["error"] and "skipped" not in r["error"] else "-"
                return f"{r[what]:.0f}" if what == "tflops" else f"{r[what]:.3f}"
        return ""

    order = list(VARIANTS) + [n for n in BWD_VARIANTS if n not in VARIANTS] + ["best"]
    for mode, title in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
        impls = sorted({r["impl"] for r in recs if r["mode"] == mode and r["impl"] in order},
                       key=order.index)
        if not impls:
            continue
        print(f"\n{title}: TFLOP/s of cuDNN and of the base launch, then each launch / cuDNN")
        heads = ["seqlen", "mask", "cuDNN-TF", "base-TF"] + impls
        widths = [max(6, len(h)) for h in heads]
        print("  ".join(h.rjust(w) for h, w in zip(heads, widths)))
        for seqlen, causal in rows:
            vals = [f"{seqlen // 1024}k" if seqlen >= 1024 else str(seqlen),
                    "causal" if causal else "full",
                    cell(seqlen, causal, mode, "sdpa-cudnn", "tflops"),
                    cell(seqlen, causal, mode, "base", "tflops")]
            vals += [cell(seqlen, causal, mode, i, "ratio_cudnn") for i in impls]
            best = [r.get("best_forward") for r in recs if (r["seqlen"], r["causal"], r["mode"],
                                                            r["impl"]) == (seqlen, causal, mode, "best")]
            print("  ".join(v.rjust(w) for v, w in zip(vals, widths))
                  + (f"   best: {best[0]}" if best and best[0] else ""))
    if run.failures:
        print(f"\n!!! {len(run.failures)} CHECK FAILURE(S):")
        for f in run.failures:
            print(f"!!!   {f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:  # before triton is imported: its own jit functions are decorated then
        os.environ["TRITON_INTERPRET"] = "1"
    if args.probe is not None:
        return probe_child(args)
    out_path = None
    if args.out:
        out_path = Path(args.out)
        if out_path.suffix != ".json":
            out_path.mkdir(parents=True, exist_ok=True)
            out_path = out_path / "kernel_variants_h200.json"
        else:
            out_path.parent.mkdir(parents=True, exist_ok=True)
    env = Env(args)
    if env.device.type == "cuda" and not env.torch.cuda.is_available():
        print("ERROR: no CUDA device (use --cpu-smoke to exercise the script on the CPU)")
        return 2
    run = Run(env, out_path)
    print(f"{run.meta.get('gpu', 'cpu (interpreter)')}  torch {run.meta['torch']}  triton "
          f"{run.meta['triton']}  cudnn {run.meta.get('cudnn')}  commit {run.meta.get('commit', '?')[:10]}",
          flush=True)

    items = [f"{n}:{int(c)}" for n in args.variants if n != "base"
             for c in (False, True) if c or not VARIANTS[n][2]]
    if args.no_probe:
        usable = set(items)
    else:
        print(f"compile probe of {len(items)} (variant, mask) pairs in a child process ...", flush=True)
        run.probe = run_probes(args, items)
        usable = {i for i, r in run.probe.items() if r == "ok"}
    run.save()

    for seqlen in args.seqlens:
        qkv, bhsd = env.inputs(seqlen)
        for causal in (False, True):
            try:
                run_row(run, seqlen, causal, usable, qkv, bhsd)
            except Exception as exc:  # noqa: BLE001 - keep the other rows
                traceback.print_exc()
                run.records.append(dict(seqlen=seqlen, causal=causal, mode="row", impl="-",
                                        error=short(exc)))
            run.save()
        qkv = bhsd = None
        if env.device.type == "cuda":
            env.torch.cuda.empty_cache()
    run.meta["elapsed_s"] = round(time.time() - run.t0, 1)
    run.save()
    print_tables(run)
    print(f"\nelapsed {time.time() - run.t0:.0f}s" + (f"; wrote {out_path}" if out_path else ""))
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
