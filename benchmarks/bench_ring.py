"""Multi-GPU ring benchmark: ringflash ``ring_flash_attn`` against torch's context parallel
(SDPA flash and cuDNN backends) and against ringflash's own kernel on one GPU holding the
whole sequence, forward and forward+backward, side by side in one run.

    torchrun --nproc-per-node=4 benchmarks/bench_ring.py              # seqlen 32k, 64k
    torchrun --nproc-per-node=4 benchmarks/bench_ring.py --add-128k   # and 128k
    torchrun --nproc-per-node=4 benchmarks/bench_ring.py --profile-only --profile trace.json
    torchrun --nproc-per-node=4 benchmarks/bench_ring.py --profile-only --profile trace.json \
        --profile-mask documents --profile-heads-parallel 4 --profile-seqlen 128k   # one grid call
    torchrun --nproc-per-node=2 benchmarks/bench_ring.py --device cpu   # smoke test, gloo
    torchrun --nproc-per-node=4 benchmarks/bench_ring.py --heads-parallel 1 2 4 --seqlens 128k \\
        --masks causal documents --impls ringflash,ringflash_1gpu,torch_cp_cudnn --bench-name mesh
                             # the heads x ring grid at (U, R) = (1, 4), (2, 2), (4, 1) -> mesh_<gpu>x4.json

Writes <out-dir>/<bench-name>_<gpu>x<N>.json (+ .png), e.g. benchmarks/results/ring_h200x4.json,
and prints a table on rank 0. A smoke run (--device cpu: gloo, small sizes, fp32, ringflash
only, since torch's context parallel has no CPU attention; or --quick) writes to a new
temporary directory unless --out-dir is given, so it never replaces committed results.
Throughput is per GPU (per process on the CPU): FLOPs of the global problem / world size /
time, time being the max over ranks of each rank's median. Efficiency = ringflash per-GPU
TFLOP/s / ringflash_1gpu TFLOP/s, i.e. 1-GPU time / (U x R x time); ringflash_1gpu is
``flash_attn``'s default, whose backward on Hopper is the Gluon kernel where it serves the
call (kernels/dispatch.py), as the ring's is where it serves every pair of its steps. At the smallest seqlen
every implementation is checked against ringflash's kernel on the full sequence (out, dq,
dk, dv); ringflash aborts the run on a mismatch, a peer that mismatches is reported as null.

Masks (--masks): none, causal, and documents: packed documents of log-normal lengths (median
2k; bench_masks.documents), causal within each, on the layout computed from them
(--document-layouts, default "documents": ``ringflash.document_layout``); their FLOPs count
the visible (query, key) pairs only. torch's context parallel (SDPA) takes no document mask:
its documents rows say so, with null times.

Grid rows (U > 1) carry ``exposed_comm_ms``: forward+backward of the grid minus that of the
same ring on tensors already split by heads (the shapes each rank's ring runs on in the
grid, with the same masks and layout: ``ring_only_fwdbwd_ms``), i.e. what the all-to-alls
and their chunking add that compute does not hide (0 where U = 1: no all-to-all); and
``alltoall_ms``: the grid's all-to-alls of one forward+backward timed alone, back to back,
what an unoverlapped grid would expose. ``head_chunks``: the chunks of heads each rank's
call split into (``ringflash.heads``); --head-chunks sets RINGFLASH_HEAD_CHUNKS, each value
its own row (``--head-chunks auto 1``: overlapped against unchunked).

torch's context parallel runs through torch_cp.py; timing, FLOPs, checks, results files and
the --profile breakdown come from the harness (harness/).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

import torch_cp
from harness import checks, cli, plots, results, timing, traces

IMPLS = ("ringflash", *torch_cp.CP_BACKENDS, "ringflash_1gpu")
LAYOUTS = ("contiguous", "zigzag", "stripe")
MASKS = ("none", "causal", "documents")
# Layouts for packed documents: "documents" is the one computed from them (ringflash.document_layout).
DOCUMENT_LAYOUTS = ("documents", "block_stripe", "zigzag", "stripe", "contiguous")
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
    p.add_argument("--gqa-only", action="store_true", help="only the GQA rows (no MHA row)")
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
    p.add_argument("--head-chunks", nargs="+", default=["auto"], metavar="C",
                   help="RINGFLASH_HEAD_CHUNKS of the grid rows (U > 1), each value its own row: auto, or "
                        "at most C chunks of heads a rank (1: no overlap of the all-to-alls)")
    p.add_argument("--masks", nargs="+", default=None,
                   help=f"masks to run, of {','.join(MASKS)} (default from --causal: both is none,causal)")
    p.add_argument("--document-layouts", nargs="+", default=["documents"],
                   help=f"ringflash layout(s) for the documents mask, of {','.join(DOCUMENT_LAYOUTS)}")
    p.add_argument("--no-rank-check", action="store_true",
                   help="set RINGFLASH_RANK_CHECK=0 (skip ringflash's per-call cross-rank argument check)")
    p.add_argument("--quick", action="store_true",
                   help="a short GPU run: smallest seqlen only, shorter timing; results to a "
                        "temporary directory unless --out-dir")
    p.add_argument("--out-name", default=None,
                   help="results file name without .json (default <bench-name>_<device>x<ranks>, e.g. ring_h200x4)")
    p.add_argument("--bench-name", default="ring",
                   help="the results file's stem before _<device>x<ranks> (mesh: mesh_h100x4.json)")
    cli.add_run_args(p, g, c, max_reps=50)
    p.add_argument("--tol", type=float, default=2e-2, help="max relative error of out at the check")
    p.add_argument("--grad-tol", type=float, default=5e-2, help="max relative error of dq, dk, dv")
    p.add_argument("--timeout-min", type=float, default=10.0, help="process group timeout (minutes)")
    p.add_argument("--profile", metavar="PATH", default=None,
                   help="also write a chrome trace of one ringflash fwd+bwd to PATH (rank r>0: PATH.rank<r>)")
    p.add_argument("--profile-only", action="store_true", help="with --profile: skip the benchmark")
    p.add_argument("--profile-seqlen", default="64k", help="global seqlen of the profiled call")
    p.add_argument("--profile-layout", default=None, choices=sorted(set(LAYOUTS + DOCUMENT_LAYOUTS)),
                   help="default: first of --causal-layouts / --noncausal-layouts / --document-layouts")
    p.add_argument("--profile-noncausal", action="store_true", help="profile the non-causal case")
    p.add_argument("--profile-mask", default=None, choices=MASKS,
                   help="mask of the profiled call (default: causal, or none with --profile-noncausal)")
    p.add_argument("--profile-heads-parallel", type=int, default=1,
                   help="U of the profiled call's U x (world / U) grid (1: the ring alone)")
    p.add_argument("--profile-kv-heads", type=int, default=None,
                   help="kv heads of the profiled call (default: --heads, i.e. MHA)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke test of the script over gloo (small sizes, fp32, seconds)")
    args = p.parse_args(argv)
    cli.fill_defaults(args, CPU_DEFAULTS if args.device == "cpu" else GPU_DEFAULTS, lists=("seqlens", "impls"))
    try:
        args.impls = cli.parse_names(args.impls, IMPLS)
        args.causal_layouts = cli.parse_names(args.causal_layouts, LAYOUTS)
        args.noncausal_layouts = cli.parse_names(args.noncausal_layouts, LAYOUTS)
        args.document_layouts = cli.parse_names(args.document_layouts, DOCUMENT_LAYOUTS)
        args.masks = (cli.parse_names(args.masks, MASKS) if args.masks is not None else
                      ["none" if not c else "causal" for c in cli.causal_modes(args.causal)])
        args.head_chunks = [c.strip().lower() for v in args.head_chunks for c in str(v).split(",") if c.strip()]
        if not all(c == "auto" or (c.isdigit() and int(c) > 0) for c in args.head_chunks):
            raise ValueError(f"--head-chunks takes auto or positive integers, got {args.head_chunks}")
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
    mask: str  # one of MASKS

    @property
    def causal(self) -> bool:
        """Causal on global positions (documents: causal within each document)."""
        return self.mask != "none"

    @property
    def tag(self) -> str:
        kv = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        mask = {"none": "full", "documents": "docs"}.get(self.mask, self.mask)
        return f"S={cli.fmt_size(self.seqlen)} h={self.heads}{kv} d={self.head_dim} {mask}"

    def flops(self, mode: str) -> float:
        if self.mask == "documents":  # the visible pairs: one query row against that many keys
            visible = sum(n * (n + 1) // 2 for n in document_lengths(self.seqlen))
            return timing.attn_flops(self.batch, self.heads, 1, visible, self.head_dim, causal=False, mode=mode)
        return timing.attn_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim,
                                 causal=self.causal, mode=mode)


@functools.lru_cache(maxsize=None)
def document_lengths(seqlen: int) -> tuple[int, ...]:
    """The packed documents of a documents row: bench_masks.py's (log-normal lengths, median
    2k, sigma 1.5, seed 0; the last one cut at the sequence's end)."""
    from bench_masks import documents  # imported late: it imports ringflash

    return tuple(documents(seqlen))


