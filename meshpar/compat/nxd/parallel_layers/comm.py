"""``neuronx_distributed.parallel_layers.comm``: NxD's collective helpers with torch_xla's signatures, on
torch.distributed (gloo or NCCL).

``groups`` is a process group or, as torch_xla takes them, a list of rank lists (the group holding this rank is
used; the parallel state's own groups are reused). ``all_reduce`` reduces in place; ``all_gather`` concatenates
along ``dim``; ``reduce_scatter`` reduces and keeps this rank's ``1/size`` slice along ``scatter_dim``, times
``scale``; ``gloo_reduce_scatter`` / ``cpu_reduce_scatter`` are NxD's reduce-then-scatter spelling of it for
backends without a reduce-scatter (the same result).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshpar.compat.nxd import xla

Groups = dist.ProcessGroup | Sequence[Sequence[int]] | None


def _group(groups: Groups) -> dist.ProcessGroup | None:
    if groups is None or isinstance(groups, dist.ProcessGroup):
        return groups
    return xla._group_of(groups)[0]


def _op(op: str | dist.ReduceOp) -> dist.ReduceOp:
    if isinstance(op, str):
        if op not in xla._OPS:
            raise ValueError(f"reduce type must be one of {sorted(xla._OPS)}, got {op!r}")
        return xla._OPS[op]
    return op


def all_reduce(
    op_type: str | dist.ReduceOp,
    tensor_bucket: torch.Tensor | list[torch.Tensor],
    groups: Groups,
    pin_layout: bool = True,
) -> torch.Tensor | list[torch.Tensor]:
    """Each tensor reduced in place over the group; returns the list (a single tensor is wrapped in one)."""
    tensors = [tensor_bucket] if isinstance(tensor_bucket, torch.Tensor) else list(tensor_bucket)
    for tensor in tensors:
        dist.all_reduce(tensor, op=_op(op_type), group=_group(groups))
    return tensors


def all_gather(
    input: torch.Tensor,
    dim: int = 0,
    groups: Groups = None,
    output: torch.Tensor | None = None,
    pin_layout: bool = True,
) -> torch.Tensor:
    """Every rank's ``input`` concatenated along ``dim`` in group-rank order (written into ``output`` if given)."""
    group = _group(groups)
    parts = [torch.empty_like(input) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, input.contiguous(), group=group)
    gathered = torch.cat(parts, dim=dim)
    if output is None:
        return gathered
    output.copy_(gathered)
    return output


def gloo_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str | dist.ReduceOp,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor:
    """``input`` reduced to the group's first rank, which scatters the dim-0 slices: ``output`` this rank's."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    reduced = input.contiguous().clone()
    dist.reduce(reduced, dst=ranks[0], op=_op(op), group=group)
    pieces = None
    if dist.get_rank() == ranks[0]:
        pieces = [p.contiguous() for p in reduced.split(reduced.shape[0] // len(ranks), dim=0)]
    dist.scatter(output, pieces, src=ranks[0], group=group)
    return output


def cpu_reduce_scatter(
    reduce_type: str | dist.ReduceOp,
    input: torch.Tensor,
    scale: float = 1,
    scatter_dim: int = 0,
    shard_count: int | None = None,
    groups: Groups = None,
    output: torch.Tensor | None = None,
    pin_layout: bool = True,
) -> torch.Tensor:
    """This rank's slice along ``scatter_dim`` of ``input`` reduced over the group, times ``scale``."""
    group = _group(groups)
    size = dist.get_world_size(group)
    if shard_count is not None and shard_count != size:
        raise ValueError(f"shard_count={shard_count} must equal the group's size {size}")
    if input.shape[scatter_dim] % size != 0:
        raise RuntimeError(f"Cannot reduce on dim {scatter_dim} with input shape {list(input.shape)} and world_size "
                           f"{size}")  # fmt: skip
    moved = input.movedim(scatter_dim, 0).contiguous()
    piece = torch.empty((moved.shape[0] // size, *moved.shape[1:]), dtype=input.dtype, device=input.device)
    gloo_reduce_scatter(piece, moved, reduce_type, group)
    result = piece.movedim(0, scatter_dim)
    if scale != 1:
        result = result * scale
    if output is None:
        return result
    output.copy_(result)
    return output


def reduce_scatter(
    reduce_type: str | dist.ReduceOp,
    input: torch.Tensor,
    scale: float,
    scatter_dim: int,
    shard_count: int,
    groups: Groups = None,
    output: torch.Tensor | None = None,
    pin_layout: bool = True,
) -> Any:
    """torch_xla's ``reduce_scatter``: see :func:`cpu_reduce_scatter`."""
    return cpu_reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count, groups, output, pin_layout)


__all__ = ["all_gather", "all_reduce", "cpu_reduce_scatter", "gloo_reduce_scatter", "reduce_scatter"]
