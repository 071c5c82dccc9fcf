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

Parts of unequal sizes (grouped-query attention's fused ``[q | k | v]``: ``heads`` query heads, ``kv_heads`` key and
value heads) cannot be one ``[parts, part_size, ...]`` tensor. :class:`GroupedRows` keeps them as
``[groups, slots, ...]``, each group holding its share of every part in part order (Megatron's layout: one key/value
head with the query heads that read it); a box of whole groups is one box of the model's rows per part and group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from meshpar._compat import DTensor, local_box, local_tensor, make_wrapper_subclass


def merged_dim(logical: tuple[int, ...], stored: tuple[int, ...]) -> int:
    """The dim ``d`` such that ``stored`` is ``logical`` with dims ``d`` and ``d + 1`` merged."""
    for d in range(len(logical) - 1):
        merged = (*logical[:d], logical[d] * logical[d + 1], *logical[d + 2 :])
        if merged == tuple(stored):
            return d
    raise ValueError(f"shape {tuple(stored)} is not {tuple(logical)} with two neighbouring dims merged")


Pieces = list[tuple[torch.Size, torch.Tensor]]


@dataclass(frozen=True)
class GroupedRows:
    """The model's rows ``[part_0 | part_1 | ...]`` (part ``k``: ``groups * slots[k] * unit`` rows) kept as
    ``[groups, sum(slots) * unit, ...]``: group ``g`` holds rows ``g * slots[k] * unit ...`` of each part ``k``, in
    part order. ``stored`` is the model's shape."""

    slots: tuple[int, ...]
    unit: int
    stored: tuple[int, ...]

    @property
    def groups(self) -> int:
        return self.stored[0] // (sum(self.slots) * self.unit)

    def _part_rows(self) -> list[int]:
        return [self.groups * n * self.unit for n in self.slots]

    def pack(self, dense: torch.Tensor) -> torch.Tensor:
        """The model's tensor in this layout (a new tensor)."""
        parts = dense.split(self._part_rows())
        return torch.cat([p.reshape(self.groups, -1, *p.shape[1:]) for p in parts], dim=1)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """The model's tensor from one in this layout (a new tensor)."""
        parts = packed.split([n * self.unit for n in self.slots], dim=1)
        return torch.cat([p.reshape(-1, *p.shape[2:]) for p in parts])

    def pieces(self, local: torch.Tensor, offsets: tuple[int, ...]) -> Pieces:
        """(offsets in the model's shape, view of ``local``) for every run of one part's rows in one group of the
        box ``local`` at ``offsets`` (of the whole ``[groups, slots, ...]`` tensor) covers."""
        out: Pieces = []
        g0, s0, rest = offsets[0], offsets[1], tuple(offsets[2:])
        base = start = 0
        for part_rows, n in zip(self._part_rows(), self.slots, strict=True):
            end = start + n * self.unit
            lo, hi = max(s0, start), min(s0 + local.shape[1], end)
            for i in range(local.shape[0] if lo < hi else 0):
                row = base + (g0 + i) * n * self.unit + (lo - start)
                out.append((torch.Size((row, *rest)), local[i, lo - s0 : hi - s0]))
            base, start = base + part_rows, end
        return out


Layout = tuple[int, ...] | GroupedRows


def stored_shape(layout: Layout) -> tuple[int, ...]:
    """The model's shape of a parameter kept in ``layout`` (a merged shape, or :class:`GroupedRows`)."""
    return layout.stored if isinstance(layout, GroupedRows) else tuple(layout)


def to_layout(dense: torch.Tensor, layout: Layout, logical: tuple[int, ...]) -> torch.Tensor:
    """``dense`` (in the model's shape) as meshpar keeps it: packed for :class:`GroupedRows`, else reshaped to the
    ``logical`` shape (a view where ``dense`` allows one)."""
    return layout.pack(dense) if isinstance(layout, GroupedRows) else dense.reshape(logical)


def from_layout(whole: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The inverse of :func:`to_layout`: ``whole`` (the whole tensor as meshpar keeps it) in the model's shape."""
    return layout.unpack(whole) if isinstance(layout, GroupedRows) else whole.reshape(layout)


def _merged_pieces(local: torch.Tensor, offsets: tuple[int, ...], logical: tuple[int, ...], stored: tuple) -> Pieces:
    """(offsets in the merged shape, local piece) for every part the box ``local`` at ``offsets`` covers."""
    d = merged_dim(logical, stored)
    part_size = logical[d + 1]
    pieces = []
    for i in range(local.shape[d]):
        part = offsets[d] + i
        merged = (*offsets[:d], part * part_size + offsets[d + 1], *offsets[d + 2 :])
        pieces.append((torch.Size(merged), local.select(d, i)))
    return pieces


class _StoredAs(torch.Tensor):
    """A stand-in DCP saves and loads as the boxes of the model's shape; holds no data of its own (its pieces are
    views of the local shard, written into in place on load). Only DCP's checkpoint protocol is meant to touch it."""

    _local: torch.Tensor
    _pieces: Pieces
    _for_load: bool

    @staticmethod
    def __new__(cls: type[_StoredAs], tensor: torch.Tensor, layout: Layout, *, for_load: bool) -> _StoredAs:
        local = local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
        shape = stored_shape(layout)
        out = make_wrapper_subclass(cls, torch.Size(shape), local.dtype, local.device)
        offsets = local_box(tensor)[1] if isinstance(tensor, DTensor) else (0,) * tensor.dim()
        if isinstance(layout, GroupedRows):
            out._pieces = layout.pieces(local, offsets)
        else:
            out._pieces = _merged_pieces(local, offsets, tuple(tensor.shape), shape)
        out._local = local
        out._for_load = for_load
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(f"{func} on a checkpoint stand-in: only DCP's checkpoint protocol reads it")

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
            for offsets, piece in self._pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=piece.shape) for offsets, piece in self._pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, piece in self._pieces:
            if offsets == index.offset:
                return piece if self._for_load else piece.contiguous()
        raise ValueError(f"no local piece of {index.fqn} at offsets {index.offset}")


def stored_as(tensor: torch.Tensor, layout: Layout, *, for_load: bool = False) -> torch.Tensor:
    """``tensor`` (a DTensor or a plain tensor kept in ``layout``: a shape that is its own with two neighbouring
    dims merged, or :class:`GroupedRows`) as DCP should store it, in the model's shape. Loading writes into
    ``tensor``'s local shard in place."""
    if not isinstance(layout, GroupedRows) and tuple(tensor.shape) == tuple(layout):
        return tensor
    return _StoredAs(tensor, layout, for_load=for_load)
