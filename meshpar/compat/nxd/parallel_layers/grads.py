"""``neuronx_distributed.parallel_layers.grads``: NxD's global grad norm and clipping, its data-parallel bucketed
grad all-reduce and the sequence-parallel grad sum.

The norm is meshpar's (:func:`meshpar.grad_clip.total_grad_norm`), which reads NxD's parameter attributes: a grad of
a ``tensor_model_parallel`` parameter is this rank's part (summed over tp), any other plain grad is a copy every tp
rank holds (counted once), DTensor grads are counted by their placements; parameters marked ``shared`` (NxD) or as
a shared pipeline copy (meshpar) are skipped; stage totals are summed over pp. With ``zero1_optimizer`` the grads
are disjoint ZeRO-1 parts and the shares are summed over the world (given ``zero1_optimizer_groups``: over
tp, pp and then those groups, as NxD does).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from meshpar import grad_clip
from meshpar.compat.nxd.parallel_layers.utils import param_is_not_tensor_parallel_duplicate
from meshpar.parallel_dims import get_parallel, is_initialized

# NxD's default bucket size for the data-parallel grad all-reduce (``ALLREDUCE_BUCKET_CAP_MB`` overrides it)
_ALLREDUCE_BUCKET_CAP_MB = 512


def param_is_not_shared(param: torch.Tensor) -> bool:
    return not getattr(param, "shared", False)


def _as_list(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def get_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2,
    zero1_optimizer: bool = False,
    zero1_optimizer_groups: list[list[int]] | None = None,
    force_spmd: bool = True,
) -> torch.Tensor:
    """The norm of all grads as if the model were dense on one device (see the module docstring). ``force_spmd``
    picks how NxD counts a grad every tp rank holds (1/tp on each rank, or all on tp rank 0): the same number."""
    if not zero1_optimizer and zero1_optimizer_groups is not None:
        raise ValueError("zero1_optimizer_groups given with zero1_optimizer=False")
    params = [p for p in _as_list(parameters) if p.grad is not None and param_is_not_shared(p)]
    dims = get_parallel() if is_initialized() else None
    if not zero1_optimizer:
        return grad_clip.total_grad_norm(params, norm_type, dims=dims)
    groups = _zero1_norm_groups(zero1_optimizer_groups) if zero1_optimizer_groups is not None else None
    return grad_clip.partitioned_grad_norm([(p, p.grad) for p in params], norm_type, groups, dims=dims)


def _zero1_norm_groups(zero1_groups: list[list[int]]) -> list[dist.ProcessGroup] | None:
    """The groups a ZeRO-1 norm's shares are summed over given ``zero1_optimizer_groups``: NxD sums them over tp, then
    pp, then those groups. With the groups NxD's optimizer shards over (dp; dp x cp at cp > 1) those three span the
    world, so one world all-reduce (``None``) does it; other groups are reduced over in NxD's order. Expert weights'
    shares under expert parallelism are summed right only over the world, so other groups are refused there."""
    from meshpar.compat.nxd.parallel_layers import parallel_state

    def same(a: list[list[int]], b: list[list[int]]) -> bool:
        return sorted(map(sorted, a)) == sorted(map(sorted, b))

    dims = get_parallel()
    if same(zero1_groups, parallel_state.get_zero1_sharding_groups()) or (
        dims.cp == 1 and same(zero1_groups, parallel_state.get_data_parallel_replica_groups())
    ):
        return None
    if dims.ep > 1:
        raise NotImplementedError(
            "get_grad_norm(zero1_optimizer=True, zero1_optimizer_groups=...) under expert parallelism takes the "
            "data-parallel (ZeRO-1 sharding) groups only: parallel_state.get_zero1_sharding_groups()"
        )
    model_groups = [(dims.tp, dims.tp_mesh), (dims.pp, dims.pp_mesh)]
    return [mesh.get_group() for size, mesh in model_groups if size > 1] + [_my_group(zero1_groups)]


def _my_group(groups: list[list[int]]) -> dist.ProcessGroup:
    """The process group of the listed rank groups that holds this rank: made once for those lists (every rank
    creates every group, as c10d requires) and reused at every later step (see ``xla._group_of``)."""
    from meshpar.compat.nxd import xla

    return xla._group_of(groups)[0]


def clip_grads_with_norm(parameters: Iterable[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale every grad by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    params = _as_list(parameters)
    if not params:
        raise ValueError("clip_grads_with_norm: parameters is empty")
    coefficient = torch.clamp(max_norm / (total_norm + 1.0e-6), max=1.0)
    for param in params:
        if param.grad is not None:
            param.grad.detach().mul_(coefficient.to(param.grad.device, param.grad.dtype))
    return total_norm


def clip_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2,
    zero1_optimizer: bool = False,
    zero1_optimizer_groups: list[list[int]] | None = None,
    force_spmd: bool = True,
) -> torch.Tensor:
    """Clip the grads in place to a global norm of ``max_norm``; returns the norm before clipping."""
    params = _as_list(parameters)
    total = get_grad_norm(params, norm_type, zero1_optimizer, zero1_optimizer_groups, force_spmd)
    clip_grads_with_norm(params, total, max_norm)
    return total


def bucket_allreduce_gradients(grads_list: list[torch.Tensor], reduce_over_ep_group: bool = False) -> None:
    """Reduce ``grads_list`` in place, in buckets of at most ``ALLREDUCE_BUCKET_CAP_MB`` (per dtype, last layer
    first), as NxD does: summed over the expert-data-parallel group and divided by the dp size (all of dp without
    expert parallelism, so the dp mean); or, with ``reduce_over_ep_group``, summed over the expert-parallel group with
    no division, the second half of a dense grad's dp mean under expert parallelism (an expert's grad takes the first
    half only: its ep ranks hold other experts)."""
    dims = get_parallel()
    if reduce_over_ep_group:
        group, size, divide_by = (dims.ep_mesh.get_group() if dims.ep_mesh is not None else None), dims.ep, 1
    else:
        group, size, divide_by = dims.edp_mesh.get_group(), dims.dp // dims.ep, dims.dp
    if size == 1:
        if divide_by != 1:
            for grad in grads_list:
                grad.div_(divide_by)
        return
    cap = int(os.environ.get("ALLREDUCE_BUCKET_CAP_MB", _ALLREDUCE_BUCKET_CAP_MB)) * 1024 * 1024
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads_list:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in reversed(grads):
            nbytes = grad.numel() * grad.element_size()
            if bucket and size + nbytes > cap:
                _reduce_bucket(bucket, group, divide_by)
                bucket, size = [], 0
            bucket.append(grad)
            size += nbytes
        if bucket:
            _reduce_bucket(bucket, group, divide_by)


def _reduce_bucket(bucket: list[torch.Tensor], group: dist.ProcessGroup, divide_by: int = 1) -> None:
    """Sum the tensors of ``bucket`` over ``group`` in place, in one flat all-reduce, then divide by ``divide_by``."""
    flat = torch.cat([grad.reshape(-1) for grad in bucket])
    dist.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    offset = 0
    for grad in bucket:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if isinstance(p, torch.Tensor)]


def allreduce_sequence_parallel_gradients(optimizer: Any) -> None:
    """Sum over tp the grads of the parameters marked ``sequence_parallel_enabled`` (norms and row-parallel biases
    under sequence parallelism, whose grad each tp rank computed from its own part of the sequence)."""
    dims = get_parallel()
    grads = [p.grad for p in _optimizer_params(optimizer)
             if getattr(p, "sequence_parallel_enabled", False) and p.grad is not None]  # fmt: skip
    if dims.tp == 1 or not grads:
        return
    _reduce_bucket(grads, dims.tp_mesh.get_group())


def allreduce_context_parallel_gradients(optimizer: Any) -> None:
    """Average the grads of every parameter of ``optimizer`` (``main_grad`` where a parameter has no ``grad``) over
    the context-parallel group, as NxD does: each cp rank computed them from its piece of every sequence with the
    loss averaged over that piece, so their mean is the grad of the mean of the pieces' losses. Nothing at cp 1.
    For a ZeRO-1 optimizer (also inside NxD's trainer wrapper), whose own reduce-scatter sums over dp x cp, the grads
    are only divided by cp here: the same mean, one collective fewer."""
    dims = get_parallel()
    if dims.cp == 1:
        return
    inner = getattr(optimizer, "optimizer", optimizer)  # the trainer's NxDOptimizer wraps the one that steps
    sums_over_cp = getattr(inner, "reduces_over_context_parallel", False)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in _optimizer_params(optimizer):
        grad = p.grad if p.grad is not None else getattr(p, "main_grad", None)
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        if sums_over_cp:
            for grad in grads:
                grad.div_(dims.cp)
        else:
            _reduce_bucket(grads, dims.cp_mesh.get_group(), dims.cp)


__all__ = [
    "allreduce_context_parallel_gradients",
    "allreduce_sequence_parallel_gradients",
    "bucket_allreduce_gradients",
    "clip_grad_norm",
    "clip_grads_with_norm",
    "get_grad_norm",
    "param_is_not_shared",
    "param_is_not_tensor_parallel_duplicate",
]
