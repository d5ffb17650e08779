"""Draw which global tokens each rank holds under every layout.

    python benchmarks/plot_layouts.py                      # -> benchmarks/results/layouts.png
    python benchmarks/plot_layouts.py --out /tmp/layouts.png

The picture is computed from ringflash.layouts, the same code the ring runs. Needs
matplotlib (pip install -e ".[bench]").
"""

import argparse
import sys
from pathlib import Path

from harness import cli, plots, results
from ringflash.kernels.masks import BLOCK
from ringflash.layouts import LAYOUTS, global_positions, pair_area, step_pairs

WORLD, SEQLEN = 4, 32  # SEQLEN cells: tokens, or for block_stripe blocks of BLOCK tokens


def unit(layout) -> int:
    """Tokens per drawn cell."""
    return BLOCK if layout == "block_stripe" else 1


def owner_map(layout) -> list[int]:
    owner = [0] * SEQLEN
    for rank in range(WORLD):
        for t in global_positions(SEQLEN * unit(layout), layout, rank, WORLD).tolist():
            owner[t // unit(layout)] = rank
    return owner


def causal_work(layout):
    """Visible (query, key) elements each rank computes: the causal triangle split by rank
    (what each pair's band keeps, ``layouts.pair_area``)."""
    n = SEQLEN * unit(layout) // WORLD
    return [sum(pair_area(pair, n) for src in range(WORLD)
                for pair in step_pairs(layout, rank, src, WORLD, n, (None, 0)))
            for rank in range(WORLD)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=cli.HelpFormatter)
    p.add_argument("--out", default=None, help="PNG to write (default benchmarks/results/layouts.png)")
    args = p.parse_args(argv)
    try:
        plt = plots.import_pyplot()
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    colors = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(len(LAYOUTS), 2, figsize=(10, 1.6 * len(LAYOUTS)),
                             gridspec_kw={"width_ratios": [4, 1]})
    for row, layout in enumerate(LAYOUTS):
        ax = axes[row, 0]
        owner = owner_map(layout)
        for t in range(SEQLEN):
            ax.add_patch(plt.Rectangle((t, 0), 1, 1, color=colors[owner[t]], ec="white"))
            ax.text(t + 0.5, 0.5, str(owner[t]), ha="center", va="center", fontsize=7, color="white")
        ax.set_xlim(0, SEQLEN)
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_xticks(range(0, SEQLEN + 1, SEQLEN // WORLD))
        cells = f"{SEQLEN} tokens" if unit(layout) == 1 else f"{SEQLEN} blocks of {unit(layout)} tokens"
        ax.set_title(f"{layout}: owner rank of each of {cells} ({WORLD} ranks)", fontsize=9, loc="left")
        work = causal_work(layout)
        axes[row, 1].bar(range(WORLD), work, color=colors[:WORLD])
        axes[row, 1].set_title("causal work per rank", fontsize=9)
        axes[row, 1].set_xticks(range(WORLD))
    axes[-1, 0].set_xlabel("global token position")
    fig.tight_layout()
    out = Path(args.out) if args.out else results.RESULTS_DIR / "layouts.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
