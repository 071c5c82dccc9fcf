"""Point-to-point transfers between neighbouring pipeline ranks, with optional shape headers.

Every transfer carries a tag naming what it is (activation or gradient, stage, microbatch), so that two ranks that
exchange both directions of several stages (interleaving with pp=2) never confuse one message for another. With a
fixed ``tensor_shape`` only the payload travels. Without one, every activation is preceded by a small
header (dtype code, ndim, sizes), so microbatches of different sequence lengths flow through the pipeline with no
fixed shape and no deadlock. Sends are asynchronous; their buffers are kept until the work completes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 10  # dtype, ndim, up to 8 sizes


class P2P:
    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device) -> None:
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._pending.append((dist.isend(tensor, dst, tag=tag), tensor))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def send(self, tensor: torch.Tensor, dst: int, with_header: bool, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        if with_header:
            if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
                raise ValueError(f"cannot send a {tensor.dim()}-d {tensor.dtype} activation between pipeline stages")
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
            header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
            self._isend(header, dst, tag)
        self._isend(tensor, dst, tag)

    def recv(self, src: int, shape: tuple[int, ...] | None, dtype: torch.dtype, tag: int) -> torch.Tensor:
        if shape is None:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            dist.recv(header, src, tag=tag)
            dtype, ndim = _DTYPES[int(header[0])], int(header[1])
            shape = tuple(int(s) for s in header[2 : 2 + ndim])
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buffer, src, tag=tag)
        return buffer

    def wait_all(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def message_tag(kind: str, receiving_stage: int, microbatch: int) -> int:
    """A tag unique to one activation ("F") or gradient ("B") message of one microbatch."""
    return (microbatch * 4096 + receiving_stage) * 2 + (kind == "B")
