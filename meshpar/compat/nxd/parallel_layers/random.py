"""``neuronx_distributed.parallel_layers.random``: the tensor-parallel RNG tracker under NxD's names (meshpar's
tracker forks the generator of the process's device, where NxD's forks XLA's)."""

from __future__ import annotations

from meshpar.parallel_dims import get_parallel
from meshpar.random import RNGStatesTracker, get_rng_tracker, model_parallel_manual_seed

# NxD's tracker class, by its name
XLARNGStatesTracker = RNGStatesTracker


def get_xla_rng_tracker() -> RNGStatesTracker:
    return get_rng_tracker()


def model_parallel_xla_manual_seed(seed: int) -> None:
    """The default generator seeded with ``seed`` on every rank, the tp generator with ``seed + 2718 + tp_rank``."""
    model_parallel_manual_seed(seed, get_parallel())


__all__ = ["XLARNGStatesTracker", "get_xla_rng_tracker", "model_parallel_xla_manual_seed"]
