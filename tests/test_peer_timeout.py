"""No wait without an end: the forward kernel's wait for a part still arriving
(``kernels.Arrival`` with flags) gives up after its timeout, records the chunk in the
status word and writes NaN. On the CPU through Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1; the interpreter reads the host's clock where the GPU reads its
global timer), compiled where CUDA is (the status then in pinned host memory, as
``exchange.PeerRing`` keeps it). The host side (``exchange._PeerStatus``) turns the record
into an error naming the peer, and its watchdog ends a process that raised none. Two GPUs
with a peer that stops mid-call: tests/test_peer_failure_gpu.py.
"""

import importlib
import threading
import time
import types

import pytest
import torch

from ringflash import exchange
from ringflash.kernels import Arrival, PairMask
from ringflash.kernels import triton as triton_kernels
from ringflash.kernels.block_sparse import random_block_mask
from ringflash.kernels.masks import Blocks
from ringflash.kernels.triton.fwd import GAVE_UP

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
N = 128  # rows of each part of the keys, and of the queries: one tile


def _problem(seed=0):
    """q (1, N, 2, 16) against keys in two parts of N rows (2 K/V heads, a chunk each),
    under a per-head block mask that lists every block."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, 2, 16, generator=gen).to(DEVICE) for n in (N, 2 * N, 2 * N))
    bm = random_block_mask(2 * N, 1.0, heads=2, seed=1, device=DEVICE)[:, :1]
    return q, k, v, PairMask(blocks=Blocks(bm))


def _forward(q, k, v, mask, arrival):
    """The launcher itself (``pair.flash_attn_fwd`` takes flags with CUDA tensors only),
    into NaN-filled outputs; the second part runs last."""
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    lse = torch.full((1, 2, N), float("nan"), device=DEVICE)
    (k1, k2), (v1, v2) = ((t[:, :N].contiguous(), t[:, N:].contiguous()) for t in (k, v))
    triton_kernels.fwd(q, k1, v1, out, lse, softmax_scale=0.3, mask=mask, accumulate=False, tail=(k2, v2),
                       arrival=arrival)
    if HAS_CUDA:
        torch.cuda.synchronize()
    return out, lse


def _status(rank=0, peer=1):
    return exchange._PeerStatus(None, rank, peer, pinned=HAS_CUDA)


def test_a_wait_that_never_ends_gives_up_and_names_the_peer():
    """Chunk 1 (K/V head 1) never lands: its tiles give up after the timeout, the status
    records chunk 1, every flag is raised past any epoch (no tile waits again), head 1's
    out and lse are NaN, and head 0's rows are right (tiles run before the give-up) or
    NaN (after it). The host's check raises an error naming the peer, the heads and the
    timeout, in about the timeout."""
    q, k, v, mask = _problem()
    want = _forward(q, k, v, mask, None)
    flags = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    status = _status(rank=0, peer=1)
    status.arm(0.3, 1)
    start = time.monotonic()
    out, lse = _forward(q, k, v, mask, Arrival(1, flags, 1, 1, 0.3, status.tensor))
    with pytest.raises(exchange.PeerTimeoutError, match=r"rank 0 gave up on rank 1: K/V heads 1-1 .* 0\.3 s"):
        status.check()
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 30, elapsed
    assert status.raised and int(status.words[0]) == 2  # chunk 1, + 1
    assert torch.all(flags.cpu() == GAVE_UP.value)
    assert torch.isnan(out[:, :, 1]).all() and torch.isnan(lse[:, 1]).all()
    for got, ref in ((out[0, :, 0], want[0][0, :, 0]), (lse[0, 0], want[1][0, 0])):
        assert (torch.isnan(got) | torch.isclose(got, ref, rtol=1e-5, atol=1e-6)).all()


def test_every_chunk_missing_gives_up_once():
    """No chunk ever lands: the first tile to give up releases the rest, so the launch
    ends in about one timeout (not one per tile), every output is NaN."""
    q, k, v, mask = _problem(seed=1)
    flags = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    status = _status()
    start = time.monotonic()
    out, lse = _forward(q, k, v, mask, Arrival(1, flags, 1, 1, 0.5, status.tensor))
    assert time.monotonic() - start < 0.5 + 30
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    assert int(status.words[0]) in (1, 2)


def test_a_chunk_landing_during_the_wait_is_read(monkeypatch):
    """Chunk 1 lands while its tiles wait (a thread raises its flag once a tile reads the
    clock, i.e. spins; on a GPU 0.5 s in): the result is that of the whole tensors, and
    nothing is recorded. On a GPU the flags live in pinned host memory, which the kernel
    reads through its device address and the host thread writes directly: what the test
    needs is a write from outside the launch while the tiles spin. (Writes from this GPU
    itself did not serve: on 2026-11-26 a copy kernel on a side stream, and on 2026-11-27
    a stream memory write, never reached the spinning tiles on one H100 within 60 s. The
    ring's flags are written by the peer GPU's copy stream: tests/test_peer_failure_gpu.py
    and the ring tests run that path.)"""
    q, k, v, mask = _problem(seed=2)
    want = _forward(q, k, v, mask, None)
    flags = torch.tensor([1, 0], dtype=torch.int32)
    flags = flags.pin_memory() if HAS_CUDA else flags
    landed = torch.tensor([1, 1], dtype=torch.int32)
    status = _status()
    spinning = threading.Event()
    if not HAS_CUDA:  # the interpreted kernel reads the host's clock only while it waits
        fwd = importlib.import_module("ringflash.kernels.triton.fwd")  # the module (the package exports a fwd)

        def clock():
            spinning.set()
            return time.monotonic_ns()
        monkeypatch.setattr(fwd, "time", types.SimpleNamespace(monotonic_ns=clock))

    def land():
        if HAS_CUDA:
            time.sleep(0.5)
        else:
            spinning.wait(60)
            time.sleep(0.2)
        flags.copy_(landed)
    lander = threading.Thread(target=land)
    lander.start()
    out, lse = _forward(q, k, v, mask, Arrival(1, flags, 1, 1, 60.0, status.tensor))
    lander.join()
    assert HAS_CUDA or spinning.is_set()
    status.check()
    assert int(status.words[0]) == 0
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want[1], rtol=1e-5, atol=1e-6)


def test_peer_timeout_setting(monkeypatch):
    monkeypatch.delenv("RINGFLASH_PEER_TIMEOUT_S", raising=False)
    assert exchange.peer_timeout() == exchange.PEER_TIMEOUT_S == 60.0
    monkeypatch.setenv("RINGFLASH_PEER_TIMEOUT_S", "2.5")
    assert exchange.peer_timeout() == 2.5
    for bad in ("0", "-1", "inf", "nan", "soon"):
        monkeypatch.setenv("RINGFLASH_PEER_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="RINGFLASH_PEER_TIMEOUT_S must be a positive number"):
            exchange.peer_timeout()


def test_a_failure_stays_and_is_checked_per_group():
    """A group whose kernel gave up raises at every check (``transport`` asks before a
    call's collectives); another group, or the same name made again, does not."""
    group, other = types.SimpleNamespace(group_name="g"), types.SimpleNamespace(group_name="g")
    status = exchange._PeerStatus(group, 3, 2, pinned=False)
    status.arm(1.0, 4)
    status.words[0] = 2  # as the kernel writes it: chunk 1
    registry = {"g": status}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(exchange, "_PEER_STATUS", registry)
        for _ in range(2):
            with pytest.raises(exchange.PeerTimeoutError, match="rank 3 gave up on rank 2: K/V heads 4-7"):
                exchange._check_group(group)
        exchange._check_group(other)  # a group made again under the name: not this one's failure
        exchange._check_group(types.SimpleNamespace(group_name="h"))


def _watched(monkeypatch, timeout):
    """A watched status (the watchdog polls every 20 ms here) and the list of the
    statuses ``_end_process`` was called with (instead of ending pytest)."""
    ended = []

    def end(status):
        ended.append(status)
        status.raised = True  # the real one never returns
    monkeypatch.setattr(exchange, "_WATCHED", [])
    monkeypatch.setattr(exchange, "_WATCH_POLL_S", 0.02)
    monkeypatch.setattr(exchange, "_end_process", end)
    status = _status()
    status.tensor = status.tensor.cpu()
    status.words = status.tensor.numpy()
    status.arm(timeout, 1)
    exchange._watch(status)
    return status, ended


def test_the_watchdog_ends_a_process_that_raised_nothing(monkeypatch):
    """A failure no call raises: the watchdog ends the process one timeout after it saw
    it, not before."""
    status, ended = _watched(monkeypatch, 0.3)
    time.sleep(0.2)
    assert not ended  # nothing failed yet
    status.words[0] = 1
    seen = time.monotonic()
    while not ended and time.monotonic() - seen < 10:
        time.sleep(0.01)
    assert ended == [status] and 0.25 <= time.monotonic() - seen < 10


def test_the_watchdog_leaves_a_process_that_raised_the_error(monkeypatch):
    """The next call raised the failure in this process: the watchdog does nothing."""
    status, ended = _watched(monkeypatch, 0.2)
    status.words[0] = 1
    with pytest.raises(exchange.PeerTimeoutError):
        status.check()
    time.sleep(0.6)
    assert not ended


def test_the_one_launch_forward_passes_the_rings_watch(monkeypatch):
    """``gathered_forward`` hands the kernel the ring's timeout and status with its
    flags (``Ring.watch``)."""
    import ringflash
    from ringflash.ring import gathered
    launches = []

    def fwd(q, k, v, *, out, lse, arrival, **kw):
        launches.append(arrival)
    monkeypatch.setattr(ringflash.kernels, "flash_attn_fwd", fwd)
    monkeypatch.setattr(gathered, "pair_mask", lambda *args: None)
    status = torch.zeros(4, dtype=torch.int64)

    class Watching(exchange.Ring):
        rank, world, streams_chunks = 0, 2, True

        def __init__(self):
            pass

        def arriving(self, send, recv, heads):
            self.watch = (2.5, status)
            self.flags = torch.ones(send[0].shape[2] // heads, dtype=torch.int32)
            return [], self.flags

    ring = Watching()
    q, k, v = (torch.randn(1, 256, 4, 64) for _ in range(3))
    gathered.gathered_forward(q, k, v, torch.zeros(2, *k.shape), softmax_scale=0.125, band=(None, None),
                              dropout=(0.0, 0), ring=ring, plan=None, blocks=None)
    arrival = launches[0]
    assert arrival.flags is ring.flags and arrival.timeout == 2.5 and arrival.status is status


def test_arriving_serves_a_ring_of_two_only():
    """The copy-engine ring's streamed exchange relies on its one peer being sender and
    receiver both (its first handshake has then heard from the sender before the flags'
    clock can start): a larger ring raises instead of timing a late sender."""
    ring = types.SimpleNamespace(world=4)
    with pytest.raises(ValueError, match="serves a ring of two, not of 4"):
        exchange.PeerRing.arriving(ring, (None, None), None, 1)
