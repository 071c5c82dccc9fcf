"""``apex.transformer.tensor_parallel.layers``: apex's tensor-parallel layers with apex's meaning.

These differ from meshpar's native layers (:mod:`meshpar.tensor_parallel.layers`) where apex's contract says so, which
is why they are their own classes here and not the native ones renamed:

- parameters are this rank's plain local shards (``weight`` of a column-parallel layer is ``[out/tp, in]``) carrying
  apex's attributes ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``, not DTensors;
- linear layers return ``(output, bias)``: ``bias`` is ``None`` unless ``skip_bias_add``, when the bias is returned
  unadded for the caller to fuse;
- activations are ``[s, b, h]`` and under sequence parallelism the sequence shard is the first dim (``[s/tp, b, h]``);
- ``keep_master_weight_for_test`` keeps the full initial weight as ``master_weight``; ``use_cpu_initialization``
  initialises that full weight on CPU and slices it (so any tp gives the same model), otherwise each rank initialises
  its shard under the tp RNG tracker; ``gradient_accumulation_fusion`` accumulates the weight's grad into
  ``weight.main_grad`` (which the caller allocates, as with Megatron's fused kernel) instead of ``weight.grad``.

The communication is meshpar's: the tp group of the current parallel state and the collectives of
:mod:`meshpar.tensor_parallel._collectives`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshpar.compat._shards import strided_local_part
from meshpar.compat.apex.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from meshpar.compat.apex.tensor_parallel.random import get_cuda_rng_tracker
from meshpar.compat.apex.tensor_parallel.utils import VocabUtility
from meshpar.compat.apex.utils import divide
from meshpar.parallel_dims import get_parallel
from meshpar.tensor_parallel._collectives import _all_gather, _all_reduce, _reduce_scatter

InitMethod = Callable[[torch.Tensor], Any]

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """Whether ``param`` counts once per tp rank in a norm: it is sharded, or this is tp rank 0."""
    return bool(getattr(param, "tensor_model_parallel", False)) or get_parallel().tp_rank == 0


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, name):
            raise ValueError(f"the tensor already has the attribute {name!r}")
    tensor.tensor_model_parallel, tensor.partition_dim, tensor.partition_stride = is_parallel, dim, stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    for name, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


def _initialize_affine_weight_gpu(
    weight: torch.Tensor, init_method: InitMethod, partition_dim: int, stride: int = 1
) -> None:
    """Initialise this rank's shard in place under the tp RNG tracker (shards differ across tp ranks)."""
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    with get_cuda_rng_tracker().fork():
        init_method(weight)


def _initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: InitMethod,
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
) -> torch.Tensor | None:
    """Initialise the full ``[output_size, input_size]`` weight on CPU (float32, then ``params_dtype``) and copy this
    rank's part into ``weight``: with ``stride`` s the dim is cut into ``per_partition_size / s`` blocks dealt out
    round-robin, so a fused weight (q, k, v stacked) gives every rank its part of each. Returns the full weight with
    ``return_master_weight``."""
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    master = torch.empty(output_size, input_size, dtype=torch.float32, requires_grad=False)
    init_method(master)
    master = master.to(dtype=params_dtype)
    dims = get_parallel()
    with torch.no_grad():
        weight.copy_(strided_local_part(master, partition_dim, per_partition_size, stride, dims.tp_rank, dims.tp))
    return master if return_master_weight else None


