"""How a benchmark script starts: sizes and names on the command line, the flags the scripts
share, the device and the process group."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
from typing import Iterable, Sequence

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ----------------------------------------------------------------------------- sizes and names


def parse_size(text: str) -> int:
    """'32k' -> 32768, '1m' -> 1048576, '4096' -> 4096."""
    s = str(text).strip().lower()
    mult = 1
    if s.endswith("k"):
        mult, s = 1024, s[:-1]
    elif s.endswith("m"):
        mult, s = 1024 * 1024, s[:-1]
    value = float(s) * mult
    if value <= 0 or value != int(value):
        raise ValueError(f"not a positive whole size: {text!r}")
    return int(value)


def parse_sizes(values: Iterable[str]) -> list[int]:
    """Accept both ``--seqlens 2k 4k`` and ``--seqlens 2k,4k``; sorted, without duplicates."""
    out = []
    for v in values:
        out.extend(parse_size(p) for p in str(v).split(",") if p.strip())
    if not out:
        raise ValueError("empty list")
    return sorted(set(out))


def parse_names(values: Iterable[str], allowed: Sequence[str]) -> list[str]:
    """Comma- or space-separated names, checked against ``allowed``, order kept."""
    out = []
    for v in values:
        for p in str(v).split(","):
            p = p.strip()
            if not p:
                continue
            if p not in allowed:
                raise ValueError(f"unknown name {p!r}; expected one of {', '.join(allowed)}")
            if p not in out:
                out.append(p)
    return out


def fmt_size(n: int) -> str:
    """32768 -> '32k'."""
    if n >= 1024 * 1024 and n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}m"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    if n >= 1024:
        return f"{n / 1024:g}k"
    return str(n)


def causal_modes(choice: str) -> list[bool]:
    return {"both": [False, True], "causal": [True], "noncausal": [False]}[choice]


# ----------------------------------------------------------------------------- shared flags


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none (None, False) or the help
    already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def add_problem_args(p, impls: Sequence[str], gpu: dict, cpu: dict) -> None:
    """The problem flags bench_kernel.py and bench_ring.py share: --batch, --causal, --impls
    (a subset of ``impls``) and --dtype (defaults from ``gpu`` / ``cpu``), --seed."""
    p.add_argument("--batch", type=int, default=1, help="sequences per call")
    p.add_argument("--causal", choices=("both", "causal", "noncausal"), default="both",
                   help="which masks to run")
    p.add_argument("--impls", nargs="+", default=None,
                   help=f"subset of {','.join(impls)} (default all; on the cpu {cpu['impls']})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help=f"input dtype (default {gpu['dtype']}; on the cpu {cpu['dtype']})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


def add_run_args(p, gpu: dict, cpu: dict, max_reps: int) -> None:
    """The output and timing flags bench_kernel.py and bench_ring.py share: --out-dir,
    --no-plot, --warmup-ms, --rep-ms (defaults from ``gpu`` / ``cpu``), --min-reps, --max-reps."""
    p.add_argument("--out-dir", default=None,
                   help="directory for the results (default benchmarks/results; a new temporary "
                        "directory for --quick and --device cpu)")
    p.add_argument("--no-plot", action="store_true", help="write the JSON only")
    p.add_argument("--warmup-ms", type=float, default=None,
                   help=f"warm-up time per measurement (default {gpu['warmup_ms']:g}; cpu {cpu['warmup_ms']:g})")
    p.add_argument("--rep-ms", type=float, default=None,
                   help=f"timed time per measurement (default {gpu['rep_ms']:g}; cpu {cpu['rep_ms']:g})")
    p.add_argument("--min-reps", type=int, default=3, help="timed repetitions at least")
    p.add_argument("--max-reps", type=int, default=max_reps, help="timed repetitions at most")


def fill_defaults(args: argparse.Namespace, defaults: dict, lists: Sequence[str] = ()) -> None:
    """Every flag of ``defaults`` left unset (None) takes its value there (a GPU run's or a
    CPU smoke run's defaults); those named in ``lists`` as a one-item list, as nargs="+" gives."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, [value] if key in lists else value)


def gpu_parser(doc: str, out_name: str) -> argparse.ArgumentParser:
    """The parser of a GPU-only script (bench_masks, bench_dropout, bench_blocksparse) with
    the flags they share: --ring, --seqlens, --heads, --head-dim, --rep-ms, --out-name
    (``out_name``: what its default is) and --out-dir. ``doc``: the script's docstring."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ring", action="store_true", help="run the ring under torchrun (NCCL)")
    p.add_argument("--seqlens", nargs="+", default=["32k,128k"], help="sequence lengths")
    p.add_argument("--heads", type=int, default=32, help="query (= key/value) heads")
    p.add_argument("--head-dim", type=int, default=128, help="head dim")
    p.add_argument("--rep-ms", type=float, default=100.0, help="timed time per measurement")
    p.add_argument("--out-name", default=None, help=f"results file name (default {out_name})")
    p.add_argument("--out-dir", default=None, help="results directory (default benchmarks/results)")
    return p


# ----------------------------------------------------------------------------- device and process group


def init_process_group(device: torch.device, timeout) -> None:
    """NCCL on a GPU, gloo on the CPU. NCCL's kernels go on high-priority streams
    (TORCH_NCCL_HIGH_PRIORITY=1 unless the environment says otherwise): the ring's
    transfers run beside full-grid attention kernels, and at normal priority they wait
    for SMs to free up. Every implementation in a run shares the setting.

    Without torchrun (no RANK / WORLD_SIZE in the environment) the script runs as a
    world of one process."""
    import torch.distributed as dist
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device.type == "cuda":
        os.environ.setdefault("TORCH_NCCL_HIGH_PRIORITY", "1")
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_gpu() -> torch.device:
    """This process's GPU: LOCAL_RANK's under torchrun, else the first; made current."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def start_ranks(device_type: str, minutes: float) -> torch.device:
    """This process's device, its GPU ("cuda": LOCAL_RANK's under torchrun) or the CPU (a
    smoke run over gloo), with the process group of every rank started
    (``init_process_group``: a world of one without torchrun)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ERROR: no CUDA device; use --device cpu for a smoke test")
    device = local_gpu() if device_type == "cuda" else torch.device("cpu")
    init_process_group(device, datetime.timedelta(minutes=minutes))
    return device


@contextlib.contextmanager
def gpu_run(ring: bool, script: str, why: str = "", minutes: float = 10.0):
    """(device, group, world, rank) of a GPU-only script: this process's GPU and, with
    ``ring`` (under torchrun), the process group of every rank, destroyed on the way out;
    without it (None, 1, 0). Exits with "``script`` needs a GPU (``why``)" without one."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a GPU" + (f" ({why})" if why else ""))
    if not ring:
        yield local_gpu(), None, 1, 0
        return
    import torch.distributed as dist
    device = start_ranks("cuda", minutes)
    try:
        yield device, dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def env_var(name: str, value: str):
    """``os.environ[name] = value`` inside the block, the old value (or none) after it."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def backend_label(transport: str, group=None) -> str:
    """What really moved the bytes: ringflash's "nccl" transport is the process group's own
    send/recv, i.e. gloo on a CPU run."""
    import torch.distributed as dist
    if transport == "nccl" and dist.is_available() and dist.is_initialized():
        return str(dist.get_backend(group))
    return transport
