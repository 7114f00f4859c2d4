"""Build of pynccl: the pure-Python package plus pynccl._C (C++/CUDA, torch.utils.cpp_extension).

This is the one real build (docs/design.md §1); CMakeLists.txt mirrors it for IDEs and C++ tests.
    pip install --no-build-isolation -e .        # against the torch already installed
NCCL comes from the nvidia-nccl wheel torch depends on (nvidia.nccl.__path__), or $NCCL_HOME.
Without a CUDA torch or a CUDA compiler, the pure-Python package still installs (gloo works)
and one line says why _C was not built.
"""
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
SOURCES = [
    "csrc/bindings.cpp",
    "csrc/bucket.cpp",
    "csrc/bucket_reduce.cpp",
    "csrc/buffer_registration.cpp",
    "csrc/collectives.cpp",
    "csrc/communicator.cpp",
    "csrc/nccl_api.cpp",
    "csrc/op_scope.cpp",
    "csrc/p2p.cpp",
    "csrc/watchdog.cpp",
    "csrc/work.cpp",
    "csrc/kernels/bucket.cu",
]


def _skip(reason):
    print(f"pynccl: NOT building pynccl._C ({reason}); the pure-Python package (gloo backend) is installed, "
          f"the nccl backend is unavailable", file=sys.stderr)
    return [], {}


def _find_nccl():
    """(include_dir, lib_dir) of NCCL: $NCCL_HOME, else the nvidia-nccl wheel torch loads."""
    home = os.environ.get("NCCL_HOME")
    if home:
        return os.path.join(home, "include"), next(
            (d for d in (os.path.join(home, "lib"), os.path.join(home, "lib64")) if os.path.isdir(d)),
            os.path.join(home, "lib"))
    try:
        import nvidia.nccl  # namespace package: no __file__
    except ImportError:
        return None, None
    for base in nvidia.nccl.__path__:
        if os.path.exists(os.path.join(base, "include", "nccl.h")):
            return os.path.join(base, "include"), os.path.join(base, "lib")
    return None, None


def _cuda_home_default():
    # torch guesses CUDA_HOME from `which nvcc`; a wrapper script in /usr/local/bin then gives
    # /usr/local, which has no CUDA headers. Prefer a real toolkit when the user set nothing.
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for candidate in ("/usr/local/cuda",):
        if os.path.exists(os.path.join(candidate, "bin", "nvcc")) and \
                os.path.exists(os.path.join(candidate, "include", "cuda_runtime_api.h")):
            os.environ["CUDA_HOME"] = candidate
            return


def _extensions():
    try:
        import torch
    except ImportError as e:
        return _skip(f"torch is not importable: {e}")
    if not torch.version.cuda:
        return _skip(f"torch {torch.__version__} has no CUDA support")
    _cuda_home_default()
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return _skip(f"no CUDA compiler found (CUDA_HOME={CUDA_HOME!r}; set CUDA_HOME to a CUDA toolkit)")
    nccl_include, nccl_lib = _find_nccl()
    if nccl_include is None or not os.path.exists(os.path.join(nccl_include, "nccl.h")):
        return _skip("NCCL headers not found (install torch's nvidia-nccl wheel or set NCCL_HOME)")
    if not os.path.exists(os.path.join(nccl_lib, "libnccl.so.2")):
        return _skip(f"{nccl_lib}/libnccl.so.2 not found")
    if os.environ.get("NCCL_HOME"):
        print("pynccl: linking NCCL from NCCL_HOME; make sure torch loads the same libnccl.so.2, "
              "two copies in one process cause undefined symbols and hangs", file=sys.stderr)
    # NOTE: link the very file torch loads, by soname (-l:libnccl.so.2: the wheel has no unversioned
    # .so), so the dynamic loader reuses the copy torch already mapped: one libnccl per process.
    rpaths = ["$ORIGIN/../nvidia/nccl/lib", nccl_lib]
    link_args = [f"-L{nccl_lib}", "-l:libnccl.so.2", "-ldl"] + [f"-Wl,-rpath,{p}" for p in rpaths]
    ext = CUDAExtension(
        name="pynccl._C",
        sources=SOURCES,
        include_dirs=[os.path.join(ROOT, "csrc"), nccl_include],
        extra_compile_args={
            "cxx": ["-O3", "-Wall", "-Wno-unknown-pragmas", "-Wno-sign-compare"],
            "nvcc": ["-O3", "--expt-relaxed-constexpr"],
        },
        extra_link_args=link_args,
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    packages=find_packages(include=["pynccl", "pynccl.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
