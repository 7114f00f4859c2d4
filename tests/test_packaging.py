"""The packaging rules a build depends on: the default GPU arch list without a GPU, the torch an
isolated build asks for, and the warning when a GPU is visible but pynccl._C is not. The builds
themselves (pip install ., sdist -> wheel) run in .ci/check_package."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from repo_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_pynccl_{name}", os.path.join(ROOT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup.py calls setup() only as __main__
    return module


def test_default_arch_list_is_torchs_archs_that_nvcc_supports():
    setup = _load("setup")
    torch_cu130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    nvcc_13 = ["compute_75", "compute_80", "compute_86", "compute_87", "compute_88", "compute_89",
               "compute_90", "compute_100", "compute_110", "compute_103", "compute_120", "compute_121"]
    assert setup.default_arch_list(torch_cu130, nvcc_13) == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
    # an older nvcc drops what it cannot compile; the PTX goes with the newest that is left
    assert setup.default_arch_list(torch_cu130, ["compute_75", "compute_80", "compute_90"]) == "7.5;8.0;9.0+PTX"
    # arch-specific 'a' targets run on one GPU generation only: not a default
    assert setup.default_arch_list(["sm_90", "sm_90a", "compute_90"], None) == "9.0+PTX"
    assert setup.default_arch_list(["sm_50"], ["compute_75"]) == ""


def test_isolated_build_asks_for_the_installed_torch():
    backend = _load("build_backend")
    installed = backend.target_torch()
    import torch  # the test interpreter's own torch is what an install into this env would use
    assert installed is not None and installed["version"] == torch.__version__
    assert installed["cuda"] == torch.version.cuda
    assert backend.torch_requirement(installed) == f"torch=={installed['dist_version']}"
    assert installed["version"].startswith(installed["dist_version"])
    assert backend.torch_requirement(None) == f"torch>={backend.TORCH_LOWER_BOUND}"


def test_build_against_another_torch_than_installed_stops_with_the_fix(monkeypatch):
    setup = _load("setup")
    import build_backend  # setup.py put the repo root on sys.path
    import torch
    same = {"dist_version": "x", "version": torch.__version__, "cuda": torch.version.cuda}
    monkeypatch.setattr(build_backend, "target_torch", lambda: same)
    setup.check_build_torch_matches_target(torch)  # the installed torch: nothing to say
    # Another torch than the installed one, whichever that is (on a host with torch 2.11.0+cu130 a
    # literal "2.11.0+cu130" would be the same one).
    other = "2.11.0+cu130" if torch.__version__ != "2.11.0+cu130" else "2.12.0+cu130"
    monkeypatch.setattr(build_backend, "target_torch", lambda: dict(same, version=other))
    with pytest.raises(SystemExit, match=rf"installed into has torch {re.escape(other)} .*--no-build-isolation"):
        setup.check_build_torch_matches_target(torch)
    other_cuda = "12.8" if torch.version.cuda != "12.8" else "13.0"
    monkeypatch.setattr(build_backend, "target_torch", lambda: dict(same, cuda=other_cuda))
    with pytest.raises(SystemExit, match=rf"\(CUDA {re.escape(other_cuda)}\)"):
        setup.check_build_torch_matches_target(torch)


_WARNING_PROBE = r"""
import sys, warnings, importlib
import torch
sys.modules["pynccl._C"] = None  # makes `import pynccl._C` raise ImportError, as when it was not built
torch.version.cuda = torch.version.cuda or "13.0"
counts = []
for gpus in (0, 2):
    torch.cuda.device_count = lambda: gpus
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import pynccl._ext
        importlib.reload(pynccl._ext)
    counts.append([str(w.message) for w in caught if "pynccl._C" in str(w.message)])
print(repr(counts))
"""


def test_missing_extension_warns_only_where_a_gpu_is_visible():
    env = subprocess_env()
    env.pop("PYNCCL_WARN_NO_EXTENSION", None)
    out = subprocess.run([sys.executable, "-c", _WARNING_PROBE], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    without_gpu, with_gpu = eval(out.stdout.strip().splitlines()[-1])
    assert without_gpu == [], without_gpu
    assert len(with_gpu) == 1 and "a GPU is visible" in with_gpu[0] and "--no-build-isolation" in with_gpu[0], with_gpu
