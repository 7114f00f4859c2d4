"""Names a package exports from a submodule that is imported only when one of them is first used
(PEP 562), for submodules whose imports cost seconds (torch.distributed.checkpoint, DTensor)."""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Sequence, Tuple


def lazy_exports(package: str, submodule: str, names: Sequence[str], namespace: Dict[str, object]
                 ) -> Tuple[Callable[[str], object], Callable[[], list]]:
    """(__getattr__, __dir__) for package `package` that serve `names` from `package.submodule`."""
    names = tuple(names)

    def __getattr__(name: str):
        if name in names:
            return getattr(importlib.import_module(f"{package}.{submodule}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
