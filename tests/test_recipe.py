"""The model-agnostic recipe (meshpar.recipe) on a plain nn.Module: loss, every grad and the parameters after an
AdamW step equal the dense model's, at several tp x dp layouts with and without FSDP2 and activation checkpointing;
ties survive sharding; a meta-built module is allocated shard by shard."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshpar._compat import DTensor
from meshpar.data_parallel import allreduce_gradients
from meshpar.recipe import Recipe, apply_recipe
from meshpar.tensor_parallel import ColumnParallel, VocabParallel
from meshpar.testing import run_distributed
from meshpar.testing.reference import setup_parallel
from tests._models import Block, block_plan

VOCAB, HIDDEN, HEADS, SEQ, BATCH = 24, 16, 4, 7, 4  # odd sequence length


class TiedLM(nn.Module):
    """Embedding -> blocks -> LM head tied to the embedding."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(HIDDEN, HEADS, 24) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _recipe(**options: object) -> Recipe:
    plan = {**block_plan(heads=HEADS), "embed": VocabParallel(), "head": ColumnParallel(gather_output=True)}
    return Recipe(tp_plan=plan, blocks="layers", ties=[("head.weight", "embed.weight")], **options)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def recipe_matches_dense(tp: int, fsdp: bool, checkpointing: bool) -> list[str]:
    dims = setup_parallel(tp=tp)
    torch.manual_seed(0)
    dense = TiedLM()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    model = apply_recipe(copy.deepcopy(dense), dims, _recipe(fsdp=fsdp, activation_checkpointing=checkpointing))
    assert model.head.weight is model.embed.weight, "the tie survives sharding"
    mine = ids.chunk(dims.dp)[dims.dp_rank]  # each dp replica its slice of the batch
    loss = _loss(model, mine)
    loss.backward()
    if not fsdp:
        allreduce_gradients(model.parameters(), dims.dp_mesh)
    dense_loss = _loss(dense, mine)  # this replica's slice, dense
    torch.testing.assert_close(loss, dense_loss, atol=1e-5, rtol=1e-5)
    _loss(dense, ids).backward()
    params = dict(model.named_parameters())
    for name, ref in dense.named_parameters():
        torch.testing.assert_close(_full(params[name].grad), ref.grad, atol=1e-5, rtol=1e-4, msg=f"grad {name}")
    for net in (model, dense):
        # eps well above round-off: the key bias's true grad is 0, and Adam's first step would blow its noise up
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, eps=1e-4)
        optimizer.step()
    for name, ref in dense.named_parameters():
        torch.testing.assert_close(_full(params[name]), ref, atol=1e-5, rtol=1e-4, msg=f"param {name}")
    layouts = {type(p).__name__ for p in params.values()}
    return [*sorted(layouts), str(len(params))]


@pytest.mark.parametrize(
    ("tp", "fsdp", "checkpointing"), [(2, True, True), (2, False, False), (4, False, True), (1, True, False)]
)
def test_recipe_matches_dense(tp: int, fsdp: bool, checkpointing: bool) -> None:
    results = run_distributed(recipe_matches_dense, 4, tp, fsdp, checkpointing)
    assert all(r == results[0] for r in results)
    assert "DTensor" in results[0], "parameters are sharded"


def meta_module_is_allocated_shard_by_shard() -> list[float]:
    dims = setup_parallel(tp=2)
    with torch.device("meta"):
        model = TiedLM()
    with pytest.raises(ValueError, match="init_weights"):
        apply_recipe(copy.deepcopy(model), dims, _recipe())
    torch.manual_seed(dist.get_rank())  # every rank draws differently: the recipe makes replicas agree

    def init(module: nn.Module) -> None:
        for sub in module.modules():
            if sub is not module and hasattr(sub, "reset_parameters"):
                sub.reset_parameters()

    model = apply_recipe(model, dims, _recipe(init_weights=init))
    assert not any(t.is_meta for t in model.parameters())
    assert model.head.weight is model.embed.weight
    local = model.layers[0].qkv.weight.to_local()
    assert local.shape == (3 * HIDDEN // 2, HIDDEN), "only this rank's shard is allocated"
    replicated = model.layers[0].out.bias  # row-parallel bias: replicated over tp, drawn per rank above
    return [(replicated.to_local() if isinstance(replicated, DTensor) else replicated).sum().item()]


def test_meta_module_is_allocated_shard_by_shard() -> None:
    results = run_distributed(meta_module_is_allocated_shard_by_shard, 2)
    assert results[0] == results[1], "replicated and sharded parameters agree across ranks"
