"""Which backend: torch's ways of naming one (None, "nccl", "NCCL", Backend.NCCL,
"cpu:gloo,cuda:nccl") mapped to pynccl's one backend per group, and whether each can run here.
"""
from __future__ import annotations

import torch


def _default_backend() -> str:
    """torch's backend=None: the device's backend. "nccl" needs CUDA and the built extension."""
    from .. import _ext
    return "nccl" if torch.cuda.is_available() and _ext._C is not None else "gloo"


def parse_backend(fn: str, backend) -> str:
    """pynccl's backend ("nccl" or "gloo") for a backend as torch takes it: None, "nccl", "gloo",
    torch.distributed.Backend.NCCL (a str), any case ("NCCL"), or torch's per-device string
    ("cpu:gloo,cuda:nccl"). A pynccl group runs one backend: "cuda:nccl" in the string makes it
    nccl (CUDA tensors; CPU tensors then go through torch.distributed's own default group, which
    pynccl makes "cpu:gloo,cuda:nccl" as torch would), else gloo (CPU tensors)."""
    if backend is None:
        return _default_backend()
    if not isinstance(backend, str):
        raise TypeError(f"{fn}: backend must be a str (e.g. 'nccl', 'gloo', torch.distributed.Backend.NCCL or "
                        f"'cpu:gloo,cuda:nccl') or None, got {type(backend).__name__}")
    name = backend.strip().lower()
    if name in ("nccl", "gloo"):
        return name
    if ":" in name:
        pairs = {}
        for pair in name.split(","):
            device, _, impl = pair.strip().partition(":")
            if not impl or device in pairs:
                raise ValueError(f"{fn}: backend {backend!r} is not torch's '<device>:<backend>,...' form "
                                 f"(e.g. 'cpu:gloo,cuda:nccl')")
            pairs[device] = impl
        unsupported = [f"{d}:{b}" for d, b in pairs.items() if (d, b) not in (("cpu", "gloo"), ("cuda", "nccl"))]
        if not unsupported:
            return "nccl" if "cuda" in pairs else "gloo"
        raise ValueError(f"{fn}: backend {backend!r}: pynccl runs cpu:gloo and cuda:nccl, not "
                         f"{', '.join(unsupported)} (pynccl's gloo groups take CPU tensors only)")
    raise ValueError(f"{fn}: backend must be 'nccl', 'gloo', torch's 'cpu:gloo,cuda:nccl' form or None, got "
                     f"{backend!r}")


def is_available() -> bool:
    """torch's is_available: whether the distributed package works here (torch.distributed, under
    every pynccl group, is built)."""
    import torch.distributed as tdist
    return tdist.is_available()


def is_nccl_available() -> bool:
    """Whether backend='nccl' can run: pynccl's extension is built and loaded."""
    from .. import _ext
    return _ext._C is not None


def is_gloo_available() -> bool:
    import torch.distributed as tdist
    return tdist.is_available() and tdist.is_gloo_available()
