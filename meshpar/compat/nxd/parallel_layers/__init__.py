"""``neuronx_distributed.parallel_layers``: layers, ``parallel_state``, ``clip_grad_norm``, ``move_model_to_device``,
``save`` / ``load`` and the ``pad``, ``loss_functions`` and ``utils`` submodules."""

from meshpar.compat.nxd.parallel_layers import (
    grads,
    layers,
    loss_functions,
    mappings,
    pad,
    parallel_state,
    random,
    utils,
)
from meshpar.compat.nxd.parallel_layers.checkpointing import load, save
from meshpar.compat.nxd.parallel_layers.grads import clip_grad_norm
from meshpar.compat.nxd.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from meshpar.compat.nxd.parallel_layers.loss_functions import parallel_cross_entropy
from meshpar.compat.nxd.parallel_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from meshpar.compat.nxd.parallel_layers.parallel_state import initialize_model_parallel
from meshpar.compat.nxd.parallel_layers.random import get_xla_rng_tracker, model_parallel_xla_manual_seed
from meshpar.compat.nxd.parallel_layers.utils import (
    copy_tensor_model_parallel_attributes,
    move_model_to_device,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    split_tensor_along_last_dim,
)

# NxD's lists of what its pipeline tracer keeps as leaves
PARALLEL_MODULES = [ColumnParallelLinear, RowParallelLinear, ParallelEmbedding]
PARALLEL_FUNCTIONS = [
    parallel_cross_entropy,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
]

__all__ = [
    "PARALLEL_FUNCTIONS",
    "PARALLEL_MODULES",
    "ColumnParallelLinear",
    "copy_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_xla_rng_tracker",
    "grads",
    "initialize_model_parallel",
    "layers",
    "mappings",
    "model_parallel_xla_manual_seed",
    "parallel_cross_entropy",
    "random",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "ParallelEmbedding",
    "RowParallelLinear",
    "clip_grad_norm",
    "copy_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "split_tensor_along_last_dim",
    "load",
    "loss_functions",
    "move_model_to_device",
    "pad",
    "parallel_state",
    "save",
    "utils",
]
