"""What every ``group=`` argument of ringflash accepts, resolved in one place.

- None: the default (WORLD) process group, or a ring of one without an initialized one;
- a ``torch.distributed.ProcessGroup``;
- a 1-D ``DeviceMesh`` (e.g. ``mesh["sp"]``), meaning its one group;
- a pair ``(mesh, dim)`` of a DeviceMesh and one of its dimensions, by name or index;
- two dimensions (``resolve_grid``): a 2-D DeviceMesh, or a pair ``(head_group,
  ring_group)`` of the above: dimension 0 an all-to-all that trades the sequence split
  for a head split (U ranks), dimension 1 the ring (R ranks). ``Grid`` holds the two.

``GroupMember.NON_GROUP_MEMBER`` (what ``new_group`` returns on a rank outside the group)
raises a ValueError saying so; anything else (a group's name, a rank, a list of ranks) a
TypeError naming ``group``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def _device_mesh_type():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch built without distributed support
        return None
    return DeviceMesh


def _not_a_group(group, name: str) -> Exception:
    """The error for a ``group`` argument that names no group (see the module docstring)."""
    outside = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    if outside is not None and (group is outside or (type(group) is type(outside) and group == outside)):
        return ValueError(f"{name}: this process is not a member of the given process group")
    return TypeError(f"{name} must be a ProcessGroup, a DeviceMesh, (mesh, dim), a pair (head_group, "
                     f"ring_group) or None, got {type(group).__name__} {group!r}")


def resolve_group(group, name: str = "group"):
    """The ProcessGroup (or None) that ``group`` names; see the module docstring. ``name``:
    the argument's name in errors."""
    if isinstance(group, Grid):
        if group.heads_world > 1:
            raise ValueError("group: this function takes one dimension (a ring), not a 2-D grid "
                             f"({group.heads_world} x {group.ring_world}); pass the grid's ring or heads group")
        return group.ring
    if group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        return group
    mesh_type = _device_mesh_type()
    if mesh_type is None:
        raise _not_a_group(group, name)
    if isinstance(group, mesh_type):
        if group.ndim != 1:
            names = group.mesh_dim_names or tuple(range(group.ndim))
            raise ValueError(f"group: a {group.ndim}-D DeviceMesh is ambiguous; pass one of its dimensions, "
                             f"as mesh[name] or (mesh, dim) with dim in {names}")
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], mesh_type):
        mesh, dim = group
        if isinstance(dim, bool) or not isinstance(dim, (int, str)):
            raise TypeError(f"group: the dimension in (mesh, dim) must be a name or an index, got {dim!r}")
        return mesh.get_group(dim)
    raise _not_a_group(group, name)


def group_name(group) -> str:
    """The registered name of a resolved group, by which a torch.library op can find it
    again (``torch.distributed`` resolves it); "" for a ring of one without a process
    group. None means WORLD when a process group is initialized."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return ""
        group = dist.group.WORLD
    return group.group_name


def _size_rank(group) -> tuple[int, int]:
    """(size, this process's rank) of a resolved group (None: the world, or a ring of one
    without an initialized process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return dist.get_world_size(group), rank


@dataclass(frozen=True)
class Grid:
    """The ranks one sequence is split over: ``heads`` (U ranks; tokens traded for heads by
    an all-to-all) x ``ring`` (R ranks). Rank (u, r) holds piece u of the ring layout's
    shard r, so its place in the sequence's order of shards is r * U + u. A 1-D group is
    the grid with U = 1 (``heads`` None)."""

    heads: object
    ring: object

    @property
    def heads_world(self) -> int:
        return 1 if self.heads is None else _size_rank(self.heads)[0]

    @property
    def heads_rank(self) -> int:
        return 0 if self.heads is None else _size_rank(self.heads)[1]

    @property
    def ring_world(self) -> int:
        return _size_rank(self.ring)[0]

    @property
    def ring_rank(self) -> int:
        return _size_rank(self.ring)[1]

    @property
    def world(self) -> int:
        """The ranks the sequence is split over, U x R."""
        return self.heads_world * self.ring_world

    @property
    def rank(self) -> int:
        """This rank's place in the order of the sequence's shards, r * U + u."""
        return self.ring_rank * self.heads_world + self.heads_rank

    def groups(self) -> list:
        """The groups to reduce over in turn to reduce over the whole grid (heads, ring)."""
        return [g for g, n in ((self.heads, self.heads_world), (self.ring, self.ring_world)) if n > 1]

    def all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """``t`` reduced in place over every rank of the grid (over the heads group, then the
        ring group: the grid is their product). SUM by default."""
        for group in self.groups():
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)
        return t


def resolve_grid(group) -> Grid:
    """The ``Grid`` that ``group`` names: a 1-D group (see ``resolve_group``) is the ring with
    U = 1; a 2-D DeviceMesh or a pair of groups (head_group, ring_group) has both."""
    if isinstance(group, Grid):
        return group
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(group, mesh_type) and group.ndim != 1:
        if group.ndim != 2:
            raise ValueError(f"group: a DeviceMesh of {group.ndim} dimensions; ringflash takes 1 (the "
                             "ring) or 2 (heads all-to-all x ring): pass mesh[(dim0, dim1)] or (mesh, dim)")
        return Grid(group.get_group(0), group.get_group(1))
    if isinstance(group, (tuple, list)) and len(group) == 2 and not (
            mesh_type is not None and isinstance(group[0], mesh_type) and isinstance(group[1], (int, str))):
        heads = resolve_group(group[0], "group[0] (head_group)")
        ring = resolve_group(group[1], "group[1] (ring_group)")
        return Grid(heads if _size_rank(heads)[0] > 1 else None, ring)
    return Grid(None, resolve_group(group))
