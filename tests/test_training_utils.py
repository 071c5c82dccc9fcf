"""Data helpers, device moves, mixed precision and activation checkpointing on sharded models."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from meshpar import get_rng_tracker
from meshpar._compat import DTensor
from meshpar.data import broadcast_data, make_dataloader, move_model_to_device
from meshpar.data_parallel import allreduce_gradients, apply_activation_checkpointing
from meshpar.mixed_precision import GradScaler
from meshpar.optim import DistributedOptimizer
from meshpar.tensor_parallel import ColumnParallel, RowParallel
from meshpar.testing import run_distributed, setup_parallel
from meshpar.testing.dispatch import AtenOps


def loader_case() -> list[list[int]]:
    dims = setup_parallel(tp=2)
    loader = make_dataloader(list(range(16)), batch_size=2, shuffle=True, seed=3)
    batches = [b.tolist() for b in loader]
    data = {"ids": torch.arange(6).view(2, 3)} if dims.tp_rank == 0 else None
    got = broadcast_data(["ids"], data, torch.int64)
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


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        with get_rng_tracker().fork():  # sharded region: per-rank masks
            h = F.dropout(h, 0.3)
        return F.dropout(self.fc2(h), 0.2)  # replicated region: same mask on every tp rank


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DropoutMLP() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def checkpointing_case(compile: bool) -> tuple[bool, int]:
    dims = setup_parallel(tp=2, seed=5)
    plan = {"blocks.*.fc1": ColumnParallel(), "blocks.*.fc2": RowParallel()}
    torch.manual_seed(0)
    plain = parallelize_module(Net(), dims.tp_mesh, plan)
    recomputed = apply_activation_checkpointing(copy.deepcopy(plain), DropoutMLP, compile_blocks=compile)
    if compile:  # the reference: the same blocks compiled, without checkpointing
        for block in plain.blocks:
            block.forward = torch.compile(block.forward)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x = torch.randn(4, 16)
    grads = []
    for model in (plain, recomputed):
        setup_parallel(tp=2, seed=5)  # same RNG streams for both runs
        model(x).square().sum().backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), graphs


@pytest.mark.parametrize("compile", [False, True])
def test_activation_checkpointing_reproduces_tp_dropout_exactly(compile: bool) -> None:
    """Sharded-region dropout (TP RNG tracker) and replicated dropout replay exactly on recompute, also with each
    block compiled inside the checkpoint (``compile_blocks``)."""
    for equal, graphs in run_distributed(checkpointing_case, 2, compile, timeout=600):
        assert equal
        assert (graphs > 0) == compile


def bf16_case() -> float:
    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    model = parallelize_module(
        copy.deepcopy(dense).to(torch.bfloat16), dims.tp_mesh, {"0": ColumnParallel(), "2": RowParallel()}
    )
    opt = DistributedOptimizer(model, torch.optim.SGD, master_weights=True, lr=0.1)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    for _ in range(3):
        dense_opt.zero_grad()
        dense(x).square().mean().backward()
        dense_opt.step()
        opt.zero_grad()
        model(x.bfloat16()).float().square().mean().backward()
        allreduce_gradients(model.parameters(), reduce_dtype=torch.float32)
        opt.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert opt.state_bytes() > 0  # fp32 masters live in the optimizer
    master = opt.state_dict()["state"]["0.weight"]["master_weight"]
    expected = dense[0].weight.detach().chunk(2)[dims.tp_rank]
    return float((master.to_local() - expected).abs().max())


def test_bf16_params_with_fp32_master_weights_track_the_fp32_run() -> None:
    errors = run_distributed(bf16_case, 4)
    assert max(errors) < 2e-2  # bf16 compute noise only; without masters 0.1 * grad updates would be lost to rounding


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


def _mixed_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).to(dtype)


def test_optimizer_step_writes_nothing_back_when_leaves_share_the_parameters() -> None:
    """fp32 parameters (master_weights or not) are stepped in place: no copy-back, no master copy, no master state."""
    model = _mixed_model(torch.float32)
    opt = DistributedOptimizer(model, torch.optim.SGD, master_weights=True, lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    with AtenOps() as counter:
        opt.step()
    assert counter.compute["copy_"] == 0, counter.compute
    momentum_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert opt.state_bytes() == momentum_bytes
    assert all("master_weight" not in entry for entry in opt.state_dict()["state"].values())


def test_bf16_master_weights_are_counted_and_copied_back() -> None:
    model = _mixed_model(torch.bfloat16)
    opt = DistributedOptimizer(model, torch.optim.SGD, master_weights=True, lr=0.1)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    with AtenOps() as counter:
        opt.step()
    params = list(model.parameters())
    assert counter.compute["copy_"] == len(params)  # one fp32 -> bf16 write-back per parameter
    assert opt.state_bytes() == sum(p.numel() * 4 for p in params)  # plain SGD: the fp32 masters are the state
    assert set(opt.state_dict()["state"]["0.weight"]) == {"master_weight"}
