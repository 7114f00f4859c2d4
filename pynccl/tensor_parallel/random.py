"""Random numbers under tensor parallelism (Megatron's CudaRNGStatesTracker).

Dropout on replicated activations must draw the same mask on every TP rank (else the replicas
drift apart); dropout on sharded activations (attention heads, sequence-parallel shards) must
draw different masks on each rank (else every shard sees the same pattern). So:

* the default generators (CPU and every CUDA device) get `seed`, the same on every TP rank, and
  serve the replicated regions;
* the tracker holds named states; `fork()` swaps one in for the duration of a `with` block and
  serves the sharded regions. `model_parallel_seed(seed, tp_rank)` seeds the tracker's
  "model-parallel-rng" state with seed + 2718 + tp_rank, Megatron's choice.

A named state is kept per device (CPU, cuda:0, ...), each started from the named seed, so the
tracker serves gloo (CPU) and NCCL (CUDA) runs alike. With pipeline parallelism pass a seed that
differs per stage if stages should differ (Megatron adds 100 × pp_rank).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Tuple

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
TP_SEED_OFFSET = 2718


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    raise ValueError(f"RNGStatesTracker: device must be cpu or cuda, got {device}")


def _canonical(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class RNGStatesTracker:
    """Named generator states, swapped in by `fork(name)`; the default generator's own state is
    untouched by what runs inside the fork."""

    def __init__(self):
        self._seeds: Dict[str, int] = {}
        self._states: Dict[Tuple[str, torch.device], torch.Tensor] = {}

    def reset(self) -> None:
        self._seeds.clear()
        self._states.clear()

    def add(self, name: str, seed: int) -> None:
        if name in self._seeds:
            raise ValueError(f"RNGStatesTracker.add: state {name!r} already exists (seed {self._seeds[name]}); "
                             f"call reset() first")
        if seed in self._seeds.values():
            raise ValueError(f"RNGStatesTracker.add: seed {seed} is already used by another state; two states "
                             f"with one seed would draw the same numbers")
        self._seeds[name] = int(seed)

    def get_states(self) -> dict:
        """Everything needed to resume (for checkpoints): the seeds and each device's state."""
        return {"seeds": dict(self._seeds), "states": {k: v.clone() for k, v in self._states.items()}}

    def set_states(self, states: dict) -> None:
        self._seeds = dict(states["seeds"])
        self._states = {k: v.clone() for k, v in states["states"].items()}

    def is_seeded(self, name: str = MODEL_PARALLEL_RNG) -> bool:
        return name in self._seeds

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG, device=None):
        """Within the block, `device`'s default generator (cpu, or a cuda device; None: the
        current CUDA device once CUDA is initialised, else cpu) draws from state `name`."""
        if name not in self._seeds:
            raise RuntimeError(f"RNGStatesTracker.fork: state {name!r} was never seeded; call "
                               f"pynccl.tensor_parallel.model_parallel_seed(seed, tp_rank) on every rank first")
        device = _canonical(device)
        gen = _default_generator(device)
        key = (name, device)
        state = self._states.get(key)
        if state is None:
            state = torch.Generator(device=device).manual_seed(self._seeds[name]).get_state()
        saved = gen.get_state()
        gen.set_state(state)
        try:
            yield
        finally:
            self._states[key] = gen.get_state()
            gen.set_state(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (like the default generator, one per process)."""
    return _TRACKER


get_cuda_rng_tracker = get_rng_tracker  # Megatron's name


def model_parallel_seed(seed: int, tp_rank: int) -> None:
    """Seed for tensor parallelism; call on every rank with the same `seed` and its own `tp_rank`.

    Default generators (CPU and all CUDA devices, via torch.manual_seed): `seed`, identical across
    the TP group. The tracker's MODEL_PARALLEL_RNG state: seed + 2718 + tp_rank, distinct per rank.
    """
    if not isinstance(seed, int) or not isinstance(tp_rank, int):
        raise TypeError(f"model_parallel_seed: seed and tp_rank must be ints, got {type(seed).__name__} "
                        f"and {type(tp_rank).__name__}")
    if tp_rank < 0:
        raise ValueError(f"model_parallel_seed: tp_rank must be >= 0, got {tp_rank}")
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp_rank)


def sharded_rng(sharded: bool, device):
    """The tracker's fork for sharded activations on `device`; a no-op for replicated ones."""
    return _TRACKER.fork(device=device) if sharded else contextlib.nullcontext()


def dropout(x: torch.Tensor, p: float, training: bool, sharded: bool) -> torch.Tensor:
    """F.dropout drawing from the tracker on sharded activations, from the default generator on
    replicated ones."""
    if p == 0.0 or not training:
        return x
    with sharded_rng(sharded, x.device):
        return torch.nn.functional.dropout(x, p, True)
