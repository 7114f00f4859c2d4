"""Which submodules become stage-3 units (all-gathered together, freed together).

A unit should be a block the forward runs once and in order, big enough that its
all-gather is bandwidth- rather than latency-bound: a transformer layer is the textbook
choice. "auto" picks the children of every nn.ModuleList (how GPT/LLaMA-style models hold
their layers), else the root's direct children. Units never nest: only the outermost
selected module counts. Parameters outside every unit belong to the root unit.

With layers found, "auto" also makes a unit of every other module that holds, itself, at least
a quarter of an average layer's parameters: an untied token embedding and LM head (a Llama's
are 1.07 layers each at 1B). The root unit is gathered before the forward starts and reduced
after backward ends, both exposed; as units, the head's gather and reduce-scatter overlap the
layers' compute, and the embedding's gather is half the root's. A weight tied between two such
modules (GPT-2's wte / lm_head) stays in the root: a parameter used by two units belongs to none.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Union

from torch import nn

WrapSpec = Union[None, str, Sequence[Union[type, nn.Module]], Callable[[nn.Module], bool]]


def _numel(m: nn.Module, recurse: bool = True) -> int:
    return sum(p.numel() for p in m.parameters(recurse=recurse))


def _auto(root: nn.Module) -> List[nn.Module]:
    layers = [child for m in root.modules() if isinstance(m, nn.ModuleList) for child in m.children()]
    if not layers:
        return [c for c in root.children() if any(True for _ in c.parameters())]
    inside = {id(sub) for layer in layers for sub in layer.modules()}
    layer_ids = {id(layer) for layer in layers}
    threshold = max(1.0, sum(_numel(layer) for layer in layers) / len(layers) / 4)
    holders = {}                                   # id(parameter) -> how many modules hold it
    for m in root.modules():
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    # Left out: modules inside a layer, modules holding a layer (units never nest, the layer
    # would be lost in it), and modules holding a tied parameter (it goes to the root anyway).
    big = [m for m in root.modules()
           if m is not root and id(m) not in inside and _numel(m, recurse=False) >= threshold
           and not any(id(sub) in layer_ids for sub in m.modules())
           and all(holders[id(p)] == 1 for p in m.parameters(recurse=False))]
    return layers + big


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
