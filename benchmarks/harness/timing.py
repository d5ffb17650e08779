"""Timing: FLOPs and TFLOP/s, the timer, forward and forward+backward of one implementation,
peak memory, and the reductions over ranks that make a ring's time its slowest rank's.

Every script times its implementations side by side in one run, on random inputs, with the
same timer (``bench_ms``): a first untimed call (JIT compilation, communicators), warm-up,
then CUDA events around each repetition with the L2 cache flushed in between, and the
median of the repetitions. Under a process group every rank runs the same number of
repetitions and the reported time is the maximum over ranks of the per-rank medians: a ring
is as slow as its slowest rank.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable, Optional, Sequence

import torch

from .checks import short_error

GIB = 1024 ** 3
L2_FLUSH_BYTES = 256 * 1024 * 1024  # several times the 50-60 MB L2 of an H100/H200


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


def throughput_unit(device: torch.device, per: str = "") -> tuple[str, float]:
    """(label, factor) for printing a TFLOP/s figure: TFLOP/s on a GPU, GFLOP/s (x1000) on
    the CPU, where TFLOP/s would print as 0.0. ``per``: e.g. 'GPU', said as 'process' on
    the CPU."""
    if device.type == "cuda":
        return ("TFLOP/s" + (f" per {per}" if per else ""), 1.0)
    return ("GFLOP/s" + (" per process" if per else "") + " (CPU)", 1e3)


# ----------------------------------------------------------------------------- over ranks


def dist_active(group) -> bool:
    return group is not None and torch.distributed.is_available() and torch.distributed.is_initialized()


def barrier(group=None) -> None:
    if dist_active(group):
        torch.distributed.barrier(group=group)


def allreduce_max(value: float, group, device: torch.device) -> float:
    if not dist_active(group):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return float(t.item())


def allreduce_sum(values: Sequence[float], group, device: torch.device) -> list[float]:
    if not dist_active(group):
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
    return [float(x) for x in t.tolist()]


def all_ranks_ok(ok: bool, group, device: torch.device) -> bool:
    """True only if ``ok`` is True on every rank (so all ranks take the same branch)."""
    if not dist_active(group):
        return ok
    return allreduce_max(0.0 if ok else 1.0, group, device) == 0.0


# ----------------------------------------------------------------------------- the timer

_l2_buffer: dict = {}


def init_l2_flush(device: torch.device) -> None:
    """Allocate the L2-flush buffer now, so it is not counted in anyone's peak memory."""
    if device.type == "cuda" and device not in _l2_buffer:
        _l2_buffer[device] = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)


def _flush_l2(device: torch.device) -> None:
    if device.type == "cuda":
        init_l2_flush(device)
        _l2_buffer[device].zero_()


def sync(device: torch.device) -> None:
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
        sync(device)
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
    sync(device)

    barrier(group)
    sync(device)
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
        sync(device)
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
    sync(device)
    barrier(group)
    sync(device)

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
        sync(device)
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


def timed(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device: torch.device,
          args: argparse.Namespace, group=None) -> tuple[float, float]:
    """(fwd ms, fwd+bwd ms) of out = fn(q, k, v) on the leaves q, k, v, the forward with
    autograd recording as in training, fwd+bwd against a random output gradient; the
    script's ``--rep-ms``, and GPU time with the host ahead where it has ``--host-ahead``
    and it is given (``bench_ms``). bench_masks, bench_dropout and bench_blocksparse time
    every implementation this way."""
    dout = torch.randn_like(q)
    opts = dict(device=device, rep_ms=args.rep_ms, group=group,
                host_ahead=getattr(args, "host_ahead", False))
    fwd = bench_ms(lambda: fn(q, k, v), **opts)
    fwdbwd = bench_ms(lambda: fn(q, k, v).backward(dout), grad_to_none=(q, k, v), **opts)
    return fwd, fwdbwd


# ----------------------------------------------------------------------------- memory


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
