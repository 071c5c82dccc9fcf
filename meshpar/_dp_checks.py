"""Checks that every dp rank can pair its collectives with the others', run once when a dp-reducing object is built,
so that a misconfigured model fails with a clear error instead of hanging inside a collective."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from meshpar._compat import DTensor


def is_dp_sharded(param: torch.Tensor) -> bool:
    """Sharded over the ``dp`` mesh dim, or an expert weight over ``edp`` (FSDP2), which reduce-scatters its own
    grads."""
    names = (param.device_mesh.mesh_dim_names or ()) if isinstance(param, DTensor) else ()
    return "dp" in names or "edp" in names


def is_expert_parallel(param: torch.Tensor) -> bool:
    """Sharded over an ``ep`` dim (an expert weight under expert parallelism): dp ranks hold different experts, and
    its grads are reduced over the expert-data-parallel group only. A DTensor says so by its mesh, a plain local
    shard by NxD's ``expert_model_parallel`` attribute."""
    if isinstance(param, DTensor):
        return "ep" in (param.device_mesh.mesh_dim_names or ())
    return bool(getattr(param, "expert_model_parallel", False))


def holds_different_experts(param: torch.Tensor, expert_parallel: bool) -> bool:
    """Whether dp ranks hold different experts under ``param``'s name: a DTensor over an ``ep`` dim, or a plain
    weight NxD marks ``expert_model_parallel`` where expert parallelism is on. NxD marks its experts whatever the ep
    size; without ep every dp rank holds them alike, as dense weights."""
    return is_expert_parallel(param) and (isinstance(param, DTensor) or expert_parallel)


def refuse_dp_sharded(parameters: Iterable[torch.Tensor], who: str) -> None:
    """Raise if a parameter is already sharded over the ``dp`` mesh dim (FSDP2 reduce-scatters its own grads)."""
    for param in parameters:
        if is_dp_sharded(param):
            raise ValueError(
                f"{who} got parameters sharded over the 'dp' mesh dim (FSDP2?): fully_shard reduce-scatters its own "
                f"grads and shards its optimizer state; use {who} only for replicated-over-dp parameters"
            )


def check_same_across_dp(
    layout: list, group: dist.ProcessGroup, size: int, summary: Callable[[list], str], what: str
) -> None:
    """Compare ``layout`` over the dp group and raise on every rank, with each rank's ``summary``, if they differ."""
    layouts: list = [None] * size
    dist.all_gather_object(layouts, layout, group=group)
    if any(other != layouts[0] for other in layouts):
        ranks = "; ".join(f"dp rank {r}: {summary(lay)}" for r, lay in enumerate(layouts))
        raise ValueError(f"dp ranks hold different parameters, so {what} differ ({ranks})")
