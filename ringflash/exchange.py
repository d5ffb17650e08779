"""The ring: this rank's neighbours in a process group and the point-to-point exchange.

Every exchange sends to rank+1 and receives from rank-1, all of a step's tensors posted
together as one batch of P2P ops. On NCCL the batch runs on the process group's own
communication stream: it starts once the work already queued on the compute stream is
done (which is also when the receive buffer, last step's operand, is free), and
``wait`` only makes the compute stream wait on an event, never the host. On gloo the
same calls move CPU tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Ring:
    """Rank, world size and neighbours of this process in ``group`` (None: the world;
    without an initialized process group, a ring of one)."""

    def __init__(self, group=None):
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.group, self.rank, self.world = None, 0, 1
            return
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the given process group")
        self.next_peer = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev_peer = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def exchange(self, *pairs: tuple[torch.Tensor, torch.Tensor]) -> list:
        """Post, for each (send, recv) pair, the send to rank+1 and the receive from rank-1."""
        ops = []
        for send, recv in pairs:
            ops.append(dist.P2POp(dist.isend, send, self.next_peer, self.group))
            ops.append(dist.P2POp(dist.irecv, recv, self.prev_peer, self.group))
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending: list) -> None:
        for work in pending:
            work.wait()

    def collective_device(self) -> torch.device:
        """Where this group's collectives take their tensors when no input says: the
        current GPU on NCCL, the CPU otherwise."""
        if "nccl" in str(dist.get_backend(self.group)).lower():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_gather_ints(self, values: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere); one small collective."""
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.group)
        return torch.stack(everyone).tolist()