def _new_weight(shape: tuple[int, ...], params_dtype: torch.dtype, use_cpu_initialization: bool) -> nn.Parameter:
    device = torch.device("cpu") if use_cpu_initialization else get_parallel().device
    return nn.Parameter(torch.empty(shape, dtype=params_dtype, device=device))


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary is split over tp (``weight`` is this rank's ``[vocab/tp, dim]`` rows); ids of
    other ranks' rows look up zeros and the partial results are summed over tp."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        init_method: InitMethod = nn.init.xavier_normal_,
        *,
        params_dtype: torch.dtype = torch.float32,
        use_cpu_initialization: bool = False,
    ) -> None:
        super().__init__()
        dims = get_parallel()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse, self._weight = False, False, None
        self.tensor_model_parallel_size = dims.tp
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, dims.tp_rank, dims.tp
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _new_weight(
            (self.num_embeddings_per_partition, embedding_dim), params_dtype, use_cpu_initialization
        )
        if use_cpu_initialization:
            _initialize_affine_weight_cpu(
                self.weight, num_embeddings, embedding_dim, self.num_embeddings_per_partition, 0, init_method,
                params_dtype=params_dtype,
            )  # fmt: skip
        else:
            _initialize_affine_weight_gpu(self.weight, init_method, partition_dim=0, stride=1)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tensor_model_parallel_size > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        else:
            outside, ids = None, input_
        out = F.embedding(ids, self.weight)
        if outside is not None:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out)


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``input @ weight^T + bias`` for this rank's weight shard, with the input's tp communication folded in:

    - ``sequence_parallel_enabled``: the input is this rank's sequence shard ``[s/tp, b, h]``; forward all-gathers
      it along dim 0, backward reduce-scatters the input grad;
    - ``async_grad_allreduce``: the input is replicated; backward sums its grad over tp;
    - ``gradient_accumulation_fusion``: the weight grad is added to ``weight.main_grad`` (in its dtype) and
      ``weight.grad`` stays untouched.
    """

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        async_grad_allreduce: bool,
        sequence_parallel_enabled: bool,
        use_16bit_in_wgrad_accum_fusion: bool | None = None,
    ) -> torch.Tensor:
        mesh = get_parallel().tp_mesh
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.flags = (gradient_accumulation_fusion, async_grad_allreduce, sequence_parallel_enabled)
        ctx.mesh = mesh
        full = _all_gather(input, mesh, 0) if sequence_parallel_enabled and mesh.size() > 1 else input
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        accumulate, all_reduce_input, sequence_parallel = ctx.flags
        mesh = ctx.mesh
        full = _all_gather(input, mesh, 0) if sequence_parallel and mesh.size() > 1 else input
        # under autocast forward ran in a lower precision: backward computes in the grad's dtype, and each grad is
        # returned in the dtype of what it is the grad of
        full = full.to(grad_output.dtype)
        grad_input = grad_output.matmul(weight.to(grad_output.dtype)).to(input.dtype)
        if mesh.size() > 1:
            if sequence_parallel:
                grad_input = _reduce_scatter(grad_input, mesh, 0)
            elif all_reduce_input:
                grad_input = _all_reduce(grad_input, mesh)
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        flat_input = full.reshape(-1, full.shape[-1])
        grad_weight = flat_grad.t().matmul(flat_input).to(weight.dtype)
        if accumulate:
            if not hasattr(weight, "main_grad"):
                raise RuntimeError(
                    "gradient_accumulation_fusion=True: allocate weight.main_grad (zeros like the weight, in the "
                    "accumulation dtype) before backward, as with Megatron's fused kernel"
                )
            weight.main_grad.add_(grad_weight.to(weight.main_grad.dtype))
            grad_weight = None
        grad_bias = flat_grad.sum(dim=0).to(ctx.bias_dtype) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    async_grad_allreduce: bool,
    sequence_parallel_enabled: bool,
) -> torch.Tensor:
    """See :class:`LinearWithGradAccumulationAndAsyncCommunication` (run outside autocast's casts of its inputs)."""
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, gradient_accumulation_fusion, async_grad_allreduce, sequence_parallel_enabled
    )