def segment_ids(cfg: Cfg, device) -> Optional[torch.Tensor]:
    """(batch, seqlen) int32 ids of the documents of a documents row, the same in every
    sequence of the batch; None for the other masks."""
    if cfg.mask != "documents":
        return None
    lengths = torch.tensor(document_lengths(cfg.seqlen))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(torch.int32)
    return ids[None].expand(cfg.batch, -1).contiguous().to(device)


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


def reference(full, cfg: Cfg) -> dict:
    """out, dq, dk, dv of ringflash's single-device kernel on the whole sequence (B, S, H, D)."""
    from ringflash.kernels import flash_attn

    ids = segment_ids(cfg, full[0].device)
    return checks.out_and_grads(lambda q, k, v: flash_attn(q, k, v, causal=cfg.causal, segment_ids=ids),
                                full[:3], full[3])


# ----------------------------------------------------------------------------- ringflash


def ringflash_api():
    import ringflash.api as api  # imported late: --help must work without a built ringflash

    return api


def run_ringflash(cfg: Cfg, layout: str, transport: str, full, ref: Optional[dict], ctx: Ctx,
                  args, heads_parallel: int = 1, chunks: str = "auto", ring_only: Optional[dict] = None) -> dict:
    """ringflash with RINGFLASH_TRANSPORT=transport and RINGFLASH_HEAD_CHUNKS=chunks for the
    duration of the run, on the grid of ``heads_parallel`` x (world / heads_parallel) ranks
    (1: the ring alone). ``ring_only``: where a grid row's ring alone is timed once
    (``_ring_only``), shared by the rows of one configuration, grid, layout and transport."""
    from ringflash import exchange  # imported late, as ringflash_api
    from ringflash.groups import resolve_grid

    group = ctx.grid(heads_parallel)
    grid = resolve_grid(group)
    with cli.env_var("RINGFLASH_TRANSPORT", transport), cli.env_var("RINGFLASH_HEAD_CHUNKS", chunks):
        exchange.release_buffers()  # this run's own peer buffers, counted in its peak memory
        try:
            resolved = layout_of(cfg, layout, group)
        except Exception as exc:  # noqa: BLE001 - e.g. seqlen not divisible: same on every rank
            return {"layout": layout, "heads_parallel": heads_parallel, "ring": grid.ring_world,
                    "error": f"layout: {checks.short_error(exc)}"}
        res = _run_ringflash(cfg, layout, resolved, full, ref, ctx, args, group)
        res.update(heads_parallel=heads_parallel, ring=grid.ring_world)
        # What "auto" resolved to, and what really moved the bytes ("gloo", not "nccl", on a CPU run).
        res["transport"] = cli.backend_label(ringflash_api().transport(grid.ring), grid.ring)
        if res.get("peak_bytes") is not None:
            res["peak_bytes"] += exchange.symmetric_bytes()
        if heads_parallel == 1:
            res["exposed_comm_ms"] = 0.0  # no all-to-all
            return res
        res["head_chunks"] = chunks_used(cfg, grid, resolved)
        if res.get("fwdbwd_ms") is not None:
            if ring_only is None or not ring_only:
                ring_only = _ring_only(cfg, resolved, full, ctx, args, grid, ring_only)
            base = ring_only.get("fwdbwd_ms")
            res.update(ring_only_fwdbwd_ms=base, alltoall_ms=ring_only.get("alltoall_ms"),
                       exposed_comm_ms=None if base is None else res["fwdbwd_ms"] - base)
    return res


