"""Results: where a run's JSON goes, what its meta says, and the text tables a run prints.

A file is named after the bench and the measured device (``result_name``: kernel_h200.json,
ring_h200x4.json, ring_cpux2.json) and holds {"meta": ..., "records": [...]}; the meta
(``collect_meta``) names the device, the GPU count, the torch / triton / CUDA / cuDNN
versions, the git commit and the date. A real GPU run writes into benchmarks/results; a
smoke run (``--device cpu`` or ``--quick``) into a fresh temporary directory unless
``--out-dir`` says otherwise (``results_dir``), so that it never replaces committed
measurements.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"


# ----------------------------------------------------------------------------- names and places

# Words of a device name that are not the model: vendors, product lines, memory sizes.
_NOT_MODEL = {"nvidia", "geforce", "tesla", "quadro", "amd", "instinct", "radeon", "intel", "pcie",
              "sxm", "nvl", "hbm3", "hbm3e", "hbm2e", "hbm2"}


def gpu_slug(name: str) -> str:
    """A short lowercase model name: 'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100',
    'NVIDIA A100-SXM4-80GB' -> 'a100', 'NVIDIA GeForce RTX 4090' -> 'rtx4090'."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in _NOT_MODEL]
    for i, word in enumerate(words):
        if re.search(r"\d", word) and not re.fullmatch(r"\d+gb", word):
            if word.isdigit() and i > 0:  # 'rtx 4090': the line belongs to the model
                return words[i - 1] + word
            return word
    return "".join(words)[:16] or "gpu"


def device_slug(device: Optional[torch.device] = None) -> str:
    """gpu_slug of the measured GPU, 'cpu' off CUDA."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    return gpu_slug(torch.cuda.get_device_name(device))


def result_name(bench: str, device: Optional[torch.device], ranks: Optional[int] = None) -> str:
    """``<bench>_<device>``, with ``x<ranks>`` for a multi-process bench: kernel_h200,
    ring_h200x4, balance_cpux2."""
    return f"{bench}_{device_slug(device)}" + ("" if ranks is None else f"x{ranks}")


def is_smoke_run(device: torch.device, quick: bool = False) -> bool:
    """A run that checks the script rather than measures the hardware: on the CPU, or --quick."""
    return device.type != "cuda" or quick


def results_dir(out_dir: Optional[os.PathLike], smoke: bool) -> Path:
    """``out_dir`` if given; a new temporary directory for a smoke run (so it never replaces
    the committed results); benchmarks/results otherwise."""
    if out_dir is not None:
        return Path(out_dir)
    if smoke:
        return Path(tempfile.mkdtemp(prefix="ringflash-bench-"))
    return RESULTS_DIR


# ----------------------------------------------------------------------------- meta and files


def git_commit() -> tuple[str, Optional[bool]]:
    """(HEAD commit, whether the tree has uncommitted changes); ('unknown', None) without git.

    A copy of the tree without .git (a GPU machine's) can name its commit in the
    environment: RINGFLASH_COMMIT=$(git rev-parse HEAD) where the checkout is.
    """
    if os.environ.get("RINGFLASH_COMMIT"):
        return os.environ["RINGFLASH_COMMIT"], None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown", None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        return head.stdout.strip(), dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def collect_meta(device: Optional[torch.device] = None, **extra) -> dict:
    """Device name, GPU count, versions, git commit and date of this run."""
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - any failure means "not available"
        triton_version = None
    if torch.cuda.is_available():
        index = device.index if device is not None and device.type == "cuda" and device.index is not None else 0
        name = torch.cuda.get_device_name(index)
    else:
        name = f"cpu ({platform.processor() or platform.machine()})"
    commit, dirty = git_commit()
    meta = {
        "device": name,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "commit": commit,
        "dirty": dirty,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "nccl_high_priority": os.environ.get("TORCH_NCCL_HIGH_PRIORITY"),
    }
    meta.update(extra)
    return meta


def _clean(obj):
    """JSON-safe copy: non-finite floats become None, tuples lists, unknown objects strings."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (bool, int, str)) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return _clean(obj.item())
    return str(obj)


def write_results(name: str, meta: dict, records: list[dict], out_dir: os.PathLike) -> Path:
    """Write {"meta": ..., "records": [...]} to <out_dir>/<name>.json, replacing it atomically
    (``results_dir`` decides out_dir)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    payload = {"meta": _clean(meta), "records": _clean(records)}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def load_results(path: os.PathLike) -> dict:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "records" not in data:
        raise ValueError(f"{path}: not a results file (no 'records')")
    data.setdefault("meta", {})
    return data


# ----------------------------------------------------------------------------- tables


def _cell(value, fmt) -> str:
    if value is None:
        return "-"
    if callable(fmt):
        return fmt(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and not math.isfinite(value):
        return "-"
    return format(value, fmt) if fmt else str(value)


def latest_runs(records: list[dict], key) -> list[dict]:
    """The records of a file that holds several runs (each record's ``run`` indexes
    meta.runs; a record without one is run 0), keeping of each ``key(record)`` only the
    latest run's, in file order: what a plot of the file shows."""
    latest: dict = {}
    for r in records:
        k = key(r)
        if k not in latest or r.get("run", 0) >= latest[k].get("run", 0):
            latest[k] = r
    kept = {id(r) for r in latest.values()}
    return [r for r in records if id(r) in kept]


def format_table(rows: list[dict], columns: Sequence[tuple]) -> str:
    """Fixed-width plain-text table. columns: (key, header) or (key, header, fmt), where fmt is
    a format spec ('.1f') or a callable; None prints as '-'. Text is left-aligned, numbers
    right-aligned."""
    cols = [(c[0], c[1], c[2] if len(c) > 2 else "") for c in columns]
    cells = [[_cell(row.get(k), f) for k, _, f in cols] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, (_, h, _) in enumerate(cols)]
    def is_number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    numeric = [any(row.get(k) is not None for row in rows)
               and all(is_number(row.get(k)) for row in rows if row.get(k) is not None) for k, _, _ in cols]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line([h for _, h, _ in cols]), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out)
