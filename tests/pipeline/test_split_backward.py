"""The zero-bubble split backward on its own: the input-grad pass leaves every parameter's grad untouched and gives
the stage input the full backward's grad; the weight pass then gives every parameter the full backward's grad, on
graphs with shared parameters, norms, branches that bypass the input, activation checkpointing, scalar losses and
meshpar's fused tensor-parallel linears (whose weight pass must not repeat the input grad's all-reduce)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from meshpar.pipeline._split_backward import backward_input
from meshpar.testing import run_distributed
from meshpar.testing.dispatch import AtenOps

H = 8


class Block(nn.Module):
    """A norm, a gated MLP, a residual, a bias-only branch and a weight used twice, with another weight between its
    uses (as Gemma-3n's altup router, applied before and after the altup correction)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.gate, self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.shift = nn.Parameter(torch.randn(H))  # reaches the output without touching the input's path
        self.shared, self.between = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
        # the same weight twice: two frontier nodes in one group, another group's frontier on the path between them
        x = self.shared(torch.tanh(self.between(self.shared(x))))
        return x * 0.5 + self.shift.tanh()


def _checkpointed(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)


@pytest.mark.parametrize("variant", ["output_grad", "scalar_loss", "checkpointed", "first_stage"])
def test_input_pass_then_weight_pass_equal_the_full_backward(variant: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    reference = copy.deepcopy(model)
    x = torch.randn(3, 5, H)
    grad = torch.randn(3, 5, H)
    run = _checkpointed(model) if variant == "checkpointed" else model
    needs_input = variant != "first_stage"

    ref_x = x.clone().requires_grad_(needs_input)
    ref_out = reference(ref_x)
    if variant == "scalar_loss":
        ref_out.square().mean().backward()
    else:
        ref_out.backward(grad)

    split_x = x.clone().requires_grad_(needs_input)
    out = run(split_x)
    if variant == "scalar_loss":
        out, seed = out.square().mean(), None
    else:
        seed = grad
    deferred = backward_input(out, seed, split_x if needs_input else None, model.parameters())
    assert all(p.grad is None for p in model.parameters())  # the input pass touched no parameter
    if needs_input:
        torch.testing.assert_close(split_x.grad, ref_x.grad)
    deferred.run()
    for (name, mine), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, ref.grad, msg=name)


def test_weight_pass_fires_post_accumulate_hooks_once_per_parameter() -> None:
    torch.manual_seed(0)
    block = Block()
    fired: list[str] = []
    for name, param in block.named_parameters():
        param.register_post_accumulate_grad_hook(lambda _, name=name: fired.append(name))
    x = torch.randn(2, 3, H, requires_grad=True)
    deferred = backward_input(block(x), torch.randn(2, 3, H), x, block.parameters())
    assert fired == []
    deferred.run()
    assert sorted(fired) == sorted(name for name, _ in block.named_parameters())


def _tensor_parallel_split(sp: bool) -> tuple[list[str], list[str]]:
    """tp=2 column -> row MLP on meshpar's fused linears: equal to the dense grads; the collectives of each pass."""
    from meshpar import ColumnParallelLinear, RowParallelLinear
    from meshpar.testing import assert_matches_dense, setup_parallel, shard_of

    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(H, 4 * H), nn.Tanh(), nn.Linear(4 * H, H))
    torch.manual_seed(0)  # the sharded layers hold exactly their slices of the dense init
    column = ColumnParallelLinear(H, 4 * H, gather_output=False, sequence_parallel_enabled=sp, tp_mesh=dims.tp_mesh)
    row = RowParallelLinear(4 * H, H, input_is_parallel=True, sequence_parallel_enabled=sp, tp_mesh=dims.tp_mesh)
    x, grad = torch.randn(2, 4, H), torch.randn(2, 4, H)
    ref_x = x.clone().requires_grad_()
    dense(ref_x).backward(grad)

    split_x = (shard_of(x, dims.tp_mesh, 1) if sp else x).clone().requires_grad_()
    out = row(torch.tanh(column(split_x)))
    seed = shard_of(grad, dims.tp_mesh, 1) if sp else grad
    # the collectives each pass dispatches, by name (counted where c10d ops are dispatched, whatever API called them)
    with AtenOps() as input_pass:
        deferred = backward_input(out, seed, split_x, [*column.parameters(), *row.parameters()])
    assert all(p.grad is None for p in [*column.parameters(), *row.parameters()])
    with AtenOps() as weight_pass:
        deferred.run()
    input_calls, weight_calls = (sorted(ops.collective_names.elements()) for ops in (input_pass, weight_pass))
    expected_x = shard_of(ref_x.grad, dims.tp_mesh, 1) if sp else ref_x.grad
    torch.testing.assert_close(split_x.grad, expected_x, atol=1e-5, rtol=1e-5)
    for layer, reference in ((column, dense[0]), (row, dense[2])):
        for name, param in layer.named_parameters():
            assert_matches_dense(param.grad, getattr(reference, name).grad, msg=name)
    return input_calls, weight_calls


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_tensor_parallel_layers_split_backward_collectives_per_pass(sp: bool) -> None:
    input_calls, weight_calls = run_distributed(_tensor_parallel_split, 2, sp)[0]
    # sp: the row all-gathers the output grad over the sequence once, in the input pass (the weight pass uses what it
    # gathered), the column's input grad is reduce-scattered there; the row's bias grad is summed in the weight pass
    if sp:
        assert (input_calls, weight_calls) == (["all_gather_into_tensor", "reduce_scatter_tensor"], ["all_reduce"])
    else:  # the column's input grad is all-reduced once, in the input pass
        assert (input_calls, weight_calls) == (["all_reduce"], [])


def _row_grads_after_an_input_only_grad(change: str) -> None:
    """The SP row's input-only backward keeps the output grad it gathered; a later weight-only backward uses it only
    for that very grad, unchanged: another grad, or the same one changed in place, is gathered afresh."""
    from meshpar import RowParallelLinear
    from meshpar.testing import assert_matches_dense, setup_parallel, shard_of

    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    dense = nn.Linear(4 * H, H)
    torch.manual_seed(0)
    row = RowParallelLinear(4 * H, H, input_is_parallel=True, sequence_parallel_enabled=True, tp_mesh=dims.tp_mesh)
    x, first = torch.randn(2, 4, 4 * H), torch.randn(2, 4, H)
    second = first if change == "none" else torch.randn(2, 4, H)
    x_shard = shard_of(x, dims.tp_mesh, 2).clone().requires_grad_()
    out = row(x_shard)
    seed = shard_of(first, dims.tp_mesh, 1).clone()
    torch.autograd.grad(out, [x_shard], seed, retain_graph=True)
    if change == "in_place":
        second = first * 3
        seed.mul_(3)
    weight_seed = seed if change in ("none", "in_place") else shard_of(second, dims.tp_mesh, 1)
    (grad_w,) = torch.autograd.grad(out, [row.weight], weight_seed)
    dense(x).backward(second)
    assert_matches_dense(grad_w, dense.weight.grad, msg=change)


@pytest.mark.parametrize("change", ["none", "other_grad", "in_place"])
def test_a_kept_output_grad_serves_only_the_grad_it_was_gathered_from(change: str) -> None:
    run_distributed(_row_grads_after_an_input_only_grad, 2, change)
