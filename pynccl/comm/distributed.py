"""torch.distributed-like API: process groups, rendezvous, and every collective.

The public surface users import (pynccl re-exports it); groups.py holds the groups and their
life cycle, collectives.py the collectives, p2p.py the point-to-point ops, the other modules what
torch has beyond them (subgroups, object collectives, monitored_barrier, coalesced ops, torch group
interop). tests/test_conformance.py holds every name here that torch.distributed also has to
torch's signature and results.
"""
from .backend_names import is_available, is_gloo_available, is_nccl_available
from .coalesced_ops import all_gather_coalesced, all_reduce_coalesced
from .collectives import (all_gather, all_gather_into_tensor, all_reduce, all_to_all, all_to_all_single, barrier,
                          broadcast, gather, reduce, reduce_scatter, reduce_scatter_tensor, scatter)
from .groups import (ProcessGroup, abort_process_group, destroy_process_group, flight_record, get_backend,
                     get_default_group, get_device, get_process_group_ranks, get_rank, get_store, get_world_size,
                     init_process_group, is_initialized, new_group, resolve_group, to_torch_group)
from .monitored_barrier import monitored_barrier
from .object_collectives import (all_gather_object, broadcast_object_list, gather_object, recv_object_list,
                                 scatter_object_list, send_object_list)
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .subgroups import get_global_rank, get_group_rank, new_subgroups, new_subgroups_by_enumeration, split_group
from .work_future import install as _install_work_api

_install_work_api()

__all__ = [
    "P2POp", "ProcessGroup", "abort_process_group", "all_gather", "all_gather_coalesced", "all_gather_into_tensor",
    "all_gather_object", "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier",
    "batch_isend_irecv", "broadcast", "broadcast_object_list", "destroy_process_group", "flight_record", "gather",
    "gather_object", "get_backend", "get_default_group", "get_device", "get_global_rank", "get_group_rank",
    "get_process_group_ranks", "get_rank", "get_store", "get_world_size", "init_process_group", "irecv",
    "is_available", "is_gloo_available", "is_initialized", "is_nccl_available", "isend", "monitored_barrier",
    "new_group", "new_subgroups", "new_subgroups_by_enumeration", "recv", "recv_object_list", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "send_object_list",
    "split_group", "to_torch_group",
]
