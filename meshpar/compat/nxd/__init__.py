"""``neuronx_distributed``'s training surface at NxD's module paths: ``parallel_layers``, ``pipeline``,
``modules``, ``optimizer``, ``trainer``, ``utils``, ``overrides``, plus the torch_xla shim :mod:`.xla`. The
top-level names are the trainer API (``neuronx_distributed_config``, ``initialize_parallel_model``,
``initialize_parallel_optimizer``, ``save_checkpoint`` / ``load_checkpoint`` / ``has_checkpoint`` /
``finalize_checkpoint``)."""

from meshpar.compat.nxd import modules, optimizer, overrides, parallel_layers, pipeline, trainer, utils, xla
from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.compat.nxd.trainer import (
    CheckpointIOState,
    finalize_checkpoint,
    has_checkpoint,
    initialize_parallel_model,
    initialize_parallel_optimizer,
    load_checkpoint,
    neuronx_distributed_config,
    save_checkpoint,
)

__all__ = [
    "CheckpointIOState",
    "finalize_checkpoint",
    "has_checkpoint",
    "initialize_parallel_model",
    "initialize_parallel_optimizer",
    "load_checkpoint",
    "modules",
    "neuronx_distributed_config",
    "optimizer",
    "overrides",
    "parallel_layers",
    "parallel_state",
    "pipeline",
    "save_checkpoint",
    "trainer",
    "utils",
    "xla",
]
