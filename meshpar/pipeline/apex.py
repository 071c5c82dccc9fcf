"""apex.transformer's ``get_forward_backward_func`` and its three schedules, on meshpar's executor.

Each function is ``fn(forward_step_func, batch, model, *, forward_only, tensor_shape=None, dtype=None,
num_microbatches=None, deallocate_pipeline_outputs=False)`` where ``forward_step_func(microbatch, model) -> (output,
loss_func)`` and ``loss_func(output) -> loss`` or ``(loss, anything)``. ``batch`` is a list of microbatches, or a
tensor / dict of tensors split along dim 0 into ``num_microbatches``. ``model`` is a module, or the list of this
rank's chunks for the interleaved schedule. As in apex, each microbatch's loss is scaled by ``1 / num_microbatches``
before backward, so grads are those of the mean loss. Returns the per-microbatch losses on the last pipeline stage
(``[]`` elsewhere). ``tensor_shape=None`` sends shapes along, so microbatches may differ in sequence length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar import parallel_state
from meshpar.parallel_dims import get_parallel
from meshpar.pipeline._p2p import P2P
from meshpar.pipeline.executor import ForwardStep, PipelineExecutor
from meshpar.pipeline.schedule_ir import build_actions


def split_microbatches(batch: Any, num_microbatches: int | None) -> list[Any]:
    if isinstance(batch, (list, tuple)) and num_microbatches is None:
        return list(batch)
    if num_microbatches is None:
        raise ValueError("pass num_microbatches, or the batch as a list of microbatches")
    tensors = batch if isinstance(batch, dict) else {"": batch}
    for name, tensor in tensors.items():
        if tensor.shape[0] % num_microbatches != 0:
            raise ValueError(
                f"batch size {tensor.shape[0]} of {name or 'the batch'} is not divisible into "
                f"{num_microbatches} microbatches"
            )
    chunks = {name: t.chunk(num_microbatches) for name, t in tensors.items()}
    out = [{name: chunks[name][i] for name in tensors} for i in range(num_microbatches)]
    return out if isinstance(batch, dict) else [mb[""] for mb in out]


def _chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _neighbours() -> tuple[int, int]:
    dims = get_parallel()
    group = next(g for g in dims.group_ranks("pp") if dist.get_rank() in g)
    index = group.index(dist.get_rank())
    return group[(index - 1) % len(group)], group[(index + 1) % len(group)]


def forward_backward_no_pipelining(
    forward_step_func: ForwardStep,
    batch: Any,
    model: nn.Module | Sequence[nn.Module],
    *,
    forward_only: bool,
    num_microbatches: int | None = None,
    **_: Any,
) -> list[torch.Tensor]:
    """Gradient accumulation over microbatches on one stage."""
    (chunk,) = _chunks(model)
    microbatches = split_microbatches(batch, num_microbatches)
    losses = []
    for microbatch in microbatches:
        with torch.set_grad_enabled(not forward_only):
            output, loss_func = forward_step_func(microbatch, chunk)
            loss = loss_func(output)
            loss = loss[0] if isinstance(loss, tuple) else loss
            if not forward_only:
                (loss / len(microbatches)).backward()
        losses.append(loss.detach())
    return losses


def _pipelined(
    schedule: str,
    forward_step_func: ForwardStep,
    batch: Any,
    model: nn.Module | Sequence[nn.Module],
    *,
    forward_only: bool,
    tensor_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    num_microbatches: int | None = None,
    deallocate_pipeline_outputs: bool = False,
    **_: Any,
) -> list[torch.Tensor]:
    dims = get_parallel()
    chunks = _chunks(model)
    if schedule == "interleaved_1f1b" and len(chunks) != (dims.virtual_pipeline_size or 1):
        raise ValueError(
            f"{len(chunks)} model chunks on this rank, but the parallel state was initialised with "
            f"virtual_pipeline_model_parallel_size={dims.virtual_pipeline_size}: pass one chunk per virtual stage "
            "(the stage getters of parallel_state count chunks by it)"
        )
    microbatches = split_microbatches(batch, num_microbatches)
    actions = build_actions(schedule, dims.pp, len(chunks), len(microbatches))[dims.pp_rank]
    prev_rank, next_rank = _neighbours()
    vpp = dims.virtual_pipeline_size or 1
    executor = PipelineExecutor(
        chunks=chunks,
        pp_rank=dims.pp_rank,
        pp=dims.pp,
        p2p=P2P(prev_rank, next_rank, dims.device),
        tensor_shape=tuple(tensor_shape) if tensor_shape is not None else None,
        dtype=dtype or torch.float32,
        deallocate_pipeline_outputs=deallocate_pipeline_outputs,
        loss_scale=1.0 / len(microbatches),
        set_virtual_rank=parallel_state.set_virtual_pipeline_model_parallel_rank if vpp > 1 else None,
    )
    return executor.run(actions, microbatches, forward_step_func, forward_only)


def forward_backward_pipelining_without_interleaving(
    forward_step_func: ForwardStep, batch: Any, model: nn.Module | Sequence[nn.Module], **kwargs: Any
) -> list[torch.Tensor]:
    """1F1B: ``pp - rank - 1`` warm-up forwards, then one forward one backward, then the cool-down backwards."""
    if len(_chunks(model)) != 1:
        raise ValueError("the non-interleaved schedule takes one model chunk per rank")
    return _pipelined("1f1b", forward_step_func, batch, model, **kwargs)


def forward_backward_pipelining_with_interleaving(
    forward_step_func: ForwardStep, batch: Any, model: nn.Module | Sequence[nn.Module], **kwargs: Any
) -> list[torch.Tensor]:
    """Interleaved 1F1B over this rank's chunks; any ``num_microbatches >= pp`` (not only multiples of pp)."""
    return _pipelined("interleaved_1f1b", forward_step_func, batch, model, **kwargs)


def get_forward_backward_func(
    virtual_pipeline_model_parallel_size: int | None = None, pipeline_model_parallel_size: int | None = None
) -> Callable[..., list[torch.Tensor]]:
    """apex's dispatcher: no pipelining for pp=1, interleaving when a virtual size > 1 is given."""
    pp = pipeline_model_parallel_size if pipeline_model_parallel_size is not None else get_parallel().pp
    if pp == 1:
        if virtual_pipeline_model_parallel_size not in (None, 1):
            raise ValueError("virtual pipeline parallelism needs pipeline_model_parallel_size > 1")
        return forward_backward_no_pipelining
    if virtual_pipeline_model_parallel_size not in (None, 1):
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
