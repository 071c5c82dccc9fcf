"""NxD's parallel_layers view against dense torch at tp 1, 2 and 4 (one gloo world of 4, each case looping over the
tp sizes): layers with NxD's signatures, plain local-shard parameters with NxD's attributes, ``master_weight``,
strides, NxD's bias rules, ``skip_bias_add``, sequence parallelism along any dim, padding, the embedding's two
shardings, the region mappings with a process group, the grad norm and NxD's grads helpers, xm's optimizer step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshpar.testing import run_distributed

B, S, H, OUT, V = 2, 8, 16, 24, 20


def _tp_sizes(world: int = 4) -> list[int]:
    return [tp for tp in (1, 2, 4) if world % tp == 0]


def _shard(full: torch.Tensor, dim: int, tp: int, rank: int, stride: int = 1) -> torch.Tensor:
    """This rank's part cut the NxD way (``stride`` blocks dealt round-robin), written out independently."""
    blocks = full.chunk(tp * stride, dim)
    return torch.cat([blocks[rank + tp * k] for k in range(stride)], dim)


def _reset() -> None:
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.destroy_model_parallel()


def linear_case(kind: str, stride: int) -> None:
    """One layer against ``nn.Linear`` holding its master weight. With a stride (a fused weight, q / k / v stacked)
    each rank holds its part of every stacked piece, so the column layer's local output is that rank's part of each
    piece of the dense output (NxD uses strides with ``gather_output=False``) and the row layer's input is cut the
    same way."""
    from meshpar.compat.nxd.parallel_layers import layers, parallel_state

    for tp in _tp_sizes():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        rank = parallel_state.get_tensor_model_parallel_rank()
        torch.manual_seed(0)
        x = torch.randn(B, S, H)
        if kind == "column":
            # NxD's positional order: input, output, bias, gather_output, dtype, device, stride
            layer = layers.ColumnParallelLinear(H, OUT, True, stride == 1, torch.float32, None, stride,
                                                keep_master_weight=True)  # fmt: skip
            dim = 0
            assert layer.bias.shape == ((OUT,) if stride == 1 else (OUT // tp,))
            full_bias = layer.bias.detach() if stride == 1 else _unshard(layer.bias.detach(), 0, tp, stride)
        else:
            layer = layers.RowParallelLinear(H, OUT, True, stride > 1, torch.float32, None, stride,
                                             keep_master_weight=True)  # fmt: skip
            dim, full_bias = 1, layer.bias.detach()
        master = layer.master_weight
        weight = layer.weight
        assert not hasattr(weight, "device_mesh"), "NxD's parameters are plain tensors"
        assert (weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride) == (True, dim, stride)
        assert weight.num_partitions == tp
        torch.testing.assert_close(weight.detach(), _shard(master, dim, tp, rank, stride))
        dense = nn.Linear(H, OUT)
        with torch.no_grad():
            dense.weight.copy_(master)
            dense.bias.copy_(full_bias)
        local_in = _shard(x, -1, tp, rank, stride) if kind == "row" and stride > 1 else x
        xp = local_in.clone().requires_grad_()
        xd = x.clone().requires_grad_()
        out = layer(xp)
        ref = dense(xd)
        expected = _shard(ref, -1, tp, rank, stride) if kind == "column" and stride > 1 else ref
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        grad_out = torch.randn_like(ref)
        out.backward(_shard(grad_out, -1, tp, rank, stride) if kind == "column" and stride > 1 else grad_out)
        ref.backward(grad_out)
        input_grad = _shard(xd.grad, -1, tp, rank, stride) if kind == "row" and stride > 1 else xd.grad
        torch.testing.assert_close(xp.grad, input_grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(weight.grad, _shard(dense.weight.grad, dim, tp, rank, stride), atol=1e-5, rtol=1e-5)
        bias_grad = dense.bias.grad if kind == "row" or stride == 1 else _shard(dense.bias.grad, 0, tp, rank, stride)
        torch.testing.assert_close(layer.bias.grad, bias_grad, atol=1e-5, rtol=1e-5)
        _reset()


def _unshard(local: torch.Tensor, dim: int, tp: int, stride: int) -> torch.Tensor:
    """The full tensor from every rank's strided part (the inverse of :func:`_shard`)."""
    parts = [piece.chunk(stride, dim) for piece in mappings_all_gather(local.contiguous(), tp)]
    return torch.cat([parts[rank][k] for k in range(stride) for rank in range(tp)], dim)


@pytest.mark.parametrize("kind,stride", [("column", 1), ("column", 2), ("row", 1), ("row", 2)])
def test_nxd_linear_layers_equal_dense(kind: str, stride: int) -> None:
    run_distributed(linear_case, 4, kind, stride)


def parallel_mlp_case(sequence_dim: int | None, skip_bias_add: bool) -> None:
    """Column (no gather) -> row, NxD's MLP, optionally sequence parallel along ``sequence_dim``."""
    from meshpar.compat.nxd.parallel_layers import layers, mappings, parallel_state

    for tp in _tp_sizes():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        rank = parallel_state.get_tensor_model_parallel_rank()
        sp = sequence_dim is not None
        torch.manual_seed(1)
        column = layers.ColumnParallelLinear(H, OUT, gather_output=False, sequence_parallel_enabled=sp,
                                             sequence_dimension=sequence_dim, keep_master_weight=True)  # fmt: skip
        row = layers.RowParallelLinear(OUT, H, input_is_parallel=True, sequence_parallel_enabled=sp,
                                       sequence_dimension=sequence_dim, keep_master_weight=True,
                                       skip_bias_add=skip_bias_add)  # fmt: skip
        assert column.bias.shape == (OUT // tp,) and column.bias.tensor_model_parallel
        assert row.bias.sequence_parallel_enabled == sp
        dense1, dense2 = _dense_twins(column, row, tp)
        dim = sequence_dim if sp else 0
        x = torch.randn(S, B, H) if dim == 0 else torch.randn(B, S, H)  # the sequence along ``dim``
        xp = (x.chunk(tp, dim)[rank] if sp else x).clone().requires_grad_()
        out = row(torch.relu(column(xp)))
        if skip_bias_add:
            out, bias = out
            assert bias is row.bias
            out = out + bias
        ref = dense2(torch.relu(dense1(x)))
        torch.testing.assert_close(out, ref.chunk(tp, dim)[rank] if sp else ref, atol=1e-5, rtol=1e-5)
        out.sum().backward()
        if sp:  # NxD sums the sequence-parallel grads of the row bias over tp
            mappings.reduce_from_tensor_model_parallel_region(torch.zeros(()))  # the group is usable
            torch.distributed.all_reduce(row.bias.grad, group=parallel_state.get_tensor_model_parallel_group())
        ref.sum().backward()
        torch.testing.assert_close(column.weight.grad, _shard(dense1.weight.grad, 0, tp, rank), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(row.weight.grad, _shard(dense2.weight.grad, 1, tp, rank), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(row.bias.grad, dense2.bias.grad, atol=1e-5, rtol=1e-4)
        _reset()


def mappings_all_gather(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    from meshpar.compat.nxd.parallel_layers import parallel_state

    out = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(out, t, group=parallel_state.get_tensor_model_parallel_group())
    return out


def _dense_twins(column: nn.Module, row: nn.Module, tp: int) -> tuple[nn.Linear, nn.Linear]:
    """Dense ``nn.Linear`` twins of a column-then-row pair of NxD layers, holding their master weights and whole
    biases (the column bias gathered over tp, the row bias as it is: replicated)."""
    full_bias = torch.cat(mappings_all_gather(column.bias.detach(), tp))
    dense1, dense2 = nn.Linear(*column.master_weight.shape[::-1]), nn.Linear(*row.master_weight.shape[::-1])
    with torch.no_grad():
        dense1.weight.copy_(column.master_weight)
        dense1.bias.copy_(full_bias)
        dense2.weight.copy_(row.master_weight)
        dense2.bias.copy_(row.bias)
    return dense1, dense2


@pytest.mark.parametrize("sequence_dim,skip_bias_add", [(None, False), (None, True), (0, False), (1, True)])
def test_nxd_column_row_mlp_equals_dense(sequence_dim: int | None, skip_bias_add: bool) -> None:
    run_distributed(parallel_mlp_case, 4, sequence_dim, skip_bias_add)


def embedding_case(shard_across_embedding: bool, padding_idx: int | None, collect_output: bool) -> None:
    from meshpar.compat.nxd.parallel_layers import layers, parallel_state

    for tp in _tp_sizes():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        rank = parallel_state.get_tensor_model_parallel_rank()
        torch.manual_seed(2)
        layer = layers.ParallelEmbedding(V, OUT, padding_idx=padding_idx, shard_across_embedding=shard_across_embedding,
                                         collect_output=collect_output)  # fmt: skip
        dim = 1 if shard_across_embedding else 0
        full = torch.cat(mappings_all_gather_dim(layer.weight.detach(), tp, dim), dim)
        torch.manual_seed(2)
        assert layer.weight.partition_dim == dim
        dense = nn.Embedding(V, OUT, padding_idx=padding_idx)
        with torch.no_grad():
            dense.weight.copy_(full)
        ids = torch.randint(0, V, (B, S))
        ids[0, 0] = padding_idx if padding_idx is not None else 0
        out = layer(ids)
        ref = dense(ids)
        if collect_output:
            torch.testing.assert_close(out, ref)
        elif shard_across_embedding:
            torch.testing.assert_close(out, ref.chunk(tp, -1)[rank])
        else:  # each rank's partial lookup (its rows), unsummed
            total = out.clone()
            torch.distributed.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
            torch.testing.assert_close(total, ref)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(
            grad
            if collect_output or not shard_across_embedding
            else torch.cat(mappings_all_gather_dim(grad, tp, -1), -1)
        )
        torch.testing.assert_close(layer.weight.grad, dense.weight.grad.chunk(tp, dim)[rank], atol=1e-5, rtol=1e-5)
        _reset()


def mappings_all_gather_dim(t: torch.Tensor, tp: int, dim: int) -> list[torch.Tensor]:
    return [piece for piece in mappings_all_gather(t.contiguous(), tp)]


@pytest.mark.parametrize(
    "shard_across_embedding,padding_idx,collect_output",
    [(False, None, True), (False, 3, True), (True, 1, True), (False, None, False), (True, None, False)],
)
def test_nxd_parallel_embedding_equals_dense(shard_across_embedding: bool, padding_idx: int | None,
                                             collect_output: bool) -> None:  # fmt: skip
    run_distributed(embedding_case, 4, shard_across_embedding, padding_idx, collect_output)


def pad_case() -> None:
    """``pad=True``: sizes tp does not divide are padded; the layer refuses to train and equals dense in eval."""
    from meshpar.compat.nxd.parallel_layers import layers, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=4)
    torch.manual_seed(3)
    column = layers.ColumnParallelLinear(H, 10, pad=True, keep_master_weight=True)  # 10 -> 12 outputs
    assert column.output_size == 12 and column.weight.shape == (3, H)
    x = torch.randn(B, S, H)
    with pytest.raises(RuntimeError, match="only supported for inference"):
        column(x)
    column.eval()
    out = column(x)
    assert out.shape == (B, S, 10)
    full_bias = column.bias.detach()[:10]
    torch.testing.assert_close(out, F.linear(x, column.master_weight[:10], full_bias), atol=1e-5, rtol=1e-5)
    checkpoint = {"w.weight": torch.randn(10, H), "w.bias": torch.randn(10)}
    column.preshard_hook(checkpoint, "w.weight")
    column.preshard_hook(checkpoint, "w.bias")
    assert checkpoint["w.weight"].shape == (12, H) and checkpoint["w.bias"][10:].max() < -1e30
    row = layers.RowParallelLinear(10, H, pad=True, keep_master_weight=True).eval()
    torch.testing.assert_close(row(torch.randn(B, S, 10)).shape, torch.Size([B, S, H]))
    with pytest.raises(RuntimeError, match=r"expected"):
        column.preshard_hook({"w.weight": torch.randn(11, H)}, "w.weight")


def test_nxd_padded_layers() -> None:
    run_distributed(pad_case, 4)


def refusal_case() -> list[str]:
    from meshpar.compat.nxd.parallel_layers import layers, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=4)
    messages = []
    for build in (
        lambda: layers.ColumnParallelLinear(H, 10),  # 10 outputs over tp=4 without pad
        lambda: layers.RowParallelLinear(H, OUT, sequence_parallel_enabled=True),  # needs input_is_parallel
        lambda: layers.ColumnParallelLinear(H, OUT, gather_output=True, sequence_parallel_enabled=True),
    ):
        try:
            build()
        except (ValueError, RuntimeError) as error:
            messages.append(str(error))
    return messages


def test_nxd_layers_refuse_what_they_cannot_build() -> None:
    messages = run_distributed(refusal_case, 4)[0]
    assert len(messages) == 3
    assert "not divisible" in messages[0] and "input_is_parallel" in messages[1] and "gather_output" in messages[2]


def meta_and_fallback_case() -> None:
    from meshpar.compat.nxd.parallel_layers import layers

    with pytest.warns(UserWarning, match="Falling back"):
        layer = layers.ColumnParallelLinear(H, OUT)  # no parallel state: one process, tp = 1
    x = torch.randn(B, S, H)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    meta = layers.RowParallelLinear(H, OUT, device=torch.device("meta"))
    assert meta.weight.is_meta and meta.weight.tensor_model_parallel and meta.weight.partition_dim == 1


def test_nxd_layers_on_meta_and_without_a_parallel_state() -> None:
    run_distributed(meta_and_fallback_case, 1)


class _StandInGroup:
    """Not a torch.distributed group: an object with a size, as NxD's unit tests pass."""

    def size(self) -> int:
        return 4


def stand_in_group_case() -> None:
    """A layer built over a stand-in group takes its sizes from it and its shard from the (here replaced) tp
    getters, as NxD's layers do; its groups can be set as NxD code sets them; a collective over the stand-in is
    refused with a clear error instead of running over some other group."""
    from unittest import mock

    from meshpar.compat.nxd.parallel_layers import layers, parallel_state

    parallel_state.initialize_model_parallel()
    torch.manual_seed(3)
    with (
        mock.patch.object(layers, "get_tensor_model_parallel_size", return_value=4),
        mock.patch.object(layers, "get_tensor_model_parallel_rank", return_value=2),
    ):
        column = layers.ColumnParallelLinear(
            H, OUT, keep_master_weight=True, tensor_model_parallel_group=_StandInGroup()
        )
        row = layers.RowParallelLinear(OUT, H, keep_master_weight=True, tensor_model_parallel_group=_StandInGroup())
    assert column.weight.shape == (OUT // 4, H) and column.weight.num_partitions == 4
    torch.testing.assert_close(column.weight, _shard(column.master_weight, 0, 4, 2), rtol=0, atol=0)
    torch.testing.assert_close(row.weight, _shard(row.master_weight, 1, 4, 2), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"not a process group torch\.distributed made"):
        column(torch.randn(B, S, H))
    column.tensor_parallel_group = parallel_state.get_tensor_model_parallel_group()  # a real group again: usable
    assert column.tensor_model_parallel_group is parallel_state.get_tensor_model_parallel_group()
    assert isinstance(column.tensor_parallel_group, torch.distributed.ProcessGroup) and column.tp_mesh.size() == 1


def test_nxd_layers_over_a_stand_in_group() -> None:
    run_distributed(stand_in_group_case, 1)


def grad_norm_case(zero1: str | None) -> None:
    """NxD's clip_grad_norm over tp-sharded plain parameters and replicated ones equals torch's on the dense model;
    with ``zero1`` each dp rank holds half of the grads, and the shares are summed over the world (``"world"``) or,
    as NxD does given ``zero1_optimizer_groups``, over tp and pp and then those groups (``"dp_groups"``; with
    single-rank groups, ``"own_groups"``, that is the norm of this dp rank's half)."""
    from meshpar.compat.nxd.parallel_layers import grads, layers, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(4)
    column = layers.ColumnParallelLinear(H, OUT, gather_output=False, keep_master_weight=True)
    row = layers.RowParallelLinear(OUT, H, input_is_parallel=True, keep_master_weight=True)
    norm_layer = nn.LayerNorm(H)
    dense1, dense2 = _dense_twins(column, row, 2)
    dense_norm_layer = nn.LayerNorm(H)
    x = torch.randn(B, S, H)
    norm_layer(row(torch.relu(column(x)))).pow(2).sum().backward()
    dense_norm_layer(dense2(torch.relu(dense1(x)))).pow(2).sum().backward()
    params = [column.weight, column.bias, row.weight, row.bias, *norm_layer.parameters()]
    dense_params = [*dense1.parameters(), *dense2.parameters(), *dense_norm_layer.parameters()]
    dp_rank = parallel_state.get_data_parallel_rank()
    # this dp rank's half alone: what the shares sum to over tp and pp when the ZeRO-1 groups are single ranks
    half = torch.stack([p.grad.norm() for i, p in enumerate(dense_params) if i % 2 == dp_rank]).norm()
    expected = torch.nn.utils.clip_grad_norm_(dense_params, 0.5)
    if zero1:  # disjoint parts per dp rank: with dp=2, each rank keeps half of the parameters' grads
        mine = [p for i, p in enumerate(params) if i % 2 == dp_rank]
        groups = {
            "world": None,
            "dp_groups": parallel_state.get_data_parallel_replica_groups(),
            "own_groups": [[rank] for rank in range(4)],
        }[zero1]
        norm = grads.get_grad_norm(mine, zero1_optimizer=True, zero1_optimizer_groups=groups)
        expected = half if zero1 == "own_groups" else expected
    else:
        norm = grads.clip_grad_norm(params, 0.5)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        torch.testing.assert_close(row.weight.grad, _shard(dense2.weight.grad, 1, 2, tp_rank))
    torch.testing.assert_close(norm.reshape(()), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("zero1", [None, "world", "dp_groups", "own_groups"])
def test_nxd_grad_norm_counts_tp_shards_and_replicas_once(zero1: str | None) -> None:
    run_distributed(grad_norm_case, 4, zero1)


def zero1_groups_under_ep_case() -> str:
    """Under expert parallelism the shares are summed right only over the dp (ZeRO-1 sharding) groups: those are
    accepted, other groups refused."""
    from meshpar.compat.nxd.parallel_layers import grads, parallel_state

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    norm = grads.get_grad_norm([param], zero1_optimizer=True,
                               zero1_optimizer_groups=parallel_state.get_zero1_sharding_groups())  # fmt: skip
    assert norm.item() == pytest.approx(8**0.5)  # four ranks' disjoint shares of two ones
    with pytest.raises(NotImplementedError, match="under expert parallelism") as refused:
        grads.get_grad_norm([param], zero1_optimizer=True, zero1_optimizer_groups=[[r] for r in range(4)])
    return str(refused.value)


def test_nxd_zero1_norm_groups_other_than_dp_are_refused_under_expert_parallelism() -> None:
    assert len(set(run_distributed(zero1_groups_under_ep_case, 4))) == 1


def zero1_shards_case(tp: int) -> None:
    """NxD's ZeRO-1 optimizer as torch_xla's presents it: ``base_optimizer``'s groups pair one to one with the
    model's (this rank's share of each parameter: all of it or an empty tensor), the shares keep their clipped
    averaged grads when ``base_optimizer.zero_grad`` is replaced (NxD's grads test does this), the model keeps its
    raw grads until ``zero_grad``, and NxD's norm over the shares (tp attributes copied from the parameters, summed
    over the dp groups) is the dense clipped norm. The step equals SGD on the dense model's clipped dp-mean grads."""
    from meshpar.compat.nxd.optimizer import NeuronZero1Optimizer
    from meshpar.compat.nxd.parallel_layers import grads, layers, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tp_rank, dp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_size()
    torch.manual_seed(6)
    column = layers.ColumnParallelLinear(H, OUT, gather_output=False, keep_master_weight=True)
    row = layers.RowParallelLinear(OUT, H, input_is_parallel=True, keep_master_weight=True)  # replicated bias
    dense1, dense2 = _dense_twins(column, row, tp)
    inputs = [torch.randn(B, S, H, generator=torch.Generator().manual_seed(10 + d)) for d in range(dp)]
    row(torch.relu(column(inputs[parallel_state.get_data_parallel_rank()]))).pow(2).sum().backward()
    for x in inputs:  # the dense grads: the mean over the dp ranks' batches
        (dense2(torch.relu(dense1(x))).pow(2).sum() / dp).backward()
    params = [column.weight, column.bias, row.weight, row.bias]
    raw = [p.grad.clone() for p in params]
    dense_params = [*dense1.parameters(), *dense2.parameters()]
    max_norm = 0.5
    opt = NeuronZero1Optimizer(params, torch.optim.SGD, lr=0.1, max_norm=max_norm, grad_clipping=True,
                               sharding_groups=parallel_state.get_data_parallel_replica_groups())  # fmt: skip
    opt.base_optimizer.zero_grad = lambda set_to_none=True: None
    opt.step()
    expected = torch.nn.utils.clip_grad_norm_(dense_params, max_norm)
    torch.testing.assert_close(opt.grad_norm.reshape(()), expected, atol=1e-5, rtol=1e-5)
    for param, grad in zip(params, raw, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)  # NxD's model keeps its raw grads
    shards = []
    for group, shard_group in zip(opt.param_groups, opt.base_optimizer.param_groups, strict=True):
        for param, shard in zip(group["params"], shard_group["params"], strict=True):
            assert shard.numel() in (0, param.numel()) and (shard.grad is None) == (shard.numel() == 0)
            if hasattr(param, "tensor_model_parallel"):
                shard.tensor_model_parallel = param.tensor_model_parallel
            shards.append(shard)
    held = torch.tensor([float(s.numel() > 0) for s in shards])
    torch.distributed.all_reduce(held, group=parallel_state.get_data_parallel_group())
    assert held.tolist() == [1.0] * len(params), "each parameter is held whole by exactly one dp rank"
    after = grads.get_grad_norm(shards, zero1_optimizer=True,
                                zero1_optimizer_groups=parallel_state.get_data_parallel_replica_groups())  # fmt: skip
    dense_after = torch.stack([p.grad.norm() for p in dense_params]).norm()
    torch.testing.assert_close(after.reshape(()), dense_after, atol=1e-5, rtol=1e-5)
    assert after.item() <= max_norm + 1e-5
    with torch.no_grad():
        for p in dense_params:
            p.sub_(0.1 * p.grad)
    torch.testing.assert_close(column.weight, _shard(dense1.weight, 0, tp, tp_rank), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(column.bias, _shard(dense1.bias, 0, tp, tp_rank), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(row.weight, _shard(dense2.weight, 1, tp, tp_rank), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(row.bias, dense2.bias, atol=1e-6, rtol=1e-5)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("tp", [1, 2])
def test_nxd_zero1_shards_pair_with_the_parameters_and_keep_clipped_grads(tp: int) -> None:
    run_distributed(zero1_shards_case, 4, tp)


def xm_case() -> None:
    """The torch_xla shim: optimizer_step averages grads over the given replica groups, then steps."""
    from meshpar.compat.nxd import xla as xm
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = xm.get_ordinal()
    assert xm.xrt_world_size() == 4 and xm.xla_device() == torch.device("cpu")
    param = nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), float(rank))
    optimizer = torch.optim.SGD([param], lr=1.0)
    xm.optimizer_step(optimizer, groups=parallel_state.get_data_parallel_replica_groups())
    dp_ranks = next(g for g in parallel_state.get_data_parallel_replica_groups() if rank in g)
    torch.testing.assert_close(param.detach(), torch.full((3,), -sum(dp_ranks) / len(dp_ranks)))
    total = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([1.0]), scale=0.5)
    assert total.item() == 2.0
    assert xm.rendezvous("tag", b"x") == [b"x"] * 4
    xm.mark_step()


def test_nxd_xla_shim() -> None:
    run_distributed(xm_case, 4)


def conv_case(partition_pad: bool) -> None:
    """Output-channel-parallel conv feeding an input-channel-parallel conv (NxD's conv block) equals the dense pair:
    outputs, the input grad and each rank's part of the kernel and bias grads."""
    from meshpar.compat.nxd.parallel_layers import layers, parallel_state

    channels = 6 if partition_pad else 8  # 6 channels over tp=4: padded to 8
    for tp in _tp_sizes():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        rank = parallel_state.get_tensor_model_parallel_rank()
        torch.manual_seed(6)
        first = layers.OutputChannelParallelConv2d(3, channels, 3, padding=1, gather_output=False,
                                                   keep_master_weight=True, partition_pad=partition_pad)  # fmt: skip
        second = layers.InputChannelParallelConv2d(channels, 4, 3, stride=2, input_is_parallel=True,
                                                   keep_master_weight=True, partition_pad=partition_pad)  # fmt: skip
        assert first.weight.partition_dim == 0 and second.weight.partition_dim == 1
        real = first.out_channels - first.partition_pad_size
        dense1, dense2 = nn.Conv2d(3, real, 3, padding=1), nn.Conv2d(real, 4, 3, stride=2)
        with torch.no_grad():
            dense1.weight.copy_(first.master_weight[:real])
            dense1.bias.copy_(first.master_bias[:real])
            dense2.weight.copy_(second.master_weight[:, :real])
            dense2.bias.copy_(second.bias)
            # padded channels: zero kernels in, zero kernels out (what a preshard-padded checkpoint holds)
            per_rank = first.channels_per_partition
            mine = torch.arange(rank * per_rank, (rank + 1) * per_rank)
            first.weight[mine >= real] = 0
            first.bias[mine >= real] = 0
            second.weight[:, mine >= real] = 0
        x = torch.randn(2, 3, 9, 9)
        xp, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref = second(torch.relu(first(xp))), dense2(torch.relu(dense1(xd)))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        out.square().sum().backward()
        ref.square().sum().backward()
        torch.testing.assert_close(xp.grad, xd.grad, atol=1e-5, rtol=1e-4)
        keep = mine < real
        torch.testing.assert_close(first.weight.grad[keep], dense1.weight.grad[mine[keep]], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(first.bias.grad[keep], dense1.bias.grad[mine[keep]], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(second.weight.grad[:, keep], dense2.weight.grad[:, mine[keep]], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(second.bias.grad, dense2.bias.grad, atol=1e-4, rtol=1e-4)
        gathered = layers.OutputChannelParallelConv2d(3, channels, 1, keep_master_weight=True,
                                                      partition_pad=partition_pad)  # fmt: skip
        y = torch.randn(1, 3, 4, 4)
        expected = F.conv2d(y, gathered.master_weight, gathered.master_bias)[:, :channels]
        torch.testing.assert_close(gathered(y), expected, atol=1e-5, rtol=1e-5)
        _reset()


@pytest.mark.parametrize("partition_pad", [False, True])
def test_nxd_parallel_convs_equal_dense(partition_pad: bool) -> None:
    run_distributed(conv_case, 4, partition_pad)


def device_init_case() -> None:
    """NxD's device-side weight init (``_initialize_affine_weight_neuron``, the path for weights off the CPU, which
    NxD's unit tests patch by name) leaves this rank's part of the full parameter in the weight, strided blocks
    included, so that the layer starts equal to the dense one as on the CPU path."""
    from meshpar.compat.nxd.parallel_layers import layers, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    for dim, stride in ((0, 1), (1, 1), (0, 2)):
        shape = [8, 4]
        shape[dim] //= 2
        weight = torch.empty(shape)
        torch.manual_seed(7)
        layers._initialize_affine_weight_neuron(weight, nn.init.normal_, dim, 2, stride)
        torch.manual_seed(7)
        full = nn.init.normal_(torch.empty(8, 4))
        torch.testing.assert_close(weight, _shard(full, dim, 2, rank, stride), rtol=0, atol=0)
        assert (weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride) == (True, dim, stride)


def test_nxd_device_weight_init_gives_each_rank_its_part() -> None:
    run_distributed(device_init_case, 2)
