"""``apex.transformer.pipeline_parallel.schedules.common``: ``build_model`` and what apex's three schedules share,
on meshpar's executor, with apex's contract.

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
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from meshpar._compat import run_backward_unchecked
from meshpar.compat.apex import parallel_state
from meshpar.compat.apex.enums import ModelType
from meshpar.compat.apex.pipeline_parallel.p2p_communication import FutureTensor
from meshpar.compat.apex.pipeline_parallel.utils import _split_batch
from meshpar.data_parallel import DataParallelGrads
from meshpar.grad_sync import OverlappedGradSync
from meshpar.parallel_dims import ParallelDims, get_parallel
from meshpar.pipeline.executor import run_schedule
from meshpar.replicas import make_replicas_equal

# apex's communication tuning keywords: accepted, nothing to tune on meshpar's executor
_TUNING = {"async_comm", "sync_batch_comm", "batch_p2p_comm", "overlap_p2p_comm"}

Batch = torch.Tensor | FutureTensor | list | tuple
LossFunc = Callable[[torch.Tensor], torch.Tensor]
FwdStepFunc = Callable[[Batch | None, nn.Module], tuple[torch.Tensor, LossFunc]]


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


def _is_encoder_or_decoder(model_type: Any) -> bool:
    return str(getattr(model_type, "name", model_type)).rsplit(".", 1)[-1] == "encoder_or_decoder"


def build_model(
    model_provider_func: Callable[..., nn.Module],
    wrap_with_ddp: bool = True,
    virtual_pipeline_model_parallel_size: int | None = None,
    model_type: ModelType = ModelType.encoder_or_decoder,
    *args: Any,
    **kwargs: Any,
) -> list[nn.Module]:
    """apex's ``build_model``: one ``model_provider_func(*args, pre_process=, post_process=, **kwargs)`` per virtual
    stage of this rank (``pre_process`` on the first stage, ``post_process`` on the last), moved to this rank's
    device and, with ``wrap_with_ddp``, wrapped for data parallelism (:class:`DataParallelChunk`, ``.module`` the
    chunk, as apex's DDP wrapper; every dp replica takes dp rank 0's values, as DDP does). Returns the list of
    chunks."""
    if not _is_encoder_or_decoder(model_type):
        raise NotImplementedError(
            f"build_model: model_type={model_type!r}: meshpar's apex view pipelines one-stack models "
            "(ModelType.encoder_or_decoder); encoder-decoder pipelines are not supported yet"
        )
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
    if wrap_with_ddp:
        for chunk in chunks:  # as torch's DDP does at construction: dp rank 0's values on every replica
            make_replicas_equal(chunk, dims, over=("dp",))
        chunks = [DataParallelChunk(chunk, dims) for chunk in chunks]
    return chunks


def _calc_number_of_params(model: Sequence[nn.Module]) -> int:
    """Parameters of this rank's chunks (local shards)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for m in model for p in m.parameters())


def _get_params_for_weight_decay_optimization(
    model: nn.Module | Sequence[nn.Module], *, no_weight_decay_modules: tuple[type, ...] | None = None
) -> tuple[dict[str, list[nn.Parameter]], dict[str, list[nn.Parameter]]]:
    """Megatron's two parameter groups: weights decay; biases and the parameters of normalisation layers
    (``no_weight_decay_modules``, default every LayerNorm / RMSNorm kind) get ``weight_decay=0.0``."""
    from meshpar.compat.apex.layers import FusedLayerNorm

    skip = no_weight_decay_modules or (FusedLayerNorm, nn.LayerNorm, nn.RMSNorm)
    decay: dict[str, Any] = {"params": []}
    no_decay: dict[str, Any] = {"params": [], "weight_decay": 0.0}
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for module in chunk.modules():
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]
            if isinstance(module, skip):
                no_decay["params"].extend(p for _, p in own)
            else:
                decay["params"].extend(p for n, p in own if n != "bias")
                no_decay["params"].extend(p for n, p in own if n == "bias")
    return decay, no_decay


