"""Masked attention: packed documents and sliding windows, ringflash against FlexAttention
and SDPA document by document on one GPU, and through the ring against the dense causal
ring of the same length and the 1-GPU kernel. Packed documents run through the ring on
the layout computed from their documents (``ringflash.document_layout``, layout
"documents") beside the fixed layouts; ring rows carry the steps the ring ran and the
bytes the busiest rank sent (the cost model's count of the schedule: ``bytes_sent``) and their
``efficiency`` (1-GPU time / (world x ring time)). Beside them: torch's context parallel with
FlexAttention on the masks of --torch-cp (torch_cp.run_flex_cp; for documents its
per-document head-tail balancer, which needs lengths in multiples of 2 x world: its row runs
them so rounded), and the cost model's efficiency of each ring row (impl "cost_model").

    python benchmarks/bench_masks.py                               # one GPU -> results/masks_<gpu>.json
    torchrun --nproc-per-node=2 benchmarks/bench_masks.py --ring   # ring -> results/masks_<gpu>x2.json
    torchrun --nproc-per-node=2 benchmarks/bench_masks.py --ring --device cpu   # smoke test, gloo

Documents: lengths drawn log-normal (median 2k, sigma 1.5: about 1% past 64k), packed
into one row and cut at the sequence end; causal within each document. Window: causal
with window_size (4096, 0). TFLOP/s are counted over the visible (query, key) pairs only:
4 * heads * head_dim * visible, times 3.5 for forward+backward. Every implementation's
output is checked against ringflash's on the same inputs before it is timed. The ring's rows
are written before torch CP runs, and again with its rows after.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import torch
import torch.nn.functional as F

import ringflash
import torch_cp
from ringflash import cost
from ringflash.kernels import band_of_window
from ringflash.layouts import active_steps
from harness import checks, cli, plots, results, timing
from harness.timing import timed

MASKS = ("causal", "documents", "window")


def documents(seqlen: int, seed: int = 0, median: int = 2048, sigma: float = 1.5) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seqlen:
        n = max(1, int(math.exp(math.log(median) + sigma * torch.randn(1, generator=gen).item())))
        n = min(n, seqlen - total)
        lengths.append(n)
        total += n
    return lengths


def draw(seqlen: int, args) -> list[int]:
    """The documents of a row: ``documents`` with --documents-seed and --documents-median."""
    return documents(seqlen, args.documents_seed, args.documents_median)


def case_mask(mask: str, seqlen: int, window: int, device, lengths=None):
    """(flash_attn keywords, visible pairs, FlexAttention mask_mod, document lengths);
    documents: ``lengths``, else drawn (``documents``)."""
    if mask == "causal":
        return dict(causal=True), seqlen * (seqlen + 1) // 2, lambda b, h, q, k: q >= k, None
    if mask == "window":
        visible = sum(min(i, window) + 1 for i in range(seqlen))
        return (dict(causal=True, window_size=(window, 0)), visible,
                lambda b, h, q, k: (q >= k) & (q - k <= window), None)
    lengths = lengths or documents(seqlen)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    visible = sum(n * (n + 1) // 2 for n in lengths)
    return (dict(causal=True, segment_ids=ids[None].int()), visible,
            lambda b, h, q, k: (q >= k) & (ids[q] == ids[k]), lengths)


def record(impl, mask, seqlen, window, visible, fwd, fwdbwd, args, world=1, **extra):
    flops = 4 * args.heads * args.head_dim * visible
    rec = dict(impl=impl, mask=mask, seqlen=seqlen, window=window if mask == "window" else None,
               heads=args.heads, head_dim=args.head_dim, fwd_ms=fwd, fwdbwd_ms=fwdbwd,
               fwd_tflops_visible=timing.tflops(flops, fwd), fwdbwd_tflops_visible=timing.tflops(3.5 * flops, fwdbwd),
               **extra)
    if world > 1:
        rec["gpus"] = world
        rec["fwdbwd_tflops_visible_per_gpu"] = timing.tflops(3.5 * flops / world, fwdbwd)
    return rec


def inputs(seqlen: int, args, device, n: int = 3) -> list[torch.Tensor]:
    """q, k, v (and an output gradient, n=4): (1, seqlen, heads, head_dim), the same on every rank."""
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return [torch.randn(1, seqlen, args.heads, args.head_dim, device=device, generator=gen, dtype=dtype)
            for _ in range(n)]


def single_gpu(args, device) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    records = []
    for seqlen in args.seqlens:
        for mask in args.masks:
            kw, visible, mask_mod, lengths = case_mask(mask, seqlen, args.window, device, draw(seqlen, args))
            q, k, v = (torch.randn(1, seqlen, args.heads, args.head_dim, device=device,
                                   dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            ours = lambda q, k, v: ringflash.flash_attn(q, k, v, **kw)
            want = ours(q, k, v).detach()
            records.append(record("ringflash", mask, seqlen, args.window, visible,
                                  *timed(ours, q, k, v, device, args), args))
            bm = create_block_mask(mask_mod, 1, None, seqlen, seqlen, device=device, _compile=True)
            qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
            theirs = lambda q, k, v: flex(q, k, v, block_mask=bm)
            err = checks.rel_err(theirs(qt, kt, vt).detach().transpose(1, 2), want)
            records.append(record("flex_attention", mask, seqlen, args.window, visible,
                                  *timed(theirs, qt, kt, vt, device, args), args, check_rel_err=err))
            if lengths is not None:
                bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()

                def per_doc(q, k, v):
                    return torch.cat([F.scaled_dot_product_attention(
                        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
                        for a, b in zip(bounds[:-1], bounds[1:])], dim=2)
                err = checks.rel_err(per_doc(qt, kt, vt).detach().transpose(1, 2), want)
                records.append(record("sdpa_per_doc", mask, seqlen, args.window, visible,
                                      *timed(per_doc, qt, kt, vt, device, args), args,
                                      check_rel_err=err, documents=len(lengths)))
            print(results.format_table(records[-3:], [("impl", "impl"), ("mask", "mask"), ("seqlen", "seqlen"),
                                                ("fwd_ms", "fwd_ms", ".2f"), ("fwdbwd_ms", "fwdbwd_ms", ".2f"),
                                                ("fwdbwd_tflops_visible", "fwdbwd_tflops_visible", ".0f")]), flush=True)
            del q, k, v, qt, kt, vt
            timing.free_memory(device)
    return records


def cost_mask(mask: str, seqlen: int, args) -> cost.Mask:
    """The cost model's mask of ``mask`` (causal; "window": args.window back; "documents":
    this length's ``documents``)."""
    if mask == "documents":
        return cost.Mask.documents(draw(seqlen, args))
    return cost.Mask(True, (args.window, 0) if mask == "window" else (-1, -1))


