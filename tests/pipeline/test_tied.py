"""A weight the model ties, split across pipeline stages, stays one weight (meshpar.pipeline.tied): the tie groups
read off the model, the copies started from the first holder's values, their grads summed into each copy after the
backward (the dense grad of the tied weight), the grad norm counting the weight once; the one combination that
cannot sum after the dp reductions is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshpar.pipeline.tied import merged_groups, tied_parameter_groups
from meshpar.testing import run_distributed
from tests._models import TanhLayer, TiedLM, token_loss

H, VOCAB = 6, 9


def test_tie_groups_are_read_off_the_model_and_merged() -> None:
    model = TiedLM(H, VOCAB)
    model.layers[3].linear.weight = model.layers[1].linear.weight
    assert tied_parameter_groups(model) == [
        ["embed.weight", "head.weight"],
        ["layers.1.linear.weight", "layers.3.linear.weight"],
    ]
    assert tied_parameter_groups(nn.Linear(2, 2)) == []
    assert merged_groups([["a", "b"], ["c", "d"], ["b", "e"], ["f"]]) == [["a", "b", "e"], ["c", "d"]]


def core_tied_case() -> None:
    """pp2 x dp2 through meshpar's own pipeline API: the last stage's copy of the tied embedding, deliberately
    different before the pipeline is built, starts as the first stage's; after a step both copies hold the dense
    grad of the one weight and the norm counts it once; an overlapped dp reduction left to the caller is refused."""
    from meshpar.grad_clip import total_grad_norm
    from meshpar.parallel_dims import get_parallel
    from meshpar.parallel_state import initialize_model_parallel
    from meshpar.pipeline import PipelineModel, StageChunk, split_model

    initialize_model_parallel(1, 2)
    dims = get_parallel()
    dense, model = TiedLM(H, VOCAB), TiedLM(H, VOCAB)
    if dims.pp_rank == 1:
        with torch.no_grad():
            model.embed.weight.add_(1.0)  # this rank's copy differs: the first stage's must win
    stages, plan = split_model(model, dims.pp_rank, dims.pp, transformer_layer_cls=TanhLayer)
    chunks = [StageChunk(stage, index, ["ids"]) for index, stage in stages]
    groups = tied_parameter_groups(model)
    pipeline = PipelineModel(chunks, plan, dims, num_microbatches=2, loss_fn=token_loss, tied_parameters=groups)
    copy = dict(pipeline.local_named_parameters())["head.weight" if dims.pp_rank == 1 else "embed.weight"]
    torch.testing.assert_close(copy.detach(), dense.embed.weight.detach())

    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (4 * dims.dp, 5))
    labels = ids.roll(1, 1)
    mine = slice(4 * dims.dp_rank, 4 * dims.dp_rank + 4)
    pipeline.run_train(ids=ids[mine], labels=labels[mine])
    torch.stack(
        [token_loss(dense(i), t) for i, t in zip(ids.chunk(2 * dims.dp), labels.chunk(2 * dims.dp), strict=True)]
    ).mean().backward()
    torch.testing.assert_close(copy.grad, dense.embed.weight.grad, atol=1e-6, rtol=1e-5)
    norm = total_grad_norm(list(pipeline.local_parameters()), dims=dims)
    dense_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in dense.parameters()]))
    torch.testing.assert_close(norm, dense_norm, atol=1e-6, rtol=1e-5)

    stages, plan = split_model(TiedLM(H, VOCAB), dims.pp_rank, dims.pp, transformer_layer_cls=TanhLayer)
    chunks = [StageChunk(stage, index, ["ids"]) for index, stage in stages]
    with pytest.raises(ValueError, match="average_grads_over_dp=False"):
        PipelineModel(chunks, plan, dims, num_microbatches=2, loss_fn=token_loss, tied_parameters=groups,
                      dp_mode="overlapped", average_grads_over_dp=False)  # fmt: skip


def test_a_tied_weight_split_across_stages_stays_one_weight() -> None:
    run_distributed(core_tied_case, 4)
