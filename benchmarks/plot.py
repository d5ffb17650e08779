"""Re-draw the PNG of one or more results files (benchmarks/results/<name>.json -> <name>.png).

    python benchmarks/plot.py benchmarks/results/kernel_h200.json benchmarks/results/ring_h200x4.json

TFLOP/s against sequence length, one line per implementation, one subplot per
(configuration, forward / forward+backward). The benchmark scripts call the same function
after a run; this is for re-plotting without re-running.
"""

from __future__ import annotations

import argparse
import sys

import _harness as H


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="results JSON files")
    p.add_argument("--out", default=None, help="PNG path (only with a single results file)")
    args = p.parse_args(argv)
    if args.out and len(args.results) != 1:
        p.error("--out needs exactly one results file")
    for path in args.results:
        print(f"wrote {H.plot_json(path, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
