"""Column-parallel ``nn.Linear`` whose output packs several parts: Phi-3's ``qkv_proj`` (``[q | k | v]``), Phi-3's
and GLM's ``gate_up_proj`` (``[gate | up]``).

The module's own forward slices the parts by size (``q``: ``num_attention_heads * head_dim`` rows) or chunks the
output in halves. A plain column split would give rank 0 all of ``q``; transformers therefore gathers the whole
output on every rank (``colwise_gather_output``) and splits the next layer's input again (``rowwise_split_input``):
an all-gather per projection and full-size activations. Here every rank holds its share of each part, in the
model's order (``[q_r | k_r | v_r]``, ``[gate_r | up_r]``), so the forward's own slicing (with the attention's head
counts divided by tp) reads whole heads, and the next projection is a plain row-parallel layer: Megatron's
collectives, one all-reduce each way per pair.

The weight is a DTensor whose global value does not depend on tp, so DCP reshards it exactly, and its checkpoint
holds the model's own shape (``checkpoint_shapes``, :mod:`meshpar._stored_layout`):

- equal parts (gate/up; q/k/v with as many key/value heads as query heads): ``[parts, rows, in]`` sharded on the
  rows (``Shard(1)``), a view of the model's ``[parts * rows, in]``; the local shard flattens to
  ``[gate_r | up_r]`` for free.
- unequal parts (grouped-query q/k/v): :class:`meshpar._stored_layout.GroupedRows`, ``[groups, slots, in]``
  sharded on the groups (``Shard(0)``), a group being one key/value head with the query heads that read it
  (Megatron's layout); the local output is reordered into ``[q_r | k_r | v_r]`` (one copy of the output).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshpar._compat import DeviceMesh, Shard, local_tensor
from meshpar._in_place import become
from meshpar._stored_layout import GroupedRows, Layout, stored_shape, to_layout
from meshpar.tensor_parallel._init import check_divisible, fill_from_full_, linear_bias_init, linear_weight_init
from meshpar.tensor_parallel.layers import ColumnParallelLinear, distribute_parameter, mark_partitioned


def _grouped(parts: tuple[int, ...], unit: int) -> tuple[int, tuple[int, ...]]:
    """(groups, slots per group of each part) for parts of ``unit``-row heads: the most groups that split every part
    evenly."""
    counts = [size // unit for size in parts]
    groups = math.gcd(*counts)
    return groups, tuple(count // groups for count in counts)


class PackedColumnParallelLinear(ColumnParallelLinear):
    """``y = x W^T + b`` with ``W``'s rows ``[part_0 | part_1 | ...]`` split per part; output ``[p0_r | p1_r | ...]``.

    ``parts``: the rows of each part (their sum is ``out_features``), or a number of equal parts; ``unit``: rows
    per head (tp splits whole heads of every part)."""

    parts: tuple[int, ...]
    unit: int
    grouped: GroupedRows | None
    checkpoint_shapes: dict[str, Layout]

    @classmethod
    def from_linear(  # type: ignore[override]
        cls,
        linear: nn.Linear,
        tp_mesh: DeviceMesh,
        *,
        parts: tuple[int, ...] | int,
        unit: int = 1,
        sequence_parallel_enabled: bool = False,
        input_gathered: bool = False,
        src_data_rank: int | None = 0,
    ) -> PackedColumnParallelLinear:
        """Shard an existing ``nn.Linear`` in place (the module object is kept; its class becomes this one)."""
        out_features, in_features = linear.out_features, linear.in_features
        if isinstance(parts, int):
            check_divisible(out_features, parts, "out_features", f"{cls.__name__} with {parts} equal parts")
            parts = (out_features // parts,) * parts
        if sum(parts) != out_features or any(size % unit for size in parts):
            raise ValueError(
                f"{cls.__name__}: parts {parts} of {unit}-row heads do not make up the {out_features} output rows"
            )
        for size in parts:
            check_divisible(size // unit, tp_mesh.size(), "heads per packed part", cls.__name__)
        shapes: dict[str, Layout] = {"weight": (out_features, in_features)}
        grouped = None
        if len(set(parts)) > 1:
            groups, slots = _grouped(parts, unit)
            check_divisible(groups, tp_mesh.size(), "groups of packed heads", cls.__name__)
            grouped = GroupedRows(slots, unit, (out_features, in_features))
            shapes["weight"] = grouped
        placement = Shard(0) if grouped is not None else Shard(1)
        linear.weight = _packed_param(linear.weight, shapes["weight"], len(parts), tp_mesh, placement, src_data_rank)
        if linear.bias is not None:
            shapes["bias"] = GroupedRows(grouped.slots, unit, (out_features,)) if grouped else (out_features,)
            linear.bias = _packed_param(linear.bias, shapes["bias"], len(parts), tp_mesh, placement, src_data_rank)
        become(linear, cls)
        linear._configure(tp_mesh, in_features, out_features, False, sequence_parallel_enabled, None)
        linear.input_gathered, linear.regather_input = input_gathered, False
        linear.parts, linear.unit, linear.grouped, linear.checkpoint_shapes = tuple(parts), unit, grouped, shapes
        mark_partitioned(linear)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.grouped is None:  # [p0_r | p1_r | ...] already
            return y
        local_groups = local_tensor(self.weight).shape[0]
        per_part = y.unflatten(-1, (local_groups, -1)).split([n * self.unit for n in self.grouped.slots], dim=-1)
        return torch.cat([part.flatten(-2) for part in per_part], dim=-1)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s init of the model's ``[out, in]`` weight, packed (fan-in from ``in``, not the packing)."""
        n = len(self.parts)
        fill_from_full_(self.weight, _init_packed(linear_weight_init, self.checkpoint_shapes["weight"], n))
        if self.bias is not None:
            bias_init = linear_bias_init(self.input_size)
            fill_from_full_(self.bias, _init_packed(bias_init, self.checkpoint_shapes["bias"], n))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={self.parts}, unit={self.unit}"


def _pack(dense: torch.Tensor, layout: Layout, parts: int) -> torch.Tensor:
    """``dense`` as this layer keeps it: ``[parts, rows, ...]`` for equal parts, else grouped."""
    return to_layout(dense, layout, (parts, -1, *dense.shape[1:]))


def _packed_param(
    param: nn.Parameter,
    layout: Layout,
    parts: int,
    mesh: DeviceMesh,
    placement: Shard,
    src_data_rank: int | None,
) -> nn.Parameter:
    packed = _pack(param.detach(), layout, parts)
    return distribute_parameter(packed, mesh, [placement], src_data_rank, requires_grad=param.requires_grad)


def _init_packed(init: object, layout: Layout, parts: int) -> object:
    def fill(full: torch.Tensor) -> None:
        dense = torch.empty(stored_shape(layout), dtype=full.dtype)
        init(dense)
        full.copy_(_pack(dense, layout, parts))

    return fill
