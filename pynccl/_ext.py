"""Loading of the C++ extension pynccl._C and what it reports about NCCL.

_C is imported once, eagerly: a machine without it (no CUDA torch, no nvcc) must still import
pynccl and run the gloo backend. Whoever needs _C calls `require_extension(what)`, which raises an
ImportError that says how to build it and carries the original import error. Where a GPU is
visible, a missing _C is almost always a surprise (pip hides the build's notice), so importing
pynccl then warns once (silence it with PYNCCL_WARN_NO_EXTENSION=0).
"""
from __future__ import annotations

import importlib
import os
import warnings
from typing import NamedTuple, Optional, Tuple

import torch  # noqa: F401  (loads libtorch and torch's libnccl.so.2 before _C needs them)

try:
    # NOTE: import_module, not `from pynccl import _C`: when _C is missing the latter reports a
    # misleading "circular import" (pynccl is still initialising here).
    _C = importlib.import_module("pynccl._C")
    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as e:  # not built, or built against another torch/NCCL
    _C = None
    _IMPORT_ERROR = e

_BUILD_HINT = (
    "build it with `pip install --no-build-isolation -e .` (or `pip install --no-build-isolation .`) from "
    "the pynccl source, with a CUDA build of torch and a CUDA compiler (nvcc; set CUDA_HOME if it is not "
    "found) installed; an _C built against another torch does not load"
)


def _warn_if_gpu_without_extension() -> None:
    # NOTE: device_count() asks NVML where it can, which does not initialise CUDA in this process
    # (a later fork stays usable); it is only reached when _C is missing.
    if _C is not None or os.environ.get("PYNCCL_WARN_NO_EXTENSION") == "0" or not torch.version.cuda:
        return
    if torch.cuda.device_count() == 0:
        return
    warnings.warn(f"pynccl: a GPU is visible but pynccl's C++ extension (pynccl._C) could not be imported "
                  f"({_IMPORT_ERROR}), so backend='nccl' is unavailable (torch {torch.__version__}); "
                  f"{_BUILD_HINT}. PYNCCL_WARN_NO_EXTENSION=0 silences this.", RuntimeWarning, stacklevel=2)


_warn_if_gpu_without_extension()


def available() -> bool:
    """True when pynccl._C imported (the nccl backend can be used)."""
    return _C is not None


def import_error() -> Optional[BaseException]:
    """Why pynccl._C did not import, or None."""
    return _IMPORT_ERROR


def require_extension(what: str):
    """Return pynccl._C, or raise an ImportError saying that `what` needs it and how to build it."""
    if _C is not None:
        return _C
    raise ImportError(f"{what} needs pynccl's C++ extension (pynccl._C), which could not be imported: "
                      f"{_IMPORT_ERROR!r}; {_BUILD_HINT}") from _IMPORT_ERROR


def _decode(code: int) -> Tuple[int, int, int]:
    # NCCL_VERSION(X, Y, Z): X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z after.
    if code < 10000:
        return code // 1000, (code % 1000) // 100, code % 100
    return code // 10000, (code % 10000) // 100, code % 100


class NcclVersion(NamedTuple):
    build: Tuple[int, int, int]    # NCCL_VERSION_CODE of the headers _C was compiled with
    runtime: Tuple[int, int, int]  # ncclGetVersion() of the libnccl loaded in this process


def nccl_version() -> NcclVersion:
    """NCCL versions as (major, minor, patch): the build-time headers' and the loaded library's."""
    c = require_extension("pynccl.nccl_version()")
    return NcclVersion(build=_decode(c.nccl_version_build()), runtime=_decode(c.nccl_version_runtime()))


def loaded_nccl_libraries() -> list:
    """Paths of every libnccl mapped into this process (docs/design.md §1: there must be one)."""
    paths = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "libnccl.so" in path.rsplit("/", 1)[-1]:
                    paths.add(path)
    except OSError:  # not Linux
        pass
    return sorted(paths)
