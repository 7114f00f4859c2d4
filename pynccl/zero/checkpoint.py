"""Sharded checkpoints: each rank writes only its shards and its optimizer state.

Crash safety: every rank first writes its file beside the final one (".staged", itself
written by checkpoint_io.atomic_save: temp file, fsync, rename); only when all ranks report
success does each os.replace it over its old file (then fsyncs the directory). A crash or error while writing therefore leaves the previous
checkpoint whole. Each save carries a token chosen by the first rank; load refuses a set of
files whose tokens differ (a crash between two ranks' renames would otherwise mix saves).

Loading at the same world size and layout copies the shards back; from any other world
size or stage, every rank reads all files, rebuilds the full state dicts and cuts its own
slices (resharding), via state_dict.py.

Hybrid sharding (hybrid.py): the replicas hold the same shards, so the first replica writes the
files (one per shard rank) and every replica reads them; the votes and the final barrier span
the replicas too, so no rank returns before the files are committed, and all raise together.
"""
from __future__ import annotations

import glob
import os
import re
import uuid
from typing import List

import torch

from ..comm import distributed as dist
from ..checkpoint_io import atomic_save
from . import state_dict as sd
from .hybrid import agree
from .layout import FlatLayout
from .params import named_buffers_all

FORMAT = "pynccl.zero.sharded/2"     # /2: optimizer state per original parameter (row shards)
_FILE_RE = re.compile(r"rank(\d+)-of-(\d+)\.pt$")


def shard_file(path: str, rank: int, world_size: int) -> str:
    return os.path.join(path, f"rank{rank:05d}-of-{world_size:05d}.pt")


def _commit(staged: str, final: str) -> None:
    os.replace(staged, final)
    fd = os.open(os.path.dirname(os.path.abspath(final)), os.O_RDONLY)
    try:
        os.fsync(fd)                               # NOTE: or the rename may not survive a power loss
    finally:
        os.close(fd)


def _agree(model, ok: bool) -> bool:
    """True on every rank (every replica's too) iff `ok` is true on every rank (collective)."""
    return agree(ok, model.device, model.process_group, model.replicate_group)


def _barrier(model) -> None:
    dist.barrier(group=model.process_group)
    if model.replicate_group is not None:
        dist.barrier(group=model.replicate_group)


def _param_positions(model, optimizer) -> List[int]:
    """The original module.parameters() position of each optimizer parameter, in order."""
    return [sd.param_index_of(e) for row in sd.optimizer_params(model, optimizer) for e in row]


def save_sharded(model, path: str, optimizer=None) -> None:
    g = model.process_group
    token = [uuid.uuid4().hex if g.group_rank == 0 else None]
    dist.broadcast_object_list(token, src=g.ranks[0], group=g)
    final = shard_file(path, g.group_rank, g.world_size)
    staged, error = final + ".staged", None
    # Hybrid sharding: the other replicas hold the same shards as the first, which writes them.
    writes = model.replicate_group is None or model.replicate_group.group_rank == 0
    if writes:
        try:
            atomic_save(_payload(model, token[0], optimizer), staged)   # temp file + fsync + rename
        except Exception as e:  # noqa: BLE001 - every rank must reach the vote below
            error = e
    if not _agree(model, error is None):
        if writes and os.path.exists(staged):
            os.remove(staged)
        _barrier(model)                            # every temp file is gone when any rank raises
        msg = f"save_sharded: writing {path} failed on some rank; the previous checkpoint there is intact"
        raise RuntimeError(msg + (f" (this rank: {error!r})" if error else "")) from error
    if writes:
        _commit(staged, final)
    _barrier(model)


def _payload(model, token: str, optimizer) -> dict:
    g = model.process_group
    return {
        "format": FORMAT, "token": token, "rank": g.group_rank, "world_size": g.world_size, "stage": model.stage,
        "units": [u.layout.metadata() for u in model.units],
        "shards": [u.check_params() or u.shard.detach().cpu() for u in model.units],
        "param_names": [info.names for info in model._param_infos],
        "frozen": {info.name: info.frozen_master.cpu() for info in model._param_infos
                   if info.frozen_master is not None},
        "buffers": {name: b.detach().cpu() for name, b in named_buffers_all(model.module)},
        "optimizer": None if optimizer is None else _to_cpu(optimizer.state_dict()),
        "optimizer_params": None if optimizer is None else _param_positions(model, optimizer),
    }


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _read(file: str) -> dict:
    payload = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or not str(payload.get("format", "")).startswith("pynccl.zero.sharded/"):
        raise ValueError(f"load_sharded: {file} is not a pynccl.zero sharded checkpoint")
    if payload["format"] != FORMAT:
        raise ValueError(f"load_sharded: {file} is a {payload['format']} checkpoint, this pynccl reads {FORMAT}; "
                         f"load it with the pynccl that wrote it and save full_state_dict() / "
                         f"full_optim_state_dict() instead, which any version loads")
    return payload


