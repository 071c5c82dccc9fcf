"""Column-parallel projections that read the same input (q/k/v, gate/up) reduce their input grad once.

Each column-parallel linear all-reduces its input grad over tp in backward. When q, k and v (or gate and up) read one
tensor, Megatron fuses them into one weight, so the grads are summed locally and all-reduced once. HF models keep
them as separate modules called one after the other, so meshpar fuses at run time: the first member of a
:class:`SharedInputGroup` to be called computes every member's output for that input in one autograd node
(:class:`SharedInputColumnFunction`: one local input-grad sum, one all-reduce), and the other members, called with
the *same tensor object*, take their output from it. A member called with another input computes its own group
call; an output nobody takes gets a zero grad. So a grouping that guesses wrong costs compute, never correctness.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar._compat import DeviceMesh, DTensor, dtensor_like, grad_needed, local_tensor
from meshpar.tensor_parallel._linear_functions import _autocast_operands, _flat

# sibling modules that read one input in HF's families (attention projections, gated MLPs)
SHARED_INPUT_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"), ("w1", "w3"))


class SharedInputColumnFunction(torch.autograd.Function):
    """``y_i = x W_i^T + b_i`` for every member; backward sums ``dy_i W_i`` locally and all-reduces the sum once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, *params: DTensor | None) -> tuple[torch.Tensor, ...]:
        weights, biases = params[0::2], params[1::2]
        ctx.mesh, ctx.weights, ctx.biases = mesh, weights, biases
        outputs, saved = [], []
        for weight, bias in zip(weights, biases, strict=True):
            xc, w, b = _autocast_operands(x, local_tensor(weight), local_tensor(bias) if bias is not None else None)
            saved.append(w)
            outputs.append(torch.nn.functional.linear(xc, w, b))
        ctx.save_for_backward(xc, *saved)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        x, *local_weights = ctx.saved_tensors
        grad_x = work = None
        if grad_needed(ctx, 0):  # a zero-bubble weight-grad pass skips the input grad and its all-reduce
            grad_x = grads[0] @ local_weights[0]
            for grad, w in zip(grads[1:], local_weights[1:], strict=True):
                grad_x.add_(grad @ w)  # the local sum: one all-reduce for all members
            if ctx.mesh.size() > 1:
                work = dist.all_reduce(grad_x, group=ctx.mesh.get_group(), async_op=True)
        param_grads: list[DTensor | None] = []
        edge = 1  # the tensor inputs: x, then each member's weight and bias (where it has one)
        for grad, weight, bias in zip(grads, ctx.weights, ctx.biases, strict=True):
            need_w, need_b = grad_needed(ctx, edge), bias is not None and grad_needed(ctx, edge + 1)
            edge += 1 if bias is None else 2
            param_grads.append(dtensor_like((_flat(grad).t() @ _flat(x)).to(weight.dtype), weight) if need_w else None)
            param_grads.append(dtensor_like(_flat(grad).sum(0).to(bias.dtype), bias) if need_b else None)
        if work is not None:
            work.wait()
        return (grad_x, None, *param_grads)


class SharedInputGroup:
    """Column-parallel siblings that read one input; see the module docstring."""

    def __init__(self, members: list[nn.Module]) -> None:
        self.members = members
        self._taken: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(member) -> (input, its output)

    def output_for(self, member: nn.Module, x: torch.Tensor) -> torch.Tensor:
        cached = self._taken.pop(id(member), None)
        if cached is not None and cached[0] is x:
            return cached[1]
        params = [p for m in self.members for p in (m.weight, m.bias)]
        outputs = SharedInputColumnFunction.apply(x, member.tp_mesh, *params)
        self._taken = {id(m): (x, out) for m, out in zip(self.members, outputs, strict=True) if m is not member}
        return outputs[self.members.index(member)]


def group_shared_inputs(model: nn.Module) -> int:
    """Give the column-parallel siblings of :data:`SHARED_INPUT_NAMES` one group each (same input size, dtype and
    plain column layout: no sequence parallelism, no gathered output). Returns the number of groups."""
    from meshpar.tensor_parallel.layers import ColumnParallelLinear

    groups = 0
    for parent in model.modules():
        for names in SHARED_INPUT_NAMES:
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, ColumnParallelLinear) for m in members):
                continue
            plain = all(
                not m.sequence_parallel_enabled and not m.gather_output and not m.input_gathered and not m.weight_in_out
                for m in members
            )
            alike = len({(m.input_size, m.weight.dtype, m.tp_mesh) for m in members}) == 1
            if plain and alike:
                group = SharedInputGroup(members)
                for member in members:
                    member.shared_input_group = group
                groups += 1
    return groups
