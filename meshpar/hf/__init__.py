"""HuggingFace integration: ``meshpar.parallelize(model, config)``, plans (meshpar tables, transformers' own plans,
user plans), plan verification, head padding."""

from meshpar.hf import grouped_experts
from meshpar.hf.config import ParallelConfig, load_config
from meshpar.hf.parallelize import ParallelizedModel, parallelize
from meshpar.hf.plans import metadata_plan, plan_for, plan_summary
from meshpar.hf.verify import PlanVerificationError

grouped_experts.register()  # "meshpar_grouped_mm" among transformers' experts implementations

__all__ = [
    "ParallelConfig",
    "ParallelizedModel",
    "PlanVerificationError",
    "load_config",
    "metadata_plan",
    "parallelize",
    "plan_for",
    "plan_summary",
]
