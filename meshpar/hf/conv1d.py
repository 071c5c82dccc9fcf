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
from transformers.pytorch_utils import Conv1D

from meshpar._compat import DeviceMesh, Replicate, Shard
from meshpar._in_place import become
from meshpar.tensor_parallel._collectives import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from meshpar.tensor_parallel._init import check_divisible
from meshpar.tensor_parallel.layers import distribute_parameter


class ColumnParallelConv1D(Conv1D):
    """``y = x W + b`` with ``W [in, out]`` split by output features (``fused`` blocks split separately)."""

    tp_mesh: DeviceMesh
    fused: int
    gather_output: bool
    sequence_parallel: bool

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
        conv.tp_mesh, conv.fused = mesh, fused
        conv.gather_output, conv.sequence_parallel = gather_output, sequence_parallel
        return conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sp(x, self.tp_mesh, 1) if self.sequence_parallel else copy_to_tp(x, self.tp_mesh)
        weight = self.weight.to_local()
        y = torch.addmm(
            self.bias.to_local().reshape(-1), x.reshape(-1, x.shape[-1]), weight.reshape(weight.shape[0], -1)
        )
        y = y.view(*x.shape[:-1], -1)
        if not self.gather_output:
            return y
        # gathered per part, so that the output is the model's [q | k | v], not [q_0 k_0 v_0 | q_1 k_1 v_1]
        return gather_from_tp(y.unflatten(-1, (self.fused, -1)), self.tp_mesh, -1).flatten(-2)


class RowParallelConv1D(Conv1D):
    """``y = x W + b`` with ``W [in, out]`` split by input features; output all-reduced (reduce-scattered under SP)."""

    tp_mesh: DeviceMesh
    sequence_parallel: bool

    @classmethod
    def from_conv1d(cls, conv: Conv1D, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> RowParallelConv1D:
        n_in = conv.weight.shape[0]
        check_divisible(n_in, mesh.size(), "input features", cls.__name__)
        conv.weight = distribute_parameter(conv.weight, mesh, [Shard(0)])
        conv.bias = distribute_parameter(conv.bias, mesh, [Replicate()])
        become(conv, cls)
        conv.tp_mesh, conv.sequence_parallel = mesh, sequence_parallel
        return conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight.to_local())
        if self.sequence_parallel:
            return reduce_scatter_to_sp(y, self.tp_mesh, 1) + copy_to_tp(self.bias.to_local(), self.tp_mesh)
        return reduce_from_tp(y, self.tp_mesh) + self.bias.to_local()
