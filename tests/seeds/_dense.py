"""Helpers shared by the seed ports: copy dense weights into sharded parameters, compare after a step."""

from __future__ import annotations

import torch
from torch import nn

from meshpar._compat import DTensor, distribute_tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def apex_shard(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """This tp rank's part of ``value`` for a parameter of apex's layers (a plain local shard carrying apex's
    ``tensor_model_parallel`` / ``partition_dim`` attributes); ``value`` itself for any other parameter."""
    if not getattr(param, "tensor_model_parallel", False):
        return value
    from meshpar.compat.apex import parallel_state

    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    return value.chunk(tp, param.partition_dim)[rank]


@torch.no_grad()
def copy_dense_into(module: nn.Module, dense: dict[str, torch.Tensor], rename=lambda name: name) -> None:
    """Every parameter of ``module`` takes its (sharded) value from the dense state dict."""
    for name, param in module.named_parameters():
        value = dense[rename(name)]
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(value, param.device_mesh, param.placements).to_local())
        else:
            param.copy_(apex_shard(param, value))


def assert_params_match(
    module: nn.Module, dense: dict[str, torch.Tensor], rename=lambda name: name, atol: float = 1e-5, rtol: float = 1e-4
) -> None:
    for name, param in module.named_parameters():
        value = dense[rename(name)].detach()
        if not isinstance(param, DTensor):
            value = apex_shard(param, value)
        torch.testing.assert_close(full(param.detach()), value, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
