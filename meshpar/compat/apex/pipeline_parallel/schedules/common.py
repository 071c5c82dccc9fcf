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
- An encoder-decoder (``model.model_type == ModelType.encoder_and_decoder``, as :func:`build_model` sets it) runs
  its encoder on the pipeline ranks before ``pipeline_model_parallel_split_rank`` and its decoder on the rest; every
  decoder stage receives ``[decoder hidden states, encoder output]`` (the split rank: ``[encoder output]``) through
  ``set_input_tensor`` and hands the encoder output on beside its own output, as apex does; ``tensor_shape`` is the
  encoder's ``(seq, micro_batch, hidden)`` and ``decoder_sequence_length`` the decoder's sequence.
- ``set_input_tensor`` gets the received tensor (``None`` on the first stage), or a list where several crossed
  (apex always hands a list; Megatron-style models wrap a lone tensor in one, as apex's own test models do).
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

    def set_input_tensor(self, tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        self.module.set_input_tensor(tensor)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backwards inside only accumulate grads (apex's DDP ``no_sync``)."""
        return self.data_parallel.no_sync()


def _is_encoder_or_decoder(model_type: Any) -> bool:
    return str(getattr(model_type, "name", model_type)).rsplit(".", 1)[-1] == "encoder_or_decoder"


def _split_roles() -> dict[str, bool]:
    """An encoder-decoder's keywords for this pipeline rank's model (apex's rules): the encoder on the ranks before
    the split rank, the decoder from it on; ``pre_process`` where a stack starts, ``post_process`` where one ends."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return {"pre_process": True, "post_process": True, "add_encoder": True, "add_decoder": True}
    split = parallel_state.get_pipeline_model_parallel_split_rank()
    if split is None:
        raise RuntimeError(
            "build_model: an encoder-decoder (ModelType.encoder_and_decoder) pipelined over several ranks needs "
            "pipeline_model_parallel_split_rank_ in initialize_model_parallel: the first rank that runs the decoder"
        )
    rank = parallel_state.get_pipeline_model_parallel_rank()
    last = parallel_state.get_pipeline_model_parallel_world_size() - 1
    return {
        "pre_process": rank in (0, split),
        "post_process": rank in (split - 1, last),
        "add_encoder": parallel_state.is_pipeline_stage_before_split(),
        "add_decoder": parallel_state.is_pipeline_stage_after_split(),
    }


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
    chunks. ``model_type=ModelType.encoder_and_decoder`` (one chunk per rank) also passes ``add_encoder`` /
    ``add_decoder`` and the stacks' ``pre_process`` / ``post_process`` by the split rank (see :func:`_split_roles`);
    the chunk's ``model_type`` is set, which the schedules read."""
    dims = get_parallel()
    vpp = virtual_pipeline_model_parallel_size or 1
    if vpp != (dims.virtual_pipeline_size or 1):
        raise ValueError(
            f"build_model: virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}, but the "
            f"parallel state was initialised with {dims.virtual_pipeline_size}"
        )
    encoder_and_decoder = not _is_encoder_or_decoder(model_type)
    if encoder_and_decoder and vpp > 1:
        raise ValueError(
            "build_model: an encoder-decoder runs one chunk per pipeline rank (apex's interleaved schedule pipelines "
            "one-stack models); pass virtual_pipeline_model_parallel_size=None"
        )
    chunks = []
    for index in range(vpp):
        if vpp > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(index)
        roles = (
            _split_roles()
            if encoder_and_decoder
            else {
                "pre_process": parallel_state.is_pipeline_first_stage(),
                "post_process": parallel_state.is_pipeline_last_stage(),
            }
        )
        chunk = model_provider_func(*args, **{**kwargs, **roles})
        if vpp == 1 or dims.pp == 1:
            chunk.model_type = model_type  # as apex: set outside the interleaved path
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


def _hands_on_encoder_output(model_type: Any) -> bool:
    """apex: a decoder stage of an encoder-decoder hands the encoder output it received on beside its own output."""
    return not _is_encoder_or_decoder(model_type) and parallel_state.is_pipeline_stage_after_split()


def forward_step(
    forward_step_func: FwdStepFunc,
    batch: Batch | None,
    model: nn.Module,
    input_tensor: torch.Tensor | list[torch.Tensor] | None,
    losses_reduced: list[Any],
    dtype: torch.dtype,
    disable_autocast: bool = False,
    checkpoint_activations_micro_batch: bool | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """One microbatch's forward on one stage: the received activation set as the model's input, the step function
    run (under autocast for half dtypes); on the last stage the loss is computed, its reported value appended to
    ``losses_reduced``, and the loss divided by the number of microbatches returned. An encoder-decoder's decoder
    stage returns ``[output, encoder output]`` (the last of ``input_tensor``); a list ``input_tensor`` gives a list
    back, a tensor (or ``None``) the output alone."""
    from meshpar.compat.apex.pipeline_parallel.utils import get_model_type, get_num_microbatches, unwrap_model

    unwrapped = unwrap_model(model)
    inputs = input_tensor if isinstance(input_tensor, list) else [input_tensor]
    inputs = [x.get() if isinstance(x, FutureTensor) else x for x in inputs]
    if hasattr(unwrapped, "set_input_tensor"):
        unwrapped.set_input_tensor(inputs[0] if len(inputs) == 1 else inputs)
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
    if _hands_on_encoder_output(get_model_type(unwrapped)):
        return [output, inputs[-1]]
    return output if not isinstance(input_tensor, list) else [output]


def backward_step(
    input_tensor: torch.Tensor | list[torch.Tensor] | None,
    output_tensor: torch.Tensor | list[torch.Tensor],
    output_tensor_grad: torch.Tensor | list[torch.Tensor] | None,
    model_type: ModelType,
    *,
    grad_scaler: Any = None,
    deallocate_pipeline_outputs: bool = False,
) -> torch.Tensor | list[torch.Tensor | None] | None:
    """One microbatch's backward on one stage: from the loss (scaled by ``grad_scaler``) on the last stage, from the
    received output grad elsewhere; returns the grad of the stage's input (``None`` on the first stage; a list for a
    list ``input_tensor``). On an encoder-decoder's decoder stage the grad of the encoder output it handed on is
    added to the grad of the encoder output it received, as apex does."""
    listed = isinstance(input_tensor, list)
    inputs = [x.get() if isinstance(x, FutureTensor) else x for x in (input_tensor if listed else [input_tensor])]
    for x in inputs:
        if x is not None:
            x.retain_grad()
    outputs = output_tensor if isinstance(output_tensor, list) else [output_tensor]
    grads = output_tensor_grad if isinstance(output_tensor_grad, list) else [output_tensor_grad]
    outputs = [x.get() if isinstance(x, FutureTensor) else x for x in outputs]
    grads = [x.get() if isinstance(x, FutureTensor) else x for x in grads]
    head = outputs[0]
    if grad_scaler is not None and grads[0] is None:
        head = grad_scaler.scale(head)
    if deallocate_pipeline_outputs:
        custom_backward(head, grads[0])
    else:
        torch.autograd.backward(head, grad_tensors=grads[0])
    input_grads = [None if x is None else x.grad for x in inputs]
    if (
        parallel_state.get_pipeline_model_parallel_world_size() > 1
        and _hands_on_encoder_output(model_type)
        and len(grads) > 1
        and grads[1] is not None
    ):
        input_grads[-1] = grads[1] if input_grads[-1] is None else input_grads[-1] + grads[1]
    return input_grads if listed else input_grads[0]


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
    decoder_sequence_length: int | None = None

    def forward_context(self, dims: ParallelDims) -> Callable[[], contextlib.AbstractContextManager]:
        if self.disable_autocast or self.dtype not in (torch.float16, torch.bfloat16):
            return contextlib.nullcontext
        return lambda: torch.autocast(dims.device.type, dtype=self.dtype)

    def expected_shapes(self, model_type: ModelType) -> Callable[[int], list[tuple[int, int, int]]] | None:
        """The shapes each stage receives, by the stage sending them (apex's ``get_tensor_shapes``: the sequence
        divided by tp under sequence parallelism; a decoder stage's ``[decoder, encoder]`` pair); ``None`` without a
        ``tensor_shape``."""
        from meshpar.compat.apex.pipeline_parallel.schedules.fwd_bwd_pipelining_without_interleaving import (
            get_tensor_shapes,
        )

        if self.tensor_shape is None:
            return None
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if self.sequence_parallel_enabled and self.tensor_shape[0] % tp:
            raise ValueError(f"tensor_shape[0]={self.tensor_shape[0]} (the sequence) is not divisible by tp={tp}")
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        shapes = {
            rank: get_tensor_shapes(
                rank,
                model_type,
                tensor_shape=self.tensor_shape,
                decoder_sequence_length=self.decoder_sequence_length,
                sequence_parallel_enabled=self.sequence_parallel_enabled,
            )
            for rank in range(pp)
        }
        return lambda stage: shapes[(stage - 1) % pp]


def _options(
    forward_only: bool, kwargs: dict[str, Any], schedule: str, unused: frozenset[str] = frozenset()
) -> _StepOptions:
    """The schedule's keywords: apex's tuning ones accepted as no-ops, any other one apex's ``**kwargs`` would have
    swallowed (``unused``: options this schedule swallows although others honour them) accepted with a warning naming
    it. ``decoder_sequence_length`` matters to encoder-decoders only, as in apex."""
    known = {f.name for f in fields(_StepOptions)} - {"forward_only"} - unused
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
    from meshpar.compat.apex.pipeline_parallel.utils import get_model_type

    model_type = get_model_type(chunks[0])
    if not _is_encoder_or_decoder(model_type):
        if len(chunks) > 1:
            raise ValueError("apex's interleaved schedule pipelines one-stack models, not an encoder-decoder")
        if dims.pp > 1 and parallel_state.get_pipeline_model_parallel_split_rank() is None:
            raise ValueError(
                "an encoder-decoder (ModelType.encoder_and_decoder) pipeline needs pipeline_model_parallel_split_rank_ "
                "in initialize_model_parallel: the first rank that runs the decoder"
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
                expected_shapes=options.expected_shapes(model_type),
                hands_on_last_input=(lambda stage: parallel_state.is_pipeline_stage_after_split(stage))
                if not _is_encoder_or_decoder(model_type)
                else None,
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
