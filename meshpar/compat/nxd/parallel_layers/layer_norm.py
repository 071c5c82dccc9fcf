"""``neuronx_distributed.parallel_layers.layer_norm``: ``nn.LayerNorm`` whose parameters are marked
``sequence_parallel_enabled`` when it runs on sequence shards (NxD's optimizer wrapper then sums their grads over
tp)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class LayerNorm(nn.LayerNorm):
    def __init__(
        self,
        normalized_shape: int | list[int] | torch.Size,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        sequence_parallel_enabled: bool = False,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.sequence_parallel_enabled = sequence_parallel_enabled
        for param in (self.weight, self.bias):
            if param is not None:
                param.sequence_parallel_enabled = sequence_parallel_enabled


__all__ = ["LayerNorm"]
