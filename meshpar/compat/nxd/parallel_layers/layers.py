"""``neuronx_distributed.parallel_layers.layers``: NxD's tensor-parallel layers with NxD's meaning.

They are their own classes, not meshpar's native layers renamed, because NxD's contract differs from meshpar's:

- parameters are this rank's plain local shards (a column-parallel ``weight`` is ``[out/tp, in]``) carrying NxD's
  attributes ``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, ``num_partitions`` and
  ``rank_ordering``; meshpar's native layers hold DTensors;
- the constructors take NxD's arguments in NxD's order (``dtype`` and ``device`` 5th and 6th, ``stride``,
  ``keep_master_weight``, ``pad``, ``sequence_dimension``, ``tensor_model_parallel_group``, ``reduce_dtype``, ...);
- a layer built on CPU (``device`` ``None`` or ``"cpu"``) initialises the full weight in float32 on every rank and
  keeps its part (cut with ``stride``, :func:`create_local_weight`), so any tp gives the same model; with
  ``keep_master_weight`` the full weight stays as ``master_weight``. On a meta device only the shapes and
  attributes are made. On an accelerator the weight is initialised the CPU way and moved (NxD initialises each
  shard under its tp RNG tracker there: meshpar keeps the layer independent of tp everywhere);
- linear layers return the output, or ``(output, bias)`` with ``skip_bias_add``; a column-parallel layer with
  ``gather_output`` holds the full bias and adds it after the gather;
- activations are ``[b, s, h]``; under sequence parallelism the shard is along ``sequence_dimension`` (0 when not
  given, as in NxD).

Communication is meshpar's tp collectives on the group the layer was given (the parallel state's tp group by
default). A layer built with no parallel state warns and sets up a one-process state, as NxD does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn import init

from meshpar.compat._shards import strided_local_part
from meshpar.compat.nxd.parallel_layers import layers_utils

# the steps LinearWithAsyncCommunication is built from, in this module's namespace as in NxD's (its tests patch them)
from meshpar.compat.nxd.parallel_layers.layers_utils import (  # noqa: F401
    _compute_gradients,
    _gather_along_dim,
    _linear_autograd_base_setup_bwd,
    _linear_autograd_base_setup_fwd,
    _linear_autograd_bwd_grad_reduce,
    _linear_autograd_bwd_input_grad,
    _linear_autograd_bwd_no_weight_grad,
    _reduce_scatter_along_dim,
)
from meshpar.compat.nxd.parallel_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_mesh,
    is_registered_group,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

# NxD's layers module holds these getters (its unit tests patch them here): a weight is cut by them
from meshpar.compat.nxd.parallel_layers.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_size,
)
from meshpar.compat.nxd.parallel_layers.utils import (
    EmbeddingUtility,
    cast_if_autocast_enabled,
    divide,
    ensure_parallel_state,
    get_padding_length,
    set_tensor_model_parallel_attributes,
    verify_casted_dtype,
)

InitMethod = Callable[[torch.Tensor], Any]


def create_local_weight(
    full_weight: torch.Tensor,
    partition_dim: int,
    per_partition_size: int,
    stride: int,
    out_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """This tp rank's part of ``full_weight`` along ``partition_dim`` (``stride`` blocks dealt round-robin: see
    :func:`meshpar.compat._shards.strided_local_part`), written into ``out_weight`` when given. The rank and size
    are the parallel state's tp rank and size, read through this module's getters as NxD reads them."""
    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_size()
    part = strided_local_part(full_weight, partition_dim, per_partition_size, stride, rank, size)
    if out_weight is None:
        return part
    with torch.no_grad():
        out_weight.copy_(part)
    return out_weight


def _initialize_parameter_cpu(
    param: torch.Tensor,
    partition_dim: int,
    num_partitions: int,
    init_method: InitMethod,
    return_master_param: bool = False,
    *,
    param_dtype: torch.dtype = torch.float32,
    stride: int = 1,
    rank_ordering: list[int] | None = None,
) -> torch.Tensor | None:
    """Initialise the full parameter in float32 (then ``param_dtype``) and copy this rank's part into ``param``,
    which may live on any device; returns the full parameter with ``return_master_param``."""
    set_tensor_model_parallel_attributes(param, True, partition_dim, stride, num_partitions, rank_ordering)
    shape = list(param.shape)
    shape[partition_dim] *= num_partitions
    master = torch.empty(shape, dtype=torch.float32)
    init_method(master)
    master = master.to(param_dtype)
    create_local_weight(master.to(param.device), partition_dim, param.shape[partition_dim], stride, out_weight=param)
    return master if return_master_param else None


def _initialize_affine_weight_neuron(
    weight: torch.Tensor,
    init_method: InitMethod,
    partition_dim: int,
    num_partitions: int,
    stride: int = 1,
) -> None:
    """Initialise this rank's part of ``weight`` on its own device (NxD's path for weights not on the CPU). NxD runs
    ``init_method`` on the local part under its per-rank RNG; here the full parameter is initialised and this rank's
    part copied in (:func:`_initialize_parameter_cpu`), so a tp-sharded layer starts equal to the dense one."""
    _initialize_parameter_cpu(
        weight, partition_dim, num_partitions, init_method, param_dtype=weight.dtype, stride=stride
    )


class BaseParallelLayer(nn.Module):
    """Every NxD parallel layer: built without a parallel state it warns and sets up a one-process one. A layer
    keeps its process group as a mesh (``tp_mesh``, which copies and pickles); NxD's group attributes
    (``tensor_parallel_group``, ``tensor_model_parallel_group``) read it and can be set, as NxD code does. Any other
    object given or set as the group (NxD's unit tests use stand-ins with a ``size()``) is kept as it is: sizes are
    read from it, and the collectives refuse it when they run."""

    tp_mesh: Any
    _given_group: Any = None

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        ensure_parallel_state(device)

    def _set_group(self, group: Any) -> None:
        if group is None or is_registered_group(group):
            self.tp_mesh, self._given_group = group_mesh(group), None
        else:
            self.tp_mesh, self._given_group = None, group

    @property
    def tensor_parallel_group(self) -> Any:
        return self._given_group if self._given_group is not None else self.tp_mesh.get_group()

    @tensor_parallel_group.setter
    def tensor_parallel_group(self, group: Any) -> None:
        self._set_group(group)

    @property
    def tensor_model_parallel_group(self) -> Any:
        return self.tensor_parallel_group

    @tensor_model_parallel_group.setter
    def tensor_model_parallel_group(self, group: Any) -> None:
        self._set_group(group)


def _new_parameter(shape: tuple[int, ...], device: torch.device | str | None, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))


class ParallelEmbedding(BaseParallelLayer):
    """An embedding split over tp by vocabulary rows (``weight`` is ``[vocab/tp, dim]``; ids of other ranks' rows
    look up zeros and the results are summed over tp) or, with ``shard_across_embedding``, by embedding columns
    (``[vocab, dim/tp]``, gathered). ``collect_output=False`` returns this rank's part unreduced; under sequence
    parallelism the sum is reduce-scattered along the sequence (``sequence_dimension``; without one NxD's layout
    rule: the ``[b, s, h]`` output is transposed to ``[s, b, h]`` and split along dim 0)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: InitMethod = init.normal_,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        shard_across_embedding: bool = False,
        pad: bool = False,
        sequence_parallel_enabled: bool = False,
        tensor_model_parallel_group: Any = None,
        use_spmd_rank: bool = False,
        sequence_dimension: int | None = None,
        tile_cc: bool = False,
        rank_ordering: list[int] | None = None,
        collect_output: bool = True,
    ) -> None:
        super().__init__(device=device)
        if use_spmd_rank:
            raise NotImplementedError("ParallelEmbedding(use_spmd_rank=True) is NxD's SPMD inference tracing")
        self.tp_mesh = group_mesh(tensor_model_parallel_group)
        tp, tp_rank = self.tp_mesh.size(), self.tp_mesh.get_local_rank()
        self.tensor_model_parallel_size = tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.shard_across_embedding, self.pad, self.stride = shard_across_embedding, pad, 1
        self.sequence_parallel_enabled, self.sequence_dim = sequence_parallel_enabled, sequence_dimension
        self.tile_cc, self.rank_ordering, self.collect_output = tile_cc, rank_ordering, collect_output
        self.init_method, self.dtype = init_method, dtype
        self.pad_size = 0
        if shard_across_embedding:
            if pad:
                self.pad_size = get_padding_length(embedding_dim, tp)
                self.embedding_dim += self.pad_size
            self.num_embeddings_per_partition = self.num_embeddings
            self.embedding_dim_per_partition = divide(self.embedding_dim, tp)
            self.padding_idx = padding_idx
            self.per_partition_size, self.weight_partition_dim = self.embedding_dim_per_partition, 1
        else:
            if pad:
                self.pad_size = get_padding_length(num_embeddings, tp)
                self.num_embeddings += self.pad_size
            self.start_index, self.end_index = EmbeddingUtility.range_from_global_vocab_size(
                self.num_embeddings, tp_rank, tp
            )
            self.num_embeddings_per_partition = self.end_index - self.start_index
            self.embedding_dim_per_partition = self.embedding_dim
            in_range = padding_idx is not None and self.start_index <= padding_idx < self.end_index
            self.padding_idx = padding_idx - self.start_index if in_range else None
            self.per_partition_size, self.weight_partition_dim = self.num_embeddings_per_partition, 0
        shape = (self.num_embeddings_per_partition, self.embedding_dim_per_partition)
        self.weight = _new_parameter(shape, device, dtype)
        if self.weight.device.type == "meta":
            set_tensor_model_parallel_attributes(self.weight, True, self.weight_partition_dim, 1, tp, rank_ordering)
        else:
            self.init_weight_cpu()

    def init_weight_cpu(self) -> None:
        _initialize_parameter_cpu(
            self.weight, self.weight_partition_dim, self.tensor_model_parallel_size, self.init_method,
            param_dtype=self.dtype, rank_ordering=self.rank_ordering,
        )  # fmt: skip

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(
            ids.long(), self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
            self.sparse,
        )  # fmt: skip

    def _forward_shard_across_vocab(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tensor_model_parallel_size > 1:
            inside = (input_ >= self.start_index) & (input_ < self.end_index)
            out = self._lookup((input_ - self.start_index) * inside.long())
            out = out * inside.unsqueeze(-1).to(out.dtype)
        else:
            out = self._lookup(input_)
        if not self.collect_output:
            return out
        if self.sequence_parallel_enabled:
            if self.sequence_dim is None:
                out, dim = out.transpose(0, 1).contiguous(), 0
            else:
                dim = self.sequence_dim
            return reduce_scatter_to_sequence_parallel_region(out, dim, self.tensor_model_parallel_group)
        return reduce_from_tensor_model_parallel_region(out, self.tensor_model_parallel_group)

    def _forward_shard_across_embed(self, input_: torch.Tensor) -> torch.Tensor:
        out = self._lookup(input_)
        if not self.collect_output:
            return out
        return gather_from_tensor_model_parallel_region(out, self.tensor_model_parallel_group)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.pad and self.training:
            raise RuntimeError("`pad=True` is only supported for inference. Set model.eval()")
        if not self.shard_across_embedding:
            return self._forward_shard_across_vocab(input_)
        out = self._forward_shard_across_embed(input_)
        if self.pad and self.pad_size > 0 and self.collect_output:
            out = out.narrow(-1, 0, self.embedding_dim - self.pad_size)
        return out

    def preshard_hook(self, model_state_dict: dict[str, Any], prefix: str) -> None:
        """Pad a full checkpoint tensor ``model_state_dict[prefix]`` to the padded size before it is sharded."""
        if not self.pad or self.pad_size == 0:
            return
        size = model_state_dict[prefix].shape[self.weight_partition_dim]
        full = self.embedding_dim if self.shard_across_embedding else self.num_embeddings
        if full != size + self.pad_size:
            raise RuntimeError(f"state dict {prefix} has size {size}; expected {full - self.pad_size}")
        padding = (0, self.pad_size) if self.shard_across_embedding else (0, 0, 0, self.pad_size)
        model_state_dict[prefix] = F.pad(model_state_dict[prefix], padding)


class LinearWithAsyncCommunication(torch.autograd.Function):
    """``input @ weight^T + bias`` for this rank's weight shard with the input's tp communication folded in, built
    from NxD's steps (:mod:`.layers_utils`):

    - ``sequence_parallel_enabled``: the input is this rank's sequence shard along ``sequence_dimension``; forward
      all-gathers it, backward reduce-scatters the input grad;
    - ``async_grad_allreduce``: the input is replicated; backward sums its grad over the group, overlapped with the
      weight grad's matmul.

    Both reductions of the input grad run in ``reduce_dtype`` and are returned in the grad's dtype; on a group of
    one neither runs.
    """

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
        dim = 0 if sequence_dimension is None else sequence_dimension
        total = _linear_autograd_base_setup_fwd(
            ctx, input, weight, bias, async_grad_allreduce, sequence_parallel_enabled, dim, save_for_backward,
            process_group, reduce_dtype,
        )  # fmt: skip
        output = torch.matmul(total, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        total, weight, grad_output = _linear_autograd_base_setup_bwd(ctx, grad_outputs)
        grad_input = grad_output.matmul(weight)
        dtype = grad_input.dtype
        handle = _linear_autograd_bwd_grad_reduce(ctx, grad_input, dtype)
        rest = (None,) * 6
        if not ctx.compute_weight_gradient:
            if ctx.sequence_parallel_enabled:
                return _linear_autograd_bwd_no_weight_grad(ctx, grad_input, dtype), None, None, *rest
            return layers_utils._reduced_input_grad(ctx, grad_input, handle, dtype), None, None, *rest
        # the weight grad's matmul runs while the input grad's all-reduce is under way
        grad_weight, grad_bias = _compute_gradients(
            total.reshape(-1, total.shape[-1]), weight, grad_output, ctx.use_bias
        )
        shard, grad_input = _linear_autograd_bwd_input_grad(ctx, grad_input, handle, dtype)
        return shard if ctx.sequence_parallel_enabled else grad_input, grad_weight, grad_bias, *rest


def linear_with_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    async_grad_allreduce: bool,
    sequence_parallel_enabled: bool,
    sequence_dimension: int | None = 0,
    autograd_func_class: type[torch.autograd.Function] = LinearWithAsyncCommunication,
    save_for_backward: bool = True,
    process_group: Any = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """:class:`LinearWithAsyncCommunication` (or ``autograd_func_class``) with autocast's cast applied to its
    inputs first and autocast off inside."""
    args = cast_if_autocast_enabled(
        input, weight, bias, async_grad_allreduce, sequence_parallel_enabled, sequence_dimension, save_for_backward,
        process_group, reduce_dtype,
    )  # fmt: skip
    verify_casted_dtype(args)
    with torch.autocast(device_type=input.device.type, enabled=False):
        return autograd_func_class.apply(*args)


class BaseParallelLinear(BaseParallelLayer):
    """What NxD's linear layers share: the weight init (``init_method`` or ``nn.Linear``'s Kaiming uniform), the
    bias init and the refusal to train a padded layer."""

    autograd_func_class: type[torch.autograd.Function] = LinearWithAsyncCommunication

    def _init_weight(self, weight: torch.Tensor) -> None:
        if self.arg_init_method is None:
            init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            self.arg_init_method(weight)

    def _init_bias(self) -> None:
        fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        init.uniform_(self.bias, -bound, bound)

    def _check_pad_false_for_training(self) -> None:
        if self.pad and self.training:
            raise RuntimeError("`pad=True` is only supported for inference. Set model.eval()")

    def _make_weight(self) -> None:
        tp = self.world_size
        self.weight = _new_parameter(self.weight_shape, self.device, self.dtype)
        self.device = self.weight.device
        self.master_weight = None
        if self.device.type == "meta":
            set_tensor_model_parallel_attributes(
                self.weight, True, self.weight_partition_dim, self.stride, tp, self.rank_ordering
            )
        elif self.device.type == "cpu" or self.keep_master_weight or self.rank_ordering is not None:
            self.init_weight_cpu()
        else:  # NxD's device path (its unit tests patch both by name)
            _initialize_affine_weight_neuron(self.weight, self._init_weight, self.weight_partition_dim, tp, self.stride)

    def init_weight_cpu(self) -> None:
        self.master_weight = _initialize_parameter_cpu(
            self.weight, self.weight_partition_dim, self.world_size, self._init_weight, self.keep_master_weight,
            param_dtype=self.dtype, stride=self.stride, rank_ordering=self.rank_ordering,
        )  # fmt: skip

    def _make_bias(self) -> None:
        if self.bias_shape is None:
            self.register_parameter("bias", None)
            return
        self.bias = _new_parameter(self.bias_shape, self.device, self.dtype)
        if self.bias.device.type != "meta":
            self._init_bias()


def _sequence_dimension(sequence_parallel_enabled: bool, sequence_dimension: int | None) -> int | None:
    return 0 if sequence_parallel_enabled and sequence_dimension is None else sequence_dimension


class ColumnParallelLinear(BaseParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by output features (``weight`` ``[out/tp, in]``). The input is replicated
    or, with ``sequence_parallel_enabled``, this rank's sequence shard. The output is this rank's ``[..., out/tp]``
    or, with ``gather_output``, the full ``[..., out]``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        stride: int = 1,
        init_method: InitMethod | None = None,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        pad: bool = False,
        pad_alignment_size_per_rank: int = 1,
        keep_padded_output: bool = False,
        tensor_model_parallel_group: Any = None,
        reduce_dtype: torch.dtype = torch.float32,
        rank_ordering: list[int] | None = None,
    ) -> None:
        super().__init__(device=device)
        self._set_group(tensor_model_parallel_group)
        self.world_size = tp = dist.get_world_size(group=self.tensor_parallel_group)
        self.input_size, self.output_size, self.add_bias = input_size, output_size, bias
        self.gather_output, self.arg_init_method, self.rank_ordering = gather_output, init_method, rank_ordering
        self.pad, self.keep_padded_output, self.pad_size = pad, keep_padded_output, 0
        if pad:
            self.pad_size = get_padding_length(output_size, pad_alignment_size_per_rank * tp)
            self.output_size += self.pad_size
        self.output_size_per_partition = divide(self.output_size, tp)
        self.dtype, self.device, self.stride = dtype, device, stride
        self.keep_master_weight, self.skip_bias_add = keep_master_weight, skip_bias_add
        if sequence_parallel_enabled and gather_output:
            raise RuntimeError("ColumnParallelLinear: sequence_parallel_enabled=True requires gather_output=False")
        self.async_tensor_model_parallel_allreduce = not sequence_parallel_enabled and tp > 1
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = _sequence_dimension(sequence_parallel_enabled, sequence_dimension)
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else dtype
        self.initialize_weight_and_bias()
        self._forward_impl = linear_with_async_allreduce

    def set_weight_and_bias_config(self) -> None:
        self.weight_shape = (self.output_size_per_partition, self.input_size)
        self.weight_partition_dim = 0
        self.bias_shape = None
        if self.add_bias:
            self.bias_shape = (self.output_size if self.gather_output else self.output_size_per_partition,)
            self.bias_partition_dim = 0

    def initialize_weight_and_bias(self) -> None:
        self.set_weight_and_bias_config()
        self._make_weight()
        self._make_bias()
        if self.bias is not None and not self.gather_output:
            set_tensor_model_parallel_attributes(
                self.bias, True, self.bias_partition_dim, self.stride, self.world_size, self.rank_ordering
            )

    def forward(
        self, input: torch.Tensor, slice_indices: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        self._check_pad_false_for_training()
        input_parallel = self._cpl_maybe_input_copy_to_tp_region(input)
        weight = self.weight[slice_indices, :] if slice_indices is not None else self.weight
        output_parallel = self._forward_impl(
            input=input_parallel, weight=weight, bias=None,
            async_grad_allreduce=self.async_tensor_model_parallel_allreduce,
            sequence_parallel_enabled=self.sequence_parallel_enabled, sequence_dimension=self.sequence_dimension,
            autograd_func_class=self.autograd_func_class, process_group=self.tensor_parallel_group,
            reduce_dtype=self.reduce_dtype,
        )  # fmt: skip
        output = self._cpl_maybe_gather_output(output_parallel)
        bias = self.bias
        if bias is not None and self.gather_output and output.shape[-1] < bias.shape[-1]:
            bias = bias[: output.shape[-1]]  # the padded outputs were dropped: the full bias's padded entries too
        if self.skip_bias_add:
            return output, bias
        return output + bias if bias is not None else output

    def _cpl_maybe_input_copy_to_tp_region(self, input: torch.Tensor) -> torch.Tensor:
        """The input as the matmul takes it: the linear function handles the input's communication under async
        all-reduce or sequence parallelism; otherwise the input grad is summed over tp by the copy."""
        if self.async_tensor_model_parallel_allreduce or self.sequence_parallel_enabled:
            return input
        return copy_to_tensor_model_parallel_region(input, process_group=self.tensor_parallel_group)

    def _cpl_maybe_gather_output(self, output_parallel: torch.Tensor) -> torch.Tensor:
        """With ``gather_output``, the full output gathered over tp (the vocabulary padding dropped unless
        ``keep_padded_output``); else this rank's part."""
        if not self.gather_output:
            return output_parallel
        assert not self.sequence_parallel_enabled, "ColumnParallelLinear: gather_output under sequence parallelism"
        output = gather_from_tensor_model_parallel_region(output_parallel, process_group=self.tensor_parallel_group)
        if self.pad and self.pad_size > 0 and not self.keep_padded_output:
            output = torch.narrow(output, -1, 0, self.output_size - self.pad_size)
        return output

    def preshard_hook(self, model_state_dict: dict[str, Any], prefix: str) -> None:
        """Pad a full checkpoint weight / bias to the padded output size before it is sharded (bias with the
        dtype's lowest value, so padded logits never win)."""
        if not self.pad or self.pad_size == 0:
            return
        size = model_state_dict[prefix].shape[0]
        if self.output_size != size + self.pad_size:
            raise RuntimeError(f"state dict {prefix} has size {size}; expected {self.output_size - self.pad_size}")
        tensor = model_state_dict[prefix]
        if prefix.endswith("weight"):
            model_state_dict[prefix] = F.pad(tensor, (0, 0, 0, self.pad_size))
        elif prefix.endswith("bias"):
            model_state_dict[prefix] = F.pad(tensor, (0, self.pad_size), value=torch.finfo(tensor.dtype).min)
        else:
            raise RuntimeError(f"cannot tell how to pad {prefix}: the name must end with weight or bias")


class RowParallelLinear(BaseParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by input features (``weight`` ``[out, in/tp]``, ``bias`` the full
    ``[out]``). The input is this rank's feature slice (``input_is_parallel``) or the full input, sliced here. The
    partial products are summed over tp in ``reduce_dtype`` (``reduce_output=False``: returned unsummed) or, with
    ``sequence_parallel_enabled``, reduce-scattered along ``sequence_dimension``; every rank adds the bias after
    (under sequence parallelism to its own shard, so the bias grad is partial: NxD's
    ``allreduce_sequence_parallel_gradients`` sums it)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        stride: int = 1,
        init_method: InitMethod | None = None,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        pad: bool = False,
        reduce_output: bool = True,
        tensor_model_parallel_group: Any = None,
        reduce_dtype: torch.dtype = torch.float32,
        tile_cc: bool = False,
        rank_ordering: list[int] | None = None,
    ) -> None:
        super().__init__(device=device)
        self._set_group(tensor_model_parallel_group)
        self.world_size = tp = self.tensor_parallel_group.size()
        self.input_size, self.output_size, self.add_bias = input_size, output_size, bias
        self.input_is_parallel, self.pad, self.reduce_output, self.pad_size = input_is_parallel, pad, reduce_output, 0
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else dtype
        self.tile_cc, self.rank_ordering, self.arg_init_method = tile_cc, rank_ordering, init_method
        if pad:
            self.pad_size = get_padding_length(input_size, tp)
            self.input_size += self.pad_size
        self.input_size_per_partition = divide(self.input_size, tp)
        if sequence_parallel_enabled and not input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel_enabled`, `input_is_parallel` must be `True`")
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = _sequence_dimension(sequence_parallel_enabled, sequence_dimension)
        self.dtype, self.device, self.stride = dtype, device, stride
        self.keep_master_weight, self.skip_bias_add = keep_master_weight, skip_bias_add
        self.initialize_weight_and_bias()
        self._forward_impl = linear_with_async_allreduce

    def set_weight_and_bias_config(self) -> None:
        self.weight_shape = (self.output_size, self.input_size_per_partition)
        self.weight_partition_dim = 1
        self.bias_shape = (self.output_size,) if self.add_bias else None

    def initialize_weight_and_bias(self) -> None:
        self.set_weight_and_bias_config()
        self._make_weight()
        self._make_bias()
        if self.bias is not None:
            self.bias.sequence_parallel_enabled = self.sequence_parallel_enabled

    def _init_bias(self) -> None:
        bound = 1 / math.sqrt(self.input_size_per_partition) if self.input_size_per_partition > 0 else 0
        init.uniform_(self.bias, -bound, bound)

    def forward(
        self, input_: torch.Tensor, slice_indices: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        self._check_pad_false_for_training()
        input_parallel = self._rpl_maybe_scatter_input(input_)
        weight = self.weight[:, slice_indices] if slice_indices is not None else self.weight
        output = self._forward_impl(
            input=input_parallel, weight=weight, bias=None, async_grad_allreduce=False,
            sequence_parallel_enabled=False, sequence_dimension=self.sequence_dimension,
            autograd_func_class=self.autograd_func_class, process_group=self.tensor_parallel_group,
            reduce_dtype=self.reduce_dtype,
        )  # fmt: skip
        output = self._rpl_maybe_reduce_output(output)
        if self.skip_bias_add:
            return output, self.bias
        return output + self.bias if self.bias is not None else output

    def _rpl_maybe_scatter_input(self, input_: torch.Tensor) -> torch.Tensor:
        """This rank's feature slice of the input: as given with ``input_is_parallel``, else cut here (after
        padding the features to the padded input size)."""
        if self.input_is_parallel:
            return input_
        if self.pad and self.pad_size > 0:
            input_ = F.pad(input_, (0, self.pad_size))
        assert not self.sequence_parallel_enabled, "RowParallelLinear: sequence parallelism needs a parallel input"
        return scatter_to_tensor_model_parallel_region(input_, process_group=self.tensor_parallel_group)

    def _rpl_maybe_reduce_output(self, output: torch.Tensor) -> torch.Tensor:
        """The partial products summed over tp in ``reduce_dtype`` (reduce-scattered along the sequence under
        sequence parallelism), returned in their own dtype; unsummed with ``reduce_output=False``."""
        if not self.reduce_output:
            return output
        dtype = output.dtype
        output = output.to(self.reduce_dtype)
        if self.sequence_parallel_enabled:
            output = reduce_scatter_to_sequence_parallel_region(
                output, self.sequence_dimension, process_group=self.tensor_parallel_group, dtype=dtype
            )
        else:
            output = reduce_from_tensor_model_parallel_region(output, process_group=self.tensor_parallel_group)
        return output.to(dtype)

    def preshard_hook(self, model_state_dict: dict[str, Any], prefix: str) -> None:
        """Pad a full checkpoint weight's input features to the padded size before it is sharded."""
        if not self.pad or self.pad_size == 0 or prefix.endswith("bias"):
            return
        size = model_state_dict[prefix].shape[1]
        if self.input_size != size + self.pad_size:
            raise RuntimeError(f"state dict {prefix} has size {size}; expected {self.input_size - self.pad_size}")
        model_state_dict[prefix] = F.pad(model_state_dict[prefix], (0, self.pad_size))


# NxD's tensor-parallel convolutions live in this module's namespace too (written in ._conv)
from meshpar.compat.nxd.parallel_layers._conv import (  # noqa: E402
    CONV_KERNEL_INPUT_CHANNEL_DIMENSION,
    CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION,
    BaseParallelConv,
    Conv2dWithInputGradAllReduce,
    InputChannelParallelConv2d,
    OutputChannelParallelConv2d,
    conv2d_with_weight_grad_allreduce,
)

__all__ = [
    "CONV_KERNEL_INPUT_CHANNEL_DIMENSION",
    "CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION",
    "BaseParallelConv",
    "BaseParallelLayer",
    "Conv2dWithInputGradAllReduce",
    "InputChannelParallelConv2d",
    "OutputChannelParallelConv2d",
    "conv2d_with_weight_grad_allreduce",
    "BaseParallelLinear",
    "ColumnParallelLinear",
    "LinearWithAsyncCommunication",
    "ParallelEmbedding",
    "RowParallelLinear",
    "create_local_weight",
    "linear_with_async_allreduce",
]
