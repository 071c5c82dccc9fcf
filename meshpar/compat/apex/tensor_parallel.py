"""``apex.transformer.tensor_parallel``: meshpar's tensor-parallel layers, vocab-parallel cross entropy and RNG
tracker."""

from meshpar.random import activation_checkpoint as checkpoint
from meshpar.random import get_rng_tracker as get_cuda_rng_tracker
from meshpar.random import model_parallel_manual_seed as model_parallel_cuda_manual_seed
from meshpar.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
)
from meshpar.tensor_parallel import parallel_cross_entropy as vocab_parallel_cross_entropy

copy_to_tensor_model_parallel_region = copy_to_tp
gather_from_tensor_model_parallel_region = gather_from_tp
reduce_from_tensor_model_parallel_region = reduce_from_tp
scatter_to_tensor_model_parallel_region = scatter_to_tp

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "checkpoint",
    "copy_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "vocab_parallel_cross_entropy",
]
