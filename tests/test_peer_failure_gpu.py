"""A peer that stops mid-call, on two GPUs: the other rank ends with an error naming it
within a bound, instead of waiting forever inside the forward kernel.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python -m pytest \\
        tests/test_peer_failure_gpu.py -q -p no:cacheprovider

(under ``torchrun --nproc-per-node=2 -m pytest`` the same: local rank 0 runs the worlds,
the other ranks skip). Each test launches a world of two of its own (torchrun, this file
as its script; skipped without two GPUs) over the copy-engine ring with
RINGFLASH_PEER_TIMEOUT_S=3: a ring of two over contiguous shards under a block mask with
``deterministic=True`` (which the Gluon backward does not serve under a block mask, so the
ring keeps the other rank's K/V: ``gathered.keeps_kv``), whose one-launch forward waits
inside the kernel for the other rank's K/V (``gathered.gathered_forward``). After a healthy call (kernels compiled, buffers made),
rank 1 fails in its next exchange, after the first handshake (both ranks' kernels have
started waiting), before it copies a byte:

- silent: rank 1 skips its copies and flag writes and goes on (its handshakes run): rank 0's
  kernel gives up, its output is NaN, the exchange completes, and rank 0's next call
  raises ``PeerTimeoutError`` naming rank 1 in its own process.
- stopped: rank 1 sleeps (a peer stuck, its process alive); killed: rank 1's process exits
  (status 0: torchrun's agent would end rank 0 itself on a failure). Rank 0's kernel gives
  up, but its main thread waits on the GPU, which waits for rank 1 at the exchange's
  closing handshake: the watchdog reports the error naming rank 1 and ends rank 0's
  process (exit status 1), one more timeout later.

A test that ends a rank cannot be a rank of the world it ends (a pytest process would
not report), hence the worlds of their own. Each takes about 30-60 s, most of it starting
up and compiling; BOUND_S counts from the failing call.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

TIMEOUT_S = 3  # RINGFLASH_PEER_TIMEOUT_S of the worlds
BOUND_S = 30  # from the failing call to the error (or the process's end)
LIMIT_S = 180  # a world that lasts longer hangs: it is killed, and the test fails
FAULTS = ("silent", "stopped", "killed")
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(fault: str, log) -> subprocess.Popen:
    env = {name: value for name, value in os.environ.items()
           if name not in _LAUNCH_ENV and not name.startswith("TORCHELASTIC_")}
    env.update(RINGFLASH_PEER_TIMEOUT_S=str(TIMEOUT_S), RINGFLASH_TRANSPORT="peer", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={_free_port()}", os.path.abspath(__file__), fault]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _run(fault: str, path) -> tuple[int | None, str, float | None]:
    """Run a world with ``fault``; returns its exit status (None: it hung and was killed),
    its output, and when (time.time(), to 0.1 s) the watchdog's report appeared in it."""
    ended = None
    with open(path, "w") as log:
        world = _launch(fault, log)
        start = time.monotonic()
        while time.monotonic() - start < LIMIT_S:
            done = world.poll() is not None
            if ended is None and "ending the process" in open(path).read():
                ended = time.time()
            if done:
                return world.returncode, open(path).read(), ended
            time.sleep(0.1)
        os.killpg(world.pid, signal.SIGKILL)  # its own session: torchrun and its ranks
        world.wait()
    return None, open(path).read(), ended


def _armed(text: str) -> float:
    found = re.search(r"ARMED (\S+)", text)
    assert found, f"the world never reached its failing call:\n{text[-6000:]}"
    return float(found.group(1))


@pytest.mark.parametrize("fault", FAULTS)
def test_a_peer_that_stops_mid_call_ends_in_an_error_naming_it(fault, tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    if os.environ.get("LOCAL_RANK", "0") != "0":
        pytest.skip("under torchrun, local rank 0 runs the worlds")
    status, text, ended = _run(fault, tmp_path / f"{fault}.log")
    assert status is not None, f"the world hung for {LIMIT_S} s:\n{text[-6000:]}"
    armed = _armed(text)
    named = "rank 0 gave up on rank 1"
    if fault == "silent":
        assert status == 0, f"exit status {status}:\n{text[-6000:]}"
        raised = re.search(r"RAISED (\S+) (.*)", text)
        assert raised and named in raised.group(2), text[-6000:]
        assert float(raised.group(1)) - armed < BOUND_S, text[-6000:]
        assert "NAN True" in text, text[-6000:]  # the call that gave up wrote NaN, not garbage
        assert "DONE 0" in text and "DONE 1" in text, text[-6000:]
    else:
        assert status != 0 and named in text and "ending the process" in text, \
            f"exit status {status}:\n{text[-6000:]}"
        assert ended - armed < BOUND_S, text[-6000:]


# ----------------------------------------------------------------------------- the world


def _fail(fault: str) -> None:
    """Make this rank fail in its next copy-engine exchange that streams chunks: after
    its first handshake has run (the other rank's kernel is waiting then), before its first
    copy."""
    import ringflash.exchange as exchange

    def stop(*args):
        torch.cuda.current_stream().synchronize()  # the copy stream: the first handshake has run
        print(f"rank 1 {fault}", flush=True)
        if fault == "killed":
            os._exit(0)
        time.sleep(3600)

    if fault == "silent":
        exchange._copy_rows = lambda *args: None
        exchange._write_flag = lambda *args: None
    else:
        exchange._copy_rows = stop


def world(fault: str) -> None:
    """One rank of the world ``_launch`` starts."""
    from datetime import timedelta

    import torch.distributed as dist

    import ringflash
    from ringflash import exchange
    from ringflash.exchange import PeerTimeoutError
    from ringflash.kernels.block_sparse import random_block_mask

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=2))
    assert ringflash.transport() == "peer"
    gen = torch.Generator(device=device).manual_seed(0)
    n, heads, head_dim = 2048, 8, 128  # 1024 tokens a rank; chunks of 4 K/V heads
    q, k, v = (torch.randn(1, n, heads, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    mask = random_block_mask(n, 0.5, heads=heads, seed=1, device=device)
    local = [ringflash.shard(t, 1, "contiguous").requires_grad_() for t in (q, k, v)]

    def call():  # a backward would follow: the ring of two keeps the K/V, one forward launch
        return ringflash.ring_flash_attn(*local, layout="contiguous", block_mask=mask, deterministic=True)

    streamed, arriving = [], exchange.PeerRing.arriving
    exchange.PeerRing.arriving = lambda *args: streamed.append(1) or arriving(*args)
    out = call()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "the healthy call"
    assert streamed, "the healthy call did not stream the other rank's K/V into a waiting kernel"
    dist.barrier()
    if rank == 1:
        _fail(fault)
        call()
        torch.cuda.synchronize()
    else:
        print(f"ARMED {time.time()}", flush=True)
        out = call()
        try:
            torch.cuda.synchronize()  # silent: the kernel gave up; else the watchdog ends the process here
            print(f"NAN {bool(torch.isnan(out).all())}", flush=True)
            call()
            print("NO ERROR", flush=True)
        except PeerTimeoutError as error:
            print(f"RAISED {time.time()} {error}", flush=True)
    print(f"DONE {rank}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    world(sys.argv[1])
