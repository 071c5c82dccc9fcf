"""Data for parallel training: every tp and pp rank of one dp replica sees the same batch.

``make_dataloader`` shards a dataset over dp only (NxD's ``DistributedSampler(num_replicas=dp, rank=dp_rank)``
pattern); ``broadcast_data`` (apex) sends a batch that only tp rank 0 read to the other tp ranks.
``move_model_to_device`` moves a model whose parameters are DTensors without losing their placements.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from meshpar._compat import DTensor, local_tensor
from meshpar.parallel_dims import ParallelDims


def data_parallel_sampler(
    dataset: Dataset, dims: ParallelDims, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True
) -> DistributedSampler:
    """A sampler giving each dp replica its share of ``dataset`` (every tp and pp rank of a replica the same)."""
    return DistributedSampler(
        dataset, num_replicas=dims.dp, rank=dims.dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )


def make_dataloader(
    dataset: Dataset, batch_size: int, dims: ParallelDims, *, shuffle: bool = True, seed: int = 0, **kwargs: Any
) -> DataLoader:
    """A loader of per-dp-replica batches of ``batch_size``; call ``loader.sampler.set_epoch(e)`` each epoch."""
    sampler = data_parallel_sampler(dataset, dims, shuffle=shuffle, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **kwargs)


def broadcast_data(
    keys: list[str], data: dict[str, torch.Tensor] | None, dtype: torch.dtype, dims: ParallelDims
) -> dict[str, torch.Tensor]:
    """Megatron's ``broadcast_data``: tp rank 0 holds ``data``; every tp rank returns the same tensors of ``dtype``."""
    group = dims.tp_mesh.get_group()
    src = dist.get_process_group_ranks(group)[0]
    if dims.tp_rank == 0:
        missing = [k for k in keys if data is None or k not in data]
        if missing:
            raise KeyError(f"broadcast_data: keys {missing} are not in the batch")
        shapes = [list(data[k].shape) for k in keys]
    else:
        shapes = None
    box = [shapes]
    dist.broadcast_object_list(box, src=src, group=group)
    shapes = box[0]
    sizes = [int(torch.tensor(s).prod()) if s else 1 for s in shapes]
    if dims.tp_rank == 0:
        flat = torch.cat([data[k].to(dims.device, dtype).reshape(-1) for k in keys])
    else:
        flat = torch.empty(sum(sizes), dtype=dtype, device=dims.device)
    dist.broadcast(flat, src=src, group=group)
    out, offset = {}, 0
    for key, shape, size in zip(keys, shapes, sizes, strict=True):
        out[key] = flat[offset : offset + size].view(shape)
        offset += size
    return out


@torch.no_grad()
def move_model_to_device(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model.to(device)`` for parallel models: what is already there stays untouched; plain parameters move in
    place (``.data``: the same objects, so optimizers and attributes set on parameters stay valid); DTensor
    parameters keep their mesh, placements and attributes."""
    device = torch.device(device)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device == device:
                continue
            if isinstance(param, DTensor):
                local = local_tensor(param).to(device)
                moved = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
                new = nn.Parameter(moved, requires_grad=param.requires_grad)
                new.__dict__.update({k: v for k, v in param.__dict__.items() if not k.startswith("_")})
                module._parameters[name] = new
                continue
            moved = param.data.to(device)
            try:
                param.data = moved
            except RuntimeError:  # another tensor type there (meta, XLA): swap the data, keep the attributes
                attributes = dict(param.__dict__)
                torch.utils.swap_tensors(param, nn.Parameter(moved, requires_grad=param.requires_grad))
                param.__dict__.update(attributes)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)
    return model
