"""ColumnParallelLinear / RowParallelLinear / ParallelEmbedding against dense nn.Linear / nn.Embedding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshpar import ColumnParallel, ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from meshpar.testing import assert_matches_dense, run_distributed, setup_parallel, shard_of

BATCH, SEQ, IN, OUT = 3, 8, 12, 20  # OUT=20 and IN=12 split over tp=4; SEQ=8 splits for sequence parallelism


def _dense_linear(bias: bool) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, bias=bias)
    x = torch.randn(BATCH, SEQ, IN, requires_grad=True)
    grad_out = torch.randn(BATCH, SEQ, OUT)
    dense(x).backward(grad_out)
    return dense, x, grad_out


def _check_params(layer: nn.Module, dense: nn.Module) -> None:
    for name, param in layer.named_parameters():
        dense_param = dict(dense.named_parameters())[name]
        assert_matches_dense(param.detach(), dense_param.detach(), msg=f"value of {name}")
        assert_matches_dense(param.grad, dense_param.grad, msg=f"grad of {name}")


def column_case(tp: int, bias: bool, gather_output: bool, sp: bool) -> None:
    dims = setup_parallel(tp=tp)
    dense, x, grad_out = _dense_linear(bias)
    torch.manual_seed(0)  # the sharded layer must hold exactly the slice of the dense init
    layer = ColumnParallelLinear(
        IN, OUT, bias=bias, gather_output=gather_output, sequence_parallel_enabled=sp, tp_mesh=dims.tp_mesh
    )
    mesh = dims.tp_mesh
    x_local = (shard_of(x.detach(), mesh, 1) if sp else x.detach()).clone().requires_grad_()
    y = layer(x_local)
    expected = dense(x)
    if not gather_output:
        expected, grad_out = shard_of(expected, mesh, -1), shard_of(grad_out, mesh, -1)
    torch.testing.assert_close(y, expected.detach(), atol=1e-5, rtol=1e-5)
    y.backward(grad_out)
    expected_grad = shard_of(x.grad, mesh, 1) if sp else x.grad
    torch.testing.assert_close(x_local.grad, expected_grad, atol=1e-5, rtol=1e-5)
    _check_params(layer, dense)


def row_case(tp: int, bias: bool, input_is_parallel: bool, sp: bool) -> None:
    dims = setup_parallel(tp=tp)
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, bias=bias)
    x = torch.randn(BATCH, SEQ, IN, requires_grad=True)
    grad_out = torch.randn(BATCH, SEQ, OUT)
    expected = dense(x)
    expected.backward(grad_out)
    torch.manual_seed(0)
    layer = RowParallelLinear(
        IN, OUT, bias=bias, input_is_parallel=input_is_parallel, sequence_parallel_enabled=sp, tp_mesh=dims.tp_mesh
    )
    mesh = dims.tp_mesh
    x_local = (shard_of(x.detach(), mesh, -1) if input_is_parallel else x.detach()).clone().requires_grad_()
    y = layer(x_local)
    if sp:
        expected, grad_out = shard_of(expected, mesh, 1), shard_of(grad_out, mesh, 1)
    torch.testing.assert_close(y, expected.detach(), atol=1e-5, rtol=1e-5)
    y.backward(grad_out)
    expected_grad = shard_of(x.grad, mesh, -1) if input_is_parallel else x.grad
    torch.testing.assert_close(x_local.grad, expected_grad, atol=1e-5, rtol=1e-5)
    _check_params(layer, dense)


def embedding_case(tp: int, shard_across_embedding: bool, sp: bool, padding_idx: int | None) -> None:
    dims = setup_parallel(tp=tp)
    vocab, dim = 20, 12
    torch.manual_seed(0)
    dense = nn.Embedding(vocab, dim, padding_idx=padding_idx)
    ids = torch.tensor([[0, 4, 5, 9, 10, 14, 15, 19], [19, 3, 3, 7, 12, 0, 1, 2]])  # every shard boundary
    grad_out = torch.randn(2, 8, dim)
    expected = dense(ids)
    expected.backward(grad_out)
    torch.manual_seed(0)
    layer = ParallelEmbedding(
        vocab,
        dim,
        padding_idx=padding_idx,
        shard_across_embedding=shard_across_embedding,
        sequence_parallel_enabled=sp,
        tp_mesh=dims.tp_mesh,
    )
    y = layer(ids)
    if sp:
        expected, grad_out = shard_of(expected, dims.tp_mesh, 1), shard_of(grad_out, dims.tp_mesh, 1)
    torch.testing.assert_close(y, expected.detach(), atol=1e-6, rtol=1e-6)
    y.backward(grad_out)
    _check_params(layer, dense)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("gather_output", "sp"), [(True, False), (False, False), (False, True), (True, True)])
def test_column_parallel_linear_matches_dense(tp: int, bias: bool, gather_output: bool, sp: bool) -> None:
    run_distributed(column_case, 4, tp, bias, gather_output, sp)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("input_is_parallel", "sp"), [(True, False), (False, False), (True, True)])
def test_row_parallel_linear_matches_dense(tp: int, bias: bool, input_is_parallel: bool, sp: bool) -> None:
    run_distributed(row_case, 4, tp, bias, input_is_parallel, sp)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("shard_across_embedding", "sp"), [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_parallel_embedding_matches_dense(
    tp: int, shard_across_embedding: bool, sp: bool, padding_idx: int | None
) -> None:
    run_distributed(embedding_case, 4, tp, shard_across_embedding, sp, padding_idx)


def test_single_process_world() -> None:
    run_distributed(column_case, 1, 1, True, False, False)
    run_distributed(row_case, 2, 2, True, True, True)


def placements_case() -> list[str]:
    mesh = setup_parallel(tp=2).tp_mesh
    col = ColumnParallelLinear(IN, OUT, tp_mesh=mesh)
    row = RowParallelLinear(IN, OUT, tp_mesh=mesh)
    emb = ParallelEmbedding(20, 12, tp_mesh=mesh)
    emb_dim = ParallelEmbedding(20, 12, shard_across_embedding=True, tp_mesh=mesh)
    return [str(p.placements) for p in (col.weight, col.bias, row.weight, row.bias, emb.weight, emb_dim.weight)]


def test_parameters_are_dtensors_with_megatron_placements() -> None:
    results = run_distributed(placements_case, 2)
    assert results[0] == [
        "(Shard(dim=0),)",
        "(Shard(dim=0),)",
        "(Shard(dim=1),)",
        "(Replicate(),)",
        "(Shard(dim=0),)",
        "(Shard(dim=1),)",
    ]


def meta_init_case() -> bool:
    mesh = setup_parallel(tp=2).tp_mesh
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT)
    layer = ColumnParallelLinear(IN, OUT, device="meta", tp_mesh=mesh)
    assert layer.weight.to_local().is_meta and layer.weight.to_local().shape == (OUT // 2, IN)
    layer.to_empty(device="cpu")
    torch.manual_seed(0)
    layer.reset_parameters()
    assert_matches_dense(layer.weight.detach(), dense.weight.detach())
    assert_matches_dense(layer.bias.detach(), dense.bias.detach())
    return True


def test_meta_init_allocates_only_local_shard_then_matches_dense() -> None:
    assert run_distributed(meta_init_case, 2) == [True, True]


def indivisible_case(kind: str) -> None:
    mesh = setup_parallel(tp=4).tp_mesh
    if kind == "column":
        ColumnParallelLinear(8, 30, tp_mesh=mesh)
    elif kind == "row":
        RowParallelLinear(30, 8, tp_mesh=mesh)
    elif kind == "heads":
        ColumnParallelLinear(
            64 * 6, 3 * 64 * 6, num_heads=6, tp_mesh=mesh
        )  # 1152 features split over 4; 6 heads do not
    elif kind == "row_sp_without_parallel_input":
        RowParallelLinear(8, 8, input_is_parallel=False, sequence_parallel_enabled=True, tp_mesh=mesh)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("column", "output_size 30 is not divisible by tp=4"),
        ("row", "input_size 30 is not divisible by tp=4"),
        ("row_sp_without_parallel_input", "requires input_is_parallel=True"),
        ("heads", "the number of attention heads 6 is not divisible by tp=4"),
    ],
)
def test_indivisible_sizes_raise_clear_errors(kind: str, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        run_distributed(indivisible_case, 4, kind)


def sp_bad_seq_case() -> None:
    mesh = setup_parallel(tp=4).tp_mesh
    layer = RowParallelLinear(8, 8, input_is_parallel=True, sequence_parallel_enabled=True, tp_mesh=mesh)
    layer(torch.randn(2, 6, 2))  # sequence length 6 is not divisible by tp=4


def test_sequence_length_not_divisible_raises() -> None:
    with pytest.raises(AssertionError, match="sequence length must be divisible by tp"):
        run_distributed(sp_bad_seq_case, 4)


def uneven_vocab_case(tp: int) -> None:
    """A vocabulary tp does not divide (22 at tp=4: 6, 6, 6, 4 rows) embeds and projects exactly like dense."""
    dims = setup_parallel(tp=tp)
    torch.manual_seed(0)
    dense_emb, dense_head = nn.Embedding(22, 12), nn.Linear(12, 22, bias=False)
    torch.manual_seed(0)
    emb = ParallelEmbedding(22, 12, tp_mesh=dims.tp_mesh)
    head = ColumnParallelLinear(12, 22, bias=False, gather_output=True, allow_uneven=True, tp_mesh=dims.tp_mesh)
    assert emb.weight.to_local().shape[0] == (4 if dims.tp_rank == tp - 1 else 6) if tp == 4 else True
    ids = torch.tensor([[0, 5, 6, 11, 12, 17, 18, 21]])
    torch.testing.assert_close(emb(ids), dense_emb(ids))
    x = torch.randn(2, 12)
    torch.testing.assert_close(head(x), dense_head(x))
    emb(ids).sum().backward()
    dense_emb(ids).sum().backward()
    assert_matches_dense(emb.weight.grad, dense_emb.weight.grad)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_uneven_vocab_embedding_and_gathered_head_match_dense(tp: int) -> None:
    run_distributed(uneven_vocab_case, 4, tp)


def test_regather_input_needs_sequence_parallel() -> None:
    with pytest.raises(ValueError, match="regather_input=True\\) needs sequence_parallel=True"):
        ColumnParallel(regather_input=True)


def autocast_case(sp: bool) -> None:
    """A column -> row pair under CPU bfloat16 autocast: output and every grad (in the parameters' fp32) equal the
    dense pair under the same autocast, within bfloat16's tolerance."""
    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(IN, OUT), nn.Linear(OUT, IN))
    x = torch.randn(BATCH, SEQ, IN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense(x).float().square().sum().backward()
    torch.manual_seed(0)
    column = ColumnParallelLinear(IN, OUT, gather_output=False, sequence_parallel_enabled=sp, tp_mesh=dims.tp_mesh)
    row = RowParallelLinear(OUT, IN, input_is_parallel=True, sequence_parallel_enabled=sp, tp_mesh=dims.tp_mesh)
    x_local = shard_of(x, dims.tp_mesh, 1) if sp else x
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = row(column(x_local))
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
    for layer, reference in ((column, dense[0]), (row, dense[1])):
        for name, param in layer.named_parameters():
            assert param.grad.dtype == torch.float32, name
            expected = dict(reference.named_parameters())[name].grad
            assert_matches_dense(param.grad, expected, atol=0.05, rtol=0.02, msg=f"grad of {name}")


@pytest.mark.parametrize("sp", [False, True])
def test_parallel_linears_under_autocast_match_dense(sp: bool) -> None:
    run_distributed(autocast_case, 2, sp)


def shared_input_case(mode: str) -> None:
    """q/k/v as one shared-input group (meshpar.tensor_parallel.shared_input) stay exact when the group guesses
    wrong: a member called with another tensor, or a member whose output never reaches the loss."""
    from meshpar.tensor_parallel.shared_input import group_shared_inputs

    dims = setup_parallel(tp=2)

    class QKV(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(IN, OUT) for _ in range(3))

    dense = QKV()
    sharded = QKV()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(sharded, name, ColumnParallelLinear.from_linear(getattr(sharded, name), dims.tp_mesh))
    assert group_shared_inputs(sharded) == 1
    torch.manual_seed(1)
    x, other = torch.randn(BATCH, SEQ, IN, requires_grad=True), torch.randn(BATCH, SEQ, IN, requires_grad=True)

    def loss(model: nn.Module, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        q, k = model.q_proj(x), model.k_proj(x)
        v = model.v_proj(other if mode == "other_input" else x)
        parts = [q, v] if mode == "unused_output" else [q, k, v]
        # each rank squares its feature shard; summed over tp that is the dense loss
        return sum(p.square().sum() for p in parts)

    loss(dense, x, other).backward()
    x_local, other_local = x.detach().clone().requires_grad_(), other.detach().clone().requires_grad_()
    loss(sharded, x_local, other_local).backward()
    torch.testing.assert_close(x_local.grad, x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(other_local.grad, other.grad, atol=1e-5, rtol=1e-5)
    for name in ("q_proj", "k_proj", "v_proj"):
        if getattr(dense, name).weight.grad is None:  # the unused output: its shard's grads are zero
            assert all(not p.grad.to_local().any() for p in getattr(sharded, name).parameters()), name
            continue
        _check_params(getattr(sharded, name), getattr(dense, name))


@pytest.mark.parametrize("mode", ["same_input", "other_input", "unused_output"])
def test_shared_input_groups_are_exact_whatever_the_calls(mode: str) -> None:
    run_distributed(shared_input_case, 2, mode)
