"""Gradient norm and clipping over every way a model is split.

A grad that is sharded along a mesh dim (tp shards, FSDP/ZeRO-2 dp shards) contributes its local part and is summed
over that dim; a replicated grad (``Replicate()`` DTensors and plain tensors of a tp model) counts once. Stages of a
pipeline hold different parameters, so the per-stage totals are summed over pp. Every rank gets the same total norm.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from meshpar._compat import DTensor, Partial, Replicate
from meshpar.parallel_dims import get_parallel, is_initialized


def _local_power(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if norm_type == float("inf"):
        return torch.stack([g.detach().abs().max().float() for g in grads]).max()
    return torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type for g in grads]).sum()


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all grads as if the model were dense and on one device."""
    norm_type = float(norm_type)
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    groups: dict[tuple, list[torch.Tensor]] = {}
    meshes: dict[tuple, object] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(isinstance(p, Partial) for p in grad.placements):  # pending sums: reduce them first
                placements = [Replicate() if isinstance(p, Partial) else p for p in grad.placements]
                grad = grad.redistribute(grad.device_mesh, placements)
            # any non-replicated placement (Shard, FSDP's _StridedShard) holds a disjoint part of the grad
            key = (
                id(grad.device_mesh),
                tuple(i for i, p in enumerate(grad.placements) if not isinstance(p, Replicate)),
            )
            meshes[key] = grad.device_mesh
            groups.setdefault(key, []).append(grad.to_local())
        else:
            groups.setdefault(("plain",), []).append(grad)
    device = get_parallel().device if is_initialized() else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, grads in groups.items():
        value = _local_power(grads, norm_type).to(device)
        if key != ("plain",):
            mesh = meshes[key]
            for dim in key[1]:
                dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, value) if op == dist.ReduceOp.MAX else total + value
    if is_initialized() and get_parallel().pp > 1:
        dist.all_reduce(total, op=op, group=get_parallel().pp_mesh.get_group())
    return total if norm_type == float("inf") else total ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all grads so that their global norm is at most ``max_norm``; returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    norm = total_grad_norm(params, norm_type)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for param in params:
            grad = param.grad._local_tensor if isinstance(param.grad, DTensor) else param.grad
            grad.mul_(coef.to(grad.dtype))
    return norm
