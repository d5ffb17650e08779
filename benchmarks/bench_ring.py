"""Multi-GPU ring benchmark: ringflash ``ring_flash_attn`` against torch's context parallel
(SDPA flash and cuDNN backends) and against ringflash's own kernel on one GPU holding the
whole sequence, forward and forward+backward, side by side in one run.

    torchrun --nproc-per-node=4 benchmarks/bench_ring.py              # seqlen 32k, 64k
    torchrun --nproc-per-node=4 benchmarks/bench_ring.py --add-128k   # and 128k
    torchrun --nproc-per-node=4 benchmarks/bench_ring.py --profile-only --profile trace.json
    torchrun --nproc-per-node=2 benchmarks/bench_ring.py --device cpu   # smoke test, gloo
    torchrun --nproc-per-node=4 benchmarks/bench_ring.py --heads-parallel 1 2 4 --out-name mesh_h100x4
                                                   # the heads x ring grid at (U, R) = (1, 4), (2, 2), (4, 1)

Writes <out-dir>/ring_<gpu>x<N>.json (+ .png), e.g. benchmarks/results/ring_h200x4.json, and
prints a table on rank 0. A smoke run (--device cpu: gloo, small sizes, fp32, ringflash
only, since torch's context parallel has no CPU attention; or --quick) writes to a new
temporary directory unless --out-dir is given, so it never replaces committed results.
Throughput is per GPU (per process on the CPU): FLOPs of the global problem / world size /
time, time being the max over ranks of each rank's median. Efficiency = ringflash per-GPU TFLOP/s / ringflash_1gpu
TFLOP/s. At the smallest seqlen every implementation is checked against ringflash's kernel
on the full sequence (out, dq, dk, dv); ringflash aborts the run on a mismatch, a peer that
mismatches is reported as null.

torch's context parallel runs through torch_cp.py; timing, FLOPs, checks, results files and
the --profile breakdown come from the harness (harness/).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import torch_cp
from harness import checks, cli, plots, results, timing, traces

IMPLS = ("ringflash", *torch_cp.CP_BACKENDS, "ringflash_1gpu")
LAYOUTS = ("contiguous", "zigzag", "stripe")
MULTI_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Defaults of a GPU run, and of a CPU smoke run (seconds; torch CP has no CPU attention).
GPU_DEFAULTS = dict(seqlens="32k,64k", heads=32, gqa_kv_heads=8, head_dim=128, dtype="bf16",
                    impls=",".join(IMPLS), warmup_ms=25.0, rep_ms=100.0)
CPU_DEFAULTS = dict(seqlens="1k", heads=4, gqa_kv_heads=2, head_dim=32, dtype="fp32",
                    impls="ringflash,ringflash_1gpu", warmup_ms=2.0, rep_ms=10.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=cli.HelpFormatter)
    g, c = GPU_DEFAULTS, CPU_DEFAULTS
    p.add_argument("--seqlens", nargs="+", default=None,
                   help=f"global sequence lengths (default {g['seqlens']}; on the cpu {c['seqlens']})")
    p.add_argument("--add-128k", action="store_true", help="also run global seqlen 128k")
    p.add_argument("--heads", type=int, default=None,
                   help=f"query heads (default {g['heads']}; on the cpu {c['heads']})")
    p.add_argument("--gqa-kv-heads", type=int, default=None,
                   help=f"kv heads of the extra GQA row, 0: no GQA row (default {g['gqa_kv_heads']}; "
                        f"on the cpu {c['gqa_kv_heads']})")
    p.add_argument("--head-dim", type=int, default=None,
                   help=f"head dim (default {g['head_dim']}; on the cpu {c['head_dim']})")
    cli.add_problem_args(p, IMPLS, g, c)
    p.add_argument("--causal-layouts", nargs="+", default=["zigzag"],
                   help="ringflash layout(s) for causal runs, one record each")
    p.add_argument("--noncausal-layouts", nargs="+", default=["contiguous"],
                   help="ringflash layout(s) for non-causal runs")
    p.add_argument("--rotate-method", choices=("allgather", "alltoall"), default="allgather",
                   help="torch context parallel K/V rotation")
    p.add_argument("--transports", nargs="+", default=["auto"], choices=("auto", "nccl", "peer"),
                   help="ringflash's ring transport(s) (RINGFLASH_TRANSPORT), each its own row")
    p.add_argument("--heads-parallel", nargs="+", type=int, default=[1], metavar="U",
                   help="ringflash on a heads x ring grid of U x (ranks / U) (ringflash.heads), each U its "
                        "own row; 1 is the ring alone")
    p.add_argument("--no-rank-check", action="store_true",
                   help="set RINGFLASH_RANK_CHECK=0 (skip ringflash's per-call cross-rank argument check)")
    p.add_argument("--quick", action="store_true",
                   help="a short GPU run: smallest seqlen only, shorter timing; results to a "
                        "temporary directory unless --out-dir")
    p.add_argument("--out-name", default=None,
                   help="results file name without .json (default ring_<device>x<ranks>, e.g. ring_h200x4)")
    cli.add_run_args(p, g, c, max_reps=50)
    p.add_argument("--tol", type=float, default=2e-2, help="max relative error of out at the check")
    p.add_argument("--grad-tol", type=float, default=5e-2, help="max relative error of dq, dk, dv")
    p.add_argument("--timeout-min", type=float, default=10.0, help="process group timeout (minutes)")
    p.add_argument("--profile", metavar="PATH", default=None,
                   help="also write a chrome trace of one ringflash fwd+bwd to PATH (rank r>0: PATH.rank<r>)")
    p.add_argument("--profile-only", action="store_true", help="with --profile: skip the benchmark")
    p.add_argument("--profile-seqlen", default="64k", help="global seqlen of the profiled call")
    p.add_argument("--profile-layout", default=None, choices=LAYOUTS,
                   help="default: first of --causal-layouts / --noncausal-layouts")
    p.add_argument("--profile-noncausal", action="store_true", help="profile the non-causal case")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke test of the script over gloo (small sizes, fp32, seconds)")
    args = p.parse_args(argv)
    cli.fill_defaults(args, CPU_DEFAULTS if args.device == "cpu" else GPU_DEFAULTS, lists=("seqlens", "impls"))
    try:
        args.impls = cli.parse_names(args.impls, IMPLS)
        args.causal_layouts = cli.parse_names(args.causal_layouts, LAYOUTS)
        args.noncausal_layouts = cli.parse_names(args.noncausal_layouts, LAYOUTS)
        seqlens = cli.parse_sizes(args.seqlens)
        if args.add_128k and 128 * 1024 not in seqlens:
            seqlens = sorted(seqlens + [128 * 1024])
        if args.quick and args.device != "cpu":
            seqlens = seqlens[:1]
            args.rep_ms, args.warmup_ms = min(args.rep_ms, 50.0), min(args.warmup_ms, 10.0)
        args.seqlens = seqlens
        args.profile_seqlen = cli.parse_size(args.profile_seqlen)
    except ValueError as exc:
        p.error(str(exc))
    if any(u < 1 for u in args.heads_parallel):
        p.error(f"--heads-parallel sizes must be positive, got {args.heads_parallel}")
    if args.profile_only and not args.profile:
        p.error("--profile-only needs --profile PATH")
    if args.gqa_kv_heads >= args.heads:
        args.gqa_kv_heads = 0  # no GQA row possible with so few heads
    if args.gqa_kv_heads < 0 or (args.gqa_kv_heads and args.heads % args.gqa_kv_heads):
        p.error(f"--gqa-kv-heads must divide --heads ({args.heads}), got {args.gqa_kv_heads}")
    return args


# ----------------------------------------------------------------------------- process group


@dataclass
class Ctx:
    rank: int
    world: int
    device: torch.device
    group: object
    mesh: object = None
    mesh_error: Optional[str] = None
    grids: dict = None  # U -> the heads x ring grid of U x (world / U), made once
    # torch CP modes found wrong at the checked seqlen, never used unchecked later:
    # (impl, heads, kv_heads, causal) -> {mode, ...}
    cp_wrong_modes: dict = None

    def __post_init__(self):
        self.cp_wrong_modes = {}
        self.grids = {}

    def grid(self, heads_parallel: int):
        """The group of a ringflash run: the world (U = 1), else a U x (world / U) DeviceMesh,
        made on every rank the first time (every rank asks for the same U in turn)."""
        if heads_parallel == 1:
            return self.group
        if heads_parallel not in self.grids:
            from torch.distributed.device_mesh import init_device_mesh
            if self.world % heads_parallel:
                raise ValueError(f"--heads-parallel {heads_parallel} does not divide {self.world} ranks")
            self.grids[heads_parallel] = init_device_mesh(
                self.device.type, (heads_parallel, self.world // heads_parallel), mesh_dim_names=("heads", "ring"))
        return self.grids[heads_parallel]

    def log(self, *a, **kw):
        if self.rank == 0:
            print(*a, **kw, flush=True)


def setup(args) -> Ctx:
    for k, v in MULTI_GPU_ENV.items():
        os.environ.setdefault(k, v)
    if args.no_rank_check:
        os.environ["RINGFLASH_RANK_CHECK"] = "0"
    device = cli.start_ranks(args.device, args.timeout_min)  # without torchrun: a ring of one
    return Ctx(rank=dist.get_rank(), world=dist.get_world_size(), device=device, group=dist.group.WORLD)


def broadcast_obj(obj, ctx: Ctx, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=ctx.group)
    return box[0]


# ----------------------------------------------------------------------------- configurations and data


@dataclass(frozen=True)
class Cfg:
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool

    @property
    def tag(self) -> str:
        kv = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return (f"S={cli.fmt_size(self.seqlen)} h={self.heads}{kv} d={self.head_dim} "
                f"{'causal' if self.causal else 'full'}")

    def flops(self, mode: str) -> float:
        return timing.attn_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim,
                            causal=self.causal, mode=mode)


def make_full(cfg: Cfg, dtype, device, seed: int) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, dout (B, S, H, D) and k, v (B, S, Hkv, D), identical on every rank."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qshape = (cfg.batch, cfg.seqlen, cfg.heads, cfg.head_dim)
    kshape = (cfg.batch, cfg.seqlen, cfg.kv_heads, cfg.head_dim)
    q = torch.randn(qshape, generator=gen, device=device, dtype=dtype)
    k = torch.randn(kshape, generator=gen, device=device, dtype=dtype)
    v = torch.randn(kshape, generator=gen, device=device, dtype=dtype)
    do = torch.randn(qshape, generator=gen, device=device, dtype=dtype)
    return q, k, v, do


def reference(full, causal: bool) -> dict:
    """out, dq, dk, dv of ringflash's single-device kernel on the whole sequence (B, S, H, D)."""
    from ringflash.kernels import flash_attn

    return checks.out_and_grads(lambda q, k, v: flash_attn(q, k, v, causal=causal), full[:3], full[3])


