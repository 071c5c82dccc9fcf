"""``neuronx_distributed.trainer``: NxD's config, model / optimizer initialisation and checkpoints."""

from meshpar.compat.nxd.trainer.post_partition_hooks import PostPartitionHooks

hooks = PostPartitionHooks()

from meshpar.compat.nxd.trainer import checkpoint, model, optimizer, post_partition_hooks, trainer  # noqa: E402
from meshpar.compat.nxd.trainer.checkpoint import (  # noqa: E402
    CheckpointIOState,
    finalize_checkpoint,
    has_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from meshpar.compat.nxd.trainer.trainer import (  # noqa: E402
    initialize_parallel_model,
    initialize_parallel_optimizer,
    neuronx_distributed_config,
)

__all__ = [
    "CheckpointIOState",
    "PostPartitionHooks",
    "checkpoint",
    "finalize_checkpoint",
    "has_checkpoint",
    "hooks",
    "initialize_parallel_model",
    "initialize_parallel_optimizer",
    "load_checkpoint",
    "model",
    "neuronx_distributed_config",
    "optimizer",
    "post_partition_hooks",
    "save_checkpoint",
    "trainer",
]
