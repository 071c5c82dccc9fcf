"""``apex.transformer.pipeline_parallel.schedules.fwd_bwd_pipelining_without_interleaving``: 1F1B on meshpar's
executor, and apex's helpers of that module (``get_tensor_shapes`` and the list forms of the neighbour transfers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from meshpar.compat.apex import parallel_state
from meshpar.compat.apex.enums import ModelType
from meshpar.compat.apex.pipeline_parallel import p2p_communication
from meshpar.compat.apex.pipeline_parallel.schedules.common import (
    FwdStepFunc,
    _chunks,
    _is_encoder_or_decoder,
    _options,
    _pipelined,
)

__all__ = ["forward_backward_pipelining_without_interleaving"]

Shapes = list[Sequence[int] | None]


def get_tensor_shapes(
    rank: int,
    model_type: ModelType,
    *,
    tensor_shape: Sequence[int],
    decoder_sequence_length: int | None = None,
    sequence_parallel_enabled: bool = False,
) -> list[tuple[int, int, int]]:
    """The shapes pipeline rank ``rank`` sends / receives for ``tensor_shape = (seq, micro_batch, hidden)``: the
    sequence divided by tp under sequence parallelism; an encoder-decoder's decoder stages also carry the encoder's
    output, so they get ``[(decoder_seq, b, h), (seq, b, h)]``."""
    if len(tensor_shape) != 3:
        raise ValueError(f"tensor_shape must be (seq_length, micro_batch_size, hidden_size), got {tensor_shape}")
    seq, batch, hidden = tensor_shape
    decoder_seq = decoder_sequence_length
    if sequence_parallel_enabled:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        seq = seq // tp
        decoder_seq = decoder_seq // tp if decoder_seq is not None else None
    if _is_encoder_or_decoder(model_type) or parallel_state.is_pipeline_stage_before_split(rank):
        return [(seq, batch, hidden)]
    if decoder_seq is None:
        raise ValueError("an encoder-decoder model's decoder stages need decoder_sequence_length")
    return [(decoder_seq, batch, hidden), (seq, batch, hidden)]


def recv_forward(tensor_shapes: Shapes, *, dtype: torch.dtype | None = None, **tuning: Any) -> list:
    return [None if s is None else p2p_communication.recv_forward(s, dtype=dtype, **tuning) for s in tensor_shapes]


def recv_backward(tensor_shapes: Shapes, *, dtype: torch.dtype | None = None, **tuning: Any) -> list:
    return [None if s is None else p2p_communication.recv_backward(s, dtype=dtype, **tuning) for s in tensor_shapes]


def _listed(tensors: Any) -> list:
    return tensors if isinstance(tensors, list) else [tensors]


def send_forward(
    output_tensors: Any, tensor_shapes: Shapes, *, dtype: torch.dtype | None = None, **tuning: Any
) -> None:
    for tensor, shape in zip(_listed(output_tensors), tensor_shapes, strict=False):
        if shape is not None:
            p2p_communication.send_forward(tensor, tensor_shape=shape, dtype=dtype, **tuning)


def send_backward(
    input_tensor_grads: Any, tensor_shapes: Shapes, *, dtype: torch.dtype | None = None, **tuning: Any
) -> None:
    for tensor, shape in zip(_listed(input_tensor_grads), tensor_shapes, strict=False):
        if shape is not None:
            p2p_communication.send_backward(tensor, tensor_shape=shape, dtype=dtype, **tuning)


def send_forward_recv_backward(
    output_tensors: Any, tensor_shapes: Shapes, *, dtype: torch.dtype | None = None, **tuning: Any
) -> list:
    return [
        None if shape is None else p2p_communication.send_forward_recv_backward(tensor, shape, dtype=dtype, **tuning)
        for tensor, shape in zip(_listed(output_tensors), tensor_shapes, strict=False)
    ]


def send_backward_recv_forward(
    input_tensor_grads: Any, tensor_shapes: Shapes, *, dtype: torch.dtype | None = None, **tuning: Any
) -> list:
    return [
        None if shape is None else p2p_communication.send_backward_recv_forward(tensor, shape, dtype=dtype, **tuning)
        for tensor, shape in zip(_listed(input_tensor_grads), tensor_shapes, strict=False)
    ]


def forward_backward_pipelining_without_interleaving(
    forward_step_func: FwdStepFunc, batch: Any, model: nn.Module | Sequence[nn.Module], *, forward_only: bool, **kwargs
) -> list[Any]:
    """1F1B: ``pp - rank - 1`` warm-up forwards, then one forward one backward, then the cool-down backwards."""
    if len(_chunks(model)) != 1:
        raise ValueError("the non-interleaved schedule takes one model chunk per rank")
    return _pipelined(
        forward_step_func,
        batch,
        model,
        _options(forward_only, kwargs, "forward_backward_pipelining_without_interleaving"),
    )
