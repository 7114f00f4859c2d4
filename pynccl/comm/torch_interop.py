"""torch.distributed's groups accepted as pynccl groups.

torch -> pynccl: a torch ProcessGroup (torch.distributed.new_group, init_device_mesh(...).get_group()),
or a 1-D DeviceMesh (its group), is accepted wherever pynccl takes a group, through
groups.resolve_group. It is mapped to a pynccl
group of the same global ranks in the same order, made once and cached weakly per torch group.
Torch hands a group object only to its members (the others get GroupMember.NON_GROUP_MEMBER), so
the pynccl group is made by the members alone, never by a split of the default communicator:
  * nccl: a new communicator from a unique id that the group's first rank publishes in the store
    (ncclCommInitRank over the members, as torch's own lazy NCCL init does);
  * gloo: the torch group itself where it has a CPU (gloo) backend, else a gloo torch group of the
    same ranks made with use_local_synchronization=True.
NOTE: so the first use of a torch group is collective over that group's members: each of them must
reach it (any pynccl call with the group) before the others can go on, as with torch's NCCL groups.

pynccl -> torch: the other way is ProcessGroup.torch_group (process_group.py), spelled
pynccl.to_torch_group(g) as in groups.py.
"""
from __future__ import annotations

import torch.distributed as tdist

from . import rendezvous
from .members_only_groups import new_members_only_group
from .process_group import ProcessGroup, _maybe_checked, _state, get_default_group, torch_backend_name


def _is_device_mesh(obj) -> bool:
    # NOTE: by the class torch defines, looked up only if torch's device_mesh module is loaded (a
    # DeviceMesh cannot exist otherwise), so this costs no import.
    import sys
    module = sys.modules.get("torch.distributed.device_mesh")
    return module is not None and isinstance(obj, module.DeviceMesh)


def from_torch_group(pg) -> ProcessGroup:
    """The pynccl group of torch group `pg`, or of a 1-D torch DeviceMesh's group (TypeError for
    anything else)."""
    if _is_device_mesh(pg):
        if pg.ndim != 1:
            raise ValueError(f"group: a {pg.ndim}-D DeviceMesh {tuple(pg.mesh_dim_names or ())} stands for no one "
                             f"group; pass one dimension (mesh['tp'] or mesh.get_group('tp'))")
        pg = pg.get_group()
    if not isinstance(pg, tdist.ProcessGroup):
        raise TypeError(f"group must be a pynccl ProcessGroup (pynccl.new_group), a torch.distributed "
                        f"ProcessGroup, a 1-D torch DeviceMesh, or None; got {type(pg).__name__}")
    cached = _state.torch_groups.get(pg)
    if cached is not None:
        return cached
    world = get_default_group()
    ranks = tdist.get_process_group_ranks(pg)
    if ranks == list(range(world.world_size)):
        group = world   # NOTE: the same ranks in the same order: the default communicator serves it
    else:
        if max(ranks) >= world.world_size:
            raise ValueError(f"torch group {pg.group_name!r} has global ranks {ranks}, beyond pynccl's default "
                             f"group of {world.world_size} ranks")
        group = _members_only_group(pg, ranks, world)
    _state.torch_groups[pg] = group
    return group


def _members_only_group(pg, ranks, world: ProcessGroup) -> ProcessGroup:
    group_rank = ranks.index(world.group_rank)
    # NOTE: torch gives a group the same name on all its members; the use count keeps the store key
    # fresh if a group of that name is mapped again (a new torch group after destroy, a new init).
    uses = _state.torch_group_uses.get(pg.group_name, 0) + 1
    _state.torch_group_uses[pg.group_name] = uses
    name = f"torch:{pg.group_name}" + (f"#{uses}" if uses > 1 else "")
    timeout_s = world.timeout_s
    if world.backend_name == "gloo":
        from .backends.gloo import GlooBackend
        if "gloo" in torch_backend_name(pg):
            backend = GlooBackend(pg, group_rank, len(ranks), timeout_s, name, owns_pg=False)
        else:
            gloo_pg = new_members_only_group(ranks, "gloo", timeout_s, f"gloo/{name}")
            backend = GlooBackend(gloo_pg, group_rank, len(ranks), timeout_s, name)
    else:
        from .backends.nccl import NcclBackend
        prefix = f"{_state.key_prefix}/torch_group/{pg.group_name}/{uses}"
        unique_id = rendezvous.exchange_unique_id(_state.store, prefix, group_rank, timeout_s)
        backend = NcclBackend.create(unique_id, len(ranks), group_rank, world.backend.device, timeout_s, name=name)
    group = ProcessGroup(_maybe_checked(backend, name), ranks, name, timeout_s, world.backend_name)
    group._torch_group = pg
    _state.groups.append(group)
    return group

