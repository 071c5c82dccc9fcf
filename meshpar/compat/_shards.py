"""The one rule both Megatron-style views (apex, NxD) use to cut a full weight into a tp rank's plain local shard."""

from __future__ import annotations

import torch


def strided_local_part(
    full: torch.Tensor, dim: int, per_partition_size: int, stride: int, rank: int, world: int
) -> torch.Tensor:
    """This rank's part of ``full`` along ``dim``: the dim is cut into blocks of ``per_partition_size / stride`` and
    the blocks dealt out round-robin, so with ``stride`` s (q, k and v stacked in one weight, say) every rank gets its
    part of each of the s stacked pieces. ``stride`` 1 is the plain contiguous 1/world."""
    if per_partition_size % stride != 0:
        raise ValueError(f"the per-rank size {per_partition_size} is not divisible by stride {stride}")
    blocks = torch.split(full, per_partition_size // stride, dim=dim)
    if len(blocks) != world * stride:
        raise ValueError(
            f"a dim of size {full.shape[dim]} cannot be cut into {world} ranks x {stride} blocks of "
            f"{per_partition_size // stride}"
        )
    return torch.cat(blocks[rank::world], dim=dim)
