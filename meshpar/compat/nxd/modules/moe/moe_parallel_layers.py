"""``neuronx_distributed.modules.moe.moe_parallel_layers``: linear layers over every local expert at once.

``ExpertFusedColumnParallelLinear`` holds ``weight`` ``[E / ep, in, out / tp]`` (each expert's matrix stored
input-major, split over tp along its output features: ``partition_dim`` 2) and ``ExpertFusedRowParallelLinear``
``[E / ep, in / tp, out]`` (split along its input features: ``partition_dim`` 1); both compute
``out[e] = x[e] @ weight[e]`` for inputs ``[E', ..., in]`` (``E'`` the local experts, or 1 broadcast over them).
They are NxD's tensor-parallel linear layers with 3-D weights: the column layer's input grad is summed over tp in
backward, the row layer's output is summed over tp unless ``reduce_output=False`` (NxD's MoE sums once, after the
experts' outputs are combined). Biases are ``[E / ep, out / tp]`` and ``[E / ep, out]``, added after the matmul on
every rank (with ``reduce_output=False`` a row bias is then counted tp times by the later sum, as NxD notes).

Under expert parallelism (``expert_model_parallel_group`` of size > 1, the parallel state's by default) a rank
holds its ep rank's contiguous block of experts and every parameter is marked ``expert_model_parallel`` (and
``is_prefill``), as NxD marks them, so the grad reductions, clipping, ZeRO-1 and checkpoints treat them as expert
weights.

Initialisation keeps this view's layer contract (any tp and any ep give the same model): each expert's weight is
initialised alone from a seed of its own (one draw per tensor from the default generator, plus its global expert
id), in full, then cut to this rank's shard. NxD initialises the local experts in turn from the generator, so its
values depend on ep. The input-grad all-reduce runs in ``reduce_dtype`` (NxD's leaves that as a to-do and reduces
in the grad's dtype). Sequence parallelism, a bias inside the fused matmul and ``expert_distribution`` are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import init

from meshpar._compat import DeviceMesh
from meshpar.compat.nxd.parallel_layers import layers, parallel_state
from meshpar.compat.nxd.parallel_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    group_mesh,
    reduce_from_tensor_model_parallel_region,
)
from meshpar.compat.nxd.parallel_layers.utils import divide, ensure_parallel_state
from meshpar.parallel_dims import get_parallel


def per_expert_init(experts: range, shape: tuple[int, ...], dtype: torch.dtype, init_fn: Callable) -> torch.Tensor:
    """``[len(experts), *shape]``: expert ``g`` initialised by ``init_fn`` from its own seed, ``base + g``, ``base``
    drawn once from the default generator (the same draw on every rank). Only the given experts are made, and they
    are the values a layer holding every expert, built from the same generator state, gives them."""
    base = int(torch.randint(0, 2**62, ()))
    out = torch.empty(len(experts), *shape, dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        for i, g in enumerate(experts):
            torch.default_generator.manual_seed(base + g)
            init_fn(out[i])
    return out


def expert_parallel_mesh(group: Any) -> DeviceMesh | None:
    """The expert-parallel mesh experts are split over: ``group``'s (``None`` for a group of one rank), or the
    parallel state's without one (``None`` without expert parallelism)."""
    if group is None:
        return get_parallel().ep_mesh
    return group_mesh(group) if group.size() > 1 else None


