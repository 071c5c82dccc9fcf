"""Gradient norm and clipping over every way a model is split.

A grad that is sharded along a mesh dim (tp shards, FSDP/ZeRO-2 dp shards) contributes its local part and is summed
over that dim; a replicated grad (``Replicate()`` DTensors and plain tensors of a tp model) counts once. A plain
tensor whose parameter is marked ``tensor_model_parallel`` (the Megatron / NxD attribute the apex and NxD views'
layers put on their plain local shards) is a tp shard: its local part is summed over tp; one marked
``expert_model_parallel`` (NxD's expert weights under expert parallelism) holds this ep rank's experts: summed over
ep. Stages of a
pipeline hold different parameters, so the per-stage totals are summed over pp; a parameter that a second stage holds
a copy of (a tied embedding on the last stage, see :func:`mark_shared_copy`) counts once, on the stage that owns it.
Every rank gets the same total norm.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from meshpar._compat import DTensor, Partial, Replicate, local_tensor
from meshpar._dp_checks import holds_different_experts
from meshpar.parallel_dims import ParallelDims

_SHARED_COPY = "_meshpar_shared_copy"


def mark_shared_copy(param: torch.Tensor) -> None:
    """Mark ``param`` as a copy of a parameter another pipeline stage owns (the tied LM head of the last stage, kept
    equal to the first stage's embedding by summing their grads). Grad norms skip it, as Megatron skips its
    ``shared`` embedding copy: counting both copies would add the tied grad twice."""
    setattr(param, _SHARED_COPY, True)


def _device(dims: ParallelDims | None) -> torch.device:
    return dims.device if dims is not None else torch.device("cpu")


def _plain_tp_shard(param: torch.Tensor) -> bool:
    return not isinstance(param, DTensor) and bool(getattr(param, "tensor_model_parallel", False))


def _counted(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p in params if p.grad is not None and not getattr(p, _SHARED_COPY, False)]


def _local_power(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if norm_type == float("inf"):
        return torch.stack([g.detach().abs().max().float() for g in grads]).max()
    return torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type for g in grads]).sum()


def total_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, *, dims: ParallelDims | None
) -> torch.Tensor:
    """The norm of all grads as if the model were dense and on one device. ``dims``: the model's mesh, whose pp
    stages' totals are summed; ``None`` for a model whose parameters say all there is (one process, or DTensors and
    plain replicas only). It is asked for, never looked up: a pipeline stage's parameters cannot tell that other
    stages hold the rest of the model."""
    norm_type = float(norm_type)
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    groups: dict[tuple, list[torch.Tensor]] = {}
    meshes: dict[tuple, object] = {}
    for param in _counted(parameters):
        grad = param.grad
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
        else:  # a plain tensor: summed over the dims it is a part of (its attributes say which)
            over_tp = _plain_tp_shard(param) and dims is not None and dims.tp > 1
            over_ep = holds_different_experts(param, dims is not None and dims.ep > 1)
            groups.setdefault(("plain", over_tp, over_ep), []).append(grad)
    device = _device(dims)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, grads in groups.items():
        value = _local_power(grads, norm_type).to(device)
        if key[0] == "plain":
            for summed, mesh in zip(key[1:], ("tp_mesh", "ep_mesh"), strict=True):
                if summed:
                    dist.all_reduce(value, op=op, group=getattr(dims, mesh).get_group())
        else:
            mesh = meshes[key]
            for dim in key[1]:
                dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, value) if op == dist.ReduceOp.MAX else total + value
    if dims is not None and dims.pp > 1:
        dist.all_reduce(total, op=op, group=dims.pp_mesh.get_group())
    return total if norm_type == float("inf") else total ** (1.0 / norm_type)


def _counts_here(param: torch.Tensor, dims: ParallelDims | None) -> bool:
    """Whether this rank's copy of ``param`` is the one counted in a sum over all ranks: a copy replicated over a mesh
    dim counts at coordinate 0 of that dim only; a plain tensor of a tensor-parallel model is replicated over tp."""
    if isinstance(param, DTensor):
        coordinate = param.device_mesh.get_coordinate()
        return all(c == 0 for c, p in zip(coordinate, param.placements, strict=True) if isinstance(p, Replicate))
    return dims is None or dims.tp_rank == 0 or _plain_tp_shard(param)


def partitioned_grad_norm(
    owned: list[tuple[torch.Tensor, torch.Tensor]],
    norm_type: float = 2.0,
    group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None = None,
    *,
    dims: ParallelDims | None,
) -> torch.Tensor:
    """The global grad norm when the dp ranks hold disjoint parts of the parameters (ZeRO-1 owners).

    ``owned`` pairs each parameter this rank owns with its reduced local grad. Ranks own different sets, so grouping
    grads by placement (as :func:`total_grad_norm` does) would issue different collectives on different ranks;
    instead each rank adds up what it alone counts (see :func:`_counts_here`) and one scalar all-reduce over every
    rank of ``group`` (default: the world, i.e. the whole dp x pp x tp mesh) sums the shares. ``group`` may also be a
    sequence of groups, reduced over one after the other (tp, then pp, then a ZeRO-1 group, say): together they must
    span the ranks whose shares make up the norm."""
    norm_type = float(norm_type)
    device = _device(dims)
    counted = [grad for param, grad in owned if _counts_here(param, dims) and not getattr(param, _SHARED_COPY, False)]
    value = _local_power(counted, norm_type).to(device)
    is_max = norm_type == float("inf")
    for each in group if isinstance(group, Sequence) else [group]:
        dist.all_reduce(value, op=dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM, group=each)
    return value if is_max else value ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *, dims: ParallelDims | None
) -> torch.Tensor:
    """Scale all grads so that their global norm is at most ``max_norm``; returns the norm before clipping.
    ``dims``: the model's mesh (``model.dims``), or ``None`` for a plain model (see :func:`total_grad_norm`)."""
    params = [p for p in parameters if p.grad is not None]
    norm = total_grad_norm(params, norm_type, dims=dims)
    scale_to_max_norm([local_tensor(p.grad) for p in params], norm, max_norm)
    return norm


def scale_to_max_norm(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale local ``grads`` in place by ``max_norm / norm`` when that is below 1 (torch's clipping coefficient)."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
