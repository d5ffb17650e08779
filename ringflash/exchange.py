"""The ring: this rank's neighbours in a process group and the point-to-point exchange.

Every exchange sends to rank+shift and receives from rank-shift (shift 1 but for the
gradients' last trip home), all of a step's tensors posted together. ``exchange`` returns at once; ``wait`` makes the compute stream wait on the
transfer (an event, never the host). Two transports:

- ``Ring`` (NCCL, or gloo on CPUs): one batch of NCCL P2P ops on the process group's
  communication stream. Its kernels take SMs from the attention kernels beside them.
- ``PeerRing`` (NCCL groups within one node): each rank copies its message straight into
  the neighbour's memory, mapped into its own address space through torch's symmetric
  memory, with ``cudaMemcpyAsync``: the GPU's copy engines move the bytes, so the
  attention kernels keep every SM. Messages arrive in symmetric buffers
  (``Ring.buffer``) that stay allocated for the next call; what a rank sends can be any
  tensor, so its own K/V leave as they are, with no copy into a buffer first.

Both start a transfer only once the work already queued on the compute stream is done,
which is also when the receive buffer, last step's operand, is free.

No wait on a peer is without an end. A kernel that waits inside for chunks the copy
engines bring (``PeerRing.arriving``) gives up after RINGFLASH_PEER_TIMEOUT_S seconds
(``peer_timeout``) and records which peer failed it in host memory; the next ring call
over the group raises ``PeerTimeoutError`` naming that peer, before any collective, and a
watchdog thread ends the process when no call raised it within another timeout (the main
thread then waits on the GPU, which waits for the peer: ``_PeerStatus``).
"""

from __future__ import annotations

import ctypes
import faulthandler
import math
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from .groups import resolve_group

TRANSPORTS = ("auto", "nccl", "peer")


