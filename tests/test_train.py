"""launch/train.py under torchrun (2 gloo ranks) against plain attention in one process.

- The ring run's per-step losses, gradient norms and final parameters equal those of the
  same model trained in this process on full sequences with torch's own attention; so
  do those of a 2 x 2 grid of data and sequence parallelism (4 ranks).
- A run killed after step 5 and resumed from its step-4 checkpoint ends with the same
  parameters as the uninterrupted run (bitwise: same ranks, same reductions), and so
  does a resume in one process without torchrun (within fp32 rounding).
- With the newest checkpoint truncated, --resume falls back to the previous one, says so,
  and still ends with the uninterrupted run's parameters.
- SIGTERM to one worker only stops every rank after the same step with a checkpoint of
  it; SIGTERM to torchrun (which forwards it) does the same for the resumed run.

Each torchrun job runs in its own session and is killed as a whole on timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from oracle import rel_err as _rel
from ringflash.layer import RingSelfAttention

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "launch" / "train.py"
STEPS = 6
SMALL = ["--seqlen", "64", "--batch-size", "2", "--d-model", "32", "--layers", "2",
         "--heads", "4", "--kv-heads", "2", "--num-keys", "2", "--values-per-key", "4",
         "--queries", "4", "--noise-tokens", "8", "--steps", str(STEPS), "--warmup", "2",
         "--lr", "1e-3", "--grad-clip", "1.0", "--ckpt-every", "2", "--no-progress"]


def load_train_module():
    spec = importlib.util.spec_from_file_location("ringflash_launch_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def start_torchrun(args, nproc=2) -> subprocess.Popen:
    """launch/train.py under torchrun, in a session of its own, output piped (text)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--max-restarts=0", str(TRAIN), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def torchrun(args, nproc=2, timeout=90):
    """Run launch/train.py under torchrun; returns (returncode, output). Never hangs."""
    proc = start_torchrun(args, nproc)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the agent and its workers
        out, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


def _final_params(ckpt_dir):
    state = torch.load(Path(ckpt_dir) / f"step_{STEPS:08d}.pt", weights_only=False)
    return state["model"]


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory):
    """The uninterrupted run: 2 ranks, zigzag, checkpoints every 2 steps."""
    tmp = tmp_path_factory.mktemp("ring")
    rc, out = torchrun([*SMALL, "--ckpt-dir", str(tmp / "ckpt"), "--metrics-out",
                        str(tmp / "metrics.json")])
    assert rc == 0, out[-4000:]
    return json.loads((tmp / "metrics.json").read_text()), tmp / "ckpt"


def plain_attention(self, q, k, v, segment_ids=None, dropout_seed=None, block_mask=None):
    """torch's attention on the full sequence, K/V heads repeated for GQA, causal within
    each document of ``segment_ids`` (the training job passes no block mask)."""
    assert block_mask is None
    group = q.shape[2] // k.shape[2]
    n = q.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).tril() if self.causal else torch.ones(n, n, dtype=torch.bool)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        mask = mask[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(group, dim=2).transpose(1, 2),
        v.repeat_interleave(group, dim=2).transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def single_process_reference(train, argv):
    """The same model, data and optimizer, trained here on full sequences, plain attention."""
    args = train.parse_args(argv)
    task = train.Task.from_args(args)
    model = train.build_model(args, task)
    optimizer = train.make_optimizer(model, args)
    losses, grad_norms = [], []
    for step in range(1, args.steps + 1):
        tokens, labels = task.batch(step, range(args.batch_size))
        segments = task.segment_ids()
        segments = None if segments is None else segments.expand(args.batch_size, -1)
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(step, args)
        logits = model(tokens, segments)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=train.IGNORE)
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grad_norms, model.state_dict()


def test_metrics_file(ring_run):
    metrics, ckpt_dir = ring_run
    for key in ("world_size", "steps", "initial_loss", "final_loss", "tokens_per_s"):
        assert key in metrics, key
    assert metrics["world_size"] == 2 and metrics["steps"] == STEPS
    assert metrics["tokens_per_s"] > 0
    assert len(metrics["losses"]) == STEPS
    # Atomic writes leave no temporary files; only the newest two checkpoints are kept.
    assert sorted(os.listdir(ckpt_dir)) == ["step_00000004.pt", "step_00000006.pt"]


