"""Checkpoint a tensor in the model's own shape when meshpar keeps it in another (packed parameters).

meshpar keeps a packed parameter, e.g. GPT-2's fused ``c_attn.weight`` (``[in, 3 * hidden]`` in HF, output
``[q | k | v]``), as a DTensor of logical shape ``[in, 3, hidden]`` sharded on the last dim: every rank then holds
whole heads of q, k and v, and the logical tensor does not depend on tp. DCP would store that logical shape, which
torch's standard tools (``dcp_to_torch_save`` + ``load_state_dict``, ``dcp.load`` into a plain model) cannot use.

The rank's shard is one box of the logical tensor, and a box of ``[..., parts, part_size, ...]`` is one box of the
merged ``[..., parts * part_size, ...]`` tensor per part it covers. :func:`stored_as` hands DCP those boxes through
the checkpoint protocol DTensor itself implements (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), so the checkpoint holds the model's shape, and a load in any layout (or into a plain
unsharded model) reads exactly its parts back. DCP's replica de-duplication and resharding work unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from meshpar._compat import DTensor, local_box, local_tensor


def merged_dim(logical: tuple[int, ...], stored: tuple[int, ...]) -> int:
    """The dim ``d`` such that ``stored`` is ``logical`` with dims ``d`` and ``d + 1`` merged."""
    for d in range(len(logical) - 1):
        merged = (*logical[:d], logical[d] * logical[d + 1], *logical[d + 2 :])
        if merged == tuple(stored):
            return d
    raise ValueError(f"shape {tuple(stored)} is not {tuple(logical)} with two neighbouring dims merged")


class _StoredAs(torch.Tensor):
    """A stand-in DCP saves and loads as the boxes of a merged shape; holds no data of its own (the local shard's
    parts are views, written into in place on load). Only DCP's checkpoint protocol is meant to touch it."""

    _local: torch.Tensor
    _offsets: tuple[int, ...]
    _dim: int
    _part_size: int
    _for_load: bool

    @staticmethod
    def __new__(cls: type[_StoredAs], tensor: torch.Tensor, shape: tuple[int, ...], *, for_load: bool) -> _StoredAs:
        local = local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
        out = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=local.dtype, device=local.device)
        out._local = local
        out._offsets = local_box(tensor)[1] if isinstance(tensor, DTensor) else (0,) * tensor.dim()
        out._dim = merged_dim(tuple(tensor.shape), tuple(shape))
        out._part_size = tensor.shape[out._dim + 1]
        out._for_load = for_load
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(f"{func} on a checkpoint stand-in: only DCP's checkpoint protocol reads it")

    def _pieces(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """(offsets in the merged shape, local piece) for every part this rank's box covers."""
        d, offsets = self._dim, self._offsets
        pieces = []
        for i in range(self._local.shape[d]):
            part = offsets[d] + i
            merged = (*offsets[:d], part * self._part_size + offsets[d + 1], *offsets[d + 2 :])
            pieces.append((torch.Size(merged), self._local.select(d, i)))
        return pieces

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=piece.shape),
                    properties=TensorProperties.create_from_tensor(self._local),
                    size=self.shape,
                ),
            )
            for offsets, piece in self._pieces()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=piece.shape) for offsets, piece in self._pieces()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, piece in self._pieces():
            if offsets == index.offset:
                return piece if self._for_load else piece.contiguous()
        raise ValueError(f"no local piece of {index.fqn} at offsets {index.offset}")


def stored_as(tensor: torch.Tensor, shape: tuple[int, ...], *, for_load: bool = False) -> torch.Tensor:
    """``tensor`` (a DTensor or a plain tensor of a packed logical shape) as DCP should store it: in ``shape``, its
    logical shape with two neighbouring dims merged. Loading writes into ``tensor``'s local shard in place."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    return _StoredAs(tensor, tuple(shape), for_load=for_load)
