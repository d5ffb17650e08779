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
