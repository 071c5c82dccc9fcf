"""Every tp, cp and pp rank of one dp replica must compute on the same batch: its ranks each hold a part of the
model (tp, pp: every stage reads the batch's masks and positions, the last its labels) or take their part of each
sequence (cp) from it. A loader sharded over every rank instead
of over dp (``DistributedSampler()`` with its defaults, the usual slip) hands them different batches, and the step
then mixes them into a number that is wrong without any error. :func:`check_same_batch` compares a fingerprint of
each rank's batch (exact integer arithmetic on the tensors' bits, so equal batches always agree) with one small
all-reduce over the world, and every rank raises together when the peers of any replica differ.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from meshpar.failure import shared_refusal
from meshpar.parallel_dims import ParallelDims

_MODULUS = 2**61 - 1  # fingerprints are reduced into [0, 2**61): their negations never overflow int64
_INTEGER_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def batch_fingerprint(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A 0-d int64 fingerprint of named tensors: their names, shapes, dtypes and every element's bits, position
    weighted (int64 arithmetic wraps the same way on every device, so equal inputs give equal fingerprints)."""
    acc: torch.Tensor | None = None
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        flat = tensor.reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        elif flat.is_floating_point() or flat.is_complex():
            flat = flat.contiguous().view(_INTEGER_VIEWS[flat.element_size()])
        content = _content(flat)
        header = zlib.crc32(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        value = content * 1_000_003 + header
        acc = value if acc is None else acc * 31 + value
    if acc is None:
        return torch.zeros((), dtype=torch.int64)
    return torch.remainder(acc, _MODULUS)


_CHUNK = 1 << 20  # elements per step: a large batch (inputs_embeds) is never copied whole into int64


def _content(flat: torch.Tensor) -> torch.Tensor:
    """A position-weighted int64 sum of a flat integer tensor, chunk by chunk (each chunk's sum folded into the
    running value, so the order of the chunks counts too)."""
    weights = torch.arange(1, min(flat.numel(), _CHUNK) + 1, device=flat.device, dtype=torch.int64)
    content = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start : start + _CHUNK].to(torch.int64)
        content = content * 1_000_003 + (part * weights[: part.numel()]).sum()
    return content


def check_same_batch(tensors: Mapping[str, torch.Tensor], dims: ParallelDims, entry: str) -> None:
    """Raise on every rank if the tp / cp / pp ranks of any dp replica were given different ``tensors``; a
    collective of every rank (nothing to compare, and no collective, where tp x cp x pp is 1)."""
    if dims.tp * dims.cp * dims.pp == 1:
        return
    slots, mine = dims.dp, dims.dp_rank
    fingerprint = batch_fingerprint(tensors).to(dims.device)
    # per slot: the highest fingerprint, and the highest negated one (minus the lowest); -2**62 from the other ranks
    box = torch.full((2, slots), -(2**62), dtype=torch.int64, device=dims.device)
    box[0, mine], box[1, mine] = fingerprint, -fingerprint
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    differ = (box[0] != -box[1]).nonzero().flatten().tolist()
    if differ:
        where = ", ".join(f"dp rank {slot}" for slot in differ)
        raise shared_refusal(
            ValueError(
                f"{entry}: the tp / cp / pp ranks of one data-parallel replica were given different batches "
                f"({where}); each of them computes its part of the same batch (tp={dims.tp}, cp={dims.cp}, "
                f"pp={dims.pp}), so they must all be handed it: shard the data over dp only "
                "(meshpar.data.make_dataloader, or DistributedSampler(num_replicas=dims.dp, rank=dims.dp_rank)), "
                "not over every rank"
            )
        )  # every rank saw the same all-reduced fingerprints: all raise alike, and the job stays usable