@pytest.fixture(scope="module")
def reference():
    """Losses, gradient norms, final and initial parameters of single-process training."""
    train = load_train_module()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RingSelfAttention, "_attend", plain_attention)
        losses, grad_norms, params = single_process_reference(train, SMALL)
    args = train.parse_args(SMALL)
    init = train.build_model(args, train.Task.from_args(args)).state_dict()
    return losses, grad_norms, params, init


def _assert_matches_reference(metrics, ckpt_dir, reference):
    losses, grad_norms, params, init = reference
    torch.testing.assert_close(metrics["losses"], losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(metrics["grad_norms"], grad_norms, rtol=1e-5, atol=0)
    # Parameters: relative Frobenius error per tensor. (Elementwise, Adam turns the
    # rounding noise of a near-zero gradient entry into a step of up to ~lr.)
    ring_params = _final_params(ckpt_dir)
    assert ring_params.keys() == params.keys()
    for name, p in params.items():
        assert _rel(ring_params[name], p) < 1e-5, name
        assert _rel(p, init[name]) > 1e-3, f"{name} hardly moved: the comparison would be vacuous"


def test_ring_training_matches_single_process(ring_run, reference):
    _assert_matches_reference(*ring_run, reference)


def test_data_x_sequence_parallel_grid_matches_single_process(reference, tmp_path):
    """4 ranks as 2 replicas x rings of 2 (--sp-size 2), on the layout computed from the
    documents (each of the two documents whole on one rank of a ring)."""
    rc, out = torchrun([*SMALL, "--sp-size", "2", "--layout", "documents", "--ckpt-dir",
                        str(tmp_path / "ckpt"), "--metrics-out", str(tmp_path / "m.json")],
                       nproc=4)
    assert rc == 0, out[-4000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert (metrics["world_size"], metrics["dp_size"], metrics["sp_size"]) == (4, 2, 2)
    _assert_matches_reference(metrics, tmp_path / "ckpt", reference)


def test_resume_after_crash_matches_uninterrupted(ring_run, tmp_path):
    metrics, ckpt_dir = ring_run
    crashed = tmp_path / "ckpt"
    rc, out = torchrun([*SMALL, "--ckpt-dir", str(crashed), "--crash-after-step", "5"])
    assert rc != 0, "the simulated crash should fail the torchrun job"
    assert sorted(os.listdir(crashed)) == ["step_00000002.pt", "step_00000004.pt"], out[-2000:]
    # A second copy of the interrupted state, resumed later in one process.
    single = tmp_path / "ckpt_single"
    single.mkdir()
    (single / "step_00000004.pt").write_bytes((crashed / "step_00000004.pt").read_bytes())

    rc, out = torchrun([*SMALL, "--ckpt-dir", str(crashed), "--resume", "--metrics-out",
                        str(tmp_path / "metrics.json")])
    assert rc == 0, out[-4000:]
    resumed = json.loads((tmp_path / "metrics.json").read_text())
    assert resumed["resumed_from_step"] == 4
    assert resumed["losses"] == metrics["losses"]  # steps 1-4 from the checkpoint, 5-6 recomputed
    want = _final_params(ckpt_dir)
    got = _final_params(crashed)
    for name in want:
        assert torch.equal(got[name], want[name]), name

    # The same checkpoint resumed at world size 1 (no torchrun): same run up to rounding.
    train = load_train_module()
    env_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    assert not any(k in os.environ for k in env_keys)
    one = train.run(train.parse_args([*SMALL, "--ckpt-dir", str(single), "--resume"]))
    assert one["world_size"] == 1 and one["resumed_from_step"] == 4
    got = _final_params(single)
    for name in want:
        assert _rel(got[name], want[name]) < 1e-5, name


def test_resume_refuses_a_different_run(ring_run, tmp_path):
    _, ckpt_dir = ring_run
    train = load_train_module()
    other = tmp_path / "ckpt"
    other.mkdir()
    (other / "step_00000004.pt").write_bytes((ckpt_dir / "step_00000004.pt").read_bytes())
    args = train.parse_args([*SMALL, "--ckpt-dir", str(other), "--resume", "--d-model", "48"])
    with pytest.raises(ValueError, match="different run"):
        train.run(args)


# ----------------------------------------------------------------------------- damaged checkpoints


def test_resume_falls_back_past_a_truncated_checkpoint(ring_run, tmp_path):
    """The newest checkpoint is cut in half (a write that never finished on a file system
    without atomic rename): every rank resumes from the one before, rank 0 says so, and
    the run ends where the uninterrupted one did."""
    metrics, ckpt_dir = ring_run
    damaged = tmp_path / "ckpt"
    damaged.mkdir()
    for name in ("step_00000004.pt", "step_00000006.pt"):
        (damaged / name).write_bytes((ckpt_dir / name).read_bytes())
    newest = damaged / "step_00000006.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

    rc, out = torchrun([*SMALL, "--ckpt-dir", str(damaged), "--resume", "--metrics-out",
                        str(tmp_path / "metrics.json")])
    assert rc == 0, out[-4000:]
    assert "step_00000006.pt does not load" in out and "resuming from step_00000004.pt" in out, out[-4000:]
    assert out.count("does not load") == 1, "only rank 0 decides and reports"
    resumed = json.loads((tmp_path / "metrics.json").read_text())
    assert resumed["resumed_from_step"] == 4 and resumed["losses"] == metrics["losses"]
    assert (damaged / "step_00000006.pt.corrupt").exists()  # kept for inspection, not counted
    want, got = _final_params(ckpt_dir), _final_params(damaged)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_resume_refuses_when_no_checkpoint_loads(tmp_path):
    train = load_train_module()
    (tmp_path / "step_00000002.pt").write_bytes(b"not a checkpoint")
    args = train.parse_args([*SMALL, "--ckpt-dir", str(tmp_path), "--resume"])
    with pytest.raises(train.CheckpointError, match="no checkpoint .* loads"):
        train.run(args)


# ----------------------------------------------------------------------------- preemption


class Output:
    """The lines of a running process, read by a thread, so the test can wait for one."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self._queue = proc, [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if text in line:
                return
        self.kill()
        pytest.fail(f"no line with {text!r}:\n{self.text[-4000:]}")

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {timeout} s after the signal:\n{self.text[-4000:]}")
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return self.proc.returncode, self.text

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @property
    def text(self) -> str:
        return "".join(self.lines)


def worker_pid(agent_pid: int, rank: int) -> int:
    """The pid of torchrun's worker of global rank ``rank`` (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if f"RANK={rank}".encode() in env:
            return int(stat.parent.name)
    raise AssertionError(f"no worker of rank {rank} under torchrun pid {agent_pid}")


def _step_of_stop(text: str) -> int:
    line = next(l for l in text.splitlines() if "stopped after step" in l)
    return int(line.split("stopped after step")[1].split()[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds torchrun's workers in /proc")
def test_sigterm_checkpoints_and_resume_continues(tmp_path):
    ckpt = tmp_path / "ckpt"
    endless = [*SMALL, "--steps", "100000", "--ckpt-every", "100000", "--log-every", "1",
               "--ckpt-dir", str(ckpt)]
    # 1. SIGTERM to rank 1 only: rank 0 learns of it through the step's all-reduce.
    run = Output(start_torchrun(endless))
    run.wait_for("step      3/")
    os.kill(worker_pid(run.proc.pid, rank=1), signal.SIGTERM)
    rc, out = run.finish()
    assert rc == 0, out[-4000:]
    assert "by a signal to another rank" in out, out[-4000:]
    first = _step_of_stop(out)
    assert sorted(os.listdir(ckpt)) == [f"step_{first:08d}.pt"], out[-4000:]
    saved = torch.load(ckpt / f"step_{first:08d}.pt", weights_only=True)
    assert saved["step"] == first and len(saved["history"]) == first

    # 2. Resume, then SIGTERM to torchrun itself, which forwards it to every worker.
    run = Output(start_torchrun([*endless, "--resume"]))
    run.wait_for(f"step {first + 2:>6}/")
    os.kill(run.proc.pid, signal.SIGTERM)
    rc, out = run.finish()
    assert f"resumed at step {first}" in out and "by SIGTERM" in out, out[-4000:]
    second = _step_of_stop(out)
    assert second > first
    resumed = torch.load(ckpt / f"step_{second:08d}.pt", weights_only=True)
    assert resumed["step"] == second
    assert resumed["history"][:first] == saved["history"]
    assert [h["step"] for h in resumed["history"]] == list(range(1, second + 1))
