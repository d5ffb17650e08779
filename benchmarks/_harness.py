"""Shared pieces of the benchmark scripts: FLOP counts, timing, peak memory, run metadata,
JSON results, plots and text tables.

Every script times its implementations side by side in one run, on random inputs, with the
same timer: a first untimed call (JIT compilation, communicators), warm-up, then CUDA events
around each repetition with the L2 cache flushed in between, and the median of the
repetitions. Under a process group every rank runs the same number of repetitions and the
reported time is the maximum over ranks of the per-rank medians: a ring is as slow as its
slowest rank.

Where results go (``result_name``, ``results_dir``): a file named after the bench and the
measured device (kernel_h200.json, ring_h200x4.json, ring_cpux2.json), in
benchmarks/results for a real GPU run and in a fresh temporary directory for a smoke run
(``--device cpu`` or ``--quick``) unless ``--out-dir`` says otherwise, so that a smoke run
never replaces committed measurements.

Nothing here imports ringflash; matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

GIB = 1024 ** 3
L2_FLUSH_BYTES = 256 * 1024 * 1024  # several times the 50-60 MB L2 of an H100/H200

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ----------------------------------------------------------------------------- arguments


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


def causal_modes(choice: str) -> list[bool]:
    return {"both": [False, True], "causal": [True], "noncausal": [False]}[choice]


def fmt_size(n: int) -> str:
    """32768 -> '32k'."""
    if n >= 1024 * 1024 and n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}m"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    if n >= 1024:
        return f"{n / 1024:g}k"
    return str(n)


# ----------------------------------------------------------------------------- FLOPs

_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


def attn_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, *,
               causal: bool, mode: str = "fwd") -> float:
    """FLOPs of attention, counted the FlashAttention way.

    Forward: two matmuls of 2·sq·sk·d each per head -> 4·batch·heads·sq·sk·head_dim, halved when
    causal (the masked half is not computed). Backward counts 2.5x the forward (five matmuls
    instead of two), forward+backward 3.5x. ``heads`` are the query heads; GQA does not
    change the count.
    """
    if mode not in _FLOP_FACTOR:
        raise ValueError(f"mode must be one of {sorted(_FLOP_FACTOR)}, got {mode!r}")
    fwd = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        fwd /= 2.0
    return fwd * _FLOP_FACTOR[mode]


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds; None when there is no time."""
    if ms is None or not ms > 0 or not math.isfinite(ms):
        return None
    return flops / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------- numerics


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error ||a - e|| / ||e||, in fp32, of two tensors of one shape."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.float(), expected.float()
    num = torch.linalg.vector_norm(a - e).item()
    den = torch.linalg.vector_norm(e).item()
    if not math.isfinite(num) or not math.isfinite(den):
        return float("inf")
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def sq_norms(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(||a - e||², ||e||²) in fp32, to combine shards of one tensor across ranks."""
    a, e = actual.float(), expected.float()
    return ((a - e).pow(2).sum().item(), e.pow(2).sum().item())


# ----------------------------------------------------------------------------- distributed helpers


def _dist_active(group) -> bool:
    return group is not None and torch.distributed.is_available() and torch.distributed.is_initialized()


def barrier(group=None) -> None:
    if _dist_active(group):
        torch.distributed.barrier(group=group)


def allreduce_max(value: float, group, device: torch.device) -> float:
    if not _dist_active(group):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return float(t.item())


def allreduce_sum(values: Sequence[float], group, device: torch.device) -> list[float]:
    if not _dist_active(group):
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
    return [float(x) for x in t.tolist()]


def all_ranks_ok(ok: bool, group, device: torch.device) -> bool:
    """True only if ``ok`` is True on every rank (so all ranks take the same branch)."""
    if not _dist_active(group):
        return ok
    return allreduce_max(0.0 if ok else 1.0, group, device) == 0.0


# ----------------------------------------------------------------------------- timing

_l2_buffer: dict = {}


def init_l2_flush(device: torch.device) -> None:
    """Allocate the L2-flush buffer now, so it is not counted in anyone's peak memory."""
    if device.type == "cuda" and device not in _l2_buffer:
        _l2_buffer[device] = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)


def _flush_l2(device: torch.device) -> None:
    if device.type == "cuda":
        init_l2_flush(device)
        _l2_buffer[device].zero_()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_SLEEP_CYCLES_PER_MS: dict = {}


