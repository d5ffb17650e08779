"""Re-draw the PNG of one or more results files (benchmarks/results/<name>.json -> <name>.png).

    python benchmarks/plot.py benchmarks/results/ring_h200x4.json            # beside the JSON
    python benchmarks/plot.py --out-dir /tmp/plots benchmarks/results/*.json # elsewhere

TFLOP/s against sequence length, one line per implementation, one subplot per
(configuration, forward / forward+backward). The benchmark scripts call the same function
after a run; this is for re-plotting without re-running. Needs matplotlib
(pip install -e ".[bench]").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import cli, plots


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
            print(f"wrote {plots.plot_json(path, out)}")
        except ValueError as exc:  # not a TFLOP/s-against-seqlen file (balance, training metrics)
            print(f"skipped {path}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
