"""Re-draw the PNG of one or more results files (benchmarks/results/<name>.json -> <name>.png).

    python benchmarks/plot.py benchmarks/results/ring_h200x4.json            # beside the JSON
    python benchmarks/plot.py --out-dir /tmp/plots benchmarks/results/*.json # elsewhere
    python benchmarks/plot.py benchmarks/results/train_h100x4_128k.json      # a training curve

TFLOP/s against sequence length, one line per implementation, one subplot per
(configuration, forward / forward+backward). The benchmark scripts call the same function
after a run; this is for re-plotting without re-running. A launch/train.py metrics file
(--metrics-out: per-step losses and accuracies) gives its training curve instead
(``plot_train``). Needs matplotlib (pip install -e ".[bench]").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

from harness import cli, plots


def is_train_metrics(data) -> bool:
    """A launch/train.py metrics file: per-step ``losses``, no benchmark ``records``."""
    return isinstance(data, dict) and isinstance(data.get("losses"), list) and "records" not in data


def _train_stages(m: dict) -> list[tuple[int, int, int, Optional[float]]]:
    """(first step, batch size, seqlen, tokens/s) of each stage: the curriculum's, else one."""
    stages = [(int(s["first_step"]), int(s.get("batch_size", 1)), int(s["seqlen"]), s.get("tokens_per_s"))
              for s in m.get("stages") or [] if "first_step" in s and "seqlen" in s]
    if not stages:
        stages = [(1, int(m.get("batch_size", 1)), int(m.get("seqlen", 0)), m.get("tokens_per_s"))]
    return stages


def plot_train(json_path, png_path=None) -> Path:
    """PNG of a launch/train.py metrics file: the loss per step (log axis) above the accuracy
    per step, a dotted line at the chance level of each, a vertical line at the start of each
    stage of a curriculum; each stage labelled with its batch x length and tokens/s, the
    evaluation in the title. Beside the JSON (same name, .png) unless ``png_path`` says."""
    plt = plots.import_pyplot()
    json_path = Path(json_path)
    m = json.loads(json_path.read_text())
    if not is_train_metrics(m):
        raise ValueError("not a launch/train.py metrics file (no per-step losses)")
    losses = m["losses"]
    accs = m.get("accuracies") or []
    steps = list(range(1, len(losses) + 1))
    stages = _train_stages(m)
    args = m.get("args") or {}

    fig, (ax_loss, ax_acc) = plt.subplots(2, 1, figsize=(8.0, 5.6), sharex=True)
    pos = [(x, y) for x, y in zip(steps, losses) if isinstance(y, (int, float)) and y > 0]
    if pos:
        ax_loss.plot(*zip(*pos), color="tab:blue", linewidth=1.0)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss (queries)")
    if accs:
        ax_acc.plot(steps[:len(accs)], accs, color="tab:green", linewidth=1.0)
    ax_acc.set_ylim(-0.02, 1.05)
    ax_acc.set_ylabel("accuracy (queries)")
    ax_acc.set_xlabel("step")
    ax_acc.set_xlim(0, len(losses) + 1)
    chance = m.get("chance_loss")
    if isinstance(chance, (int, float)):
        ax_loss.axhline(chance, color="gray", linestyle=":", linewidth=1.0, label="chance")
        ax_acc.axhline(math.exp(-chance), color="gray", linestyle=":", linewidth=1.0, label="chance")
    for ax in (ax_loss, ax_acc):
        ax.grid(True, alpha=0.3)
        for i, (first, *_) in enumerate(stages):
            if i:
                ax.axvline(first - 0.5, color="black", linewidth=0.8, alpha=0.6)
    for first, batch, seqlen, tok_s in stages:  # the label sits at the foot of the loss panel
        label = f"{batch} x {cli.fmt_size(seqlen)}" + (f"\n{tok_s / 1e3:,.0f}k tok/s" if tok_s else "")
        ax_loss.text(first + 0.006 * len(losses), 0.03, label, transform=ax_loss.get_xaxis_transform(),
                     va="bottom", ha="left", fontsize=8)
    ax_acc.legend(loc="center right", fontsize=8, frameon=False)

    ev = m.get("eval") or {}
    title = (f"{m.get('device', '?')} x{m.get('world_size', '?')} | torch {m.get('torch', '?')}"
             f" | {m.get('dtype', '')} | {m.get('params', 0) / 1e6:.0f}M params"
             + (f" | rope base {args['rope_base']:g}" if "rope_base" in args else ""))
    sub = (f"curriculum {m['curriculum']}" if m.get("curriculum") else f"{m.get('seqlen', '?')} tokens")
    sub += f" | final stage {m.get('tokens_per_s', 0):,.0f} tok/s"
    if ev:
        sub += (f" | eval: {ev.get('steps')} x {cli.fmt_size(int(ev.get('seqlen', 0)))}, "
                f"{ev.get('scored', 0):,} queries, loss {ev.get('loss', float('nan')):.2g}, "
                f"acc {ev.get('accuracy', float('nan')):.3f}")
    if m.get("min_answer_distance"):
        sub += f" | answers >= {m['min_answer_distance']:,} tokens back"
    fig.suptitle(f"{title}\n{sub}", fontsize=8)
    fig.tight_layout()
    png = Path(png_path) if png_path is not None else json_path.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return png


def plot_any(json_path, png_path=None) -> Path:
    """plot_train for a launch/train.py metrics file, plots.plot_json for the others."""
    try:
        data = json.loads(Path(json_path).read_text())
    except (OSError, ValueError):
        data = None
    if is_train_metrics(data):
        return plot_train(json_path, png_path)
    return plots.plot_json(json_path, png_path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=cli.HelpFormatter)
    p.add_argument("results", nargs="+", help="results JSON files")
    p.add_argument("--out", default=None, help="PNG path (only with a single results file)")
    p.add_argument("--out-dir", default=None,
                   help="directory for the PNGs (default: beside each JSON, replacing its PNG)")
    args = p.parse_args(argv)
    if args.out and len(args.results) != 1:
        p.error("--out needs exactly one results file")
    if args.out and args.out_dir:
        p.error("--out and --out-dir exclude each other")
    try:
        plots.import_pyplot()
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in args.results:
        out = args.out
        if args.out_dir:
            out = Path(args.out_dir) / Path(path).with_suffix(".png").name
        try:
            print(f"wrote {plot_any(path, out)}")
        except ValueError as exc:  # neither TFLOP/s against seqlen nor training metrics (balance)
            print(f"skipped {path}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
