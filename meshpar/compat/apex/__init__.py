"""``apex.transformer``: ``parallel_state``, ``tensor_parallel``, ``pipeline_parallel``."""

from meshpar.compat.apex import parallel_state, pipeline_parallel, tensor_parallel

__all__ = ["parallel_state", "pipeline_parallel", "tensor_parallel"]
