"""``neuronx_distributed.parallel_layers.utils``: NxD's tensor-parallel attribute helpers, divisibility and split
helpers, autocast casting helpers and the single-process fallback state its layers build when no parallel state is
set up. XLA-only helpers answer for the process's own device (``move_all_tensor_to_cpu`` moves tensors to CPU,
``is_pjrt_device`` is ``False``)."""

from __future__ import annotations

import collections.abc
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshpar.data import move_model_to_device
from meshpar.hf.padding import divide, get_number_of_extra_heads
from meshpar.parallel_dims import get_parallel, is_initialized

# NxD's parameter attributes and the values a parameter without them is read as
_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS: dict[str, Any] = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
    "num_partitions": 1,
}


class EmbeddingUtility:
    """The ``[first, last)`` vocabulary rows of tp rank ``rank`` when the vocabulary is split evenly."""

    @staticmethod
    def range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
        per_partition = divide(global_vocab_size, world_size)
        return EmbeddingUtility.range_from_per_partition_vocab_size(per_partition, rank, world_size)


def _tp_size() -> int:
    return get_parallel().tp


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """Whether ``param`` counts once per tp rank in a norm: it is sharded, or this is tp rank 0."""
    return bool(getattr(param, "tensor_model_parallel", False)) or get_parallel().tp_rank == 0


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor,
    is_parallel: bool,
    dim: int,
    stride: int,
    num_partitions: int = -1,
    rank_ordering: list[int] | None = None,
) -> None:
    """Mark ``tensor`` as a tp shard along ``dim`` (NxD's attributes; a tensor marked once cannot be marked again)."""
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, name):
            raise ValueError(f"the tensor already has the attribute {name!r}")
    if num_partitions == -1:
        num_partitions = _tp_size()
    if rank_ordering is not None and sorted(rank_ordering) != list(range(_tp_size())):
        raise ValueError(f"rank_ordering {rank_ordering} must hold every tp rank 0..{_tp_size() - 1} once")
    tensor.tensor_model_parallel, tensor.partition_dim, tensor.partition_stride = is_parallel, dim, stride
    tensor.num_partitions, tensor.rank_ordering = num_partitions, rank_ordering


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    for name, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


def ensure_divisibility(numerator: int, denominator: int) -> None:
    divide(numerator, denominator)


def split_tensor_along_dim(
    tensor: torch.Tensor, dim: int, num_partitions: int, contiguous_split_chunks: bool = False
) -> Sequence[torch.Tensor]:
    """``tensor`` cut into ``num_partitions`` equal pieces along ``dim`` (views unless made contiguous)."""
    pieces = list(torch.split(tensor, divide(tensor.size(dim), num_partitions), dim=dim))
    return tuple(piece.contiguous() for piece in pieces) if contiguous_split_chunks else pieces


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Sequence[torch.Tensor]:
    return split_tensor_along_dim(tensor, tensor.dim() - 1, num_partitions, contiguous_split_chunks)


def split_tensor_along_second_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Sequence[torch.Tensor]:
    return split_tensor_along_dim(tensor, 1, num_partitions, contiguous_split_chunks)


def get_padding_length(numerator: int, denominator: int) -> int:
    """What ``numerator`` must grow by to divide by ``denominator``."""
    return -numerator % denominator


def indices_split_along_dim(
    tensor: torch.Tensor | None, dim: int, rank: int, num_partitions: int
) -> torch.Tensor | None:
    """The indices along ``dim`` of ``rank``'s contiguous 1/``num_partitions`` of ``tensor`` (``None`` for none)."""
    if tensor is None:
        return None
    size = divide(tensor.size(dim), num_partitions)
    return torch.arange(size, device=tensor.device) + rank * size


def is_torch_version_greater_than_2() -> bool:
    return int(torch.__version__.split(".")[0]) >= 2


def is_pjrt_device() -> bool:
    """NxD asks whether it runs on Neuron's PJRT runtime: never here."""
    return False


def requires_init_pg_override() -> bool:
    return torch.__version__.startswith("2.0")


