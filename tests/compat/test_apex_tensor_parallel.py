"""apex's tensor_parallel view against dense torch at tp 1, 2 and 4 (one gloo world of 4; each case loops over the tp
sizes as apex's own tests do): layers with apex's layout, returns and parameters, the region mappings and their
private helpers, the affine-weight initialisers, data broadcast, the neighbour transfers and the small utilities."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshpar.compat.apex import parallel_state, tensor_parallel
from meshpar.compat.apex.pipeline_parallel import p2p_communication
from meshpar.compat.apex.tensor_parallel import layers, mappings
from meshpar.testing import run_distributed

S, B, H = 8, 3, 16  # apex's [s, b, h]


def _tp_sizes(world: int = 4) -> list[int]:
    return [tp for tp in (1, 2, 4) if world % tp == 0]


def _dense_linear(master: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    dense = nn.Linear(master.shape[1], master.shape[0], bias=bias is not None)
    with torch.no_grad():
        dense.weight.copy_(master)
        if bias is not None:
            dense.bias.copy_(bias)
    return dense


def column_case(sequence_parallel: bool, skip_bias_add: bool, fused_accumulation: bool) -> None:
    for tp in _tp_sizes():
        if sequence_parallel and tp == 1:
            continue
        parallel_state.initialize_model_parallel(tensor_model_parallel_size_=tp)
        rank = parallel_state.get_tensor_model_parallel_rank()
        torch.manual_seed(0)
        x = torch.randn(S, B, H)
        grad_out = torch.randn(S, B, 2 * H)
        layer = layers.ColumnParallelLinear(
            H, 2 * H, gather_output=False, keep_master_weight_for_test=True, skip_bias_add=skip_bias_add,
            use_cpu_initialization=True, sequence_parallel_enabled=sequence_parallel,
            no_async_tensor_model_parallel_allreduce=sequence_parallel, gradient_accumulation_fusion=fused_accumulation,
        )  # fmt: skip
        assert layer.weight.shape == (2 * H // tp, H) and type(layer.weight) is nn.Parameter
        assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
        with torch.no_grad():
            layer.bias.copy_(torch.arange(2 * H, dtype=torch.float).chunk(tp)[rank])
        if fused_accumulation:
            layer.weight.main_grad = torch.zeros_like(layer.weight)
        mine = x.chunk(tp, 0)[rank].clone() if sequence_parallel else x.clone()
        mine.requires_grad_()
        out, bias = layer(mine)
        (out + (bias if skip_bias_add else 0)).mul(grad_out.chunk(tp, -1)[rank]).sum().backward()

        dense = _dense_linear(layer.master_weight, torch.arange(2 * H, dtype=torch.float))
        xd = x.clone().requires_grad_()
        dense(xd).mul(grad_out).sum().backward()
        expected = dense(x).detach().chunk(tp, -1)[rank]
        if skip_bias_add:
            assert bias is layer.bias
            expected = expected - dense.bias.detach().chunk(tp)[rank]
        else:
            assert bias is None
        torch.testing.assert_close(out, expected)
        weight_grad = layer.weight.main_grad if fused_accumulation else layer.weight.grad
        if fused_accumulation:
            assert layer.weight.grad is None
        torch.testing.assert_close(weight_grad, dense.weight.grad.chunk(tp, 0)[rank], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.grad, xd.grad.chunk(tp, 0)[rank] if sequence_parallel else xd.grad)
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize(
    ("sequence_parallel", "skip_bias_add", "fused_accumulation"),
    [(False, False, False), (False, True, True), (True, False, False)],
)
def test_column_parallel_linear_is_apexs(sequence_parallel: bool, skip_bias_add: bool, fused_accumulation: bool):
    run_distributed(column_case, 4, sequence_parallel, skip_bias_add, fused_accumulation)


def row_case(sequence_parallel: bool, skip_bias_add: bool) -> None:
    for tp in _tp_sizes():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size_=tp)
        rank = parallel_state.get_tensor_model_parallel_rank()
        torch.manual_seed(0)
        x, grad_out = torch.randn(S, B, 2 * H), torch.randn(S, B, H)
        layer = layers.RowParallelLinear(
            2 * H, H, input_is_parallel=True, keep_master_weight_for_test=True, use_cpu_initialization=True,
            skip_bias_add=skip_bias_add, sequence_parallel_enabled=sequence_parallel,
        )  # fmt: skip
        assert layer.weight.shape == (H, 2 * H // tp) and layer.weight.partition_dim == 1
        with torch.no_grad():
            layer.bias.normal_()
        mine = x.chunk(tp, -1)[rank].clone().requires_grad_()
        out, bias = layer(mine)
        upstream = grad_out.chunk(tp, 0)[rank] if sequence_parallel else grad_out
        (out + (bias if skip_bias_add else 0)).mul(upstream).sum().backward()

        dense = _dense_linear(layer.master_weight, layer.bias.detach())
        xd = x.clone().requires_grad_()
        dense(xd).mul(grad_out).sum().backward()
        expected = dense(x).detach() - (dense.bias.detach() if skip_bias_add else 0)
        torch.testing.assert_close(out, expected.chunk(tp, 0)[rank] if sequence_parallel else expected)
        assert (bias is layer.bias) if skip_bias_add else bias is None
        torch.testing.assert_close(layer.weight.grad, dense.weight.grad.chunk(tp, 1)[rank], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.grad, xd.grad.chunk(tp, -1)[rank])
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize(("sequence_parallel", "skip_bias_add"), [(False, False), (False, True), (True, False)])
def test_row_parallel_linear_is_apexs(sequence_parallel: bool, skip_bias_add: bool) -> None:
    run_distributed(row_case, 4, sequence_parallel, skip_bias_add)


def embedding_and_init_case() -> None:
    for tp in _tp_sizes():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size_=tp)
        rank = parallel_state.get_tensor_model_parallel_rank()
        torch.manual_seed(5)
        ids, weights = torch.randint(0, 32, (B, S)), torch.randn(B, S, H)
        torch.manual_seed(7)
        dense = nn.Embedding(32, H)
        torch.manual_seed(7)
        parallel = layers.VocabParallelEmbedding(32, H, init_method=nn.init.normal_, use_cpu_initialization=True)
        torch.testing.assert_close(parallel.weight, dense.weight.detach().chunk(tp, 0)[rank])
        dense(ids).mul(weights).sum().backward()
        out = parallel(ids)
        out.mul(weights).sum().backward()
        torch.testing.assert_close(out, dense(ids))
        torch.testing.assert_close(parallel.weight.grad, dense.weight.grad.chunk(tp, 0)[rank])

        # the CPU initialiser deals out blocks of per_partition / stride rows round-robin (fused q/k/v weights)
        for stride in (1, 2):
            torch.manual_seed(3)
            master = torch.empty(8 * tp, 4)
            nn.init.normal_(master)
            torch.manual_seed(3)
            shard = torch.empty(8, 4)
            returned = layers._initialize_affine_weight_cpu(
                shard, 8 * tp, 4, 8, 0, nn.init.normal_, stride=stride, return_master_weight=True
            )
            torch.testing.assert_close(returned, master)
            blocks = master.split(8 // stride, 0)
            torch.testing.assert_close(shard, torch.cat(blocks[rank::tp]))
            assert shard.tensor_model_parallel and shard.partition_stride == stride
        parallel_state.destroy_model_parallel()


def test_vocab_parallel_embedding_and_the_weight_initialisers_match_dense() -> None:
    run_distributed(embedding_and_init_case, 4)


def mappings_case() -> None:
    for tp in _tp_sizes():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size_=tp)
        rank = parallel_state.get_tensor_model_parallel_rank()
        full = torch.arange(S * B * H, dtype=torch.float).view(S, B, H)
        mine_last, mine_first = full.chunk(tp, -1)[rank], full.chunk(tp, 0)[rank]
        torch.testing.assert_close(mappings._split_along_last_dim(full), mine_last)
        torch.testing.assert_close(mappings._split_along_first_dim(full), mine_first)
        torch.testing.assert_close(mappings._gather_along_last_dim(mine_last.contiguous()), full)
        torch.testing.assert_close(mappings._gather_along_first_dim(mine_first.contiguous()), full)
        torch.testing.assert_close(mappings._reduce(full.clone()), full * tp)
        torch.testing.assert_close(mappings._reduce_scatter_along_first_dim(full.clone()), mine_first * tp)

        x = full.clone().requires_grad_()
        mappings.scatter_to_sequence_parallel_region(x).sum().backward()
        torch.testing.assert_close(x.grad, torch.ones_like(full))  # backward all-gathers every rank's slice grad
        shard = mine_first.clone().requires_grad_()
        gathered = mappings.gather_from_sequence_parallel_region(shard)
        torch.testing.assert_close(gathered, full)
        gathered.sum().backward()
        torch.testing.assert_close(shard.grad, torch.full_like(mine_first, float(tp)))  # reduce-scattered
        shard = mine_first.clone().requires_grad_()
        mappings.gather_from_sequence_parallel_region(shard, to_model_parallel=False).sum().backward()
        torch.testing.assert_close(shard.grad, torch.ones_like(mine_first))  # split, not summed
        torch.testing.assert_close(tensor_parallel.scatter_to_tensor_model_parallel_region(full), mine_last)
        parallel_state.destroy_model_parallel()


def test_region_mappings_and_their_private_helpers_are_apexs() -> None:
    run_distributed(mappings_case, 4)


def data_and_cross_entropy_case() -> None:
    for tp in _tp_sizes():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size_=tp)
        rank = parallel_state.get_tensor_model_parallel_rank()
        keys = ["text", "types"]
        batch = {"text": torch.randint(0, 9, (2, 5)), "types": torch.randint(0, 9, (3, 1, 2))}
        sizes, numels, total = tensor_parallel.data._build_key_size_numel_dictionaries(
            keys, batch if rank == 0 else None
        )
        assert sizes == {"text": [2, 5], "types": [3, 1, 2]} and numels == {"text": 10, "types": 6} and total == 16
        torch.manual_seed(0)  # every rank draws the same batch; only tp rank 0's is read
        data = {"text": torch.randint(0, 9, (2, 5)), "types": torch.randint(0, 9, (3, 1, 2))}
        received = tensor_parallel.broadcast_data(keys, data if rank == 0 else None, torch.int64)
        for key in keys:
            torch.testing.assert_close(received[key], data[key])
        with pytest.raises(TypeError, match="different than"):
            tensor_parallel.data._check_data_types(keys, data, torch.float32)

        torch.manual_seed(1)
        logits, target = torch.randn(S, B, 32), torch.randint(0, 32, (S, B))
        losses = tensor_parallel.vocab_parallel_cross_entropy(logits.chunk(tp, -1)[rank].clone(), target, 0.1)
        torch.testing.assert_close(losses, F.cross_entropy(logits.view(-1, 32), target.view(-1), reduction="none",
                                                           label_smoothing=0.1).view(S, B))  # fmt: skip
        parts = tensor_parallel.split_tensor_along_last_dim(logits, 4, contiguous_split_chunks=True)
        assert len(parts) == 4 and all(p.is_contiguous() and p.shape == (S, B, 8) for p in parts)
        first, last = tensor_parallel.utils.VocabUtility.vocab_range_from_global_vocab_size(32, rank, tp)
        assert (first, last) == (rank * 32 // tp, (rank + 1) * 32 // tp)
        parallel_state.destroy_model_parallel()


def test_data_broadcast_and_vocab_parallel_cross_entropy_are_apexs() -> None:
    run_distributed(data_and_cross_entropy_case, 4)


def p2p_case() -> list:
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size_=4)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    mine = torch.full((2, 2), float(rank))
    got = []
    if parallel_state.is_pipeline_first_stage():
        p2p_communication.send_forward(mine, tensor_shape=(2, 2))
        got.append(p2p_communication.recv_forward(tensor_shape=(2, 2)))
    elif parallel_state.is_pipeline_last_stage():
        got.append(p2p_communication.recv_forward(tensor_shape=(2, 2)))
    else:
        got.append(p2p_communication.send_forward_recv_forward(mine, recv_prev=True, tensor_shape=(2, 2)))
    if parallel_state.is_pipeline_last_stage():
        p2p_communication.send_backward(mine * 10, tensor_shape=(2, 2))
    elif parallel_state.is_pipeline_first_stage():
        got.append(p2p_communication.recv_backward(tensor_shape=(2, 2), dtype=torch.float32))
    else:
        got.append(p2p_communication.send_backward_recv_backward(mine * 10, recv_next=True, tensor_shape=(2, 2)))
    parallel_state.destroy_model_parallel()
    return [None if t is None else (t[0, 0].item(), t.requires_grad) for t in got]


def test_neighbour_transfers_skip_the_missing_neighbour_and_deliver_the_rest() -> None:
    results = run_distributed(p2p_case, 4)
    assert results[0] == [None, (10.0, True)]  # the first stage receives no activation
    assert results[1] == [(0.0, True), (20.0, True)]
    assert results[2] == [(1.0, True), (30.0, True)]
    assert results[3] == [(2.0, True)]  # the last stage receives no grad


def no_shape_case() -> None:
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size_=2)
    with pytest.raises(RuntimeError, match="tensor_shape must be given"):
        p2p_communication.recv_forward(tensor_shape=None)
    parallel_state.destroy_model_parallel()


def test_a_receive_without_a_tensor_shape_is_refused() -> None:
    run_distributed(no_shape_case, 2)
