"""``neuronx_distributed.parallel_layers.pad``: pad attention to a head count tp divides.

``pad_model`` is meshpar's (:func:`meshpar.hf.padding.pad_model`) with NxD's layers padded NxD's way: each rank's
local shard grows by ``padded / n_heads`` with zeros at its end (a column-parallel layer's output rows, a
row-parallel layer's input columns), so every rank keeps the rows it had and a column -> row chain computes what it
computed before, whatever each rank feeds it. (Heads that were split across ranks before padding stay split: pad
before loading weights laid out for the padded model, as NxD intends.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from meshpar.compat.nxd.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear
from meshpar.hf.padding import get_number_of_extra_heads
from meshpar.hf.padding import pad_model as _pad_model


@torch.no_grad()
def _padded_locally(param: nn.Parameter, dim: int, ratio: float) -> nn.Parameter:
    """``param`` (this rank's shard) with zeros appended along ``dim`` to ``ratio`` times its size."""
    size = param.shape[dim]
    extra = round(size * ratio) - size
    padding = [0, 0] * (param.dim() - 1 - dim) + [0, extra]
    new = nn.Parameter(F.pad(param.detach(), padding).contiguous(), requires_grad=param.requires_grad)
    new.__dict__.update({k: v for k, v in param.__dict__.items() if not k.startswith("_")})
    return new


@torch.no_grad()
def _pad_nxd_linear(layer: nn.Module, n_heads: int, padded_heads: int) -> None:
    ratio = padded_heads / n_heads
    column = isinstance(layer, ColumnParallelLinear)
    layer.weight = _padded_locally(layer.weight, 0 if column else 1, ratio)
    tp = layer.tp_mesh.size()
    if column:
        local = layer.weight.shape[0]
        if layer.bias is not None:
            if layer.gather_output:  # the full bias follows the gathered layout: each rank's part, then its zeros
                parts = [_padded_locally(nn.Parameter(p), 0, ratio) for p in layer.bias.detach().chunk(tp)]
                layer.bias = nn.Parameter(torch.cat([p.detach() for p in parts]))
            else:
                layer.bias = _padded_locally(layer.bias, 0, ratio)
        layer.output_size, layer.output_size_per_partition = local * tp, local
    else:
        local = layer.weight.shape[1]
        layer.input_size, layer.input_size_per_partition = local * tp, local


def generate_padding_mask(
    num_heads: int,
    num_heads_with_pad: int,
    num_kv_heads: int,
    tp_degree: int,
    tp_rank: int,
    hardware_type: object = None,
) -> torch.Tensor:
    """Which of tp rank ``tp_rank``'s query heads are real (True) and which padding (False), when ``num_heads``
    query heads padded to ``num_heads_with_pad`` share ``num_kv_heads`` kv heads replicated up to ``tp_degree``.
    The kv heads' replica layout decides it: Trn1 cycles the kv heads over the ranks, Trn2 puts a head's replicas on
    adjacent ranks; by default the platform's (:func:`~meshpar.compat.nxd.utils.utils.platform_hardware`, the layout
    ``GQAQKVColumnParallelLinear`` uses)."""
    from meshpar.compat.nxd.utils.utils import hardware, platform_hardware

    kind = platform_hardware() if hardware_type is None else hardware_type
    per_rank = num_heads_with_pad // tp_degree
    per_kv_head = num_heads // num_kv_heads
    if kind == hardware.TRN1:
        group = tp_rank // num_kv_heads  # which cycle of kv heads this rank is in
        mask = torch.arange(per_rank * group, per_rank * (group + 1)) < per_kv_head
    elif kind == hardware.TRN2:
        replicas = max(tp_degree // num_kv_heads, 1)
        replica = tp_rank % replicas
        kv_per_rank = num_kv_heads * replicas // tp_degree
        mask = torch.arange(per_rank * replica, per_rank * (replica + 1)) < per_kv_head * kv_per_rank
    else:
        raise RuntimeError(f"Unexpected hardware_type {hardware_type} received in padding mask generation.")
    return mask


def pad_model(
    model: nn.Module,
    tp_degree: int,
    n_heads: int,
    wrapped_classes: Iterable[type] = (),
    pad_hook_fn: Callable[[nn.Module, float], None] | None = None,
) -> nn.Module:
    """NxD's ``pad_model(model, tp_degree, n_heads, wrapped_classes=(), pad_hook_fn=None)`` (see the module
    docstring for where the zeros go)."""
    padders = {ColumnParallelLinear: _pad_nxd_linear, RowParallelLinear: _pad_nxd_linear}
    return _pad_model(model, tp_degree, n_heads, wrapped_classes, pad_hook_fn, layer_padders=padders)


__all__ = ["generate_padding_mask", "get_number_of_extra_heads", "pad_model"]
