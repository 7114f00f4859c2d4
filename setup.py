"""Build of pynccl: the pure-Python package plus pynccl._C (C++/CUDA, torch.utils.cpp_extension).

This is the one real build (docs/design.md §1); CMakeLists.txt mirrors it for IDEs and C++ tests.
    pip install --no-build-isolation -e .        # against the torch already installed
    pip install .                                # isolated: build_backend.py pins the installed torch
NCCL comes from the nvidia-nccl wheel torch depends on (nvidia.nccl.__path__), or $NCCL_HOME.
GPU archs: $TORCH_CUDA_ARCH_LIST, else the visible GPUs' (torch's rule), else with no GPU the archs
torch was built for that the local nvcc supports (`default_arch_list`).
Without a CUDA torch or a CUDA compiler (or with PYNCCL_BUILD_EXTENSION=0), the pure-Python package
still installs (gloo works), the build prints why _C was not built, and `import pynccl` warns when
a GPU is visible.
"""
import glob
import os
import re
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)  # build_backend.py beside this file, whoever runs setup.py
SOURCES = [
    "csrc/bindings.cpp",
    "csrc/bucket.cpp",
    "csrc/bucket_reduce.cpp",
    "csrc/buffer_registration.cpp",
    "csrc/collectives.cpp",
    "csrc/comm_config.cpp",
    "csrc/comm_stream.cpp",
    "csrc/communicator.cpp",
    "csrc/nccl_api.cpp",
    "csrc/op_scope.cpp",
    "csrc/p2p.cpp",
    "csrc/symmetric_memory.cpp",
    "csrc/tp_exchange.cpp",
    "csrc/tp_overlap.cpp",
    "csrc/watchdog.cpp",
    "csrc/work.cpp",
    "csrc/kernels/bucket.cu",
]


# Headers the sources include: a change to one must rebuild _C (setuptools compares only these
# and the sources against the built .so before it hands over to ninja).
DEPENDS = sorted(glob.glob(os.path.join("csrc", "*.h")) + glob.glob(os.path.join("csrc", "kernels", "*.cuh")))

# Commands that need pynccl._C; anything else (sdist, egg_info, dist_info) only needs the metadata.
_BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "bdist_egg", "editable_wheel", "develop", "install"}


def _skip(reason):
    rule = "=" * 100
    print(f"\n{rule}\npynccl: NOT building pynccl._C: {reason}.\n"
          f"pynccl: the pure-Python package is installed (gloo backend); backend='nccl' is unavailable.\n"
          f"{rule}\n", file=sys.stderr)
    return [], {}


def _arch_number(name):
    """'sm_90' / 'compute_90' / 'sm_90a' -> (90, 'a'); None for anything else."""
    m = re.fullmatch(r"(?:sm|compute)_(\d+)([a-z]?)", name)
    return (int(m.group(1)), m.group(2)) if m else None


def default_arch_list(torch_archs, nvcc_archs):
    """TORCH_CUDA_ARCH_LIST for a build with no GPU to look at: the archs torch itself was built
    for (torch.cuda.get_arch_list()) that the local nvcc can compile (`nvcc --list-gpu-arch`;
    None: unknown, keep all), plus PTX of the newest so later GPUs JIT it. '' if none is left.
    ['sm_75', 'sm_90', 'sm_120'], ['compute_75', 'compute_90'] -> '7.5;9.0+PTX'
    """
    supported = None if nvcc_archs is None else {_arch_number(a)[0] for a in nvcc_archs if _arch_number(a)}
    numbers = sorted({_arch_number(a)[0] for a in torch_archs
                      if _arch_number(a) and not _arch_number(a)[1]})  # 'a' variants are not portable
    numbers = [n for n in numbers if supported is None or n in supported]
    if not numbers:
        return ""
    names = [f"{n // 10}.{n % 10}" for n in numbers]
    return ";".join(names) + "+PTX"


def _nvcc_archs(cuda_home):
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split()


