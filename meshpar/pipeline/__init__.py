"""Pipeline parallelism: FQN-preserving splitting (by structure or by tracing), schedules as data, meshpar's
executor (the one runtime; torch's runs the same action lists as a cross-check in :mod:`meshpar.testing`). apex's
schedule API is a view over it in :mod:`meshpar.compat.apex.pipeline_parallel`."""

from meshpar.pipeline.inspector import ScheduleDeadlockError, Timeline, inspect_schedule, simulate
from meshpar.pipeline.model import PipelineModel, StageChunk
from meshpar.pipeline.schedule_ir import Action, build_actions
from meshpar.pipeline.split import PipelineLayers, StagePlan, build_stage, build_stages, plan_stages, split_model

__all__ = [
    "Action",
    "PipelineLayers",
    "PipelineModel",
    "ScheduleDeadlockError",
    "StageChunk",
    "StagePlan",
    "Timeline",
    "build_actions",
    "build_stage",
    "build_stages",
    "inspect_schedule",
    "plan_stages",
    "simulate",
    "split_model",
]
