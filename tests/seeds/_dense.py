"""Helpers shared by the seed ports: copy dense weights into sharded parameters, compare after a step."""

from __future__ import annotations

import torch
from torch import nn

from meshpar._compat import DTensor, distribute_tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def copy_dense_into(module: nn.Module, dense: dict[str, torch.Tensor], rename=lambda name: name) -> None:
    """Every parameter of ``module`` takes its (sharded) value from the dense state dict."""
    for name, param in module.named_parameters():
        value = dense[rename(name)]
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(value, param.device_mesh, param.placements).to_local())
        else:
            param.copy_(value)


def assert_params_match(module: nn.Module, dense: dict[str, torch.Tensor], rename=lambda name: name) -> None:
    for name, param in module.named_parameters():
        torch.testing.assert_close(full(param.detach()), dense[rename(name)], atol=1e-5, rtol=1e-4, msg=name)
