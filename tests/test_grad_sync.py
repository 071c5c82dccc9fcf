"""OverlappedGradSync: dp grad averaging during backward equals the dense step's grads, on plain and DTensor (tp)
parameters, with gradient accumulation, unused parameters and fp32 reduction; misuse raises instead of hanging."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from meshpar.data_parallel import allreduce_gradients, apply_fsdp
from meshpar.grad_sync import OverlappedGradSync
from meshpar.parallel_dims import get_parallel
from meshpar.testing import assert_matches_dense, run_distributed, setup_parallel
from tests._models import TinyTransformer, block_plan

BATCH = 8


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(BATCH, 6, 16), torch.randn(BATCH, 6, 16)


def _loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((model(x) - target) ** 2).mean()


def _models(tp: int) -> tuple[nn.Module, nn.Module, object]:
    dims = setup_parallel(tp=tp)
    torch.manual_seed(0)
    dense = TinyTransformer(hidden=16, heads=4, ffn=24, layers=3)
    model = parallelize_module(copy.deepcopy(dense), dims.tp_mesh, block_plan())
    return dense, model, dims


def _my_rows(dims, microbatches: int = 1) -> list[slice]:
    per_rank = BATCH // dims.dp
    start = dims.dp_rank * per_rank
    step = per_rank // microbatches
    return [slice(start + i * step, start + (i + 1) * step) for i in range(microbatches)]


def _check_grads(dense: nn.Module, model: nn.Module) -> None:
    dense_params = dict(dense.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert_matches_dense(param.grad, dense_params[name].grad, atol=1e-6, rtol=1e-5, msg=name)


def overlap_case(tp: int, bucket_mb: float, microbatches: int) -> dict:
    dense, model, dims = _models(tp)
    sync = OverlappedGradSync(model.parameters(), dims.dp_mesh, bucket_mb=bucket_mb)
    x, target = _data()
    _loss(dense, x, target).backward()
    rows = _my_rows(dims, microbatches)
    for r in rows[:-1]:
        with sync.no_sync():
            (_loss(model, x[r], target[r]) / microbatches).backward()
        assert sync.launched == 0
    (_loss(model, x[rows[-1]], target[rows[-1]]) / microbatches).backward()
    launched_in_backward = sync.launched
    sync.finish()
    _check_grads(dense, model)
    # a second step on the same sync (state was reset) gives the same grads again
    model.zero_grad()
    for r in rows[:-1]:
        with sync.no_sync():
            (_loss(model, x[r], target[r]) / microbatches).backward()
    (_loss(model, x[rows[-1]], target[rows[-1]]) / microbatches).backward()
    sync.finish()
    _check_grads(dense, model)
    return {"buckets": sync.num_buckets, "launched": launched_in_backward}


@pytest.mark.parametrize("tp", [1, 2])
def test_overlapped_sync_equals_dense_grads(tp: int) -> None:
    # 1 KiB buckets: many buckets, every one of them launched by backward itself, before finish()
    results = run_distributed(overlap_case, 4, tp, 1 / 1024, 1)
    assert all(r["buckets"] > 4 and r["launched"] == r["buckets"] for r in results), results
    # one big bucket: the single all-reduce starts when the last grad (the first layer's) lands
    results = run_distributed(overlap_case, 4, tp, 25.0, 1)
    assert all(r == {"buckets": 1, "launched": 1} for r in results), results


def test_overlapped_sync_with_gradient_accumulation() -> None:
    results = run_distributed(overlap_case, 2, 1, 1 / 256, 2)
    assert all(r["launched"] == r["buckets"] for r in results), results


def unused_and_dtype_case() -> dict:
    dims = setup_parallel()
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(8, 8), "unused": nn.Linear(8, 8)}).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    torch.manual_seed(dims.dp_rank)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    sync = OverlappedGradSync(model.parameters(), dims.dp_mesh, bucket_mb=1 / 1024, reduce_dtype=torch.float32)
    model["used"](x).sum().backward()
    launched = sync.launched
    sync.finish()
    reference["used"](x).sum().backward()
    allreduce_gradients(reference.parameters(), dims.dp_mesh, reduce_dtype=torch.float32)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, dict(reference.named_parameters())[name].grad, atol=0, rtol=0)
    return {"unused_grads": [p.grad is None for p in model["unused"].parameters()], "launched": launched}


def test_unused_parameters_and_fp32_reduction() -> None:
    results = run_distributed(unused_and_dtype_case, 2)
    # buckets holding the unused layer never fill during backward; finish() launches them with zeros
    assert all(r["unused_grads"] == [True, True] and r["launched"] == 0 for r in results), results


def used_on_one_rank_case(overlapped: bool) -> list[str]:
    """An expert only dp rank 0's batch reaches: every rank must end with the dense step's grad for it (half of rank
    0's, the dp mean), not rank 1 with ``None`` (its replica would skip the step and drift); a layer no rank used
    keeps ``None`` everywhere. Checked on a tp DTensor parameter too."""
    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    dense = nn.ModuleDict({"shared": nn.Linear(8, 8), "expert": nn.Linear(8, 8), "idle": nn.Linear(8, 8)})
    model = parallelize_module(copy.deepcopy(dense), dims.tp_mesh, {"expert": ColwiseParallel()})
    x = torch.randn(2 * dims.dp, 8)
    rows = slice(2 * dims.dp_rank, 2 * dims.dp_rank + 2)
    (dense["expert"](dense["shared"](x[:2])).sum() + dense["shared"](x).sum()).backward()
    sync = OverlappedGradSync(model.parameters(), dims.dp_mesh, bucket_mb=1 / 1024) if overlapped else None
    mine = model["shared"](x[rows])
    loss = mine.sum() * dims.dp  # each rank's share of the dense sum, scaled back by the dp mean below
    if dims.dp_rank == 0:
        # the column shard's sum: its weight grad is the dense one; the input grad is summed over tp by the style
        loss = loss + model["expert"](mine).sum() * dims.dp
    loss.backward()
    if overlapped:
        sync.finish()
    else:
        allreduce_gradients(model.parameters(), dims.dp_mesh)
    for name, param in model.named_parameters():
        want = dense.get_parameter(name).grad
        if want is None:
            assert param.grad is None, name
        else:
            assert_matches_dense(param.grad, want, atol=1e-5, rtol=1e-5, msg=name)
    return [name for name, param in model.named_parameters() if param.grad is None]


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_parameter_used_on_one_dp_rank_gets_the_mean_on_every_rank(overlapped: bool) -> None:
    for idle in run_distributed(used_on_one_rank_case, 4, overlapped):
        assert idle == ["idle.weight", "idle.bias"], idle


def misuse_case() -> str:
    dims = setup_parallel()
    model = nn.Linear(4, 4)
    sync = OverlappedGradSync(model.parameters(), dims.dp_mesh, bucket_mb=1.0)
    model(torch.ones(2, 4)).sum().backward()
    try:
        model(torch.ones(2, 4)).sum().backward()  # second microbatch forgot no_sync()
    except RuntimeError as error:
        message = str(error)
    else:
        message = ""
    sync.finish()  # the started all-reduce still completes: the ranks stay in step
    return message


def test_backward_after_launch_without_finish_raises() -> None:
    messages = run_distributed(misuse_case, 2)
    assert all("no_sync()" in m and "finish()" in m for m in messages), messages


def layout_case() -> list[list[int]]:
    mesh = setup_parallel().dp_mesh
    # registration order a, b, c, d; backward order (the bucket order) d, c, b, a
    sizes = {"a": 300_000, "b": 100_000, "c": 150_000, "d": 100_000}
    params = [nn.Parameter(torch.zeros(n)) for n in sizes.values()]
    default = OverlappedGradSync(params, mesh, bucket_mb=1.0, first_bucket_mb=0.5).bucket_numels
    one_per_param = OverlappedGradSync(params, mesh, bucket_mb=0.1).bucket_numels
    single = OverlappedGradSync(params, mesh, bucket_mb=10.0, first_bucket_mb=10.0).bucket_numels
    return [default, one_per_param, single]


def test_bucket_layout_follows_backward_order_and_caps() -> None:
    default, one_per_param, single = run_distributed(layout_case, 2)[0]
    # first bucket capped at 0.5 MiB (131072 fp32): d alone; then c + b fit in 1 MiB (262144); a alone
    assert default == [100_000, 250_000, 300_000]
    assert one_per_param == [100_000, 150_000, 100_000, 300_000]  # a parameter over the cap gets its own bucket
    assert single == [650_000]


def _refusal(model: nn.Module) -> str:
    """The ValueError message of building a sync over ``model`` on this rank ("" if it was accepted)."""
    try:
        OverlappedGradSync(model.parameters(), get_parallel().dp_mesh)
    except ValueError as error:
        return str(error)
    return ""


def mismatch_case() -> str:
    dims = setup_parallel()
    return _refusal(nn.Linear(4, 4 + dims.dp_rank))  # a different model on dp rank 1


def test_different_parameters_across_dp_ranks_raise_on_every_rank() -> None:
    messages = run_distributed(mismatch_case, 2)
    assert all("dp ranks hold different parameters" in m and "dp rank 1: 1 buckets, 25 elements" in m for m in messages)


def fsdp_case() -> str:
    dims = setup_parallel()
    return _refusal(apply_fsdp(nn.Sequential(nn.Linear(4, 4)), dims.dp_mesh))


def test_fsdp_parameters_are_refused() -> None:
    assert all("FSDP2" in m for m in run_distributed(fsdp_case, 2))


def test_bad_bucket_size() -> None:
    with pytest.raises(ValueError, match="bucket_mb and first_bucket_mb must be positive"):
        OverlappedGradSync([nn.Parameter(torch.ones(2))], None, bucket_mb=0)
