"""meshpar's pipeline runtime: runs an action list (see :mod:`.schedule_ir`) with explicit sends/receives.

The one runtime of every entry point (HF ``parallelize``, NxD's ``NxDPPModel``, apex's schedules). Why not torch's
``torch.distributed.pipelining`` runtime: the apex and NxD contracts need what it does not offer: every stage calls
the user's ``forward_step_func(microbatch, model)`` (so the last stage sees labels and masks), non-first stages
receive their input through ``model.set_input_tensor(t)`` (apex), activation shapes may change from one microbatch
to the next (variable sequence lengths, checked against apex's ``tensor_shape``), losses are scaled and reported as
apex returns them, and an error on one rank stops the others (:mod:`meshpar.failure`). torch's runtime stays the
reference: the tests run the same action lists on it (:mod:`meshpar.testing.torch_runtime`) and the benchmarks time
this executor against torch's schedules.

Follow one microbatch: ``F`` receives the input (or reads the batch on stage 0), runs the chunk and sends the output
on; ``B`` receives the output grad (or starts from the loss on the last stage), runs backward and sends the input
grad back. An activation is one tensor, or several (a list or tuple the stage returns, e.g. an encoder-decoder's
decoder hidden states and encoder output); its grad message holds one grad per floating-point tensor. Zero-bubble
schedules split ``B``: ``I`` computes and sends the input grad only, ``W`` later the weight grads
(:mod:`._split_backward`).

Receives are posted ahead of their use, in each neighbour's send order (:mod:`._inbox`). When ``fixed_shapes``
(a declared ``tensor_shape``, or microbatches split from one batch), only each stage's first activation of a step
carries its shape; the sender refuses a later one of another shape. Otherwise every activation brings its shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar._compat import run_backward_unchecked
from meshpar.failure import stop_all_ranks_on_error
from meshpar.parallel_dims import ParallelDims
from meshpar.pipeline._inbox import Inbox
from meshpar.pipeline._p2p import P2P, Meta, PipelineShapeError, message_tag
from meshpar.pipeline._split_backward import DeferredWeightGrads, backward_input
from meshpar.pipeline.schedule_ir import ACCUMULATES_WEIGHT_GRADS, Action, build_actions

if TYPE_CHECKING:
    from meshpar.grad_sync import OverlappedGradSync

# (microbatch, chunk) -> (output, loss function of the last stage's output); a forward-only step may give ``None``
# for the loss function: the last stage then reports no loss (its outputs are what the step is for)
ForwardStep = Callable[[Any, nn.Module], tuple[torch.Tensor, Callable[[torch.Tensor], Any] | None]]


Activation = tuple[torch.Tensor, ...]  # what crosses one cut for one microbatch


def _tensors(value: Any) -> Activation:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _differentiable(tensors: Activation) -> Activation:
    """The tensors of an activation that carry a grad back (floating point)."""
    return tuple(t for t in tensors if t.is_floating_point())


@dataclass
class _Slot:
    input: Activation | None = None
    output: Activation | None = None
    output_meta: tuple[Meta, ...] | None = None  # of the grads this stage receives: its floating outputs'
    loss: torch.Tensor | None = None
    weight_grads: DeferredWeightGrads | None = None  # left by an ``I`` for its ``W``


def _stage_module(chunk: nn.Module) -> nn.Module:
    """The module that takes ``set_input_tensor``: the chunk, or the module a data-parallel wrapper holds (apex
    unwraps DDP the same way)."""
    while not hasattr(chunk, "set_input_tensor") and isinstance(getattr(chunk, "module", None), nn.Module):
        chunk = chunk.module
    return chunk


@dataclass
class PipelineExecutor:
    """Runs one rank's actions over its local chunks (chunk ``k`` is stage ``k * pp + pp_rank``)."""

    chunks: Sequence[nn.Module]
    pp_rank: int
    pp: int
    p2p: P2P
    # the shapes of the tensors each stage receives (a function of the receiving stage), checked on arrival
    expected_shapes: Callable[[int], Sequence[tuple[int, ...]]] | None = None
    # every activation a stage receives in one step has the shape and dtype of its first (implied by tensor_shape)
    fixed_shapes: bool = False
    deallocate_pipeline_outputs: bool = False
    loss_scale: float = 1.0
    set_virtual_rank: Callable[[int], None] | None = None
    # stages that hand the last tensor they received on again beside their own output (an encoder-decoder's decoder
    # stages carry the encoder's output to the next); its grad there accumulates with the stage's own use of it
    hands_on_last_input: Callable[[int], bool] | None = None
    keep_outputs: bool = False  # keep the last stage's outputs (e.g. logits) per microbatch
    # apex: the forward (and loss) under autocast; the last stage's loss scaled (GradScaler.scale) before backward
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None
    # one per chunk: dp all-reduces start during each chunk's last backward, earlier backwards only accumulate
    grad_syncs: Sequence[OverlappedGradSync] | None = None
    # a context around each of this rank's stages' last backward of the step, given the stage index (apex's
    # custom_sync_context_handler re-enables grad reduction there)
    last_backward_context: Callable[[int], contextlib.AbstractContextManager] | None = None
    # called once per step on every rank between its last forward and its first backward (or after the forwards of
    # a forward-only step): a collective over what every microbatch's forward produced, e.g. the routers' assignment
    # counts of the load-balancing loss (meshpar.hf.router_loss); only schedules that run every forward first
    between_forwards_and_backwards: Callable[[], None] | None = None
    slots: dict[tuple[int, int], _Slot] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    # the second value of a loss function returning ``(loss, reported)`` (apex's ``loss_reduced`` dicts)
    reported: dict[int, Any] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)  # the last stage's, set by run
    # shapes and dtypes of the first activation sent to each stage this step
    _sent_meta: dict[int, tuple[Meta, ...]] = field(default_factory=dict)
    _inbox: Inbox | None = None  # this step's receives

    @property
    def num_stages(self) -> int:
        return self.pp * len(self.chunks)

    def _chunk(self, stage: int) -> nn.Module:
        return self.chunks[stage // self.pp]

    def forward(self, action: Action, microbatch: Any, forward_step: ForwardStep, forward_only: bool) -> Any:
        stage, slot = action.stage, _Slot()
        chunk = self._chunk(stage)
        if self.set_virtual_rank is not None:
            self.set_virtual_rank(stage // self.pp)
        if stage > 0:
            slot.input = self._receive_activation(action)
            if not forward_only:
                for tensor in _differentiable(slot.input):
                    tensor.requires_grad_()
        target = _stage_module(chunk)
        if hasattr(target, "set_input_tensor"):
            target.set_input_tensor(self._handed(slot.input))
        elif stage > 0:
            raise TypeError(f"{type(chunk).__name__} needs set_input_tensor(tensor) to run as a non-first stage")
        result = None
        with self.forward_context():
            output, loss_func = forward_step(microbatch, chunk)
            if stage == self.num_stages - 1:
                if self.keep_outputs:
                    self.outputs[action.microbatch] = output.detach() if torch.is_tensor(output) else output
                if loss_func is None and not forward_only:
                    raise ValueError("a training step needs a loss: forward_step gave no loss function")
                loss = loss_func(output) if loss_func is not None else None
        if stage == self.num_stages - 1:
            if loss is not None:  # None: a forward-only step without a loss (its outputs are what it is for)
                loss_value, reported = loss if isinstance(loss, tuple) else (loss, None)
                slot.loss = loss_value * self.loss_scale
                self.reported[action.microbatch] = reported
                result = loss_value.detach()
        else:
            outputs = _tensors(output)
            if slot.input is not None and self.hands_on_last_input is not None and self.hands_on_last_input(stage):
                outputs = (*outputs, slot.input[-1])
            self._send_activation(outputs, action)
            slot.output = outputs
            slot.output_meta = tuple((tuple(t.shape), t.dtype) for t in _differentiable(outputs))
            if self.deallocate_pipeline_outputs and not forward_only:
                # The next stage holds the values; backward needs only the graph (Megatron's trick). Tensors the
                # stage passes on unchanged (its inputs) keep theirs: its own graph may have saved them.
                for tensor in outputs:
                    if tensor.grad_fn is not None:
                        tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)
        if not forward_only:
            self.slots[(stage, action.microbatch)] = slot
        return result

    @staticmethod
    def _handed(received: Activation | None) -> Any:
        """What ``set_input_tensor`` gets: ``None`` on the first stage, the received tensor, or a list of them where
        several crossed (Megatron-style models take either: they wrap a lone tensor in a list)."""
        if received is None or len(received) > 1:
            return None if received is None else list(received)
        return received[0]

    def backward(self, action: Action) -> None:
        """``B`` (full backward), ``I`` (input grad only) or ``W`` (the weight grads ``I`` left)."""
        stage, key = action.stage, (action.stage, action.microbatch)
        if action.kind == "W":
            self.slots.pop(key).weight_grads.run()
            return
        slot = self.slots[key] if action.kind == "I" else self.slots.pop(key)
        if stage == self.num_stages - 1:
            outputs, grads = (self.scale_loss(slot.loss) if self.scale_loss is not None else slot.loss,), (None,)
        else:
            outputs, grads = _differentiable(slot.output), self._inbox.take(("B", stage, action.microbatch))
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        inputs = _differentiable(slot.input) if slot.input is not None else ()
        if action.kind == "I":
            if len(pairs) != 1 or len(inputs) > 1:
                raise ValueError(
                    "the zero_bubble schedule splits the backward of stages that pass one tensor on; this stage "
                    f"receives {len(inputs)} and sends {len(pairs)}: use schedule '1f1b'"
                )
            chunk = self._chunk(stage)
            stage_input = inputs[0] if inputs else None
            slot.weight_grads = backward_input(*pairs[0], stage_input, chunk.parameters())
            slot.output = slot.loss = None  # what W needs is in weight_grads
        elif pairs and pairs[0][1] is None:
            pairs[0][0].backward()
        elif pairs and self.deallocate_pipeline_outputs:
            run_backward_unchecked([o for o, _ in pairs], [g for _, g in pairs])
        elif pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if stage > 0:
            tag = message_tag("B", stage - 1, action.microbatch)
            grads_back = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs)
            self.p2p.send(grads_back, self.p2p.prev_rank, tag, header=False)
            slot.input = None

    @property
    def _fixed(self) -> bool:
        return self.fixed_shapes or self.expected_shapes is not None

    def _receive_activation(self, action: Action) -> Activation:
        received = self._inbox.take(("F", action.stage, action.microbatch))
        if self.expected_shapes is not None:
            shapes = [tuple(t.shape) for t in received]
            expected = [tuple(s) for s in self.expected_shapes(action.stage)]
            if shapes != expected:
                got, want = (shapes[0], expected[0]) if len(shapes) == len(expected) == 1 else (shapes, expected)
                raise PipelineShapeError(
                    f"pipeline stage {action.stage} received an activation of shape {_listed(got)} from rank "
                    f"{self.p2p.prev_rank}, but the schedule was given tensor_shape={_listed(want)}: pass the "
                    "shape the previous stage really outputs (mind batch-first vs apex's [seq, batch, hidden]), or "
                    "tensor_shape=None"
                )
        return received

    def _send_activation(self, outputs: Activation, action: Action) -> None:
        receiver = action.stage + 1
        meta = tuple((tuple(t.shape), t.dtype) for t in outputs)
        first = self._sent_meta.get(receiver)
        if first is None:
            self._sent_meta[receiver] = meta
        elif self._fixed and first != meta:
            raise PipelineShapeError(
                f"pipeline stage {action.stage} output {_described(meta)} for microbatch {action.microbatch}, but "
                f"{_described(first)} for the step's first: this step runs with one activation shape per stage (a "
                "declared tensor_shape, or microbatches split from one batch); pass tensor_shape=None for "
                "activations whose shape changes between microbatches"
            )
        header = not self._fixed or first is None  # the receiver knows the shapes from the step's first message
        self.p2p.send(outputs, self.p2p.next_rank, message_tag("F", receiver, action.microbatch), header=header)

    def _grad_sync_context(self, stage: int, last: bool) -> contextlib.AbstractContextManager:
        if self.grad_syncs is None or last:
            return contextlib.nullcontext()
        return self.grad_syncs[stage // self.pp].no_sync()

    def run(
        self,
        actions_by_rank: Mapping[int, Sequence[Action]],
        microbatches: Sequence[Any],
        forward_step: ForwardStep,
        forward_only: bool,
    ) -> list[torch.Tensor]:
        """Execute this rank's actions (``actions_by_rank[pp_rank]``; the others tell what the neighbours send);
        returns the per-microbatch losses on the rank owning the last stage, else ``[]``."""
        actions = actions_by_rank[self.pp_rank]
        self._sent_meta.clear()
        self._inbox = Inbox(
            self.p2p, self.pp_rank, self.pp, self.num_stages, actions_by_rank, forward_only=forward_only,
            fixed_shapes=self._fixed, grad_meta=self._grad_meta, ahead=2 * self.num_stages,
        )  # fmt: skip
        losses: dict[int, torch.Tensor] = {}
        last_backward = {a.stage: i for i, a in enumerate(actions) if a.kind in ACCUMULATES_WEIGHT_GRADS}
        first_backward = self._first_backward(actions)
        for i, action in enumerate(actions):
            if i == first_backward and self.between_forwards_and_backwards is not None:
                self.between_forwards_and_backwards()
            self._inbox.post_ahead()
            if action.kind == "F":
                with torch.set_grad_enabled(not forward_only):
                    loss = self.forward(action, microbatches[action.microbatch], forward_step, forward_only)
                if loss is not None:
                    losses[action.microbatch] = loss
            elif not forward_only:
                last = i == last_backward.get(action.stage)
                around = self.last_backward_context if last and self.last_backward_context else None
                with (
                    around(action.stage) if around else contextlib.nullcontext(),
                    self._grad_sync_context(action.stage, last=last),
                ):
                    self.backward(action)
        if first_backward == len(actions) and self.between_forwards_and_backwards is not None:
            self.between_forwards_and_backwards()
        self.p2p.wait_all()
        self.losses = [losses[i] for i in sorted(losses)]
        return self.losses

    def _first_backward(self, actions: Sequence[Action]) -> int:
        """The index of this rank's first backward action (``len(actions)`` without one); with
        ``between_forwards_and_backwards`` every forward must come before it."""
        first = next((i for i, a in enumerate(actions) if a.kind != "F"), len(actions))
        if self.between_forwards_and_backwards is not None and any(a.kind == "F" for a in actions[first:]):
            raise ValueError(
                "this step needs every microbatch's forward before any backward (a sum over all of them enters "
                "the grads), but the schedule interleaves them: use pipeline schedule 'gpipe'"
            )
        return first

    def _grad_meta(self, stage: int, microbatch: int) -> tuple[Meta, ...] | None:
        """Shapes and dtypes of the grads stage ``stage`` receives for ``microbatch``: its outputs', once it ran."""
        slot = self.slots.get((stage, microbatch))
        return None if slot is None else slot.output_meta


def _listed(shapes: Any) -> Any:
    return [list(s) for s in shapes] if shapes and isinstance(shapes[0], tuple) else list(shapes)


def _described(meta: tuple[Meta, ...]) -> str:
    return ", ".join(f"{list(shape)} ({dtype})" for shape, dtype in meta)


def pipeline_neighbours(dims: ParallelDims) -> tuple[int, int]:
    """Global ranks of the previous and next pipeline rank of this rank (wrapping around, for interleaving)."""
    group = dist.get_process_group_ranks(dims.pp_mesh.get_group())
    return group[(dims.pp_rank - 1) % dims.pp], group[(dims.pp_rank + 1) % dims.pp]


PIPELINE_SCHEDULES = ("1f1b", "zero_bubble", "gpipe")


def check_pipeline_schedule(schedule: str, virtual_pipeline_size: int) -> None:
    """``"1f1b"`` (interleaved for several chunks per rank), ``"zero_bubble"`` (ZB-H1, one chunk per rank) or
    ``"gpipe"`` (every forward, then every backward, one chunk per rank: every microbatch's activations held at once,
    for steps whose grads need a sum over all forwards first)."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {list(PIPELINE_SCHEDULES)}")
    if schedule in ("zero_bubble", "gpipe") and virtual_pipeline_size != 1:
        raise ValueError(
            f"the {schedule} schedule runs one chunk per rank: use virtual_pipeline_size=1, or schedule "
            "'1f1b' for the interleaved schedule"
        )


def refuse_split_backward_with_fsdp(chunks: Sequence[nn.Module]) -> None:
    """FSDP2 reduce-scatters a module's grads when the backward reaches its inputs: in a split backward that is the
    input-grad pass, before any weight grad exists."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(module, FSDPModule) for chunk in chunks for module in chunk.modules()):
        raise ValueError(
            "the zero_bubble schedule computes weight grads after the input grads, but FSDP2 (fully_shard) reduces "
            "a module's grads as soon as its input grad is done: use schedule '1f1b' with FSDP, or plain data "
            "parallelism (fsdp=False) with zero_bubble"
        )


def run_schedule(
    dims: ParallelDims,
    chunks: Sequence[nn.Module],
    microbatches: Sequence[Any],
    forward_step: ForwardStep,
    forward_only: bool,
    schedule: str = "1f1b",
    **options: Any,
) -> PipelineExecutor:
    """The one way meshpar's entry points (apex, NxD, HF) run a step: ``schedule="1f1b"`` is 1F1B for one chunk per
    rank and meshpar's interleaved 1F1B for several, ``"zero_bubble"`` ZB-H1, ``"gpipe"`` GPipe; ``options`` are
    :class:`PipelineExecutor` fields. Returns the executor, whose ``losses`` (last stage) and ``outputs`` /
    ``reported`` the caller reads. An error on any rank (in a stage, the loss, a shape check) stops every rank at
    once (:mod:`meshpar.failure`) instead of leaving its neighbours in a recv."""
    check_pipeline_schedule(schedule, len(chunks))
    if schedule == "zero_bubble":
        refuse_split_backward_with_fsdp(chunks)
        name = "zb_h1"
    elif schedule == "gpipe":
        name = "gpipe"
    else:
        name = "interleaved_1f1b" if len(chunks) > 1 else "1f1b"
    if forward_only:
        name = "forward_only"  # the same forward order, and any number of microbatches (one prompt at pp > 1)
    actions = build_actions(name, dims.pp, len(chunks), len(microbatches))
    prev_rank, next_rank = pipeline_neighbours(dims)
    executor = PipelineExecutor(
        chunks=chunks, pp_rank=dims.pp_rank, pp=dims.pp, p2p=P2P(prev_rank, next_rank, dims.device), **options
    )
    with stop_all_ranks_on_error("the pipeline schedule"):
        executor.run(actions, microbatches, forward_step, forward_only)
    return executor
