"""``neuronx_distributed.utils.random``: one seed for Python, NumPy, torch and (once a parallel state exists) the
tensor-parallel RNG tracker."""

from __future__ import annotations

import random

import numpy as np
import torch

from meshpar.parallel_dims import is_initialized


def set_random_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if is_initialized():
        from meshpar.compat.nxd.parallel_layers.random import model_parallel_xla_manual_seed

        model_parallel_xla_manual_seed(seed)


__all__ = ["set_random_seed"]
