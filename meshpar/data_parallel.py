"""Plain data parallelism: average gradients over ``mesh["dp"]`` after backward.

The minimal DDP-style step for models whose parameters are DTensors on the tp mesh (their local shards are what each
dp replica owns). ZeRO-1 and FSDP2 are separate options.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from meshpar._compat import DeviceMesh, DTensor
from meshpar.parallel_dims import get_parallel


def allreduce_gradients(parameters: Iterable[torch.nn.Parameter], dp_mesh: DeviceMesh | None = None) -> None:
    """Average the grads of ``parameters`` over the dp group, flattened into one bucket per dtype."""
    mesh = dp_mesh if dp_mesh is not None else get_parallel().dp_mesh
    if mesh.size() == 1:
        return
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for bucket in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=mesh.get_group())
        flat /= mesh.size()
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
