"""Point-to-point transfers between neighbouring pipeline ranks, posted ahead of their use.

Every transfer carries a tag naming what it is (activation or gradient, stage, microbatch), so that two ranks that
exchange both directions of several stages (interleaving with pp=2) never confuse one message for another.

Receives are posted early (:class:`Receive`, ``irecv``) so the transfer overlaps the receiver's compute instead of
starting when it needs the data: a receive whose size is known costs no round trip on the critical path. A size is
known for a gradient (the shape of the activation the receiver itself sent) and for an activation whose shape the
step has fixed; otherwise a small header (dtype code, ndim, sizes) goes first and the receiver allocates exactly
what was sent, so microbatches of different sequence lengths flow through the pipeline. Sends are asynchronous;
their buffers are kept until the work completes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 10  # dtype, ndim, up to 8 sizes
_MAX_STAGES = 4096


class PipelineShapeError(ValueError):
    """An activation arrived with another shape than the ``tensor_shape`` the schedule was given."""


class Receive:
    """A receive posted ahead. Without a header the payload is posted at once; with one the header is, and
    :meth:`resolve` (waiting for it) posts the payload. ``wait()`` returns the tensor."""

    def __init__(
        self, src: int, tag: int, device: torch.device, shape: tuple[int, ...] | None, dtype: torch.dtype | None
    ) -> None:
        self.src, self.tag, self.device = src, tag, device
        if shape is None:
            self.header: torch.Tensor | None = torch.empty(_HEADER, dtype=torch.int64, device=device)
            self.work = dist.irecv(self.header, src, tag=tag)
        else:
            self.header, self.buffer = None, torch.empty(shape, dtype=dtype, device=device)
            self.work = dist.irecv(self.buffer, src, tag=tag)

    @property
    def has_header(self) -> bool:
        """The payload is not posted yet: it waits for the header."""
        return self.header is not None

    def header_arrived(self) -> bool:
        return self.header is not None and self.work.is_completed()

    def resolve(self) -> None:
        """Wait for the header and post the payload's receive."""
        if self.header is None:
            return
        self.work.wait()
        dtype, ndim = _DTYPES[int(self.header[0])], int(self.header[1])
        shape = tuple(int(s) for s in self.header[2 : 2 + ndim])
        self.buffer, self.header = torch.empty(shape, dtype=dtype, device=self.device), None
        self.work = dist.irecv(self.buffer, self.src, tag=self.tag)

    def wait(self) -> torch.Tensor:
        self.resolve()
        self.work.wait()
        return self.buffer


class P2P:
    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device) -> None:
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._pending.append((dist.isend(tensor, dst, tag=tag), tensor))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, header: bool) -> None:
        """Send ``tensor``; with ``header`` its dtype and shape go first (the receiver does not know them)."""
        tensor = tensor.detach().contiguous()
        if header:
            if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
                raise ValueError(f"cannot send a {tensor.dim()}-d {tensor.dtype} activation between pipeline stages")
            meta = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            meta[0], meta[1] = _DTYPES.index(tensor.dtype), tensor.dim()
            meta[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
            self._isend(meta, dst, tag)
        self._isend(tensor, dst, tag)

    def post(
        self, src: int, tag: int, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None
    ) -> Receive:
        """Post the receive of one message now: of ``shape`` and ``dtype``, or, with ``shape=None``, header first."""
        return Receive(src, tag, self.device, shape, dtype)

    def wait_all(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def message_tag(kind: str, receiving_stage: int, microbatch: int) -> int:
    """A tag unique to one activation ("F") or gradient ("B") message of one microbatch."""
    if not 0 <= receiving_stage < _MAX_STAGES:
        raise ValueError(f"pipeline stage {receiving_stage} is out of range: meshpar's tags allow {_MAX_STAGES} stages")
    tag = (microbatch * _MAX_STAGES + receiving_stage) * 2 + (kind == "B")
    if tag >= 2**31:
        raise ValueError(f"microbatch {microbatch} is out of range for pipeline message tags (int32)")
    return tag
