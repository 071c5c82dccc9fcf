"""Point-to-point transfers between neighbouring pipeline ranks, posted ahead of their use.

Every transfer carries a tag naming what it is (activation or gradient, stage, microbatch), so that two ranks that
exchange both directions of several stages (interleaving with pp=2) never confuse one message for another. A message
is one tensor or several (an encoder-decoder's decoder stages hand on the decoder's hidden states and the encoder's
output), sent one after another under the message's tag.

Receives are posted early (:class:`Receive`, ``irecv``) so the transfer overlaps the receiver's compute instead of
starting when it needs the data: a receive whose size is known costs no round trip on the critical path. A size is
known for a gradient (the shapes of the activations the receiver itself sent) and for an activation whose shapes the
step has fixed; otherwise a small header (the number of tensors, then each one's dtype code, ndim and sizes) goes
first and the receiver allocates exactly what was sent, so microbatches of different sequence lengths flow through
the pipeline. Sends are asynchronous; their buffers are kept until the work completes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]
_PER_TENSOR = 10  # dtype, ndim, up to 8 sizes
MAX_TENSORS = 64  # tensors in one message (an HF stage hands on one per later layer's carried argument)
_HEADER = 1 + MAX_TENSORS * _PER_TENSOR
_MAX_STAGES = 4096

Meta = tuple[tuple[int, ...], torch.dtype]  # one tensor's shape and dtype


class PipelineShapeError(ValueError):
    """An activation arrived with another shape than the ``tensor_shape`` the schedule was given."""


class Receive:
    """A receive posted ahead. With the message's ``metas`` (each tensor's shape and dtype) its payload is posted at
    once; without, the header is, and :meth:`resolve` (waiting for it) posts the payload. ``wait()`` returns the
    message's tensors."""

    def __init__(self, src: int, tag: int, device: torch.device, metas: tuple[Meta, ...] | None) -> None:
        self.src, self.tag, self.device = src, tag, device
        self.buffers: tuple[torch.Tensor, ...] = ()
        if metas is None:
            self.header: torch.Tensor | None = torch.empty(_HEADER, dtype=torch.int64, device=device)
            self.works = [dist.irecv(self.header, src, tag=tag)]
        else:
            self.header = None
            self._post(metas)

    def _post(self, metas: tuple[Meta, ...]) -> None:
        self.buffers = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in metas)
        self.works = [dist.irecv(buffer, self.src, tag=self.tag) for buffer in self.buffers]

    @property
    def has_header(self) -> bool:
        """The payload is not posted yet: it waits for the header."""
        return self.header is not None

    @property
    def metas(self) -> tuple[Meta, ...]:
        return tuple((tuple(b.shape), b.dtype) for b in self.buffers)

    def header_arrived(self) -> bool:
        return self.header is not None and self.works[0].is_completed()

    def resolve(self) -> None:
        """Wait for the header and post the payload's receives."""
        if self.header is None:
            return
        self.works[0].wait()
        header, self.header = self.header.tolist(), None
        metas = []
        for index in range(header[0]):
            dtype, ndim, *sizes = header[1 + index * _PER_TENSOR : 1 + (index + 1) * _PER_TENSOR]
            metas.append((tuple(sizes[:ndim]), _DTYPES[dtype]))
        self._post(tuple(metas))

    def wait(self) -> tuple[torch.Tensor, ...]:
        self.resolve()
        for work in self.works:
            work.wait()
        return self.buffers


class P2P:
    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device) -> None:
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._pending.append((dist.isend(tensor, dst, tag=tag), tensor))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def send(self, tensors: tuple[torch.Tensor, ...], dst: int, tag: int, *, header: bool) -> None:
        """Send one message of ``tensors``; with ``header`` their dtypes and shapes go first (the receiver does not
        know them)."""
        tensors = tuple(t.detach().contiguous() for t in tensors)
        if header:
            if not 1 <= len(tensors) <= MAX_TENSORS:
                raise ValueError(f"a pipeline message holds 1 to {MAX_TENSORS} tensors, not {len(tensors)}")
            meta = torch.zeros(_HEADER, dtype=torch.int64)
            meta[0] = len(tensors)
            for index, tensor in enumerate(tensors):
                if tensor.dim() > _PER_TENSOR - 2 or tensor.dtype not in _DTYPES:
                    raise ValueError(
                        f"cannot send a {tensor.dim()}-d {tensor.dtype} activation between pipeline stages"
                    )
                start = 1 + index * _PER_TENSOR
                meta[start], meta[start + 1] = _DTYPES.index(tensor.dtype), tensor.dim()
                meta[start + 2 : start + 2 + tensor.dim()] = torch.tensor(tensor.shape)
            self._isend(meta.to(self.device), dst, tag)
        for tensor in tensors:
            self._isend(tensor, dst, tag)

    def post(self, src: int, tag: int, metas: tuple[Meta, ...] | None = None) -> Receive:
        """Post the receive of one message now: of the tensors ``metas`` describe, or, with ``None``, header first."""
        return Receive(src, tag, self.device, metas)

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
