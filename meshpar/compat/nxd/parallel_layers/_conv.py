"""NxD's tensor-parallel 2-D convolutions (exported by :mod:`meshpar.compat.nxd.parallel_layers.layers`): the kernel
split over tp by output channels (each rank computes its channels; gathered along dim 1 with ``gather_output``) or
by input channels (each rank convolves its slice of the input's channels; the partial outputs summed over tp, the
bias added after). ``[N, C, H, W]`` inputs; dilation 1, groups 1 and zero padding, as in NxD. Parameters are plain
local shards with NxD's attributes, initialised the CPU way (the full kernel, then this rank's part)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import grad as nn_grad

from meshpar.compat.nxd.parallel_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region_with_dim,
    group_mesh,
    reduce_from_tensor_model_parallel_region,
    scatter_input_channels_to_tensor_model_parallel_region,
)
from meshpar.compat.nxd.parallel_layers.utils import (
    cast_if_autocast_enabled,
    divide,
    get_padding_length,
    set_tensor_model_parallel_attributes,
    verify_casted_dtype,
)
from meshpar.tensor_parallel._collectives import _all_reduce

CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION = 0
CONV_KERNEL_INPUT_CHANNEL_DIMENSION = 1


class Conv2dWithInputGradAllReduce(torch.autograd.Function):
    """``conv2d`` whose input grad is summed over tp in backward (``allreduce_weight_grad``, NxD's name for it):
    the input is replicated and each rank's output channels contribute part of its grad."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: tuple[int, int],
        padding: tuple[int, int],
        allreduce_weight_grad: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.stride, ctx.padding, ctx.has_bias = stride, padding, bias is not None
        ctx.allreduce, ctx.mesh = allreduce_weight_grad, group_mesh(None)
        return F.conv2d(input, weight, bias, stride, padding)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = nn_grad.conv2d_input(input.shape, weight, grad_output, ctx.stride, ctx.padding)
            if ctx.allreduce and ctx.mesh.size() > 1:
                grad_input = _all_reduce(grad_input, ctx.mesh)
        if ctx.needs_input_grad[1]:
            grad_weight = nn_grad.conv2d_weight(input, weight.shape, grad_output, ctx.stride, ctx.padding)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum((0, 2, 3))
        return grad_input, grad_weight, grad_bias, None, None, None


def conv2d_with_weight_grad_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: tuple[int, int],
    padding: tuple[int, int],
    allreduce_weight_grad: bool,
) -> torch.Tensor:
    args = cast_if_autocast_enabled(input, weight, bias, stride, padding, allreduce_weight_grad)
    verify_casted_dtype(args)
    with torch.autocast(device_type=input.device.type, enabled=False):
        return Conv2dWithInputGradAllReduce.apply(*args)


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(value, tuple):
        return value
    if isinstance(value, int):
        return (value, value)
    raise TypeError(f"expected an int or a tuple of two ints, got {type(value)}")


