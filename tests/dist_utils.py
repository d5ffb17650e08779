"""Run test functions in a world of W spawned gloo processes: never a hang, every traceback.

    with World(3) as world:
        per_rank = world.run(fn, arg1, arg2)   # fn(rank, world_size, arg1, arg2) on every rank

A ``World`` spawns its W processes once (a free TCP port on 127.0.0.1, gloo, one CPU
thread each) and then runs any number of tasks in them, so a test module pays the few
seconds of start-up once per world size rather than once per case. ``fn`` must be a
module-level function (it is pickled by name) and its return value picklable.

The processes are started by multiprocessing's fork server where the platform has one,
with torch imported there once (``set_forkserver_preload``): every rank is still a fresh
process of its own, not a fork of pytest's, but a world of 4 no longer waits for four
imports of torch on a 2-core machine (seconds each); elsewhere they are spawned.

Failures: if any rank raises, ``run`` raises ``DistributedError`` with that rank's
traceback (and those of the ranks that failed within a short grace period after it);
a rank that dies (segfault, os._exit) or a task that outlives its timeout (a hung
collective) ends the same way. The world is then killed, since its surviving ranks may
be stuck in a collective; the next ``run`` starts a fresh one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta

# A rank that fails first lets the others this long to report their own failure.
_GRACE_S = 3.0


class DistributedError(AssertionError):
    """A task failed on at least one rank (an AssertionError, so pytest shows it as a failure)."""


def raised(fn) -> tuple[str, str] | None:
    """(exception type name, message) of what ``fn()`` raised, None if nothing: for a check
    run on every rank of a world, whose verdicts are compared after it returns."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        return type(e).__name__, str(e)
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, tasks, results, collective_timeout_s: float):
    """Body of one spawned rank: join the gloo world, then run tasks until told to stop."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if os.environ.get("TRITON_INTERPRET") == "1":
            import fast_interpreter
            fast_interpreter.install()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
    except BaseException:
        results.put((rank, 0, False, traceback.format_exc()))
        return
    results.put((rank, 0, True, None))  # ready
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            value = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            results.put((rank, task_id, False, traceback.format_exc()))
        else:
            try:
                results.put((rank, task_id, True, value))
            except BaseException:  # unpicklable value
                results.put((rank, task_id, False, traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except BaseException:
        pass
    # Leave without finalizing the interpreter, as the fork server's children always do
    # (spawned ones would not): a gloo worker thread still freeing a finished collective's
    # tensors then takes the GIL from a finalizing interpreter, which aborts the process
    # ("terminate called without an active exception"), and destroy_process_group does
    # not stop those threads while a task's objects still hold a group.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_context():
    """The fork server with torch imported (see the module's docstring), else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


class World:
    """W spawned processes in one gloo process group, running tasks on demand."""

    def __init__(self, world_size: int, *, start_timeout_s: float = 90.0,
                 collective_timeout_s: float = 60.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.start_timeout_s = start_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self._ctx = _start_context()
        self._procs: list = []
        self._tasks: list = []
        self._results = None
        self._task_id = 0

    # -- life cycle

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        """Spawn the ranks and wait until every one has joined the process group."""
        last_error = None
        for _attempt in range(2):  # a second try covers the port being taken meanwhile
            self._spawn(free_port())
            try:
                self._collect(0, self.start_timeout_s, what="joining the gloo process group")
                return
            except DistributedError as e:
                last_error = e
        raise last_error

    def _spawn(self, port: int) -> None:
        self.close()
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(target=_worker_main, name=f"ringflash-test-rank{rank}", daemon=True,
                              args=(rank, self.world_size, port, self._tasks[rank], self._results,
                                    self.collective_timeout_s))
            for rank in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._task_id = 0

    def close(self) -> None:
        """Ask the ranks to leave; kill any that have not within a couple of seconds."""
        if not self._procs:
            return
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5.0)
        for q in [*self._tasks, self._results]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._procs, self._tasks, self._results = [], [], None

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- tasks

    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        """``fn(rank, world_size, *args, **kwargs)`` on every rank; their return values by rank."""
        if not self.alive:
            self.start()
        self._task_id += 1
        for q in self._tasks:
            q.put((self._task_id, fn, args, kwargs))
        name = getattr(fn, "__qualname__", repr(fn))
        return self._collect(self._task_id, timeout, what=f"running {name}")

    def _collect(self, task_id: int, timeout: float, *, what: str) -> list:
        values: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        first_error_at = None
        while len(values) + len(errors) < self.world_size:
            now = time.monotonic()
            if first_error_at is not None and now > first_error_at + _GRACE_S:
                break
            if now > deadline:
                for rank in range(self.world_size):
                    if rank not in values and rank not in errors:
                        errors[rank] = (f"no answer after {timeout:.0f} s while {what} "
                                        "(hung collective?); killed")
                break
            try:
                rank, tid, ok, value = self._results.get(timeout=0.1)
            except queue.Empty:
                for rank, p in enumerate(self._procs):
                    if rank not in values and rank not in errors and not p.is_alive():
                        errors[rank] = f"process died with exit code {p.exitcode} while {what}"
                        first_error_at = first_error_at or time.monotonic()
                continue
            if tid != task_id:
                continue  # a late answer to an earlier task
            if ok:
                values[rank] = value
            else:
                errors[rank] = value
                first_error_at = first_error_at or time.monotonic()
        if errors:
            self._kill()
            for rank in range(self.world_size):
                if rank not in values and rank not in errors:
                    errors[rank] = "killed after another rank failed (no answer of its own)"
            report = "\n".join(f"---- rank {rank} of {self.world_size} ----\n{errors[rank]}"
                               for rank in sorted(errors))
            raise DistributedError(f"{what} failed on rank(s) "
                                   f"{sorted(r for r in errors if 'killed after' not in errors[r])}"
                                   f" of a world of {self.world_size}:\n{report}")
        return [values[rank] for rank in range(self.world_size)]


class Worlds:
    """``worlds(W)``: a live World of W ranks, reusing the last one when W is the same.

    Keeps one world at a time (a world of 4 is 4 processes with torch loaded), so tests
    should be ordered by world size to spawn each size once.
    """

    def __init__(self, **world_kwargs):
        self._kwargs = world_kwargs
        self._world: World | None = None

    def __call__(self, world_size: int) -> World:
        if self._world is None or self._world.world_size != world_size:
            self.close()
            self._world = World(world_size, **self._kwargs)
        return self._world

    def close(self) -> None:
        if self._world is not None:
            self._world.close()
            self._world = None



def run_command(cmd, cwd, timeout: float = 120, **env_changes) -> tuple[int, str]:
    """(returncode, stdout+stderr) of ``cmd`` run in its own process session on the CPU
    (one thread, gloo on loopback, no torchrun variables inherited); ``env_changes`` set or
    (with None) remove variables. On timeout the whole session is killed and the test fails."""
    import signal
    import subprocess

    import pytest

    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} timed out after {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out
