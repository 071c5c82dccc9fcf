"""meshpar's schedules on torch's ``torch.distributed.pipelining`` runtime: the cross-check, not a second runtime.

Every meshpar entry point runs its pipeline on :mod:`meshpar.pipeline.executor` (see why there). torch's runtime is
the ecosystem's reference, so the tests run meshpar's action lists (:mod:`meshpar.pipeline.schedule_ir`: GPipe, 1F1B,
the interleaved 1F1B for any ``num_microbatches >= pp`` and ZB-H1) on it too: torch's pass adds the sends/receives
and its ``PipelineStage``s run them, and the results must equal both the executor's and the dense model's. The
benchmarks time the executor against torch's own schedule classes (``"torch_*"`` names) through ``build_schedule``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from meshpar._compat import (
    PP_BACKWARD_INPUT,
    PP_BACKWARD_WEIGHT,
    PP_FORWARD,
    PP_FULL_BACKWARD,
    PP_RECV_B,
    PP_REDUCE_GRAD,
    PP_SEND_B,
    DeviceMesh,
    PipelineScheduleRuntime,
    PipelineStage,
    PPAction,
)
from meshpar.pipeline.schedule_ir import build_actions

_BACKWARD_ACTIONS = (PP_FULL_BACKWARD, PP_BACKWARD_INPUT, PP_BACKWARD_WEIGHT, PP_RECV_B, PP_SEND_B, PP_REDUCE_GRAD)
_KINDS = {"F": PP_FORWARD, "B": PP_FULL_BACKWARD, "I": PP_BACKWARD_INPUT, "W": PP_BACKWARD_WEIGHT}


class MeshparSchedule(PipelineScheduleRuntime):
    """torch's pipelining runtime driven by meshpar's action lists."""

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        schedule: str = "interleaved_1f1b",
        forward_only: bool = False,
        scale_grads: bool = True,
    ) -> None:
        super().__init__(stages=list(stages), n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        pp = stages[0].group_size
        self.schedule_name = schedule
        self.actions = build_actions(schedule, pp, len(stages), n_microbatches)
        self.pipeline_order = {
            rank: [PPAction(a.stage, _KINDS[a.kind], a.microbatch) for a in actions]
            for rank, actions in self.actions.items()
        }
        self._prepare_schedule_with_comms(self.pipeline_order)
        if forward_only:
            # torch validates complete schedules only; evaluation runs the same order without the backward half.
            self.pipeline_order_with_comms = {
                rank: [a for a in actions if a.computation_type not in _BACKWARD_ACTIONS]
                for rank, actions in self.pipeline_order_with_comms.items()
            }


_TORCH_SCHEDULES = {
    "torch_gpipe": ScheduleGPipe,
    "torch_1f1b": Schedule1F1B,
    "torch_interleaved_1f1b": ScheduleInterleaved1F1B,
    "torch_interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
}
_MULTI_STAGE = (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)  # take a list of stages
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", *_TORCH_SCHEDULES)


def make_pipeline_stages(
    stage_modules: Sequence[tuple[int, nn.Module]], num_stages: int, pp_mesh: DeviceMesh, device: torch.device
) -> list[PipelineStage]:
    return [
        PipelineStage(module, index, num_stages, device, group=pp_mesh.get_group()) for index, module in stage_modules
    ]


def build_schedule(
    name: str,
    stages: Sequence[PipelineStage],
    n_microbatches: int,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    forward_only: bool = False,
    scale_grads: bool = True,
) -> PipelineScheduleRuntime:
    """One factory for every schedule; ``forward_only`` builds the evaluation order (call ``.eval(...)`` on it)."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULE_NAMES}")
    if name in _TORCH_SCHEDULES:
        cls = _TORCH_SCHEDULES[name]
        if cls not in _MULTI_STAGE and len(stages) != 1:
            raise ValueError(f"{name} runs one stage per rank, got {len(stages)}")
        arg = list(stages) if cls in _MULTI_STAGE else stages[0]
        return cls(arg, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return MeshparSchedule(
        stages, n_microbatches, loss_fn, schedule=name, forward_only=forward_only, scale_grads=scale_grads
    )
