"""``neuronx_distributed.modules.qkv_linear_utils``: what NxD's fused q / k / v autograd asks of its weights."""

from __future__ import annotations

import torch


def check_requires_grad(weight_qkv: torch.Tensor | None, fuse_qkv: bool, weight_q: torch.Tensor | None) -> bool:
    """Whether the projection's weights take grads (the fused weight's, else the query weight's)."""
    return bool((weight_qkv if fuse_qkv else weight_q).requires_grad)


def check_use_bias(
    weight_qkv: torch.Tensor | None,
    fuse_qkv: bool,
    weight_q: torch.Tensor | None,
    bias_q: torch.Tensor | None,
    bias_qkv: torch.Tensor | None,
) -> bool:
    """Whether a bias grad is computed: a bias exists and the weights take grads."""
    has_bias = (bias_qkv if fuse_qkv else bias_q) is not None
    return has_bias and check_requires_grad(weight_qkv, fuse_qkv, weight_q)


__all__ = ["check_requires_grad", "check_use_bias"]
