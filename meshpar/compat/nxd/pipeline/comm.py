"""``neuronx_distributed.pipeline.comm``: sends and receives between neighbouring pipeline ranks (a tensor to the
next / from the previous rank, or the other way; Python objects pickled), on torch.distributed point-to-point over
the pipeline group, and NxD's ``rmsg``. meshpar's own pipelines do not use these: their executor posts its receives
ahead in the sender's order (:mod:`meshpar.pipeline._inbox`)."""

from __future__ import annotations

import pickle
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from meshpar.compat.nxd.parallel_layers.parallel_state import rmsg
from meshpar.compat.nxd.utils.serialization import TensorMeta
from meshpar.parallel_dims import get_parallel

MAX_LENGTH = 2**20  # NxD's bound on a pickled object's size
MAX_RETRY = 3
# NxD's per-tag counters of its TCP-store transfers (kept for code that reads them; transfers here use p2p)
kv_tag_send_count: dict[str, int] = defaultdict(int)
kv_tag_recv_count: dict[str, int] = defaultdict(int)


def _neighbour(next_rank: bool) -> int:
    dims = get_parallel()
    ranks = dist.get_process_group_ranks(dims.pp_mesh.get_group())
    return ranks[(dims.pp_rank + (1 if next_rank else -1)) % dims.pp]


def send(tensor: torch.Tensor, send_next: bool = True, all_reduce_send_recv: bool = False) -> torch.Tensor:
    """``tensor`` to the next pipeline rank (``send_next=False``: the previous one); returns it."""
    dist.send(tensor.contiguous(), dst=_neighbour(send_next))
    return tensor


def recv_from(
    tensor_meta: TensorMeta, recv_prev: bool = True, tracing: bool = False, all_reduce_send_recv: bool = False
) -> torch.Tensor:
    """A tensor of ``tensor_meta``'s shape and dtype from the previous pipeline rank (``recv_prev=False``: the next)."""
    out = torch.empty(tensor_meta.shape, dtype=tensor_meta.dtype, device=get_parallel().device)
    dist.recv(out, src=_neighbour(not recv_prev))
    return out.requires_grad_(tensor_meta.requires_grad) if out.is_floating_point() else out


def send_python_object(obj: Any, send_next: bool = True, method: str = "tcp") -> None:
    """``obj`` pickled to the next (or previous) pipeline rank: its length, then its bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    if data.numel() > MAX_LENGTH:
        raise ValueError(f"the pickled object is {data.numel()} bytes; NxD's limit is {MAX_LENGTH}")
    device = get_parallel().device
    dst = _neighbour(send_next)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), dst=dst)
    dist.send(data.to(device), dst=dst)


def recv_python_object(recv_prev: bool = True, method: str = "tcp") -> Any:
    device = get_parallel().device
    src = _neighbour(not recv_prev)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, src=src)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(data, src=src)
    return pickle.loads(data.cpu().numpy().tobytes())


__all__ = [
    "MAX_LENGTH",
    "MAX_RETRY",
    "kv_tag_recv_count",
    "kv_tag_send_count",
    "recv_from",
    "recv_python_object",
    "rmsg",
    "send",
    "send_python_object",
]
