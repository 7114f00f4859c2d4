"""How a parameter is cut across the TP group, for both ways of building a tensor-parallel model:
the Megatron-layout layers (layers.py) take their shards from a freshly built torch layer, and the
plan's styles (styles.py) from the model's own layers, through the same functions here.

A sharded Parameter is a new one holding this rank's slice, marked with `tp_shard_dim` and
`tp_num_chunks` (the dim it was cut along, and how many fused blocks that dim holds); a Parameter
without the marks is replicated across the TP group (count it once when, e.g., clipping norms).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn

from ..comm import distributed as dist


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a linear layer storing its weight transposed, (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def check_divisible(where: str, what: str, value: int, tp_size: int, num_chunks: int = 1, hint: str = "") -> None:
    """ValueError naming the module, the dimension and the TP size when `value` does not split evenly."""
    if value % (tp_size * num_chunks):
        by = f"{num_chunks} fused blocks × " if num_chunks > 1 else ""
        raise ValueError(f"{where or 'the root module'}: {what}={value} is not divisible by {by}tp={tp_size}{hint}")


def shard_tensor(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int, num_chunks: int = 1) -> torch.Tensor:
    """Rank `tp_rank`'s slice of `full` along `dim`. With num_chunks > 1 (a fused QKV weight), `dim`
    holds num_chunks equal blocks, each split across ranks, and the rank's slices are concatenated:
    [q | k | v] -> [q_r | k_r | v_r]."""
    blocks = full.chunk(num_chunks, dim) if num_chunks > 1 else (full,)
    return torch.cat([b.chunk(tp_size, dim)[tp_rank] for b in blocks], dim)


def shard_like(param: torch.Tensor, full: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of `full` (an unsharded weight, its grad, an optimizer state), cut as
    `param` was cut; `full` itself for a replicated param. A full dim shorter than the sharded one
    (a padded vocabulary) is zero-padded first."""
    dim = getattr(param, "tp_shard_dim", None)
    if dim is None:
        return full
    tp_size = dist.get_world_size(group)
    missing = param.shape[dim] * tp_size - full.shape[dim]
    if missing > 0:
        pad_shape = list(full.shape)
        pad_shape[dim] = missing
        full = torch.cat([full, full.new_zeros(pad_shape)], dim)
    return shard_tensor(full, dim, dist.get_rank(group), tp_size, param.tp_num_chunks)


def shard_parameter(full: torch.Tensor, dim: int, group, num_chunks: int = 1,
                    sharded: Optional[Dict[int, nn.Parameter]] = None,
                    requires_grad: Optional[bool] = None, where: str = "the parameter") -> nn.Parameter:
    """A new Parameter holding this rank's slice of `full` along `dim`, marked as sharded.
    sharded: {id(full parameter): its shard} over one parallelization, so a parameter shared by two
    modules (tied embedding and LM head) gets one shard, which must be cut the same way for both.
    requires_grad: default `full`'s. where: the parameter's name in errors."""
    if sharded is not None and id(full) in sharded:
        param = sharded[id(full)]
        if (param.tp_shard_dim, param.tp_num_chunks) != (dim, num_chunks):
            raise ValueError(f"{where}: this tied parameter is sharded on dim {param.tp_shard_dim} by another "
                             f"style, but this style needs dim {dim}")
        return param
    if getattr(full, "tp_shard_dim", None) is not None:
        raise ValueError(f"{where} is already tensor-parallel (parallelized twice?)")
    shard = shard_tensor(full.detach(), dim, dist.get_rank(group), dist.get_world_size(group), num_chunks)
    # clone: a view would keep the whole unsharded tensor alive.
    param = nn.Parameter(shard.clone(memory_format=torch.contiguous_format),
                         requires_grad=full.requires_grad if requires_grad is None else requires_grad)
    param.tp_shard_dim, param.tp_num_chunks = dim, num_chunks
    if sharded is not None:
        sharded[id(full)] = param
    return param


def column_shards(module: nn.Module, group, num_chunks: int = 1,
                  sharded: Optional[Dict[int, nn.Parameter]] = None) -> Dict[str, nn.Parameter]:
    """{"weight": ..., "bias": ...}: this rank's slices of a layer split along its outputs (column
    parallel). nn.Linear's weight (out, in) is cut on dim 0, Hugging Face's Conv1D (in, out) on
    dim 1, nn.Embedding's (V, h) along the embedding dim 1; the bias, if any, like the outputs.
    num_chunks: the outputs are that many equal blocks, each split on its own (a fused q|k|v)."""
    weight_dim = 1 if is_conv1d(module) or isinstance(module, nn.Embedding) else 0
    return {attr: shard_parameter(module._parameters[attr], weight_dim if attr == "weight" else 0, group, num_chunks,
                                  sharded, where=f"{type(module).__name__}.{attr}")
            for attr in ("weight", "bias") if module._parameters.get(attr) is not None}


def row_shards(module: nn.Module, group, sharded: Optional[Dict[int, nn.Parameter]] = None) -> Dict[str, nn.Parameter]:
    """{"weight": ...}: this rank's slice of a layer split along its inputs (row parallel):
    nn.Linear's weight (out, in) on dim 1, Conv1D's (in, out) on dim 0, nn.Embedding's
    vocabulary (V, h) on dim 0. The bias stays whole: it is added once, after the sum over ranks."""
    weight_dim = 0 if is_conv1d(module) or isinstance(module, nn.Embedding) else 1
    return {"weight": shard_parameter(module._parameters["weight"], weight_dim, group, 1, sharded,
                                      where=f"{type(module).__name__}.weight")}
