"""Shard-exact initialisation: a tp layer holds exactly the slice of the weight its dense twin would hold.

Every rank draws the *full* weight from the default generator (seeded identically on all ranks by
``init_parallel``), keeps its slice and frees the rest, one layer at a time. This is Megatron's CPU-initialisation
strategy: tp=1 and tp=N start from identical values. Peak extra memory is one full layer weight, transiently, and
only when parameters are materialised: layers built on ``device="meta"`` allocate nothing until
``reset_parameters()`` is called (after ``to_empty``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from meshpar._compat import DeviceMesh, DTensor, Placement, Shard, local_tensor

InitMethod = Callable[[torch.Tensor], object]


def check_divisible(value: int, tp: int, what: str, owner: str) -> None:
    if value % tp != 0:
        options = sorted({d for d in range(1, value + 1) if value % d == 0 and d <= 64})
        raise ValueError(
            f"{owner}: {what} {value} is not divisible by tp={tp}; use tp in {options} or pad {what} to a "
            f"multiple of {tp} (e.g. {math.ceil(value / tp) * tp})"
        )


def empty_dtensor(
    global_shape: tuple[int, ...],
    mesh: DeviceMesh,
    placements: list[Placement],
    *,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> nn.Parameter:
    """An uninitialised parameter holding this rank's shard of ``global_shape`` (uneven shards follow
    ``torch.chunk``: every rank but the last holds ``ceil(n / tp)``)."""
    local_shape = list(global_shape)
    for placement in placements:
        if isinstance(placement, Shard):
            local_shape[placement.dim] = shard_range(global_shape[placement.dim], mesh)[1]
    local = torch.empty(local_shape, dtype=dtype, device=device)
    stride = torch.empty(global_shape, device="meta").stride()
    shape = torch.Size(global_shape)
    return nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride))


def shard_range(size: int, mesh: DeviceMesh) -> tuple[int, int]:
    """(start, length) of this rank's ``torch.chunk`` slice of a dim of ``size`` split over ``mesh``."""
    chunk = math.ceil(size / mesh.size())
    start = min(size, mesh.get_local_rank() * chunk)
    return start, min(chunk, size - start)


def fill_from_full_(param: torch.Tensor, init_full: InitMethod) -> None:
    """Initialise the full tensor of ``param`` on CPU with ``init_full`` and copy this rank's shard into it."""
    if isinstance(param, DTensor):
        full = torch.empty(param.shape, dtype=torch.float32)
        init_full(full)
        local = local_tensor(param)
        for mesh_dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                size = param.device_mesh.size(mesh_dim)
                full = full.chunk(size, placement.dim)[param.device_mesh.get_local_rank(mesh_dim)]
        with torch.no_grad():
            local.copy_(full)
    else:
        full = torch.empty(param.shape, dtype=torch.float32)
        init_full(full)
        with torch.no_grad():
            param.copy_(full)


def linear_weight_init(weight: torch.Tensor) -> None:
    """``nn.Linear``'s default weight initialisation."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def linear_bias_init(fan_in: int) -> InitMethod:
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0

    def init(bias: torch.Tensor) -> None:
        nn.init.uniform_(bias, -bound, bound)

    return init
