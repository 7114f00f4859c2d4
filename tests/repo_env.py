"""The environment a test's subprocess runs in: this checkout first on PYTHONPATH (so a script,
torchrun worker or `python -m` imports this tree's pynccl and benchmarks, not an installed copy),
then whatever PYTHONPATH the suite itself runs with."""
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pythonpath() -> str:
    """The checkout, then the suite's own PYTHONPATH (if any)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def subprocess_env(**extra: str) -> dict:
    """os.environ with pythonpath() as PYTHONPATH, plus `extra` (names to values)."""
    return dict(os.environ, PYTHONPATH=pythonpath(), **extra)
