"""``neuronx_distributed.parallel_layers.grads``: the global grad norm clip over tp, pp and dp."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from meshpar import grad_clip
from meshpar.parallel_dims import get_parallel, is_initialized

__all__ = ["clip_grad_norm"]


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """NxD's ``clip_grad_norm``: meshpar's over the mesh NxD's ``initialize_model_parallel`` set up (a single process
    without one: the parameters alone); returns the norm before clipping."""
    return grad_clip.clip_grad_norm(parameters, max_norm, norm_type, dims=get_parallel() if is_initialized() else None)
