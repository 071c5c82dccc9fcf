"""``neuronx_distributed.modules.qkv_linear``: the query / key / value projection of grouped-query attention as one
column-parallel layer, with the key / value heads replicated ``kv_size_multiplier`` times when tp exceeds their
count.

The query weight is split over tp like a column-parallel layer. The key and value weights are repeated as NxD lays
them out on the platform (:func:`~meshpar.compat.nxd.utils.utils.platform_hardware`), then split: on Trn2 (the
default off Neuron) block by block, each rank's heads on ``kv_size_multiplier`` adjacent tp ranks (with
``kv_size_multiplier = tp / kv_heads`` rank ``r`` holds kv head ``r // multiplier``, the head its own query heads use
in the dense model's grouping); on Trn1 (``NEURON_PLATFORM_TARGET_OVERRIDE=trn1``, for a model trained there) the
whole set repeated, rank ``r`` holding kv head ``r % kv_heads``. The projection runs as NxD's
autograd function (:class:`GQAQKVLinearWithAsyncCommunication`): in backward it sums the k / v output grads over
each kv-shared group (:func:`~meshpar.compat.nxd.parallel_layers.parallel_state.initialize_kv_group`), which makes
every replica's weight and bias grads the dense grads of its head, so replicas stay equal.
``forward`` returns ``(q, k, v)``; ``fuse_qkv`` keeps one ``weight_qkv`` (q, k, v rows stacked) instead of three.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshpar.compat.nxd import xla as xm  # noqa: F401 - torch_xla's module in NxD's namespace (its tests patch it)
from meshpar.compat.nxd.modules.qkv_linear_utils import (
    _qkvlinear_autograd_base_setup_bwd,
    _qkvlinear_autograd_base_setup_fwd,
    _qkvlinear_autograd_bwd_grad_reduce,
    _qkvlinear_autograd_bwd_input_grad,
    _qkvlinear_autograd_bwd_no_weight_grad,
)
from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.compat.nxd.parallel_layers.layers import BaseParallelLinear, create_local_weight

# the weight and bias grads of a matmul, in NxD's namespace here (its tests patch it)
from meshpar.compat.nxd.parallel_layers.layers_utils import _compute_gradients
from meshpar.compat.nxd.parallel_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_mesh,
)
from meshpar.compat.nxd.parallel_layers.utils import (
    cast_if_autocast_enabled,
    divide,
    set_tensor_model_parallel_attributes,
    verify_casted_dtype,
)
from meshpar.compat.nxd.utils.utils import hardware, platform_hardware


def _linear_forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    output = torch.matmul(input, weight.t())
    return output + bias if bias is not None else output


class GQAQKVLinearWithAsyncCommunication(torch.autograd.Function):
    """The q, k and v projections of this rank's heads (three weights, or ``weight_qkv`` stacked with
    ``fuse_qkv``), built from :mod:`.qkv_linear_utils`' steps. In backward the k / v output grads are summed over
    the kv-shared group (each replica of a kv head saw only its own query heads' grads), which makes the k / v weight
    grads the dense heads' on every replica; their share of the input grad is divided by ``kv_size_multiplier``,
    since the sum over tp that follows counts each replicated head that many times."""

    @staticmethod
    def forward(
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        total = _qkvlinear_autograd_base_setup_fwd(
            ctx, input, weight_q, weight_k, weight_v, bias_q, bias_k, bias_v, async_grad_allreduce,
            sequence_parallel_enabled, kv_size_multiplier, weight_qkv, bias_qkv, fuse_qkv, output_size_q,
            output_size_kv, reduce_dtype,
        )  # fmt: skip
        if ctx.fuse_qkv:
            if weight_qkv is None or output_size_q is None or output_size_kv is None:
                raise ValueError("fuse_qkv needs weight_qkv, output_size_q and output_size_kv")
            stacked = _linear_forward(total, weight_qkv, bias_qkv)
            return tuple(stacked.split([output_size_q, output_size_kv, output_size_kv], dim=-1))
        if weight_q is None or weight_k is None or weight_v is None:
            raise ValueError("without fuse_qkv the projection needs weight_q, weight_k and weight_v")
        return (_linear_forward(total, weight_q, bias_q), _linear_forward(total, weight_k, bias_k),
                _linear_forward(total, weight_v, bias_v))  # fmt: skip

    @staticmethod
    def backward(
        ctx: Any, grad_output_q: torch.Tensor, grad_output_k: torch.Tensor, grad_output_v: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        total, weight_qkv, weight_q, weight_k, weight_v, grad_output_k, grad_output_v = (
            _qkvlinear_autograd_base_setup_bwd(ctx, grad_output_q, grad_output_k, grad_output_v)
        )
        m = ctx.kv_size_multiplier
        if ctx.fuse_qkv:
            grad_input = torch.cat([grad_output_q, grad_output_k / m, grad_output_v / m], dim=-1).matmul(weight_qkv)
        else:
            grad_input = (
                grad_output_q.matmul(weight_q) + (grad_output_k.matmul(weight_k) + grad_output_v.matmul(weight_v)) / m
            )
        dtype = grad_input.dtype
        grad_input = _qkvlinear_autograd_bwd_grad_reduce(ctx, grad_input, dtype)
        if not ctx.compute_weight_gradient:
            if ctx.sequence_parallel_enabled:
                grad_input = _qkvlinear_autograd_bwd_no_weight_grad(ctx, grad_input, dtype)
            return (grad_input, *(None,) * 15)
        rows = total.reshape(-1, total.shape[-1])
        if ctx.sequence_parallel_enabled:
            grad_input = _qkvlinear_autograd_bwd_input_grad(ctx, grad_input, dtype)
        if ctx.fuse_qkv:
            stacked = torch.cat([grad_output_q, grad_output_k, grad_output_v], dim=-1)
            grad_weight, grad_bias = _compute_gradients(rows, weight_qkv, stacked, ctx.use_bias)
            return (grad_input, *(None,) * 9, grad_weight, grad_bias, *(None,) * 4)
        (gwq, gbq), (gwk, gbk), (gwv, gbv) = (
            _compute_gradients(rows, weight, grad, ctx.use_bias)
            for weight, grad in ((weight_q, grad_output_q), (weight_k, grad_output_k), (weight_v, grad_output_v))
        )
        # one trailing None more than there are inputs, as NxD returns it (autograd accepts extra Nones)
        return (grad_input, gwq, gwk, gwv, gbq, gbk, gbv, *(None,) * 10)


def gqa_qkv_linear_with_async_allreduce(
    input: torch.Tensor,
    weight_q: torch.Tensor | None,
    weight_k: torch.Tensor | None,
    weight_v: torch.Tensor | None,
    bias_q: torch.Tensor | None,
    bias_k: torch.Tensor | None,
    bias_v: torch.Tensor | None,
    async_grad_allreduce: bool,
    sequence_parallel_enabled: bool,
    kv_size_multiplier: int = 1,
    weight_qkv: torch.Tensor | None = None,
    bias_qkv: torch.Tensor | None = None,
    fuse_qkv: bool = False,
    output_size_q: int | None = None,
    output_size_kv: int | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`GQAQKVLinearWithAsyncCommunication` with autocast's cast applied to its inputs and autocast off
    inside."""
    args = cast_if_autocast_enabled(
        input, weight_q, weight_k, weight_v, bias_q, bias_k, bias_v, async_grad_allreduce, sequence_parallel_enabled,
        kv_size_multiplier, weight_qkv, bias_qkv, fuse_qkv, output_size_q, output_size_kv, reduce_dtype,
    )  # fmt: skip
    verify_casted_dtype(args)
    with torch.autocast(device_type=input.device.type, enabled=False):
        return GQAQKVLinearWithAsyncCommunication.apply(*args)


def _replicated_blocks(full: torch.Tensor, per_partition: int, multiplier: int, cycled: bool) -> torch.Tensor:
    """``full`` (``[out, ...]``) with its kv rows replicated ``multiplier`` times so that, cut over tp into parts of
    ``per_partition`` rows, each part sits on ``multiplier`` ranks: adjacent ranks (each block repeated in place), or,
    ``cycled`` (Trn1), ranks ``tp / multiplier`` apart (the whole set repeated)."""
    if multiplier == 1:
        return full
    if cycled:
        return torch.cat([full] * multiplier, dim=0)
    return torch.cat([block for block in full.split(per_partition, dim=0) for _ in range(multiplier)], dim=0)


def _kv_replica_layout(multiplier: int) -> hardware:
    """The platform's layout of replicated kv heads: Trn1's or Trn2's (NxD lays them out for no other)."""
    kind = platform_hardware()
    if multiplier > 1 and kind not in (hardware.TRN1, hardware.TRN2):
        raise NotImplementedError(
            f"GQAQKVColumnParallelLinear(kv_size_multiplier={multiplier}) on {kind.value}: NxD lays replicated key / "
            "value heads out for trn1 and trn2 only (set NEURON_PLATFORM_TARGET_OVERRIDE to one of them)"
        )
    return kind


def _check_kv_groups(layout: hardware, tp: int, multiplier: int) -> None:
    """The kv-shared groups already made must be the ones the layout replicates heads on (their sums in backward
    would otherwise mix different heads' grads)."""
    expected = parallel_state.arrange_kv_groups(1, tp, multiplier, False, layout)
    made = parallel_state.get_kv_shared_replica_groups()
    import torch.distributed as dist

    rank = dist.get_rank()
    tp_ranks = next(ranks for ranks in parallel_state.get_tensor_model_parallel_replica_groups() if rank in ranks)
    local = [[tp_ranks.index(r) for r in group] for group in made if group[0] in tp_ranks]
    if sorted(local) != sorted(expected):
        raise ValueError(
            f"the kv-shared groups were made as {local} (tp-local ranks), but the {layout.value} layout replicates "
            f"key / value heads on {expected}: call initialize_kv_group with the default sequential_ranks_in_group"
        )


def kv_replica_mismatch(modules: list[nn.Module]) -> str | None:
    """Why the loaded key / value replicas of the ``GQAQKVColumnParallelLinear`` layers in ``modules`` are not
    replicas (``None`` if they all are): each kv head's copies on its kv-shared group must agree, or the checkpoint
    was cut for the other platform layout (a model trained on Trn1 loads with ``NEURON_PLATFORM_TARGET_OVERRIDE=trn1``)
    or by another cut. Copies agree within 1% of their norm: replicas trained with stochastic rounding may differ in
    their last bits, different heads differ by about their whole norm. Collective over the kv-shared groups: every
    rank of a tp group calls it with the same layers."""
    import torch.distributed as dist

    layers = [m for module in modules for m in module.modules() if isinstance(m, GQAQKVColumnParallelLinear)]
    layers = [layer for layer in layers if layer.kv_size_multiplier > 1]
    if not layers:
        return None
    group = parallel_state.get_kv_shared_group()
    size = dist.get_world_size(group)
    for number, layer in enumerate(layers):
        for name, rows in layer._kv_rows():
            mine = rows.detach().float().contiguous()
            copies = [torch.empty_like(mine) for _ in range(size)]
            dist.all_gather(copies, mine, group=group)
            scale = max(float(copies[0].norm()), torch.finfo(torch.float32).tiny)
            if any(float((copy - copies[0]).norm()) > 1e-2 * scale for copy in copies[1:]):
                return (
                    f"the key / value replicas of GQAQKVColumnParallelLinear #{number} ({name}) differ across the "
                    f"kv-shared group {dist.get_process_group_ranks(group)}: the checkpoint holds another layout than "
                    f"this platform's {layer.kv_replica_layout.value} one (a model trained on Trn1 loads with "
                    "NEURON_PLATFORM_TARGET_OVERRIDE=trn1, or convert it with checkpoint_converter --hw_backend)"
                )
    return None


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
        self.kv_replica_layout = _kv_replica_layout(kv_size_multiplier)
        if kv_size_multiplier > 1:
            _check_kv_groups(self.kv_replica_layout, tp, kv_size_multiplier)
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
        self._forward_impl = gqa_qkv_linear_with_async_allreduce

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

    def kv_block_of(self, tp_rank: int) -> int:
        """Which ``kv_output_size_per_partition`` rows of the dense k / v weights tp rank ``tp_rank`` holds."""
        m = self.kv_size_multiplier
        if m == 1:
            return tp_rank
        return tp_rank % (self.world_size // m) if self.kv_replica_layout is hardware.TRN1 else tp_rank // m

    def kv_owner_ranks(self) -> list[int]:
        """For each block of the dense k / v rows in order, the first tp rank holding it."""
        first: dict[int, int] = {}
        for rank in range(self.world_size):
            first.setdefault(self.kv_block_of(rank), rank)
        return [first[block] for block in sorted(first)]

    def _kv_rows(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's key and value weight rows (and biases), by name."""
        q = self.q_output_size_per_partition
        if self.fuse_qkv:
            rows = [("weight_qkv[k, v]", self.weight_qkv[q:])]
            if self.bias_qkv is not None and not self.gather_output:
                rows.append(("bias_qkv[k, v]", self.bias_qkv[q:]))
            return rows
        named = [("weight_k", self.weight_k), ("weight_v", self.weight_v)]
        if not self.gather_output:
            named += [("bias_k", self.bias_k), ("bias_v", self.bias_v)]
        return [(name, tensor) for name, tensor in named if tensor is not None]

    def _init_weight_part(
        self, size: int, per_partition: int, multiplier: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's initialised part of a ``[size, input]`` weight (float32 master, then ``dtype``)."""
        master = torch.empty(size, self.input_size, dtype=torch.float32)
        self._init_weight(master)
        master = master.to(self.dtype)
        cycled = self.kv_replica_layout is hardware.TRN1
        local = create_local_weight(_replicated_blocks(master, per_partition, multiplier, cycled), 0, per_partition, 1)
        return local, (master if self.keep_master_weight else None)

    def _init_bias_part(self, size: int, per_partition: int, multiplier: int) -> torch.Tensor:
        bound = 1 / math.sqrt(self.input_size)
        master = torch.empty(size, dtype=torch.float32).uniform_(-bound, bound).to(self.dtype)
        if self.gather_output:
            return master
        cycled = self.kv_replica_layout is hardware.TRN1
        return create_local_weight(_replicated_blocks(master, per_partition, multiplier, cycled), 0, per_partition, 1)

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

    # -- forward ---------------------------------------------------------------------------------------------------
    def _biases(self) -> list[torch.Tensor | None]:
        if self.fuse_qkv:
            if self.bias_qkv is None:
                return [None, None, None]
            q = self.output_sizes[0] if self.gather_output else self.q_output_size_per_partition
            kv = self.output_sizes[1] if self.gather_output else self.kv_output_size_per_partition
            return list(self.bias_qkv.split([q, kv, kv]))
        return [self.bias_q, self.bias_k, self.bias_v]

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)`` of this rank's heads (gathered over tp with ``gather_output``). Under sequence parallelism
        the input is this rank's shard of dim 0 (NxD's ``[s, b, h]``). This rank's biases go into the projection's
        function, whose k / v bias grads are then the dense heads' too (NxD adds them after it, which leaves a
        replicated head's bias replicas with different grads); a gathered layer's full biases are added after the
        gather."""
        if self.async_tensor_model_parallel_allreduce or self.sequence_parallel_enabled:
            x = input  # the projection's function handles the input's communication
        else:
            x = copy_to_tensor_model_parallel_region(input)
        inside = not self.gather_output
        outputs = self._forward_impl(
            input=x, weight_q=self.weight_q, weight_k=self.weight_k, weight_v=self.weight_v,
            bias_q=self.bias_q if inside else None, bias_k=self.bias_k if inside else None,
            bias_v=self.bias_v if inside else None, async_grad_allreduce=self.async_tensor_model_parallel_allreduce,
            sequence_parallel_enabled=self.sequence_parallel_enabled, kv_size_multiplier=self.kv_size_multiplier,
            weight_qkv=self.weight_qkv, bias_qkv=self.bias_qkv if inside else None, fuse_qkv=self.fuse_qkv,
            output_size_q=self.q_output_size_per_partition, output_size_kv=self.kv_output_size_per_partition,
            reduce_dtype=self.reduce_dtype,
        )  # fmt: skip
        if inside:
            return tuple(outputs)
        gathered = [gather_from_tensor_model_parallel_region(o) for o in outputs]
        return tuple(o + b if b is not None else o for o, b in zip(gathered, self._biases(), strict=True))


__all__ = [
    "GQAQKVColumnParallelLinear",
    "GQAQKVLinearWithAsyncCommunication",
    "gqa_qkv_linear_with_async_allreduce",
]