def free_output_tensor(
    output_tensors: torch.Tensor | Sequence[torch.Tensor] | None, deallocate_pipeline_outputs: bool = False
) -> None:
    """Megatron's memory trick: once an output was sent on, keep only its autograd node (its data becomes one
    element). Only with ``deallocate_pipeline_outputs``; the backward then runs through :func:`custom_backward`."""
    if not deallocate_pipeline_outputs or output_tensors is None:
        return
    for tensor in [output_tensors] if torch.is_tensor(output_tensors) else output_tensors:
        if tensor is not None:
            tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Backward from ``output`` whose data may have been freed (:func:`free_output_tensor`): autograd's check of the
    grad's shape against the output's (now one-element) data is skipped."""
    if grad_output is None:
        if output.numel() != 1:
            raise ValueError("custom_backward: a grad_output is needed for a non-scalar output")
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    run_backward_unchecked(output, grad_output)


def forward_step(
    forward_step_func: FwdStepFunc,
    batch: Batch | None,
    model: nn.Module,
    input_tensor: torch.Tensor | list[torch.Tensor] | None,
    losses_reduced: list[Any],
    dtype: torch.dtype,
    disable_autocast: bool = False,
    checkpoint_activations_micro_batch: bool | None = None,
) -> torch.Tensor:
    """One microbatch's forward on one stage: the received activation set as the model's input, the step function
    run (under autocast for half dtypes); on the last stage the loss is computed, its reported value appended to
    ``losses_reduced``, and the loss divided by the number of microbatches returned."""
    from meshpar.compat.apex.pipeline_parallel.utils import get_num_microbatches

    unwrapped = model.module if isinstance(model, DataParallelChunk) else model
    if hasattr(unwrapped, "set_input_tensor"):
        unwrapped.set_input_tensor(input_tensor[0] if isinstance(input_tensor, list) else input_tensor)
    half = dtype in (torch.float16, torch.bfloat16) and not disable_autocast
    device = get_parallel().device.type
    with torch.autocast(device, dtype=dtype) if half else contextlib.nullcontext():
        if checkpoint_activations_micro_batch is None:
            output, loss_func = forward_step_func(batch, model)
        else:
            output, loss_func = forward_step_func(batch, model, checkpoint_activations_micro_batch)
        if parallel_state.is_pipeline_last_stage():
            loss = loss_func(output)
            loss, reported = loss if isinstance(loss, tuple) else (loss, loss)
            output = loss / get_num_microbatches()
            losses_reduced.append(reported)
    return output


def backward_step(
    input_tensor: torch.Tensor | None,
    output_tensor: torch.Tensor,
    output_tensor_grad: torch.Tensor | None,
    model_type: ModelType,
    *,
    grad_scaler: Any = None,
    deallocate_pipeline_outputs: bool = False,
) -> torch.Tensor | None:
    """One microbatch's backward on one stage: from the loss (scaled by ``grad_scaler``) on the last stage, from the
    received output grad elsewhere; returns the grad of the stage's input (``None`` on the first stage)."""
    if not _is_encoder_or_decoder(model_type):
        raise NotImplementedError("backward_step: encoder-decoder pipelines are not supported yet")
    if input_tensor is not None:
        input_tensor.retain_grad()
    if grad_scaler is not None and output_tensor_grad is None:
        output_tensor = grad_scaler.scale(output_tensor)
    if deallocate_pipeline_outputs:
        custom_backward(output_tensor, output_tensor_grad)
    else:
        torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    return input_tensor.grad if input_tensor is not None else None


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
    custom_grad_sync_func: Callable[[], None] | None = None

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


