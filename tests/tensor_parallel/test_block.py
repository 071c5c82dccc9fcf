"""A 2-layer transformer sharded with parallelize_module plan dicts vs its dense twin, and its collectives."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.distributed.tensor.parallel import parallelize_module

from meshpar._compat import CommDebugMode
from meshpar.optim import DistributedOptimizer
from meshpar.testing import SavedForBackward, assert_matches_dense, run_distributed, setup_parallel, shard_of
from meshpar.testing.dispatch import AtenOps, comm_counts
from tests._models import TinyTransformer, block_plan


def block_case(tp: int, sp: bool, bias: bool, regather: bool = False) -> None:
    dims = setup_parallel(tp=tp)
    torch.manual_seed(0)
    dense = TinyTransformer(hidden=16, heads=4, ffn=24, layers=2, bias=bias)
    model = parallelize_module(copy.deepcopy(dense), dims.tp_mesh, block_plan(sequence_parallel=sp, regather=regather))
    x = torch.randn(2, 8, 16, requires_grad=True)
    grad_out = torch.randn(2, 8, 16)
    expected = dense(x)
    expected.backward(grad_out)

    x_local = (shard_of(x.detach(), dims.tp_mesh, 1) if sp else x.detach()).clone().requires_grad_()
    y = model(x_local)
    if sp:
        expected, grad_out = shard_of(expected, dims.tp_mesh, 1), shard_of(grad_out, dims.tp_mesh, 1)
    torch.testing.assert_close(y, expected.detach(), atol=1e-5, rtol=1e-5)
    y.backward(grad_out)
    torch.testing.assert_close(x_local.grad, shard_of(x.grad, dims.tp_mesh, 1) if sp else x.grad, atol=1e-5, rtol=1e-5)
    dense_params = dict(dense.named_parameters())
    for name, param in model.named_parameters():
        assert_matches_dense(param.grad, dense_params[name].grad, atol=1e-5, rtol=1e-5, msg=f"grad of {name}")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_transformer_block_matches_dense(tp: int, sp: bool, bias: bool) -> None:
    run_distributed(block_case, 4, tp, sp, bias)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_with_regathered_inputs_matches_dense(tp: int) -> None:
    run_distributed(block_case, 4, tp, True, True, True)


def comm_case(sp: bool, regather: bool = False) -> tuple[dict, dict, int]:
    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    plan = block_plan(sequence_parallel=sp, regather=regather)
    model = parallelize_module(TinyTransformer(layers=1, bias=False), dims.tp_mesh, plan)
    x = torch.randn(2, 4 if sp else 8, 16, requires_grad=True)
    with CommDebugMode() as fwd, SavedForBackward() as saved:
        y = model(x)
    with CommDebugMode() as bwd:
        y.sum().backward()
    return dict(comm_counts(fwd)), dict(comm_counts(bwd)), saved.bytes


def test_megatron_block_issues_one_all_reduce_per_pair_each_way() -> None:
    fwd, bwd, _ = run_distributed(comm_case, 2, False)[0]
    # attention (qkv -> out) and MLP (fc1 -> fc2): one all-reduce each, forward and backward
    assert fwd == {"all_reduce": 2}
    assert bwd == {"all_reduce": 2}


def test_sequence_parallel_block_uses_all_gather_and_reduce_scatter() -> None:
    fwd, bwd, saved = run_distributed(comm_case, 2, True)[0]
    assert fwd == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    # backward mirrors the forward; the two LayerNorms' replicated weight and bias grads are partial sums over the
    # sequence shards: each is all-reduced as it is accumulated (Megatron's sequence-parallel grad all-reduce), four
    # small all-reduces
    assert bwd == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2, "all_reduce": 4}
    # regather_input: the same forward; backward gathers the qkv and fc1 inputs again, and those two inputs are
    # saved as [2, 4, 16] sequence shards instead of gathered [2, 8, 16] tensors
    fwd_r, bwd_r, saved_r = run_distributed(comm_case, 2, True, True)[0]
    assert fwd_r == fwd
    assert bwd_r == {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 2, "all_reduce": 4}
    assert saved - saved_r == 2 * (2 * 8 * 16 - 2 * 4 * 16) * 4


def _train_step_ops(model: torch.nn.Module, opt: object, x: torch.Tensor) -> AtenOps:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    step()  # optimizer state exists from here on
    with AtenOps() as ops:
        step()
    return ops


def hot_path_case(tp: int) -> tuple[Counter, Counter, int, tuple[int, int]]:
    dims = setup_parallel(tp=tp)
    torch.manual_seed(0)
    dense = TinyTransformer(hidden=16, heads=4, ffn=24, layers=2)
    model = parallelize_module(copy.deepcopy(dense), dims.tp_mesh, block_plan())
    x = torch.randn(2, 8, 16)
    dense_ops = _train_step_ops(dense, torch.optim.AdamW(dense.parameters(), lr=1e-3), x)
    tp_ops = _train_step_ops(model, DistributedOptimizer(model, torch.optim.AdamW, dims=dims, lr=1e-3), x)
    return dense_ops.compute, tp_ops.compute, tp_ops.collectives, (dense_ops.syncs, tp_ops.syncs)


@pytest.mark.parametrize("tp", [1, 2])
def test_train_step_dispatches_the_dense_ops_plus_only_megatrons_collectives(tp: int) -> None:
    """The eager hot path adds no hidden work over the dense model: no copies, no DTensor redistribution, no host
    syncs beyond the optimizer's own. The only compute difference at tp > 1 is the row-parallel bias, which is added
    after the all-reduce (``mm`` + in-place ``add_`` instead of one ``addmm``, as in Megatron); at tp=1 there is no
    reduction and the ops are exactly the dense model's."""
    dense, sharded, collectives, syncs = run_distributed(hot_path_case, 2, tp)[0]
    row_biases = 2 * 2 if tp > 1 else 0  # out and fc2 in each of the 2 layers
    expected = dense + Counter({"mm": row_biases, "add_": row_biases})
    expected.subtract({"addmm": row_biases})
    assert +expected == +sharded, (dense, sharded)
    assert syncs[1] == syncs[0], syncs  # AdamW's own step-count reads on CPU only
    assert collectives == (0 if tp == 1 else 2 * 2 * 2)  # 2 all-reduces per layer forward and 2 backward
