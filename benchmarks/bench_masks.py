"""Masked attention: packed documents and sliding windows, ringflash against FlexAttention
and SDPA document by document on one GPU, and through the ring against the dense causal
ring of the same length and the 1-GPU kernel. Packed documents run through the ring on
the layout computed from their documents (``ringflash.document_layout``, layout
"documents") beside the fixed layouts; ring rows carry the steps the ring ran and the
bytes the busiest rank sent (counted from the schedule: ``bytes_sent``).

    python benchmarks/bench_masks.py                               # one GPU -> results/masks_<gpu>.json
    torchrun --nproc-per-node=2 benchmarks/bench_masks.py --ring   # ring -> results/masks_<gpu>x2.json

Documents: lengths drawn log-normal (median 2k, sigma 1.5: about 1% past 64k), packed
into one row and cut at the sequence end; causal within each document. Window: causal
with window_size (4096, 0). TFLOP/s are counted over the visible (query, key) pairs only:
4 * heads * head_dim * visible, times 3.5 for forward+backward. Every implementation's
output is checked against ringflash's on the same inputs before it is timed.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

import ringflash
from ringflash.kernels import band_of_window
from ringflash.layouts import active_steps
from ringflash.ring.plan import travelling_rows
from harness import checks, cli, plots, results, timing
from harness.timing import timed


def documents(seqlen: int, seed: int = 0, median: int = 2048, sigma: float = 1.5) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seqlen:
        n = max(1, int(math.exp(math.log(median) + sigma * torch.randn(1, generator=gen).item())))
        n = min(n, seqlen - total)
        lengths.append(n)
        total += n
    return lengths


def case_mask(mask: str, seqlen: int, window: int, device):
    """(flash_attn keywords, visible pairs, FlexAttention mask_mod, document lengths)."""
    if mask == "causal":
        return dict(causal=True), seqlen * (seqlen + 1) // 2, lambda b, h, q, k: q >= k, None
    if mask == "window":
        visible = sum(min(i, window) + 1 for i in range(seqlen))
        return (dict(causal=True, window_size=(window, 0)), visible,
                lambda b, h, q, k: (q >= k) & (q - k <= window), None)
    lengths = documents(seqlen)
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


def single_gpu(args, device) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    records = []
    for seqlen in args.seqlens:
        for mask in args.masks:
            kw, visible, mask_mod, lengths = case_mask(mask, seqlen, args.window, device)
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


def bytes_sent(layout, world: int, local_len: int, band, args) -> int:
    """Bytes the busiest rank sends in one forward+backward, counted from the schedule
    (``ring.plan.travelling_rows``): at each hop the travelling rows of the shard it passes
    on, as K/V (bf16) in the forward and again in the backward, and as the running dK/dV sum
    (fp32) in the backward; segment ids aside."""
    steps = active_steps(layout, world, local_len, band)
    sent = travelling_rows(layout, world, local_len, band, True, steps) if steps > 1 else None
    rows = [sum(local_len if sent is None else sent[(r - s) % world][1] - sent[(r - s) % world][0]
                for s in range(steps - 1)) for r in range(world)]
    return max(rows) * 2 * args.heads * args.head_dim * (2 + 2 + 4)


def ring(args, device, group, world, rank) -> list[dict]:
    records = []
    for seqlen in args.seqlens:
        for mask in args.masks:
            kw, visible, _, lengths = case_mask(mask, seqlen, args.window, device)
            layouts = {"causal": ["zigzag", "block_stripe"], "window": ["contiguous", "block_stripe"],
                       "documents": ["documents", "zigzag", "stripe", "block_stripe"]}[mask]
            gen = torch.Generator(device=device).manual_seed(0)
            full = [torch.randn(1, seqlen, args.heads, args.head_dim, device=device, generator=gen,
                                dtype=torch.bfloat16) for _ in range(3)]
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
                band = band_of_window(True, kw.get("window_size", (-1, -1)))
                steps = active_steps(layout, world, seqlen // world, band)
                extra["bytes_sent_per_rank"] = bytes_sent(layout, world, seqlen // world, band, args)
                local = [ringflash.shard(t, 1, layout).requires_grad_() for t in full]
                rkw = dict(kw, layout=layout)
                if "segment_ids" in kw:
                    rkw["segment_ids"] = ringflash.shard(kw["segment_ids"], 1, layout)
                fwd, fwdbwd = timed(lambda q, k, v: ringflash.ring_flash_attn(q, k, v, **rkw),
                                    *local, device, args, group=group)
                records.append(record("ringflash", mask, seqlen, args.window, visible, fwd, fwdbwd,
                                      args, world=world, layout=name, ring_steps=steps, **extra))
                del local
            if rank == 0:
                print(results.format_table([r for r in records if r["seqlen"] == seqlen and r["mask"] == mask],
                                     [("impl", "impl"), ("layout", "layout"), ("mask", "mask"), ("seqlen", "seqlen"),
                                      ("fwdbwd_ms", "fwdbwd_ms", ".2f"), ("fwdbwd_tflops_visible", "fwdbwd_tflops_visible", ".0f"),
                                      ("fwdbwd_tflops_visible_per_gpu", "fwdbwd_tflops_visible_per_gpu", ".0f")]), flush=True)
            del full
            timing.free_memory(device)
    return records


def plot(json_path) -> str:
    """Bars of forward+backward TFLOP/s over visible pairs (per GPU in the ring file), one
    group per (mask, seqlen), one bar per implementation (and layout), beside the JSON."""
    plt = plots.import_pyplot()
    data = results.load_results(json_path)
    records = data["records"]
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


def main(argv=None):
    p = cli.gpu_parser(__doc__, "masks_<gpu>[xN]")
    p.add_argument("--masks", nargs="+", default=["causal,documents,window"], help="masks to run")
    p.add_argument("--window", type=int, default=4096, help="left window of the 'window' mask")
    p.add_argument("--plot", default=None, metavar="JSON", help="only draw the PNG of a results file")
    args = p.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return
    args.seqlens = cli.parse_sizes(args.seqlens)
    args.masks = cli.parse_names(args.masks, ("causal", "documents", "window"))
    with cli.gpu_run(args.ring, "bench_masks.py", "FlexAttention and the Triton kernels") as (device, group, world, rank):
        records = ring(args, device, group, world, rank) if args.ring else single_gpu(args, device)
        if rank == 0:
            name = args.out_name or results.result_name("masks", device, world if args.ring else None)
            out_dir = results.results_dir(args.out_dir, results.is_smoke_run(device))
            print(plot(results.write_results(name, results.collect_meta(device), records, out_dir)))


if __name__ == "__main__":
    main()
