"""Tensor parallelism: layers, plan styles, collectives and vocab-parallel cross entropy."""

from meshpar.tensor_parallel._collectives import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
)
from meshpar.tensor_parallel.cross_entropy import parallel_cross_entropy
from meshpar.tensor_parallel.fused_cross_entropy import fused_linear_cross_entropy
from meshpar.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from meshpar.tensor_parallel.packed import PackedColumnParallelLinear
from meshpar.tensor_parallel.style import (
    ColumnParallel,
    GatherSequenceInput,
    PackedColumnParallel,
    ReplicatedKV,
    RowParallel,
    SequenceParallelNorm,
    VocabParallel,
)

__all__ = [
    "ColumnParallel",
    "ColumnParallelLinear",
    "GatherSequenceInput",
    "PackedColumnParallel",
    "PackedColumnParallelLinear",
    "ParallelEmbedding",
    "ReplicatedKV",
    "RowParallel",
    "RowParallelLinear",
    "SequenceParallelNorm",
    "VocabParallel",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "gather_from_sp",
    "fused_linear_cross_entropy",
    "gather_from_tp",
    "parallel_cross_entropy",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_sp",
    "scatter_to_tp",
]
