"""Which slice of a full tensor a DTensor holds on this rank."""

from __future__ import annotations

import torch

from meshpar._compat import DTensor, Shard


def local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that ``like`` (a DTensor with even ``Shard`` / ``Replicate`` placements) holds here."""
    if not isinstance(like, DTensor):
        return full
    out = full
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            mesh = like.device_mesh
            out = out.chunk(mesh.size(mesh_dim), placement.dim)[mesh.get_local_rank(mesh_dim)]
    return out
