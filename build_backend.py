"""PEP 517 build backend: setuptools' own, except that a build-isolated wheel build asks for the
torch the target environment already has.

pynccl._C is a torch C++ extension: it only loads into the torch it was compiled against. With a
static `requires = ["torch"]`, `pip install .` would build against the newest torch in a throw-away
environment and install the result next to an older one. So `get_requires_for_build_wheel` looks up
the torch of the interpreter pip runs for (without importing it) and pins exactly that version;
setup.py re-checks the torch it actually got (`check_build_torch_matches_target`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every hook we do not override)

# The oldest torch pynccl has been built and tested with (torch 2.11+cu130 on the GPU machines).
TORCH_LOWER_BOUND = "2.11"

# Runs in the target interpreter: the installed torch's distribution version ("2.14.1") and its
# torch/version.py (`__version__ = "2.14.1+cu130"`, `cuda = "13.0"`), read without importing torch.
_PROBE = r"""
import importlib.metadata, importlib.util, json, os
spec = importlib.util.find_spec("torch")
if spec is None or not spec.submodule_search_locations:
    print("null")
else:
    ns = {}
    with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
        exec(f.read(), ns)
    print(json.dumps({"dist_version": importlib.metadata.version("torch"),
                      "version": ns.get("__version__"), "cuda": ns.get("cuda")}))
"""


def _outside_build_env() -> dict:
    """os.environ without what pip / build add to isolate the build (their site dir on PYTHONPATH)."""
    env = dict(os.environ)
    env.pop("PYTHONNOUSERSITE", None)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and "build-env-" not in p]  # pip's pip-build-env-*, build's build-env-*
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        env.pop("PYTHONPATH", None)
    return env


def target_torch() -> Optional[dict]:
    """The torch installed for sys.executable outside any build isolation, or None.

    pip runs the build hooks with the interpreter it installs for, so this is the environment the
    wheel lands in ({"dist_version", "version", "cuda"}); `python -m build` runs them in its own
    fresh venv, which has no torch: None.
    """
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], env=_outside_build_env(), cwd=os.sep,
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return json.loads(out.strip().splitlines()[-1]) if out.strip() else None


def torch_requirement(installed: Optional[dict]) -> str:
    """The torch a wheel build needs: exactly the installed one, else any at or above the bound."""
    if installed is None:
        return f"torch>={TORCH_LOWER_BOUND}"
    return f"torch=={installed['dist_version']}"


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + [torch_requirement(target_torch())]


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + [torch_requirement(target_torch())]
