"""``apex.transformer.pipeline_parallel.schedules.fwd_bwd_no_pipelining``: gradient accumulation on one stage."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from meshpar.compat.apex.pipeline_parallel.schedules.common import (
    FwdStepFunc,
    _chunks,
    _grad_syncs,
    _options,
    _results,
)
from meshpar.compat.apex.pipeline_parallel.utils import _split_batch
from meshpar.parallel_dims import get_parallel

__all__ = ["forward_backward_no_pipelining"]


def forward_backward_no_pipelining(
    forward_step_func: FwdStepFunc,
    batch: Any,
    model: nn.Module | Sequence[nn.Module],
    *,
    forward_only: bool,
    **kwargs: Any,
) -> list[Any]:
    """Gradient accumulation over the microbatches on one stage; grads are those of the mean loss.

    This is apex's plain loop, not a pipeline schedule: every microbatch but the last runs its forward *and* backward
    inside the sync context (``custom_sync_context_handler``, else the model's ``no_sync``), the last one outside it.
    A DDP-style context acts at forward time (torch DDP's ``no_sync`` decides in forward whether backward reduces),
    which the pipeline runtime's per-backward contexts cannot express, so pp = 1 keeps its own loop."""
    # apex's plain loop has no grad sync function to call: only the pipelined schedules take one
    options = _options(forward_only, kwargs, "forward_backward_no_pipelining", frozenset({"custom_grad_sync_func"}))
    chunks = _chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"forward_backward_no_pipelining takes one model, got {len(chunks)} chunks")
    (chunk,) = chunks
    dims = get_parallel()
    microbatches = _split_batch(batch, options.num_microbatches)
    syncs = _grad_syncs(chunks)
    no_sync = options.custom_sync_context_handler or getattr(chunk, "no_sync", contextlib.nullcontext)
    losses, reported = [], {}
    for index, microbatch in enumerate(microbatches):
        last = index == len(microbatches) - 1
        with contextlib.nullcontext() if last else no_sync(), torch.set_grad_enabled(not forward_only):
            with options.forward_context(dims)():
                output, loss_func = forward_step_func(microbatch, chunk)
                loss = loss_func(output)
            loss, reported[index] = loss if isinstance(loss, tuple) else (loss, None)
            if not forward_only:
                scaled = loss / len(microbatches)
                (options.grad_scaler.scale(scaled) if options.grad_scaler is not None else scaled).backward()
        losses.append(loss.detach())
    if syncs and not forward_only:
        syncs[0].finish()
    return _results(losses, reported)
