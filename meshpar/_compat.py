"""Every private or version-sensitive torch import of meshpar lives here.

A torch upgrade that moves one of these names should only need a change in this file.
"""

from __future__ import annotations

import torch

import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ParallelStyle

# torch >= 2.13 renamed the dim-aware functional collectives; same signatures.
all_gather_single = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
reduce_scatter_single = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)

__all__ = [
    "all_gather_single",
    "reduce_scatter_single",
    "CommDebugMode",
    "DTensor",
    "DeviceMesh",
    "ParallelStyle",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "funcol",
    "init_device_mesh",
]

# Pipelining runtime internals (schedules as action lists).
from torch.distributed.pipelining import PipelineStage  # noqa: E402
from torch.distributed.pipelining.schedules import (  # noqa: E402
    FORWARD as PP_FORWARD,
    FULL_BACKWARD as PP_FULL_BACKWARD,
    RECV_B as PP_RECV_B,
    REDUCE_GRAD as PP_REDUCE_GRAD,
    SEND_B as PP_SEND_B,
    _Action as PPAction,
    _PipelineScheduleRuntime as PipelineScheduleRuntime,
)

__all__ += ["PP_FORWARD", "PP_FULL_BACKWARD", "PP_RECV_B", "PP_REDUCE_GRAD", "PP_SEND_B", "PPAction", "PipelineScheduleRuntime", "PipelineStage"]


def run_backward_unchecked(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from ``output`` without the shape check, for outputs whose data was freed after sending
    (Megatron's ``custom_backward``)."""
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )
