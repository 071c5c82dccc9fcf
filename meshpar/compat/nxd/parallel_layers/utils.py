"""``neuronx_distributed.parallel_layers.utils``."""

from meshpar.hf.padding import divide, get_number_of_extra_heads

__all__ = ["divide", "get_number_of_extra_heads"]