def bytes_sent(counts: cost.RingCounts, args, kept: bool = False) -> int:
    """Bytes the busiest rank sends in one forward+backward: the cost model's count
    (``cost.link_bytes``, from the schedule's travelling rows: K/V in bf16 in the forward and
    again in the backward, the running dK/dV sum in fp32), segment ids aside; ``kept``: the
    direct schedule keeps the rows its forward received (through NCCL on cut shards:
    ringflash/ops.py), so its backward receives no K/V."""
    problem = cost.Problem(args.heads, args.heads, args.head_dim)
    per_step = cost.link_bytes(counts, problem)
    if kept and counts.direct and counts.cut:
        per_step = per_step - cost.kv_bytes(1, problem) * counts.received
    return int(per_step.sum(-1).max()) if per_step.dim() == 2 else int(per_step.sum())


def ring(args, device, group, world, rank) -> list[dict]:
    records = []
    for seqlen in args.seqlens:
        for mask in args.masks:
            kw, visible, _, lengths = case_mask(mask, seqlen, args.window, device, draw(seqlen, args))
            layouts = {"causal": ["zigzag", "block_stripe"], "window": ["contiguous", "block_stripe"],
                       "documents": ["documents", "zigzag", "stripe", "block_stripe"]}[mask]
            layouts = [name for name in layouts if not args.layouts or name in args.layouts]
            full = inputs(seqlen, args, device)
            if rank == 0:  # the same problem on one GPU, for the ring's efficiency
                one = [t.clone().requires_grad_() for t in full]
                fwd, fwdbwd = timed(lambda q, k, v: ringflash.flash_attn(q, k, v, **kw), *one,
                                    device, args)
                records.append(record("ringflash_1gpu", mask, seqlen, args.window, visible, fwd, fwdbwd, args))
                del one
            timing.barrier(group)
            for name in layouts:
                extra, layout = {}, name
                if name == "documents":  # the layout computed from this row's documents
                    start = time.perf_counter()
                    layout = ringflash.document_layout(torch.tensor([0, *lengths]).cumsum(0), seqlen, group)
                    extra = dict(layout_host_ms=1e3 * (time.perf_counter() - start), split_documents=layout.splits)
                if mask == "documents" and (args.documents_seed, args.documents_median) != (0, 2048):
                    extra.update(documents_seed=args.documents_seed, documents_median=args.documents_median)
                band = band_of_window(True, kw.get("window_size", (-1, -1)))
                steps = active_steps(layout, world, seqlen // world, band)
                local = [ringflash.shard(t, 1, layout).requires_grad_() for t in full]
                rkw = dict(kw, layout=layout)
                if "segment_ids" in kw:
                    rkw["segment_ids"] = ringflash.shard(kw["segment_ids"], 1, layout)
                for schedule in args.schedules:  # RINGFLASH_SCHEDULE, the same on every rank
                    counts = cost.ring_counts(world, seqlen, layout, cost_mask(mask, seqlen, args), schedule=schedule)
                    kept = ringflash.transport(group) == "nccl"  # eager calls through NCCL keep (ops.py)
                    extra.update(schedule=schedule, direct=counts.direct,
                                 bytes_sent_per_rank=bytes_sent(counts, args, kept))
                    with _schedule(schedule):
                        fwd, fwdbwd = timed(lambda q, k, v: ringflash.ring_flash_attn(q, k, v, **rkw),
                                            *local, device, args, group=group)
                    records.append(record("ringflash", mask, seqlen, args.window, visible, fwd, fwdbwd,
                                          args, world=world, layout=name, ring_steps=steps, **extra))
                del local
            if rank == 0:
                add_efficiency(records)
                print_rows([r for r in records if r["seqlen"] == seqlen and r["mask"] == mask])
            del full
            timing.free_memory(device)
    return records


@contextlib.contextmanager
def _schedule(schedule: str):
    """RINGFLASH_SCHEDULE set to ``schedule`` for the calls inside."""
    before = os.environ.get("RINGFLASH_SCHEDULE")
    os.environ["RINGFLASH_SCHEDULE"] = schedule
    try:
        yield
    finally:
        if before is None:
            del os.environ["RINGFLASH_SCHEDULE"]
        else:
            os.environ["RINGFLASH_SCHEDULE"] = before


def print_rows(rows: list[dict]) -> None:
    numbers = (("fwdbwd_ms", ".2f"), ("fwdbwd_tflops_visible", ".0f"), ("fwdbwd_tflops_visible_per_gpu", ".0f"),
               ("efficiency", ".2f"), ("predicted_efficiency", ".2f"), ("imbalance", ".2f"))
    columns = [(k, k) for k in ("impl", "layout", "schedule", "mask", "seqlen")] + [(k, k, f) for k, f in numbers]
    print(results.format_table(rows, columns + [("error", "error")]), flush=True)


def torch_cp_rows(args, device, group, world) -> list[dict]:
    """torch CP's FlexAttention path (``torch_cp.run_flex_cp``) on each mask of --torch-cp, on
    the ring's inputs; packed documents rounded to multiples of 2 x world for its balancer. A
    mask that failed (an error on every rank alike) is not tried at the longer lengths."""
    records, failed = [], {}
    for seqlen in args.seqlens:
        for mask in args.torch_cp:
            if mask in failed:
                records.append(record(torch_cp.FLEX_IMPL, mask, seqlen, args.window, 1, None, None, args,
                                      world=world, error=f"not run: {failed[mask]}"))
                continue
            lengths = torch_cp.cp_document_lengths(draw(seqlen, args), world) if mask == "documents" else None
            extra = dict(documents=len(lengths), document_unit=2 * world) if lengths else {}
            kw, visible, mask_mod, _ = case_mask(mask, seqlen, args.window, device, lengths)
            *full, dout = inputs(seqlen, args, device, n=4)
            res = torch_cp.run_flex_cp(full, dout, mask_mod, lambda q, k, v: ringflash.flash_attn(q, k, v, **kw),
                                       mask=mask, lengths=lengths, group=group, args=args)
            fwd, fwdbwd = res.pop("fwd_ms"), res.pop("fwdbwd_ms")
            records.append(record(torch_cp.FLEX_IMPL, mask, seqlen, args.window, visible, fwd, fwdbwd, args,
                                  world=world, **res, **extra))
            if res["error"]:
                failed[mask] = f"failed at {cli.fmt_size(seqlen)}"
            del full, dout
            timing.free_memory(device)
    return records


def add_efficiency(records: list[dict]) -> None:
    """``efficiency`` of every multi-GPU row with a time: its TFLOP/s per GPU over the same run's
    1-GPU row's (mask, seqlen), i.e. 1-GPU time / (world x its time) where both count the same
    visible pairs (the torch CP row on rounded documents counts its own)."""
    one = {(r["mask"], r["seqlen"]): r["fwdbwd_tflops_visible"] for r in records if r["impl"] == "ringflash_1gpu"}
    for r in records:
        per_gpu, base = r.get("fwdbwd_tflops_visible_per_gpu"), one.get((r["mask"], r["seqlen"]))
        if per_gpu and base:
            r["efficiency"] = per_gpu / base


def predicted(records: list[dict], world: int, args, costs: cost.Costs = cost.H100) -> list[dict]:
    """The cost model's efficiency (``ringflash.cost``, ``costs``: ``model_constants``) of each
    ring row of ``records``: its world, seqlen, mask and layout ("documents": document_layout
    of its documents)."""
    out = []
    for r in [r for r in records if r["impl"] == "ringflash" and r.get("gpus")]:
        m = cost_mask(r["mask"], r["seqlen"], args)
        layout = r["layout"]
        if layout == "documents":
            layout = ringflash.document_layout(torch.tensor(m.cu_seqlens), r["seqlen"], world=world)
        problem = cost.Problem(args.heads, args.heads, args.head_dim, segments=m.cu_seqlens is not None)
        schedule = r.get("schedule", "auto")
        eff = cost.efficiency(cost.ring_counts(world, r["seqlen"], layout, m, schedule=schedule),
                              cost.ring_counts(1, r["seqlen"], "contiguous", m), costs, problem)
        out.append(dict(impl="cost_model", gpus=world, layout=r["layout"], schedule=schedule, mask=r["mask"],
                        seqlen=r["seqlen"], window=r["window"], predicted_efficiency=eff, gluon=costs.gluon,
                        measured_efficiency=r.get("efficiency")))
    return out


def model_constants(device: torch.device, args) -> cost.Costs:
    """The cost model's constants for this run's kernels: ``cost.H100_GLUON`` where the Gluon
    kernels run the 1-GPU call (Hopper, bf16, head_dim 128: kernels/dispatch.py), else
    ``cost.H100`` (the Triton kernels)."""
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    return cost.H100_GLUON if hopper and args.head_dim == 128 else cost.H100


def plot(json_path) -> str:
    """Bars of forward+backward TFLOP/s over visible pairs (per GPU in the ring file), one
    group per (mask, seqlen), one bar per implementation (and layout; of several runs the
    latest), beside the JSON."""
    plt = plots.import_pyplot()
    data = results.load_results(json_path)
    records = results.latest_runs([r for r in data["records"] if r["impl"] != "cost_model"],
                                  lambda r: (r["impl"], r.get("layout"), r["mask"], r["seqlen"]))
    key = ("fwdbwd_tflops_visible_per_gpu" if any("fwdbwd_tflops_visible_per_gpu" in r for r in records)
           else "fwdbwd_tflops_visible")
    groups = sorted({(r["mask"], r["seqlen"]) for r in records}, key=lambda g: (g[1], g[0]))
    labels = sorted({r["impl"] + (f" ({r['layout']})" if r.get("layout") else "") for r in records})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 3.2))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = [next((r.get(key) or r.get("fwdbwd_tflops_visible") for r in records
                        if (r["mask"], r["seqlen"]) == g
                        and r["impl"] + (f" ({r['layout']})" if r.get("layout") else "") == label), 0)
                  for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], [v or 0 for v in values], width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{cli.fmt_size(n)}" for m, n in groups])
    ax.set_ylabel("fwd+bwd TFLOP/s" + (" per GPU" if key.endswith("per_gpu") else "") + ", visible pairs")
    ax.set_title(f"{data['meta'].get('device')} x{data['meta'].get('gpu_count')}, bf16, 32 heads, head_dim 128")
    ax.legend(fontsize=7)
    return plots.save_beside(fig, json_path)


