"""``apex.transformer.tensor_parallel.mappings``: apex's region functions, taking one tensor (the tp group is the
current parallel state's), on meshpar's differentiable tp collectives.

Layouts are apex's: the hidden / feature dim is the last, the sequence the first (``[s, b, h]``), so the
sequence-parallel functions split and gather along dim 0 (meshpar's native layers use ``[b, s, h]``). The private
helpers (``_reduce``, ``_split_along_last_dim``, ...) are the plain, non-differentiable collectives apex's tests call.
"""

from __future__ import annotations

import torch

from meshpar._compat import DeviceMesh
from meshpar.parallel_dims import get_parallel
from meshpar.tensor_parallel._collectives import (
    _all_gather,
    _all_reduce,
    _own_chunk,
    _reduce_scatter,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)


def _tp_mesh() -> DeviceMesh:
    return get_parallel().tp_mesh


def _reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum over the tp group (the input itself at tp = 1)."""
    mesh = _tp_mesh()
    return input_ if mesh.size() == 1 else _all_reduce(input_, mesh)


def _split_along_last_dim(input_: torch.Tensor) -> torch.Tensor:
    mesh = _tp_mesh()
    return input_ if mesh.size() == 1 else _own_chunk(input_, mesh, input_.dim() - 1)


def _split_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    mesh = _tp_mesh()
    return input_ if mesh.size() == 1 else _own_chunk(input_, mesh, 0)


def _gather_along_last_dim(input_: torch.Tensor) -> torch.Tensor:
    mesh = _tp_mesh()
    return input_ if mesh.size() == 1 else _all_gather(input_, mesh, -1)


def _gather_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    mesh = _tp_mesh()
    return input_ if mesh.size() == 1 else _all_gather(input_, mesh, 0)


def _reduce_scatter_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    mesh = _tp_mesh()
    return input_ if mesh.size() == 1 else _reduce_scatter(input_, mesh, 0)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward: identity; backward: sum of the grads over tp."""
    return copy_to_tp(input_, _tp_mesh())


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward: sum over tp; backward: identity."""
    return reduce_from_tp(input_, _tp_mesh())


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward: this rank's slice of the last dim; backward: all-gather along it."""
    return scatter_to_tp(input_, _tp_mesh(), dim=-1)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward: all-gather along the last dim; backward: this rank's slice."""
    return gather_from_tp(input_, _tp_mesh(), dim=-1)


def scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward: this rank's slice of the sequence (dim 0); backward: all-gather along it."""
    return scatter_to_tp(input_, _tp_mesh(), dim=0)


def gather_from_sequence_parallel_region(input_: torch.Tensor, to_model_parallel: bool = True) -> torch.Tensor:
    """Forward: all-gather the sequence (dim 0). Backward: reduce-scatter (the gathered tensor fed a tensor-parallel
    region, so each rank's grad is partial) or, with ``to_model_parallel=False``, this rank's slice."""
    mesh = _tp_mesh()
    if to_model_parallel:
        return gather_from_sp(input_, mesh, dim=0)
    return gather_from_tp(input_, mesh, dim=0)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward: sum over tp and keep this rank's sequence slice (dim 0); backward: all-gather along it."""
    return reduce_scatter_to_sp(input_, _tp_mesh(), dim=0)


__all__ = [
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]
