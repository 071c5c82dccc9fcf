"""``apex.transformer.pipeline_parallel.schedules``: ``get_forward_backward_func`` picks one of apex's three schedules,
each a module of this package run on meshpar's executor (:mod:`.common` holds the contract they share)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshpar.compat.apex import parallel_state
from meshpar.compat.apex.pipeline_parallel.schedules.fwd_bwd_no_pipelining import forward_backward_no_pipelining
from meshpar.compat.apex.pipeline_parallel.schedules.fwd_bwd_pipelining_with_interleaving import (
    _forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_with_interleaving,
)
from meshpar.compat.apex.pipeline_parallel.schedules.fwd_bwd_pipelining_without_interleaving import (
    forward_backward_pipelining_without_interleaving,
)
from meshpar.compat.apex.pipeline_parallel.utils import get_num_microbatches
from meshpar.parallel_dims import check_virtual_pipeline_size

__all__ = [
    "_forward_backward_pipelining_with_interleaving",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
    "get_num_microbatches",
]


class ExperimentalWarning(Warning):
    """apex's warning category for experimental code paths."""


def get_forward_backward_func(
    virtual_pipeline_model_parallel_size: int | None = None, pipeline_model_parallel_size: int | None = None
) -> Callable[..., list[Any]]:
    """apex's dispatcher: no pipelining for pp=1, interleaving when a virtual size > 1 is given."""
    pp = (
        pipeline_model_parallel_size
        if pipeline_model_parallel_size is not None
        else parallel_state.get_pipeline_model_parallel_world_size()
    )
    if pp == 1:
        check_virtual_pipeline_size(pp, virtual_pipeline_model_parallel_size)
        return forward_backward_no_pipelining
    if virtual_pipeline_model_parallel_size not in (None, 1):
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
