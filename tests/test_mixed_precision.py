"""meshpar.mixed_precision: the loss scaler agrees on overflow over every rank."""

from __future__ import annotations

import torch
from torch import nn

from meshpar.mixed_precision import GradScaler
from meshpar.testing import run_distributed, setup_parallel


def fp16_scaler_case() -> tuple[bool, float]:
    dims = setup_parallel(tp=2)
    layer = nn.Linear(4, 4)
    layer.weight.grad = torch.ones(4, 4)
    if dims.tp_rank == 1 and dims.dp_rank == 0:
        layer.weight.grad[0, 0] = float("inf")  # one rank overflows
    scaler = GradScaler(init_scale=1024.0)
    before = layer.weight.detach().clone()
    taken = scaler.step(torch.optim.SGD(layer.parameters(), lr=1.0), layer.parameters())
    assert torch.equal(layer.weight, before) or taken
    return taken, scaler.scale


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere() -> None:
    results = run_distributed(fp16_scaler_case, 4)
    assert results == [(False, 512.0)] * 4
