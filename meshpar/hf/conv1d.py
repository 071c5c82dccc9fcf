"""Tensor-parallel versions of HuggingFace's ``Conv1D`` (GPT-2's linear layer, weight stored ``[in, out]``).

GPT-2 fuses Q, K and V into one ``c_attn`` whose output is ``[q | k | v]``. Splitting that dim blindly would give
rank 0 all of Q. Here the fused weight is kept as a DTensor of logical shape ``[in, 3, hidden]`` sharded on the last
dim, so each rank holds ``[q_r | k_r | v_r]`` (whole heads of each) and the logical tensor does not depend on tp,
which keeps DCP resharding exact. The module's ``checkpoint_shapes`` records HF's shapes of its parameters, in which
checkpoints store them (:mod:`meshpar._stored_layout`); on the module, it survives what replaces parameters
(materialising a model built on meta, ``fully_shard``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from meshpar._compat import DeviceMesh, ParallelStyle, Replicate, Shard
from meshpar._in_place import become
from meshpar.tensor_parallel import ColumnParallel, PackedColumnParallel, RowParallel
from meshpar.tensor_parallel._collectives import gather_from_tp
from meshpar.tensor_parallel._init import check_divisible, fill_from_full_
from meshpar.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    distribute_parameter,
    mark_partitioned,
)


class _Conv1DInit:
    """HF's ``Conv1D`` initialisation (weight normal with std 0.02, bias zeros), applied shard by shard."""

    def reset_parameters(self) -> None:
        fill_from_full_(self.weight, lambda full: nn.init.normal_(full, std=0.02))
        fill_from_full_(self.bias, nn.init.zeros_)


class ColumnParallelConv1D(_Conv1DInit, ColumnParallelLinear, Conv1D):
    """``y = x W + b`` with ``W [in, out]`` split by output features (``fused`` blocks split separately): a
    :class:`ColumnParallelLinear` whose weight is stored ``[in, out]`` (the same forward, autograd functions and
    collectives, on a transposed view)."""

    weight_in_out = True
    fused: int

    @classmethod
    def from_conv1d(
        cls,
        conv: Conv1D,
        mesh: DeviceMesh,
        *,
        fused: int = 1,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        input_gathered: bool = False,
    ) -> ColumnParallelConv1D:
        n_in, n_out = conv.weight.shape
        check_divisible(n_out // fused, mesh.size(), "output features per fused block", cls.__name__)
        weight, bias = conv.weight, conv.bias
        if fused == 1:
            conv.weight = distribute_parameter(weight, mesh, [Shard(1)])
            conv.bias = distribute_parameter(bias, mesh, [Shard(0)])
        else:
            packed_weight, packed_bias = weight.view(n_in, fused, n_out // fused), bias.view(fused, n_out // fused)
            conv.weight = distribute_parameter(packed_weight, mesh, [Shard(2)])  # views: trainable as the originals
            conv.bias = distribute_parameter(packed_bias, mesh, [Shard(1)])
            conv.checkpoint_shapes = {"weight": (n_in, n_out), "bias": (n_out,)}
        become(conv, cls)
        conv._configure(mesh, n_in, n_out, gather_output, sequence_parallel, None)
        conv.input_gathered = input_gathered  # the enclosing region all-gathered the input (sequence parallel)
        conv.fused = fused
        mark_partitioned(conv)
        return conv

    def _maybe_gather(self, y: torch.Tensor) -> torch.Tensor:
        if not self.gather_output:
            return y
        # gathered per part, so that the output is the model's [q | k | v], not [q_0 k_0 v_0 | q_1 k_1 v_1]
        return gather_from_tp(y.unflatten(-1, (self.fused, -1)), self.tp_mesh, -1).flatten(-2)


class RowParallelConv1D(_Conv1DInit, RowParallelLinear, Conv1D):
    """``y = x W + b`` with ``W [in, out]`` split by input features; output all-reduced (reduce-scattered under SP):
    a :class:`RowParallelLinear` whose weight is stored ``[in, out]``."""

    weight_in_out = True

    @classmethod
    def from_conv1d(cls, conv: Conv1D, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> RowParallelConv1D:
        n_in, n_out = conv.weight.shape
        check_divisible(n_in, mesh.size(), "input features", cls.__name__)
        conv.weight = distribute_parameter(conv.weight, mesh, [Shard(0)])
        conv.bias = distribute_parameter(conv.bias, mesh, [Replicate()])
        become(conv, cls)
        conv._configure(mesh, n_in, n_out, True, sequence_parallel, None)
        mark_partitioned(conv)
        return conv


class Conv1DColumn(ParallelStyle):
    """:class:`~meshpar.tensor_parallel.ColumnParallel` for a transformers ``Conv1D``; ``fused``: equal blocks
    (GPT-2's ``[q | k | v]``) split separately; ``input_gathered`` as for ``ColumnParallel``."""

    def __init__(
        self,
        *,
        fused: int = 1,
        gather_output: bool = False,
        num_heads: int | None = None,
        sequence_parallel: bool = False,
        input_gathered: bool = False,
    ) -> None:
        super().__init__()
        self.fused, self.gather_output, self.num_heads = fused, gather_output, num_heads
        self.sequence_parallel, self.input_gathered = sequence_parallel, input_gathered

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not Conv1D:
            raise TypeError(f"Conv1DColumn applies to transformers Conv1D, got {type(module).__name__}")
        if self.num_heads is not None:
            check_divisible(self.num_heads, device_mesh.size(), "the number of attention heads", "Conv1DColumn")
        return ColumnParallelConv1D.from_conv1d(
            module, device_mesh, fused=self.fused, gather_output=self.gather_output,
            sequence_parallel=self.sequence_parallel, input_gathered=self.input_gathered,
        )  # fmt: skip


class Conv1DRow(ParallelStyle):
    """:class:`~meshpar.tensor_parallel.RowParallel` for a transformers ``Conv1D``."""

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not Conv1D:
            raise TypeError(f"Conv1DRow applies to transformers Conv1D, got {type(module).__name__}")
        return RowParallelConv1D.from_conv1d(module, device_mesh, sequence_parallel=self.sequence_parallel)


def on_conv1d(style: ParallelStyle, where: str) -> ParallelStyle:
    """The style a plan string gave (for ``nn.Linear``) for modules that are transformers ``Conv1D`` (weight stored
    ``[in, out]``): column, packed column in equal parts (GPT-2's ``c_attn``), row. Raises for anything else."""
    if type(style) is ColumnParallel and not style.sequence_parallel and not style.input_gathered:
        return Conv1DColumn(gather_output=style.gather_output)
    if isinstance(style, PackedColumnParallel):
        parts = style.parts if isinstance(style.parts, tuple) else (1,) * style.parts
        if len(set(parts)) == 1:
            return Conv1DColumn(fused=len(parts))
    if type(style) is RowParallel and style.input_is_parallel and not style.sequence_parallel:
        return Conv1DRow()
    raise ValueError(f"{where}: {type(style).__name__} on a transformers Conv1D")
