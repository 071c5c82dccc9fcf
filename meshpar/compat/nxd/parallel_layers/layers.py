"""``neuronx_distributed.parallel_layers.layers``: the tensor-parallel layers (meshpar's, whose parameters are
DTensors on the tp mesh; see docs/compat.md for how they differ from NxD's plain local shards)."""

from meshpar.tensor_parallel import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear

__all__ = ["ColumnParallelLinear", "ParallelEmbedding", "RowParallelLinear"]
