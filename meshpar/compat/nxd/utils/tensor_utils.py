"""``neuronx_distributed.utils.tensor_utils``: NxD's cumulative sum along dim 0 of a 2-D tensor (computed in float64,
returned in the input's dtype)."""

from __future__ import annotations

import torch


def cumsum(tensor: torch.Tensor, dim: int = 0, tril_size: int = 2048) -> torch.Tensor:
    """``tensor.cumsum(0)`` as NxD computes it (``tril_size`` is NxD's matmul block size: no effect here)."""
    if tensor.dim() != 2:
        raise ValueError(f"Expected 2D input tensor, unsupported shape: {tuple(tensor.shape)}")
    if dim != 0:
        raise NotImplementedError(f"Only cumsum along dimension-0 is currently supported, unexpected dim={dim}")
    return tensor.double().cumsum(0).to(tensor.dtype)


__all__ = ["cumsum"]
