"""``apex.transformer.tensor_parallel``: apex's tensor-parallel layers (plain local shards, ``(output, bias)``
returns, ``[s, b, h]``), region mappings, RNG tracker, vocab-parallel cross entropy and data broadcast, in apex's
submodules (``layers``, ``mappings``, ``random``, ``cross_entropy``, ``data``, ``utils``, ``memory``)."""

from meshpar.compat.apex.tensor_parallel import cross_entropy, data, layers, mappings, memory, random, utils
from meshpar.compat.apex.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from meshpar.compat.apex.tensor_parallel.data import broadcast_data
from meshpar.compat.apex.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from meshpar.compat.apex.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from meshpar.compat.apex.tensor_parallel.random import (
    checkpoint,
    get_cuda_rng_tracker,
    init_checkpointed_activations_memory_buffer,
    model_parallel_cuda_manual_seed,
    reset_checkpointed_activations_memory_buffer,
)
from meshpar.compat.apex.tensor_parallel.utils import split_tensor_along_last_dim

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "broadcast_data",
    "checkpoint",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "cross_entropy",
    "data",
    "gather_from_tensor_model_parallel_region",
    "get_cuda_rng_tracker",
    "init_checkpointed_activations_memory_buffer",
    "layers",
    "mappings",
    "memory",
    "model_parallel_cuda_manual_seed",
    "random",
    "reduce_from_tensor_model_parallel_region",
    "reset_checkpointed_activations_memory_buffer",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "split_tensor_along_last_dim",
    "utils",
    "vocab_parallel_cross_entropy",
]
