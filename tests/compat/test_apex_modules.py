"""apex's smaller modules through meshpar's view: the batch samplers, the functional softmax and rotary embedding,
the layer norms, the model-parallel grad scaler, apex's extra process groups and rank getters, the pipeline utils and
the schedules' keyword handling, each against a dense torch computation or apex's documented values."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshpar.compat.apex import _data, amp, functional, layers, parallel_state
from meshpar.compat.apex.enums import AttnMaskType, ModelType
from meshpar.compat.apex.pipeline_parallel import build_model, get_forward_backward_func, utils
from meshpar.compat.apex.pipeline_parallel.schedules import common
from meshpar.compat.apex.pipeline_parallel.schedules.fwd_bwd_pipelining_without_interleaving import (
    get_tensor_shapes,
)
from meshpar.testing import run_distributed


def test_pretraining_sampler_yields_local_minibatches_from_the_consumed_samples() -> None:
    sampler = _data.MegatronPretrainingSampler(10, 2, 3, 0, 1, drop_last=False)
    assert list(sampler) == [[2, 3, 4], [5, 6, 7], [8, 9]] and len(sampler) == 10
    assert list(_data.MegatronPretrainingSampler(10, 2, 3, 0, 1)) == [[2, 3, 4], [5, 6, 7]]
    with pytest.raises(RuntimeError, match="no samples left"):
        _data.MegatronPretrainingSampler(4, 4, 2, 0, 1)
    with pytest.raises(RuntimeError, match="data_parallel_rank"):
        _data.MegatronPretrainingSampler(8, 0, 2, 2, 2)


def test_random_sampler_splits_buckets_over_ranks_and_resumes() -> None:
    per_rank = [list(_data.MegatronPretrainingRandomSampler(16, 0, 2, rank, 2)) for rank in range(2)]
    seen = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert seen == list(range(16))  # every sample once per epoch, each rank its own bucket
    assert all(i < 8 for batch in per_rank[0] for i in batch) and all(i >= 8 for batch in per_rank[1] for i in batch)
    resumed = list(_data.MegatronPretrainingRandomSampler(16, 4, 2, 0, 2))
    assert resumed == per_rank[0][1:]  # 4 consumed samples = one local minibatch per rank
    with pytest.raises(ValueError, match="data_parallel_rank"):
        _data.MegatronPretrainingRandomSampler(16, 0, 2, 3, 2)


def _mask_func(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return scores.masked_fill(mask, -10000.0)


@pytest.mark.parametrize("mask_type", [AttnMaskType.padding, AttnMaskType.causal])
@pytest.mark.parametrize("fused", [True, False])
def test_fused_scale_mask_softmax_matches_the_torch_path(mask_type: AttnMaskType, fused: bool) -> None:
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1).expand(2, 1, 8, 8)
    mask = causal if mask_type == AttnMaskType.causal else torch.rand(2, 1, 8, 8) < 0.3
    module = functional.FusedScaleMaskSoftmax(False, True, mask_type, fused, _mask_func, True, 0.5)
    out = module(scores, mask)
    expected = torch.softmax(_mask_func(scores.float() * 0.5, mask), dim=-1).bfloat16()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=0)
    with pytest.raises(RuntimeError, match="fp32 when scaled"):
        functional.FusedScaleMaskSoftmax(False, True, mask_type, fused, _mask_func, False, 0.5)


def test_rotary_embedding_rotates_the_first_features_and_passes_the_rest() -> None:
    torch.manual_seed(0)
    t, freqs = torch.randn(5, 2, 3, 8), torch.randn(5, 1, 1, 4)
    out = functional.fused_apply_rotary_pos_emb(t, freqs)
    x1, x2 = t[..., :2], t[..., 2:4]
    cos, sin = freqs.cos(), freqs.sin()
    expected = torch.cat([x1 * cos[..., :2] - x2 * sin[..., :2], x2 * cos[..., 2:] + x1 * sin[..., 2:], t[..., 4:]], -1)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(functional.fused_apply_rotary_pos_emb_cached(t, cos, sin), expected)


def _turn(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Independent reference: pair feature i with i + width/2 and rotate each pair by its angle."""
    width = angles.shape[-1]
    a, b = x[..., : width // 2], x[..., width // 2 : width]
    cos, sin = angles[..., : width // 2].cos(), angles[..., : width // 2].sin()
    cos2, sin2 = angles[..., width // 2 :].cos(), angles[..., width // 2 :].sin()
    return torch.cat([a * cos - b * sin, b * cos2 + a * sin2, x[..., width:]], -1)


@pytest.mark.parametrize("transpose_output_memory", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_rotary_grads_and_output_layout(transpose_output_memory: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    t = torch.randn(6, 3, 2, 10, dtype=torch.float64).transpose(1, 2).contiguous().transpose(1, 2)  # strided
    freqs, weight = torch.randn(6, 1, 1, 6, dtype=torch.float64), torch.randn(6, 3, 2, 10, dtype=torch.float64)
    t.requires_grad_(True)
    expected = _turn(t, freqs)
    (grad,) = torch.autograd.grad((expected * weight).sum(), t)
    x = t.detach().to(dtype).requires_grad_(True)
    for out in (
        functional.fused_apply_rotary_pos_emb(x, freqs, transpose_output_memory),
        functional.fused_apply_rotary_pos_emb_cached(x, freqs.cos(), freqs.sin(), transpose_output_memory),
    ):
        assert out.transpose(0, 1).is_contiguous() is transpose_output_memory
        (got,) = torch.autograd.grad((out * weight.to(dtype)).sum(), x)
        tol = {"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(out.double(), expected.detach(), **tol)
        torch.testing.assert_close(got.double(), grad, **tol)
    torch.autograd.gradcheck(lambda v: functional.fused_apply_rotary_pos_emb(v, freqs), (t,))


def test_packed_rotary_restarts_positions_at_every_sequence() -> None:
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 3, 3, 7, 12], dtype=torch.int32)  # an empty sequence too
    t = torch.randn(12, 2, 8, dtype=torch.float64, requires_grad=True)
    freqs = torch.randn(6, 1, 1, 4, dtype=torch.float64)
    out = functional.fused_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs)
    for start, stop in [(0, 3), (3, 7), (7, 12)]:
        torch.testing.assert_close(out[start:stop], _turn(t[start:stop], freqs[: stop - start, 0]))
    torch.autograd.gradcheck(lambda v: functional.fused_apply_rotary_pos_emb_thd(v, cu_seqlens, freqs), (t,))
    with pytest.raises(ValueError, match="cu_seqlens must run from 0"):
        functional.fused_apply_rotary_pos_emb_thd(t, torch.tensor([0, 5, 11]), freqs)
    with pytest.raises(ValueError, match="sequence lengths"):
        functional.fused_apply_rotary_pos_emb_thd(t, torch.tensor([0, 12]), freqs)


def test_two_d_rotary_turns_rows_then_columns() -> None:
    torch.manual_seed(0)
    img_h, img_w, d = 2, 3, 8
    t = torch.randn(2, img_h * img_w, 2, d, dtype=torch.float64, requires_grad=True)
    rows, cols = torch.randn(1, img_h + 1, 1, d // 2, dtype=torch.float64), torch.randn(1, img_w, 1, d // 2).double()
    out = functional.fused_apply_rotary_pos_emb_2d(t, img_h, img_w, rows.cos(), rows.sin(), cols.cos(), cols.sin())
    for patch in range(img_h * img_w):
        r, c = divmod(patch, img_w)
        half = d // 2
        torch.testing.assert_close(out[:, patch, :, :half], _turn(t[:, patch, :, :half], rows[0, r, 0]))
        torch.testing.assert_close(out[:, patch, :, half:], _turn(t[:, patch, :, half:], cols[0, c, 0]))
    tables = (rows.cos(), rows.sin(), cols.cos(), cols.sin())
    torch.autograd.gradcheck(lambda v: functional.fused_apply_rotary_pos_emb_2d(v, img_h, img_w, *tables), (t,))
    with pytest.raises(ValueError, match="img_h \\* img_w"):
        functional.fused_apply_rotary_pos_emb_2d(t, 3, 3, *tables)


@pytest.mark.parametrize("cls", [layers.FusedLayerNorm, layers.MixedFusedLayerNorm])
def test_layer_norms_match_torch_and_carry_the_sequence_parallel_flag(cls: type) -> None:
    torch.manual_seed(0)
    norm = cls(16, eps=1e-6, sequence_parallel_enabled=True)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(4, 3, 16, requires_grad=True)
    out = norm(x)
    out.sum().backward()
    ref = nn.LayerNorm(16, eps=1e-6)
    ref.load_state_dict(norm.state_dict())
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).sum().backward()
    torch.testing.assert_close(out, ref(x_ref), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(norm.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-4)
    assert norm.weight.sequence_parallel_enabled and norm.bias.sequence_parallel_enabled
    if cls is layers.MixedFusedLayerNorm:
        assert norm(x.detach().bfloat16()).dtype == torch.bfloat16


def state_case() -> dict:
    parallel_state.initialize_model_parallel(2, 2)  # world 4: tp2 x pp2
    result = {
        "model": torch.distributed.get_process_group_ranks(parallel_state.get_model_parallel_group()),
        "embedding": parallel_state.is_rank_in_embedding_group(),
        "position": parallel_state.is_rank_in_position_embedding_group(),
        "first_last": (
            parallel_state.get_pipeline_model_parallel_first_rank(),
            parallel_state.get_pipeline_model_parallel_last_rank(),
            parallel_state.get_pipeline_model_parallel_next_rank(),
            parallel_state.get_pipeline_model_parallel_prev_rank(),
        ),
        "info": parallel_state.get_rank_info(),
        "dp_src": parallel_state.get_data_parallel_src_rank(),
        "uninitialised": parallel_state.is_unitialized(),
    }
    value = torch.tensor([float(torch.distributed.get_rank())])
    torch.distributed.all_reduce(value, group=parallel_state.get_embedding_group())
    result["embedding_sum"] = value.item()
    parallel_state.destroy_model_parallel()
    result["after"] = parallel_state.is_unitialized()
    return result


def test_apexs_groups_and_rank_getters() -> None:
    results = run_distributed(state_case, 4)
    for rank, r in enumerate(results):
        assert r["model"] == [0, 1, 2, 3]  # one replica: tp x pp is the whole world
        assert r["embedding"] and r["position"] == (rank < 2)  # pp=2: both stages hold an embedding copy
        pp_ranks = [rank % 2, rank % 2 + 2]
        assert r["first_last"] == (pp_ranks[0], pp_ranks[1], pp_ranks[1 - rank // 2], pp_ranks[1 - rank // 2])
        assert r["info"] == (rank % 2, rank // 2, None, 0) and r["dp_src"] == rank
        assert r["embedding_sum"] == sum(pp_ranks) and not r["uninitialised"] and r["after"]


def scaler_case() -> list:
    parallel_state.initialize_model_parallel(2, 1)
    rank = parallel_state.get_tensor_model_parallel_rank()
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler = amp.GradScaler(init_scale=4.0)
    stepped = []
    for poison in (False, True):
        optimizer.zero_grad()
        loss = (weight * (float("inf") if poison and rank == 1 else 1.0)).sum()
        scaler.scale(loss).backward()
        before = weight.detach().clone()
        scaler.step(optimizer)
        scaler.update()
        stepped.append(not torch.equal(before, weight.detach()))
    parallel_state.destroy_model_parallel()
    return [stepped, scaler.get_scale()]


def test_an_inf_on_one_tensor_parallel_rank_skips_the_step_on_every_rank() -> None:
    assert run_distributed(scaler_case, 2) == [[[True, False], 2.0]] * 2


def test_ltor_masks_reset_positions_and_attention_at_document_ends() -> None:
    data = torch.tensor([[5, 0, 6, 7, 0, 8]])  # eod = 0
    mask, loss_mask, positions = utils.get_ltor_masks_and_position_ids(data, 0, True, True, True)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0]]
    assert loss_mask.tolist() == [[1, 0, 1, 1, 0, 1]]
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    assert mask[0, 0, 2, 1] and not mask[0, 0, 3, 2] and mask[0, 0, 1, 2]  # new document; same; future


def test_weight_decay_groups_exclude_biases_and_norms() -> None:
    model = nn.Sequential(nn.Linear(4, 4), layers.FusedLayerNorm(4), nn.Linear(4, 2, bias=False))
    decay, no_decay = common._get_params_for_weight_decay_optimization(model)
    assert [p.shape for p in decay["params"]] == [(4, 4), (2, 4)]
    assert [p.shape for p in no_decay["params"]] == [(4,), (4,), (4,)] and no_decay["weight_decay"] == 0.0


def schedule_case() -> list:
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model = build_model(lambda pre_process, post_process: nn.Linear(3, 1), wrap_with_ddp=True)
    assert len(model) == 1 and isinstance(model[0].module, nn.Linear)  # wrapped even at dp=1, as apex does
    batch = [torch.randn(4, 3), torch.randn(4, 1)]

    def step(microbatch, chunk):
        x, y = microbatch
        return chunk(x), lambda out: F.mse_loss(out, y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = get_forward_backward_func(None, 1)(
            step, batch, model[0], forward_only=False, num_microbatches=2, async_comm=True,
            decoder_sequence_length=7, custom_grad_sync_func=None, not_an_apex_keyword=1,
        )  # fmt: skip
    named = [str(w.message) for w in caught if "ignores" in str(w.message)]
    shapes = get_tensor_shapes(0, ModelType.encoder_or_decoder, tensor_shape=(8, 2, 4))
    parallel_state.destroy_model_parallel()
    return [len(losses), named, shapes]


def test_schedules_warn_once_naming_keywords_they_ignore() -> None:
    (result,) = run_distributed(schedule_case, 1)
    count, named, shapes = result
    assert count == 2 and len(named) == 1
    assert "custom_grad_sync_func" in named[0] and "not_an_apex_keyword" in named[0], named
    assert "async_comm" not in named[0] and "decoder_sequence_length" not in named[0]
    assert shapes == [(8, 2, 4)]


def test_timers_exist_once_set_as_in_apex(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(AssertionError, match="timers is not initialized"):
        utils.get_timers()
    utils._set_timers()
    try:
        timers = utils.get_timers()
        timers("step").start()
        with pytest.raises(RuntimeError, match="already running"):
            timers("step").start()
        timers("step").stop()
        assert timers("step").elapsed(reset=False) >= 0.0
        timers.log(["step"])
        assert "time (ms) | step:" in capsys.readouterr().out
        assert timers("step").elapsed() == 0.0  # log reset it
        with pytest.raises(AssertionError, match="already initialized"):
            utils._set_timers()
    finally:
        utils._timers = None
