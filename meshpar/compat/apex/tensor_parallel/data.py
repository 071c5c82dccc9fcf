"""``apex.transformer.tensor_parallel.data``: tp rank 0 reads a batch, every tp rank gets it
(:func:`meshpar.data.broadcast_data`), and apex's two helpers of that path."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshpar.data import broadcast_data as _broadcast_data
from meshpar.parallel_dims import get_parallel

_MAX_DATA_DIM = 8


def _check_data_types(keys: Sequence[str], data: dict[str, torch.Tensor], target_dtype: torch.dtype) -> None:
    for key in keys:
        if data[key].dtype != target_dtype:
            raise TypeError(f"{key} has data type {data[key].dtype}, which is different than {target_dtype}")


def _build_key_size_numel_dictionaries(
    keys: Sequence[str], data: dict[str, torch.Tensor] | None
) -> tuple[dict[str, list[int]], dict[str, int], int]:
    """Every tp rank learns tp rank 0's tensor sizes: ``(sizes by key, numel by key, total numel)``."""
    dims = get_parallel()
    sizes = None
    if dims.tp_rank == 0:
        sizes = [list(data[key].size()) for key in keys]
        for key, size in zip(keys, sizes, strict=True):
            if len(size) >= _MAX_DATA_DIM:
                raise ValueError(f"{key} has {len(size)} dims; at most {_MAX_DATA_DIM - 1} are supported")
    box = [sizes]
    if dims.tp > 1:
        group = dims.tp_mesh.get_group()
        dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[0], group=group)
    key_size = dict(zip(keys, box[0], strict=True))
    key_numel = {key: int(torch.Size(size).numel()) for key, size in key_size.items()}
    return key_size, key_numel, sum(key_numel.values())


def broadcast_data(
    keys: Sequence[str], data: dict[str, torch.Tensor] | None, datatype: torch.dtype
) -> dict[str, torch.Tensor]:
    """tp rank 0's ``data[key]`` for every key, on every tp rank, as ``datatype``."""
    if get_parallel().tp_rank == 0 and data is not None:
        _check_data_types(keys, data, datatype)
    return _broadcast_data(list(keys), data, datatype, get_parallel())


__all__ = ["broadcast_data"]
