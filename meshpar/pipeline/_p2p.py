"""Point-to-point transfers between neighbouring pipeline ranks.

Every transfer carries a tag naming what it is (activation or gradient, stage, microbatch), so that two ranks that
exchange both directions of several stages (interleaving with pp=2) never confuse one message for another.

Every activation is preceded by a small header (dtype code, ndim, sizes): the receiver allocates exactly what was
sent, so microbatches of different sequence lengths flow through the pipeline, and a ``tensor_shape`` the caller
declared is *checked* against what really arrives (the same element count in another layout, say apex's
``(seq, batch, hidden)`` for a batch-first model, would otherwise be read silently wrong). Gradients travel without
a header: their shape is that of the activation the receiver itself sent. Sends are asynchronous; their buffers are
kept until the work completes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 10  # dtype, ndim, up to 8 sizes
_MAX_STAGES = 4096


class PipelineShapeError(ValueError):
    """An activation arrived with another shape than the ``tensor_shape`` the schedule was given."""


class P2P:
    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device) -> None:
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._pending.append((dist.isend(tensor, dst, tag=tag), tensor))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def send_activation(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
            raise ValueError(f"cannot send a {tensor.dim()}-d {tensor.dtype} activation between pipeline stages")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        self._isend(header, dst, tag)
        self._isend(tensor, dst, tag)

    def recv_activation(self, src: int, tag: int, expected_shape: tuple[int, ...] | None, stage: int) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src, tag=tag)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        shape = tuple(int(s) for s in header[2 : 2 + ndim])
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buffer, src, tag=tag)  # first, even if refused: the sender's transfer completes
        if expected_shape is not None and shape != tuple(expected_shape):
            raise PipelineShapeError(
                f"pipeline stage {stage} received an activation of shape {list(shape)} from rank {src}, but the "
                f"schedule was given tensor_shape={list(expected_shape)}: pass the shape the previous stage really "
                "outputs (mind batch-first vs apex's [seq, batch, hidden]), or tensor_shape=None"
            )
        return buffer

    def send_grad(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._isend(tensor.detach().contiguous(), dst, tag)

    def recv_grad(self, src: int, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buffer, src, tag=tag)
        return buffer

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
