"""meshpar.data: batches shared over tp and split over dp, moving a parallel model between devices."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from meshpar._compat import DTensor
from meshpar.data import broadcast_data, make_dataloader, move_model_to_device
from meshpar.tensor_parallel import ColumnParallel, RowParallel
from meshpar.testing import run_distributed, setup_parallel


def loader_case() -> list[list[int]]:
    dims = setup_parallel(tp=2)
    loader = make_dataloader(list(range(16)), 2, dims, shuffle=True, seed=3)
    batches = [b.tolist() for b in loader]
    data = {"ids": torch.arange(6).view(2, 3)} if dims.tp_rank == 0 else None
    got = broadcast_data(["ids"], data, torch.int64, dims)
    assert torch.equal(got["ids"], torch.arange(6).view(2, 3))
    return batches


def test_tp_ranks_share_batches_and_dp_ranks_split_the_data() -> None:
    r0, r1, r2, r3 = run_distributed(loader_case, 4)
    assert r0 == r1 and r2 == r3  # same dp replica, different tp ranks
    seen = sorted(x for batch in r0 + r2 for x in batch)
    assert seen == list(range(16))  # the two replicas partition the dataset


def move_case() -> bool:
    dims = setup_parallel(tp=2)
    model = parallelize_module(
        nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), dims.tp_mesh, {"0": ColumnParallel(), "1": RowParallel()}
    )
    model[0].weight.tp_note = "kept"
    move_model_to_device(model, "cpu")
    assert isinstance(model[0].weight, DTensor) and model[0].weight.placements == model[0].weight.placements
    assert model[0].weight.tp_note == "kept"
    return str(model[1].weight.placements) == "(Shard(dim=1),)"


def test_move_model_to_device_keeps_placements_and_attributes() -> None:
    assert run_distributed(move_case, 2) == [True, True]