# ----------------------------------------------------------------------------- ringflash


def ringflash_api():
    import ringflash.api as api  # imported late: --help must work without a built ringflash

    return api


def run_ringflash(cfg: Cfg, layout: str, transport: str, full, ref: Optional[dict], ctx: Ctx,
                  args, heads_parallel: int = 1) -> dict:
    """ringflash with RINGFLASH_TRANSPORT=transport for the duration of the run, on the
    grid of ``heads_parallel`` x (world / heads_parallel) ranks (1: the ring alone)."""
    from ringflash import exchange  # imported late, as ringflash_api
    from ringflash.groups import resolve_grid

    group = ctx.grid(heads_parallel)
    ring = resolve_grid(group).ring
    with cli.env_var("RINGFLASH_TRANSPORT", transport):
        exchange.release_buffers()  # this run's own peer buffers, counted in its peak memory
        res = _run_ringflash(cfg, layout, full, ref, ctx, args, group)
        res.update(heads_parallel=heads_parallel, ring=ctx.world // heads_parallel)
        # What "auto" resolved to, and what really moved the bytes ("gloo", not "nccl", on a CPU run).
        res["transport"] = cli.backend_label(ringflash_api().transport(ring), ring)
        if res.get("peak_bytes") is not None:
            res["peak_bytes"] += exchange.symmetric_bytes()
    return res


def _run_ringflash(cfg: Cfg, layout: str, full, ref: Optional[dict], ctx: Ctx, args, group) -> dict:
    api = ringflash_api()
    res = {"layout": layout, "note": None}
    try:
        q, k, v, do = (api.shard(t, dim=1, layout=layout, group=group) for t in full)
    except Exception as exc:  # noqa: BLE001 - e.g. seqlen not divisible: same on every rank
        return {**res, "error": f"shard: {checks.short_error(exc)}"}

    def call(q_, k_, v_):
        return api.ring_flash_attn(q_, k_, v_, causal=cfg.causal, group=group, layout=layout)

    if ref is not None:
        error = None
        try:
            got = checks.out_and_grads(call, (q, k, v), do)
        except Exception as exc:  # noqa: BLE001
            got, error = None, checks.short_error(exc)
        if not timing.all_ranks_ok(got is not None, ctx.group, ctx.device):
            return {**res, "error": f"check: {error or 'failed on another rank'}"}
        want = {n: api.shard(t, dim=1, layout=layout, group=group) for n, t in ref.items()}
        errs = checks.sharded_rel_errs({n: (got[n], want[n]) for n in got}, ctx.group, ctx.device)
        bad = checks.failed_checks(errs, args.tol, args.grad_tol)
        if bad:
            raise checks.WrongResult(f"ringflash ring_flash_attn (layout {layout}, group {group}) is WRONG at "
                                     f"{cfg.tag}: " + "; ".join(bad))
        res["rel_err"] = errs["out"]
        del got, want
    res.update(timing.time_phases(call, (q, k, v), do, device=ctx.device, group=ctx.group,
                                  **timing.timing_opts(args)))
    return res


def run_ringflash_1gpu(cfg: Cfg, full, ctx: Ctx, args) -> dict:
    """ringflash's kernel on rank 0 over the whole sequence; the other ranks wait."""
    res = {"layout": "full", "note": "one GPU, whole sequence" if ctx.device.type == "cuda"
           else "one process, whole sequence"}
    if ctx.rank == 0:
        from ringflash.kernels import flash_attn

        def call(q_, k_, v_):
            return flash_attn(q_, k_, v_, causal=cfg.causal)

        try:
            res.update(timing.time_phases(call, full[:3], full[3], device=ctx.device, **timing.timing_opts(args)))
        except Exception as exc:  # noqa: BLE001 - out of memory and the like: null
            res["error"] = checks.short_error(exc)
            timing.free_memory(ctx.device)
    timing.barrier(ctx.group)
    return broadcast_obj(res, ctx)


# ----------------------------------------------------------------------------- the benchmark


def configs(args) -> list[Cfg]:
    head_cfgs = [(args.heads, args.heads)]
    if args.gqa_kv_heads and args.gqa_kv_heads != args.heads:
        head_cfgs.append((args.heads, args.gqa_kv_heads))
    return [Cfg(args.batch, s, h, kvh, args.head_dim, c)
            for s in args.seqlens for (h, kvh) in head_cfgs for c in cli.causal_modes(args.causal)]


def make_record(impl: str, cfg: Cfg, res: dict, ctx: Ctx) -> dict:
    per_gpu = 1 if impl == "ringflash_1gpu" else ctx.world
    fwd_ms, fwdbwd_ms = res.get("fwd_ms"), res.get("fwdbwd_ms")
    peak = res.get("peak_bytes")
    rec = {
        "impl": impl, "layout": res.get("layout"), "seqlen": cfg.seqlen, "heads": cfg.heads,
        "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "causal": cfg.causal,
        "fwd_tflops_per_gpu": timing.tflops(cfg.flops("fwd") / per_gpu, fwd_ms),
        "fwdbwd_tflops_per_gpu": timing.tflops(cfg.flops("fwdbwd") / per_gpu, fwdbwd_ms),
        "peak_mem_gib": None if peak is None else peak / timing.GIB,
        "efficiency": None, "fwd_efficiency": None,
        "gpus": per_gpu, "batch": cfg.batch, "fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms,
    }
    for key in ("heads_parallel", "ring", "transport", "rel_err", "note", "error"):
        if res.get(key) is not None:
            rec[key] = res[key]
    return rec


def add_efficiency(records: list[dict]) -> None:
    """ringflash rows: per-GPU TFLOP/s over ringflash_1gpu's on the same problem."""
    base = {}
    for r in records:
        if r["impl"] == "ringflash_1gpu":
            base[_problem(r)] = r
    for r in records:
        b = base.get(_problem(r))
        if b is None or r["impl"] not in ("ringflash", "ringflash_1gpu"):
            continue
        for key, src in (("efficiency", "fwdbwd_tflops_per_gpu"), ("fwd_efficiency", "fwd_tflops_per_gpu")):
            if r.get(src) is not None and b.get(src):
                r[key] = r[src] / b[src]


def _problem(r: dict) -> tuple:
    return (r["seqlen"], r["heads"], r["kv_heads"], r["head_dim"], r["causal"])


def progress_line(rec: dict, tag: str, unit: tuple[str, float] = ("TFLOP/s per GPU", 1.0)) -> str:
    """One record as a log line; ``unit``: (label, factor) of timing.throughput_unit."""
    label, scale = unit

    def f(x, spec, factor=1.0):
        return "-" if x is None else format(x * factor, spec)
    grid = f"{rec['heads_parallel']}x{rec['ring']}" if rec.get("heads_parallel", 1) > 1 else None
    where = [x for x in (rec.get("layout"), rec.get("transport"), grid) if x]
    impl = rec["impl"] + (f"[{','.join(where)}]" if where else "")
    line = (f"  {tag:<32} {impl:<28} fwd {f(rec['fwd_tflops_per_gpu'], '6.1f', scale)}  "
            f"f+b {f(rec['fwdbwd_tflops_per_gpu'], '6.1f', scale)} {label}  "
            f"mem {f(rec['peak_mem_gib'], '.2f')} GiB")
    if rec.get("error"):
        line += f"  ERROR {rec['error']}"
    elif rec.get("note"):
        line += f"  ({rec['note']})"
    return line


def table_columns(device: torch.device) -> list[tuple]:
    """Columns of the summary table; throughput in TFLOP/s per GPU, GFLOP/s per process on the CPU."""
    short, scale = ("TF/GPU", 1.0) if device.type == "cuda" else ("GF/proc", 1e3)
    per = (lambda x: f"{x * scale:.1f}")
    return [("impl", "impl"), ("layout", "layout"), ("transport", "transport"), ("seqlen", "seqlen", cli.fmt_size),
            ("heads", "heads"), ("kv_heads", "kv"), ("causal", "causal"),
            ("fwd_tflops_per_gpu", f"fwd {short}", per), ("fwdbwd_tflops_per_gpu", f"f+b {short}", per),
            ("peak_mem_gib", "mem GiB", ".2f"), ("efficiency", "eff f+b", ".2f"),
            ("fwd_efficiency", "eff fwd", ".2f"), ("remark", "remark")]


def table_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in records:
        text = r.get("error") or (r.get("note") if r["impl"] != "ringflash_1gpu" else None)
        rows.append({**r, "remark": None if not text else (text if len(text) <= 60 else text[:57] + "...")})
    return rows


def benchmark(args, ctx: Ctx) -> list[dict]:
    dtype = cli.DTYPES[args.dtype]
    cfgs = configs(args)
    check_seqlen = min(args.seqlens)
    records = []
    for cfg in cfgs:
        full = make_full(cfg, dtype, ctx.device, args.seed + cfg.seqlen + cfg.kv_heads)
        ref = None
        if cfg.seqlen == check_seqlen:
            try:
                ref = reference(full, cfg.causal)
            except Exception as exc:  # noqa: BLE001 - without a reference nothing can be reported
                raise checks.WrongResult(f"the reference (flash_attn on the full sequence, {cfg.tag}) failed: "
                                         f"{checks.short_error(exc)}") from exc
            timing.free_memory(ctx.device)
        for impl in args.impls:
            if impl == "ringflash":
                layouts = args.causal_layouts if cfg.causal else args.noncausal_layouts
                runs = [run_ringflash(cfg, layout, transport, full, ref, ctx, args, u)
                        for u in args.heads_parallel for layout in layouts for transport in args.transports]
            elif impl == "ringflash_1gpu":
                runs = [run_ringflash_1gpu(cfg, full, ctx, args)]
            else:
                runs = [torch_cp.run_torch_cp(impl, cfg, full, ref, ctx, args)]
            for res in runs:
                rec = make_record(impl, cfg, res, ctx)
                records.append(rec)
                ctx.log(progress_line(rec, cfg.tag, timing.throughput_unit(ctx.device, per="GPU")))
            timing.free_memory(ctx.device)
        del full, ref
        timing.free_memory(ctx.device)
    add_efficiency(records)
    return records


# ----------------------------------------------------------------------------- profile


def profile(args, ctx: Ctx) -> None:
    api = ringflash_api()
    causal = not args.profile_noncausal
    layout = args.profile_layout or (args.causal_layouts if causal else args.noncausal_layouts)[0]
    cfg = Cfg(args.batch, args.profile_seqlen, args.heads, args.heads, args.head_dim, causal)
    full = make_full(cfg, cli.DTYPES[args.dtype], ctx.device, args.seed)
    q, k, v, do = (api.shard(t, dim=1, layout=layout, group=ctx.group) for t in full)
    del full
    step = traces.fwd_bwd_step(
        lambda *qkv: api.ring_flash_attn(*qkv, causal=causal, group=ctx.group, layout=layout), (q, k, v), do)
    traces.profile_call(step, device=ctx.device, group=ctx.group, path=args.profile,
                        title=f"ringflash fwd+bwd, {cfg.tag}, layout {layout}, {ctx.world} rank(s)")


# ----------------------------------------------------------------------------- main


def run(args, ctx: Ctx) -> int:
    timing.init_l2_flush(ctx.device)
    backend = dist.get_backend(ctx.group)
    ctx.log(f"# ring benchmark: {ctx.world} rank(s), device {ctx.device.type}, {backend}, impls {', '.join(args.impls)}"
            + ("; smoke run (CPU: the PyTorch twin of the kernels)" if ctx.device.type != "cuda" else ""))
    if not args.profile_only:
        records = benchmark(args, ctx)
        if ctx.rank == 0:
            meta = results.collect_meta(ctx.device, world_size=ctx.world, bench="ring", dtype=args.dtype,
                                  batch=args.batch, head_dim=args.head_dim,
                                  torch_cp_rotate_method=args.rotate_method,
                                  ringflash_rank_check=os.environ.get("RINGFLASH_RANK_CHECK", "1") != "0",
                                  timing=(f"per-rank median of >= {args.min_reps} reps "
                                          f"({'CUDA events, L2 flushed' if ctx.device.type == 'cuda' else 'wall clock'}), "
                                          "max over ranks; *_tflops_per_gpu = global TFLOPs / world / time "
                                          "(per process on a CPU run)"),
                                  backend=backend,
                                  peak_mem=("max over ranks of (peak allocated during the impl's runs minus "
                                            "memory live before them + this rank's q, k, v, dout; "
                                            "ringflash with the peer transport: + its symmetric buffers)"),
                                  check=f"at seqlen {cli.fmt_size(min(args.seqlens))} vs ringflash flash_attn on "
                                        f"the full sequence: out rel err <= {args.tol}, grads <= {args.grad_tol}")
            name = args.out_name or results.result_name("ring", ctx.device, ctx.world)
            out_dir = results.results_dir(args.out_dir, results.is_smoke_run(ctx.device, args.quick))
            path = results.write_results(name, meta, records, out_dir)
            print(f"\nwrote {path}", flush=True)
            if not args.no_plot:
                plots.try_plot(path)
            print()
            print(f"{timing.throughput_unit(ctx.device, per='GPU')[0]} (higher is better); "
                  "eff = ringflash / ringflash_1gpu")
            print(results.format_table(table_rows(records), table_columns(ctx.device)), flush=True)
    if args.profile:
        profile(args, ctx)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = setup(args)
    code = 0
    try:
        code = run(args, ctx)
    except checks.WrongResult as exc:
        if ctx.rank == 0:
            print(checks.abort_banner(str(exc), "a ring"), file=sys.stderr, flush=True)
        code = 3
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return code


if __name__ == "__main__":
    sys.exit(main())
