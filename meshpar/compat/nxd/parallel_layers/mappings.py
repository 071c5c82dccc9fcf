"""``neuronx_distributed.parallel_layers.mappings``: NxD's differentiable region functions with NxD's signatures
(an optional ``process_group``, the tp group by default; the sequence functions' ``sequence_dimension``, 0 by
default as in NxD), on meshpar's tp collectives (:mod:`meshpar.tensor_parallel._collectives`).

Expert-parallel regions swap which dim is split over the expert-parallel group with one all-to-all each way (NxD's
``[e, c, h]`` expert slots in, ``[e / ep, ep, c, h]`` out: this rank's experts' slots from every ep rank), the identity
without expert parallelism. NxD's ``scatter_gather`` option only thins the traffic of the same exchange (tp ranks
each send a 1/tp slice of identical rows and gather them back); here every tp rank sends its rows, to the same
result. NxD's SPMD-rank scatters (inference tracing with a rank tensor) are not provided.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from meshpar._compat import DeviceMesh
from meshpar._compat import is_registered_process_group as is_registered_group
from meshpar.expert_parallel import all_to_all
from meshpar.parallel_dims import get_parallel
from meshpar.tensor_parallel._collectives import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)


def traced_as_call(func: Callable[..., Any]) -> Callable[..., Any]:
    """Under torch.fx tracing, ``func`` becomes one call in the graph instead of being traced into (its collectives
    and checks cannot be traced): NxD's tracer autowraps its parallel functions only when a model calls them by
    their module-level names; this also covers a model that imports them inside ``forward``."""

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        proxy = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.fx.Proxy)), None)
        if proxy is not None:
            return proxy.tracer.create_proxy("call_function", wrapped, args, kwargs)
        return func(*args, **kwargs)

    return wrapped


def group_mesh(process_group: dist.ProcessGroup | None) -> DeviceMesh:
    """The 1-D mesh of ``process_group``: the parallel state's tp mesh for ``None`` or the tp group itself, a mesh
    over any other group (one of the parallel state's, or the caller's own)."""
    dims = get_parallel()
    if process_group is None or process_group == dims.tp_mesh.get_group():
        return dims.tp_mesh
    for name in ("pp", "dp", "cp", "ep"):
        mesh = getattr(dims, f"{name}_mesh")
        if mesh is not None and process_group == mesh.get_group():
            return mesh
    if not is_registered_group(process_group):
        raise TypeError(
            f"{process_group!r} is not a process group torch.distributed made (new_group / the parallel state's "
            "groups): the collectives cannot run over it"
        )
    return DeviceMesh.from_group(process_group, dims.device.type)


def nonzero_partition_dim_swap(func: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """NxD's decorator: ``func`` works on dim 0; the wrapper moves ``partition_dim`` there and back."""

    @functools.wraps(func)
    def wrapped(x: torch.Tensor, partition_dim: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        moved = x.transpose(0, partition_dim) if partition_dim != 0 else x
        out = func(moved, 0, *args, **kwargs)
        return out.transpose(0, partition_dim) if partition_dim != 0 else out

    return wrapped


@traced_as_call
def copy_to_tensor_model_parallel_region(
    input_: torch.Tensor, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: identity; backward: the grads summed over the group."""
    return copy_to_tp(input_, group_mesh(process_group))


@traced_as_call
def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: summed over the group; backward: identity."""
    return reduce_from_tp(input_, group_mesh(process_group))


def reduce_from_context_model_parallel_region(
    input_: torch.Tensor, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: summed over ``process_group`` (NxD's callers pass the context-parallel group; without one NxD's
    default is the tensor-parallel group, and so it is here); backward: identity."""
    return reduce_from_tp(input_, group_mesh(process_group))


@traced_as_call
def scatter_to_tensor_model_parallel_region(
    input_: torch.Tensor, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: this rank's slice of the last dim; backward: all-gathered along it."""
    return scatter_to_tp(input_, group_mesh(process_group), dim=-1)


def scatter_input_channels_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward: this tp rank's slice of the channels (dim 1, ``[n, c, h, w]``); backward: all-gathered along it."""
    return scatter_to_tp(input_, group_mesh(None), dim=1)


@traced_as_call
def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: all-gathered along the last dim; backward: this rank's slice."""
    return gather_from_tp(input_, group_mesh(process_group), dim=-1)


def scatter_to_sequence_parallel_region(
    input_: torch.Tensor, sequence_dimension: int = 0, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: this rank's slice of the sequence; backward: all-gathered along it."""
    return scatter_to_tp(input_, group_mesh(process_group), dim=sequence_dimension)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    sequence_dimension: int = 0,
    to_model_parallel: bool = True,
    process_group: dist.ProcessGroup | None = None,
    tile_cc: bool = False,
) -> torch.Tensor:
    """Forward: the sequence all-gathered. Backward: reduce-scattered (the gathered tensor fed a tensor-parallel
    region, so each rank's grad is partial) or, with ``to_model_parallel=False``, this rank's slice."""
    mesh = group_mesh(process_group)
    if to_model_parallel:
        return gather_from_sp(input_, mesh, dim=sequence_dimension)
    return gather_from_tp(input_, mesh, dim=sequence_dimension)


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    sequence_dimension: int = 0,
    process_group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Forward: summed over the group, this rank's sequence slice kept (in ``dtype`` when given: NxD reduces in a
    wider dtype and returns the input's); backward: all-gathered along it."""
    original = input_.dtype
    out = reduce_scatter_to_sp(input_, group_mesh(process_group), dim=sequence_dimension)
    return out.to(dtype if dtype is not None else original)


def reduce_scatter_to_tensor_model_parallel_region_with_dim(
    input_: torch.Tensor, partition_dim: int, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    return reduce_scatter_to_sp(input_, group_mesh(process_group), dim=partition_dim)


def gather_from_tensor_model_parallel_region_with_dim(
    input_: torch.Tensor, gather_dim: int, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: all-gathered along ``gather_dim``; backward: this rank's slice."""
    return gather_from_tp(input_, group_mesh(process_group), dim=gather_dim)


def swap_split_over_ep(
    x: torch.Tensor, split_dim: int, concat_dim: int, ep_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """``x`` cut into ep equal parts along ``split_dim``, part ``j`` sent to ep rank ``j``; the parts received,
    in ep-rank order, concatenated along ``concat_dim`` (every ep rank's ``x`` has the same shape). Differentiable:
    the grads go back by the inverse exchange. ``ep_mesh``: the parallel state's ep group unless given."""
    ep_mesh = ep_mesh if ep_mesh is not None else get_parallel().ep_mesh
    if ep_mesh is None:
        return x
    ep = ep_mesh.size()
    if x.shape[split_dim] % ep != 0:
        raise ValueError(f"dim {split_dim} of {tuple(x.shape)} does not divide over the {ep} expert-parallel ranks")
    parts = torch.stack(x.chunk(ep, dim=split_dim))
    rows = parts.shape[1]
    received = all_to_all(parts.reshape(ep * rows, *parts.shape[2:]), [rows] * ep, [rows] * ep, ep_mesh)
    return torch.cat(received.view_as(parts).unbind(0), dim=concat_dim)


def enter_expert_parallel_region(x: torch.Tensor, scatter_gather: bool) -> torch.Tensor:
    """``[e, c, h]`` expert slots (expert ``i``'s ``c`` rows at ``x[i]``) -> ``[e / ep, ep, c, h]``: this rank's
    experts' slots from each ep rank (``[e, 1, c, h]`` without expert parallelism). ``scatter_gather``: see the
    module docstring."""
    e, c, h = x.shape
    return swap_split_over_ep(x.view(e, 1, c, h), 0, 1)


def exit_expert_parallel_region(x: torch.Tensor, scatter_gather: bool) -> torch.Tensor:
    """The inverse of :func:`enter_expert_parallel_region`: ``[e / ep, ep, c, h]`` -> ``[e, c, h]``, each ep rank's
    slots back to it."""
    return swap_split_over_ep(x, 1, 0).squeeze(1)


__all__ = [
    "copy_to_tensor_model_parallel_region",
    "enter_expert_parallel_region",
    "exit_expert_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region_with_dim",
    "group_mesh",
    "nonzero_partition_dim_swap",
    "reduce_from_context_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "reduce_scatter_to_tensor_model_parallel_region_with_dim",
    "scatter_input_channels_to_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]
