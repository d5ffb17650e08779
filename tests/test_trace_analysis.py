"""The --profile breakdown of bench_ring and bench_blocksparse (benchmarks/harness/traces.py)
on small hand-made chrome traces: what counts as communication, and how much of it no
compute hid; and profile_call tracing a step on the CPU.

Times in the traces are microseconds, as Kineto writes them; the breakdown is in ms.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    from harness import traces as T
finally:
    sys.path.pop(0)

COMPUTE, NCCL, COPY = 7, 20, 30  # stream ids: the compute stream, NCCL's, the copy ring's
SYMM_BARRIER = "c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)"


def gpu(name: str, cat: str, stream: int, start: float, end: float, **args) -> dict:
    """A GPU event as Kineto exports it: pid the device, tid the stream."""
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": start, "dur": end - start,
            "args": {"stream": stream, **args}}


def annotation(name: str, start: float, end: float) -> dict:
    return {"ph": "X", "cat": "gpu_user_annotation", "name": name, "pid": 0, "tid": COMPUTE,
            "ts": start, "dur": end - start}


def ring_trace() -> dict:
    """Forward 0-100 us, backward 100-150 us: attention 0-100 on the compute stream; an NCCL
    kernel 90-120; a copy from GPU 1 60-130, hidden by the attention until 100; a copy
    within GPU 0 140-150 on the compute stream, which is no communication."""
    return {"traceEvents": [
        gpu("_fwd_kernel", "kernel", COMPUTE, 0, 100, device=0),
        gpu("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "kernel", NCCL, 90, 120, device=0),
        gpu("Memcpy PtoP (Device -> Device)", "gpu_memcpy", COPY, 60, 130,
            fromDevice=1, inDevice=0, toDevice=0, bytes=1 << 20),
        gpu("Memcpy DtoD (Device -> Device)", "gpu_memcpy", COMPUTE, 140, 150, device=0, bytes=1 << 20),
        annotation("ringflash.fwd", 0, 100),
        annotation("ringflash.bwd", 100, 150),
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 1, "tid": 1, "ts": 0, "dur": 500},
        {"ph": "X", "cat": "user_annotation", "name": "ringflash.fwd", "pid": 1, "tid": 1, "ts": -30, "dur": 40},
    ]}


def approx(d: dict) -> dict:
    return {k: pytest.approx(v, abs=1e-9) for k, v in d.items()}


def test_peer_copies_are_communication_local_copies_are_not():
    got = T.trace_breakdown(ring_trace(), wall_ms=0.2)
    step = {k: got["step"][k] for k in ("attention", "merge", "other", "comm", "exposed_comm",
                                        "gpu_busy", "gpu_span", "wall", "idle")}
    # comm: NCCL 30 us + peer copy 70 us; exposed: 100-130 us, when only they run;
    # busy: 0-130 and 140-150.
    assert step == approx({"attention": 0.1, "merge": 0.0, "other": 0.01, "comm": 0.1,
                           "exposed_comm": 0.03, "gpu_busy": 0.14, "gpu_span": 0.15, "wall": 0.2,
                           "idle": 0.06})
    # idle 60 us: 10 between the GPU's operations (130-140), 30 before its first (the host
    # began the forward at -30), the rest after its last
    assert got["step"]["gaps"] == pytest.approx(0.01) and got["step"]["lead"] == pytest.approx(0.03)


def test_phases_clip_the_events_to_their_windows():
    got = T.trace_breakdown(ring_trace())
    fwd = {k: got["ringflash.fwd"][k] for k in ("attention", "other", "comm", "exposed_comm", "wall")}
    bwd = {k: got["ringflash.bwd"][k] for k in ("attention", "other", "comm", "exposed_comm", "wall")}
    assert fwd == approx({"attention": 0.1, "other": 0.0, "comm": 0.05, "exposed_comm": 0.0, "wall": 0.1})
    assert bwd == approx({"attention": 0.0, "other": 0.01, "comm": 0.05, "exposed_comm": 0.03, "wall": 0.05})
    assert got["step"]["wall"] is None and got["step"]["idle"] is None


def test_copy_ring_barrier_and_copies_on_its_stream_are_communication():
    """torch's symmetric memory barrier kernel is the copy ring's handshake; a copy that
    CUPTI calls DtoD counts as communication when a communication kernel shares its stream."""
    trace = {"traceEvents": [
        gpu("_dkdv_kernel", "kernel", COMPUTE, 0, 100, device=0),
        gpu(SYMM_BARRIER, "kernel", COPY, 10, 20, device=0),
        gpu("Memcpy DtoD (Device -> Device)", "gpu_memcpy", COPY, 20, 120, device=0),
        gpu("Memcpy DtoD (Device -> Device)", "gpu_memcpy", COMPUTE, 130, 140, device=0),
        gpu("Memset (Device)", "gpu_memset", COMPUTE, 140, 145, device=0),
    ]}
    step = T.trace_breakdown(trace)["step"]
    assert {k: step[k] for k in ("attention", "other", "comm", "exposed_comm")} == approx(
        {"attention": 0.1, "other": 0.015, "comm": 0.11, "exposed_comm": 0.02})


@pytest.mark.parametrize("name, cls", [
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "comm"),
    (SYMM_BARRIER, "comm"),
    ("Memcpy PtoP (Device -> Device)", "comm"),
    ("Memcpy DtoD (Device -> Device)", "other"),
    ("_attn_fwd_merge_kernel", "merge"),
    ("_dq_kernel", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
], ids=["nccl", "symm-mem-barrier", "memcpy-ptop", "memcpy-dtod", "merge", "attention", "fill"])
def test_names_alone(name, cls):
    """What key_averages sees: names only, no streams or devices."""
    assert T.classify_name(name) == cls


def test_report_says_what_comm_counts():
    info = {"rank": 0, "trace": T.trace_breakdown(ring_trace(), wall_ms=0.2)}
    report = T.profile_report([info])
    assert "comm ms" in report and "peer copies" in report
    assert report.splitlines()[3].split()[7] == "0.03"  # the step row's exposed comm


def test_profile_call_traces_the_step_it_is_given(tmp_path, capsys):
    """profile_call on the CPU, no process group, of the forward+backward step the benchmarks
    trace (fwd_bwd_step): warm-up calls untraced, then one traced call whose phases and ops
    are in the written trace, and a report on stdout."""
    import torch

    calls = []

    def attention(q, k, v):
        calls.append(1)
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v

    q, k, v, dout = (torch.ones(64, 64) for _ in range(4))
    path = tmp_path / "one.json"
    T.profile_call(T.fwd_bwd_step(attention, (q, k, v), dout), device=torch.device("cpu"), group=None,
                   path=str(path), title="a matmul", warmup=2)
    assert len(calls) == 3
    names = {e.get("name") for e in T.load_trace(str(path))["traceEvents"]}
    assert {"ringflash.fwd", "ringflash.bwd", "aten::matmul"} <= names
    out = capsys.readouterr().out
    assert "== profile: a matmul ==" in out and "exposed comm ms" in out and str(path) in out
