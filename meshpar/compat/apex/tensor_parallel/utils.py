"""``apex.transformer.tensor_parallel.utils``: splitting along the last dim and vocabulary ranges."""

from __future__ import annotations

import torch

from meshpar.compat.apex.utils import divide


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """``num_partitions`` equal views along the last dim (contiguous copies with ``contiguous_split_chunks``)."""
    chunks = torch.split(tensor, divide(tensor.size(-1), num_partitions), dim=-1)
    return tuple(chunk.contiguous() for chunk in chunks) if contiguous_split_chunks else chunks


class VocabUtility:
    """The ``[first, last)`` vocabulary ids a tp rank holds when the vocabulary is split into equal parts."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)


__all__ = ["VocabUtility", "split_tensor_along_last_dim"]
