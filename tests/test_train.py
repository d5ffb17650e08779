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
- --curriculum: its stages parse (bad ones raise ValueError naming the stage), a stage whose
  length the layout cannot split over the ring is refused before training, a curriculum run
  on 2 ranks equals the single-process one stage for stage and writes per-stage metrics and
  the evaluation at the final length, and --time-budget-s ends training early but still
  evaluates at the final length.
- --layout: packed documents get the layout computed from them by default (auto), one per
  curriculum length, a named layout wins; a two-length curriculum on it over 2 ranks, one
  document crossing ranks at each length, equals the single-process run.

Most runs pin --layout zigzag (SMALL), so that every document crosses ranks.

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

import ringflash
from oracle import rel_err as _rel
from ringflash.documents import DocumentLayout
from ringflash.layer import RingSelfAttention
from ringflash.layouts import global_positions

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "launch" / "train.py"
STEPS = 6
SMALL = ["--seqlen", "64", "--batch-size", "2", "--d-model", "32", "--layers", "2",
         "--heads", "4", "--kv-heads", "2", "--num-keys", "2", "--values-per-key", "4",
         "--queries", "4", "--noise-tokens", "8", "--steps", str(STEPS), "--warmup", "2",
         "--lr", "1e-3", "--grad-clip", "1.0", "--ckpt-every", "2", "--no-progress",
         "--layout", "zigzag"]


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


def _final_params(ckpt_dir, step=STEPS):
    state = torch.load(Path(ckpt_dir) / f"step_{step:08d}.pt", weights_only=False)
    return state["model"]


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory):
    """The uninterrupted run: 2 ranks, zigzag, checkpoints every 2 steps."""
    tmp = tmp_path_factory.mktemp("ring")
    rc, out = torchrun([*SMALL, "--ckpt-dir", str(tmp / "ckpt"), "--metrics-out",
                        str(tmp / "metrics.json")])
    assert rc == 0, out[-4000:]
    return json.loads((tmp / "metrics.json").read_text()), tmp / "ckpt"