def get_local_world_size() -> int:
    """Processes on this host (torchrun's ``LOCAL_WORLD_SIZE``; the world size without it)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return dist.get_world_size() if dist.is_initialized() else 1


def cast_tensor(
    tensor: torch.Tensor, from_dtype: torch.dtype = torch.float32, to_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return tensor.to(dtype=to_dtype) if tensor.dtype == from_dtype else tensor


def cast_all(state: Any, from_dtype: torch.dtype = torch.float32, to_dtype: torch.dtype = torch.bfloat16) -> Any:
    """Every ``from_dtype`` tensor in a nest of dicts, lists and tuples cast to ``to_dtype``."""
    if isinstance(state, torch.Tensor):
        return cast_tensor(state, from_dtype, to_dtype)
    if isinstance(state, dict):
        return {key: cast_all(value, from_dtype, to_dtype) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cast_all(value, from_dtype, to_dtype) for value in state)
    return state


def _autocast_dtype() -> torch.dtype:
    device = "cuda" if torch.is_autocast_enabled("cuda") else "cpu"
    return torch.get_autocast_dtype(device)


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype is not torch.float64 else value
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, collections.abc.Mapping):
        return {_cast(key, dtype): _cast(item, dtype) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(item, dtype) for item in value)
    return value


def cast_if_autocast_enabled(*args: Any) -> Any:
    """``args`` as given, or under autocast with their floating tensors (not float64) in autocast's dtype."""
    return _cast(args, _autocast_dtype()) if _autocast_on() else args


def verify_casted_dtype(value: Any) -> None:
    """Under autocast, refuse a tensor in ``value`` that is not in autocast's dtype."""
    if not _autocast_on():
        return
    if isinstance(value, torch.Tensor):
        if value.dtype != _autocast_dtype():
            raise TypeError(
                f"Datatype of tensor is expected to be {_autocast_dtype()}, got {value.dtype} instead (under autocast)"
            )
    elif isinstance(value, collections.abc.Mapping):
        for key, item in value.items():
            verify_casted_dtype(key)
            verify_casted_dtype(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            verify_casted_dtype(item)


def move_all_tensor_to_cpu(data: Any, convert: bool = True) -> Any:
    """Every tensor in a nest of dicts, lists and tuples moved to CPU (``convert=False``: left where it is)."""
    if not convert:
        return data
    if isinstance(data, torch.Tensor):
        return data.cpu()
    if isinstance(data, dict):
        return {key: move_all_tensor_to_cpu(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(move_all_tensor_to_cpu(value) for value in data)
    return data


def initialize_fallback_parallel_state(device: torch.device | None = None) -> None:
    """What NxD's layers do when built with no parallel state: a one-process world (an in-memory store, no port)
    and tp = pp = 1, so a layer runs as its dense equivalent."""
    # meshpar's own initialiser, not the NxD name a caller may have replaced (NxD's unit tests patch it to a no-op)
    from meshpar.parallel_state import initialize_model_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(
            "a parallel layer was built before initialize_model_parallel in a multi-process job: call "
            "neuronx_distributed.parallel_layers.parallel_state.initialize_model_parallel(...) first"
        )
    if not is_initialized():
        initialize_model_parallel()


def ensure_parallel_state(device: torch.device | None = None) -> None:
    """NxD's layers without a parallel state warn and fall back to one process
    (:func:`initialize_fallback_parallel_state`)."""
    if not is_initialized():
        warnings.warn(
            "Parallel state is not initialized. Falling back to non-parallel equivalent.", UserWarning, stacklevel=3
        )
        initialize_fallback_parallel_state(device)


__all__ = [
    "EmbeddingUtility",
    "cast_all",
    "cast_if_autocast_enabled",
    "cast_tensor",
    "copy_tensor_model_parallel_attributes",
    "divide",
    "ensure_divisibility",
    "get_local_world_size",
    "get_number_of_extra_heads",
    "get_padding_length",
    "indices_split_along_dim",
    "initialize_fallback_parallel_state",
    "is_pjrt_device",
    "is_torch_version_greater_than_2",
    "move_all_tensor_to_cpu",
    "move_model_to_device",
    "param_is_not_tensor_parallel_duplicate",
    "requires_init_pg_override",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "split_tensor_along_dim",
    "split_tensor_along_last_dim",
    "split_tensor_along_second_dim",
    "verify_casted_dtype",
]
