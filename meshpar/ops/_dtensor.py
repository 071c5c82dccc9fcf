"""Running row-local ops on DTensor inputs by working on local shards."""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshpar._compat import DTensor, Partial, Replicate


def on_local_shards(fn: Callable[..., torch.Tensor], x: torch.Tensor, *params: torch.Tensor | None) -> torch.Tensor:
    """``fn(x, *params)`` on local shards when ``x`` is a DTensor; the output keeps ``x``'s placements.

    ``fn`` must be local along every sharded dim of ``x`` (rows for norms, any dim for elementwise ops). Replicated
    parameters used on a sharded ``x`` get ``Partial`` grads: each rank saw only its rows.
    """
    if not isinstance(x, DTensor):
        return fn(x, *params)
    sharded = any(not isinstance(p, Replicate) for p in x.placements)
    grad_placements = [Partial()] if sharded else [Replicate()]
    local_params = [
        p.to_local(grad_placements=grad_placements * p.device_mesh.ndim) if isinstance(p, DTensor) else p
        for p in params
    ]
    out = fn(x.to_local(), *local_params)
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())
