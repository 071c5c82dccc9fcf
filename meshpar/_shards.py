"""Which slice of a full tensor a DTensor holds on this rank."""

from __future__ import annotations

import torch
from torch import nn

from meshpar._compat import DTensor, Shard, _StridedShard
from meshpar._stored_layout import from_layout, to_layout


def local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that ``like`` (a DTensor with ``Shard`` / ``Replicate`` placements, or FSDP2's
    ``_StridedShard`` over dp ahead of a tp shard of the same dim) holds here. A strided shard splits what the later
    shards left (FSDP2 shards each tp shard), so it is cut last; uneven cuts as ``torch.chunk`` (FSDP2's padding)."""
    if not isinstance(like, DTensor):
        return full
    mesh, out = like.device_mesh, full
    strided = [(d, p) for d, p in enumerate(like.placements) if isinstance(p, _StridedShard)]
    plain = [(d, p) for d, p in enumerate(like.placements) if isinstance(p, Shard)]
    for mesh_dim, placement in plain + strided:
        parts = out.chunk(mesh.size(mesh_dim), placement.dim)
        rank = mesh.get_local_rank(mesh_dim)
        out = parts[rank] if rank < len(parts) else out.narrow(placement.dim, 0, 0)
    return out


def _layout(model: nn.Module, name: str) -> object:
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner), "checkpoint_shapes", {}).get(leaf)


def in_model_layout(whole: torch.Tensor, model: nn.Module, name: str) -> torch.Tensor:
    """The inverse of :func:`in_parameter_layout`: ``whole``, a whole tensor in the layout meshpar keeps parameter
    ``name`` in (``full_tensor()`` of it, its grad, its optimizer state), in the model's own shape."""
    layout = _layout(model, name)
    return whole if layout is None else from_layout(whole, layout)


def in_parameter_layout(full: torch.Tensor, model: nn.Module, name: str) -> torch.Tensor:
    """``full``, a tensor in the model's own shape for parameter ``name`` of ``model`` (a dense weight or its grad),
    in the layout meshpar keeps that parameter in: packed parameters (``checkpoint_shapes`` of their module,
    :mod:`meshpar._stored_layout`) are packed; every other tensor is returned as it is."""
    layout = _layout(model, name)
    shape = tuple(model.get_parameter(name).shape)
    return full if layout is None or tuple(full.shape) == shape else to_layout(full, layout, shape)