class ExpertFusedLinearWithAsyncCommunication(torch.autograd.Function):
    """``out = einsum("e...h,ehi->e...i", input, weight)``: one matmul per expert, every expert in one call. With
    ``async_grad_allreduce`` the input grad is summed over ``process_group`` in backward (in ``reduce_dtype``), the
    column layer's replicated input. The arguments are :class:`~meshpar.compat.nxd.parallel_layers.layers.
    LinearWithAsyncCommunication`'s, so the layers' ``_forward_impl`` runs either."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        async_grad_allreduce: bool,
        sequence_parallel_enabled: bool,
        sequence_dimension: int | None = 0,
        save_for_backward: bool = True,
        process_group: Any = None,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        if bias is not None:
            raise NotImplementedError("the fused expert matmul takes no bias: the layers add theirs after it")
        if sequence_parallel_enabled:
            raise NotImplementedError(
                "sequence parallelism is not provided for the expert-fused linear layers: leave the sequence-parallel "
                "region (as NxD's MoE layer does) before the experts"
            )
        if input.shape[0] not in (1, weight.shape[0]):
            raise RuntimeError(
                f"input and weight disagree on the number of experts (dim 0): input {tuple(input.shape)}, "
                f"weight {tuple(weight.shape)}"
            )
        ctx.async_grad_allreduce = async_grad_allreduce
        if process_group is None:
            process_group = parallel_state.get_tensor_model_parallel_group()
        ctx.process_group = process_group
        ctx.reduce_dtype = reduce_dtype
        ctx.save_for_backward(input, weight)
        output = torch.einsum("e...h,ehi->e...i", input, weight)
        # einsum may return a view of its matmul's result: a custom Function's output is then not modifiable in
        # place (the row layer's all-reduce is), so it is returned as a tensor of its own
        return output.clone() if output._base is not None else output

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        grad_output = grad_outputs[0]
        grad_input = torch.einsum("e...i,ehi->e...h", grad_output, weight)
        if ctx.async_grad_allreduce and dist.get_world_size(ctx.process_group) > 1:
            reduced = grad_input.to(ctx.reduce_dtype).contiguous()
            dist.all_reduce(reduced, group=ctx.process_group)
            grad_input = reduced.to(grad_output.dtype)
        grad_weight = torch.einsum("e...h,e...i->ehi", input, grad_output) if ctx.needs_input_grad[1] else None
        return grad_input, grad_weight, *(None,) * 7


class ExpertFusedLinear(nn.Module):
    """What the expert-fused layers share: their experts' block of this rank (``_experts``), the marking of their
    parameters (and saved tensors) as expert-parallel when ep > 1, and the per-expert initialisation."""

    def _setup_experts(
        self,
        num_experts: int,
        expert_model_parallel_group: Any,
        is_prefill: bool,
        is_fused_gate_up: bool,
        expert_distribution: Any,
        device: torch.device | None,
    ) -> None:
        """Before the tp layer's constructor: the parallel state (a one-process one, as NxD's layers fall back
        to), this rank's block of experts and the ep mesh."""
        ensure_parallel_state(device)
        if expert_distribution is not None:
            raise NotImplementedError(
                "expert_distribution places experts on expert-parallel ranks out of order or more than once; this "
                "view gives each ep rank its contiguous block of experts"
            )
        self.ep_mesh = expert_parallel_mesh(expert_model_parallel_group)
        self._ep_group = expert_model_parallel_group
        ep, ep_rank = (self.ep_mesh.size(), self.ep_mesh.get_local_rank()) if self.ep_mesh is not None else (1, 0)
        self.num_experts, self.is_prefill, self.is_fused_gate_up = num_experts, is_prefill, is_fused_gate_up
        self._n_local_experts = divide(num_experts, ep)
        self._experts = range(ep_rank * self._n_local_experts, (ep_rank + 1) * self._n_local_experts)

    @property
    def expert_model_parallel_group(self) -> Any:
        """The group given, else the parallel state's ep group (its one-rank group without expert parallelism,
        made when first asked for: building the layer makes no group)."""
        return self._ep_group if self._ep_group is not None else parallel_state.get_expert_model_parallel_group()

    def _mark_expert_parallel_weights(self, iterable: Iterable[torch.Tensor] | None = None) -> None:
        if self.ep_mesh is not None:
            for tensor in self.parameters() if iterable is None else iterable:
                tensor.expert_model_parallel = True
                if self.is_prefill:
                    tensor.is_prefill = True
                tensor.expert_distribution = None

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> nn.Module:
        """Moved or cast parameters may be new tensors: marked again."""
        out = super()._apply(fn, *args, **kwargs)
        self._mark_expert_parallel_weights()
        return out

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """The saved tensors are marked too (NxD's checkpointing reads the marks off the state dict)."""
        before = {id(value) for value in destination.values()}
        super()._save_to_state_dict(destination, prefix, keep_vars)
        self._mark_expert_parallel_weights([v for v in destination.values() if id(v) not in before])

    def _init_weight(self, weight: torch.Tensor) -> None:
        """``weight``: this rank's experts' full matrices ``[E / ep, in, out]``, each initialised from its own seed
        (``init_method``, or ``nn.Linear``'s Kaiming uniform on the ``[in, out]`` matrix, as NxD)."""
        method = self.arg_init_method or (lambda w: init.kaiming_uniform_(w, a=math.sqrt(5)))
        with torch.no_grad():
            weight.copy_(per_expert_init(self._experts, tuple(weight.shape[1:]), weight.dtype, method))

    def _expert_bias(self, size: int, bound: float, stride: int = 1) -> None:
        """This rank's shard (``size`` of the full ``self.bias.shape[1] * parts``) of per-expert uniform biases."""
        full = per_expert_init(self._experts, (size,), torch.float32, lambda b: init.uniform_(b, -bound, bound))
        local = full if size == self.bias.shape[1] else layers.create_local_weight(full, 1, self.bias.shape[1], stride)
        with torch.no_grad():
            self.bias.copy_(local.to(self.bias.dtype))

    def _expert_bias_in(self, expert_indices: torch.Tensor | None) -> torch.Tensor | None:
        """The bias of the computed experts, shaped to add to ``[e, ep, c, out]``."""
        if self.bias is None:
            return None
        bias = self.bias[expert_indices] if expert_indices is not None else self.bias
        return bias.unsqueeze(1).unsqueeze(2)


