"""``apex.transformer.tensor_parallel.random``: the tensor-parallel RNG tracker and activation checkpointing,
meshpar's (:mod:`meshpar.random`) under apex's names.

meshpar's tracker forks the generator of the process's device (CUDA on GPUs, the CPU generator on CPU runs). apex's
``distribute_saved_activations`` (saved activations split over tp to save memory) is not implemented: asking for it
warns and keeps them whole, which changes memory use, never results.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from meshpar.parallel_dims import get_parallel
from meshpar.random import RNGStatesTracker as CudaRNGStatesTracker
from meshpar.random import activation_checkpoint, get_rng_tracker, model_parallel_manual_seed

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return get_rng_tracker()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """The default generator seeded with ``seed`` on every rank, the tp generator with ``seed + 2718 + tp_rank``."""
    model_parallel_manual_seed(seed, get_parallel())


def _set_cuda_rng_state(new_state: torch.Tensor, device: int | str | torch.device = -1) -> None:
    """Set the CUDA generator's state (of ``device``, default the current one); on a machine without CUDA, the CPU
    generator's (meshpar's CPU runs keep the tp RNG there)."""
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device == -1 else torch.device("cuda", device).index
        torch.cuda.set_rng_state(new_state, index)
    else:
        torch.set_rng_state(new_state)


def init_checkpointed_activations_memory_buffer(
    micro_batch_size: int,
    max_position_embeddings: int,
    hidden_size: int,
    num_layers: int,
    tensor_model_parallel_size: int,
    checkpoint_num_layers: int,
    fp16: bool,
) -> None:
    warnings.warn(
        "init_checkpointed_activations_memory_buffer: meshpar keeps checkpointed activations whole (no buffer to "
        "distribute them over tp); memory use differs from apex's, results do not",
        stacklevel=2,
    )


def reset_checkpointed_activations_memory_buffer() -> None:
    """Nothing to reset: see :func:`init_checkpointed_activations_memory_buffer`."""


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
    """Recompute ``function(*args)`` in backward with the tp RNG state of the forward (dropout masks replay)."""
    if distribute_saved_activations:
        warnings.warn(
            "checkpoint(distribute_saved_activations=True): meshpar keeps the saved input whole on every tp rank",
            stacklevel=2,
        )
    return activation_checkpoint(function, *args)


class CheckpointFunction:
    """apex's autograd function, as ``CheckpointFunction.apply(run_function, distribute_saved_activations, *args)``
    (see :func:`checkpoint`)."""

    @staticmethod
    def apply(run_function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
        return checkpoint(run_function, distribute_saved_activations, *args)


__all__ = [
    "CheckpointFunction",
    "CudaRNGStatesTracker",
    "checkpoint",
    "get_cuda_rng_tracker",
    "init_checkpointed_activations_memory_buffer",
    "model_parallel_cuda_manual_seed",
    "reset_checkpointed_activations_memory_buffer",
]
