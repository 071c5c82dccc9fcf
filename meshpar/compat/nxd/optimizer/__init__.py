"""``neuronx_distributed.optimizer``: NxD's ZeRO-1 optimizers (:mod:`.zero_redundancy_optimizer`)."""

from meshpar.compat.nxd.optimizer import zero_redundancy_optimizer
from meshpar.compat.nxd.optimizer.zero_redundancy_optimizer import NeuronEPZero1Optimizer, NeuronZero1Optimizer

__all__ = ["NeuronEPZero1Optimizer", "NeuronZero1Optimizer", "zero_redundancy_optimizer"]
