"""Layout-independent checkpoints: one file holding the single-process model's state, whatever
the mesh that wrote it, so a run saved at tp2·pp2 resumes at dp4, at tp4 or on one process.

    {"format": FORMAT, "config": GPTConfig fields, "step": next step (= data position),
     "model": {full parameter name: full tensor},
     "optimizer": {"state": {full parameter name: {"exp_avg": full tensor, "step": ...}},
                   "param_groups": [hyperparameters]},
     "rng": {"cpu": ..., "cuda": ...}, "layout": the writer's dp/tp/pp/zero (information only)}

Saving: ZeRO first consolidates over dp (full_state_dict); the ranks of dp replica 0 then send
their pieces to every rank of that replica (all_gather_object over mesh.mp_group: the example's
model is small; a large model would write one file per stage instead), which glue TP shards back
together (inverse of pynccl.tensor_parallel.shard_tensor), and global rank 0 writes the file
atomically (pynccl.checkpoint_io). Loading: every rank reads the file and cuts its own TP slice
(shard_tensor) of its own stage's parameters and optimizer state.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch

import pynccl
from pynccl import checkpoint_io
from pynccl.tensor_parallel import shard_tensor

from .parallel import is_zero, unwrapped

FORMAT = "pynccl-gpt-consolidated-v1"
LATEST = "latest"


# --------------------------------------------------------------------------- TP shards <-> full
def unshard(shards, dim: Optional[int], num_chunks: int) -> torch.Tensor:
    """Full tensor from every TP rank's shard (tp_rank order); inverse of shard_tensor."""
    if dim is None:
        return shards[0]
    if num_chunks == 1:
        return torch.cat(shards, dim)
    # Fused [q | k | v]: rank r holds [q_r | k_r | v_r]; the full tensor is [q_0..q_n | k_0.. | v_0..].
    return torch.cat([torch.cat([s.chunk(num_chunks, dim)[j] for s in shards], dim)
                      for j in range(num_chunks)], dim)


def _shard(full, param_full_shape, spec, mesh):
    dim, num_chunks = spec
    if dim is None or not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(param_full_shape):
        return full                                # replicated, or per-tensor state (Adam's step)
    return shard_tensor(full, dim, mesh.tp_rank, mesh.tp_size, num_chunks).clone()


# --------------------------------------------------------------------------- this rank's pieces
def _local_state(model, optimizer, names) -> Tuple[Dict[str, torch.Tensor], Dict[str, dict], dict]:
    """(params, optimizer state, hyperparameters) of this rank's stage, keyed by full name; TP shards
    still split. Collective over dp under ZeRO."""
    if is_zero(model):
        params = dict(model.full_state_dict())
        osd = model.full_optim_state_dict(optimizer)
    else:
        params = {n: p.detach() for n, p in unwrapped(model).named_parameters()}
        osd = optimizer.state_dict()
    # Optimizer state is keyed by position in the stage's parameters(), which `names` lists.
    opt_state = {names[i]: st for i, st in osd["state"].items()}
    hyper = {k: v for k, v in osd["param_groups"][0].items() if k != "params"}
    cpu = lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return ({n: cpu(t) for n, t in params.items()},
            {n: {k: cpu(v) for k, v in st.items()} for n, st in opt_state.items()}, hyper)


def save(path: str, model, optimizer, mesh, spec, names, config, step: int, layout: dict) -> None:
    """Write the consolidated checkpoint to `path` (global rank 0 writes). Collective."""
    params, opt_state, hyper = _local_state(model, optimizer, names)
    if mesh.dp_rank == 0:
        pieces = [None] * mesh.mp_group.world_size
        pynccl.all_gather_object(pieces, (mesh.tp_rank, spec, params, opt_state), group=mesh.mp_group)
        if mesh.rank == 0:
            by_tp = sorted(pieces, key=lambda p: p[0])
            full_spec = {n: s for _, sp, _, _ in by_tp for n, s in sp.items()}
            model_sd, optim_sd = {}, {}
            for name, s in full_spec.items():
                holders = [p for p in by_tp if name in p[2]]            # one per tp rank, tp order
                model_sd[name] = unshard([p[2][name] for p in holders], *s)
                states = [p[3].get(name) for p in holders]
                if states[0]:
                    shard_shape = holders[0][2][name].shape
                    optim_sd[name] = {k: (unshard([st[k] for st in states], *s)
                                          if isinstance(v, torch.Tensor) and v.shape == shard_shape else v)
                                      for k, v in states[0].items()}
            rng = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                rng["cuda"] = torch.cuda.get_rng_state()
            checkpoint_io.atomic_save({"format": FORMAT, "config": config.to_dict(), "step": step,
                                       "model": model_sd, "optimizer": {"state": optim_sd, "param_groups": [hyper]},
                                       "rng": rng, "layout": layout}, path)
            folder = os.path.dirname(os.path.abspath(path))
            with open(os.path.join(folder, LATEST + ".tmp"), "w") as f:
                f.write(os.path.basename(path))
            os.replace(os.path.join(folder, LATEST + ".tmp"), os.path.join(folder, LATEST))
    # NOTE: nobody reads the file (a resume, the next save) before rank 0 has renamed it in place.
    pynccl.barrier()


def resolve(path: str) -> str:
    """A checkpoint file, or a folder whose `latest` names one."""
    if os.path.isdir(path):
        marker = os.path.join(path, LATEST)
        if not os.path.exists(marker):
            raise FileNotFoundError(f"--resume {path}: a folder without a '{LATEST}' file (no checkpoint saved there)")
        with open(marker) as f:
            return os.path.join(path, f.read().strip())
    return path


def load(path: str, model, optimizer, mesh, spec, names, config) -> dict:
    """Load a consolidated checkpoint into this rank's stage (any layout); returns the whole dict."""
    ckpt = checkpoint_io.load(resolve(path))
    if ckpt.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} checkpoint (format {ckpt.get('format')!r})")
    now = config.to_dict()
    # Dropout is a training choice, free to change on resume; every other field fixes shapes.
    diff = {k: (v, now.get(k)) for k, v in ckpt["config"].items() if k != "dropout" and now.get(k) != v}
    if diff:
        raise ValueError(f"{path}: saved for another model; (saved, now) differ in {diff}")
    full_model, saved_state = ckpt["model"], ckpt["optimizer"]["state"]
    missing = [n for n in names if n not in full_model]
    if missing:
        raise KeyError(f"{path}: no saved tensor for {missing}")
    local = {n: _shard(full_model[n], full_model[n].shape, spec[n], mesh) for n in names}
    state = {i: {k: _shard(v, full_model[n].shape, spec[n], mesh) for k, v in saved_state[n].items()}
             for i, n in enumerate(names) if n in saved_state}
    hyper = ckpt["optimizer"]["param_groups"][0]
    osd = {"state": state, "param_groups": [{**hyper, "params": list(range(len(names)))}]}
    if is_zero(model):
        model.load_full_state_dict(local, osd, optimizer)
    else:
        with torch.no_grad():
            for n, p in unwrapped(model).named_parameters():
                p.copy_(local[n])
        optimizer.load_state_dict(osd)
    torch.set_rng_state(ckpt["rng"]["cpu"])
    if "cuda" in ckpt["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
    return ckpt