def _sleep_cycles(device: torch.device, ms: float) -> int:
    """GPU clock cycles ``torch.cuda._sleep`` spins for about ``ms`` (calibrated once)."""
    if device not in _SLEEP_CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        _sync(device)
        _SLEEP_CYCLES_PER_MS[device] = 1_000_000 / max(start.elapsed_time(end), 1e-3)
    return int(ms * _SLEEP_CYCLES_PER_MS[device])


def bench_ms(fn: Callable[[], object], *, device: torch.device, warmup_ms: float = 25.0,
             rep_ms: float = 100.0, min_reps: int = 3, max_reps: int = 100,
             grad_to_none: Sequence[torch.Tensor] = (), flush_l2: bool = True,
             group=None, host_ahead: bool = False) -> float:
    """Median time of ``fn()`` in milliseconds (CUDA events on CUDA, wall clock elsewhere).

    As triton.testing.do_bench(return_mode="median"), with three changes: at least
    ``min_reps`` timed repetitions however slow ``fn`` is; the ``.grad`` of ``grad_to_none``
    reset before every call (outside the timed region), so backward never pays for
    accumulating into old gradients; and with a process group every rank runs the same
    number of calls (the estimate is the max over ranks) and the result is the max over
    ranks of the per-rank medians.

    The timed calls are enqueued back to back, so a call whose host takes longer to enqueue
    it than the GPU takes to run it is timed at the host's pace (the GPU waits for its
    launches). With ``host_ahead`` (CUDA), the GPU sleeps before each timed call
    (``torch.cuda._sleep``, twice the host's enqueue time of a call, the longest over the
    ranks, so every rank sleeps as long) while the host enqueues it, and the events
    bracket the call alone: its GPU time with the host ahead, as in a model whose other
    layers keep the GPU busy.
    """
    def clear() -> None:
        for t in grad_to_none:
            t.grad = None

    # First call: JIT compilation, autotuning, communicator setup. Not timed.
    clear()
    fn()
    _sync(device)

    barrier(group)
    _sync(device)
    n_est = 2
    t0 = time.perf_counter()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n_est):
            clear()
            fn()
        end.record()
        host = (time.perf_counter() - t0) * 1e3 / n_est
        _sync(device)
        est = start.elapsed_time(end) / n_est
        sleep = _sleep_cycles(device, 2 * allreduce_max(host, group, device)) if host_ahead else 0
    else:
        for _ in range(n_est):
            clear()
            fn()
        est = (time.perf_counter() - t0) * 1e3 / n_est
    est = max(allreduce_max(est, group, device), 1e-3)

    n_warmup = min(int(warmup_ms / est), max_reps)
    n_rep = max(min_reps, min(int(rep_ms / est), max_reps))
    for _ in range(n_warmup):
        clear()
        fn()
    _sync(device)
    barrier(group)
    _sync(device)

    times: list[float] = []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        for i in range(n_rep):
            clear()
            if flush_l2:
                _flush_l2(device)
            if sleep:
                torch.cuda._sleep(sleep)
            starts[i].record()
            fn()
            ends[i].record()
        _sync(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(n_rep):
            clear()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    clear()
    return allreduce_max(statistics.median(times), group, device)


def timing_opts(args: argparse.Namespace) -> dict:
    """bench_ms's options from a script's --warmup-ms, --rep-ms, --min-reps and --max-reps."""
    return dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, min_reps=args.min_reps,
                max_reps=args.max_reps)


