"""``neuronx_distributed.parallel_layers.layers``: the tensor-parallel layers, on the tp mesh of the parallel state
NxD's ``initialize_model_parallel`` set up (meshpar's own layers take the mesh as an argument; NxD's API has none).
Their parameters are DTensors on that mesh; see docs/compat.md for how they differ from NxD's plain local shards."""

from __future__ import annotations

from typing import Any

from meshpar import tensor_parallel as _native
from meshpar.parallel_dims import get_parallel

__all__ = ["ColumnParallelLinear", "ParallelEmbedding", "RowParallelLinear"]


class ColumnParallelLinear(_native.ColumnParallelLinear):
    """NxD's ``ColumnParallelLinear`` (the signature of NxD's API guide) on the parallel state's tp mesh."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("tp_mesh", get_parallel().tp_mesh)
        super().__init__(*args, **kwargs)


class RowParallelLinear(_native.RowParallelLinear):
    """NxD's ``RowParallelLinear`` (the signature of NxD's API guide) on the parallel state's tp mesh."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("tp_mesh", get_parallel().tp_mesh)
        super().__init__(*args, **kwargs)


class ParallelEmbedding(_native.ParallelEmbedding):
    """NxD's ``ParallelEmbedding`` (the signature of NxD's API guide) on the parallel state's tp mesh."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("tp_mesh", get_parallel().tp_mesh)
        super().__init__(*args, **kwargs)
