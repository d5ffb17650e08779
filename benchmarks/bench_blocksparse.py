"""Block-sparse attention: time against the density of the block mask, ringflash beside the
dense kernel and FlexAttention with the same blocks on one GPU, and through the ring.

    python benchmarks/bench_blocksparse.py                               # -> results/blocksparse_<gpu>.json
    torchrun --nproc-per-node=2 benchmarks/bench_blocksparse.py --ring   # -> results/blocksparse_<gpu>x2.json
    torchrun --nproc-per-node=2 benchmarks/bench_blocksparse.py --ring --layouts contiguous,block_stripe
    torchrun --nproc-per-node=2 benchmarks/bench_blocksparse.py --ring --profile runs/bs.json  # one call, traced
    torchrun --nproc-per-node=2 benchmarks/bench_blocksparse.py --ring --host-ahead  # GPU time, host ahead

Patterns (blocks of 128 tokens, shared by the heads, non-causal): ``random`` (exactly
round(d * n * n) blocks, the diagonal first) and ``local_global`` (one global block, a
local band wide enough for density d). ``dense`` is the kernel without a block mask. The
ring (``--layouts``, side by side; contiguous by default: these masks are not causal, and a
local band is balanced over contiguous shards, not over zigzag's, whose end chunks see
fewer keys; block_stripe deals the blocks round-robin, so a local band gives every step a
share) is timed beside the same mask on one GPU of the same run, so ``efficiency`` =
1-GPU time / (GPUs x ring time) counts the computed blocks only.
Every implementation's output is checked against ringflash's before it is timed.
``--profile PATH`` times nothing: it traces one forward+backward (the first seqlen,
pattern, density and layout given) and prints where the GPU's time went
(harness/traces.py: attention, other, communication, the communication no compute hid,
idle).
"""

from __future__ import annotations

import torch

import ringflash
from harness import checks, cli, plots, results, timing, traces
from harness.timing import timed
from ringflash.kernels import block_sparse
from ringflash.kernels.masks import BAND_INF, BLOCK, block_lists


def pattern_mask(pattern: str, seqlen: int, density: float, device) -> torch.Tensor:
    n = seqlen // BLOCK
    if pattern == "random":
        return block_sparse.random_block_mask(seqlen, density, seed=0, device=device)
    # local + global: 1 global block (row and column: 2n - 1 blocks), the band the rest
    local = max(1, round((density * n * n - (2 * n - 1) + n) / (2 * n)))
    return block_sparse.local_global_block_mask(seqlen, local_blocks=local, global_blocks=1,
                                                device=device)


def flex_block_mask(bm: torch.Tensor, seqlen: int):
    """FlexAttention's BlockMask of the same blocks, all of them full (no mask_mod to run)."""
    from torch.nn.attention.flex_attention import BlockMask
    counts, index = block_lists(bm, -BAND_INF, BAND_INF, seqlen, seqlen)  # no band: all full
    return BlockMask.from_kv_blocks(counts[0][None], index[None], counts[1][None], index[None],
                                    BLOCK_SIZE=BLOCK, seq_lengths=(seqlen, seqlen))


def cases(args):
    yield "dense", 1.0
    for pattern in args.patterns:
        for d in args.densities:
            yield pattern, d


def record(impl, pattern, bm, seqlen, fwd, fwdbwd, args, gpus=1, **extra):
    d = 1.0 if bm is None else block_sparse.density(bm)
    flops = 4 * args.heads * args.head_dim * seqlen * seqlen * d  # computed blocks only
    return dict(impl=impl, pattern=pattern, density=d, seqlen=seqlen, gpus=gpus, heads=args.heads,
                head_dim=args.head_dim, fwd_ms=fwd, fwdbwd_ms=fwdbwd,
                fwdbwd_tflops_per_gpu=timing.tflops(3.5 * flops / gpus, fwdbwd), **extra)


