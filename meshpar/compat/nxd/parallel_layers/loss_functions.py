"""``neuronx_distributed.parallel_layers.loss_functions``."""

from meshpar.tensor_parallel import parallel_cross_entropy

__all__ = ["parallel_cross_entropy"]
