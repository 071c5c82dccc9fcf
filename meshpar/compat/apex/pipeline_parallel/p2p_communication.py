"""``apex.transformer.pipeline_parallel.p2p_communication``: apex's blocking neighbour transfers.

Each function exchanges activations (forward) or their grads (backward) with the previous / next pipeline rank of
meshpar's mesh and returns once its receives arrived. As in apex, a transfer that has no partner is skipped: the first
stage receives no activation (``recv_forward`` returns ``None``) and sends no grad, the last stage sends no activation
and receives no grad. Received tensors are allocated from ``tensor_shape`` (required, as in apex: meshpar's own
executor sends a shape header instead, :mod:`meshpar.pipeline._p2p`) and ``dtype`` (default float32), and require
grad, so a stage can backpropagate into them. ``tensor_shape`` is taken as given: with sequence parallelism the caller
passes the shard's shape (apex's schedules divide the sequence by tp in ``get_tensor_shapes``).

apex's tuning keywords (``async_comm``, ``sync_batch_comm``, ``batch_p2p_comm``, ``overlap_p2p_comm``, ``timers``)
are accepted and change nothing: meshpar posts every send and receive of a call at once and waits for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshpar.parallel_dims import get_parallel
from meshpar.pipeline.executor import pipeline_neighbours

Shape = Sequence[int] | torch.Size


class FutureTensor:
    """apex's handle of a tensor whose transfer may still be running; meshpar's transfers are complete on return,
    so ``get()`` just returns the tensor."""

    def __init__(self, tensor: torch.Tensor, waitfunc: Any = None) -> None:
        self.tensor, self.waitfunc = tensor, waitfunc

    def get(self) -> torch.Tensor:
        if self.waitfunc is not None:
            self.waitfunc()
            self.waitfunc = None
        return self.tensor


def _communicate(
    tensor_send_next: torch.Tensor | None,
    tensor_send_prev: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape | None = None,
    override_scatter_gather_tensors_in_pipeline: bool = False,
    dtype_: torch.dtype | None = None,
    *,
    scatter_gather_tensors_in_pipeline: bool = True,
    params_dtype: torch.dtype | None = None,
    fp32_residual_connection: bool = False,
    **_tuning: Any,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Post every send and receive asked for (towards both neighbours), wait for all of them; returns ``(received
    from prev, received from next)``."""
    if tensor_shape is None and (recv_prev or recv_next):
        raise RuntimeError(
            "tensor_shape must be given to receive (commonly (seq_length, micro_batch_size, hidden_size))"
        )
    dims = get_parallel()
    dtype = dtype_ or (torch.float32 if fp32_residual_connection else params_dtype) or torch.float32
    prev_rank, next_rank = pipeline_neighbours(dims)
    first, last = dims.pp_rank == 0, dims.pp_rank == dims.pp - 1
    works, received = [], []
    for tensor, peer, skip in ((tensor_send_prev, prev_rank, first), (tensor_send_next, next_rank, last)):
        if tensor is not None and not skip:
            works.append(dist.isend(tensor.detach().contiguous(), peer))
    for wanted, peer, skip in ((recv_prev, prev_rank, first), (recv_next, next_rank, last)):
        if wanted and not skip:
            buffer = torch.empty(tuple(tensor_shape), dtype=dtype, device=dims.device)
            works.append(dist.irecv(buffer, peer))
            received.append(buffer)
        else:
            received.append(None)
    for work in works:
        work.wait()
    prev, next_ = (t.requires_grad_() if t is not None else None for t in received)
    return prev, next_


def recv_forward(
    tensor_shape: Shape,
    override_scatter_gather_tensors_in_pipeline: bool = False,
    *,
    dtype: torch.dtype | None = None,
    **tuning: Any,
) -> torch.Tensor | None:
    """The activation from the previous stage (``None`` on the first stage)."""
    prev, _ = _communicate(None, None, True, False, tensor_shape, dtype_=dtype, **tuning)
    return prev


def recv_backward(
    tensor_shape: Shape = None, *, dtype: torch.dtype | None = None, **tuning: Any
) -> torch.Tensor | None:
    """The grad of this stage's output from the next stage (``None`` on the last stage)."""
    _, next_ = _communicate(None, None, False, True, tensor_shape, dtype_=dtype, **tuning)
    return next_


def send_forward(
    output_tensor: torch.Tensor,
    override_scatter_gather_tensors_in_pipeline: bool = False,
    tensor_shape: Shape = None,
    *,
    dtype: torch.dtype | None = None,
    **tuning: Any,
) -> None:
    """This stage's activation to the next stage (nothing on the last stage)."""
    _communicate(output_tensor, None, False, False, tensor_shape, dtype_=dtype, **tuning)


def send_backward(
    input_tensor_grad: torch.Tensor, tensor_shape: Shape = None, *, dtype: torch.dtype | None = None, **tuning: Any
) -> None:
    """The grad of this stage's input to the previous stage (nothing on the first stage)."""
    _communicate(None, input_tensor_grad, False, False, tensor_shape, dtype_=dtype, **tuning)


def send_forward_recv_backward(
    output_tensor: torch.Tensor, tensor_shape: Shape, *, dtype: torch.dtype | None = None, **tuning: Any
) -> torch.Tensor | None:
    """Send the activation on, receive the grad of it back."""
    _, next_ = _communicate(output_tensor, None, False, True, tensor_shape, dtype_=dtype, **tuning)
    return next_


def send_backward_recv_forward(
    input_tensor_grad: torch.Tensor, tensor_shape: Shape, *, dtype: torch.dtype | None = None, **tuning: Any
) -> torch.Tensor | None:
    """Send the input grad back, receive the next activation."""
    prev, _ = _communicate(None, input_tensor_grad, True, False, tensor_shape, dtype_=dtype, **tuning)
    return prev


def send_forward_recv_forward(
    output_tensor: torch.Tensor,
    recv_prev: bool,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    **tuning: Any,
) -> torch.Tensor | None:
    """Send the activation on and (with ``recv_prev``) receive the previous stage's next one."""
    prev, _ = _communicate(output_tensor, None, recv_prev, False, tensor_shape, dtype_=dtype, **tuning)
    return prev


def send_backward_recv_backward(
    input_tensor_grad: torch.Tensor,
    recv_next: bool,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    **tuning: Any,
) -> torch.Tensor | None:
    """Send the input grad back and (with ``recv_next``) receive the next stage's next output grad."""
    _, next_ = _communicate(None, input_tensor_grad, False, recv_next, tensor_shape, dtype_=dtype, **tuning)
    return next_


def send_forward_backward_recv_forward_backward(
    output_tensor: torch.Tensor,
    input_tensor_grad: torch.Tensor,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    **tuning: Any,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Both directions at once: ``(activation from prev, grad from next)``."""
    return _communicate(output_tensor, input_tensor_grad, recv_prev, recv_next, tensor_shape, dtype_=dtype, **tuning)


__all__ = [
    "FutureTensor",
    "recv_backward",
    "recv_forward",
    "send_backward",
    "send_backward_recv_backward",
    "send_backward_recv_forward",
    "send_forward",
    "send_forward_backward_recv_forward_backward",
    "send_forward_recv_backward",
    "send_forward_recv_forward",
]