def run(args, device, group, world, rank) -> list[dict]:
    records = []
    flex = None
    for seqlen in args.seqlens:
        gen = torch.Generator(device=device).manual_seed(0)
        full = [torch.randn(1, seqlen, args.heads, args.head_dim, device=device, generator=gen,
                            dtype=torch.bfloat16) for _ in range(3)]
        local = {layout: [ringflash.shard(t, 1, layout, group).requires_grad_() for t in full]
                 for layout in args.layouts} if args.ring else None
        for pattern, d in cases(args):
            bm = None if pattern == "dense" else pattern_mask(pattern, seqlen, d, device)
            first = len(records)
            if args.ring:
                rings = []
                for layout in args.layouts:
                    ring = lambda q, k, v, layout=layout: ringflash.ring_flash_attn(
                        q, k, v, block_mask=bm, group=group, layout=layout)
                    rings.append(record("ringflash", pattern, bm, seqlen,
                                        *timed(ring, *local[layout], device, args, group), args,
                                        gpus=world, layout=layout))
                if rank == 0:
                    one = [t.clone().requires_grad_() for t in full]
                    single = timed(lambda q, k, v: ringflash.flash_attn(q, k, v, block_mask=bm), *one,
                                   device, args)
                    records.append(record("ringflash_1gpu", pattern, bm, seqlen, *single, args))
                    for rec in rings:
                        rec["efficiency"] = single[1] / (world * rec["fwdbwd_ms"])
                    del one
                records.extend(rings)
                timing.barrier(group)
            else:
                one = [t.clone().requires_grad_() for t in full]
                ours = lambda q, k, v: ringflash.flash_attn(q, k, v, block_mask=bm)
                want = ours(*one).detach()
                records.append(record("ringflash", pattern, bm, seqlen, *timed(ours, *one, device, args), args))
                if bm is not None:
                    from torch.nn.attention.flex_attention import flex_attention
                    flex = flex or torch.compile(flex_attention, dynamic=False)
                    fbm = flex_block_mask(bm, seqlen)
                    qt = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in full]
                    theirs = lambda q, k, v: flex(q, k, v, block_mask=fbm)
                    err = checks.rel_err(theirs(*qt).detach().transpose(1, 2), want)
                    records.append(record("flex_attention", pattern, bm, seqlen,
                                          *timed(theirs, *qt, device, args), args, check_rel_err=err))
                    del qt
                del one
            if rank == 0:
                print(results.format_table(records[first:], [
                    ("impl", "impl"), ("layout", "layout"), ("pattern", "pattern"), ("density", "density", ".3f"),
                    ("seqlen", "seqlen"), ("fwd_ms", "fwd ms", ".2f"), ("fwdbwd_ms", "fwd+bwd ms", ".2f"),
                    ("fwdbwd_tflops_per_gpu", "TFLOP/s/GPU", ".0f"), ("efficiency", "eff", ".2f")]), flush=True)
                write(records, args, device, world)  # a run cut short keeps what it measured
        del full, local
        timing.free_memory(device)
    return records


def profile(args, device, group, world) -> None:
    """Trace one forward+backward of the first case (``traces.profile_call``)."""
    seqlen, pattern, d, layout = args.seqlens[0], args.patterns[0], args.densities[0], args.layouts[0]
    bm = pattern_mask(pattern, seqlen, d, device)
    gen = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(1, seqlen, args.heads, args.head_dim, device=device, generator=gen,
                        dtype=torch.bfloat16) for _ in range(4)]
    q, k, v, dout = (ringflash.shard(t, 1, layout, group) if args.ring else t for t in full)
    del full
    if args.ring:
        call = lambda q, k, v: ringflash.ring_flash_attn(q, k, v, block_mask=bm, group=group, layout=layout)
    else:
        call = lambda q, k, v: ringflash.flash_attn(q, k, v, block_mask=bm)
    where = f"{world} GPU(s), layout {layout}" if args.ring else "1 GPU"
    traces.profile_call(traces.fwd_bwd_step(call, (q, k, v), dout), device=device, group=group, path=args.profile,
                        title=f"ringflash fwd+bwd, {pattern} d={block_sparse.density(bm):.3f}, "
                              f"{cli.fmt_size(seqlen)} tokens, {where}")