def _saved_files(path: str) -> List[str]:
    found = {}
    for f in glob.glob(os.path.join(path, "rank*-of-*.pt")):
        m = _FILE_RE.search(os.path.basename(f))
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    if len(found) != 1:
        raise FileNotFoundError(f"load_sharded: expected the files of one sharded checkpoint in {path}, found "
                                f"world sizes {sorted(found) or 'none'}")
    (ws, files), = found.items()
    if sorted(files) != list(range(ws)):
        raise FileNotFoundError(f"load_sharded: {path} holds ranks {sorted(files)} of a {ws}-rank checkpoint")
    return [files[r] for r in range(ws)]


def _check_tokens(tokens, path) -> None:
    if len(set(tokens)) != 1:
        raise ValueError(f"load_sharded: the rank files in {path} come from different saves (tokens {tokens}); "
                         f"a save was interrupted between renames")


def load_sharded(model, path: str, optimizer=None) -> None:
    g = model.process_group
    mine = shard_file(path, g.group_rank, g.world_size)
    payload = _read(mine) if os.path.exists(mine) else None
    same = (payload is not None and payload["world_size"] == g.world_size
            and payload["units"] == [u.layout.metadata() for u in model.units]
            and (optimizer is None or payload["optimizer_params"] == _param_positions(model, optimizer)))
    if _agree(model, same):
        tokens = [None] * g.world_size
        dist.all_gather_object(tokens, payload["token"], group=g)
        _check_tokens(tokens, path)
        with torch.no_grad():
            for unit, shard in zip(model.units, payload["shards"]):
                unit.check_params()
                unit.shard.copy_(shard)
            for info in model._param_infos:
                if info.frozen_master is not None:
                    info.frozen_master.copy_(payload["frozen"][info.name])
            for name, buf in named_buffers_all(model.module):
                buf.copy_(payload["buffers"][name])
        if optimizer is not None:
            if payload["optimizer"] is None:
                raise ValueError(f"load_sharded: {mine} was saved without optimizer state")
            optimizer.load_state_dict(payload["optimizer"])
        model._runtime.mark_stale()
        return
    # Different world size or layout: rebuild the full state from every rank's file.
    payloads = [_read(f) for f in _saved_files(path)]
    _check_tokens([p["token"] for p in payloads], path)
    model_sd, optim_sd = consolidate(payloads)
    if optimizer is not None and optim_sd is None:
        raise ValueError(f"load_sharded: {path} was saved without optimizer state")
    sd.load_full_state_dict(model, model_sd, optim_sd if optimizer is not None else None, optimizer)


def consolidate(payloads: List[dict]):
    """(model state dict, optimizer state dict or None) of a whole sharded checkpoint."""
    p0 = payloads[0]
    layouts = [FlatLayout.from_metadata(m) for m in p0["units"]]
    params = {}
    for u_idx, layout in enumerate(layouts):
        params.update(sd.split_flat(layout, torch.cat([p["shards"][u_idx] for p in payloads])))
    model_sd = {}
    for index, names in enumerate(p0["param_names"]):     # index: position in module.parameters()
        t = params[index] if index in params else p0["frozen"][names[0]]
        for n in names:
            model_sd[n] = t
    model_sd.update(p0["buffers"])
    if p0["optimizer"] is None:
        return model_sd, None
    # Each rank holds a range of whole rows of each parameter, in rank order: the full tensor
    # of a per-element entry is the ranks' pieces end to end. Frozen parameters are whole everywhere.
    shapes = {s.param_index: s.shape for lay in layouts for s in lay.slots}
    positions = p0["optimizer_params"]
    state = {}
    for pos, index in enumerate(positions):
        per_rank = [p["optimizer"]["state"].get(pos, {}) for p in payloads]
        entry = {}
        for key, v in per_rank[0].items():
            values = [st.get(key) for st in per_rank]
            if index in shapes and _per_element(key, values, shapes[index]):
                entry[key] = torch.cat([t.reshape(-1) for t in values]).view(shapes[index])
            else:
                entry[key] = v
        if entry:
            state[index] = entry
    offset, groups = 0, []
    for g in p0["optimizer"]["param_groups"]:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": positions[offset: offset + len(g["params"])]})
        offset += len(g["params"])
    return model_sd, {"state": {k: state[k] for k in sorted(state)}, "param_groups": groups}


def _per_element(key: str, values: list, shape: torch.Size) -> bool:
    """Whether the ranks' `values` of one optimizer state entry are row pieces of a parameter of
    `shape` (rather than one per-tensor value, such as a step counter, held by every rank)."""
    if not all(isinstance(v, torch.Tensor) for v in values):
        return False
    if len(shape) == 0:                        # 0-d: the holder has it 0-d, the others empty
        return key != "step" and any(v.numel() == 0 for v in values)
    return all(v.dim() == len(shape) and v.shape[1:] == shape[1:] for v in values)