def plain_attention(self, q, k, v, segment_ids=None, dropout_seed=None, block_mask=None, layout=None):
    """torch's attention on the full sequence, K/V heads repeated for GQA, causal within
    each document of ``segment_ids`` (the training job passes no block mask; one process
    holds every token in order, whatever the layout)."""
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
    """The same model, data and optimizer, trained here on full sequences, plain attention
    (each step at its --curriculum stage's length and batch size, if there is one)."""
    args = train.parse_args(argv)
    stages = train.stages_of(args)
    tasks = [train.Task.from_args(args, stage.seqlen) for stage in stages]
    model = train.build_model(args, tasks[-1])
    optimizer = train.make_optimizer(model, args)
    losses, grad_norms = [], []
    for step in range(1, args.steps + 1):
        i = train.stage_of_step(stages, step)
        task, batch_size = tasks[i], stages[i].batch_size
        tokens, labels = task.batch(step, range(batch_size))
        segments = task.segment_ids()
        segments = None if segments is None else segments.expand(batch_size, -1)
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
    documents over each ring's subgroup (each of the two documents whole on one rank of a
    ring)."""
    rc, out = torchrun([*SMALL, "--sp-size", "2", "--layout", "documents", "--ckpt-dir",
                        str(tmp_path / "ckpt"), "--metrics-out", str(tmp_path / "m.json")],
                       nproc=4)
    assert rc == 0, out[-4000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert (metrics["world_size"], metrics["dp_size"], metrics["sp_size"]) == (4, 2, 2)
    _assert_matches_reference(metrics, tmp_path / "ckpt", reference)


def test_data_parallel_alone_matches_single_process(reference, tmp_path):
    """2 ranks as 2 replicas of rings of one (--sp-size 1): each rank attends over its own
    sequences only. (The world was taken for the ring here once: a ring over both
    replicas' different sequences, losses off from the first step.)"""
    rc, out = torchrun([*SMALL, "--sp-size", "1", "--ckpt-dir", str(tmp_path / "ckpt"), "--metrics-out",
                        str(tmp_path / "m.json")], nproc=2)
    assert rc == 0, out[-4000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert (metrics["world_size"], metrics["dp_size"], metrics["sp_size"]) == (2, 2, 1)
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


# ----------------------------------------------------------------------------- length curriculum


def without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` less each of ``flags`` and the value after it."""
    out, skip = [], False
    for arg in argv:
        if not skip and arg not in flags:
            out.append(arg)
        skip = not skip and arg in flags
    return out


# SMALL's model and task over 8 steps: 4 of 4 x 32 tokens, then 4 of 2 x 64.
CURRICULUM = ["--curriculum", "4x32:4,2x64:4", "--eval-steps", "2",
              *without(SMALL, "--seqlen", "--batch-size", "--steps")]


def test_parse_curriculum():
    train = load_train_module()
    Stage = train.Stage
    assert train.parse_curriculum("16x8k:400, 4x32K:150,1x128k:300") == [
        Stage(16, 8192, 400), Stage(4, 32768, 150), Stage(1, 131072, 300)]
    assert train.parse_curriculum("4096:10,8x1024:5", batch_size=3) == [Stage(3, 4096, 10),
                                                                          Stage(8, 1024, 5)]
    args = train.parse_args(["--curriculum", "16x8k:400,1x128k:300"])
    # The final stage stands in for --seqlen and --batch-size, the sum for --steps; the
    # canonical form is what a checkpoint compares.
    assert (args.seqlen, args.batch_size, args.steps) == (131072, 1, 700)
    assert args.curriculum == "16x8192:400,1x131072:300"
    assert train.stages_of(args) == [Stage(16, 8192, 400), Stage(1, 131072, 300)]
    assert [train.stage_of_step(train.stages_of(args), s) for s in (1, 400, 401, 700)] == [0, 0, 1, 1]
    plain = train.parse_args([])
    assert (plain.seqlen, plain.batch_size, plain.steps, plain.curriculum) == (512, 8, 150, None)
    assert train.stages_of(plain) == [Stage(8, 512, 150)]


@pytest.mark.parametrize("text, stage", [
    ("", 1), ("8k", 1), ("8x8k", 1), ("0x8k:5", 1), ("8x0:5", 1), ("4x1k:5,8x8k:0", 2),
    ("4x1k:5,8x8m:5", 2), ("4x1k:5,,1x2k:5", 2), ("-1x1k:5", 1), ("4x1.5k:5", 1)])
def test_bad_curriculum(text, stage):
    train = load_train_module()
    with pytest.raises(ValueError, match=f"--curriculum stage {stage} "):
        train.parse_curriculum(text)
    with pytest.raises(SystemExit):
        train.parse_args(["--curriculum", text])


@pytest.mark.parametrize("argv", [
    ["--curriculum", "4x1k:5", "--seqlen", "1024"],       # the stages give the length
    ["--curriculum", "4x1k:5", "--steps", "5"],           # and the steps
    ["--facts-end", "0.6", "--queries-start", "0.5"],     # facts after queries
    ["--facts-end", "0"], ["--queries-start", "1"], ["--eval-steps", "-1"]])
def test_bad_task_or_schedule_arguments(argv):
    with pytest.raises(SystemExit):
        load_train_module().parse_args(argv)


def test_task_regions_and_scaled_counts():
    train = load_train_module()
    args = train.parse_args(["--curriculum", "2x256:1,1x1024:1", "--documents", "1",
                             "--queries", "64", "--fact-copies", "16", "--facts-end", "0.25",
                             "--queries-start", "0.75"])
    short, final = (train.Task.from_args(args, n) for n in (256, 1024))
    assert (short.queries, short.fact_copies) == (16, 4)       # as dense as at the final length
    assert (final.queries, final.fact_copies) == (64, 16)
    assert final.min_answer_distance == 1024 // 2 + 1          # > a rank's 512 tokens over 2
    tokens, labels = final.batch(1, range(3))
    asked = labels != train.IGNORE
    assert asked.sum() == 3 * 64 and not asked[:, :768].any()  # queries in the last quarter
    facts = tokens >= final.value_base
    assert facts.sum() == 3 * 2 * 16 and not facts[:, 256:].any()  # 2 keys, in the first
    # Every answer is a fact of the same sequence, written only in the first quarter.
    for row in range(3):
        assert set(labels[row][asked[row]].tolist()) <= set(tokens[row][facts[row]].tolist())


def test_stage_the_layout_cannot_split_is_refused():
    """Checked for every stage before the model is built, naming the stage."""
    train = load_train_module()
    args = train.parse_args([*CURRICULUM, "--curriculum", "2x128:1,2x100:1", "--layout", "block_stripe"])
    with pytest.raises(ValueError, match=r"--curriculum stage 2 \(2x100:1\): .*multiple of 128"):
        train.run(args)
    args = train.parse_args([*CURRICULUM, "--curriculum", "2x16:1,2x64:1", "--fact-copies", "16"])
    with pytest.raises(ValueError, match=r"--curriculum stage 1 \(2x16:1\): documents of 8 tokens are too short"):
        train.run(args)


def test_packed_documents_get_their_layout_by_default():
    """--layout auto (the default) is "documents" when --documents packs several a sequence,
    zigzag for one; a named layout wins. With a curriculum, every length gets the layout
    of its own documents (one SequenceParallel per stage carries it to data and attention)."""
    train = load_train_module()
    layout_of = lambda *argv: train.parse_args(list(argv)).layout  # noqa: E731
    assert layout_of() == "documents"  # --documents 2 by default
    assert layout_of("--documents", "1") == "zigzag"
    assert layout_of("--layout", "block_stripe") == "block_stripe"
    assert layout_of("--layout", "zigzag", "--documents", "4") == "zigzag"
    assert layout_of("--layout", "documents", "--documents", "1") == "documents"
    assert layout_of("--layout", "auto", "--documents", "3") == "documents"
    with pytest.raises(SystemExit):
        train.parse_args(["--layout", "diagonal"])

    args = train.parse_args(without(CURRICULUM, "--layout"))
    stages = train.stages_of(args)
    tasks, parallels = train.check_stages(args, stages, train.Dist())
    assert [sp.layout.seqlen for sp in parallels] == [32, 64]
    for task, sp in zip(tasks, parallels):
        assert isinstance(sp.layout, DocumentLayout), sp
        assert sp.layout.bounds.tolist() == [0, task.seqlen // 2, task.seqlen]
        assert torch.equal(sp.positions(task.seqlen), torch.arange(task.seqlen))  # one rank
    one = train.parse_args([*without(CURRICULUM, "--layout"), "--documents", "1"])
    _, parallels = train.check_stages(one, train.stages_of(one), train.Dist())
    assert [sp.layout for sp in parallels] == ["zigzag", "zigzag"]
    named = train.parse_args([*CURRICULUM, "--layout", "stripe"])
    _, parallels = train.check_stages(named, train.stages_of(named), train.Dist())
    assert [sp.layout for sp in parallels] == ["stripe", "stripe"]


def test_stage_the_ring_cannot_split_is_refused():
    """34 tokens split in zigzag over one rank, not over a ring of two (4 chunks): every
    rank refuses before training, with the stage named."""
    rc, out = torchrun([*CURRICULUM, "--curriculum", "2x34:1,2x64:1"])
    assert rc != 0
    assert "--curriculum stage 1 (2x34:1)" in out and "step " not in out, out[-4000:]


def test_curriculum_run_matches_single_process_and_writes_stages(tmp_path):
    rc, out = torchrun([*CURRICULUM, "--documents", "1", "--metrics-out", str(tmp_path / "m.json")])
    assert rc == 0, out[-4000:]
    assert "stage 2/2: 2 x 64 tokens/step, steps 5-8" in out, out[-4000:]
    m = json.loads((tmp_path / "m.json").read_text())
    assert (m["steps"], m["seqlen"], m["batch_size"], m["curriculum"]) == (8, 64, 2, "4x32:4,2x64:4")
    assert m["seqlens"] == [32] * 4 + [64] * 4 and len(m["step_seconds"]) == 8
    assert [(s["batch_size"], s["seqlen"], s["steps"], s["first_step"], s["steps_run"])
            for s in m["stages"]] == [(4, 32, 4, 1, 4), (2, 64, 4, 5, 4)]
    assert [(s["queries"], s["fact_copies"]) for s in m["stages"]] == [(2, 4), (4, 8)]
    assert all(s["tokens_per_s"] > 0 for s in m["stages"]) and m["tokens_per_s"] == m["stages"][1]["tokens_per_s"]
    ev = m["eval"]
    assert (ev["seqlen"], ev["batch_size"], ev["steps"], ev["scored"]) == (64, 2, 2, 2 * 2 * 4)
    assert m["final_accuracy"] == ev["accuracy"] and not m["stopped_by_time_budget"]
    # It trains: the two ranks' losses are those of one process on whole sequences, stage
    # for stage, and they fall.
    train = load_train_module()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RingSelfAttention, "_attend", plain_attention)
        losses, grad_norms, _ = single_process_reference(train, [*CURRICULUM, "--documents", "1"])
    torch.testing.assert_close(m["losses"], losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(m["grad_norms"], grad_norms, rtol=1e-5, atol=0)
    assert max(m["losses"][-2:]) < m["losses"][0]


# Three documents a sequence over 2 ranks: too even to keep whole on a rank each, so the
# layout computed from them splits each over both ranks (attention crosses ranks) without
# being zigzag's split of the whole sequence.
DOCUMENTS_CURRICULUM = [*without(CURRICULUM, "--layout", "--curriculum"), "--curriculum",
                        "4x48:4,2x96:4", "--documents", "3"]


def test_curriculum_on_the_document_layout_matches_single_process(tmp_path):
    """No --layout: the default for packed documents, one layout per length (48 and 96
    tokens), over 2 ranks; losses, gradient norms and final parameters equal those of one
    process on whole sequences, and the evaluation at the final length runs on it too."""
    train = load_train_module()
    args = train.parse_args(DOCUMENTS_CURRICULUM)
    for stage in train.stages_of(args):  # the premise: documents cross ranks, not as zigzag
        task = train.Task.from_args(args, stage.seqlen)
        planned = ringflash.document_layout(task.cu_seqlens(), stage.seqlen, world=2)
        assert planned.shared, planned
        assert not torch.equal(planned.positions(stage.seqlen, 0, 2),
                               global_positions(stage.seqlen, "zigzag", 0, 2))

    rc, out = torchrun([*DOCUMENTS_CURRICULUM, "--ckpt-dir", str(tmp_path / "ckpt"),
                        "--metrics-out", str(tmp_path / "m.json")])
    assert rc == 0, out[-4000:]
    assert "(24 tokens of a sequence per rank, layout documents)" in out, out[-4000:]
    assert "(48 tokens of a sequence per rank, layout documents)" in out, out[-4000:]
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["layout"] == "documents" and [s["layout"] for s in m["stages"]] == ["documents"] * 2
    assert m["seqlens"] == [48] * 4 + [96] * 4 and m["eval"]["seqlen"] == 96
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RingSelfAttention, "_attend", plain_attention)
        losses, grad_norms, params = single_process_reference(train, DOCUMENTS_CURRICULUM)
    torch.testing.assert_close(m["losses"], losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(m["grad_norms"], grad_norms, rtol=1e-5, atol=0)
    ring_params = _final_params(tmp_path / "ckpt", step=8)
    init = train.build_model(args, train.Task.from_args(args)).state_dict()
    for name, p in params.items():
        assert _rel(ring_params[name], p) < 1e-5, name
        assert _rel(p, init[name]) > 1e-3, f"{name} hardly moved: the comparison would be vacuous"


def test_time_budget_stops_training_and_still_evaluates_at_the_final_length(tmp_path, monkeypatch):
    train = load_train_module()
    monkeypatch.setattr(train, "START", train.START - 1e6)  # the budget is long spent
    args = train.parse_args([*CURRICULUM, "--time-budget-s", "60", "--ckpt-dir", str(tmp_path)])
    m = train.run(args)
    assert m["stopped_by_time_budget"] and m["steps"] == 1 and m["seqlens"] == [32]
    assert [s["steps_run"] for s in m["stages"]] == [1, 0] and m["tokens_per_s"] is None
    assert (m["eval"]["seqlen"], m["eval"]["batch_size"]) == (64, 2)
    assert m["final_accuracy"] == m["eval"]["accuracy"]
    assert os.listdir(tmp_path) == ["step_00000001.pt"]
    # A job with more time resumes there and runs the rest of the curriculum.
    rest = train.run(train.parse_args([*CURRICULUM, "--ckpt-dir", str(tmp_path), "--resume"]))
    assert rest["resumed_from_step"] == 1 and not rest["stopped_by_time_budget"]
    assert rest["seqlens"] == [32] * 4 + [64] * 4 and rest["losses"][0] == m["losses"][0]
    assert [s["steps_run"] for s in rest["stages"]] == [4, 4] and rest["tokens_per_s"] > 0