def write(records, args, device, world):
    name = args.out_name or results.result_name("blocksparse", device, world if args.ring else None) + (
        "_host_ahead" if args.host_ahead else "")
    meta = dict(results.collect_meta(device), timing="host_ahead" if args.host_ahead else "back_to_back")
    return results.write_results(name, meta, records, args.out_dir)


def plot(json_path) -> str:
    """fwd+bwd time against density, one panel per seqlen, with the d x dense line."""
    plt = plots.import_pyplot()
    data = results.load_results(json_path)
    records = data["records"]
    seqlens = sorted({r["seqlen"] for r in records})
    fig, axes = plt.subplots(1, len(seqlens), figsize=(8 * len(seqlens), 4.2), squeeze=False)
    for ax, seqlen in zip(axes[0], seqlens):
        rs = [r for r in records if r["seqlen"] == seqlen and r.get("fwdbwd_ms")]
        dense = next((r["fwdbwd_ms"] for r in rs if r["pattern"] == "dense" and r["impl"] == "ringflash"), None)
        def line(r):  # ringflash's "variant" (a tree or schedule of a comparison run) gets a line of its own
            variant = (r.get("variant") or "").split(", round")[0] if r["impl"].startswith("ringflash") else ""
            return r["impl"], r.get("layout") or "", r["pattern"], variant
        for key in sorted({line(r) for r in rs if r["pattern"] != "dense"}):
            best = {}  # density -> the best time over the runs (rounds) drawn on this line
            for r in rs:
                if line(r) == key:
                    best[r["density"]] = min(best.get(r["density"], float("inf")), r["fwdbwd_ms"])
            ax.plot(*zip(*sorted(best.items())), marker="o", label=" ".join(k for k in key if k))
        if dense:
            ax.plot([0.05, 1], [0.05 * dense, dense], "k--", linewidth=1, label="density x dense")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density (fraction of blocks computed)")
        ax.set_ylabel("fwd+bwd ms")
        ax.set_title(f"{cli.fmt_size(seqlen)} tokens", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside: many variants
    meta = data["meta"]
    fig.suptitle(f"{meta.get('device')} x{meta.get('gpu_count')}, bf16, {records[0]['heads']} heads, "
                 f"head_dim {records[0]['head_dim']}", fontsize=9)
    return plots.save_beside(fig, json_path)


def main(argv=None):
    p = cli.gpu_parser(__doc__, "blocksparse_<gpu>[xN][_host_ahead]")
    p.add_argument("--patterns", nargs="+", default=["random,local_global"], help="block patterns")
    p.add_argument("--densities", nargs="+", type=float, default=[1.0, 0.5, 0.25, 0.1, 0.05])
    p.add_argument("--layouts", nargs="+", default=["contiguous"],
                   help="the ring's sequence layouts, timed side by side (stripe cannot serve block masks)")
    p.add_argument("--host-ahead", action="store_true",
                   help="time each call's GPU work with the host ahead (the GPU sleeps while the host "
                        "enqueues it: no host-bound gaps) instead of calls back to back; results go to "
                        "blocksparse_<gpu>[xN]_host_ahead.json")
    p.add_argument("--plot", default=None, metavar="JSON", help="only draw the PNG of a results file")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="only trace one fwd+bwd (the first seqlen, pattern, density and layout) into PATH")
    args = p.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return
    args.seqlens = cli.parse_sizes(args.seqlens)
    args.patterns = cli.parse_names(args.patterns, ("random", "local_global"))
    args.layouts = cli.parse_names(args.layouts, ("contiguous", "zigzag", "block_stripe"))
    with cli.gpu_run(args.ring, "bench_blocksparse.py") as (device, group, world, rank):
        args.out_dir = results.results_dir(args.out_dir, results.is_smoke_run(device))
        if args.profile:
            profile(args, device, group, world)
        else:
            records = run(args, device, group, world, rank)
            if rank == 0:
                print(plot(write(records, args, device, world)))


if __name__ == "__main__":
    main()
