"""``neuronx_distributed``: ``parallel_layers`` (with ``parallel_state``, ``layers``, ``mappings``, ``random``,
``grads``, ...), ``pipeline`` (``model``, ``trace``) and ``utils`` (``logger``, ``tensor_utils``) at NxD's module
paths."""

from meshpar.compat.nxd import parallel_layers, pipeline, utils
from meshpar.compat.nxd.parallel_layers import parallel_state

__all__ = ["parallel_layers", "parallel_state", "pipeline", "utils"]
