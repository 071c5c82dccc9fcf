"""DP x TP training steps vs the dense single-process step: plain DP, ZeRO-1, FSDP2; grad norm and clipping."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from meshpar import clip_grad_norm, get_rng_tracker
from meshpar._compat import DTensor
from meshpar.data_parallel import (
    DataParallelGrads,
    allreduce_gradients,
    apply_activation_checkpointing,
    apply_fsdp,
)
from meshpar.grad_clip import total_grad_norm
from meshpar.optim import DistributedOptimizer
from meshpar.tensor_parallel import ColumnParallel, RowParallel
from meshpar.testing import assert_matches_dense, run_distributed, setup_parallel
from meshpar.testing.reference import local
from tests._models import Block, TinyTransformer, block_plan

BATCH = 4


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(BATCH, 8, 16), torch.randn(BATCH, 8, 16)


def _loss(model, x, target) -> torch.Tensor:
    return ((model(x) - target) ** 2).mean()


def dp_tp_case(tp: int, mode: str, max_norm: float | None) -> dict:
    dims = setup_parallel(tp=tp)
    torch.manual_seed(0)
    dense = TinyTransformer(hidden=16, heads=4, ffn=24, layers=2)
    model = parallelize_module(copy.deepcopy(dense), dims.tp_mesh, block_plan())
    if mode == "fsdp":
        model = apply_fsdp(model, dims.dp_mesh, block_cls=Block)
    x, target = _data()
    # dense step on the whole batch
    # eps well above fp32 noise: grads that are exactly 0 in theory (the key bias) must not flip sign under Adam
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-2, eps=1e-4)
    _loss(dense, x, target).backward()
    dense_norm = torch.nn.utils.get_total_norm([p.grad for p in dense.parameters()])
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)
    dense_opt.step()
    # sharded step: each dp rank takes its slice of the batch
    per_rank = BATCH // dims.dp
    rows = slice(dims.dp_rank * per_rank, (dims.dp_rank + 1) * per_rank)
    _loss(model, x[rows], target[rows]).backward()
    if mode == "fsdp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    else:
        zero1, reduce_scatter = mode in ("zero1", "zero1_rs"), mode == "zero1_rs"
        opt = DistributedOptimizer(
            model, torch.optim.AdamW, zero1=zero1, reduce_scatter_grads=reduce_scatter, dims=dims, lr=1e-2, eps=1e-4
        )
    if mode == "zero1_rs":  # the optimizer reduce-scatters the raw grads; it alone knows the norm
        norm = opt.clip_grad_norm(max_norm if max_norm is not None else float("inf"))
    else:
        if mode != "fsdp":
            allreduce_gradients(model.parameters(), dims.dp_mesh)
        norm = total_grad_norm(model.parameters(), dims=dims)
        if max_norm is not None:
            clip_grad_norm(model.parameters(), max_norm, dims=dims)
    torch.testing.assert_close(norm, dense_norm, atol=1e-5, rtol=1e-5)
    opt.step()
    dense_params = dict(dense.named_parameters())
    for name, param in model.named_parameters():
        full = param.full_tensor() if mode == "fsdp" else param
        expected = dense_params[name].detach()
        if mode == "fsdp":
            torch.testing.assert_close(full.detach(), expected, atol=1e-5, rtol=1e-4, msg=name)
        else:
            assert_matches_dense(full.detach(), expected, atol=1e-5, rtol=1e-4, msg=name)
    return {"state_bytes": opt.state_bytes() if mode != "fsdp" else 0}


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero1_rs", "fsdp"])
@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_dp_x_tp_step_equals_dense_step(mode: str, max_norm: float | None) -> None:
    run_distributed(dp_tp_case, 4, 2, mode, max_norm)


def test_pure_dp_and_pure_tp_steps() -> None:
    run_distributed(dp_tp_case, 4, 1, "zero1", 0.05)
    run_distributed(dp_tp_case, 4, 1, "zero1_rs", 0.05)
    run_distributed(dp_tp_case, 4, 4, "ddp", None)


def test_zero1_shards_optimizer_state_over_dp() -> None:
    plain = run_distributed(dp_tp_case, 4, 1, "ddp", None)
    zero = run_distributed(dp_tp_case, 4, 1, "zero1", None)
    full = plain[0]["state_bytes"]
    assert all(r["state_bytes"] == full for r in plain)
    assert sum(r["state_bytes"] for r in zero) == full  # every state lives on exactly one dp rank
    assert max(r["state_bytes"] for r in zero) < 0.35 * full  # ~1/4 each, up to whole-tensor granularity


def mixed_params_case() -> None:
    """A model with DTensor and plain parameters steps with foreach AdamW (torch alone rejects the mixed group): the
    step runs the multi-tensor path and updates every parameter exactly as the per-tensor path does."""
    dims = setup_parallel(tp=2)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(parallelize_module(TinyTransformer(), dims.tp_mesh, block_plan()))
    x, target = _data()
    before = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    assert len({isinstance(p, DTensor) for p in models[0].parameters()}) == 2  # the group really is mixed
    for model, foreach in zip(models, (True, False), strict=True):
        _loss(model, x, target).backward()
        optimizer = DistributedOptimizer(model, torch.optim.AdamW, dims=dims, lr=1e-3, foreach=foreach)
        assert optimizer.param_groups[0]["foreach"] is foreach
        optimizer.step()
    for (name, fast), slow in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert not torch.equal(local(fast.detach()), local(before[name])), f"{name} was not updated"
        torch.testing.assert_close(local(fast.detach()), local(slow.detach()), atol=1e-7, rtol=1e-6, msg=name)


def test_mixed_dtensor_and_plain_parameters_use_foreach() -> None:
    run_distributed(mixed_params_case, 2)


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


class _RoutedBlock(nn.Module):
    """A block whose expert runs only when its batch reaches it; ``idle`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.expert, self.idle = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, y: torch.Tensor, use: bool) -> torch.Tensor:
        return y + self.expert(y) if use else y * 1.0


class _Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared, self.block = nn.Linear(8, 8), _RoutedBlock()

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return self.block(self.shared(x), use).sum()


def fsdp_unused_case() -> dict[str, bool]:
    """FSDP2 over dp=2 with an expert only dp rank 0's batch reaches and one no batch reaches: every rank gets the
    dense grad (the dp mean) instead of FSDP pairing different tensors in its reduce-scatter (gloo aborted the
    process); after the step's sync the never-used expert's grad is None as in the dense step, so two AdamW steps
    with weight decay leave every parameter equal to dense."""
    dims = setup_parallel()
    torch.manual_seed(0)
    dense = _Routed()
    model = apply_fsdp(copy.deepcopy(dense), dims.dp_mesh, block_cls=_RoutedBlock)
    sync = DataParallelGrads("fsdp", dims.dp_mesh, [model])
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=0.1, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    x = torch.randn(2 * dims.dp, 8)
    has_grad = {}
    for _ in range(2):
        (dense(x[:2], True) + dense(x[2:], False)).backward()
        (model(x[2 * dims.dp_rank : 2 * dims.dp_rank + 2], dims.dp_rank == 0) * dims.dp).backward()
        sync.finish()
        has_grad = {name: param.grad is not None for name, param in model.named_parameters()}
        for name, param in model.named_parameters():
            want = dense.get_parameter(name).grad
            assert (param.grad is None) == (want is None), name
            if want is not None:
                torch.testing.assert_close(param.grad.full_tensor(), want, atol=1e-5, rtol=1e-5, msg=name)
        dense_opt.step()
        opt.step()
        dense_opt.zero_grad()
        opt.zero_grad()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), dense.get_parameter(name), atol=1e-5, rtol=1e-5, msg=name)
    return has_grad


def test_fsdp_with_a_parameter_one_dp_rank_did_not_use_matches_dense() -> None:
    for has_grad in run_distributed(fsdp_unused_case, 2):
        used = {"shared.weight", "shared.bias", "block.expert.weight", "block.expert.bias"}
        assert has_grad == {name: name in used for name in [*used, "block.idle.weight", "block.idle.bias"]}


def fsdp_accumulated_case() -> None:
    """Grads accumulated over two backward passes without zero_grad: the expert every rank used in the first and
    none in the second keeps its accumulated grad (the drop takes back only zeros)."""
    dims = setup_parallel()
    torch.manual_seed(0)
    dense = _Routed()
    model = apply_fsdp(copy.deepcopy(dense), dims.dp_mesh, block_cls=_RoutedBlock)
    sync = DataParallelGrads("fsdp", dims.dp_mesh, [model])
    x = torch.randn(2 * dims.dp, 8)
    for use in (True, False):
        (dense(x[:2], use) + dense(x[2:], use)).backward()
        (model(x[2 * dims.dp_rank : 2 * dims.dp_rank + 2], use) * dims.dp).backward()
        sync.finish()
    for name, param in model.named_parameters():
        want = dense.get_parameter(name).grad
        assert (param.grad is None) == (want is None), name
        if want is not None:
            torch.testing.assert_close(param.grad.full_tensor(), want, atol=1e-5, rtol=1e-5, msg=name)
    assert model.block.expert.weight.grad is not None


def test_fsdp_keeps_accumulated_grads_of_a_parameter_no_rank_used_later() -> None:
    run_distributed(fsdp_accumulated_case, 2)


def dp_modes_case(mode: str) -> list[float]:
    """Two chunks sharing one parameter (a tied embedding) on dp=2. The model is linear, so rank r's grads are
    (r + 1) times those of the all-ones input: the dp mean is 1.5 times them."""
    import torch.distributed as dist

    from meshpar.data_parallel import DataParallelGrads

    dims = setup_parallel(dp=2)
    torch.manual_seed(0)
    shared = nn.Linear(3, 3, bias=False)
    chunks = [nn.Sequential(shared, nn.Linear(3, 3, bias=False)), nn.Sequential(nn.Linear(3, 3, bias=False), shared)]

    def backward(scale: float) -> None:
        x = torch.full((1, 3), scale)
        chunks[1](chunks[0](x)).sum().backward()

    params = list({id(p): p for c in chunks for p in c.parameters()}.values())
    backward(1.0)
    unit = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    averaging = DataParallelGrads(mode, dims.dp_mesh, chunks)
    with averaging.no_sync():  # an accumulation microbatch: its grads wait for the last one's reduction
        backward(0.5 * (dist.get_rank() + 1))
    backward(0.5 * (dist.get_rank() + 1))
    averaging.finish()
    return [(p.grad / u).mean().item() for p, u in zip(params, unit, strict=True)]


@pytest.mark.parametrize("mode", ["allreduce", "overlapped", "fsdp", "optimizer"])
def test_data_parallel_modes_with_accumulation_and_a_shared_parameter(mode: str) -> None:
    results = run_distributed(dp_modes_case, 2, mode)
    reduced_elsewhere = mode in ("fsdp", "optimizer")  # FSDP2 in backward, ZeRO-1 in the optimizer
    want = [[1.0] * 3, [2.0] * 3] if reduced_elsewhere else [[1.5] * 3, [1.5] * 3]
    for got, expected in zip(results, want, strict=True):
        assert got == pytest.approx(expected, rel=1e-6), results


def test_unknown_data_parallel_mode_is_refused() -> None:
    from meshpar.data_parallel import DataParallelGrads

    with pytest.raises(ValueError, match="unknown data-parallel mode"):
        DataParallelGrads("ddp", None, [])