def distinct_chunks(cfg: Cfg, heads_parallel: int, layout: str, ctx: Ctx, args) -> list[str]:
    """The --head-chunks values of a grid's rows on ``layout``, less those giving a chunk
    count an earlier one gives (each kind of call once); "auto" alone for the ring (U = 1)."""
    if heads_parallel == 1:
        return ["auto"]
    from ringflash.groups import resolve_grid

    group = ctx.grid(heads_parallel)
    grid, resolved, seen, values = resolve_grid(group), layout_of(cfg, layout, group), set(), []
    for value in args.head_chunks:
        with cli.env_var("RINGFLASH_HEAD_CHUNKS", value):
            count = chunks_used(cfg, grid, resolved)
        if count not in seen:
            seen.add(count)
            values.append(value)
    return values


def layout_of(cfg: Cfg, name: str, group):
    """The layout ``name`` stands for: itself, or for "documents" the layout computed from
    the row's documents over the ring of ``group``."""
    if name != "documents":
        return name
    import ringflash

    bounds = torch.tensor([0, *document_lengths(cfg.seqlen)]).cumsum(0)
    return ringflash.document_layout(bounds, cfg.seqlen, group)


def chunks_used(cfg: Cfg, grid, layout) -> int:
    """The chunks of heads a rank's call on ``grid`` with ``layout`` splits into
    (``ringflash.heads.grid_chunks`` under the current RINGFLASH_HEAD_CHUNKS)."""
    from ringflash.heads import grid_chunks, kv_index

    q = torch.empty(cfg.batch, cfg.seqlen // grid.world, cfg.heads, cfg.head_dim, dtype=torch.bfloat16, device="meta")
    entries = kv_index(cfg.heads, cfg.kv_heads, grid.heads_world).shape[1]
    return grid_chunks(q, entries, grid, layout, (None, 0) if cfg.causal else (None, None))


def _run_ringflash(cfg: Cfg, name: str, layout, full, ref: Optional[dict], ctx: Ctx, args, group) -> dict:
    api = ringflash_api()
    res = {"layout": name, "note": None}
    try:
        q, k, v, do = (api.shard(t, dim=1, layout=layout, group=group) for t in full)
        ids = segment_ids(cfg, ctx.device)
        seg = None if ids is None else api.shard(ids, dim=1, layout=layout, group=group)
    except Exception as exc:  # noqa: BLE001 - e.g. seqlen not divisible: same on every rank
        return {**res, "error": f"shard: {checks.short_error(exc)}"}

    def call(q_, k_, v_):
        return api.ring_flash_attn(q_, k_, v_, causal=cfg.causal, group=group, layout=layout, segment_ids=seg)

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
            raise checks.WrongResult(f"ringflash ring_flash_attn (layout {name}, group {group}) is WRONG at "
                                     f"{cfg.tag}: " + "; ".join(bad))
        res["rel_err"] = errs["out"]
        del got, want
    res.update(timing.time_phases(call, (q, k, v), do, device=ctx.device, group=ctx.group,
                                  **timing.timing_opts(args)))
    return res


def _ring_only(cfg: Cfg, layout, full, ctx: Ctx, args, grid, into: Optional[dict] = None) -> dict:
    """The grid's ring alone (into ``into``): fwd_ms, fwdbwd_ms of ring_flash_attn over
    grid.ring on what this rank's ring computes in the grid, split by heads beforehand (query
    heads [u H / U, (u + 1) H / U) of its ring shard and the kv heads they read, the same
    masks and layout); and alltoall_ms (``_alltoall_ms``)."""
    from ringflash.heads import kv_index

    api = ringflash_api()
    into = {} if into is None else into
    u, world = grid.heads_rank, grid.heads_world
    per_rank = cfg.heads // world
    entries = kv_index(cfg.heads, cfg.kv_heads, world)[u].to(ctx.device)
    q, k, v, do = (api.shard(t, dim=1, layout=layout, group=grid.ring) for t in full)
    q2, do2 = (t[:, :, u * per_rank:(u + 1) * per_rank].contiguous() for t in (q, do))
    k2, v2 = (t.index_select(2, entries) for t in (k, v))
    del q, k, v, do
    ids = segment_ids(cfg, ctx.device)
    seg = None if ids is None else api.shard(ids, dim=1, layout=layout, group=grid.ring)

    def call(q_, k_, v_):
        return api.ring_flash_attn(q_, k_, v_, causal=cfg.causal, group=grid.ring, layout=layout, segment_ids=seg)

    into.update(timing.time_phases(call, (q2, k2, v2), do2, device=ctx.device, group=ctx.group,
                                   **timing.timing_opts(args)))
    into["alltoall_ms"] = _alltoall_ms(q2, k2, grid, ctx, args)
    return into


def _alltoall_ms(q2: torch.Tensor, k2: torch.Tensor, grid, ctx: Ctx, args) -> Optional[float]:
    """The all-to-alls of one grid forward+backward timed alone, one after the other: q, k, v,
    out and lse forward, dout, dq, dk and dv backward (``ringflash.heads``), as many bytes as
    each rank sends there (the shapes of its ring's q2, k2)."""
    qs, kvs = q2.new_empty(q2.numel()), k2.new_empty(k2.numel())
    lse = q2.new_empty(q2.numel() // q2.shape[-1], dtype=torch.float32)
    pairs = [(t, torch.empty_like(t)) for t in (qs, kvs, lse)]
    order = [0, 1, 1, 0, 2, 0, 0, 1, 1]  # q k v out lse | dout dq dk dv

    def exchange():
        for i in order:
            dist.all_to_all_single(pairs[i][1], pairs[i][0], group=grid.heads)
    try:
        return timing.bench_ms(exchange, device=ctx.device, group=ctx.group, **timing.timing_opts(args))
    except Exception as exc:  # noqa: BLE001 - the row keeps its times without it
        ctx.log(f"  all-to-all timing failed: {checks.short_error(exc)}")
        return None


def run_ringflash_1gpu(cfg: Cfg, full, ctx: Ctx, args) -> dict:
    """ringflash's kernel on rank 0 over the whole sequence; the other ranks wait."""
    res = {"layout": "full", "note": "one GPU, whole sequence" if ctx.device.type == "cuda"
           else "one process, whole sequence"}
    if ctx.rank == 0:
        from ringflash.kernels import flash_attn

        ids = segment_ids(cfg, ctx.device)

        def call(q_, k_, v_):
            return flash_attn(q_, k_, v_, causal=cfg.causal, segment_ids=ids)

        try:
            res.update(timing.time_phases(call, full[:3], full[3], device=ctx.device, **timing.timing_opts(args)))
        except Exception as exc:  # noqa: BLE001 - out of memory and the like: null
            res["error"] = checks.short_error(exc)
            timing.free_memory(ctx.device)
    timing.barrier(ctx.group)
    return broadcast_obj(res, ctx)


# ----------------------------------------------------------------------------- the benchmark


def configs(args) -> list[Cfg]:
    head_cfgs = [] if args.gqa_only and args.gqa_kv_heads else [(args.heads, args.heads)]
    if args.gqa_kv_heads and args.gqa_kv_heads != args.heads:
        head_cfgs.append((args.heads, args.gqa_kv_heads))
    return [Cfg(args.batch, s, h, kvh, args.head_dim, mask)
            for s in args.seqlens for (h, kvh) in head_cfgs for mask in args.masks]


def make_record(impl: str, cfg: Cfg, res: dict, ctx: Ctx) -> dict:
    per_gpu = 1 if impl == "ringflash_1gpu" else ctx.world
    fwd_ms, fwdbwd_ms = res.get("fwd_ms"), res.get("fwdbwd_ms")
    peak = res.get("peak_bytes")
    grid = (1, 1) if impl == "ringflash_1gpu" else (1, ctx.world)
    rec = {
        "impl": impl, "heads_parallel": res.get("heads_parallel", grid[0]), "ring": res.get("ring", grid[1]),
        "layout": res.get("layout"), "mask": cfg.mask, "seqlen": cfg.seqlen, "heads": cfg.heads,
        "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "causal": cfg.causal,
        "fwd_tflops_per_gpu": timing.tflops(cfg.flops("fwd") / per_gpu, fwd_ms),
        "fwdbwd_tflops_per_gpu": timing.tflops(cfg.flops("fwdbwd") / per_gpu, fwdbwd_ms),
        "peak_mem_gib": None if peak is None else peak / timing.GIB,
        "efficiency": None, "fwd_efficiency": None,
        "gpus": per_gpu, "batch": cfg.batch, "fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms,
        "exposed_comm_ms": res.get("exposed_comm_ms"),
    }
    for key in ("transport", "head_chunks", "ring_only_fwdbwd_ms", "alltoall_ms", "rel_err", "note", "error"):
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
    return (r["seqlen"], r["heads"], r["kv_heads"], r["head_dim"], r.get("mask", r["causal"]))


def progress_line(rec: dict, tag: str, unit: tuple[str, float] = ("TFLOP/s per GPU", 1.0)) -> str:
    """One record as a log line; ``unit``: (label, factor) of timing.throughput_unit."""
    label, scale = unit

    def f(x, spec, factor=1.0):
        return "-" if x is None else format(x * factor, spec)
    grid = f"{rec['heads_parallel']}x{rec['ring']}" if rec.get("heads_parallel", 1) > 1 else None
    chunks = f"C={rec['head_chunks']}" if rec.get("head_chunks") else None
    where = [x for x in (rec.get("layout"), rec.get("transport"), grid, chunks) if x]
    impl = rec["impl"] + (f"[{','.join(where)}]" if where else "")
    line = (f"  {tag:<32} {impl:<28} fwd {f(rec['fwd_tflops_per_gpu'], '6.1f', scale)}  "
            f"f+b {f(rec['fwdbwd_tflops_per_gpu'], '6.1f', scale)} {label}  "
            f"mem {f(rec['peak_mem_gib'], '.2f')} GiB")
    if rec.get("exposed_comm_ms") is not None and rec.get("heads_parallel", 1) > 1:
        line += f"  exposed {rec['exposed_comm_ms']:.2f} ms (all-to-all alone {f(rec.get('alltoall_ms'), '.2f')})"
    if rec.get("error"):
        line += f"  ERROR {rec['error']}"
    elif rec.get("note"):
        line += f"  ({rec['note']})"
    return line


def table_columns(device: torch.device) -> list[tuple]:
    """Columns of the summary table; throughput in TFLOP/s per GPU, GFLOP/s per process on the CPU."""
    short, scale = ("TF/GPU", 1.0) if device.type == "cuda" else ("GF/proc", 1e3)
    per = (lambda x: f"{x * scale:.1f}")
    return [("impl", "impl"), ("heads_parallel", "U"), ("ring", "R"), ("head_chunks", "C"), ("layout", "layout"),
            ("transport", "transport"), ("seqlen", "seqlen", cli.fmt_size), ("heads", "heads"), ("kv_heads", "kv"),
            ("mask", "mask"), ("fwdbwd_ms", "f+b ms", ".1f"),
            ("fwd_tflops_per_gpu", f"fwd {short}", per), ("fwdbwd_tflops_per_gpu", f"f+b {short}", per),
            ("peak_mem_gib", "mem GiB", ".2f"), ("efficiency", "eff f+b", ".2f"),
            ("fwd_efficiency", "eff fwd", ".2f"), ("exposed_comm_ms", "exposed ms", ".2f"),
            ("alltoall_ms", "a2a ms", ".2f"), ("remark", "remark")]


def table_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in records:
        text = r.get("error") or (r.get("note") if r["impl"] != "ringflash_1gpu" else None)
        rows.append({**r, "remark": None if not text else (text if len(text) <= 60 else text[:57] + "...")})
    return rows


def benchmark(args, ctx: Ctx, save=None) -> list[dict]:
    """Every configuration's records; ``save(records)`` after each one, so that a run cut
    short (a time limit) keeps what it measured."""
    dtype = cli.DTYPES[args.dtype]
    cfgs = configs(args)
    check_seqlen = min(args.seqlens)
    records = []
    for cfg in cfgs:
        full = make_full(cfg, dtype, ctx.device, args.seed + cfg.seqlen + cfg.kv_heads)
        ref = None
        if cfg.seqlen == check_seqlen:
            try:
                ref = reference(full, cfg)
            except Exception as exc:  # noqa: BLE001 - without a reference nothing can be reported
                raise checks.WrongResult(f"the reference (flash_attn on the full sequence, {cfg.tag}) failed: "
                                         f"{checks.short_error(exc)}") from exc
            timing.free_memory(ctx.device)
        for impl in args.impls:
            if impl == "ringflash":
                layouts = {"none": args.noncausal_layouts, "causal": args.causal_layouts,
                           "documents": args.document_layouts}[cfg.mask]
                runs = []
                for u in args.heads_parallel:
                    for layout in layouts:
                        for transport in args.transports:
                            ring_only = {}  # timed once for every --head-chunks row
                            runs += [run_ringflash(cfg, layout, transport, full, ref, ctx, args, u, chunks, ring_only)
                                     for chunks in distinct_chunks(cfg, u, layout, ctx, args)]
            elif impl == "ringflash_1gpu":
                runs = [run_ringflash_1gpu(cfg, full, ctx, args)]
            elif cfg.mask == "documents":
                runs = [{"layout": None, "note": "not run: torch context parallel (SDPA) takes no document mask"}]
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
        if save is not None:
            save(records)
    return records


# ----------------------------------------------------------------------------- profile


def profile(args, ctx: Ctx) -> None:
    api = ringflash_api()
    mask = args.profile_mask or ("none" if args.profile_noncausal else "causal")
    layouts = {"none": args.noncausal_layouts, "causal": args.causal_layouts, "documents": args.document_layouts}
    name = args.profile_layout or layouts[mask][0]
    cfg = Cfg(args.batch, args.profile_seqlen, args.heads, args.profile_kv_heads or args.heads, args.head_dim, mask)
    group = ctx.grid(args.profile_heads_parallel)
    layout = layout_of(cfg, name, group)
    full = make_full(cfg, cli.DTYPES[args.dtype], ctx.device, args.seed)
    q, k, v, do = (api.shard(t, dim=1, layout=layout, group=group) for t in full)
    ids = segment_ids(cfg, ctx.device)
    seg = None if ids is None else api.shard(ids, dim=1, layout=layout, group=group)
    del full
    step = traces.fwd_bwd_step(
        lambda *qkv: api.ring_flash_attn(*qkv, causal=cfg.causal, group=group, layout=layout, segment_ids=seg),
        (q, k, v), do)
    traces.profile_call(step, device=ctx.device, group=ctx.group, path=args.profile,
                        title=f"ringflash fwd+bwd, {cfg.tag}, {mask}, layout {name}, "
                              f"grid {args.profile_heads_parallel} x {ctx.world // args.profile_heads_parallel}")


def _plot_label(rec: dict) -> str:
    """A line of the plot: the implementation, and for ringflash its grid, layout and chunks."""
    label = plots.default_label(rec)
    if rec["impl"] == "ringflash":
        label += f" {rec.get('heads_parallel', 1)}x{rec.get('ring')}"
        label += f" C={rec['head_chunks']}" if rec.get("head_chunks") else ""
    return label


def plot(path) -> None:
    """The PNG beside the results: one panel per heads, kv_heads and mask; one line per
    implementation and grid. A failure only warns (the JSON is written)."""
    try:
        png = plots.plot_results(results.load_results(path), Path(path).with_suffix(".png"),
                                 panel_keys=("heads", "kv_heads", "head_dim", "mask"), label_fn=_plot_label)
        print(f"wrote {png}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the results matter more than the picture
        print(f"WARNING: no plot ({checks.short_error(exc)}); re-plot later with "
              f"python benchmarks/plot.py {path}", flush=True)


# ----------------------------------------------------------------------------- main


def run(args, ctx: Ctx) -> int:
    timing.init_l2_flush(ctx.device)
    backend = dist.get_backend(ctx.group)
    ctx.log(f"# ring benchmark: {ctx.world} rank(s), device {ctx.device.type}, {backend}, impls {', '.join(args.impls)}"
            + ("; smoke run (CPU: the PyTorch twin of the kernels)" if ctx.device.type != "cuda" else ""))
    if not args.profile_only:
        name = args.out_name or results.result_name(args.bench_name, ctx.device, ctx.world)
        out_dir = results.results_dir(args.out_dir, results.is_smoke_run(ctx.device, args.quick))

        def save(records):
            return results.write_results(name, meta, records, out_dir) if ctx.rank == 0 else None

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
                                        f"the full sequence: out rel err <= {args.tol}, grads <= {args.grad_tol}",
                                  masks=args.masks, head_chunks=args.head_chunks,
                                  documents=("bench_masks.documents: log-normal lengths, median 2k, sigma 1.5, "
                                             "seed 0, causal within each; FLOPs over the visible pairs"),
                                  efficiency="ringflash_1gpu time / (U x R x time), U x R = ranks",
                                  exposed_comm=("grid rows: fwdbwd_ms minus ring_only_fwdbwd_ms (the same ring on "
                                                "tensors split by heads beforehand, same shapes per rank); "
                                                "alltoall_ms: the grid's all-to-alls of one fwd+bwd timed alone; "
                                                "0 where U = 1"))
        records = benchmark(args, ctx, save)
        if ctx.rank == 0:
            path = save(records)
            print(f"\nwrote {path}", flush=True)
            if not args.no_plot:
                plot(path)
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
