"""Run a multi-GPU test file as several torchrun worlds at once on the same GPUs.

From a cold Triton cache the GPU tests are compile-bound: every rank compiles each kernel
variant its tests use, one after another. On 4 H200s (2026-11-27) the first 17 tests of
tests/test_ring_gpu.py made 282 compiles, 375 s of their 480 s, on 4 of the host's 64 cores.
Several worlds compile different variants at once and share one Triton cache, and the tests
are small enough to share the GPUs. The worlds take the tests from one queue in file order,
a test at a time, so a run lasts about as long as the share of its slowest world.

    python tests/run_gpu.py --nproc 4 tests/test_ring_gpu.py
    python tests/run_gpu.py --nproc 2 --worlds 3 tests/test_ring_gpu.py -- -x -k oracle

Each world writes its output to <logs>/world<i>.log; the launcher prints each world's
pytest summaries (one a rank), the whole log of a world that failed, and the wall time.
Exit status 0 when every world passed. ``--deadline S``: no test is claimed S seconds
after the launch (a world has claimed its next test while it runs one, so it may start
one more); the worlds finish and report as usual, and the launcher says how many were
claimed. Stopped (SIGTERM, as from an outer ``timeout``, or SIGINT), the launcher stops
the worlds and still reports: each world's summaries so far (none where pytest had not
finished), the test it was running, and the end of its log. Cold, on 4 H200s
(2026-11-27): test_ring_gpu.py in 222 s at --nproc 4 and 176 s at --nproc 2 (as one world
it did not finish in 530 s); on 2026-11-28 with tests/test_heads_gpu.py, 44 tests in
about 350 s at --nproc 4.

The same file is the pytest plugin the launcher loads (``-p run_gpu``): while
RINGFLASH_TEST_QUEUE names the queue's folder it replaces pytest's test loop. Rank 0 of each
world claims the next test's index under a file lock and hands it to its world's other ranks
through a file, so the ranks of a world run the same tests in the same order, as the tests'
collectives need.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

QUEUE = "RINGFLASH_TEST_QUEUE"  # the queue's folder
WORLD = "RINGFLASH_TEST_WORLD"  # which world this process belongs to
DEADLINE = "RINGFLASH_TEST_DEADLINE"  # time.time() after which no test starts (unset: none)
STOP = sys.maxsize  # the index claim returns past the deadline: beyond every test
SUMMARY = re.compile(r"\d+ (passed|failed|errors?|skipped)|no tests ran")  # a rank's last line
WAIT_S = 3600.0  # a rank waits this long for its rank 0's next index, then fails
RUNNING = "running"  # the file naming the test a world runs (in its folder of the queue)
STOP_WAIT_S = 10.0  # a stopped launcher waits this long for each world to end, then kills it
LOG_LINES = 40  # of a world's log, the last lines a stopped launcher prints


def claim(folder: str, deadline: float | None = None) -> int:
    """The next test index of the queue in ``folder`` (0, 1, 2, ... over all worlds), or
    ``STOP`` once time.time() is past ``deadline`` (None: the environment's ``DEADLINE``)."""
    if deadline is None and os.environ.get(DEADLINE):
        deadline = float(os.environ[DEADLINE])
    if deadline is not None and time.time() > deadline:
        return STOP
    with open(os.path.join(folder, "next"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        text = f.read().strip()
        index = int(text) if text else 0
        f.seek(0)
        f.truncate()
        f.write(str(index + 1))
    return index


def indices(folder: str, world: int, rank: int) -> Iterator[int]:
    """The test indices world ``world`` runs, in order, the same on each of its ranks: rank 0
    claims them and writes the n-th to <folder>/world<world>/<n>, where the others read it."""
    mine = os.path.join(folder, f"world{world}")
    os.makedirs(mine, exist_ok=True)
    for n in itertools.count():
        path = os.path.join(mine, str(n))
        if rank == 0:
            index = claim(folder)
            with open(path + ".tmp", "w") as f:
                f.write(str(index))
            os.replace(path + ".tmp", path)  # readers never see a half-written file
        else:
            deadline = time.monotonic() + WAIT_S
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"world {world} rank {rank}: no test index from rank 0 "
                                       f"in {WAIT_S:.0f} s ({path})")
                time.sleep(0.02)
            with open(path) as f:
                index = int(f.read())
        yield index


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    folder = os.environ.get(QUEUE)
    if not folder or session.config.option.collectonly:
        return None  # pytest's own loop
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} errors during collection")
    items = session.items
    world, rank = int(os.environ.get(WORLD, "0")), int(os.environ.get("RANK", "0"))
    claimed = indices(folder, world, rank)
    current = next(claimed)
    while current < len(items):
        following = next(claimed)  # claimed ahead: pytest tears fixtures down by the next item
        item = items[current]
        if rank == 0:
            mark_running(folder, world, item.nodeid)
        item.config.hook.pytest_runtest_protocol(
            item=item, nextitem=items[following] if following < len(items) else None)
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
        current = following
    if rank == 0:
        mark_running(folder, world, "")
    return True


def mark_running(folder: str, world: int, nodeid: str) -> None:
    """Write the test world ``world`` runs now (``RUNNING`` in its folder; "": none), which
    the launcher names for a world it stops."""
    path = os.path.join(folder, f"world{world}", RUNNING)
    with open(path + ".tmp", "w") as f:
        f.write(nodeid)
    os.replace(path + ".tmp", path)


def running(folder: str, world: int) -> str:
    """The test world ``world`` was running ("" if none, or none started)."""
    try:
        with open(os.path.join(folder, f"world{world}", RUNNING)) as f:
            return f.read()
    except FileNotFoundError:
        return ""


class _Stopped(Exception):
    """The launcher was told to stop (SIGTERM, as from an outer ``timeout``; or SIGINT)."""


def _stop(signum, frame):
    raise _Stopped(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="ranks (GPUs) of each world")
    parser.add_argument("--worlds", type=int, default=6, help="worlds running at once (6)")
    parser.add_argument("--logs", default=None, help="folder for the worlds' logs (a new temporary one)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after the launch from which no test starts (the module's docstring)")
    parser.add_argument("files", nargs="+", help="test files; pytest options after --")
    args, rest = parser.parse_known_args(argv)
    if args.nproc < 1 or args.worlds < 1:
        parser.error("--nproc and --worlds must be at least 1")
    pytest_args = [a for a in rest if a != "--"]
    logs = args.logs or tempfile.mkdtemp(prefix="ringflash-gpu-tests-")
    os.makedirs(logs, exist_ok=True)
    queue = tempfile.mkdtemp(prefix="queue-", dir=logs)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, **{QUEUE: queue})
    if args.deadline is not None:
        env[DEADLINE] = str(time.time() + args.deadline)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        env.setdefault(name, value)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc}", "-m", "pytest", *args.files, "-p", "run_gpu",
               "-p", "no:cacheprovider", "-q", *pytest_args]
    start = time.monotonic()
    runs = []
    for world in range(args.worlds):
        log = open(os.path.join(logs, f"world{world}.log"), "w")
        runs.append((subprocess.Popen(command, env=dict(env, **{WORLD: str(world)}),
                                      stdout=log, stderr=subprocess.STDOUT), log))
    stopped = None
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for process, _ in runs:
            process.wait()
    except _Stopped as why:
        stopped = str(why)
        for process, _ in runs:
            if process.poll() is None:
                process.terminate()  # torchrun passes it on to its ranks
        for process, _ in runs:
            try:
                process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    status = 0
    for world, (process, log) in enumerate(runs):
        code = process.returncode
        log.close()
        with open(log.name) as f:
            lines = f.read().splitlines()
        summaries = [line.strip("= ") for line in lines if SUMMARY.search(line)]
        at = running(queue, world)
        print(f"world {world}: exit {code}: " + ("; ".join(summaries) or "no pytest summary")
              + (f"; stopped by {stopped} while running {at}" if stopped and at else ""))
        if code:
            status = status or code
            print("\n".join(lines[-LOG_LINES:] if stopped else lines), file=sys.stderr)
    if args.deadline is not None:
        claimed = ""
        if os.path.exists(os.path.join(queue, "next")):
            with open(os.path.join(queue, "next")) as f:
                claimed = f.read().strip()
        print(f"--deadline {args.deadline:.0f} s: {claimed or 0} test indices claimed before it (those past the "
              "files' last test included); any test not in the summaries above did not run")
    print(f"{args.worlds} worlds of {args.nproc} ranks: {time.monotonic() - start:.0f} s (logs in {logs})")
    return status


if __name__ == "__main__":
    sys.exit(main())
