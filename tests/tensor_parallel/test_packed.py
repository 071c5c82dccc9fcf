"""Packed column-parallel projections (``[q | k | v]`` of grouped-query attention, ``[gate | up]``): each rank's output
is its share of every part in the model's order, followed by a plain row-parallel layer; output, input grad, every
parameter grad and the step equal the dense module's, and the checkpoint layout maps every row exactly once."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from meshpar._compat import DTensor
from meshpar._shards import in_parameter_layout, local_slice
from meshpar._stored_layout import GroupedRows, stored_as
from meshpar.tensor_parallel import PackedColumnParallel, RowParallel
from meshpar.testing import run_distributed, setup_parallel

HIDDEN, HEAD_DIM = 16, 4


class PackedAttentionLike(nn.Module):
    """Phi-3's slicing of a packed ``[q | k | v]`` with its own head counts, key/value heads shared by groups of
    query heads; an output projection over the query heads' features."""

    def __init__(self, heads: int, kv_heads: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.qkv = nn.Linear(HIDDEN, (heads + 2 * kv_heads) * HEAD_DIM, bias=bias)
        self.out = nn.Linear(heads * HEAD_DIM, HIDDEN, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q_rows, kv_rows = self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM
        q, k, v = self.qkv(x).split([q_rows, kv_rows, kv_rows], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)) for t in (q, k, v))
        group = self.heads // self.kv_heads
        mixed = q * k.repeat_interleave(group, dim=-2).tanh() + v.repeat_interleave(group, dim=-2)
        return self.out(mixed.flatten(-2))


class PackedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * 24, bias=False)
        self.down = nn.Linear(24, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


def _plan(module: nn.Module) -> dict:
    if isinstance(module, PackedMLP):
        return {"gate_up": PackedColumnParallel(parts=2), "down": RowParallel()}
    q, kv = module.heads * HEAD_DIM, module.kv_heads * HEAD_DIM
    return {"qkv": PackedColumnParallel(parts=(q, kv, kv), unit=HEAD_DIM), "out": RowParallel()}


def packed_case(heads: int, kv_heads: int, bias: bool) -> None:
    dims = setup_parallel(tp=torch.distributed.get_world_size())
    torch.manual_seed(0)
    dense = PackedAttentionLike(heads, kv_heads, bias) if heads else PackedMLP()
    model = parallelize_module(copy.deepcopy(dense), dims.tp_mesh, _plan(dense))
    if heads:
        model.heads, model.kv_heads = heads // dims.tp, kv_heads // dims.tp
    x = torch.randn(2, 5, HIDDEN)
    x_dense, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = dense(x_dense), model(x_tp)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(x_tp.grad, x_dense.grad, atol=1e-5, rtol=1e-5)
    torch.optim.SGD(dense.parameters(), lr=0.1).step()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for name, param in model.named_parameters():
        dense_param = dense.get_parameter(name)
        for mine, full in ((param.grad, dense_param.grad), (param, dense_param.detach())):
            expected = local_slice(in_parameter_layout(full, model, name), param)
            actual = mine.to_local() if isinstance(mine, DTensor) else mine
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    "world, heads, kv_heads, bias",
    [
        (2, 4, 2, True),  # grouped query: two groups of two query heads, one key and one value head
        (2, 8, 2, False),  # four query heads per group
        (2, 8, 4, True),  # two groups per rank: the local output is reordered into [q_r | k_r | v_r]
        (2, 4, 4, True),  # as many key/value heads as query heads: equal parts
        (4, 8, 4, True),
        (2, 0, 0, False),  # [gate | up]
    ],
)
def test_packed_column_then_row_matches_dense(world: int, heads: int, kv_heads: int, bias: bool) -> None:
    run_distributed(packed_case, world, heads, kv_heads, bias)


def refusal_case() -> list[str]:
    dims = setup_parallel(tp=2)
    messages = []
    for parts, unit in (((24, 4, 4), 4), ((16, 8, 8), 8), ((20, 12), 4)):
        linear = nn.Linear(HIDDEN, sum(parts))
        with pytest.raises(ValueError) as error:
            parallelize_module(linear, dims.tp_mesh, PackedColumnParallel(parts=parts, unit=unit))
        messages.append(str(error.value))
    return messages


def test_parts_tp_cannot_split_into_whole_heads_are_refused() -> None:
    """One key/value head, 3 heads per part, or groups of heads tp does not divide: a clear error, never a split
    head."""
    for messages in run_distributed(refusal_case, 2):
        assert "heads per packed part 1 is not divisible by tp=2" in messages[0], messages[0]
        assert "heads per packed part 1 is not divisible by tp=2" in messages[1], messages[1]
        assert "heads per packed part 5 is not divisible by tp=2" in messages[2], messages[2]


def test_grouped_rows_hold_one_key_value_head_with_its_query_heads() -> None:
    """Rows [q0 q1 q2 q3 | k0 k1 | v0 v1] in two groups: [q0 q1 k0 v0], [q2 q3 k1 v1] (Megatron's order)."""
    layout = GroupedRows((2, 1, 1), 1, (8, 1))
    packed = layout.pack(torch.arange(8.0).view(8, 1))
    assert packed.flatten().tolist() == [0, 1, 4, 6, 2, 3, 5, 7]


@pytest.mark.parametrize("slots, groups", [((2, 1, 1), 4), ((3, 1, 1), 2), ((1, 1), 6)])
def test_grouped_rows_pack_unpack_and_map_every_row_once(slots: tuple[int, ...], groups: int) -> None:
    unit, cols = 2, 3
    rows = groups * sum(slots) * unit
    layout = GroupedRows(slots, unit, (rows, cols))
    dense = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
    packed = layout.pack(dense)
    assert packed.shape == (groups, sum(slots) * unit, cols)
    torch.testing.assert_close(layout.unpack(packed), dense, rtol=0, atol=0)
    width = packed.shape[1]
    # every box of whole groups (tp and FSDP shards), with all slots or some, maps each of its rows exactly once
    for g0, g1 in itertools.combinations(range(groups + 1), 2):
        for s0, s1 in ((0, width), (0, 3), (3, width)):
            marker = torch.zeros_like(packed)
            marker[g0:g1, s0:s1] = 1
            seen = torch.zeros(rows)
            for offsets, piece in layout.pieces(packed[g0:g1, s0:s1], (g0, s0, 0)):
                r, n = offsets[0], piece.shape[0]
                torch.testing.assert_close(piece, dense[r : r + n], rtol=0, atol=0)
                seen[r : r + n] += 1
            torch.testing.assert_close(seen, layout.unpack(marker)[:, 0], rtol=0, atol=0)


def test_stored_as_keeps_the_model_shape() -> None:
    layout = GroupedRows((2, 1, 1), 2, (16, 3))
    packed = layout.pack(torch.randn(16, 3))
    stand_in = stored_as(packed, layout)
    assert tuple(stand_in.shape) == (16, 3)