class Ring:
    """Rank, world size and neighbours of this process in ``group`` (None: the world;
    without an initialized process group, a ring of one)."""

    def __init__(self, group=None):
        group = resolve_group(group)  # a DeviceMesh names its group
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.group, self.rank, self.world = None, 0, 1
            return
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the given process group")

    def peer(self, shift: int) -> int:
        """Global rank of the group member ``shift`` places after this one."""
        return dist.get_global_rank(self.group, (self.rank + shift) % self.world)

    def buffer(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Storage for messages this rank receives; ``name`` says which role it plays in a
        call, so one call's buffers never alias each other."""
        return torch.empty(shape, dtype=dtype, device=device)

    def exchange(self, *pairs: tuple, shift: int = 1) -> list:
        """Post, for each (send, recv) pair, the send to rank+shift and the receive from
        rank-shift. A pair may name a third tensor, ``at``: a view of the buffer ``recv``
        belongs to, at the place where rank+shift receives this message in its own copy of
        that buffer, when that is not where this rank receives (a message one way only:
        this rank receives an empty view while rank+shift receives into ``at``). ``recv``
        is contiguous; ``send`` may be a view (NCCL sends a contiguous copy of it; the copy
        engines read the heads of a chunk in place)."""
        to, frm = self.peer(shift), self.peer(-shift)
        ops = []
        for send, recv, *_at in pairs:
            ops.append(dist.P2POp(dist.isend, send.contiguous(), to, self.group))
            ops.append(dist.P2POp(dist.irecv, recv, frm, self.group))
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending: list) -> None:
        for work in pending:
            work.wait()

    # Whether ``arriving`` can tell a kernel, chunk by chunk, that a message has landed.
    streams_chunks = False

    # What a kernel that waits for ``arriving``'s flags takes besides them: (timeout in
    # seconds, status tensor) for ``kernels.Arrival`` (PeerRing sets it in ``arriving``).
    watch: tuple = ()

    def arriving(self, send: tuple, recv: torch.Tensor, heads: int):
        """Send (k, v) (B, S, Hkv, D) to rank+1's ``recv`` (2, B, S, Hkv, D), a view of a
        ``buffer``, receiving rank-1's the same way. Returns (pending, flags): here the
        trip is whole once ``wait(pending)`` returns, and flags is None."""
        return self.exchange((send[0].contiguous(), recv[0]), (send[1].contiguous(), recv[1])), None

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere): one small all-gather on the host
        (``host_group``), so it waits for the other ranks' hosts, never for a GPU.

        Its tensors live as long as the process (``_GATHERS``). The rank check is this
        all-gather, and the error it makes every rank raise often ends the process right
        after it; but gloo's worker thread may still hold the finished work when the call
        returns (5 to 20% of the calls, measured on 2 CPU cores). Had Python let go of the
        tensors meanwhile, that thread would free their Python objects, which takes the
        GIL, and while the interpreter finalizes that ends the thread inside a C++
        destructor: SIGABRT, "terminate called without an active exception", after the
        right error (tests/test_bad_input.py). Tensors Python still holds never need it.
        """
        key = (threading.get_ident(), self.world, len(values))
        if key not in _GATHERS:
            mine = torch.empty(len(values), dtype=torch.int64)
            _GATHERS[key] = (mine, [torch.empty_like(mine) for _ in range(self.world)])
        mine, everyone = _GATHERS[key]
        mine.copy_(torch.tensor(values, dtype=torch.int64))
        host_all_gather(everyone, mine, self.group)
        return torch.stack(everyone).tolist()


# Per (thread, ranks, integers): the tensors ``Ring.all_gather_ints`` hands to the backend,
# kept for the life of the process (it says why).
_GATHERS: dict = {}


def _is_nccl(group) -> bool:
    return "nccl" in str(dist.get_backend(group)).lower()


# Per NCCL group name: (the group, its gloo twin); a new group of that name gets a new twin.
_HOST_GROUPS: dict[str, tuple] = {}


def host_group(group):
    """The group for host-side collectives of ``group``'s ranks: ``group`` itself on gloo;
    for NCCL a gloo twin (``dist.ProcessGroupGloo``, called by ``host_all_gather``) over
    the same ranks with its timeout, made on the first call (by every member: ring calls
    run in lockstep) and kept: an NCCL all-gather makes the host wait for every kernel
    queued before it (0.5-1.9 ms a fwd+bwd on 2 x H200; docs/notes/documents.md,
    "Documents, fourth round"). Its store keys are its own: the k-th twin of these ranks
    (each member adds one to a count, and none starts the next before all joined this one)
    is keyed by k. ``dist.new_group`` names groups from their ranks and the groups alive, so
    after the world is made again on a store that outlives it (torchrun's) the old twin's
    addresses were read and the all-gather failed or hung (2 x H200, 2026-11-28)."""
    if not _is_nccl(group):
        return group
    name = group.group_name
    if name not in _HOST_GROUPS or _HOST_GROUPS[name][0] is not group:
        ranks = dist.get_process_group_ranks(group)
        store = dist.distributed_c10d._get_default_store()
        key = "ringflash/host/" + ",".join(map(str, ranks))
        made = (store.add(key, 1) - 1) // len(ranks)
        twin = dist.ProcessGroupGloo(dist.PrefixStore(f"{key}/{made}/", store), dist.get_rank(group),
                                     len(ranks), _timeout(group) or dist.default_pg_timeout)
        _HOST_GROUPS[name] = (group, twin)
    return _HOST_GROUPS[name][1]


def host_all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group) -> None:
    """``dist.all_gather(outputs, tensor, group)`` on ``host_group(group)`` (CPU tensors)."""
    host = host_group(group)
    if host is group:
        dist.all_gather(outputs, tensor, group=group)
    else:
        host.allgather([outputs], [tensor]).wait()


def _timeout(group):
    """The NCCL group's timeout, for its host group (None: torch's default for gloo)."""
    try:
        return group._get_backend(torch.device("cuda")).options._timeout
    except (AttributeError, RuntimeError):
        return None


class _Copy2D(ctypes.Structure):
    """The CUDA driver's CUDA_MEMCPY2D."""
    _fields_ = [(side + name, kind) for side in ("src", "dst") for name, kind in (
        ("XInBytes", ctypes.c_size_t), ("Y", ctypes.c_size_t), ("MemoryType", ctypes.c_int),
        ("Host", ctypes.c_void_p), ("Device", ctypes.c_uint64), ("Array", ctypes.c_void_p),
        ("Pitch", ctypes.c_size_t))] + [("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


_DRIVER: dict = {}  # the CUDA driver's entry points, loaded on first use


def _driver(name: str):
    if name not in _DRIVER:
        _DRIVER[name] = getattr(ctypes.CDLL("libcuda.so.1"), name)
    return _DRIVER[name]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"PeerRing: {what} failed with CUDA error {status}")


def _copy_rows(dst: int, src: int, width: int, pitch: int, height: int, stream, dst_pitch=None) -> None:
    """``height`` rows of ``width`` bytes, ``pitch`` bytes apart at the source and
    ``dst_pitch`` (default ``pitch``) at the destination, from device address ``src`` to
    ``dst`` on ``stream``: one 2-D copy on the copy engines."""
    copy = _Copy2D(srcMemoryType=2, srcDevice=src, srcPitch=pitch, dstMemoryType=2,  # device
                   dstDevice=dst, dstPitch=pitch if dst_pitch is None else dst_pitch, WidthInBytes=width,
                   Height=height)
    _check(_driver("cuMemcpy2DAsync_v2")(ctypes.byref(copy), ctypes.c_void_p(stream.cuda_stream)),
           "cuMemcpy2DAsync")


def _pitched(t: torch.Tensor) -> bool:
    """Whether ``t`` is (B, S, H, D) rows of contiguous heads a fixed pitch apart (some heads
    of a contiguous tensor), which one 2-D copy a batch entry carries."""
    return (t.dim() == 4 and t.stride(3) == 1 and (t.shape[2] == 1 or t.stride(2) == t.shape[3])
            and t.stride(1) >= t.shape[2] * t.shape[3])


class _MemoryBarrier(ctypes.Structure):
    """A CUstreamBatchMemOpParams (a 48-byte union) holding a system-wide memory barrier."""
    _fields_ = [("operation", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("pad", ctypes.c_uint64 * 5)]


_MEM_OP_BARRIER, _BARRIER_SYS = 6, 0  # CU_STREAM_MEM_OP_BARRIER, CU_STREAM_MEMORY_BARRIER_TYPE_SYS


def _write_flag(address: int, value: int, stream) -> None:
    """Write the int32 ``value`` at device address ``address`` on ``stream`` once the work
    before it there is done, behind a memory barrier (the _v2 stream memory operations do
    not fence a write on their own), so the writes before it are seen first: no SM takes
    part."""
    barrier = _MemoryBarrier(operation=_MEM_OP_BARRIER, flags=_BARRIER_SYS)
    handle = ctypes.c_void_p(stream.cuda_stream)
    _check(_driver("cuStreamBatchMemOp_v2")(handle, ctypes.c_uint(1), ctypes.byref(barrier), ctypes.c_uint(0)),
           "cuStreamBatchMemOp (a memory barrier)")
    _check(_driver("cuStreamWriteValue32_v2")(handle, ctypes.c_uint64(address), ctypes.c_uint32(value),
                                               ctypes.c_uint(0)), "cuStreamWriteValue32")


class _Copied:
    """A transfer posted on the copy stream; ``wait`` orders the compute stream after it."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


PEER_TIMEOUT_S = 60.0  # RINGFLASH_PEER_TIMEOUT_S's default


def peer_timeout() -> float:
    """Seconds a kernel waits for a chunk of K/V from a peer before it gives up:
    RINGFLASH_PEER_TIMEOUT_S (read at every call; default ``PEER_TIMEOUT_S``). The clock
    starts when a tile first finds its chunk missing, which is after both ranks have
    started the exchange (its first handshake), so it bounds the copy engines' delivery
    alone, not a peer arriving late at the call: the default is generous."""
    text = os.environ.get("RINGFLASH_PEER_TIMEOUT_S")
    if text is None:
        return PEER_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"RINGFLASH_PEER_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return value


class PeerTimeoutError(RuntimeError):
    """A kernel of this process gave up waiting for K/V that a peer sends (``PeerRing``)."""


class _PeerStatus:
    """Where the kernels of one process group's copy-engine ring record that they gave up
    on a peer: an int64 tensor of 4, in pinned host memory that the GPU writes and the host
    reads without a synchronization. [0] chunk + 1 of the chunk a tile gave up on, written
    by the kernel (``kernels.Arrival``; 0: none); [1] this rank, [2] the peer whose chunks
    it waits for (global ranks), [3] the timeout in ms, written by the host.

    A failure stays: a chunk that lands after its kernel gave up could raise a flag the
    next call reads as its own, so every later call over the group raises (``check``).
    When none does within a further timeout of the failure's discovery (the main thread
    waits on the GPU, which waits for the peer at the exchange's closing handshake, or it
    runs no ring call), the watchdog reports the error and ends the process
    (``_end_process``), as NCCL's watchdog does on a collective that timed out."""

    def __init__(self, group, rank: int, peer: int, pinned: bool = True):
        self.group, self.heads, self.raised = group, 1, False
        self.found = None  # when the watchdog first saw the failure (time.monotonic)
        self.tensor = torch.zeros(4, dtype=torch.int64, pin_memory=pinned)
        self.words = self.tensor.numpy()  # reads and writes of host memory, never a GPU sync
        self.words[1], self.words[2] = rank, peer

    def arm(self, timeout: float, heads: int) -> None:
        """Before a launch that waits ``timeout`` seconds for chunks of ``heads`` K/V heads."""
        self.words[3], self.heads = round(timeout * 1000), heads

    def message(self) -> str | None:
        """The error, once a kernel gave up (None before)."""
        chunk = int(self.words[0]) - 1
        if chunk < 0:
            return None
        rank, peer, heads = int(self.words[1]), int(self.words[2]), self.heads
        return (f"ringflash: rank {rank} gave up on rank {peer}: K/V heads {chunk * heads}-{(chunk + 1) * heads - 1} "
                f"that rank {peer} sends over the copy engines did not land within "
                f"{self.words[3] / 1000:g} s (RINGFLASH_PEER_TIMEOUT_S): rank {peer} stopped or is stuck. "
                f"That call's output is NaN, and this process group's copy-engine ring stays unusable")

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` if a kernel gave up."""
        text = self.message()
        if text is not None:
            self.raised = True
            raise PeerTimeoutError(text)


# Per process group, by name: its _PeerStatus (a group made again under a reused name gets
# a fresh one, as in _HOST_GROUPS).
_PEER_STATUS: dict[str, _PeerStatus] = {}
_WATCHED: list[_PeerStatus] = []  # what the watchdog looks at
_WATCHDOG: list[threading.Thread] = []  # the watchdog, once started
_WATCH_LOCK = threading.Lock()
_WATCH_POLL_S = 0.2


def _watch(status: _PeerStatus) -> None:
    """Have the watchdog thread (started on first use) look at ``status``."""
    if any(status is other for other in _WATCHED):  # a few entries at most: one per ring group
        return
    with _WATCH_LOCK:
        if not any(status is other for other in _WATCHED):
            _WATCHED.append(status)
        if not _WATCHDOG:
            _WATCHDOG.append(threading.Thread(target=_watchdog, name="ringflash-peer-watchdog", daemon=True))
            _WATCHDOG[0].start()


def _watchdog() -> None:
    """Every _WATCH_POLL_S, a look at each watched status (a read of host memory, taking
    the GIL for microseconds): a failure that no call raised within a timeout of its
    discovery ends the process."""
    while not sys.is_finalizing():
        time.sleep(_WATCH_POLL_S)
        with _WATCH_LOCK:
            watched = list(_WATCHED)
        for status in watched:
            if status.raised or status.words[0] == 0:
                continue
            if status.found is None:
                status.found = time.monotonic()
            elif time.monotonic() - status.found >= status.words[3] / 1000:
                _end_process(status)


def _end_process(status: _PeerStatus) -> None:
    """Report a failure no call raised, with where every thread is, and end the process
    (exit status 1): its main thread waits for a GPU that waits for the peer, and would
    until the exchange's handshake times out (``_SIGNAL_TIMEOUT_MS``)."""
    try:
        out = sys.__stderr__ or sys.stderr  # the process's own, where sys.stderr is replaced (captured)
        print(f"{status.message()}.\nNo ring call raised it within another {status.words[3] / 1000:g} s "
              f"(RINGFLASH_PEER_TIMEOUT_S): ending the process. Its threads:", file=out, flush=True)
        faulthandler.dump_traceback(file=out, all_threads=True)
    except Exception:  # noqa: BLE001 -- nothing may keep the process from ending
        pass
    finally:
        os._exit(1)


def _peer_status(ring: "PeerRing") -> _PeerStatus:
    name = ring.group.group_name
    status = _PEER_STATUS.get(name)
    if status is None or status.group is not ring.group:
        status = _PEER_STATUS[name] = _PeerStatus(ring.group, dist.get_rank(), ring.peer(-1))
    return status


def check_peers(group=None) -> None:
    """Raise ``PeerTimeoutError`` if a kernel waiting for a peer of ``group``'s
    copy-engine ring gave up (``PeerRing``); a read of host memory, no GPU sync."""
    group = resolve_group(group)
    _check_group(group if group is not None else dist.group.WORLD)


def _check_group(group) -> None:
    status = _PEER_STATUS.get(group.group_name)
    if status is not None and status.group is group:
        status.check()


# Per process group: name -> (symmetric tensor, its handle). Kept between calls, because
# making a buffer symmetric is a collective that maps every rank's memory into the others.
_SYMMETRIC: dict[str, dict[str, tuple[torch.Tensor, object]]] = {}
_COPY_STREAMS: dict[int, torch.cuda.Stream] = {}
# A peer that never answers a handshake ends the process with a CUDA error after this long.
_SIGNAL_TIMEOUT_MS = 10 * 60 * 1000
# The signal pad's channels of an exchange's two handshakes (``PeerRing._ready``, ``_landed``).
_READY, _LANDED = 1, 2


class PeerRing(Ring):
    """The ring over copy engines, for NCCL groups whose ranks share one node.

    Each exchange runs on a high-priority side stream: a handshake with the two ranks it
    trades with (``_ready``: the receiver rank+shift has finished the work queued before
    the exchange, so its receive buffers are free), then, for each pair, a copy of this
    rank's ``send`` into rank+shift's ``recv``, seen through its symmetric-memory mapping,
    then a second handshake (``_landed``: rank-shift's copies into this rank are done, so
    its receive buffers hold their messages). Until 2026-11-27 both were barriers of the
    whole group, which made every exchange wait for the busiest rank.
    The receive buffers must come from ``buffer`` and sit at the same place on every rank,
    which the ring schedule's lockstep guarantees. Nothing is in flight once the compute
    stream has waited for an exchange, so a call ends without a barrier of its own.
    """

    def __init__(self, group=None):
        super().__init__(group)
        self._status = _peer_status(self)
        self._status.check()
        from torch.distributed import _symmetric_memory as symm_mem
        self._symm_mem = symm_mem
        self._buffers = _SYMMETRIC.setdefault(self.group.group_name, {})
        device = torch.cuda.current_device()
        if device not in _COPY_STREAMS:
            _COPY_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
        self._stream = _COPY_STREAMS[device]

    def buffer(self, name, shape, dtype, device):
        numel, key = math.prod(shape), f"{name}/{dtype}"
        if key not in self._buffers or self._buffers[key][0].numel() < numel:
            self._grow(key, numel, dtype, device)
        return self._buffers[key][0][:numel].view(shape)

    def _grow(self, key, numel, dtype, device):
        """Replace buffer ``key`` by a larger one; every rank does so in the same call.
        Both ends synchronize: copies still queued may read the old buffer, and the new
        one's signal pad is zeroed outside this ring's streams, which must be done on every
        rank before any rank signals into it (else the signal is wiped, and the handshake
        waits for it until it times out)."""
        torch.cuda.synchronize(device)
        self._buffers.pop(key, None)
        base = self._symm_mem.empty(numel, dtype=dtype, device=device)
        handle = self._symm_mem.rendezvous(base, self.group)
        base.zero_()  # arrival flags start down
        torch.cuda.synchronize(device)
        self.all_gather_ints([0])  # returns once every rank is past its synchronize
        self._buffers[key] = (base, handle)

    streams_chunks = True

    def arriving(self, send, recv, heads):
        """As ``Ring.arriving``, with the K/V in chunks of ``heads`` heads (2-D copies of
        every row's heads, K then V), each followed by its flag: returns the flags
        ((Hkv / heads,) int32, in a buffer of their own), which turn 1 as their chunk
        lands here, for ``kernels.Arrival``; the caller zeroes them once it has waited for
        ``pending`` (before the next exchange, which no rank starts before then: a graph
        replaying the call waits anew). The current stream waits for the first handshake
        only: a kernel that waits for the flags may hold every SM (a signal kernel needs
        one), and the rest of the trip needs none. So the kernel's wait has an end of its
        own: ``watch`` gives it ``peer_timeout()`` and this group's ``_PeerStatus``.
        A ring of two only (``gathered.keeps_kv``): there the one peer is the sender and
        the receiver both, so the first handshake has heard from the sender, and the
        flags' clock never counts a sender late to the call."""
        if self.world != 2:
            raise ValueError(f"PeerRing.arriving serves a ring of two, not of {self.world}")
        self._status.check()
        timeout = peer_timeout()
        self._status.arm(timeout, heads)
        self.watch = (timeout, self._status.tensor)
        _watch(self._status)
        k, v = (t.contiguous() for t in send)
        b, n, hkv, d = k.shape
        flags = self.buffer("arrived", (hkv // heads,), torch.int32, k.device)
        offset, handle = self._find(recv)
        peer = (self.rank + 1) % self.world
        theirs = handle.get_buffer(peer, tuple(recv.shape), recv.dtype, offset)
        flag_offset, flag_handle = self._find(flags)
        their_flags = flag_handle.get_buffer(peer, tuple(flags.shape), flags.dtype, flag_offset)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        size = k.element_size()
        with torch.cuda.stream(stream):
            self._ready(handle, 1)
            started = torch.cuda.Event()
            started.record(stream)
            for t in (k, v):
                t.record_stream(stream)
            for c in range(hkv // heads):
                for i, t in enumerate((k, v)):
                    _copy_rows(theirs[i].data_ptr() + c * heads * d * size, t.data_ptr() + c * heads * d * size,
                               heads * d * size, hkv * d * size, b * n, stream)
                _write_flag(their_flags.data_ptr() + 4 * c, 1, stream)
            self._landed(handle, 1)
            done = torch.cuda.Event()
            done.record(stream)
        torch.cuda.current_stream().wait_event(started)
        return [_Copied(done)], flags

    def _find(self, recv: torch.Tensor):
        ptr = recv.data_ptr()
        for base, handle in self._buffers.values():
            start = base.data_ptr()
            if base.dtype == recv.dtype and start <= ptr < start + base.numel() * base.element_size():
                return (ptr - start) // base.element_size(), handle
        raise ValueError("PeerRing.exchange: the recv tensor must be a view of a Ring.buffer")

    def exchange(self, *pairs, shift: int = 1):
        self._status.check()
        located = []
        for send, recv, *at in pairs:
            if not ((send.is_contiguous() or _pitched(send)) and recv.is_contiguous()):
                raise ValueError("PeerRing.exchange: recv must be contiguous, send contiguous or (B, S, H, D) "
                                 f"rows of contiguous heads (strides {send.stride()})")
            located.append((send, *self._find(at[0] if at else recv)))
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        first = located[0][2]
        with torch.cuda.stream(stream):
            self._ready(first, shift)
            for send, offset, handle in located:
                send.record_stream(stream)  # read here: not to be reused before the copy is done
                theirs = handle.get_buffer((self.rank + shift) % self.world, tuple(send.shape),
                                           send.dtype, offset)
                if send.is_contiguous():
                    theirs.copy_(send)
                else:  # some heads of each row (a chunk of heads): 2-D copies, one a batch entry
                    width, size = send.shape[2] * send.shape[3] * send.element_size(), send.element_size()
                    for b in range(send.shape[0]):
                        _copy_rows(theirs[b].data_ptr(), send[b].data_ptr(), width, send.stride(1) * size,
                                   send.shape[1], stream, dst_pitch=width)
            self._landed(first, shift)
            event = torch.cuda.Event()
            event.record(stream)
        return [_Copied(event)]

    def _ready(self, handle, shift: int) -> None:
        """On the side stream, before an exchange's copies: tell this rank's sender
        (rank - shift) that its receive buffers are free (everything queued before the
        exchange is done here), and wait until the receiver (rank + shift) says the same.
        Only the two neighbours of the exchange wait for each other, not the whole group:
        a busier rank holds up its neighbours' trips, not every rank's."""
        handle.put_signal((self.rank - shift) % self.world, channel=_READY, timeout_ms=_SIGNAL_TIMEOUT_MS)
        handle.wait_signal((self.rank + shift) % self.world, channel=_READY, timeout_ms=_SIGNAL_TIMEOUT_MS)

    def _landed(self, handle, shift: int) -> None:
        """After the copies (stream order): tell the receiver its messages have landed, and
        wait for the sender's to land here."""
        handle.put_signal((self.rank + shift) % self.world, channel=_LANDED, timeout_ms=_SIGNAL_TIMEOUT_MS)
        handle.wait_signal((self.rank - shift) % self.world, channel=_LANDED, timeout_ms=_SIGNAL_TIMEOUT_MS)


def symmetric_bytes() -> int:
    """Bytes of the copy-engine ring's buffers this process holds (outside torch's caching
    allocator, so torch.cuda.max_memory_allocated does not see them)."""
    return sum(base.numel() * base.element_size()
               for buffers in _SYMMETRIC.values() for base, _ in buffers.values())


def release_buffers() -> None:
    """Free the copy-engine ring's buffers; the next ring call allocates them again. Call it
    on every rank of the group at the same point, between ring calls."""
    if _SYMMETRIC:
        torch.cuda.synchronize()
    _SYMMETRIC.clear()


def transport(group=None) -> str:
    """The transport a ring over ``group`` uses: RINGFLASH_TRANSPORT ("nccl", "peer", or
    "auto", the default). "auto" takes "peer" for NCCL groups whose ranks all run on this
    node under torchrun (every rank decides the same from its environment), "nccl" else.
    "peer" raises ``PeerTimeoutError`` where a kernel of this group's copy-engine ring
    gave up on a peer (``check_peers``)."""
    choice = os.environ.get("RINGFLASH_TRANSPORT", "auto").lower()
    if choice not in TRANSPORTS:
        raise ValueError(f"RINGFLASH_TRANSPORT must be one of {TRANSPORTS}, got {choice!r}")
    if not (dist.is_available() and dist.is_initialized()):
        return "nccl"
    group = group if group is not None else dist.group.WORLD
    nccl = _is_nccl(group)
    if choice == "peer" and not nccl:
        raise ValueError("RINGFLASH_TRANSPORT=peer needs an NCCL process group (GPU tensors)")
    kind = choice if choice != "auto" else "peer" if nccl and _all_on_this_node(group) else "nccl"
    if kind == "peer":  # a ring call asks first: raise before its collectives, which the peer would not join
        _check_group(group)
    return kind


def _all_on_this_node(group) -> bool:
    """torchrun numbers a node's ranks consecutively: RANK - LOCAL_RANK up to LOCAL_WORLD_SIZE."""
    try:
        rank, local_rank, local_world = (int(os.environ[k]) for k in
                                         ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    except (KeyError, ValueError):
        return False
    first = rank - local_rank
    members = dist.get_process_group_ranks(group)
    return all(first <= member < first + local_world for member in members)