def _init_linear(
    layer: nn.Module,
    shape: tuple[int, int],
    partition_dim: int,
    per_partition_size: int,
    init_method: InitMethod,
    stride: int,
    keep_master_weight_for_test: bool,
    params_dtype: torch.dtype,
    use_cpu_initialization: bool,
) -> None:
    layer.weight = _new_weight(shape, params_dtype, use_cpu_initialization)
    if use_cpu_initialization:
        layer.master_weight = _initialize_affine_weight_cpu(
            layer.weight, layer.output_size, layer.input_size, per_partition_size, partition_dim, init_method,
            stride=stride, return_master_weight=keep_master_weight_for_test, params_dtype=params_dtype,
        )  # fmt: skip
    else:
        _initialize_affine_weight_gpu(layer.weight, init_method, partition_dim=partition_dim, stride=stride)


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by output features: ``weight`` is ``[out/tp, in]``. The input is replicated
    (``[s, b, in]``) or, with ``sequence_parallel_enabled``, this rank's sequence shard ``[s/tp, b, in]``. Returns
    ``(output, bias)``: the output is ``[s, b, out/tp]``, or ``[s, b, out]`` with ``gather_output``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        init_method: InitMethod = nn.init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        *,
        no_async_tensor_model_parallel_allreduce: bool = False,
        params_dtype: torch.dtype = torch.float32,
        use_cpu_initialization: bool = False,
        gradient_accumulation_fusion: bool = False,
        sequence_parallel_enabled: bool = False,
        accumulation_in_fp16: bool | None = None,
    ) -> None:
        super().__init__()
        tp = get_parallel().tp
        if gather_output and sequence_parallel_enabled:
            raise RuntimeError("sequence_parallel_enabled=True requires gather_output=False")
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.output_size_per_partition = divide(output_size, tp)
        _init_linear(
            self, (self.output_size_per_partition, input_size), 0, self.output_size_per_partition, init_method,
            stride, keep_master_weight_for_test, params_dtype, use_cpu_initialization,
        )  # fmt: skip
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype,
                                                 device=self.weight.device))  # fmt: skip
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)
        self.async_tensor_model_parallel_allreduce = not no_async_tensor_model_parallel_allreduce and tp > 1
        if sequence_parallel_enabled and tp <= 1:
            sequence_parallel_enabled = False  # nothing to shard at tp = 1 (apex warns and turns it off)
        self.sequence_parallel_enabled = sequence_parallel_enabled
        if self.async_tensor_model_parallel_allreduce and self.sequence_parallel_enabled:
            raise RuntimeError(
                "`async_tensor_model_parallel_allreduce` and `sequence_parallel_enabled` cannot be enabled at the "
                "same time."
            )
        self.gradient_accumulation_fusion = gradient_accumulation_fusion

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = self.bias if not self.skip_bias_add else None
        if self.async_tensor_model_parallel_allreduce or self.sequence_parallel_enabled:
            x = input_  # the linear function itself handles the input's communication
        else:
            x = copy_to_tensor_model_parallel_region(input_)
        output = linear_with_grad_accumulation_and_async_allreduce(
            x, self.weight, bias, self.gradient_accumulation_fusion, self.async_tensor_model_parallel_allreduce,
            self.sequence_parallel_enabled,
        )  # fmt: skip
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by input features: ``weight`` is ``[out, in/tp]``, ``bias`` the full
    ``[out]``. The input is this rank's feature slice (``input_is_parallel``) or the full input, sliced here.
    Returns ``(output, bias)``: the output summed over tp (``[s, b, out]``), or, with ``sequence_parallel_enabled``,
    reduce-scattered to this rank's sequence shard ``[s/tp, b, out]`` (each rank then adds the bias to its shard, so
    its grad is this rank's part: Megatron sums such grads over tp with the other sequence-parallel ones)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod = nn.init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        *,
        params_dtype: torch.dtype = torch.float32,
        use_cpu_initialization: bool = False,
        gradient_accumulation_fusion: bool = False,
        sequence_parallel_enabled: bool = False,
        accumulation_in_fp16: bool | None = None,
    ) -> None:
        super().__init__()
        tp = get_parallel().tp
        if sequence_parallel_enabled and not input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel_enabled`, `input_is_parallel` must be `True`")
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.input_size_per_partition = divide(input_size, tp)
        _init_linear(
            self, (output_size, self.input_size_per_partition), 1, self.input_size_per_partition, init_method,
            stride, keep_master_weight_for_test, params_dtype, use_cpu_initialization,
        )  # fmt: skip
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=self.weight.device))
            self.bias.sequence_parallel_enabled = sequence_parallel_enabled
        else:
            self.register_parameter("bias", None)
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.gradient_accumulation_fusion = gradient_accumulation_fusion

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_)
        partial = linear_with_grad_accumulation_and_async_allreduce(
            x, self.weight, None, self.gradient_accumulation_fusion, False, False
        )
        if self.sequence_parallel_enabled:
            output = reduce_scatter_to_sequence_parallel_region(partial)
        else:
            output = reduce_from_tensor_model_parallel_region(partial)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None


__all__ = [
    "ColumnParallelLinear",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_tensor_model_parallel_attributes",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]
