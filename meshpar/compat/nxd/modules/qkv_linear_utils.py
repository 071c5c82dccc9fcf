"""``neuronx_distributed.modules.qkv_linear_utils``: the steps NxD's grouped q / k / v autograd function
(:class:`~meshpar.compat.nxd.modules.qkv_linear.GQAQKVLinearWithAsyncCommunication`) is built from, for code that
writes its own.

The collectives are torch_xla-shaped calls over the parallel state's replica groups, run by the view's shim
(:mod:`meshpar.compat.nxd.xla`, imported here as ``xm`` as in NxD):

- ``_qkvlinear_autograd_base_setup_fwd`` records the options on ``ctx``, saves the input and weights (the weights
  alone when they take no grad) and returns the input the matmuls see: under sequence parallelism the sequence
  shards all-gathered along dim 0 (NxD's ``[s, b, h]`` layout);
- ``_qkvlinear_autograd_base_setup_bwd`` returns ``(total_input, weight_qkv, weight_q, weight_k, weight_v,
  grad_output_k, grad_output_v)``: the input gathered again for the weight grads, and the k / v output grads summed
  over the kv-shared group when the kv heads are replicated (``kv_size_multiplier > 1``), which makes them the
  dense heads' output grads on every replica;
- ``_qkvlinear_autograd_bwd_grad_reduce`` sums the input grad over tp (in ``reduce_dtype``) with
  ``async_grad_allreduce``;
- ``_qkvlinear_autograd_bwd_no_weight_grad`` / ``_qkvlinear_autograd_bwd_input_grad`` reduce-scatter it back to
  this rank's sequence shard (dim 0), in the grad's own dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshpar.compat.nxd import xla as xm
from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.compat.nxd.parallel_layers.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_replica_groups,
    get_tensor_model_parallel_size,
)


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


def _qkvlinear_autograd_base_setup_fwd(
    ctx: Any,
    input: torch.Tensor,
    weight_q: torch.Tensor | None,
    weight_k: torch.Tensor | None,
    weight_v: torch.Tensor | None,
    bias_q: torch.Tensor | None,
    bias_k: torch.Tensor | None,
    bias_v: torch.Tensor | None,
    async_grad_allreduce: bool,
    sequence_parallel_enabled: bool,
    kv_size_multiplier: int,
    weight_qkv: torch.Tensor | None = None,
    bias_qkv: torch.Tensor | None = None,
    fuse_qkv: bool = False,
    output_size_q: int | None = None,
    output_size_kv: int | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    ctx.use_bias = check_use_bias(weight_qkv, fuse_qkv, weight_q, bias_q, bias_qkv)
    ctx.async_grad_allreduce = async_grad_allreduce
    ctx.sequence_parallel_enabled = sequence_parallel_enabled
    ctx.compute_weight_gradient = check_requires_grad(weight_qkv, fuse_qkv, weight_q)
    ctx.kv_size_multiplier = kv_size_multiplier
    ctx.fuse_qkv = fuse_qkv
    ctx.reduce_dtype = reduce_dtype
    weights = (weight_qkv,) if fuse_qkv else (weight_q, weight_k, weight_v)
    ctx.save_for_backward(*((input, *weights) if ctx.compute_weight_gradient else weights))
    if sequence_parallel_enabled:
        return xm.all_gather(input, groups=get_tensor_model_parallel_replica_groups(), pin_layout=False)
    return input


def _qkvlinear_autograd_base_setup_bwd(
    ctx: Any, grad_output_q: torch.Tensor, grad_output_k: torch.Tensor, grad_output_v: torch.Tensor
) -> tuple[Any, Any, Any, Any, Any, torch.Tensor, torch.Tensor]:
    saved = tuple(ctx.saved_tensors)
    input = None
    if ctx.compute_weight_gradient:
        input, saved = saved[0], saved[1:]
    weight_qkv = weight_q = weight_k = weight_v = None
    if ctx.fuse_qkv:
        weight_qkv = saved[0]
    else:
        weight_q, weight_k, weight_v = saved[:3]
    total_input = None
    if ctx.compute_weight_gradient:
        total_input = input
        if ctx.sequence_parallel_enabled:
            total_input = xm.all_gather(input, groups=get_tensor_model_parallel_replica_groups(), pin_layout=False)
    if ctx.kv_size_multiplier > 1:
        # each replica of a kv head saw the grads of its own query heads only: their sum is the dense head's grad
        dtype = grad_output_k.dtype
        summed = xm.all_reduce(
            xm.REDUCE_SUM,
            [grad_output_k.to(ctx.reduce_dtype, copy=True), grad_output_v.to(ctx.reduce_dtype, copy=True)],
            scale=1.0,
            groups=parallel_state.get_kv_shared_replica_groups(),
            pin_layout=False,
        )
        grad_output_k, grad_output_v = summed[0].to(dtype), summed[1].to(dtype)
    return total_input, weight_qkv, weight_q, weight_k, weight_v, grad_output_k, grad_output_v


def _qkvlinear_autograd_bwd_grad_reduce(ctx: Any, grad_input: torch.Tensor, original_dtype: torch.dtype) -> Any:
    """The input grad summed over tp with ``async_grad_allreduce`` (in ``reduce_dtype``), else as given."""
    if not ctx.async_grad_allreduce:
        return grad_input
    reduced = grad_input.to(ctx.reduce_dtype)
    dist.all_reduce(reduced, group=get_tensor_model_parallel_group())
    return reduced.to(original_dtype)


def _scattered_to_sequence_shard(ctx: Any, grad_input: torch.Tensor, original_dtype: torch.dtype) -> torch.Tensor:
    shards = get_tensor_model_parallel_size()
    shape = list(grad_input.shape)
    if shape[0] % shards:
        raise ValueError(f"the input grad's dim 0 ({shape[0]}) does not divide into {shards} sequence shards")
    shape[0] //= shards
    grad_input = grad_input.to(ctx.reduce_dtype)
    shard = torch.empty(shape, dtype=grad_input.dtype, device=grad_input.device, requires_grad=False)
    xm.reduce_scatter(
        xm.REDUCE_SUM, grad_input, output=shard, groups=get_tensor_model_parallel_replica_groups(),
        shard_count=shards, scatter_dim=0, scale=1, pin_layout=False,
    )  # fmt: skip
    return shard.to(original_dtype)


def _qkvlinear_autograd_bwd_no_weight_grad(ctx: Any, grad_input: torch.Tensor, original_dtype: torch.dtype) -> Any:
    """This rank's sequence shard of the summed input grad (no weight grads are computed)."""
    if ctx.async_grad_allreduce:
        raise ValueError("the input grad is all-reduced here (async_grad_allreduce), not reduce-scattered")
    return _scattered_to_sequence_shard(ctx, grad_input, original_dtype)


def _qkvlinear_autograd_bwd_input_grad(ctx: Any, grad_input: torch.Tensor, original_dtype: torch.dtype) -> Any:
    """This rank's sequence shard of the summed input grad."""
    return _scattered_to_sequence_shard(ctx, grad_input, original_dtype)


__all__ = ["check_requires_grad", "check_use_bias"]
