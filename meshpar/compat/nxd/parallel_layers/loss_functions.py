"""``neuronx_distributed.parallel_layers.loss_functions``."""

from __future__ import annotations

import torch

from meshpar.parallel_dims import get_parallel
from meshpar.tensor_parallel import parallel_cross_entropy as _native_parallel_cross_entropy

__all__ = ["parallel_cross_entropy"]


def parallel_cross_entropy(
    parallel_logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, **kwargs: object
) -> torch.Tensor:
    """NxD's per-token cross entropy of vocab-sharded logits, over the parallel state's tp mesh (meshpar's
    :func:`meshpar.parallel_cross_entropy` with that mesh)."""
    kwargs.setdefault("tp_mesh", get_parallel().tp_mesh)
    return _native_parallel_cross_entropy(parallel_logits, labels, label_smoothing, **kwargs)
