"""apex.transformer's pipeline API on meshpar's executor: ``get_forward_backward_func``, its three schedules,
``build_model`` and the microbatch helpers, with apex's contract.

Each schedule is ``fn(forward_step_func, batch, model, *, forward_only, tensor_shape=None, dtype=None,
grad_scaler=None, disable_autocast=False, deallocate_pipeline_outputs=False, sequence_parallel_enabled=False,
num_microbatches=None)``:

- ``batch`` is apex's: a list/tuple of tensors (the whole minibatch) whose microbatch ``k`` is every tensor's rows
  ``[k * mbs, (k + 1) * mbs)``; anything else (``None`` off the first stage, a data iterator the step function
  draws from, a dict) is handed unchanged to every ``forward_step_func(batch, model)`` call. A dict of tensors is
  split along dim 0 like a list.
- The number of microbatches is ``num_microbatches`` if given, else apex's ``get_num_microbatches()`` (see
  :func:`setup_microbatch_calculator`).
- ``forward_step_func(microbatch, model) -> (output, loss_func)``; on the last stage ``loss_func(output)`` returns
  ``(loss, loss_reduced)`` (or just the loss); each loss is divided by the number of microbatches, scaled by
  ``grad_scaler.scale`` if one is given, and backpropagated. The schedule returns the ``loss_reduced`` values (the
  losses where ``loss_func`` returns only a loss) on the last pipeline stage, ``[]`` elsewhere.
- ``dtype`` half or bfloat16 runs forward and loss under autocast unless ``disable_autocast``.
- ``tensor_shape`` is checked against the shape activations really have (each stage's first of the step travels
  with its shape, the receiver checks it; the sender refuses a later one of another shape); with
  ``sequence_parallel_enabled`` its first (sequence) dim is divided by tp, as apex does. ``None`` accepts any shape,
  a different one for every microbatch too (each activation then carries its shape).
- ``model`` is a module, or a list of this rank's chunks (one per virtual stage for the interleaved schedule).
  Chunks wrapped by :func:`build_model` (``wrap_with_ddp``) average their grads over dp after the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar import parallel_state
from meshpar.data_parallel import DataParallelGrads
from meshpar.grad_sync import OverlappedGradSync
from meshpar.parallel_dims import ParallelDims, check_virtual_pipeline_size, get_parallel
from meshpar.pipeline.executor import ForwardStep, run_schedule
from meshpar.pipeline.microbatches import NumMicroBatchesCalculator, build_num_microbatches_calculator
from meshpar.replicas import make_replicas_equal

# apex keywords meshpar accepts although they change nothing here (communication tuning of apex's p2p)
_NO_EFFECT = {"async_comm", "sync_batch_comm", "batch_p2p_comm"}


# -- microbatches -------------------------------------------------------------------------------------------------
def setup_microbatch_calculator(
    rank: int,
    rampup_batch_size: Sequence[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> None:
    """apex's ``setup_microbatch_calculator``: a constant count, or Megatron's batch-size ramp-up
    (``rampup_batch_size=[start, increment, samples]``, moved on by :func:`update_num_microbatches`)."""
    get_parallel().microbatch_calculator = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size
    )


def _calculator() -> NumMicroBatchesCalculator:
    calculator = get_parallel().microbatch_calculator
    if calculator is None:
        raise RuntimeError(
            "no microbatch calculator: call setup_microbatch_calculator(rank, None, global_batch_size, "
            "micro_batch_size, data_parallel_size) first, or pass num_microbatches= to the schedule"
        )
    return calculator


def get_num_microbatches() -> int:
    return _calculator().get()


def get_micro_batch_size() -> int:
    return _calculator().micro_batch_size


def get_current_global_batch_size() -> int:
    return _calculator().get_current_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True) -> None:
    """apex: move a ramp-up on to ``consumed_samples`` (a constant count stays)."""
    _calculator().update(consumed_samples, consistency_check)


def get_kth_microbatch(batch: Any, k: int, micro_batch_size: int | None = None) -> Any:
    """apex: rows ``[k * mbs, (k + 1) * mbs)`` of every tensor of a list/tuple (or dict) batch; anything else as
    it is."""
    if batch is None or not isinstance(batch, (list, tuple, dict)):
        return batch
    mbs = micro_batch_size if micro_batch_size is not None else get_micro_batch_size()
    start, end = k * mbs, (k + 1) * mbs
    if isinstance(batch, dict):
        return {name: x[start:end] if torch.is_tensor(x) else x for name, x in batch.items()}
    return [x[start:end] if torch.is_tensor(x) else x for x in batch]


def split_batch(batch: Any, num_microbatches: int | None) -> list[Any]:
    """apex's microbatches of ``batch`` (see the module docstring); ``num_microbatches=None``: apex's calculator."""
    m = num_microbatches if num_microbatches is not None else get_num_microbatches()
    if batch is None or not isinstance(batch, (list, tuple, dict)):
        return [batch] * m
    values = list(batch.values() if isinstance(batch, dict) else batch)
    odd = sorted({type(x).__name__ for x in values if x is not None and not torch.is_tensor(x)})
    if odd and not isinstance(batch, dict):
        raise TypeError(
            f"apex's batch is the minibatch as a list/tuple of tensors (split into microbatches by the schedule), "
            f"but it holds {odd}; pass per-microbatch data through an iterator or another object the "
            "forward_step_func reads from"
        )
    sizes = {x.shape[0] for x in values if torch.is_tensor(x)}
    if len(sizes) > 1:
        raise ValueError(f"the tensors of the batch have different sizes along dim 0: {sorted(sizes)}")
    size = sizes.pop() if sizes else 0
    if 0 < size < m:
        raise ValueError(
            f"the batch has {size} row(s), fewer than num_microbatches={m}: every microbatch needs at least one; "
            f"pass at least {m} rows (per data-parallel rank) or lower num_microbatches"
        )
    if size % m != 0:
        raise ValueError(f"batch size {size} is not divisible into {m} microbatches")
    mbs = size // m
    calculator = _calculator() if num_microbatches is None else None  # apex's sizes, only where they chose m
    if calculator is not None and calculator.micro_batch_size != mbs:
        raise ValueError(
            f"the batch holds {size} rows, but the microbatch calculator expects {m} microbatches of "
            f"micro_batch_size={calculator.micro_batch_size} ({m * calculator.micro_batch_size} rows)"
        )
    return [get_kth_microbatch(batch, k, mbs) for k in range(m)]


def average_losses_across_data_parallel_group(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """apex: the given scalar losses, each averaged over the data-parallel group (one all-reduce)."""
    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])
    dims = get_parallel()
    if dims.dp > 1:
        dist.all_reduce(averaged, group=dims.dp_mesh.get_group())
    return averaged / dims.dp


# -- model ------------------------------------------------------------------------------------------------------
class DataParallelChunk(nn.Module):
    """What ``build_model(wrap_with_ddp=True)`` returns per chunk: the chunk, whose grads the schedules average over
    dp (all-reduced in buckets during the chunk's last backward of the step)."""

    def __init__(self, module: nn.Module, dims: ParallelDims) -> None:
        super().__init__()
        self.module = module
        self.data_parallel = DataParallelGrads("overlapped", dims.dp_mesh, [module])

    @property
    def grad_sync(self) -> OverlappedGradSync | None:
        """The chunk's bucketed dp all-reduce (``None`` with dp == 1: nothing to average)."""
        return self.data_parallel.syncs[0] if self.data_parallel.syncs else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.module.set_input_tensor(tensor)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backwards inside only accumulate grads (apex's DDP ``no_sync``)."""
        return self.data_parallel.no_sync()


def build_model(
    model_provider_func: Callable[..., nn.Module],
    wrap_with_ddp: bool = True,
    virtual_pipeline_model_parallel_size: int | None = None,
    *args: Any,
    model_type: str = "encoder_or_decoder",
    **kwargs: Any,
) -> list[nn.Module]:
    """apex's ``build_model``: one ``model_provider_func(*args, pre_process=, post_process=, **kwargs)`` per virtual
    stage of this rank (``pre_process`` on the first stage, ``post_process`` on the last), moved to this rank's
    device and, with ``wrap_with_ddp``, made data parallel (every dp replica takes dp rank 0's values, as DDP does).
    Returns the list of chunks."""
    if str(model_type).rsplit(".", 1)[-1] != "encoder_or_decoder":
        raise NotImplementedError(f"build_model: model_type={model_type!r}; meshpar supports encoder_or_decoder")
    dims = get_parallel()
    vpp = virtual_pipeline_model_parallel_size or 1
    if vpp != (dims.virtual_pipeline_size or 1):
        raise ValueError(
            f"build_model: virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}, but the "
            f"parallel state was initialised with {dims.virtual_pipeline_size}"
        )
    chunks = []
    for index in range(vpp):
        if vpp > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(index)
        chunk = model_provider_func(
            *args,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            **kwargs,
        )
        chunks.append(chunk.to(dims.device))
    if vpp > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    if wrap_with_ddp and dims.dp > 1:
        for chunk in chunks:  # as torch's DDP does at construction: dp rank 0's values on every replica
            make_replicas_equal(chunk, dims, over=("dp",))
        chunks = [DataParallelChunk(chunk, dims) for chunk in chunks]
    return chunks


# -- schedules ----------------------------------------------------------------------------------------------------
def _chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


@dataclass
class _StepOptions:
    """The keywords every schedule takes, checked once."""

    forward_only: bool
    tensor_shape: Sequence[int] | None = None
    dtype: torch.dtype | None = None
    grad_scaler: Any = None
    disable_autocast: bool = False
    deallocate_pipeline_outputs: bool = False
    sequence_parallel_enabled: bool = False
    num_microbatches: int | None = None
    custom_sync_context_handler: Callable[[], contextlib.AbstractContextManager] | None = None

    def forward_context(self, dims: ParallelDims) -> Callable[[], contextlib.AbstractContextManager]:
        if self.disable_autocast or self.dtype not in (torch.float16, torch.bfloat16):
            return contextlib.nullcontext
        return lambda: torch.autocast(dims.device.type, dtype=self.dtype)

    def received_shape(self, dims: ParallelDims) -> tuple[int, ...] | None:
        if self.tensor_shape is None:
            return None
        shape = list(self.tensor_shape)
        if self.sequence_parallel_enabled:  # apex: activations between stages are sequence shards [s/tp, b, h]
            if shape[0] % dims.tp != 0:
                raise ValueError(f"tensor_shape[0]={shape[0]} (the sequence) is not divisible by tp={dims.tp}")
            shape[0] //= dims.tp
        return tuple(shape)


def _options(forward_only: bool, kwargs: dict[str, Any]) -> _StepOptions:
    for name in ("decoder_sequence_length",):
        if kwargs.pop(name, None) is not None:
            raise NotImplementedError(f"{name}: encoder-decoder pipelines are not supported by meshpar")
    for name in _NO_EFFECT:
        kwargs.pop(name, None)
    try:
        return _StepOptions(forward_only=forward_only, **kwargs)
    except TypeError as error:
        raise TypeError(f"pipeline schedule: unknown keyword argument(s) {sorted(kwargs)}: {error}") from None


def _results(losses: list[torch.Tensor], reported: dict[int, Any]) -> list[Any]:
    """apex returns what ``loss_func`` reported next to the loss (its ``loss_reduced`` dicts)."""
    if reported and all(value is not None for value in reported.values()):
        return [reported[i] for i in sorted(reported)]
    return losses


def _grad_syncs(chunks: Sequence[nn.Module]) -> list[OverlappedGradSync] | None:
    syncs = [getattr(chunk, "grad_sync", None) for chunk in chunks]
    if all(s is None for s in syncs):
        return None
    if any(s is None for s in syncs):
        raise ValueError("either every model chunk is wrapped for data parallelism (build_model) or none")
    return syncs


def forward_backward_no_pipelining(
    forward_step_func: ForwardStep,
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
    options = _options(forward_only, kwargs)
    chunks = _chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"forward_backward_no_pipelining takes one model, got {len(chunks)} chunks")
    (chunk,) = chunks
    dims = get_parallel()
    microbatches = split_batch(batch, options.num_microbatches)
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


def _pipelined(
    forward_step_func: ForwardStep, batch: Any, model: nn.Module | Sequence[nn.Module], options: _StepOptions
) -> list[Any]:
    dims = get_parallel()
    chunks = _chunks(model)
    if len(chunks) != (dims.virtual_pipeline_size or 1):
        raise ValueError(
            f"{len(chunks)} model chunks on this rank, but the parallel state was initialised with "
            f"virtual_pipeline_model_parallel_size={dims.virtual_pipeline_size}: pass one chunk per virtual stage "
            "(the stage getters of parallel_state count chunks by it)"
        )
    if options.custom_sync_context_handler is not None:
        raise NotImplementedError(
            "custom_sync_context_handler: meshpar's pipelined schedules reduce the dp grads of "
            "build_model(wrap_with_ddp=True) chunks themselves (all-reduces started in each chunk's last backward) "
            "and take no other sync context; it is honoured by forward_backward_no_pipelining (pp = 1)"
        )
    microbatches = split_batch(batch, options.num_microbatches)
    syncs = _grad_syncs(chunks)
    executor = run_schedule(
        dims,
        chunks,
        microbatches,
        forward_step_func,
        options.forward_only,
        tensor_shape=options.received_shape(dims),
        deallocate_pipeline_outputs=options.deallocate_pipeline_outputs,
        loss_scale=1.0 / len(microbatches),
        set_virtual_rank=parallel_state.set_virtual_pipeline_model_parallel_rank if len(chunks) > 1 else None,
        forward_context=options.forward_context(dims),
        scale_loss=options.grad_scaler.scale if options.grad_scaler is not None else None,
        grad_syncs=syncs,
    )
    if syncs and not options.forward_only:
        for sync in syncs:
            sync.finish()
    return _results(executor.losses, executor.reported)


def forward_backward_pipelining_without_interleaving(
    forward_step_func: ForwardStep, batch: Any, model: nn.Module | Sequence[nn.Module], *, forward_only: bool, **kwargs
) -> list[Any]:
    """1F1B: ``pp - rank - 1`` warm-up forwards, then one forward one backward, then the cool-down backwards."""
    if len(_chunks(model)) != 1:
        raise ValueError("the non-interleaved schedule takes one model chunk per rank")
    return _pipelined(forward_step_func, batch, model, _options(forward_only, kwargs))


def forward_backward_pipelining_with_interleaving(
    forward_step_func: ForwardStep, batch: Any, model: nn.Module | Sequence[nn.Module], *, forward_only: bool, **kwargs
) -> list[Any]:
    """Interleaved 1F1B over this rank's chunks; any ``num_microbatches >= pp`` (not only multiples of pp)."""
    return _pipelined(forward_step_func, batch, model, _options(forward_only, kwargs))


def get_forward_backward_func(
    virtual_pipeline_model_parallel_size: int | None = None, pipeline_model_parallel_size: int | None = None
) -> Callable[..., list[Any]]:
    """apex's dispatcher: no pipelining for pp=1, interleaving when a virtual size > 1 is given."""
    pp = pipeline_model_parallel_size if pipeline_model_parallel_size is not None else get_parallel().pp
    if pp == 1:
        check_virtual_pipeline_size(pp, virtual_pipeline_model_parallel_size)
        return forward_backward_no_pipelining
    if virtual_pipeline_model_parallel_size not in (None, 1):
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