class ExpertFusedColumnParallelLinear(layers.ColumnParallelLinear, ExpertFusedLinear):
    """Every local expert's column-parallel projection (see the module docstring): ``forward(x [E', ..., in],
    expert_indices=None)`` returns ``[E', ..., out / tp]``; ``expert_indices`` computes only those local experts."""

    autograd_func_class = ExpertFusedLinearWithAsyncCommunication
    _init_weight = ExpertFusedLinear._init_weight  # ahead of BaseParallelLinear's in the method order

    def __init__(
        self,
        num_experts: int,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        stride: int = 1,
        init_method: Callable[..., Any] | None = None,
        keep_master_weight: bool = False,
        tensor_model_parallel_group: Any = None,
        expert_model_parallel_group: Any = None,
        is_prefill: bool = True,
        is_fused_gate_up: bool = False,
        expert_distribution: list[list[int]] | None = None,
    ) -> None:
        self._setup_experts(
            num_experts, expert_model_parallel_group, is_prefill, is_fused_gate_up, expert_distribution, device
        )
        super().__init__(
            input_size, output_size, bias=bias, gather_output=False, dtype=dtype, device=device, stride=stride,
            init_method=init_method, sequence_parallel_enabled=False, keep_master_weight=keep_master_weight,
            skip_bias_add=False, tensor_model_parallel_group=tensor_model_parallel_group,
        )  # fmt: skip
        self._mark_expert_parallel_weights()

    def set_weight_and_bias_config(self) -> None:
        self.weight_shape = (self._n_local_experts, self.input_size, self.output_size_per_partition)
        self.weight_partition_dim = 2
        self.bias_shape = (self._n_local_experts, self.output_size_per_partition) if self.add_bias else None
        self.bias_partition_dim = 1

    def _init_bias(self) -> None:  # nn.Linear's bound from the full fan-in, so any tp gives the same biases
        self._expert_bias(self.output_size, 1 / math.sqrt(self.input_size), self.stride)

    def forward(self, input_: torch.Tensor, expert_indices: torch.Tensor | None = None, *_: Any) -> torch.Tensor:
        if not self.async_tensor_model_parallel_allreduce:  # tp 1 (the layer is never sequence parallel)
            input_ = copy_to_tensor_model_parallel_region(input_, process_group=self.tensor_parallel_group)
        weight = self.weight[expert_indices] if expert_indices is not None else self.weight
        output = self._forward_impl(
            input=input_, weight=weight, bias=None, async_grad_allreduce=self.async_tensor_model_parallel_allreduce,
            sequence_parallel_enabled=False, autograd_func_class=self.autograd_func_class,
            process_group=self.tensor_parallel_group, reduce_dtype=self.reduce_dtype,
        )  # fmt: skip
        bias = self._expert_bias_in(expert_indices)
        return output + bias if bias is not None else output


class ExpertFusedRowParallelLinear(layers.RowParallelLinear, ExpertFusedLinear):
    """Every local expert's row-parallel projection (see the module docstring): ``forward(x [E', ..., in / tp],
    expert_indices=None)`` returns ``[E', ..., out]``, summed over tp unless ``reduce_output=False``."""

    autograd_func_class = ExpertFusedLinearWithAsyncCommunication
    _init_weight = ExpertFusedLinear._init_weight  # ahead of BaseParallelLinear's in the method order

    def __init__(
        self,
        num_experts: int,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_output: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        stride: int = 1,
        init_method: Callable[..., Any] | None = None,
        keep_master_weight: bool = False,
        tensor_model_parallel_group: Any = None,
        expert_model_parallel_group: Any = None,
        is_prefill: bool = True,
        is_fused_gate_up: bool = False,
        expert_distribution: list[list[int]] | None = None,
    ) -> None:
        self._setup_experts(
            num_experts, expert_model_parallel_group, is_prefill, is_fused_gate_up, expert_distribution, device
        )
        super().__init__(
            input_size, output_size, bias=bias, input_is_parallel=True, dtype=dtype, device=device, stride=stride,
            init_method=init_method, sequence_parallel_enabled=False, keep_master_weight=keep_master_weight,
            skip_bias_add=False, reduce_output=reduce_output, tensor_model_parallel_group=tensor_model_parallel_group,
        )  # fmt: skip
        self._mark_expert_parallel_weights()

    def set_weight_and_bias_config(self) -> None:
        self.weight_shape = (self._n_local_experts, self.input_size_per_partition, self.output_size)
        self.weight_partition_dim = 1
        self.bias_shape = (self._n_local_experts, self.output_size) if self.add_bias else None

    def _init_bias(self) -> None:  # the full fan-in (NxD's uses this rank's slice of it, which changes with tp)
        self._expert_bias(self.output_size, 1 / math.sqrt(self.input_size))

    def forward(self, input_: torch.Tensor, expert_indices: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight[expert_indices] if expert_indices is not None else self.weight
        output = self._forward_impl(
            input=input_, weight=weight, bias=None, async_grad_allreduce=False, sequence_parallel_enabled=False,
            autograd_func_class=self.autograd_func_class, process_group=self.tensor_parallel_group,
            reduce_dtype=self.reduce_dtype,
        )  # fmt: skip
        if self.reduce_output:
            output = reduce_from_tensor_model_parallel_region(output, process_group=self.tensor_parallel_group)
        bias = self._expert_bias_in(expert_indices)
        return output + bias if bias is not None else output


__all__ = [
    "ExpertFusedColumnParallelLinear",
    "ExpertFusedLinear",
    "ExpertFusedLinearWithAsyncCommunication",
    "ExpertFusedRowParallelLinear",
]
