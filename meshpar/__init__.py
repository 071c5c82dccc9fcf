"""meshpar: tensor, pipeline, data, context and expert parallelism on one ``DeviceMesh`` with dims
``("dp", "pp", "cp", "tp")`` (ep carved out of dp)."""

from meshpar import checkpoint, parallel_state
from meshpar.grad_clip import clip_grad_norm
from meshpar.grad_sync import OverlappedGradSync
from meshpar.optim import DistributedOptimizer
from meshpar.parallel_dims import ParallelDims, destroy_parallel, get_parallel, init_parallel, is_initialized
from meshpar.random import activation_checkpoint, get_rng_tracker, model_parallel_manual_seed
from meshpar.recipe import Recipe, apply_recipe
from meshpar.tensor_parallel import (
    ColumnParallel,
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallel,
    RowParallelLinear,
    SequenceParallelNorm,
    VocabParallel,
    VocabParallelEmbedding,
    fused_linear_cross_entropy,
    parallel_cross_entropy,
)

__version__ = "0.1.0"


def parallelize(*args, **kwargs):  # noqa: ANN201 - lazy: transformers is optional
    """``meshpar.hf.parallelize``: shard a HuggingFace model with one call (see :mod:`meshpar.hf`)."""
    from meshpar.hf import parallelize as _parallelize

    return _parallelize(*args, **kwargs)


def pad_model(*args, **kwargs):  # noqa: ANN201
    """``meshpar.hf.padding.pad_model`` (NxD): pad attention heads so that tp divides them."""
    from meshpar.hf.padding import pad_model as _pad_model

    return _pad_model(*args, **kwargs)


__all__ = [
    "ColumnParallel",
    "DistributedOptimizer",
    "OverlappedGradSync",
    "clip_grad_norm",
    "ColumnParallelLinear",
    "ParallelDims",
    "ParallelEmbedding",
    "RowParallel",
    "RowParallelLinear",
    "SequenceParallelNorm",
    "VocabParallel",
    "VocabParallelEmbedding",
    "Recipe",
    "activation_checkpoint",
    "apply_recipe",
    "checkpoint",
    "destroy_parallel",
    "fused_linear_cross_entropy",
    "get_parallel",
    "get_rng_tracker",
    "init_parallel",
    "is_initialized",
    "model_parallel_manual_seed",
    "pad_model",
    "parallelize",
    "parallel_cross_entropy",
    "parallel_state",
]
