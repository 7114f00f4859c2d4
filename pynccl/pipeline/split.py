"""Cut a sequence of layers into pipeline stages: contiguous ranges balanced by parameter count
(or at given boundaries), and the module of one stage, so each rank builds only its own.

Layers are nn.Modules (e.g. an nn.Sequential) or zero-argument factories returning one; a
factory is built on the meta device to count its parameters (no memory), and for real only
on the rank whose stage holds it.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

Layer = Union[nn.Module, Callable[[], nn.Module]]


def _as_layers(layers) -> List[Layer]:
    if isinstance(layers, nn.Sequential):
        return list(layers)
    if isinstance(layers, nn.Module) or not isinstance(layers, (list, tuple, nn.ModuleList)):
        raise TypeError(f"split: layers must be an nn.Sequential or a list of nn.Modules / factories, "
                        f"got {type(layers).__name__}")
    out = list(layers)
    for i, layer in enumerate(out):
        if not callable(layer):
            raise TypeError(f"split: layers[{i}] must be an nn.Module or a zero-argument factory, "
                            f"got {type(layer).__name__}")
    return out


def _num_params(layer: Layer) -> int:
    if not isinstance(layer, nn.Module):
        with torch.device("meta"):
            layer = layer()
        if not isinstance(layer, nn.Module):
            raise TypeError(f"split: a layer factory must return an nn.Module, got {type(layer).__name__}")
    return sum(p.numel() for p in layer.parameters())


def _balanced(weights: List[int], k: int) -> List[int]:
    """Start indices of parts 1..k-1 of the contiguous partition minimising the heaviest part
    (the linear partition problem; O(n² k), n = number of layers)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i]: lightest heaviest part when splitting the first i layers into j parts.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                cost = max(best[j - 1][s], prefix[i] - prefix[s])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, s
    starts, i = [], n
    for j in range(k, 1, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]


def split_into_stages(layers, num_stages: int, boundaries: Optional[Sequence[int]] = None) -> List[Tuple[int, int]]:
    """[(start, end)] layer ranges of each stage. boundaries: the first layer index of stages
    1..num_stages-1; without it, stages are balanced by parameter count (ties: by layer count)."""
    layers = _as_layers(layers)
    n = len(layers)
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"split_into_stages: num_stages must be a positive int, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(f"split_into_stages: cannot cut {n} layers into {num_stages} non-empty stages")
    if boundaries is not None:
        starts = list(boundaries)
        if len(starts) != num_stages - 1:
            raise ValueError(f"split_into_stages: boundaries must hold num_stages - 1 = {num_stages - 1} "
                             f"layer indices, got {len(starts)}: {starts}")
        if any(not isinstance(b, int) for b in starts) or starts != sorted(set(starts)) or \
                (starts and not (0 < starts[0] and starts[-1] < n)):
            raise ValueError(f"split_into_stages: boundaries must be strictly increasing ints in (0, {n}), "
                             f"got {starts}")
    else:
        # Weight params·(n+1) + 1 per layer: minimises the heaviest stage's parameters first, then
        # its layer count (which is at most n), so parameter-free layers spread out too.
        starts = _balanced([_num_params(layer) * (n + 1) + 1 for layer in layers], num_stages)
    edges = [0] + starts + [n]
    return [(edges[i], edges[i + 1]) for i in range(num_stages)]


def build_stage_module(layers, stage_index: int, num_stages: int, boundaries: Optional[Sequence[int]] = None,
                       device=None) -> nn.Sequential:
    """The nn.Sequential of stage `stage_index`'s layers (the same module objects when given
    modules; built here when given factories), moved to `device` if given."""
    ranges = split_into_stages(layers, num_stages, boundaries)
    if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
        raise ValueError(f"build_stage_module: stage_index must be in [0, {num_stages}), got {stage_index!r}")
    start, end = ranges[stage_index]
    mine = [layer if isinstance(layer, nn.Module) else layer() for layer in _as_layers(layers)[start:end]]
    stage = nn.Sequential(*mine)
    return stage.to(device) if device is not None else stage
