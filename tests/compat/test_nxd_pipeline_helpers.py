"""NxD's layer-placement helpers (``pipeline.partition``): the cuts its examples pass to ``NxDPPModel``."""

from __future__ import annotations

import pytest

from meshpar.compat.nxd.pipeline.partition import create_partitions, stage_to_pipeline_parallel_rank

NAMES = [f"model.layers.{i}" for i in range(10)]


@pytest.mark.parametrize(
    ("stages", "cuts"),
    [
        (1, []),
        (2, ["model.layers.4"]),
        (3, ["model.layers.2", "model.layers.5"]),  # 3 + 3 + 4: the remainder on the last stages
        (4, ["model.layers.1", "model.layers.3", "model.layers.6"]),  # 2 + 2 + 3 + 3
        (10, NAMES[:-1]),
    ],
)
def test_create_partitions_gives_the_remainder_to_the_last_stages(stages: int, cuts: list[str]) -> None:
    assert create_partitions(stages, NAMES) == cuts


def test_create_partitions_refuses_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        create_partitions(4, NAMES[:3])


def test_virtual_stages_go_round_the_ranks() -> None:
    assert [stage_to_pipeline_parallel_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_too_few_layers_is_both_nxds_assertion_and_a_value_error() -> None:
    """NxD asserts (its tests expect ``AssertionError``); meshpar's callers catch ``ValueError``."""
    from torch import nn

    from meshpar.compat.nxd.pipeline.manual_pipe_stage import PipelineStageModule

    layers = [nn.Linear(2, 2) for _ in range(3)]
    for error in (AssertionError, ValueError):
        with pytest.raises(error, match="3 layers cannot fill 4 pipeline stages"):
            create_partitions(4, NAMES[:3])
        with pytest.raises(error, match="3 layers cannot fill 4 pipeline stages"):
            PipelineStageModule._partition_evenly(layers, 4)


def test_weight_sharing_stages_by_nxds_keyword() -> None:
    from torch import nn

    from meshpar.compat.nxd.pipeline.manual_pipe_stage import PipelineStageModule

    layers = [nn.Linear(2, 2) for _ in range(4)]
    PipelineStageModule.mark_weight_sharing([(layers[0], "weight"), (layers[3], "weight")], "tied")
    mapping = {layer: stage for stage, layer in enumerate(layers)}
    gather = PipelineStageModule._gather_pp_stage_idxs_for_weight_sharing
    assert gather(stage_idx_mapping=mapping, current_stage_idx=3) == {"tied": [[0, 3], [layers[3], "weight"]]}
    assert gather(mapping, current_stage_idx=1) == {}


def test_output_loss_value_spec_picks_the_loss_from_each_output_kind() -> None:
    """``True``: the output is the loss; a tuple spec picks by position (an HF ModelOutput by its fields' order, not
    by iterating its keys); a dict spec or a key by name; a spec that picks none or two is refused."""
    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from meshpar.compat.nxd.pipeline.model import _pick_loss

    loss, logits = torch.tensor(2.5), torch.ones(2, 3)
    assert _pick_loss(loss, True) is loss
    assert _pick_loss((loss, logits), (True, False)) is loss
    assert _pick_loss((logits, loss), (False, True)) is loss
    hf = CausalLMOutputWithPast(loss=loss, logits=logits)
    assert _pick_loss(hf, (True, False)) is loss
    assert _pick_loss(hf, {"loss": True, "logits": False}) is loss
    assert _pick_loss(hf, "loss") is loss
    with pytest.raises(ValueError, match="exactly one"):
        _pick_loss((loss, logits), (True, True))
