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
- ``MpDeviceLoader(loader, device)`` (torch_xla's ``parallel_loader``): the loader's batches on ``device``;
  ``send_cpu_data_to_device(data, device)``: ``data`` (nested lists, tuples, dicts) with its tensors on ``device``;
- ``all_gather`` / ``reduce_scatter`` with torch_xla's signatures (``groups`` as lists of global ranks);
  ``mesh_reduce(tag, data, reduce_fn)``: ``reduce_fn`` of every rank's ``data`` (any picklable object);
- ``get_rng_state`` / ``set_rng_state``: the device's generator. torch_xla's state is an integer seed; here
  ``get_rng_state`` returns the generator's whole state (a uint8 tensor), which ``set_rng_state`` restores exactly,
  and ``set_rng_state(seed)`` with an integer seeds it, as torch_xla's does;
- ``metrics_report`` and the other ``torch_xla.debug.metrics`` calls: no XLA graphs are compiled, so there are no
  counters or metrics (an empty report);
- ``spawn(fn, args, nprocs)`` (torch_xla's ``xla_multiprocessing``): under a launcher (torchrun, or a process group
  already made) ``fn(local_rank, *args)`` in this process; otherwise ``nprocs`` processes on this host (one per GPU,
  else one), each with the ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` variables ``init_process_group`` reads.

One module stands for torch_xla's ``core.xla_model``, ``runtime``, ``debug.metrics``, ``distributed.parallel_loader``
and ``distributed.xla_multiprocessing``: point each of those imports at it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshpar.compat.nxd._groups import group_among
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
    group = _group_of([list(replicas)])[0] if replicas else None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, payload, group=group)
    return gathered


def master_print(*args: Any, fd: Any = sys.stdout, finalizer: Callable[[], None] | None = None) -> None:
    if get_ordinal() == 0:
        print(*args, file=fd, flush=True)


def _group_of(groups: Sequence[Sequence[int]] | None) -> tuple[dist.ProcessGroup | None, int]:
    """The process group among ``groups`` (lists of global ranks, as torch_xla takes them) holding this rank, and
    its size; ``None``: the world. The parallel state's own groups are reused; other lists become groups the first
    time they are given and the same groups after that (:mod:`meshpar.compat.nxd._groups`): a script passing the
    same lists at every step does not make new groups every step."""
    if not groups:
        return None, xrt_world_size()
    if is_initialized():
        dims = get_parallel()
        for name in ("dp", "tp", "pp", "cp"):
            if sorted(map(sorted, groups)) == sorted(map(sorted, dims.group_ranks(name))):
                mesh = getattr(dims, f"{name}_mesh")
                return mesh.get_group(), mesh.size()
    group = group_among(groups)
    if group is None:
        raise ValueError(f"rank {get_ordinal()} is in none of the groups {groups}")
    return group, group.size()


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


def all_gather(
    value: torch.Tensor,
    dim: int = 0,
    groups: Sequence[Sequence[int]] | None = None,
    output: torch.Tensor | None = None,
    pin_layout: bool = True,
) -> torch.Tensor:
    """Every rank's ``value`` concatenated along ``dim`` in group-rank order (into ``output`` if given)."""
    if not _running():
        return value.clone() if output is None else output.copy_(value)
    from meshpar.compat.nxd.parallel_layers import comm

    return comm.all_gather(value, dim, groups, output, pin_layout)


def reduce_scatter(
    reduce_type: str,
    input: torch.Tensor,
    scale: float,
    scatter_dim: int,
    shard_count: int,
    groups: Sequence[Sequence[int]] | None = None,
    output: torch.Tensor | None = None,
    pin_layout: bool = True,
) -> torch.Tensor:
    """``input`` reduced over the group, times ``scale``; this rank's ``1/shard_count`` slice along
    ``scatter_dim``."""
    if not _running():
        if shard_count != 1:
            raise ValueError(f"reduce_scatter over one process: shard_count must be 1, got {shard_count}")
        result = input * scale if scale != 1 else input.clone()
        return result if output is None else output.copy_(result)
    from meshpar.compat.nxd.parallel_layers import comm

    return comm.reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count, groups, output, pin_layout)


def mesh_reduce(tag: str, data: Any, reduce_fn: Callable[[list[Any]], Any]) -> Any:
    """``reduce_fn`` of the list of every rank's ``data`` (in rank order), the same on every rank."""
    if not _running():
        return reduce_fn([data])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, move_all_tensor_to_cpu(data))
    return reduce_fn(gathered)


def _generator_device(device: Any) -> torch.device:
    return torch.device(device) if device is not None else xla_device()


def get_rng_state(device: Any = None) -> torch.Tensor:
    """The whole state of the device's random generator (restored exactly by :func:`set_rng_state`)."""
    where = _generator_device(device)
    return torch.cuda.get_rng_state(where) if where.type == "cuda" else torch.get_rng_state()


def set_rng_state(seed: int | torch.Tensor, device: Any = None) -> None:
    """Seed the device's random generator with an integer (torch_xla's form), or restore a state
    :func:`get_rng_state` returned."""
    where = _generator_device(device)
    if isinstance(seed, torch.Tensor):
        if where.type == "cuda":
            torch.cuda.set_rng_state(seed, where)
        else:
            torch.set_rng_state(seed)
        return
    if where.type == "cuda":
        with torch.cuda.device(where):
            torch.cuda.manual_seed(int(seed))
    else:
        torch.manual_seed(int(seed))


def send_cpu_data_to_device(data: Any, device: Any, input_sharding: Any = None, transfer_async: bool = False) -> Any:
    """``data`` with every tensor in it on ``device`` (the same nesting of lists, tuples and dicts)."""
    if input_sharding is not None:
        raise NotImplementedError(
            "send_cpu_data_to_device(input_sharding=...): XLA's SPMD sharding has no meaning here"
        )
    return _to_device(data, torch.device(device))


def metrics_report() -> str:
    """torch_xla's debug report: empty here, since no XLA graph is compiled or run."""
    return "no XLA metrics: eager PyTorch (meshpar.compat.nxd.xla) compiles no graphs\n"


short_metrics_report = metrics_report


def counter_names() -> list[str]:
    return []


def metric_names() -> list[str]:
    return []


def counter_value(name: str) -> None:
    return None


def metric_data(name: str) -> None:
    return None


def clear_all() -> None:
    """Nothing is counted, so nothing to clear."""


def _launched() -> bool:
    return _running() or "WORLD_SIZE" in os.environ


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int | None = None,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> Any:
    """torch_xla's ``xmp.spawn``: ``fn(index, *args)`` on every local process (see the module docstring)."""
    if _launched():
        local = get_local_ordinal()
        if nprocs not in (None, 1) and nprocs != local_process_count():
            raise ValueError(
                f"spawn(nprocs={nprocs}) under a launcher that started {local_process_count()} processes per host: "
                "let the launcher choose (nprocs=None)"
            )
        return fn(local, *args)
    count = nprocs if nprocs is not None else max(torch.cuda.device_count(), 1)
    if count == 1:
        return fn(0, *args)
    import socket

    import torch.multiprocessing as torch_mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return torch_mp.start_processes(
        _spawned, args=(fn, args, count, port), nprocs=count, join=join, daemon=daemon, start_method=start_method
    )


def _spawned(index: int, fn: Callable[..., Any], args: tuple, count: int, port: int) -> None:
    os.environ.update(
        RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(count), LOCAL_WORLD_SIZE=str(count),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    fn(index, *args)


__all__ += [
    "all_gather",
    "clear_all",
    "counter_names",
    "counter_value",
    "get_rng_state",
    "mesh_reduce",
    "metric_data",
    "metric_names",
    "metrics_report",
    "reduce_scatter",
    "send_cpu_data_to_device",
    "set_rng_state",
    "short_metrics_report",
    "spawn",
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
