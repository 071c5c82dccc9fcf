"""apex's ``parallel_state.initialize_model_parallel`` as apex spells it (trailing-underscore keywords, sizes clamped
to the world, backend keywords) and its encoder-decoder split rank, at world 4."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist

from meshpar.compat.apex import parallel_state
from meshpar.testing import run_distributed


def keywords_case() -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size_=2,
            pipeline_model_parallel_size_=2,
            pipeline_model_parallel_split_rank_=1,
            default_backend="nccl",
        )
    result = {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "split": parallel_state.get_pipeline_model_parallel_split_rank(),
        "before": parallel_state.is_pipeline_stage_before_split(),
        "after": parallel_state.is_pipeline_stage_after_split(),
        "at": parallel_state.is_pipeline_stage_at_split(),
        "encoder_group": parallel_state.is_rank_in_encoder_relative_position_embedding_group(),
        "decoder_group": parallel_state.is_rank_in_decoder_relative_position_embedding_group(),
        "warned": [str(w.message) for w in caught if "default_backend='nccl'" in str(w.message)],
    }
    parallel_state.destroy_model_parallel()
    result["split_after_destroy"] = parallel_state.get_pipeline_model_parallel_split_rank()
    return result


def test_apex_keywords_and_the_split_rank() -> None:
    results = run_distributed(keywords_case, 4)
    for rank, result in enumerate(results):
        pp_rank = rank // 2  # tp fastest, then pp
        assert (result["tp"], result["pp"], result["dp"], result["split"]) == (2, 2, 1, 1), result
        assert result["before"] == (pp_rank == 0) and result["after"] == (pp_rank == 1), result
        assert result["at"] == (pp_rank == 0), result
        assert result["encoder_group"] == (pp_rank == 0) and result["decoder_group"] == (pp_rank == 1), result
        assert len(result["warned"]) == 1 and "gloo" in result["warned"][0], result  # gloo's default group
        assert result["split_after_destroy"] is None


def clamped_case() -> tuple[int, int, int, bool, bool]:
    parallel_state.initialize_model_parallel(8, 1)  # tp clamped to the world size, as apex does
    sizes = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(),
        # without a split rank every stage runs "before" and "after" it (a one-stack model)
        parallel_state.is_pipeline_stage_before_split(),
        parallel_state.is_pipeline_stage_after_split(),
    )
    parallel_state.destroy_model_parallel()
    return sizes


def test_sizes_larger_than_the_world_are_clamped() -> None:
    assert run_distributed(clamped_case, 2) == [(2, 1, 1, True, True)] * 2


def bad_split_case() -> str:
    try:
        parallel_state.initialize_model_parallel(1, 2, pipeline_model_parallel_split_rank_=2)
    except ValueError as error:
        return str(error)
    return f"accepted on rank {dist.get_rank()}"


def test_a_split_rank_outside_the_pipeline_is_refused() -> None:
    for message in run_distributed(bad_split_case, 2):
        assert "must be a pipeline rank (0 .. 1)" in message, message


def decoder_only_case() -> list:
    """apex's decoder-only form: split rank 0 (every stage after the split) at pp=2, then at pp=1; the relative
    position groups are the ones built at initialisation (setting another split rank later moves no group)."""
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(1, 2, pipeline_model_parallel_split_rank_=0)
    at_pp2 = (
        parallel_state.is_pipeline_stage_before_split(),
        parallel_state.is_pipeline_stage_after_split(),
        parallel_state.is_rank_in_encoder_relative_position_embedding_group(),
        parallel_state.is_rank_in_decoder_relative_position_embedding_group(),
    )
    parallel_state.set_pipeline_model_parallel_split_rank(77)
    moved = parallel_state.is_rank_in_decoder_relative_position_embedding_group()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(2, 1, pipeline_model_parallel_split_rank_=0)
    at_pp1 = parallel_state.is_rank_in_encoder_relative_position_embedding_group()
    parallel_state.destroy_model_parallel()
    return [rank, at_pp2, moved, at_pp1]


def test_split_rank_zero_is_a_decoder_only_model() -> None:
    for rank, at_pp2, moved, at_pp1 in run_distributed(decoder_only_case, 2):
        assert at_pp2 == (False, True, False, True), (rank, at_pp2)
        assert moved and at_pp1


@pytest.mark.parametrize("backend", ["mpi", "nccl2"])
def test_an_unknown_backend_is_refused(backend: str) -> None:
    with pytest.raises(ValueError, match="apex takes None, 'nccl' or 'ucc'"):
        parallel_state.initialize_model_parallel(1, 1, default_backend=backend)


def calculator_survives_case() -> list[int]:
    """apex's tests set the microbatch calculator once, then initialise and destroy the parallel state per layout:
    destroying the groups keeps the calculator."""
    from meshpar.compat.apex.pipeline_parallel import utils

    utils.setup_microbatch_calculator(0, None, 16, 2, 2)
    counts = []
    for tp in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size_=tp)
        counts.append(utils.get_num_microbatches())
        parallel_state.destroy_model_parallel()
    return counts


def test_the_microbatch_calculator_outlives_destroy_model_parallel() -> None:
    assert run_distributed(calculator_survives_case, 2) == [[4, 4], [4, 4]]


def overrides_case() -> dict:
    """apex's rank / size setters change what the getters and stage predicates report, nothing else; destroying the
    parallel state forgets them."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size_=2, pipeline_model_parallel_size_=2)
    actual = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    parallel_state.set_tensor_model_parallel_world_size(8)
    parallel_state.set_tensor_model_parallel_rank(5)
    parallel_state.set_pipeline_model_parallel_world_size(3)
    parallel_state.set_pipeline_model_parallel_rank(2)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(4)
    reported = {
        "tp": (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()),
        "pp": (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_rank(),
        ),
        "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        "last": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        "first": parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        "group_size": dist.get_world_size(parallel_state.get_tensor_model_parallel_group()),
    }
    parallel_state.set_pipeline_model_parallel_rank(None)
    reported["pp_rank_back"] = parallel_state.get_pipeline_model_parallel_rank() == actual[1]
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size_=2, pipeline_model_parallel_size_=2)
    reported["after_destroy"] = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank() == actual[0],
        parallel_state.get_virtual_pipeline_model_parallel_world_size(),
    )
    parallel_state.destroy_model_parallel()
    return reported


def test_rank_and_size_overrides_change_what_the_getters_report() -> None:
    for result in run_distributed(overrides_case, 4):
        assert result["tp"] == (8, 5) and result["pp"] == (3, 2) and result["vpp"] == 4, result
        assert result["last"] and not result["first"], result
        assert result["group_size"] == 2 and result["pp_rank_back"], result  # the groups are the mesh's
        assert result["after_destroy"] == (2, True, None), result
