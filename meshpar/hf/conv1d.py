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

from meshpar._compat import DeviceMesh, Replicate, Shard
from meshpar._in_place import become
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
