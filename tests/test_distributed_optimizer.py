"""ZeRO-1 with reduce-scattered grads (``DistributedOptimizer(zero1=True, reduce_scatter_grads=True)``) vs the dense
step: gradient accumulation, uneven tp shards, bf16 with fp32 masters, the collectives of a step, misuse."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from meshpar._compat import CommDebugMode
from meshpar.data_parallel import allreduce_gradients, apply_fsdp
from meshpar.optim import DistributedOptimizer
from meshpar.parallel_dims import get_parallel
from meshpar.tensor_parallel import ColumnParallel, RowParallel
from meshpar.testing import assert_matches_dense, run_distributed, setup_parallel
from meshpar.testing.dispatch import AtenOps, comm_counts
from tests._models import TinyTransformer, block_plan

BATCH, MICROBATCHES = 8, 2


def _loss(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((model(x) - target) ** 2).mean()


def accumulation_case(tp: int, layers: int, max_norm: float) -> None:
    """Two microbatches per dp rank accumulate local grads; one reduce-scatter in the step averages them over dp and
    the clipping norm comes from the owned parts alone (tp shards, tp-replicated norms, dp owners)."""
    dims = setup_parallel(tp=tp)
    torch.manual_seed(0)
    dense = TinyTransformer(hidden=16, heads=4, ffn=24, layers=layers)
    model = parallelize_module(copy.deepcopy(dense), dims.tp_mesh, block_plan())
    torch.manual_seed(1)
    x, target = torch.randn(BATCH, 8, 16), torch.randn(BATCH, 8, 16)
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-2, eps=1e-4)
    _loss(dense, x, target).backward()
    dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)
    dense_opt.step()

    opt = DistributedOptimizer(
        model, torch.optim.AdamW, zero1=True, reduce_scatter_grads=True, dims=dims, lr=1e-2, eps=1e-4
    )
    per_rank = BATCH // dims.dp
    mine = slice(dims.dp_rank * per_rank, (dims.dp_rank + 1) * per_rank)
    for xs, ts in zip(x[mine].chunk(MICROBATCHES), target[mine].chunk(MICROBATCHES), strict=True):
        (_loss(model, xs, ts) / MICROBATCHES).backward()
    norm = opt.clip_grad_norm(max_norm)
    assert all(p.grad is None for p in model.parameters())  # the local, un-averaged grads are freed
    torch.testing.assert_close(norm, dense_norm, atol=1e-5, rtol=1e-5)
    opt.step()
    dense_params = dict(dense.named_parameters())
    for name, param in model.named_parameters():
        assert_matches_dense(param.detach(), dense_params[name].detach(), atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("tp", "layers"), [(1, 2), (2, 3)])
def test_accumulated_reduce_scattered_step_equals_dense(tp: int, layers: int) -> None:
    run_distributed(accumulation_case, 4, tp, layers, 0.05)


def bf16_case() -> None:
    """bf16 parameters, fp32 masters and an fp32 reduction: the reduce-scattered step equals the ZeRO-1 step on
    all-reduced grads (same fp32 arithmetic, so to the last bf16 bit)."""
    dims = setup_parallel(tp=1)
    torch.manual_seed(0)
    base = TinyTransformer(hidden=16, heads=4, ffn=24, layers=2).to(torch.bfloat16)
    torch.manual_seed(1 + dims.dp_rank)
    x, target = torch.randn(2, 8, 16, dtype=torch.bfloat16), torch.randn(2, 8, 16, dtype=torch.bfloat16)
    results = []
    for reduce_scatter in (False, True):
        model = copy.deepcopy(base)
        opt = DistributedOptimizer(
            model,
            torch.optim.AdamW,
            zero1=True,
            reduce_scatter_grads=reduce_scatter,
            reduce_dtype=torch.float32,
            master_weights=True,
            dims=dims,
            lr=1e-2,
        )
        _loss(model, x, target).float().backward()
        if not reduce_scatter:
            allreduce_gradients(model.parameters(), dims.dp_mesh, reduce_dtype=torch.float32)
        opt.step()
        results.append(model)
    for (name, a), b in zip(results[0].named_parameters(), results[1].parameters(), strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=name)
        assert not torch.equal(a, base.get_parameter(name)), name  # the step did move it


def test_bf16_masters_with_fp32_reduce_scatter() -> None:
    run_distributed(bf16_case, 2)


def collectives_case(reduce_scatter: bool) -> dict:
    """The dp collectives of one step: ``reduce_scatter`` makes them one reduce-scatter and one all-gather (the bytes
    of one all-reduce); the other way is an all-reduce plus the same all-gather."""
    dims = setup_parallel(tp=1)
    torch.manual_seed(0)
    model = TinyTransformer(hidden=16, heads=4, ffn=24, layers=2)
    opt = DistributedOptimizer(
        model, torch.optim.SGD, zero1=True, reduce_scatter_grads=reduce_scatter, dims=dims, lr=0.1
    )
    _loss(model, torch.randn(2, 8, 16), torch.randn(2, 8, 16)).backward()
    with CommDebugMode() as mode:
        if not reduce_scatter:
            allreduce_gradients(model.parameters(), dims.dp_mesh)
        opt.step()
    return dict(comm_counts(mode))


def test_reduce_scattered_step_issues_one_reduce_scatter_and_one_all_gather() -> None:
    assert run_distributed(collectives_case, 2, True)[0] == {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1}
    assert run_distributed(collectives_case, 2, False)[0] == {"all_reduce": 1, "all_gather_into_tensor": 1}


def _refusal(model: torch.nn.Module) -> str:
    """The ValueError message of building a ZeRO-1 optimizer over ``model`` on this rank ("" if it was accepted)."""
    try:
        DistributedOptimizer(model, torch.optim.SGD, zero1=True, reduce_scatter_grads=True, dims=get_parallel(), lr=0.1)
    except ValueError as error:
        return str(error)
    return ""


def mismatch_case() -> str:
    dims = setup_parallel()
    return _refusal(torch.nn.Linear(4, 4 + dims.dp_rank))  # a different model on dp rank 1


def test_different_parameters_across_dp_ranks_raise_on_every_rank() -> None:
    messages = run_distributed(mismatch_case, 2)
    assert all("their ZeRO-1 owner layouts differ" in m and "dp rank 1: 2 tensors, 25 elements" in m for m in messages)


def fsdp_case() -> str:
    dims = setup_parallel()
    return _refusal(apply_fsdp(torch.nn.Sequential(torch.nn.Linear(4, 4)), dims.dp_mesh))


def test_fsdp_parameters_are_refused() -> None:
    assert all("FSDP2" in m for m in run_distributed(fsdp_case, 2))


def test_reduce_scatter_without_zero1_is_refused() -> None:
    model = TinyTransformer()
    with pytest.raises(ValueError, match="reduce_scatter_grads=True needs zero1=True"):
        DistributedOptimizer(model, torch.optim.SGD, reduce_scatter_grads=True, lr=0.1)


def bf16_master_weights_case() -> float:
    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    model = parallelize_module(
        copy.deepcopy(dense).to(torch.bfloat16), dims.tp_mesh, {"0": ColumnParallel(), "2": RowParallel()}
    )
    opt = DistributedOptimizer(model, torch.optim.SGD, master_weights=True, dims=dims, lr=0.1)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    for _ in range(3):
        dense_opt.zero_grad()
        dense(x).square().mean().backward()
        dense_opt.step()
        opt.zero_grad()
        model(x.bfloat16()).float().square().mean().backward()
        allreduce_gradients(model.parameters(), dims.dp_mesh, reduce_dtype=torch.float32)
        opt.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert opt.state_bytes() > 0  # fp32 masters live in the optimizer
    master = opt.state_dict()["state"]["0.weight"]["master_weight"]
    expected = dense[0].weight.detach().chunk(2)[dims.tp_rank]
    return float((master.to_local() - expected).abs().max())


def test_bf16_params_with_fp32_master_weights_track_the_fp32_run() -> None:
    errors = run_distributed(bf16_master_weights_case, 4)
    assert max(errors) < 2e-2  # bf16 compute noise only; without masters 0.1 * grad updates would be lost to rounding


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


def unused_parameters_case(reduce_scatter: bool) -> None:
    """AdamW with weight decay under ZeRO-1: an expert only dp rank 0's batch reaches is stepped with the dp mean of
    its grad on its owner, and a layer no rank used is skipped as the dense step skips it (not decayed with a zero
    grad). Six tensors over 4 dp ranks: some owners hold only tensors they have no grad for."""
    dims = setup_parallel()
    torch.manual_seed(0)
    dense = nn.ModuleDict({"shared": nn.Linear(8, 8), "expert": nn.Linear(8, 8), "idle": nn.Linear(8, 8)})
    model = copy.deepcopy(dense)
    x = torch.randn(2 * dims.dp, 8)
    (dense["expert"](dense["shared"](x[:2])).sum() + dense["shared"](x).sum()).backward()
    torch.optim.AdamW(dense.parameters(), lr=0.1, weight_decay=0.5).step()
    opt = DistributedOptimizer(
        model, torch.optim.AdamW, zero1=True, reduce_scatter_grads=reduce_scatter, dims=dims, lr=0.1, weight_decay=0.5
    )
    mine = model["shared"](x[2 * dims.dp_rank : 2 * dims.dp_rank + 2])
    loss = mine.sum() * dims.dp  # each rank's share of the dense sum, scaled back by the dp mean
    if dims.dp_rank == 0:
        loss = loss + model["expert"](mine).sum() * dims.dp
    loss.backward()
    if not reduce_scatter:
        allreduce_gradients(model.parameters(), dims.dp_mesh)
    opt.step()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), dense.get_parameter(name).detach(), atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("reduce_scatter", [True, False])
def test_zero1_skips_parameters_no_rank_has_a_grad_for(reduce_scatter: bool) -> None:
    run_distributed(unused_parameters_case, 4, reduce_scatter)
