"""The torch_xla calls an NxD training script makes, on CPU (gloo) or CUDA (NCCL): change

    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

to ``from meshpar.compat.nxd import xla as xm`` (and ``xr``). What each call means here:

- ``xla_device()``: the process's device (``cuda:LOCAL_RANK`` where torch sees one GPU per local process, else
  the CPU); ``get_ordinal`` / ``global_ordinal`` / ``get_local_ordinal`` / ``xrt_world_size`` / ``world_size`` /
  ``is_master_ordinal``: torch.distributed's rank and world (rank 0 and world 1 without a process group);
- ``mark_step`` / ``wait_device_ops``: nothing to cut: eager PyTorch runs each op as it is called (a CUDA
  ``wait_device_ops`` synchronises the device);
- ``optimizer_step(optimizer, groups=...)``: every grad averaged over its replica group (the world by default, as
  in torch_xla), then ``optimizer.step()``; ``reduce_gradients`` is the averaging alone;
- ``all_reduce(reduce_type, inputs, scale, groups)``: in place for a list, a new tensor for one tensor;
- ``rendezvous(tag)``: a barrier; ``master_print``: prints on global rank 0; ``save``: ``torch.save`` on rank 0
  (``master_only=False``: every rank), tensors moved to CPU first; ``add_step_closure``: runs the closure now;
- ``MpDeviceLoader(loader, device)`` (torch_xla's ``parallel_loader``): the loader's batches on ``device``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshpar.compat.nxd.parallel_layers.utils import move_all_tensor_to_cpu
from meshpar.parallel_dims import get_parallel, is_initialized

REDUCE_SUM = "sum"
REDUCE_MUL = "mul"
REDUCE_AND = "and"
REDUCE_OR = "or"
REDUCE_MIN = "min"
REDUCE_MAX = "max"

_OPS = {REDUCE_SUM: dist.ReduceOp.SUM, REDUCE_MIN: dist.ReduceOp.MIN, REDUCE_MAX: dist.ReduceOp.MAX,
        REDUCE_MUL: dist.ReduceOp.PRODUCT, REDUCE_AND: dist.ReduceOp.BAND, REDUCE_OR: dist.ReduceOp.BOR}  # fmt: skip


def _running() -> bool:
    return dist.is_available() and dist.is_initialized()


def xla_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    """The device this process computes on (see the module docstring)."""
    if is_initialized():
        return get_parallel().device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and torch.cuda.device_count() > local:
        return torch.device("cuda", local)
    return torch.device("cpu")


def get_xla_supported_devices(devkind: str | None = None, max_devices: int | None = None) -> list[str]:
    return [str(xla_device())]


def get_ordinal(defval: int = 0) -> int:
    return dist.get_rank() if _running() else defval


global_ordinal = get_ordinal


def get_local_ordinal(defval: int = 0) -> int:
    return int(os.environ.get("LOCAL_RANK", defval))


local_ordinal = get_local_ordinal


def xrt_world_size(defval: int = 1) -> int:
    return dist.get_world_size() if _running() else defval


world_size = xrt_world_size


def local_process_count() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", xrt_world_size()))


def is_master_ordinal(local: bool = True) -> bool:
    return (get_local_ordinal() if local else get_ordinal()) == 0


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """Nothing to cut: eager PyTorch has already run every op."""
    if wait:
        wait_device_ops()


def wait_device_ops(devices: Sequence[str] = ()) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def add_step_closure(closure: Callable[..., Any], args: tuple = (), run_async: bool = False) -> None:
    """torch_xla runs the closure after the step's graph; eagerly the step has already run."""
    closure(*args)


def rendezvous(tag: str, payload: bytes = b"", replicas: Sequence[int] = ()) -> list[bytes]:
    """A barrier over the world (``replicas``: over those ranks); returns every rank's ``payload``."""
    if not _running():
        return [payload]
    group = dist.new_group(list(replicas)) if replicas else None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, payload, group=group)
    return gathered


def master_print(*args: Any, fd: Any = sys.stdout, finalizer: Callable[[], None] | None = None) -> None:
    if get_ordinal() == 0:
        print(*args, file=fd, flush=True)