class BaseParallelConv(nn.Module):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int],
        padding: int | tuple[int, int],
        dilation: int | tuple[int, int],
        groups: int,
        bias: bool,
        padding_mode: str,
        partition_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        keep_master_params: bool = False,
        partition_pad: bool = False,
    ) -> None:
        if _pair(dilation) != (1, 1):
            raise NotImplementedError(f"Non-1 dilation is not yet supported. Received: {dilation}")
        if groups != 1:
            raise NotImplementedError(f"Non-1 groups is not yet supported. Received: {groups}")
        if padding_mode != "zeros":
            raise NotImplementedError(f"Non-zeros padding is not yet supported. Received: {padding_mode}")
        super().__init__()
        from meshpar.compat.nxd.parallel_layers.utils import ensure_parallel_state

        ensure_parallel_state(device)
        self.tp_mesh = group_mesh(None)
        tp = self.tp_mesh.size()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding = _pair(kernel_size), _pair(stride), _pair(padding)
        self.dilation = _pair(dilation)
        self.partition_dim, self.arg_init_method, self.dtype = partition_dim, init_method, dtype
        self.keep_master_params, self.partition_pad, self.partition_pad_size = keep_master_params, partition_pad, 0
        if partition_dim == CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION:
            if partition_pad:
                self.partition_pad_size = get_padding_length(out_channels, tp)
                self.out_channels += self.partition_pad_size
            self.channels_per_partition = divide(self.out_channels, tp)
            shape = (self.channels_per_partition, in_channels, *self.kernel_size)
        elif partition_dim == CONV_KERNEL_INPUT_CHANNEL_DIMENSION:
            if partition_pad:
                self.partition_pad_size = get_padding_length(in_channels, tp)
                self.in_channels += self.partition_pad_size
            self.channels_per_partition = divide(self.in_channels, tp)
            shape = (out_channels, self.channels_per_partition, *self.kernel_size)
        else:
            raise ValueError(f"partition_dim must be 0 (output channels) or 1 (input channels), got {partition_dim}")
        from meshpar.compat.nxd.parallel_layers.layers import _initialize_parameter_cpu

        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        self.master_weight = self.master_bias = None
        if self.weight.device.type == "meta":
            set_tensor_model_parallel_attributes(self.weight, True, partition_dim, 1, tp)
        else:
            self.master_weight = _initialize_parameter_cpu(
                self.weight, partition_dim, tp, self._init_weight, keep_master_params, param_dtype=dtype
            )
        if not bias:
            self.register_parameter("bias", None)
            return
        by_output = partition_dim == CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION
        self.bias = nn.Parameter(torch.empty(self.channels_per_partition if by_output else self.out_channels,
                                             dtype=dtype, device=device))  # fmt: skip
        if self.bias.device.type == "meta":
            return
        if by_output:
            self.master_bias = _initialize_parameter_cpu(
                self.bias, 0, tp, self._init_bias, keep_master_params, param_dtype=dtype
            )
        else:
            self._init_bias(self.bias)
            self.master_bias = self.bias if keep_master_params else None

    def _init_weight(self, weight: torch.Tensor) -> None:
        if self.arg_init_method is None:
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            self.arg_init_method(weight)

    def _init_bias(self, bias: torch.Tensor) -> None:
        fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)

    def preshard_hook(self, model_state_dict: dict[str, Any], prefix: str) -> None:
        """Pad a full checkpoint kernel's partitioned channels to the padded count before it is sharded."""
        if not self.partition_pad or self.partition_pad_size == 0:
            return
        dim = self.partition_dim
        full = self.out_channels if dim == CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION else self.in_channels
        size = model_state_dict[prefix].shape[dim]
        if full != size + self.partition_pad_size:
            raise RuntimeError(f"state dict {prefix} has size {size}; expected {full - self.partition_pad_size}")
        padding = [0, 0] * (model_state_dict[prefix].dim() - 1 - dim) + [0, self.partition_pad_size]
        model_state_dict[prefix] = F.pad(model_state_dict[prefix], padding)


class OutputChannelParallelConv2d(BaseParallelConv):
    """A Conv2d split over tp by output channels; ``gather_output`` returns all channels (the padded ones dropped)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        keep_master_weight: bool = False,
        partition_pad: bool = False,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
            CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION, dtype, device, init_method, keep_master_weight, partition_pad,
        )  # fmt: skip
        self.allreduce_weight_grad = self.tp_mesh.size() > 1
        self.gather_output = gather_output

    def forward(self, in_tensor: torch.Tensor) -> torch.Tensor:
        x = in_tensor if self.allreduce_weight_grad else copy_to_tensor_model_parallel_region(in_tensor)
        out = conv2d_with_weight_grad_allreduce(x, self.weight, self.bias, self.stride, self.padding,
                                                self.allreduce_weight_grad)  # fmt: skip
        if not self.gather_output:
            return out
        out = gather_from_tensor_model_parallel_region_with_dim(out, gather_dim=1)
        if self.partition_pad and self.partition_pad_size > 0:
            out = out.narrow(1, 0, self.out_channels - self.partition_pad_size)
        return out


class InputChannelParallelConv2d(BaseParallelConv):
    """A Conv2d split over tp by input channels: the input is this rank's channels (``input_is_parallel``) or the
    full input, cut here; the partial outputs are summed over tp and the bias added after."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        input_is_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        keep_master_weight: bool = False,
        partition_pad: bool = False,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
            CONV_KERNEL_INPUT_CHANNEL_DIMENSION, dtype, device, init_method, keep_master_weight, partition_pad,
        )  # fmt: skip
        self.input_is_parallel = input_is_parallel

    def forward(self, in_tensor: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            x = in_tensor
        else:
            if self.partition_pad and self.partition_pad_size > 0:
                in_tensor = F.pad(in_tensor, (0, 0, 0, 0, 0, self.partition_pad_size))
            x = scatter_input_channels_to_tensor_model_parallel_region(in_tensor)
        out = reduce_from_tensor_model_parallel_region(
            conv2d_with_weight_grad_allreduce(x, self.weight, None, self.stride, self.padding, False)
        )
        return out + self.bias[:, None, None] if self.bias is not None else out


__all__ = [
    "CONV_KERNEL_INPUT_CHANNEL_DIMENSION",
    "CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION",
    "BaseParallelConv",
    "Conv2dWithInputGradAllReduce",
    "InputChannelParallelConv2d",
    "OutputChannelParallelConv2d",
    "conv2d_with_weight_grad_allreduce",
]