def time_phases(call: Callable, inputs: Sequence[torch.Tensor], dout: torch.Tensor, *,
                device: torch.device, group=None, **timing) -> dict:
    """Forward (no grad) and forward+backward of ``call(*inputs)`` with output gradient ``dout``.

    Returns fwd_ms, fwdbwd_ms (bench_ms: max over the ranks of ``group`` of their medians),
    peak_bytes (working set plus the inputs, max over the ranks) and error. A phase that
    fails on any rank is None on all. ``group`` None: this process alone. ``timing``:
    bench_ms's options (``timing_opts``).
    """
    res = {"fwd_ms": None, "fwdbwd_ms": None, "peak_bytes": None, "error": None}
    errors = []
    opts = dict(timing, device=device, group=group)
    with PeakMemory(device) as mem:
        try:
            with torch.no_grad():
                ms = bench_ms(lambda: call(*inputs), **opts)
        except Exception as exc:  # noqa: BLE001
            ms = None
            errors.append(f"fwd: {short_error(exc)}")
            free_memory(device)
        res["fwd_ms"] = ms if all_ranks_ok(ms is not None, group, device) else None
        leaves = [t.detach().requires_grad_() for t in inputs]
        try:
            ms = bench_ms(lambda: call(*leaves).backward(dout), grad_to_none=leaves, **opts)
        except Exception as exc:  # noqa: BLE001
            ms = None
            errors.append(f"fwd+bwd: {short_error(exc)}")
        res["fwdbwd_ms"] = ms if all_ranks_ok(ms is not None, group, device) else None
        leaves = None  # drop the grads' owners before the next impl
    if mem.working_set is not None:
        local = mem.working_set + tensor_bytes(*inputs, dout)
        res["peak_bytes"] = allreduce_max(float(local), group, device)
    if errors:
        res["error"] = "; ".join(errors)
    elif res["fwd_ms"] is None or res["fwdbwd_ms"] is None:
        res["error"] = "failed on another rank"
    free_memory(device)
    return res


def failed_checks(errs: dict[str, float], tol: float, grad_tol: float) -> list[str]:
    """The relative errors above tolerance: ``tol`` for "out", ``grad_tol`` for the rest."""
    limits = {n: tol if n == "out" else grad_tol for n in errs}
    return [f"{n} rel err {e:.3g} > {limits[n]:g}" for n, e in errs.items() if not e <= limits[n]]


class PeakMemory:
    """Peak of torch.cuda.max_memory_allocated over a block, as the block's working set.

    ``working_set`` is the peak during the block minus what was allocated when it began, so
    tensors the harness keeps around for other purposes (full-sequence copies, references)
    are not charged to the implementation; callers add the bytes of the implementation's own
    inputs. None off CUDA.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.before: Optional[int] = None
        self.peak: Optional[int] = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)

    @property
    def working_set(self) -> Optional[int]:
        if self.before is None or self.peak is None:
            return None
        return max(self.peak - self.before, 0)


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def short_error(exc: BaseException, limit: int = 300) -> str:
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else ""
    text = f"{type(exc).__name__}: {first}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- metadata and results


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


def backend_label(transport: str, group=None) -> str:
    """What really moved the bytes: ringflash's "nccl" transport is the process group's own
    send/recv, i.e. gloo on a CPU run."""
    import torch.distributed as dist
    if transport == "nccl" and dist.is_available() and dist.is_initialized():
        return str(dist.get_backend(group))
    return transport


# ----------------------------------------------------------------------------- result names and places

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


def throughput_unit(device: torch.device, per: str = "") -> tuple[str, float]:
    """(label, factor) for printing a TFLOP/s figure: TFLOP/s on a GPU, GFLOP/s (x1000) on
    the CPU, where TFLOP/s would print as 0.0. ``per``: e.g. 'GPU', said as 'process' on
    the CPU."""
    if device.type == "cuda":
        return ("TFLOP/s" + (f" per {per}" if per else ""), 1.0)
    return ("GFLOP/s" + (" per process" if per else "") + " (CPU)", 1e3)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none (None, False) or the help
    already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


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


def write_results(name: str, meta: dict, records: list[dict], out_dir: Optional[os.PathLike] = None) -> Path:
    """Write {"meta": ..., "records": [...]} to <out_dir or benchmarks/results>/<name>.json
    (``results_dir`` decides out_dir for the scripts)."""
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
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


# ----------------------------------------------------------------------------- plots

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
    return ", ".join(parts)


def default_label(record: dict) -> str:
    """A line of the plot: the implementation, ringflash's layout, and the dropout rate where
    the records have one (p = 0 and p = 0.1 are two lines, not one)."""
    label = str(record.get("impl"))
    layout = record.get("layout")
    if label == "ringflash" and layout:
        label = f"{label} ({layout})"
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
    (configuration, forward / forward+backward)."""
    plt = import_pyplot()

    records = [r for r in data["records"] if isinstance(r, dict) and "seqlen" in r]
    meta = data.get("meta", {})
    metrics = _metric_keys(records)
    if not records or not metrics:
        raise ValueError("nothing to plot: no records with a seqlen and a *_tflops field")
    if panel_keys is None:
        panel_keys = [k for k in PANEL_KEYS if any(k in r for r in records)]
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
