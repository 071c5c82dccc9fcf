"""HuggingFace integration: ``meshpar.parallelize(model, config)``, family plans, head padding."""

from meshpar.hf.config import ParallelConfig, load_config
from meshpar.hf.parallelize import ParallelizedModel, parallelize
from meshpar.hf.plans import automatic_plan, plan_for, plan_summary

__all__ = [
    "ParallelConfig",
    "ParallelizedModel",
    "automatic_plan",
    "load_config",
    "parallelize",
    "plan_for",
    "plan_summary",
]