def _set_default_arch_list(torch, cuda_home):
    """Without TORCH_CUDA_ARCH_LIST and without a GPU, torch's cpp_extension fails
    (IndexError in _get_cuda_arch_flags); choose `default_arch_list` and say so."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count() > 0:
        return
    archs = default_arch_list(torch.cuda.get_arch_list(), _nvcc_archs(cuda_home))
    if not archs:
        raise SystemExit(f"pynccl: no GPU is visible and none of torch's archs {torch.cuda.get_arch_list()} "
                         f"is supported by {cuda_home}/bin/nvcc; set TORCH_CUDA_ARCH_LIST (e.g. '9.0')")
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    print(f"pynccl: TORCH_CUDA_ARCH_LIST is not set and no GPU is visible: building for {archs} "
          f"(the archs torch {torch.__version__} was built for that this nvcc supports)", file=sys.stderr)


def check_build_torch_matches_target(torch):
    """An isolated build (`pip install .`) compiles against the torch pip put into the build
    environment; _C only loads into that same torch. Stop when the environment being installed
    into has another one (build_backend.py pins the installed version, so this is the safety net)."""
    from build_backend import target_torch
    import importlib.metadata
    target = target_torch()
    if target is None:
        return
    built = {"dist_version": importlib.metadata.version("torch"), "version": torch.__version__,
             "cuda": torch.version.cuda}
    if (built["version"], built["cuda"]) != (target["version"], target["cuda"]):
        raise SystemExit(
            f"pynccl: the build environment has torch {built['version']} (CUDA {built['cuda']}) but the "
            f"environment pynccl is installed into has torch {target['version']} (CUDA {target['cuda']}); "
            f"pynccl._C only loads into the torch it was compiled against. Install with "
            f"`pip install --no-build-isolation .` (or `pip wheel --no-build-isolation .`) so it builds "
            f"against the installed torch.")


def _rpaths(nccl_lib):
    # NOTE: torch is imported first and has libnccl.so.2 loaded already, so these are a fallback.
    # $ORIGIN/../nvidia/nccl/lib is the nvidia-nccl wheel beside an installed pynccl. The absolute
    # path serves an in-place/editable build, but not when it points into the environment of an
    # isolated build, which pip (pip-build-env-*) or build (build-env-*) deletes afterwards.
    rpaths = ["$ORIGIN/../nvidia/nccl/lib"]
    if "build-env-" not in os.path.realpath(nccl_lib):
        rpaths.append(nccl_lib)
    return rpaths


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
    if os.environ.get("PYNCCL_BUILD_EXTENSION", "1") == "0":
        return _skip("PYNCCL_BUILD_EXTENSION=0")
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
    check_build_torch_matches_target(torch)
    _set_default_arch_list(torch, CUDA_HOME)
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
    link_args = [f"-L{nccl_lib}", "-l:libnccl.so.2", "-ldl"] + [f"-Wl,-rpath,{p}" for p in _rpaths(nccl_lib)]
    ext = CUDAExtension(
        name="pynccl._C",
        sources=SOURCES,
        depends=DEPENDS,
        include_dirs=[os.path.join(ROOT, "csrc"), nccl_include],
        extra_compile_args={
            "cxx": ["-O3", "-Wall", "-Wno-unknown-pragmas", "-Wno-sign-compare"],
            "nvcc": ["-O3", "--expt-relaxed-constexpr"],
        },
        extra_link_args=link_args,
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


def _check_setuptools() -> None:
    """pyproject.toml's `license = "Apache-2.0"` (PEP 639) needs setuptools >= 77. A build-isolated
    pip gets it from [build-system]; with --no-build-isolation the environment's own setuptools
    runs, and an older one fails on that line with a schema error that does not say why."""
    import setuptools
    major = int(re.match(r"\d+", setuptools.__version__).group())
    if major < 77:
        sys.exit(f"pynccl: setuptools {setuptools.__version__} is too old to read pyproject.toml (needs >= 77); "
                 f"run `pip install -U setuptools` first (with --no-build-isolation pip uses the installed one)")


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import the helpers above
    _check_setuptools()
    needs_extension = not _BUILD_COMMANDS.isdisjoint(sys.argv[1:])
    ext_modules, cmdclass = _extensions() if needs_extension else ([], {})
    setup(
        packages=find_packages(include=["pynccl", "pynccl.*"]),
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )
