"""Sequence-parallel norms run their own forward on their own DTensor parameters (torch's SequenceParallel
mechanism: no parameter is swapped for a local tensor), and their replicated grads equal the dense grads once
backward has accumulated them, over several backward passes too."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from meshpar._compat import DTensor, Replicate
from meshpar.tensor_parallel import SequenceParallelNorm
from meshpar.tensor_parallel.style import ReplicatedGradSum
from meshpar.testing import run_distributed, setup_parallel


class WatchedRMSNorm(nn.Module):
    """An RMSNorm (HF's formulation) that records what its forward sees as ``self.weight``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.seen: list[object] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.weight)
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


class ColumnSum(nn.Module):
    """Not row-wise: sums over its input's first dim."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x.sum(0)


def norm_case(style: str, shard_dim: int) -> None:
    dims = setup_parallel(tp=2)
    rank = dims.tp_mesh.get_local_rank()
    torch.manual_seed(0)
    dense = nn.ModuleDict({"norm": WatchedRMSNorm(8), "ln": nn.LayerNorm(8)})
    with torch.no_grad():
        dense["ln"].weight.uniform_(0.5, 1.5)
        dense["ln"].bias.uniform_(-0.5, 0.5)
    model = copy.deepcopy(dense)
    make = SequenceParallelNorm if style == "sp" else ReplicatedGradSum
    model = parallelize_module(model, dims.tp_mesh, {"norm": make(), "ln": make()})
    registered = model["norm"]._parameters["weight"]
    assert type(model["norm"]) is WatchedRMSNorm and type(model["ln"]) is nn.LayerNorm  # classes are the modules' own

    for step in range(2):  # two backward passes accumulate into the same grads
        full = torch.randn(2, 6, 4, 8)
        x = full.chunk(2, dim=shard_dim)[rank].clone().requires_grad_()
        ref = full.clone().requires_grad_()
        out = model["ln"](model["norm"](x))
        want = dense["ln"](dense["norm"](ref))
        torch.testing.assert_close(out, want.chunk(2, dim=shard_dim)[rank], atol=1e-6, rtol=1e-6)
        assert type(out) is torch.Tensor  # activations outside the norm are plain tensors
        weights = torch.randn_like(want)
        (out * weights.chunk(2, dim=shard_dim)[rank]).sum().backward()
        (want * weights).sum().backward()
        torch.testing.assert_close(x.grad, ref.grad.chunk(2, dim=shard_dim)[rank], atol=1e-5, rtol=1e-5)
        for name, param in model.named_parameters():
            assert isinstance(param.grad, DTensor) and param.grad.placements == (Replicate(),), name
            torch.testing.assert_close(
                param.grad.to_local(), dense.get_parameter(name).grad, atol=1e-5, rtol=1e-5, msg=f"step {step} {name}"
            )
    assert all(seen is registered for seen in model["norm"].seen)  # the forward met the DTensor parameter itself
    assert model["norm"]._parameters["weight"] is registered


@pytest.mark.parametrize(("style", "shard_dim"), [("sp", 1), ("grad_sum", 2)])
def test_norm_runs_its_own_forward_on_its_dtensor_parameters(style: str, shard_dim: int) -> None:
    """SequenceParallelNorm on sequence shards (dim 1); ReplicatedGradSum on this rank's heads (dim 2)."""
    run_distributed(norm_case, 2, style, shard_dim)


def refused_case(kind: str) -> str:
    dims = setup_parallel(tp=2)
    module = parallelize_module(
        ColumnSum(8) if kind == "columns" else WatchedRMSNorm(8), dims.tp_mesh, SequenceParallelNorm()
    )
    try:
        module(torch.randn(3, 8) if kind == "columns" else torch.randn(8))
    except (RuntimeError, ValueError) as error:
        return str(error)
    return "not refused"


def test_norm_that_is_not_row_wise_is_refused() -> None:
    for message in run_distributed(refused_case, 2, "columns"):
        assert "ColumnSum: its output is" in message and "not row-wise" in message
    for message in run_distributed(refused_case, 2, "vector"):
        assert "WatchedRMSNorm" in message and "at least 2 dims" in message
