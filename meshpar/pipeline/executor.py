"""meshpar's own pipeline executor: runs an action list (see :mod:`.schedule_ir`) with explicit sends/receives.

It backs the apex- and NxD-style entry points, whose contract differs from ``torch.distributed.pipelining``: every
stage calls the user's ``forward_step_func(microbatch, model)`` (so the last stage sees labels and masks), non-first
stages receive their input through ``model.set_input_tensor(t)`` (apex), and activation shapes may change from one
microbatch to the next. Follow one microbatch: ``F`` receives the input (or reads the batch on stage 0), runs the
chunk and sends the output on; ``B`` receives the output grad (or starts from the loss on the last stage), runs
backward and sends the input grad back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshpar._compat import run_backward_unchecked
from meshpar.pipeline._p2p import P2P, message_tag
from meshpar.pipeline.schedule_ir import Action

if TYPE_CHECKING:
    from meshpar.grad_sync import OverlappedGradSync

ForwardStep = Callable[[Any, nn.Module], tuple[torch.Tensor, Callable[[torch.Tensor], Any]]]


@dataclass
class _Slot:
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    output_shape: tuple[int, ...] = ()
    loss: torch.Tensor | None = None


@dataclass
class PipelineExecutor:
    """Runs one rank's actions over its local chunks (chunk ``k`` is stage ``k * pp + pp_rank``)."""

    chunks: Sequence[nn.Module]
    pp_rank: int
    pp: int
    p2p: P2P
    tensor_shape: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.float32
    deallocate_pipeline_outputs: bool = False
    loss_scale: float = 1.0
    set_virtual_rank: Callable[[int], None] | None = None
    keep_outputs: bool = False  # keep the last stage's outputs (e.g. logits) per microbatch
    # one per chunk: dp all-reduces start during each chunk's last backward, earlier backwards only accumulate
    grad_syncs: Sequence[OverlappedGradSync] | None = None
    slots: dict[tuple[int, int], _Slot] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)

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
            tag = message_tag("F", stage, action.microbatch)
            received = self.p2p.recv(self.p2p.prev_rank, self.tensor_shape, self.dtype, tag)
            slot.input = received if forward_only else received.requires_grad_()
        if hasattr(chunk, "set_input_tensor"):
            chunk.set_input_tensor(slot.input)
        elif stage > 0:
            raise TypeError(f"{type(chunk).__name__} needs set_input_tensor(tensor) to run as a non-first stage")
        output, loss_func = forward_step(microbatch, chunk)
        result = None
        if stage == self.num_stages - 1:
            if self.keep_outputs:
                self.outputs[action.microbatch] = output.detach() if torch.is_tensor(output) else output
            loss = loss_func(output)
            loss_value = loss[0] if isinstance(loss, tuple) else loss
            slot.loss = loss_value * self.loss_scale
            result = loss_value.detach()
        else:
            tag = message_tag("F", stage + 1, action.microbatch)
            self.p2p.send(output, self.p2p.next_rank, with_header=self.tensor_shape is None, tag=tag)
            slot.output, slot.output_shape = output, tuple(output.shape)
            if self.deallocate_pipeline_outputs and not forward_only:
                # The next stage holds the values; backward needs only the graph. Megatron's trick.
                output.data = torch.empty((1,), device=output.device, dtype=output.dtype)
        if not forward_only:
            self.slots[(stage, action.microbatch)] = slot
        return result

    def backward(self, action: Action) -> None:
        stage = action.stage
        slot = self.slots.pop((stage, action.microbatch))
        if stage == self.num_stages - 1:
            slot.loss.backward()
        else:
            tag = message_tag("B", stage, action.microbatch)
            grad = self.p2p.recv(self.p2p.next_rank, slot.output_shape, slot.output.dtype, tag)
            if self.deallocate_pipeline_outputs:
                run_backward_unchecked(slot.output, grad)
            else:
                torch.autograd.backward(slot.output, grad)
        if stage > 0:
            tag = message_tag("B", stage - 1, action.microbatch)
            self.p2p.send(slot.input.grad, self.p2p.prev_rank, with_header=False, tag=tag)

    def _grad_sync_context(self, stage: int, last: bool) -> contextlib.AbstractContextManager:
        if self.grad_syncs is None or last:
            return contextlib.nullcontext()
        return self.grad_syncs[stage // self.pp].no_sync()

    def run(
        self, actions: Sequence[Action], microbatches: Sequence[Any], forward_step: ForwardStep, forward_only: bool
    ) -> list[torch.Tensor]:
        """Execute ``actions``; returns the per-microbatch losses on the rank owning the last stage, else ``[]``."""
        losses: dict[int, torch.Tensor] = {}
        last_backward = {action.stage: i for i, action in enumerate(actions) if action.kind != "F"}
        for i, action in enumerate(actions):
            if action.kind == "F":
                with torch.set_grad_enabled(not forward_only):
                    loss = self.forward(action, microbatches[action.microbatch], forward_step, forward_only)
                if loss is not None:
                    losses[action.microbatch] = loss
            elif not forward_only:
                with self._grad_sync_context(action.stage, last=i == last_backward[action.stage]):
                    self.backward(action)
        self.p2p.wait_all()
        return [losses[i] for i in sorted(losses)]
