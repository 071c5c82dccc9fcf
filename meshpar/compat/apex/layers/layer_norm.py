"""``apex.transformer.layers.layer_norm``: LayerNorm over the last dims on meshpar's fused norm op
(:func:`meshpar.ops.layer_norm`, a Triton kernel where available), whose parameters carry apex's
``sequence_parallel_enabled`` flag (Megatron sums such parameters' grads over tp when sequence parallelism splits
the tokens a norm sees)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshpar.ops import layer_norm as fused_layer_norm

__all__ = ["FastLayerNorm", "FusedLayerNorm", "MixedFusedLayerNorm"]


def _set_sequence_parallel_enabled(param: torch.Tensor | None, sequence_parallel_enabled: bool) -> None:
    if param is not None:
        param.sequence_parallel_enabled = sequence_parallel_enabled


class FusedLayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm``'s arguments and results; the fused op runs when the norm is over the last dim with
    affine parameters of the input's dtype."""

    def __init__(
        self,
        normalized_shape: int | list[int] | torch.Size,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        *,
        sequence_parallel_enabled: bool = False,
    ) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        self.sequence_parallel_enabled = sequence_parallel_enabled
        _set_sequence_parallel_enabled(self.weight, sequence_parallel_enabled)
        _set_sequence_parallel_enabled(self.bias, sequence_parallel_enabled)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        fused = (
            self.elementwise_affine
            and self.bias is not None
            and len(self.normalized_shape) == 1
            and input.dtype == self.weight.dtype
        )
        if fused:
            return fused_layer_norm(input, self.weight, self.bias, self.eps)
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class MixedFusedLayerNorm(FusedLayerNorm):
    """Parameters kept in float32 whatever the input's dtype; the output has the input's dtype."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype == self.weight.dtype:
            return super().forward(input)
        out = F.layer_norm(input.float(), self.normalized_shape, self.weight, self.bias, self.eps)
        return out.to(input.dtype)


class FastLayerNorm(FusedLayerNorm):
    """apex's ``FastLayerNorm(hidden_size, eps)``: the same norm (its kernel is one of apex's CUDA extensions)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, sequence_parallel_enabled: bool = False) -> None:
        super().__init__(hidden_size, eps=eps, sequence_parallel_enabled=sequence_parallel_enabled)
