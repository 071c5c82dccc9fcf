"""``neuronx_distributed.modules.qkv_linear``: the query / key / value projection of grouped-query attention as one
column-parallel layer, with the key / value heads replicated ``kv_size_multiplier`` times when tp exceeds their
count.

The query weight is split over tp like a column-parallel layer. The key and value weights are repeated block by
block (each rank's heads on ``kv_size_multiplier`` adjacent tp ranks; with ``kv_size_multiplier = tp / kv_heads``
rank ``r`` holds kv head ``r // multiplier``, the head its own query heads use in the dense model's grouping) and
then split (NxD's Trn2 layout; its Trn1 layout interleaves the replicas instead). The replicas' weight grads are
summed over each kv-shared group as they arrive (:func:`~meshpar.compat.nxd.parallel_layers.parallel_state.
initialize_kv_group`), which makes every replica's grad the dense grad of its head, so replicas stay equal.
``forward`` returns ``(q, k, v)``; ``fuse_qkv`` keeps one ``weight_qkv`` (q, k, v rows stacked) instead of three.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.compat.nxd.parallel_layers.layers import (
    BaseParallelLinear,
    LinearWithAsyncCommunication,
    create_local_weight,
    linear_with_async_allreduce,
)
from meshpar.compat.nxd.parallel_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_mesh,
)
from meshpar.compat.nxd.parallel_layers.utils import divide, set_tensor_model_parallel_attributes

# NxD's autograd function and entry point for the fused projection: one column-parallel matmul of the stacked weight
GQAQKVLinearWithAsyncCommunication = LinearWithAsyncCommunication
gqa_qkv_linear_with_async_allreduce = linear_with_async_allreduce


def _replicated_blocks(full: torch.Tensor, per_partition: int, multiplier: int) -> torch.Tensor:
    """``full`` (``[out, ...]``) with each block of ``per_partition`` rows (one rank's heads) repeated ``multiplier``
    times in place: cut over tp, adjacent ranks then hold the same heads."""
    if multiplier == 1:
        return full
    return torch.cat([block for block in full.split(per_partition, dim=0) for _ in range(multiplier)], dim=0)


class GQAQKVColumnParallelLinear(BaseParallelLinear):
    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        sequence_parallel_enabled: bool = False,
        keep_master_weight: bool = False,
        kv_size_multiplier: int = 1,
        fuse_qkv: bool = True,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(device=device)
        self.tp_mesh = group_mesh(None)
        # the tp size as NxD reads it (its unit tests set it by patching the getter)
        self.world_size = tp = parallel_state.get_tensor_model_parallel_size()
        if tp % kv_size_multiplier != 0:
            raise ValueError(f"tp={tp} must be divisible by kv_size_multiplier={kv_size_multiplier}")
        if (output_sizes[1] * kv_size_multiplier) % tp != 0:
            raise ValueError(
                f"the kv output size {output_sizes[1]} x kv_size_multiplier {kv_size_multiplier} must divide by tp={tp}"
            )
        if gather_output and kv_size_multiplier > 1:
            raise NotImplementedError(
                "GQAQKVColumnParallelLinear(gather_output=True, kv_size_multiplier > 1): gathering would return the "
                "replicated kv heads; use gather_output=False"
            )
        if sequence_parallel_enabled and gather_output:
            raise RuntimeError("sequence_parallel_enabled=True requires gather_output=False")
        parallel_state.initialize_kv_group(kv_size_multiplier)
        self.input_size, self.output_sizes, self.gather_output = input_size, list(output_sizes), gather_output
        self.arg_init_method, self.dtype, self.device = init_method, dtype, device
        self.keep_master_weight, self.kv_size_multiplier, self.fuse_qkv = (
            keep_master_weight,
            kv_size_multiplier,
            fuse_qkv,
        )
        self.use_bias, self.reduce_dtype, self.pad, self.stride, self.rank_ordering = bias, reduce_dtype, False, 1, None
        self.q_output_size_per_partition = divide(output_sizes[0], tp)
        self.kv_output_size_per_partition = divide(output_sizes[1] * kv_size_multiplier, tp)
        self.async_tensor_model_parallel_allreduce = not sequence_parallel_enabled and tp > 1
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self._create_weights_biases()
        self.initialize_weight_biases()
        self._sum_kv_grads_over_replicas()

    # -- construction: NxD's two steps, the parameters' shapes then their values -----------------------------------
    def _row_sizes(self, bias: bool = False) -> list[int]:
        """The rows of q, k and v this rank holds (a gathered layer's biases are whole)."""
        if bias and self.gather_output:
            return [self.output_sizes[0], self.output_sizes[1], self.output_sizes[1]]
        kv = self.kv_output_size_per_partition
        return [self.q_output_size_per_partition, kv, kv]

    def _create_weights_biases(self) -> None:
        """This rank's parameters, uninitialised, with NxD's tensor-parallel attributes: ``weight_qkv`` (and
        ``bias_qkv``) stacked with ``fuse_qkv``, else ``weight_q`` / ``weight_k`` / ``weight_v`` (and biases)."""
        tp = self.world_size

        def make(rows: int, *cols: int, sharded: bool = True) -> nn.Parameter:
            param = nn.Parameter(torch.empty(rows, *cols, dtype=self.dtype, device=self.device))
            if sharded:
                set_tensor_model_parallel_attributes(param, True, 0, 1, tp)
            return param

        for name in ("weight_qkv", "weight_q", "weight_k", "weight_v", "bias_qkv", "bias_q", "bias_k", "bias_v"):
            self.register_parameter(name, None)
        rows, bias_rows = self._row_sizes(), self._row_sizes(bias=True)
        if self.fuse_qkv:
            self.weight_qkv = make(sum(rows), self.input_size)
            if self.use_bias:
                self.bias_qkv = make(sum(bias_rows), sharded=not self.gather_output)
        else:
            self.weight_q, self.weight_k, self.weight_v = (make(r, self.input_size) for r in rows)
            if self.use_bias:
                self.bias_q, self.bias_k, self.bias_v = (make(r, sharded=not self.gather_output) for r in bias_rows)
        self.master_weight_qkv = self.master_weight_q = self.master_weight_k = self.master_weight_v = None

    def _init_weight_part(
        self, size: int, per_partition: int, multiplier: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's initialised part of a ``[size, input]`` weight (float32 master, then ``dtype``)."""
        master = torch.empty(size, self.input_size, dtype=torch.float32)
        self._init_weight(master)
        master = master.to(self.dtype)
        local = create_local_weight(_replicated_blocks(master, per_partition, multiplier), 0, per_partition, 1)
        return local, (master if self.keep_master_weight else None)

    def _init_bias_part(self, size: int, per_partition: int, multiplier: int) -> torch.Tensor:
        bound = 1 / math.sqrt(self.input_size)
        master = torch.empty(size, dtype=torch.float32).uniform_(-bound, bound).to(self.dtype)
        if self.gather_output:
            return master
        return create_local_weight(_replicated_blocks(master, per_partition, multiplier), 0, per_partition, 1)

    def initialize_weight_biases(self) -> None:
        """Fill the parameters: each of q, k, v initialised whole in float32 (``init_method``, or ``nn.Linear``'s
        Kaiming uniform), the kv heads repeated ``kv_size_multiplier`` times, then this rank's rows; the whole
        weights kept as ``master_weight_*`` with ``keep_master_weight``. On a meta device nothing is filled."""
        params = [self.weight_qkv] if self.fuse_qkv else [self.weight_q, self.weight_k, self.weight_v]
        if params[0].device.type == "meta":
            return
        q_rows, kv_rows, m = (
            self.q_output_size_per_partition,
            self.kv_output_size_per_partition,
            self.kv_size_multiplier,
        )
        sizes = [
            (self.output_sizes[0], q_rows, 1),
            (self.output_sizes[1], kv_rows, m),
            (self.output_sizes[1], kv_rows, m),
        ]
        made = [self._init_weight_part(*size) for size in sizes]
        locals_, masters = [local for local, _ in made], [master for _, master in made]
        with torch.no_grad():
            if self.fuse_qkv:
                self.weight_qkv.copy_(torch.cat(locals_, dim=0))
            else:
                for param, local in zip(params, locals_, strict=True):
                    param.copy_(local)
        if self.keep_master_weight:
            if self.fuse_qkv:
                self.master_weight_qkv = torch.cat(masters, dim=0)
            else:
                self.master_weight_q, self.master_weight_k, self.master_weight_v = masters
        if not self.use_bias:
            return
        parts = [self._init_bias_part(*size) for size in sizes]
        with torch.no_grad():
            if self.fuse_qkv:
                self.bias_qkv.copy_(torch.cat(parts))
            else:
                for param, part in zip((self.bias_q, self.bias_k, self.bias_v), parts, strict=True):
                    param.copy_(part)

    def _sum_kv_grads_over_replicas(self) -> None:
        """Each kv replica's incoming weight grad (and bias grad) summed over its kv-shared group before it is
        accumulated: the dense grad of that head on every replica."""
        if self.kv_size_multiplier == 1:
            return
        group = parallel_state.get_kv_shared_group()
        q_rows = self.q_output_size_per_partition

        def summed(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad

        def summed_kv_rows(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            kv = grad[q_rows:].contiguous()
            dist.all_reduce(kv, group=group)
            grad[q_rows:] = kv
            return grad

        if self.fuse_qkv:
            self.weight_qkv.register_hook(summed_kv_rows)
            if self.bias_qkv is not None and not self.gather_output:
                self.bias_qkv.register_hook(summed_kv_rows)
        else:
            for param in (self.weight_k, self.weight_v, self.bias_k, self.bias_v):
                if param is not None:
                    param.register_hook(summed)

    # -- forward ---------------------------------------------------------------------------------------------------
    def _weights(self) -> torch.Tensor:
        return self.weight_qkv if self.fuse_qkv else torch.cat([self.weight_q, self.weight_k, self.weight_v], dim=0)

    def _biases(self) -> list[torch.Tensor | None]:
        if self.fuse_qkv:
            if self.bias_qkv is None:
                return [None, None, None]
            q = self.output_sizes[0] if self.gather_output else self.q_output_size_per_partition
            kv = self.output_sizes[1] if self.gather_output else self.kv_output_size_per_partition
            return list(self.bias_qkv.split([q, kv, kv]))
        return [self.bias_q, self.bias_k, self.bias_v]

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.async_tensor_model_parallel_allreduce or self.sequence_parallel_enabled:
            x = input
        else:
            x = copy_to_tensor_model_parallel_region(input)
        out = linear_with_async_allreduce(
            x, self._weights(), None, self.async_tensor_model_parallel_allreduce, self.sequence_parallel_enabled, 0,
            process_group=self.tp_mesh.get_group(), reduce_dtype=self.reduce_dtype,
        )  # fmt: skip
        kv = self.kv_output_size_per_partition
        outputs = list(out.split([self.q_output_size_per_partition, kv, kv], dim=-1))
        if self.gather_output:
            outputs = [gather_from_tensor_model_parallel_region(o) for o in outputs]
        return tuple(o + b if b is not None else o for o, b in zip(outputs, self._biases(), strict=True))


__all__ = [
    "GQAQKVColumnParallelLinear",
    "GQAQKVLinearWithAsyncCommunication",
    "gqa_qkv_linear_with_async_allreduce",
]
