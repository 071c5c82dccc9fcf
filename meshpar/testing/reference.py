"""Helpers to compare sharded results with a dense single-process reference."""

from __future__ import annotations

import torch

from meshpar._compat import DeviceMesh, DTensor
from meshpar._shards import local_slice
from meshpar.parallel_dims import ParallelDims, _set_parallel


def setup_parallel(
    tp: int = 1, pp: int = 1, dp: int = -1, *, seed: int = 1234, ep: int = 1, cp: int = 1
) -> ParallelDims:
    """``init_parallel`` for tests on CPU workers whose default group is already up (the mesh of an earlier test
    with the same layout is reused, as ``init_parallel`` does)."""
    import torch.distributed as dist

    from meshpar.random import model_parallel_manual_seed

    dims = ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dist.get_world_size(), seed=seed, ep=ep, cp=cp)
    dims.build_mesh("cpu")
    _set_parallel(dims)
    model_parallel_manual_seed(seed, dims)
    return dims


def shard_of(dense: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """This rank's slice of ``dense`` when split evenly along ``dim`` over ``mesh``."""
    return dense.chunk(mesh.size(), dim)[mesh.get_local_rank()]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def expected_local(dense: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The slice of ``dense`` that a DTensor ``like`` (param or grad) holds on this rank."""
    return local_slice(dense, like)


def assert_matches_dense(
    actual: torch.Tensor, dense: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5, msg: str = ""
) -> None:
    torch.testing.assert_close(local(actual), expected_local(dense, actual), atol=atol, rtol=rtol, msg=msg or None)
