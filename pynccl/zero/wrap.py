"""Which submodules become stage-3 units (all-gathered together, freed together).

A unit should be a block the forward runs once and in order, big enough that its
all-gather is bandwidth- rather than latency-bound: a transformer layer is the textbook
choice. "auto" picks the children of every nn.ModuleList (how GPT/LLaMA-style models hold
their layers), else the root's direct children. Units never nest: only the outermost
selected module counts. Parameters outside every unit belong to the root unit.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Union

from torch import nn

WrapSpec = Union[None, str, Sequence[Union[type, nn.Module]], Callable[[nn.Module], bool]]


def _auto(root: nn.Module) -> List[nn.Module]:
    picked = [child for m in root.modules() if isinstance(m, nn.ModuleList) for child in m.children()]
    if picked:
        return picked
    return [c for c in root.children() if any(True for _ in c.parameters())]


def select_unit_modules(root: nn.Module, wrap_modules: WrapSpec) -> List[nn.Module]:
    """Outermost selected submodules of `root`, in root.named_modules() order."""
    if wrap_modules is None or (isinstance(wrap_modules, str) and wrap_modules == "auto"):
        chosen = _auto(root)
        is_chosen = lambda m: any(m is c for c in chosen)  # noqa: E731
    elif isinstance(wrap_modules, (list, tuple, set)):
        types = tuple(w for w in wrap_modules if isinstance(w, type))
        instances = [w for w in wrap_modules if isinstance(w, nn.Module)]
        bad = [w for w in wrap_modules if not (isinstance(w, type) and issubclass(w, nn.Module))
               and not isinstance(w, nn.Module)]
        if bad:
            raise TypeError(f"FullyShardedDataParallel: wrap_modules entries must be nn.Module classes or "
                            f"submodules, got {bad[0]!r}")
        is_chosen = lambda m: isinstance(m, types) or any(m is i for i in instances)  # noqa: E731
    elif callable(wrap_modules):
        is_chosen = wrap_modules
    else:
        raise TypeError(f"FullyShardedDataParallel: wrap_modules must be None, 'auto', a list of module classes or "
                        f"submodules, or a callable(module) -> bool, got {type(wrap_modules).__name__}")
    units: List[nn.Module] = []
    unit_prefixes: List[str] = []
    for name, m in root.named_modules():
        if m is root or not is_chosen(m):
            continue
        if any(name.startswith(p) for p in unit_prefixes):
            continue                                   # inside an already chosen unit
        units.append(m)
        unit_prefixes.append(name + ".")
    return units
