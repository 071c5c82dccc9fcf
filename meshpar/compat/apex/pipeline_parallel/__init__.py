"""``apex.transformer.pipeline_parallel``: ``get_forward_backward_func``, ``build_model`` and the schedules (see
:mod:`meshpar.pipeline.apex` for the contract)."""

from meshpar.compat.apex.pipeline_parallel import schedules, utils
from meshpar.pipeline.apex import build_model, get_forward_backward_func

__all__ = ["build_model", "get_forward_backward_func", "schedules", "utils"]
