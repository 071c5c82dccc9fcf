"""Reproducible randomness for tensor-parallel regions.

Replicated regions (the default generator) draw the same numbers on every tp rank, because every rank seeds it
with the same seed. Sharded regions (e.g. dropout on the output of a column-parallel layer, attention-probability
dropout over a head shard) must draw *different* numbers per tp rank; they run under
``get_rng_tracker().fork()``, which swaps in a generator state seeded with ``seed + 2718 + tp_rank`` (Megatron's
convention) and swaps the default state back afterwards.

:func:`activation_checkpoint` is ``torch.utils.checkpoint`` that also restores the tracker's states on recompute, so the
recomputed forward draws the same dropout masks in sharded regions as the original forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

TP_RNG_STATE = "tensor-parallel-rng"
_TP_SEED_OFFSET = 2718


def _device_rng_module(device_type: str) -> Any:
    return torch if device_type == "cpu" else getattr(torch, device_type)


class RNGStatesTracker:
    """Named generator states for one device type (Megatron's ``CudaRNGStatesTracker``, device-agnostic)."""

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    @property
    def _rng(self) -> Any:
        return _device_rng_module(self.device_type)

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG state")
        saved = self._rng.get_rng_state()
        self._rng.manual_seed(seed)
        self._states[name] = self._rng.get_rng_state()
        self._rng.set_rng_state(saved)
        self._seeds.add(seed)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = TP_RNG_STATE) -> Iterator[None]:
        """Run the body with generator state ``name``; its advanced state is kept for the next fork."""
        if name not in self._states:
            raise RuntimeError(f"RNG state {name!r} is not set; call meshpar.init_parallel(seed=...) first")
        saved = self._rng.get_rng_state()
        self._rng.set_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._rng.get_rng_state()
            self._rng.set_rng_state(saved)


# Process-wide on purpose, as torch's default generator is: model code forks it from inside forward
# (``get_rng_tracker().fork()``, Megatron's ``get_cuda_rng_tracker``) with no handle to pass it through.
_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_manual_seed(seed: int, dims: Any) -> None:
    """Seed the default generator identically on all ranks and the tp generator per tp rank (``dims``: the
    :class:`~meshpar.ParallelDims` whose tp rank picks the tp seed)."""
    torch.manual_seed(seed)
    _TRACKER.device_type = dims.device_type
    _TRACKER.reset()
    _TRACKER.add(TP_RNG_STATE, seed + _TP_SEED_OFFSET + dims.tp_rank)


def activation_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Activation checkpointing that replays the tensor-parallel RNG state on recompute (non-reentrant)."""
    replay = _ReplayTracker(_TRACKER.get_states())
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), replay), **kwargs
    )


class _ReplayTracker:
    """Sets the tracker's states of the original forward around a recompute and restores them after. Re-enterable:
    a zero-bubble schedule's input-grad and weight-grad passes each recompute."""

    def __init__(self, saved: dict[str, torch.Tensor]) -> None:
        self._saved = saved
        self._current: list[dict[str, torch.Tensor]] = []

    def __enter__(self) -> None:
        self._current.append(_TRACKER.get_states())
        _TRACKER.set_states(self._saved)

    def __exit__(self, *exc: object) -> None:
        _TRACKER.set_states(self._current.pop())
