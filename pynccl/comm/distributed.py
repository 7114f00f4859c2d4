"""torch.distributed-like API: process groups, rendezvous, and every collective.

The public surface users import (pynccl re-exports it); groups.py holds the groups and their
life cycle, collectives.py the ops.
"""
from .collectives import (all_gather, all_gather_into_tensor, all_gather_object, all_reduce, all_to_all,
                          all_to_all_single, barrier, batch_isend_irecv, broadcast, broadcast_object_list, gather,
                          irecv, isend, recv, reduce, reduce_scatter, reduce_scatter_tensor, scatter, send)
from .groups import (ProcessGroup, abort_process_group, destroy_process_group, flight_record, get_backend,
                     get_default_group, get_device, get_process_group_ranks, get_rank, get_store, get_world_size,
                     init_process_group, is_initialized, new_group)

__all__ = [
    "ProcessGroup", "abort_process_group", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "destroy_process_group", "flight_record", "gather", "get_backend", "get_default_group", "get_device",
    "get_process_group_ranks", "get_rank", "get_store", "get_world_size", "init_process_group", "irecv",
    "is_initialized", "isend", "new_group", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "send",
]
