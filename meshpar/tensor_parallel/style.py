"""Plan-dict styles for ``torch.distributed.tensor.parallel.parallelize_module``.

``parallelize_module(model, mesh["tp"], {"layers.*.attn.qkv": ColumnParallel(), "layers.*.attn.out": RowParallel(),
...})`` shards ``nn.Linear`` / ``nn.Embedding`` submodules *in place* into meshpar's layers: parameters become
DTensors with the placements below and the forward runs on local shards with Megatron's collectives.

============================  ========================  =============================================
style                         weight placement          activations in -> out
============================  ========================  =============================================
ColumnParallel                Shard(0)                  replicated (or seq shard) -> features shard
RowParallel                   Shard(1), bias Replicate  features shard -> replicated (or seq shard)
VocabParallel                 Shard(0) (or Shard(1))    ids -> replicated (or seq shard) embeddings
SequenceParallelNorm          Replicate                 seq shard -> seq shard (torch's SequenceParallel)
============================  ========================  =============================================

A vocab-parallel LM head is ``ColumnParallel()`` (``gather_output=False``) feeding
:func:`meshpar.parallel_cross_entropy`. torch's own ``ColwiseParallel`` / ``RowwiseParallel`` work in the same plan
dicts for modules meshpar does not cover.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from meshpar._compat import DeviceMesh, ParallelStyle
from meshpar.tensor_parallel.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear


def _require(module: nn.Module, cls: type, style: str) -> None:
    if type(module) is not cls:
        raise TypeError(f"{style} applies to {cls.__name__} modules, got {type(module).__name__}")


class ColumnParallel(ParallelStyle):
    """Shard an ``nn.Linear`` by output features; output is the local feature shard unless ``gather_output``."""

    def __init__(self, *, gather_output: bool = False, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _require(module, nn.Linear, type(self).__name__)
        return ColumnParallelLinear.from_linear(
            module,
            device_mesh,
            gather_output=self.gather_output,
            sequence_parallel_enabled=self.sequence_parallel,
            src_data_rank=self.src_data_rank,
        )


class RowParallel(ParallelStyle):
    """Shard an ``nn.Linear`` by input features; output is all-reduced (reduce-scattered under SP)."""

    def __init__(self, *, input_is_parallel: bool = True, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _require(module, nn.Linear, type(self).__name__)
        return RowParallelLinear.from_linear(
            module,
            device_mesh,
            input_is_parallel=self.input_is_parallel,
            sequence_parallel_enabled=self.sequence_parallel,
            src_data_rank=self.src_data_rank,
        )


class VocabParallel(ParallelStyle):
    """Shard an ``nn.Embedding`` over the vocabulary (or the embedding dim with ``shard_across_embedding``)."""

    def __init__(self, *, shard_across_embedding: bool = False, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.shard_across_embedding = shard_across_embedding
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _require(module, nn.Embedding, type(self).__name__)
        return ParallelEmbedding.from_embedding(
            module,
            device_mesh,
            shard_across_embedding=self.shard_across_embedding,
            sequence_parallel_enabled=self.sequence_parallel,
            src_data_rank=self.src_data_rank,
        )


def SequenceParallelNorm(sequence_dim: int = 1) -> ParallelStyle:  # noqa: N802 - reads like a style class
    """Norm (or dropout) over sequence shards with replicated parameters whose grads are summed over tp.

    This is torch's ``SequenceParallel`` returning local tensors, so it composes with meshpar's local-tensor layers.
    """
    return SequenceParallel(sequence_dim=sequence_dim, use_local_output=True)
