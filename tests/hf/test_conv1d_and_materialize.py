"""Unit tests of two pieces otherwise reached only through whole models: GPT-2's tensor-parallel ``Conv1D`` (the
fused QKV split per part) against the dense ``Conv1D``, and building on meta then materialising shards (ties kept,
replicas identical)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers.pytorch_utils import Conv1D

from meshpar._compat import DTensor
from meshpar._shards import local_slice
from meshpar.hf.conv1d import ColumnParallelConv1D, RowParallelConv1D
from meshpar.materialize import make_replicas_agree, materialize_sharded
from meshpar.testing import run_distributed, setup_parallel, shard_of

HIDDEN, BATCH, SEQ = 8, 2, 4


def _check(layer: nn.Module, dense: nn.Module) -> None:
    for name, param in layer.named_parameters():
        full = dense.get_parameter(name)
        for what, got, want in (("value", param.detach(), full.detach()), ("grad", param.grad, full.grad)):
            want = local_slice(want.reshape(param.shape), param)
            got = got.to_local() if isinstance(got, DTensor) else got
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"{what} of {name}")


def conv1d_case(sp: bool, gather_output: bool) -> None:
    """c_attn (3 fused parts, each split per head) then c_proj, as GPT-2's attention without the attention."""
    dims = setup_parallel(tp=2)
    mesh = dims.tp_mesh
    torch.manual_seed(0)
    dense = nn.ModuleDict({"c_attn": Conv1D(3 * HIDDEN, HIDDEN), "c_proj": Conv1D(HIDDEN, HIDDEN)})
    nn.init.normal_(dense.c_attn.bias)
    nn.init.normal_(dense.c_proj.bias)
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    q, k, v = dense.c_attn(x).split(HIDDEN, -1)
    want = dense.c_proj(q * k + v)
    want.square().sum().backward()

    model = copy.deepcopy(dense)
    column = ColumnParallelConv1D.from_conv1d(
        model.c_attn, mesh, fused=3, gather_output=gather_output, sequence_parallel=sp
    )
    row = RowParallelConv1D.from_conv1d(model.c_proj, mesh, sequence_parallel=sp) if not gather_output else None
    assert column.checkpoint_shapes == {"weight": (HIDDEN, 3 * HIDDEN), "bias": (3 * HIDDEN,)}
    mine = (shard_of(x.detach(), mesh, 1) if sp else x.detach()).clone().requires_grad_()
    parts = column(mine)
    if gather_output:  # every rank holds the whole [q | k | v] in HF's layout
        torch.testing.assert_close(parts, dense.c_attn(x).detach(), atol=1e-6, rtol=1e-5)
        return
    q, k, v = parts.split(HIDDEN // 2, -1)  # this rank's heads of each part
    out = row(q * k + v)
    torch.testing.assert_close(out, shard_of(want.detach(), mesh, 1) if sp else want.detach(), atol=1e-6, rtol=1e-5)
    out.square().sum().backward()
    want_grad = shard_of(x.grad, mesh, 1) if sp else x.grad
    torch.testing.assert_close(mine.grad, want_grad, atol=1e-5, rtol=1e-5)
    _check(model, dense)


@pytest.mark.parametrize(("sp", "gather_output"), [(False, False), (True, False), (False, True)])
def test_conv1d_column_and_row_match_dense(sp: bool, gather_output: bool) -> None:
    run_distributed(conv1d_case, 2, sp, gather_output)


def test_conv1d_refuses_a_split_that_is_not_per_part() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        ColumnParallelConv1D.from_conv1d(Conv1D(3 * 6, HIDDEN), _FakeMesh(4), fused=3)


class _FakeMesh:
    """Just enough of a DeviceMesh for the size check that runs before anything is distributed."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 16, bias=False)
        self.head.weight = self.embed.weight

    def initialize_weights(self) -> None:  # each rank draws its own values
        for module in self.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()


def materialize_case() -> list[float]:
    dims = setup_parallel(tp=2)
    with torch.device("meta"):
        model = Tied()
    torch.manual_seed(dist.get_rank())  # every rank initialises differently: agreement must come from the broadcast
    materialize_sharded(model, dims, init=Tied.initialize_weights)
    assert model.head.weight is model.embed.weight, "a tie made on meta is kept"
    assert not any(p.is_meta for p in model.parameters())
    torch.manual_seed(100 + dist.get_rank())
    with torch.no_grad():
        model.proj.weight.normal_()
    make_replicas_agree(model, dims)
    return [p.sum().item() for p in model.parameters()]


@pytest.mark.slow  # a meta-built model allocated shard by shard in every layout
def test_materialised_shards_keep_ties_and_replicas_agree() -> None:
    sums = run_distributed(materialize_case, 4)  # tp=2 x dp=2, nothing sharded: all four must agree
    assert all(s == sums[0] for s in sums), sums
