"""``apex.transformer.pipeline_parallel.schedules.fwd_bwd_pipelining_with_interleaving``: interleaved 1F1B on
meshpar's executor (apex's name has a leading underscore; meshpar exports both spellings)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from meshpar.compat.apex.pipeline_parallel.schedules.common import FwdStepFunc, _options, _pipelined

__all__ = ["_forward_backward_pipelining_with_interleaving", "forward_backward_pipelining_with_interleaving"]


def forward_backward_pipelining_with_interleaving(
    forward_step_func: FwdStepFunc, batch: Any, model: nn.Module | Sequence[nn.Module], *, forward_only: bool, **kwargs
) -> list[Any]:
    """Interleaved 1F1B over this rank's chunks; any ``num_microbatches >= pp`` (not only multiples of pp)."""
    return _pipelined(
        forward_step_func, batch, model, _options(forward_only, kwargs, "forward_backward_pipelining_with_interleaving")
    )


_forward_backward_pipelining_with_interleaving = forward_backward_pipelining_with_interleaving
