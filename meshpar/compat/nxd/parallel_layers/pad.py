"""``neuronx_distributed.parallel_layers.pad``: pad attention to a head count tp divides.

``pad_model`` is meshpar's (:func:`meshpar.hf.padding.pad_model`) with NxD's layers padded too. Where NxD pads each
rank's local shard at its end (right for a model whose weights are loaded after padding, wrong for one that already
holds its weights), meshpar pads the whole sharded dim at its end (the added heads are zero, the real heads keep
their ranks), so a model padded after its weights were loaded still computes what it computed before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from meshpar.compat.nxd.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear, create_local_weight
from meshpar.compat.nxd.parallel_layers.utils import copy_tensor_model_parallel_attributes, divide
from meshpar.hf.padding import get_number_of_extra_heads
from meshpar.hf.padding import pad_model as _pad_model
from meshpar.tensor_parallel._collectives import _all_gather


@torch.no_grad()
def _padded_shard(param: nn.Parameter, dim: int, size: int, new_size: int, layer: nn.Module) -> nn.Parameter:
    """``param`` (this rank's shard along ``dim`` of a ``size``-long dim) as the shard of the same tensor padded with
    zeros at the end to ``new_size``."""
    mesh = layer.tp_mesh
    full = _all_gather(param.detach(), mesh, dim) if mesh.size() > 1 else param.detach()
    padding = [0, 0] * (full.dim() - 1 - dim) + [0, new_size - size]
    padded = F.pad(full, padding)
    local = create_local_weight(padded, dim, divide(new_size, mesh.size()), 1)
    new = nn.Parameter(local.contiguous(), requires_grad=param.requires_grad)
    copy_tensor_model_parallel_attributes(new, param)
    new.__dict__.update({k: v for k, v in param.__dict__.items() if not k.startswith("_")})
    return new


def _pad_nxd_linear(layer: nn.Module, n_heads: int, padded_heads: int) -> None:
    column = isinstance(layer, ColumnParallelLinear)
    size = layer.output_size if column else layer.input_size
    new_size = divide(size * padded_heads, n_heads)
    layer.weight = _padded_shard(layer.weight, 0 if column else 1, size, new_size, layer)
    if column and layer.bias is not None:
        if layer.gather_output:
            layer.bias = nn.Parameter(F.pad(layer.bias.detach(), (0, new_size - size)))
        else:
            layer.bias = _padded_shard(layer.bias, 0, size, new_size, layer)
    tp = layer.tp_mesh.size()
    if column:
        layer.output_size, layer.output_size_per_partition = new_size, divide(new_size, tp)
    else:
        layer.input_size, layer.input_size_per_partition = new_size, divide(new_size, tp)


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
    adjacent ranks (the layout meshpar's ``GQAQKVColumnParallelLinear`` uses, and the default here)."""
    from meshpar.compat.nxd.utils.utils import hardware

    kind = hardware.TRN2 if hardware_type is None else hardware_type
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
    docstring for how the padding is placed)."""
    padders = {ColumnParallelLinear: _pad_nxd_linear, RowParallelLinear: _pad_nxd_linear}
    return _pad_model(model, tp_degree, n_heads, wrapped_classes, pad_hook_fn, layer_padders=padders)


__all__ = ["generate_padding_mask", "get_number_of_extra_heads", "pad_model"]
