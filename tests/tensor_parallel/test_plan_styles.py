"""transformers' plan styles on bare parameters, mapped by meshpar.hf.hf_plan.resolve_entries and applied with
parallelize_module, against the dense module: output, every input grad and every parameter grad (this rank's shard)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from meshpar._compat import DTensor
from meshpar._shards import local_slice
from meshpar.hf.hf_plan import resolve_entries
from meshpar.tensor_parallel import RowParallel
from meshpar.tensor_parallel.style import LocalParameters
from meshpar.testing import run_distributed, setup_parallel

HIDDEN, INTER = 8, 16


class SharedExperts(nn.Module):
    """Inkling's shared experts: 3-D ``[experts, out, in]`` weights, gated by a per-token scale."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(1, INTER, HIDDEN) / HIDDEN**0.5)
        self.up_proj = nn.Parameter(torch.randn(1, INTER, HIDDEN) / HIDDEN**0.5)
        self.down_proj = nn.Parameter(torch.randn(1, HIDDEN, INTER) / INTER**0.5)

    def forward(self, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(1, -1, HIDDEN)
        gate = torch.bmm(flat, self.gate_proj.transpose(1, 2))
        up = torch.bmm(flat, self.up_proj.transpose(1, 2))
        down = torch.bmm(nn.functional.silu(gate) * up * gammas.reshape(1, -1, 1), self.down_proj.transpose(1, 2))
        return down.sum(0).view(x.shape)


class Sinks(nn.Module):
    """An attention-like module with one bare parameter per head next to column-parallel heads."""

    def __init__(self, heads: int = 4, sinks: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(HIDDEN, heads * 2)
        if sinks:  # MiMo-V2: its full attentions have none
            self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_head = self.proj(x).unflatten(-1, (-1, 2))  # the rank's heads only
        scale = self.sinks.sigmoid() if "sinks" in self._parameters else 1.0
        return (per_head.sum(-1) * scale).sum(-1)


def _grads_match(model: nn.Module, dense: nn.Module) -> None:
    for name, param in model.named_parameters():
        want = dense.get_parameter(name).grad
        if isinstance(param, DTensor):
            want = local_slice(want, param)
        got = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"grad of {name}")


def shared_experts_case() -> list[str]:
    """'all_reduce' over 'colwise' / 'rowwise' bare parameters: Megatron's MLP around one module."""
    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    dense = nn.ModuleDict({"shared": SharedExperts()})
    plan = {
        "shared": "all_reduce",
        "shared.gate_proj": "colwise",
        "shared.up_proj": "colwise",
        "shared.down_proj": "rowwise",
    }
    model = copy.deepcopy(dense)
    styles, _ = resolve_entries(model, plan, 2, replicate_kv=False)
    assert isinstance(styles["shared"], LocalParameters) and styles["shared"].partial_output
    parallelize_module(model, dims.tp_mesh, styles)
    x = torch.randn(2, 5, HIDDEN, requires_grad=True)
    gammas = torch.rand(2, 5, requires_grad=True)
    want = dense["shared"](x, gammas)
    want.square().sum().backward()
    mine_x, mine_g = x.detach().clone().requires_grad_(), gammas.detach().clone().requires_grad_()
    out = model["shared"](mine_x, gammas=mine_g)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    torch.testing.assert_close(mine_x.grad, x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine_g.grad, gammas.grad, atol=1e-5, rtol=1e-5)
    _grads_match(model, dense)
    return [type(p).__name__ for p in model.parameters()]


def test_shared_experts_stored_as_bare_parameters_match_dense() -> None:
    for kinds in run_distributed(shared_experts_case, 2):
        assert kinds == ["DTensor"] * 3, kinds  # the hooks put the sharded parameters back after the forward


def sinks_case() -> None:
    """'local_params' with a 'colwise' bare parameter: each rank keeps the sinks of its own heads."""
    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    dense = nn.ModuleDict({"attn": Sinks(), "full": Sinks(sinks=False)})  # the pattern names both, one has sinks
    plan = {"*.proj": "colwise", "*.sinks": "colwise", "*": "local_params"}
    model = copy.deepcopy(dense)
    styles, _ = resolve_entries(model, plan, 2, replicate_kv=False)
    parallelize_module(model, dims.tp_mesh, styles)
    x = torch.randn(3, HIDDEN)
    (dense["attn"](x) + dense["full"](x)).sum().backward()
    out = model["attn"](x) + model["full"](x)
    out.sum().backward()  # each rank's partial sum over its heads: the grads of its shards are the dense ones
    _grads_match(model, dense)
    with pytest.raises(RuntimeError):
        model["attn"](torch.randn(3, HIDDEN + 1))  # the forward raises inside, with the local shards in place
    assert isinstance(model["attn"].sinks, DTensor)  # put back all the same


def test_per_head_bare_parameters_are_sharded_with_their_heads() -> None:
    run_distributed(sinks_case, 2)


def test_bare_parameter_styles_that_cannot_be_placed_are_refused() -> None:
    model = nn.ModuleDict({"shared": SharedExperts()})
    model.shared.bias = nn.Parameter(torch.zeros(HIDDEN))
    plan = {"shared": "all_reduce", "shared.gate_proj": "colwise", "shared.bias": "rowwise"}
    with pytest.raises(ValueError, match=r"shared.bias: 'rowwise' on a 1-D bare parameter"):
        resolve_entries(model, plan, 2, replicate_kv=False)
    with pytest.raises(ValueError, match=r"shared.gate_proj: 'colwise' on a bare parameter"):
        resolve_entries(model, {"shared.gate_proj": "colwise"}, 2, replicate_kv=False)


class Gates(nn.Module):
    """Doge's per-head gates: column-parallel heads, a projection of all their features to one gate per head, and a
    per-head scale; the gates then act on each head."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.heads = nn.Linear(HIDDEN, heads * 2)
        self.gate = nn.Linear(heads * 2, heads)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_head = self.heads(x)
        gates = torch.sigmoid(self.gate(per_head) * self.scale)
        return (per_head.unflatten(-1, (-1, 2)).sum(-1) * gates).sum(-1)


def local_output_case() -> None:
    """``RowParallel(local_output=True)``: every rank reduces the gates of all heads and keeps its own heads'."""
    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    dense = nn.ModuleDict({"g": Gates()})
    plan = {"g.heads": "colwise", "g.gate": RowParallel(local_output=True), "g": "local_params", "g.scale": "colwise"}
    model = copy.deepcopy(dense)
    styles, _ = resolve_entries(model, plan, 2, replicate_kv=False)
    parallelize_module(model, dims.tp_mesh, styles)
    x = torch.randn(3, 5, HIDDEN, requires_grad=True)
    dense["g"](x).square().sum().backward()
    mine = x.detach().clone().requires_grad_()
    out = model["g"](mine)  # a partial sum over this rank's heads
    total = out.detach().clone()
    torch.distributed.all_reduce(total, group=dims.tp_mesh.get_group())
    torch.testing.assert_close(total, dense["g"](x).detach(), atol=1e-5, rtol=1e-5)
    (out * (2 * total)).sum().backward()  # the grad of square(sum over ranks) through this rank's share
    _grads_match(model, dense)
    torch.testing.assert_close(mine.grad, x.grad, atol=1e-5, rtol=1e-5)


def test_row_parallel_with_local_output_keeps_each_ranks_heads() -> None:
    run_distributed(local_output_case, 2)


def test_row_parallel_local_output_is_refused_where_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match="pick one"):
        RowParallel(local_output=True, sequence_parallel=True)
