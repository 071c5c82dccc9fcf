"""Replicas equal by construction (meshpar.replicas): every rank builds its model with its own random weights, as a
script that never seeds does, and parallelize / apply_recipe still train the first rank's model exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import meshpar
from meshpar._compat import DTensor
from meshpar.recipe import Recipe, apply_recipe
from meshpar.replicas import make_replicas_equal
from meshpar.testing import run_distributed, setup_parallel
from tests._models import Block, block_plan

LR = 1e-2


def _llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def unseeded_parallelize_case(layout: dict) -> dict:
    """Rank r builds its model from seed 100 + r; the parallel model must be rank 0's (seed 100) exactly."""
    parallel = meshpar.parallelize(_llama(100 + dist.get_rank()), layout)
    dense = _llama(100)
    ids = torch.randint(0, 64, (4, 11), generator=torch.Generator().manual_seed(3))
    dims = parallel.dims
    optimizer = meshpar.DistributedOptimizer(parallel, torch.optim.AdamW, lr=LR)
    loss = parallel.train_step(input_ids=ids.chunk(dims.dp)[dims.dp_rank], labels=ids.chunk(dims.dp)[dims.dp_rank])
    optimizer.step()
    dense_loss = dense(input_ids=ids, labels=ids).loss
    dense_loss.backward()
    torch.optim.AdamW(dense.parameters(), lr=LR).step()
    worst, compared = 0.0, 0
    for module in parallel.local_modules():
        for name, param in module.named_parameters():
            worst = max(worst, (_full(param) - dense.get_parameter(name)).abs().max().item())
            compared += 1
    return {"loss": loss.item(), "dense": dense_loss.item(), "worst": worst, "compared": compared}


@pytest.mark.parametrize(
    "layout",
    [
        {"tensor_parallel_size": 2},
        pytest.param(
            {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "num_microbatches": 2}, marks=pytest.mark.slow
        ),
        {"tensor_parallel_size": 1, "data_parallel_size": 2},
    ],
)
def test_unseeded_models_parallelize_to_the_first_ranks_model(layout: dict) -> None:
    world = (
        layout["tensor_parallel_size"] * layout.get("pipeline_parallel_size", 1) * layout.get("data_parallel_size", 1)
    )
    for result in run_distributed(unseeded_parallelize_case, world, layout):
        assert result["compared"] > 0
        assert abs(result["loss"] - result["dense"]) < 1e-5, result
        # AdamW's first step is lr * g / (|g| + eps) per entry: grads that differ only by dp's summation order move
        # the few near-zero entries by up to ~1e-5; replicas left unequal differ by the init scale (~2e-2)
        assert result["worst"] < 1e-4, result


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(16, 4, 24) for _ in range(2))
        self.register_buffer("scale", torch.rand(16))
        self.register_buffer("mask", torch.rand(16) > 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x * self.scale * self.mask


def unseeded_recipe_case() -> dict:
    """apply_recipe on rank-seeded plain modules (tp2 x dp2): every rank trains the first rank's module, its buffers
    (a bool one too) included; a second make_replicas_equal finds nothing to change."""
    dims = setup_parallel(tp=2)
    torch.manual_seed(7 + dist.get_rank())
    model = _Net()
    torch.manual_seed(7)
    dense = _Net()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    model = apply_recipe(model, dims, Recipe(tp_plan=block_plan(heads=4), blocks="layers"))
    out = model(x)
    torch.testing.assert_close(out, dense(x), atol=1e-5, rtol=1e-5)
    F.mse_loss(out, torch.zeros_like(out)).backward()
    F.mse_loss(dense(x), torch.zeros_like(out)).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(_full(param.grad), dense.get_parameter(name).grad, atol=1e-5, rtol=1e-5)
    again = copy.deepcopy(dense)
    make_replicas_equal(again, dims)  # already equal everywhere: nothing moves
    pairs = zip(again.state_dict().values(), dense.state_dict().values(), strict=True)
    return {"equal": all(torch.equal(a, b) for a, b in pairs)}


def test_apply_recipe_makes_unseeded_replicas_equal() -> None:
    assert run_distributed(unseeded_recipe_case, 4) == [{"equal": True}] * 4


def apex_build_model_case() -> bool:
    """apex's build_model(wrap_with_ddp=True) at tp2 x dp2 with rank-seeded providers: each dp group's replicas
    hold dp rank 0's values afterwards (torch's DDP does the same at construction)."""
    from meshpar.compat.apex.pipeline_parallel import build_model

    dims = setup_parallel(tp=2)
    torch.manual_seed(dist.get_rank())
    chunks = build_model(lambda pre_process, post_process: torch.nn.Linear(8, 8), True, None)
    weight = chunks[0].module.weight.detach()
    replicas = [torch.empty_like(weight) for _ in range(dims.dp)]
    dist.all_gather(replicas, weight, group=dims.dp_mesh.get_group())
    return all(torch.equal(r, replicas[0]) for r in replicas)


def test_apex_build_model_makes_dp_replicas_equal() -> None:
    assert run_distributed(apex_build_model_case, 4) == [True] * 4


def unseeded_pipeline_case() -> dict:
    """NxD's entry point (NxDPPModel) at pp2 x dp2 on rank-seeded models: the pipeline trains the
    first rank's model."""
    from meshpar.compat.nxd.pipeline import NxDPPModel
    from tests._models import PipeGPT, lm_loss

    setup_parallel(pp=2)
    torch.manual_seed(50 + dist.get_rank())
    model = NxDPPModel(
        PipeGPT(layers=4),
        transformer_layer_cls=Block,
        num_microbatches=2,
        input_names=["ids"],
        broadcast_and_average_loss=True,
        loss_fn=lambda logits, ids, labels: lm_loss(logits, labels),
    )
    torch.manual_seed(50)
    dense = PipeGPT(layers=4)
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(9))
    loss = model.run_train(ids=ids, labels=ids)
    return {"loss": loss.item(), "dense": lm_loss(dense(ids), ids).item()}


@pytest.mark.slow  # world 4, a pipeline
def test_pipeline_model_makes_unseeded_replicas_equal() -> None:
    for result in run_distributed(unseeded_pipeline_case, 4):
        assert abs(result["loss"] - result["dense"]) < 1e-5, result
