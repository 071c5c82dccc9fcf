"""``apex.transformer``: ``parallel_state``, ``tensor_parallel``, ``pipeline_parallel``, ``microbatches``,
``enums``, ``log_util``."""

from meshpar.compat.apex import enums, log_util, microbatches, parallel_state, pipeline_parallel, tensor_parallel

__all__ = ["enums", "log_util", "microbatches", "parallel_state", "pipeline_parallel", "tensor_parallel"]
