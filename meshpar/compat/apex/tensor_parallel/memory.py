"""``apex.transformer.tensor_parallel.memory``: named flat buffers that hand out views (apex's pre-allocated
activation memory)."""

from __future__ import annotations

import torch

from meshpar.parallel_dims import get_parallel

_MEM_BUFFS: dict[str, MemoryBuffer] = {}


def allocate_mem_buff(name: str, numel: int, dtype: torch.dtype, track_usage: bool) -> MemoryBuffer:
    if name in _MEM_BUFFS:
        raise ValueError(f"memory buffer {name} already allocated")
    _MEM_BUFFS[name] = MemoryBuffer(name, numel, dtype, track_usage)
    return _MEM_BUFFS[name]


def get_mem_buff(name: str) -> MemoryBuffer:
    return _MEM_BUFFS[name]


class MemoryBuffer:
    """``numel`` elements of ``dtype``; :meth:`add` copies a tensor in and returns its view, until :meth:`reset`."""

    def __init__(self, name: str, numel: int, dtype: torch.dtype, track_usage: bool) -> None:
        self.name, self.numel, self.dtype, self.track_usage = name, numel, dtype, track_usage
        self.data = torch.empty(numel, dtype=dtype, device=get_parallel().device, requires_grad=False)
        self._start = 0
        self.in_use_value = self.total_value = 0.0

    def reset(self) -> None:
        self._start = 0

    def is_in_use(self) -> bool:
        return self._start > 0

    def numel_in_use(self) -> int:
        return self._start

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype != self.dtype:
            raise TypeError(f"input tensor type {tensor.dtype} is not the buffer's {self.dtype}")
        end = self._start + tensor.numel()
        if end > self.numel:
            raise RuntimeError(f"not enough memory left in buffer {self.name} ({end} > {self.numel})")
        view = self.data[self._start : end].view(tensor.shape)
        view.copy_(tensor)
        self._start = end
        if self.track_usage:
            self.in_use_value += float(self._start)
            self.total_value += float(self.numel)
        return view

    def get_data(self) -> torch.Tensor:
        if not self.is_in_use():
            raise RuntimeError("buffer is not in use")
        return self.data[: self._start]

    def print_average_usage(self) -> None:
        if not self.track_usage:
            raise RuntimeError("usage is not tracked")
        if self.total_value:
            print(f" > usage of {self.name} memory buffer: {self.in_use_value * 100.0 / self.total_value:.2f} %")


class RingMemBuffer:
    """``num_buffers`` :class:`MemoryBuffer` s handed out in turn."""

    def __init__(self, name: str, num_buffers: int, numel: int, dtype: torch.dtype, track_usage: bool) -> None:
        self.num_buffers = num_buffers
        self.buffers = [allocate_mem_buff(f"{name} {i}", numel, dtype, track_usage) for i in range(num_buffers)]
        self._index = -1

    def get_next_buffer(self) -> MemoryBuffer:
        self._index = (self._index + 1) % self.num_buffers
        buffer = self.buffers[self._index]
        if buffer.is_in_use():
            raise RuntimeError("buffer is already in use")
        return buffer