@contextlib.contextmanager
def cpu_ranks():  # as cli.gpu_run, over gloo: a smoke run
    import torch.distributed as dist
    device = cli.start_ranks("cpu", 10.0)
    try:
        yield device, dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = cli.gpu_parser(__doc__, "masks_<gpu>[xN]")
    p.add_argument("--masks", nargs="+", default=["causal,documents,window"], help="masks to run")
    p.add_argument("--window", type=int, default=4096, help="left window of the 'window' mask")
    p.add_argument("--documents-median", type=int, default=2048, help="median document length of the draw")
    p.add_argument("--documents-seed", type=int, default=0, help="seed of the documents' draw")
    p.add_argument("--layouts", nargs="*", default=[], help="only these of each mask's ring layouts (default all)")
    p.add_argument("--schedules", nargs="+", default=["auto"], choices=("auto", "rotate", "direct"),
                   help="RINGFLASH_SCHEDULE of the ring rows, each timed in turn (a row's 'direct': taken)")
    p.add_argument("--torch-cp", nargs="*", default=["documents"],
                   help="masks on which torch CP (FlexAttention) runs beside the ring; none: the flag alone")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke test of --ring over gloo (1k tokens, 2 heads of 32)")
    p.add_argument("--plot", default=None, metavar="JSON", help="only draw the PNG of a results file")
    args = p.parse_args(argv)
    if args.device == "cpu":  # the smoke run's sizes, unless given
        p.set_defaults(seqlens=["1k"], heads=2, head_dim=32, rep_ms=5.0, ring=True)
        args = p.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return
    args.seqlens = cli.parse_sizes(args.seqlens)
    args.masks = cli.parse_names(args.masks, MASKS)
    args.torch_cp = [m for m in args.masks if m in cli.parse_names(args.torch_cp, MASKS)]
    run = (cpu_ranks() if args.device == "cpu"
           else cli.gpu_run(args.ring, "bench_masks.py", "FlexAttention and the Triton kernels"))
    with run as (device, group, world, rank):
        out_dir = results.results_dir(args.out_dir, results.is_smoke_run(device)) if rank == 0 else None

        def save(records):  # rank 0 alone, mid-run: a failure to plot only warns
            if rank == 0:
                name = args.out_name or results.result_name("masks", device, world if args.ring else None)
                path = results.write_results(name, results.collect_meta(device), records, out_dir)
                try:
                    print(plot(path), flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"wrote {path}; no plot ({checks.short_error(exc)})", flush=True)

        if not args.ring:
            return save(single_gpu(args, device))
        records = ring(args, device, group, world, rank)
        try:  # rank 0 alone, mid-run: never raises
            records += predicted(records, world, args, model_constants(device, args)) if rank == 0 else []
        except Exception as exc:  # noqa: BLE001
            print(f"no cost model rows: {checks.short_error(exc)}", flush=True)
        save(records)  # the ring's rows are on disk before torch CP runs
        if args.torch_cp:
            records += torch_cp_rows(args, device, group, world)
            add_efficiency(records)
            save(records)
        if rank == 0:
            print_rows([r for r in records if r["impl"] in ("cost_model", torch_cp.FLEX_IMPL)])


if __name__ == "__main__":
    main()
