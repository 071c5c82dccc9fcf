"""The apex.transformer README's pipeline sketch, ported literally (imports changed), against one dense process.

The sample's pieces: a model with ``pre_process`` / ``post_process`` and ``set_input_tensor`` whose forward asks
``parallel_state.is_pipeline_first_stage()``, ``model_provider_func``, ``loss_func`` returning
``(loss, {"nice_loss": average_losses_across_data_parallel_group([loss])})``, ``forward_step_func(batch, model)``,
``get_forward_backward_func(vpp, pp)``, ``initialize_model_parallel(tp, pp, vpp)``, ``build_model(...)``, and
``forward_backward_func(forward_step_func, batch, model, forward_only=False, tensor_shape=...)`` then
``optimizer.step()``.
"""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshpar.compat.apex import parallel_state
from meshpar.compat.apex.pipeline_parallel import build_model, get_forward_backward_func
from meshpar.compat.apex.pipeline_parallel.utils import (
    average_losses_across_data_parallel_group,
    get_num_microbatches,
    setup_microbatch_calculator,
)
from meshpar.compat.apex.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from meshpar.testing import run_distributed
from tests.seeds._dense import assert_params_match, copy_dense_into

V, H, LAYERS, SEQ, MBS = 32, 16, 4, 6, 2


class DenseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.fc1 = nn.ModuleList(nn.Linear(H, 4 * H) for _ in range(LAYERS))
        self.fc2 = nn.ModuleList(nn.Linear(4 * H, H) for _ in range(LAYERS))
        self.head = nn.Linear(H, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for fc1, fc2 in zip(self.fc1, self.fc2, strict=True):
            h = h + fc2(F.gelu(fc1(h)))
        return self.head(h)


class Model(nn.Module):
    """The README's model: this (virtual) stage's layers; embedding with pre_process, head with post_process."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()
        pre_process = kwargs.pop("pre_process")
        post_process = kwargs.pop("post_process")
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
        stage = (parallel_state.get_virtual_pipeline_model_parallel_rank() or 0) * pp
        stage += parallel_state.get_pipeline_model_parallel_rank()
        per_stage = LAYERS // (pp * vpp)
        self.offset = stage * per_stage
        self.embed = nn.Embedding(V, H) if pre_process else None
        self.fc1 = nn.ModuleList(ColumnParallelLinear(H, 4 * H, gather_output=False) for _ in range(per_stage))
        self.fc2 = nn.ModuleList(RowParallelLinear(4 * H, H, input_is_parallel=True) for _ in range(per_stage))
        self.head = nn.Linear(H, V) if post_process else None
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        if parallel_state.is_pipeline_first_stage():  # noqa: SIM108 - the README sample, literally
            input = self.embed(x)
        else:
            input = self.input_tensor
        for fc1, fc2 in zip(self.fc1, self.fc2, strict=True):  # apex's layers return (output, bias)
            hidden, _ = fc1(input)
            out, _ = fc2(F.gelu(hidden))
            input = input + out
        return self.head(input) if self.head is not None else input

    def dense_name(self, name: str) -> str:
        kind, index, rest = name.split(".", 2) if name.startswith("fc") else (name, None, None)
        return f"{kind}.{int(index) + self.offset}.{rest}" if index is not None else name


def model_provider_func(*args, **kwargs):
    return Model(*args, **kwargs)


def loss_func(label, pred):
    loss = F.cross_entropy(pred.reshape(-1, V), label.reshape(-1))
    averaged_loss = average_losses_across_data_parallel_group([loss])
    return loss, {"nice_loss": averaged_loss}


def forward_step_func(batch, model):
    input, label = batch  # the sample's process_batch
    out = model(input)
    return out, partial(loss_func, label)


class Scaler:
    """What the schedule needs of a grad scaler (torch.amp.GradScaler on CUDA): ``scale``."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.factor


def readme_case(tp: int, pp: int, vpp: int | None, m: int, scaled: bool) -> None:
    parallel_state.initialize_model_parallel(tp, pp, vpp)
    dp = parallel_state.get_data_parallel_world_size()
    setup_microbatch_calculator(0, None, MBS * m * dp, MBS, dp)
    forward_backward_func = get_forward_backward_func(vpp, pp)
    dense = DenseModel()
    torch.manual_seed(1)
    tokens, labels = torch.randint(0, V, (MBS * m * dp, SEQ)), torch.randint(0, V, (MBS * m * dp, SEQ))
    mine = slice(
        parallel_state.get_data_parallel_rank() * MBS * m, (parallel_state.get_data_parallel_rank() + 1) * MBS * m
    )
    batch = [tokens[mine], labels[mine]]

    model = build_model(model_provider_func, True, vpp)
    chunks = [getattr(chunk, "module", chunk) for chunk in model]
    for chunk in chunks:
        copy_dense_into(chunk, dense.state_dict(), chunk.dense_name)
    params = [p for chunk in model for p in chunk.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = Scaler(1024.0) if scaled else None
    losses_reduced = forward_backward_func(
        forward_step_func, batch, model if vpp else model[0], forward_only=False, tensor_shape=(MBS, SEQ, H),
        grad_scaler=scaler,
    )  # fmt: skip
    if scaled:  # what GradScaler.step does first
        for p in params:
            p.grad /= scaler.factor
    optimizer.step()

    # dense: the same global batch as get_num_microbatches() * dp microbatches, mean loss
    dense_losses = [F.cross_entropy(dense(t).reshape(-1, V), lab.reshape(-1)) for t, lab in
                    zip(tokens.split(MBS), labels.split(MBS), strict=True)]  # fmt: skip
    torch.stack(dense_losses).mean().backward()
    torch.optim.SGD(dense.parameters(), lr=0.1).step()
    for chunk in chunks:
        assert_params_match(chunk, dense.state_dict(), chunk.dense_name)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        assert len(losses_reduced) == get_num_microbatches() == m
        per_replica = torch.stack(dense_losses).view(dp, m)
        for k, reduced in enumerate(losses_reduced):
            torch.testing.assert_close(reduced["nice_loss"], per_replica[:, k].mean().view(1), atol=1e-5, rtol=1e-5)
    else:
        assert losses_reduced == []


@pytest.mark.parametrize(
    ("tp", "pp", "vpp", "m", "scaled"),
    [
        (2, 2, None, 2, False),  # tp2 x pp2
        (1, 2, None, 3, True),  # pp2 x dp2, grad scaler
        (2, 1, None, 2, True),  # tp2 x dp2 (no pipelining)
        (1, 2, 2, 4, False),  # interleaved, dp2
        (1, 4, None, 4, False),
    ],
)
def test_readme_sketch_matches_dense(tp: int, pp: int, vpp: int | None, m: int, scaled: bool) -> None:
    run_distributed(readme_case, 4, tp, pp, vpp, m, scaled)


def wrong_shape_case(tensor_shape: tuple[int, ...]) -> None:
    parallel_state.initialize_model_parallel(1, 2)
    setup_microbatch_calculator(0, None, MBS * 2, MBS, 1)
    model = build_model(model_provider_func, False, None)
    batch = [torch.zeros(MBS * 2, SEQ, dtype=torch.long)] * 2
    get_forward_backward_func(None, 2)(forward_step_func, batch, model[0], forward_only=True, tensor_shape=tensor_shape)


# apex's [seq, batch, hidden] for this batch-first model (the same element count, another layout), too small, too big
@pytest.mark.slow  # each case aborts the job: the pool is rebuilt
@pytest.mark.parametrize("tensor_shape", [(SEQ, MBS, H), (MBS, SEQ - 1, H), (MBS, SEQ + 2, H)])
def test_a_wrong_tensor_shape_is_refused_on_every_rank(tensor_shape: tuple[int, int, int]) -> None:
    """The receiving stage refuses; the sending stage stops at once with the same message (meshpar.failure)."""
    with pytest.raises(AssertionError) as caught:
        run_distributed(wrong_shape_case, 2, tensor_shape)
    ranks = str(caught.value).split("\nrank ")[1:]
    assert len(ranks) == 2 and "no answer" not in str(caught.value), caught.value
    wanted = re.escape(f"tensor_shape={list(tensor_shape)}")
    for text in ranks:
        assert re.search(r"received an activation of shape \[2, 6, 16\].*" + wanted, text), text
    assert "PeerFailedError" in ranks[0] and "PipelineShapeError" in ranks[1]


def autocast_case(dtype: torch.dtype | None, disable_autocast: bool) -> list[tuple[bool, str]]:
    """apex's contract: with ``dtype`` half or bfloat16 the forward step and loss run under autocast, unless
    ``disable_autocast`` (then the model itself is in ``dtype``, as with apex's O2-style training: ``dtype`` is also
    what the stages send); records, per forward step, whether autocast was on and the stage output's dtype."""
    parallel_state.initialize_model_parallel(1, 2)
    setup_microbatch_calculator(0, None, MBS * 2, MBS, 1)
    model = build_model(model_provider_func, False, None)
    if disable_autocast:
        model[0].to(dtype)
    seen = []

    def recording_step(batch, model):
        out, loss = forward_step_func(batch, model)
        seen.append((torch.is_autocast_enabled("cpu"), str(out.dtype)))
        return out, loss

    batch = [torch.zeros(MBS * 2, SEQ, dtype=torch.long)] * 2
    get_forward_backward_func(None, 2)(
        recording_step, batch, model[0], forward_only=False, tensor_shape=(MBS, SEQ, H), dtype=dtype,
        disable_autocast=disable_autocast,
    )  # fmt: skip
    return seen


@pytest.mark.parametrize(
    "dtype, disable_autocast, on, out",
    [
        (torch.bfloat16, False, True, None),  # fp32 residual adds promote the bfloat16 matmul outputs
        (torch.bfloat16, True, False, "torch.bfloat16"),  # a bfloat16 model, no autocast
        (None, False, False, "torch.float32"),
    ],
)
def test_dtype_and_disable_autocast_as_apex(
    dtype: torch.dtype | None, disable_autocast: bool, on: bool, out: str | None
) -> None:
    for seen in run_distributed(autocast_case, 2, dtype, disable_autocast):
        assert len(seen) == 2 and all(enabled == on for enabled, _ in seen), seen
        assert out is None or all(dtype_seen == out for _, dtype_seen in seen), seen
