"""The two ways the benchmark can run an op: pynccl's API or torch.distributed's.

Both expose the same torch.distributed-shaped functions (all_reduce(tensor, op, group), P2POp,
batch_isend_irecv, ...), so each op file is written once against `impl.api` and `impl.group`;
only the reduction-operator objects and the group differ.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist

import pynccl


@dataclass
class Impl:
    name: str                    # "pynccl" or "torch": the column and JSON label
    label: str                   # what the header says it is
    api: object                  # module with the torch.distributed-shaped functions
    group: object                # passed as the `group` argument (None: pynccl's default group)
    redops: dict = field(repr=False)   # "sum" -> the api's ReduceOp
    # The pynccl Backend whose all_reduce/reduce/broadcast take output= (one NCCL call for the
    # out-of-place rows), or None where the API is in-place only (torch: copy_ + op).
    get_backend: object = field(default=None, repr=False)

    def out_of_place_backend(self):
        return self.get_backend() if self.get_backend is not None else None

    def redop(self, name):
        return self.redops.get(name) if name is not None else None


def pynccl_impl() -> Impl:
    R = pynccl.ReduceOp
    return Impl("pynccl", f"pynccl {pynccl.__version__} ({pynccl.get_backend()} backend)", pynccl, None,
                {"sum": R.SUM, "prod": R.PRODUCT, "max": R.MAX, "min": R.MIN, "avg": R.AVG},
                lambda: pynccl.get_default_group().backend)


def _torch_api():
    """torch.distributed, with the names torch itself recommends where it deprecated ours (torch ≥ 2.14
    warns on every all_gather_into_tensor / reduce_scatter_tensor call: that would be timed too)."""
    names = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_to_all_single", "gather", "scatter", "P2POp", "isend", "irecv", "batch_isend_irecv")
    api = types.SimpleNamespace(**{n: getattr(tdist, n) for n in names})
    api.all_gather_into_tensor = getattr(tdist, "all_gather_single", tdist.all_gather_into_tensor)
    api.reduce_scatter_tensor = getattr(tdist, "reduce_scatter_single", tdist.reduce_scatter_tensor)
    return api


def torch_impl(device: torch.device, timeout_s: float) -> Impl:
    """torch.distributed on its own process group over the same ranks: NCCL on CUDA, gloo on CPU.

    NOTE: collective — every rank creates it, in the same order relative to other new_group calls.
    pynccl.init_process_group left torch.distributed's default group on the same store.
    """
    import datetime
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = tdist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    R = tdist.ReduceOp
    label = f"torch.distributed {torch.__version__} ({backend})"
    if backend == "nccl":
        label += " NCCL " + ".".join(str(v) for v in torch.cuda.nccl.version())
    return Impl("torch", label, _torch_api(), group,
                {"sum": R.SUM, "prod": R.PRODUCT, "max": R.MAX, "min": R.MIN, "avg": R.AVG})


def make_impls(which: str, device: torch.device, timeout_s: float) -> list:
    """The implementations to run, primary first (its rows are the nccl-tests table)."""
    impls = []
    if which in ("pynccl", "both"):
        impls.append(pynccl_impl())
    if which in ("torch", "both"):
        impls.append(torch_impl(device, timeout_s))
    return impls
