"""``neuronx_distributed``: ``parallel_state``, ``parallel_layers``, ``pipeline``."""

from meshpar import parallel_state
from meshpar.compat.nxd import parallel_layers, pipeline

__all__ = ["parallel_layers", "parallel_state", "pipeline"]
