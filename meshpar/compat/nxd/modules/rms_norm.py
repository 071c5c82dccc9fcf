"""``neuronx_distributed.modules.rms_norm``: RMSNorm computed in float32 (returned in the input's dtype), its
weight marked ``sequence_parallel_enabled`` when it runs on sequence shards (NxD's optimizer wrapper then sums its
grad over tp)."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def manual_rms_norm(
    input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    dtype = input.dtype
    x = input.float()
    dims = tuple(range(-len(normalized_shape), 0))
    x = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return (x if weight is None else weight * x).to(dtype)


class RMSNorm(nn.Module):
    def __init__(
        self, normalized_shape: int | Sequence[int], eps: float = 1e-5, sequence_parallel_enabled: bool = False,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        if "elementwise_affine" in kwargs:
            warnings.warn("RMSNorm does not support `elementwise_affine` argument", stacklevel=2)
            if not kwargs.pop("elementwise_affine"):
                raise RuntimeError("RMSNorm does not support `elementwise_affine = False`")
        shape = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else tuple(normalized_shape)
        self.normalized_shape, self.eps, self.elementwise_affine = torch.Size(shape), eps, True
        self.weight = nn.Parameter(torch.ones(shape))
        self.weight.sequence_parallel_enabled = sequence_parallel_enabled

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return manual_rms_norm(input, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.normalized_shape)}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


__all__ = ["RMSNorm", "manual_rms_norm"]
