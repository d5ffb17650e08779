"""Plots: the PNG beside a results file, TFLOP/s against sequence length, one line per
implementation (and layout, and dropout rate), one panel per configuration and phase.
matplotlib (the "bench" extra) is imported only when a plot is drawn."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

from .checks import short_error
from .cli import fmt_size
from .results import latest_runs, load_results

# Keys that describe a configuration (one subplot row per distinct combination).
PANEL_KEYS = ("heads", "kv_heads", "head_dim", "causal")
METRIC_LABELS = {"fwd": "forward", "fwdbwd": "forward + backward"}


def _metric_keys(records: list[dict]) -> list[tuple[str, str]]:
    keys = []
    for phase in ("fwd", "fwdbwd"):
        for suffix in ("_tflops_per_gpu", "_tflops"):
            k = phase + suffix
            if any(k in r for r in records):
                keys.append((k, METRIC_LABELS[phase]))
                break
    return keys


def _panel_title(config: dict) -> str:
    parts = []
    if "heads" in config:
        kv = config.get("kv_heads")
        parts.append(f"heads {config['heads']}" + (f"/{kv} kv" if kv is not None and kv != config["heads"] else ""))
    if "head_dim" in config:
        parts.append(f"head_dim {config['head_dim']}")
    if "causal" in config:
        parts.append("causal" if config["causal"] else "non-causal")
    if config.get("mask") is not None:
        parts.append(f"mask {config['mask']}")
    return ", ".join(parts)


def default_label(record: dict) -> str:
    """A line of the plot: the implementation, ringflash's layout and ``variant`` (the tree of
    a comparison run), and the dropout rate where the records have one (p = 0 and p = 0.1
    are two lines, not one)."""
    label = str(record.get("impl"))
    layout = record.get("layout")
    if label == "ringflash" and layout:
        label = f"{label} ({layout})"
    if label.startswith("ringflash") and record.get("variant"):
        label = f"{label}, {record['variant']}"
    if record.get("dropout_p") is not None:
        label = f"{label} p={record['dropout_p']:g}"
    return label


def _linestyle(label: str) -> str:
    """Dashed for single-GPU baselines inside a multi-GPU plot."""
    return "--" if "1gpu" in label else "-"


MISSING_MATPLOTLIB = ('matplotlib is not installed; the plots need the "bench" extra: '
                      'pip install -e ".[bench]" (from the repository root)')


def save_beside(fig, json_path) -> str:
    """Lay out ``fig`` and write it as the PNG beside a results file (same name, .png)."""
    fig.tight_layout()
    png = str(Path(json_path).with_suffix(".png"))
    fig.savefig(png, dpi=110)
    return png


def import_pyplot():
    """matplotlib.pyplot on the Agg backend; without matplotlib, an ImportError that says
    which extra to install."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(MISSING_MATPLOTLIB) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_results(data: dict, png_path: os.PathLike, *, panel_keys: Optional[Sequence[str]] = None,
                 label_fn: Callable[[dict], str] = default_label, ylabel: Optional[str] = None) -> Path:
    """PNG of TFLOP/s against seqlen: one line per implementation, one subplot per
    (configuration, forward / forward+backward); of a file of several runs, each point's
    latest (``results.latest_runs``)."""
    plt = import_pyplot()

    records = [r for r in data["records"] if isinstance(r, dict) and "seqlen" in r]
    meta = data.get("meta", {})
    metrics = _metric_keys(records)
    if not records or not metrics:
        raise ValueError("nothing to plot: no records with a seqlen and a *_tflops field")
    if panel_keys is None:
        panel_keys = [k for k in PANEL_KEYS if any(k in r for r in records)]
    records = latest_runs(records, lambda r: (label_fn(r), tuple(r.get(k) for k in panel_keys), r["seqlen"]))
    configs: list[tuple] = []
    for r in records:
        key = tuple(r.get(k) for k in panel_keys)
        if key not in configs:
            configs.append(key)
    impl_order: list[str] = []
    for r in records:
        if r.get("impl") not in impl_order:
            impl_order.append(r.get("impl"))
    labels = sorted({label_fn(r) for r in records},
                    key=lambda lab: (min(impl_order.index(r.get("impl")) for r in records if label_fn(r) == lab), lab))
    cmap = plt.get_cmap("tab10")
    colors = {lab: cmap(i % 10) for i, lab in enumerate(labels)}
    markers = "os^Dv<>ph*"

    nrows, ncols = len(configs), len(metrics)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows), squeeze=False)
    seqlens = sorted({int(r["seqlen"]) for r in records})
    per_gpu = any(m.endswith("_per_gpu") for m, _ in metrics)
    per = "process" if str(meta.get("device", "")).startswith("cpu") else "GPU"  # a CPU smoke run
    for i, cfg in enumerate(configs):
        cfg_records = [r for r in records if tuple(r.get(k) for k in panel_keys) == cfg]
        for j, (metric, metric_label) in enumerate(metrics):
            ax = axes[i][j]
            for li, lab in enumerate(labels):
                pts = sorted((int(r["seqlen"]), r.get(metric)) for r in cfg_records
                             if label_fn(r) == lab and isinstance(r.get(metric), (int, float)))
                if not pts:
                    continue
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker=markers[li % len(markers)], color=colors[lab], label=lab,
                        linestyle=_linestyle(lab), linewidth=1.6, markersize=5)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens)
            ax.set_xticklabels([fmt_size(s) for s in seqlens])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{_panel_title(dict(zip(panel_keys, cfg)))} | {metric_label}", fontsize=10)
            ax.set_xlabel("sequence length" + (" (global)" if per_gpu else ""))
            ax.set_ylabel(ylabel or (f"TFLOP/s per {per}" if per_gpu else "TFLOP/s"))
    handles = [plt.Line2D([], [], color=colors[lab], marker=markers[i % len(markers)], label=lab,
                          linestyle=_linestyle(lab))
               for i, lab in enumerate(labels)]
    commit = str(meta.get("commit", "unknown"))[:10]
    title = (f"{meta.get('device', '?')} x{meta.get('world_size', meta.get('gpu_count', '?'))}"
             f" | torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}"
             f" | {meta.get('dtype', '')} | commit {commit} | {meta.get('date', '')}")
    fig.tight_layout()
    # Legend and title sit above the axes; bbox_inches="tight" keeps them in the PNG.
    height_in = fig.get_size_inches()[1]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(labels), 4), frameon=False,
               bbox_to_anchor=(0.5, 1.0 + 0.05 / height_in))
    n_legend_rows = math.ceil(len(labels) / min(len(labels), 4))
    fig.suptitle(title, fontsize=9, y=1.0 + (0.15 + 0.3 * n_legend_rows) / height_in, va="bottom")
    png = Path(png_path)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return png


def plot_json(json_path: os.PathLike, png_path: Optional[os.PathLike] = None) -> Path:
    """Plot a results file to a PNG beside it (same name, .png)."""
    json_path = Path(json_path)
    png = Path(png_path) if png_path is not None else json_path.with_suffix(".png")
    return plot_results(load_results(json_path), png)


def try_plot(json_path: os.PathLike) -> Optional[Path]:
    """plot_json, but a failure to plot only warns: the JSON is already written."""
    try:
        png = plot_json(json_path)
        print(f"wrote {png}", flush=True)
        return png
    except Exception as exc:  # noqa: BLE001 - the results matter more than the picture
        print(f"WARNING: no plot ({short_error(exc)}); re-plot later with "
              f"python benchmarks/plot.py {json_path}", flush=True)
        return None