def _group_of(groups: Sequence[Sequence[int]] | None) -> tuple[dist.ProcessGroup | None, int]:
    """The process group among ``groups`` (lists of global ranks, as torch_xla takes them) holding this rank, and
    its size; ``None``: the world. The parallel state's own groups are reused; other lists become new groups (every
    rank makes every group, as c10d requires)."""
    if not groups:
        return None, xrt_world_size()
    if is_initialized():
        dims = get_parallel()
        for name in ("dp", "tp", "pp", "cp"):
            if sorted(map(sorted, groups)) == sorted(map(sorted, dims.group_ranks(name))):
                mesh = getattr(dims, f"{name}_mesh")
                return mesh.get_group(), mesh.size()
    mine = None
    for ranks in groups:
        group = dist.new_group(list(ranks))
        if get_ordinal() in ranks:
            mine = (group, len(ranks))
    if mine is None:
        raise ValueError(f"rank {get_ordinal()} is in none of the groups {groups}")
    return mine


def all_reduce(
    reduce_type: str,
    inputs: torch.Tensor | list[torch.Tensor],
    scale: float = 1.0,
    groups: Sequence[Sequence[int]] | None = None,
    pin_layout: bool = True,
) -> torch.Tensor | list[torch.Tensor]:
    """``reduce_type`` over the group, times ``scale``: a list is reduced in place (and returned), one tensor is
    returned as a new reduced tensor."""
    if reduce_type not in _OPS:
        raise ValueError(f"reduce_type must be one of {sorted(_OPS)}, got {reduce_type!r}")
    group, _ = _group_of(groups)
    single = isinstance(inputs, torch.Tensor)
    tensors = [inputs.clone()] if single else list(inputs)
    for tensor in tensors:
        if _running():
            dist.all_reduce(tensor, op=_OPS[reduce_type], group=group)
        if scale != 1.0:
            tensor.mul_(scale)
    return tensors[0] if single else tensors


def reduce_gradients(optimizer: torch.optim.Optimizer, groups: Sequence[Sequence[int]] | None = None,
                     pin_layout: bool = True) -> None:  # fmt: skip
    """Average every grad the optimizer holds over its replica group (the world by default)."""
    group, size = _group_of(groups)
    if not _running() or size == 1:
        return
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            if param.grad is not None:
                grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                dist.all_reduce(grad, group=group)
                grad.div_(size)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    barrier: bool = False,
    optimizer_args: dict[str, Any] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    pin_layout: bool = True,
) -> Any:
    """``reduce_gradients`` then ``optimizer.step(**optimizer_args)``; returns what the step returns."""
    reduce_gradients(optimizer, groups=groups)
    return optimizer.step(**(optimizer_args or {}))


def save(data: Any, file_or_path: Any, master_only: bool = True, global_master: bool = False) -> None:
    """``torch.save`` of ``data`` with its tensors on CPU, by rank 0 (``master_only``; ``global_master=False``:
    local rank 0 of each host) or by every rank; then a barrier."""
    writer = (get_ordinal() == 0) if global_master else is_master_ordinal(local=True)
    if not master_only or writer:
        torch.save(move_all_tensor_to_cpu(data), file_or_path)
    if _running():
        dist.barrier()


__all__ = [
    "REDUCE_AND",
    "REDUCE_MAX",
    "REDUCE_MIN",
    "REDUCE_MUL",
    "REDUCE_OR",
    "REDUCE_SUM",
    "add_step_closure",
    "all_reduce",
    "get_local_ordinal",
    "get_ordinal",
    "get_xla_supported_devices",
    "global_ordinal",
    "is_master_ordinal",
    "local_ordinal",
    "local_process_count",
    "mark_step",
    "master_print",
    "optimizer_step",
    "reduce_gradients",
    "rendezvous",
    "save",
    "wait_device_ops",
    "world_size",
    "xla_device",
    "xrt_world_size",
]


class MpDeviceLoader:
    """torch_xla's ``parallel_loader.MpDeviceLoader(loader, device)``: iterates ``loader`` with every tensor of each
    batch moved to ``device``."""

    def __init__(self, loader: Any, device: torch.device | str, **kwargs: Any) -> None:
        self._loader, self._device = loader, torch.device(device)

    def __iter__(self) -> Any:
        for batch in self._loader:
            yield _to_device(batch, self._device)

    def __len__(self) -> int:
        return len(self._loader)


def _to_device(data: Any, device: torch.device) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, dict):
        return {key: _to_device(value, device) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_to_device(value, device) for value in data)
    return data


__all__ += ["MpDeviceLoader"]