def _options(
    forward_only: bool, kwargs: dict[str, Any], schedule: str, unused: frozenset[str] = frozenset()
) -> _StepOptions:
    """The schedule's keywords: apex's tuning ones accepted as no-ops, ``decoder_sequence_length`` ignored as apex
    ignores it for one-stack models, any other one apex's ``**kwargs`` would have swallowed (``unused``: options
    this schedule swallows although others honour them) accepted with a warning naming it."""
    known = {f.name for f in fields(_StepOptions)} - {"forward_only"} - unused
    kwargs = dict(kwargs)
    kwargs.pop("decoder_sequence_length", None)
    ignored = sorted(name for name in kwargs if name not in known and name not in _TUNING)
    if ignored:
        warnings.warn(
            f"{schedule}: meshpar ignores the keyword argument(s) {ignored} (apex's schedule would have too, or "
            "meshpar's executor has nothing to do with them)",
            stacklevel=3,
        )
    return _StepOptions(forward_only=forward_only, **{k: v for k, v in kwargs.items() if k in known})


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


def _pipelined(
    forward_step_func: FwdStepFunc, batch: Any, model: nn.Module | Sequence[nn.Module], options: _StepOptions
) -> list[Any]:
    dims = get_parallel()
    chunks = _chunks(model)
    if len(chunks) != (dims.virtual_pipeline_size or 1):
        raise ValueError(
            f"{len(chunks)} model chunks on this rank, but the parallel state was initialised with "
            f"virtual_pipeline_model_parallel_size={dims.virtual_pipeline_size}: pass one chunk per virtual stage "
            "(the stage getters of parallel_state count chunks by it)"
        )
    microbatches = _split_batch(batch, options.num_microbatches)
    user = _UserGradSync(options.custom_sync_context_handler, options.custom_grad_sync_func)
    chunk_syncs = _grad_syncs(chunks)
    # a user's sync context takes the dp grad reduction over (Megatron's DDP no_sync with its grad sync function):
    # build_model's own reduction then stays off for the whole step
    syncs = None if user.active else chunk_syncs
    first_rank = dims.pp_rank == 0
    with contextlib.ExitStack() as held:
        for sync in chunk_syncs or () if user.active else ():
            held.enter_context(sync.no_sync())
        user.disable()
        try:
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
                last_backward_context=user.around_last_backward(chunks, dims.pp, first_rank)
                if user.active and not options.forward_only
                else None,
            )
        finally:
            user.enable()  # the other stages reduce in the bubble after the schedule
    if len(chunks) == 1 and not first_rank and options.custom_grad_sync_func is not None and not options.forward_only:
        options.custom_grad_sync_func()
    if syncs and not options.forward_only:
        for sync in syncs:
            sync.finish()
    return _results(executor.losses, executor.reported)


class _UserGradSync:
    """apex's ``custom_sync_context_handler``: a context that disables grad reduction, entered when the step starts
    and left where apex leaves it. 1F1B: before the first stage's last backward, after the schedule elsewhere (where
    ``custom_grad_sync_func()`` then runs). Interleaved: around each chunk's last backward on every rank (left, then
    entered again), and after the schedule; ``custom_grad_sync_func(chunk parameters)`` runs after each chunk's last
    backward (apex staggers that call across ranks; the grads it sees are the same)."""

    def __init__(
        self,
        handler: Callable[[], contextlib.AbstractContextManager] | None,
        grad_sync_func: Callable[..., None] | None = None,
    ) -> None:
        self.handler, self.context, self.grad_sync_func = handler, None, grad_sync_func

    def around_last_backward(
        self, chunks: Sequence[nn.Module], pp: int, first_rank: bool
    ) -> Callable[[int], contextlib.AbstractContextManager]:
        """The executor's context around each chunk's last backward (see the class docstring)."""
        interleaved = len(chunks) > 1

        @contextlib.contextmanager
        def around(stage: int) -> Iterator[None]:
            if not interleaved:
                if first_rank and stage == 0:
                    self.enable()
                yield
                return
            if self.grad_sync_func is None:
                self.enable()
                yield
            else:
                yield
                self.enable()
                self.grad_sync_func(chunks[stage // pp].parameters())
            self.disable()

        return around

    @property
    def active(self) -> bool:
        return self.handler is not None

    def disable(self) -> None:
        if self.handler is not None and self.context is None:
            self.context = self.handler()
            self.context.__enter__()

    def enable(self) -> None:
        if self.context is not None:
            context, self.context = self.context, None
            context.__exit__(None, None, None)
