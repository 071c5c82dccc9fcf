"""meshpar's schedules on torch's pipelining runtime vs the dense model: losses and every parameter's grad."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import parallelize_module

from meshpar.pipeline.split import split_model
from meshpar.testing import assert_matches_dense, run_distributed, setup_parallel
from meshpar.testing.torch_runtime import build_schedule, make_pipeline_stages
from tests._models import Block, PipeGPT, lm_loss, pipe_gpt_plan

BATCH_PER_MB, SEQ = 2, 8


def _dense_reference(layers: int, m: int) -> tuple[PipeGPT, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    dense = PipeGPT(layers=layers)
    ids = torch.randint(0, 32, (m * BATCH_PER_MB, SEQ))
    labels = torch.randint(0, 32, (m * BATCH_PER_MB, SEQ))
    losses = [lm_loss(dense(i), t) for i, t in zip(ids.chunk(m), labels.chunk(m), strict=True)]
    torch.stack(losses).sum().backward()
    return dense, ids, labels, [loss.detach() for loss in losses]


def runtime_case(schedule: str, pp: int, tp: int, v: int, m: int, layers: int) -> None:
    dims = setup_parallel(tp=tp, pp=pp)
    dense, ids, labels, expected_losses = _dense_reference(layers, m)
    torch.manual_seed(0)
    model = PipeGPT(layers=layers)
    stage_modules, plan = split_model(model, dims.pp_rank, pp, transformer_layer_cls=Block, virtual_pipeline_size=v)
    if tp > 1:
        stage_modules = [(i, parallelize_module(mod, dims.tp_mesh, pipe_gpt_plan())) for i, mod in stage_modules]
    stages = make_pipeline_stages(stage_modules, plan.num_stages, dims.pp_mesh, torch.device("cpu"))
    sched = build_schedule(schedule, stages, m, loss_fn=lm_loss, scale_grads=False)
    losses: list[torch.Tensor] = []
    sched.step(ids, target=labels, losses=losses)
    owns_last = any(i == plan.num_stages - 1 for i, _ in stage_modules)
    if owns_last:
        torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses), atol=1e-5, rtol=1e-5)
    dense_params = dict(dense.named_parameters())
    for _, module in stage_modules:
        for name, param in module.named_parameters():
            assert_matches_dense(param.grad, dense_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    ("schedule", "pp", "tp", "v", "m", "layers"),
    [
        ("gpipe", 2, 1, 1, 4, 4),
        ("1f1b", 2, 1, 1, 2, 3),  # m == pp, uneven layers
        ("1f1b", 4, 1, 1, 8, 5),
        ("interleaved_1f1b", 2, 1, 2, 2, 4),  # m == pp: all warm-up
        ("interleaved_1f1b", 2, 1, 2, 6, 4),
        ("interleaved_1f1b", 2, 1, 2, 5, 4),  # m not a multiple of pp
        ("interleaved_1f1b", 4, 1, 2, 4, 8),  # m == pp at pp=4
        ("interleaved_1f1b", 4, 1, 2, 8, 8),
        ("interleaved_1f1b", 4, 1, 2, 12, 8),  # 3 pp
        ("interleaved_1f1b", 4, 1, 2, 6, 9),  # m % pp != 0 and uneven layers at pp=4
        ("1f1b", 2, 2, 1, 4, 4),  # pp x tp on 4 ranks
        ("interleaved_1f1b", 2, 2, 2, 4, 4),
        ("torch_1f1b", 2, 1, 1, 4, 4),
        ("torch_interleaved_1f1b", 2, 1, 2, 4, 4),
        ("zb_h1", 2, 1, 1, 4, 4),  # the split backward on torch's runtime
        ("zb_h1", 4, 1, 1, 5, 5),
        ("zb_h1", 2, 2, 1, 4, 4),
        ("torch_interleaved_zero_bubble", 2, 1, 2, 4, 4),
    ],
)
def test_schedule_matches_dense(schedule: str, pp: int, tp: int, v: int, m: int, layers: int) -> None:
    run_distributed(runtime_case, 4, schedule, pp, tp, v, m, layers)


def eval_case(pp: int, v: int) -> None:
    dims = setup_parallel(pp=pp)
    torch.manual_seed(0)
    model = PipeGPT(layers=4)
    ids = torch.randint(0, 32, (8, SEQ))
    with torch.no_grad():
        expected = model(ids)
    stage_modules, plan = split_model(model, dims.pp_rank, pp, transformer_layer_cls=Block, virtual_pipeline_size=v)
    stages = make_pipeline_stages(stage_modules, plan.num_stages, dims.pp_mesh, torch.device("cpu"))
    sched = build_schedule("interleaved_1f1b", stages, 4, forward_only=True)
    with torch.no_grad():
        out = sched.eval(ids)
    if any(i == plan.num_stages - 1 for i, _ in stage_modules):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("pp", "v"), [(2, 1), (2, 2), (4, 1)])
def test_forward_only_matches_dense_forward(pp: int, v: int) -> None:
    run_distributed(eval_case, 4, pp, v)
