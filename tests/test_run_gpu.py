"""tests/run_gpu.py's queue, on the CPU: several worlds take a file's tests from one queue,
each test once, and the ranks of a world take the same tests in the same order."""

import threading

from run_gpu import claim, indices


def test_claim_counts_up_from_zero(tmp_path):
    assert [claim(str(tmp_path)) for _ in range(5)] == [0, 1, 2, 3, 4]


def test_each_test_runs_in_one_world_on_all_its_ranks(tmp_path):
    tests, worlds, ranks = 40, 3, 2
    taken: dict[tuple[int, int], list[int]] = {}

    def rank_loop(world, rank):
        mine = taken.setdefault((world, rank), [])
        for index in indices(str(tmp_path), world, rank):
            if index >= tests:
                break
            mine.append(index)

    threads = [threading.Thread(target=rank_loop, args=(w, r)) for w in range(worlds) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for world in range(worlds):
        assert taken[world, 0] == taken[world, 1] == sorted(taken[world, 0])
    assert sorted(i for w in range(worlds) for i in taken[w, 0]) == list(range(tests))


def test_no_test_starts_past_the_deadline(tmp_path, monkeypatch):
    """Past ``--deadline`` claim hands out STOP (beyond every test, so each world's loop ends
    after the test it runs) and counts nothing; before it, the queue as usual; the deadline
    reaches the ranks through the environment."""
    import time

    from run_gpu import DEADLINE, STOP
    folder = str(tmp_path)
    assert [claim(folder, deadline=time.time() + 60) for _ in range(3)] == [0, 1, 2]
    assert claim(folder, deadline=time.time() - 1) == STOP
    monkeypatch.setenv(DEADLINE, str(time.time() - 1))
    assert claim(folder) == STOP
    monkeypatch.setenv(DEADLINE, str(time.time() + 60))
    assert claim(folder) == 3  # nothing was counted past the deadline


def test_a_stopped_launcher_names_the_test_each_world_was_running(tmp_path):
    """SIGTERM (an outer ``timeout``) to the launcher: the worlds are stopped and it still
    reports, naming the test a world was in (here one that sleeps), within seconds."""
    import os
    import signal
    import subprocess
    import sys
    import time

    tests = tmp_path / "test_sleepy.py"
    tests.write_text("import time\n\ndef test_quick():\n    pass\n\ndef test_sleeps():\n    time.sleep(600)\n")
    logs = tmp_path / "logs"
    here = os.path.dirname(os.path.abspath(__file__))
    launcher = subprocess.Popen([sys.executable, os.path.join(here, "run_gpu.py"), "--nproc", "1", "--worlds", "1",
                                 "--logs", str(logs), str(tests)],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    marker = None
    while time.monotonic() < deadline and launcher.poll() is None:
        marker = next(logs.glob("queue-*/world0/running"), None)
        if marker is not None and marker.read_text().endswith("test_sleeps"):
            break
        time.sleep(0.2)
    assert launcher.poll() is None, launcher.communicate()
    assert marker is not None and marker.read_text().endswith("test_sleeps")
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=60)
    assert "stopped by SIGTERM while running" in out and "test_sleeps" in out, (out, err)
    assert launcher.returncode != 0
