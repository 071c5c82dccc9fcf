"""``neuronx_distributed.parallel_layers.layers_utils``: the steps NxD's linear autograd functions are built from,
for code that writes its own (NxD's layers and tests import them; the view's ``LinearWithAsyncCommunication`` is
built from them).

``_linear_autograd_base_setup_fwd`` records the options on ``ctx``, saves ``(input, weight)`` (``weight`` alone
when it takes no grad) and returns the input the matmul sees: all-gathered along ``sequence_dimension`` under
sequence parallelism. ``_linear_autograd_base_setup_bwd`` returns ``(total_input, weight, grad_output)`` (the
input gathered again under sequence parallelism; ``None`` when no weight grad is computed).
``_linear_autograd_bwd_grad_reduce`` starts the asynchronous all-reduce of the input grad (in ``reduce_dtype``)
and returns its handle (``None`` without ``async_grad_allreduce``). ``_linear_autograd_bwd_no_weight_grad`` and
``_linear_autograd_bwd_input_grad`` reduce-scatter the input grad back to the sequence shard (the latter also waits
for the all-reduce), casting back to the grad's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshpar.compat.nxd.parallel_layers import comm
from meshpar.compat.nxd.parallel_layers.mappings import group_mesh


def _group(ctx: Any) -> dist.ProcessGroup:
    return ctx.process_group if ctx.process_group is not None else group_mesh(None).get_group()


def _gather_along_dim(x: torch.Tensor, dim: int, process_group: dist.ProcessGroup) -> torch.Tensor:
    return comm.all_gather(x, dim=dim, groups=process_group)


def _reduce_scatter_along_dim(x: torch.Tensor, dim: int, process_group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(process_group)
    return comm.reduce_scatter("sum", x, 1, dim, size, groups=process_group).contiguous()


def _compute_gradients(
    input: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor, use_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias grads of ``input @ weight^T + bias`` (``input``: the ``[rows, in]`` input rows; the grad
    is flattened to rows alike)."""
    rows = grad_output.reshape(-1, grad_output.shape[-1])
    return rows.t().matmul(input), rows.sum(dim=0) if use_bias else None


def _linear_autograd_base_setup_fwd(
    ctx: Any,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    async_grad_allreduce: bool,
    sequence_parallel_enabled: bool,
    sequence_dimension: int | None = 0,
    save_for_backward: bool = True,
    process_group: dist.ProcessGroup | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    if sequence_parallel_enabled and sequence_dimension is None:
        raise ValueError("sequence_parallel_enabled needs a sequence_dimension")
    ctx.use_bias = bias is not None and weight.requires_grad
    ctx.async_grad_allreduce = async_grad_allreduce
    ctx.sequence_parallel_enabled = sequence_parallel_enabled
    ctx.sequence_dimension = sequence_dimension
    ctx.compute_weight_gradient = weight.requires_grad
    ctx.process_group = process_group
    ctx.reduce_dtype = reduce_dtype
    if save_for_backward:
        ctx.save_for_backward(*((input, weight) if ctx.compute_weight_gradient else (weight,)))
    if sequence_parallel_enabled:
        return _gather_along_dim(input, sequence_dimension, process_group=_group(ctx))
    return input


def _linear_autograd_base_setup_bwd(ctx: Any, grad_outputs: Any) -> tuple[torch.Tensor | None, torch.Tensor, Any]:
    grad_output = grad_outputs[0]
    if ctx.compute_weight_gradient:
        input, weight = ctx.saved_tensors
    else:
        input, weight = None, ctx.saved_tensors[0]
    total_input = None
    if ctx.compute_weight_gradient:
        sp = ctx.sequence_parallel_enabled
        total_input = _gather_along_dim(input, ctx.sequence_dimension, process_group=_group(ctx)) if sp else input
    return total_input, weight, grad_output


def _linear_autograd_bwd_grad_reduce(ctx: Any, grad_input: torch.Tensor, original_dtype: torch.dtype) -> Any:
    if not ctx.async_grad_allreduce:
        return None
    reduced = grad_input.to(ctx.reduce_dtype)
    handle = dist.all_reduce(reduced, group=_group(ctx), async_op=True)
    ctx.reduced_grad_input = reduced  # the tensor the handle writes; cast back once it is done
    return handle


def _linear_autograd_bwd_no_weight_grad(ctx: Any, grad_input: torch.Tensor, original_dtype: torch.dtype) -> Any:
    if ctx.async_grad_allreduce:
        raise ValueError("the input grad is all-reduced asynchronously here, not reduce-scattered")
    shard = _reduce_scatter_along_dim(
        grad_input.to(ctx.reduce_dtype), ctx.sequence_dimension, process_group=_group(ctx)
    )
    return shard.to(original_dtype)


def _linear_autograd_bwd_input_grad(
    ctx: Any, grad_input: torch.Tensor, handle: Any, original_dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor]:
    shard = None
    if ctx.sequence_parallel_enabled:
        if ctx.async_grad_allreduce:
            raise ValueError("sequence parallelism reduce-scatters the input grad; it is not all-reduced too")
        shard = _reduce_scatter_along_dim(
            grad_input.to(ctx.reduce_dtype), ctx.sequence_dimension, process_group=_group(ctx)
        )
        shard = shard.to(original_dtype)
    return shard, _reduced_input_grad(ctx, grad_input, handle, original_dtype)


def _reduced_input_grad(ctx: Any, grad_input: torch.Tensor, handle: Any, original_dtype: torch.dtype) -> torch.Tensor:
    """The input grad once its asynchronous all-reduce (``handle``) is done, in ``original_dtype``; as it is
    without ``async_grad_allreduce``."""
    if not ctx.async_grad_allreduce:
        return grad_input
    if handle is None:
        raise ValueError("async_grad_allreduce without the all-reduce's handle")
    handle.wait()
    # the reduced values live in the cast copy the all-reduce wrote (grad_input itself when no cast was needed)
    reduced = getattr(ctx, "reduced_grad_input", None)
    return (reduced if isinstance(reduced, torch.Tensor) else grad_input).to(original_dtype)


__all__: list[str] = []
