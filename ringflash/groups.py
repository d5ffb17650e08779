"""What every ``group=`` argument of ringflash accepts, resolved in one place.

- None: the default (WORLD) process group, or a ring of one without an initialized one;
- a ``torch.distributed.ProcessGroup``;
- a 1-D ``DeviceMesh`` (e.g. ``mesh["sp"]``), meaning its one group;
- a pair ``(mesh, dim)`` of a DeviceMesh and one of its dimensions, by name or index.

Anything else is passed on unchanged, so torch.distributed reports it as it always does
(e.g. ``GroupMember.NON_GROUP_MEMBER`` from ``new_group`` on a rank outside the group).
"""

from __future__ import annotations

import torch.distributed as dist


def _device_mesh_type():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch built without distributed support
        return None
    return DeviceMesh


def resolve_group(group):
    """The ProcessGroup (or None) that ``group`` names; see the module docstring."""
    if group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        return group
    mesh_type = _device_mesh_type()
    if mesh_type is None:
        return group
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
    return group


def group_name(group) -> str:
    """The registered name of a resolved group, by which a torch.library op can find it
    again (``torch.distributed`` resolves it); "" for a ring of one without a process
    group. None means WORLD when a process group is initialized."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return ""
        group = dist.group.WORLD
    return group.group_name
