"""split_model: FQNs kept, uneven and balanced splits, virtual chunks, meta-device materialisation, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshpar.pipeline import plan_stages, split_model
from meshpar.pipeline.split import build_stage, encoder_stage_count, plan_encoder_decoder_stages
from tests._models import Block, PipeGPT


def test_stage_state_dicts_are_slices_of_the_full_state_dict() -> None:
    torch.manual_seed(0)
    model = PipeGPT(layers=5)
    full = model.state_dict()
    seen: dict[str, torch.Tensor] = {}
    for rank in range(2):
        stages, plan = split_model(model, rank, 2, transformer_layer_cls=Block)
        for _, stage in stages:
            for name, tensor in stage.state_dict().items():
                assert torch.equal(tensor, full[name]), name
                seen[name] = tensor
    assert set(seen) == set(full)
    assert [len(layers) for layers in plan.stage_layers] == [3, 2]
    assert "layers.4.qkv.weight" in dict(
        split_model(model, 1, 2, transformer_layer_cls=Block)[0][0][1].named_parameters()
    )


def test_thirty_layers_on_four_stages_and_virtual_chunks() -> None:
    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(30))

    plan = plan_stages(Deep(), 4, transformer_layer_cls=nn.Linear)
    assert [len(s) for s in plan.stage_layers] == [8, 8, 7, 7]
    stages, plan = split_model(Deep(), 1, 4, transformer_layer_cls=nn.Linear, virtual_pipeline_size=2)
    assert [index for index, _ in stages] == [1, 5]  # rank r owns chunks r, r + pp
    assert plan.num_stages == 8


def test_auto_partition_balances_parameters_with_embedding_and_head() -> None:
    model = PipeGPT(vocab=512, hidden=16, layers=8)  # big embedding (first) and head (last)
    balanced = plan_stages(model, 4, transformer_layer_cls=Block, auto_partition=True)
    even = plan_stages(model, 4, transformer_layer_cls=Block)
    sizes = [len(s) for s in balanced.stage_layers]
    assert sum(sizes) == 8 and sizes[0] < sizes[1] and sizes[-1] < sizes[1]
    assert [len(s) for s in even.stage_layers] == [2, 2, 2, 2]
    assert "stage 0" in balanced.describe() and "tok" in balanced.describe()


def test_explicit_cuts() -> None:
    plan = plan_stages(PipeGPT(layers=6), 3, pipeline_cuts=["layers.0", "layers.3"])
    assert plan.stage_layers == [["0"], ["1", "2", "3"], ["4", "5"]]


def test_modules_placed_against_their_registration_order() -> None:
    """A model may register a module on one side of its layers and run it on the other (OPT's final norm)."""
    plan = plan_stages(PipeGPT(layers=4), 2, transformer_layer_cls=Block)
    assert (plan.first_stage_modules, plan.last_stage_modules) == (["tok", "pos"], ["ln_f", "head"])
    plan = plan_stages(PipeGPT(layers=4), 2, transformer_layer_cls=Block, first_stage_modules=["ln_f"])
    assert (plan.first_stage_modules, plan.last_stage_modules) == (["tok", "pos", "ln_f"], ["head"])
    plan = plan_stages(PipeGPT(layers=4), 2, transformer_layer_cls=Block, last_stage_modules=["pos"])
    assert (plan.first_stage_modules, plan.last_stage_modules) == (["tok"], ["pos", "ln_f", "head"])
    stages, _ = split_model(PipeGPT(layers=4), 1, 2, transformer_layer_cls=Block, last_stage_modules=["pos"])
    assert stages[0][1].pos is not None and stages[0][1].tok is None
    with pytest.raises(ValueError, match=r"unknown: \['layers.0'\], on both stages: \['pos'\]"):
        plan_stages(
            PipeGPT(layers=4), 2, transformer_layer_cls=Block, first_stage_modules=["pos", "layers.0"],
            last_stage_modules=["pos"],
        )  # fmt: skip


def test_meta_model_materialises_only_the_local_stage() -> None:
    with torch.device("meta"):
        model = PipeGPT(vocab=64, hidden=16, layers=8)
    total = sum(p.numel() for p in model.parameters())
    stages, _ = split_model(model, 0, 4, transformer_layer_cls=Block, device="cpu")
    ((_, stage),) = stages
    params = list(stage.parameters())
    assert all(not p.is_meta for p in params)
    assert all(torch.isfinite(p).all() for p in params)
    assert sum(p.numel() for p in params) < total / 2
    assert stage.ln_f is None and stage.head is None and len(stage.layers) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pp": 8}, "5 layers cannot fill 8 pipeline stages"),
        ({"pp": 2, "pipeline_cuts": ["layers.9"]}, "pipeline_cuts name unknown layers"),
        ({"pp": 3, "pipeline_cuts": ["layers.1"]}, "1 pipeline_cuts make 2 stages, need 3"),
        ({"pp": 2, "pipeline_cuts": ["layers.4"]}, "leave a stage without layers"),
        ({"pp": 1, "virtual_pipeline_size": 2}, "needs pipeline parallelism \\(pp > 1\\)"),
        ({"pp": 2, "transformer_layer_cls": nn.GRU}, "no nn.ModuleList or nn.Sequential"),
    ],
)
def test_bad_splits_raise(kwargs: dict, message: str) -> None:
    pp = kwargs.pop("pp")
    kwargs.setdefault("transformer_layer_cls", None if "pipeline_cuts" in kwargs else Block)
    with pytest.raises(ValueError, match=message):
        split_model(PipeGPT(layers=5), 0, pp, **kwargs)


class _EncoderDecoder(nn.Module):
    def __init__(self, encoder: int, decoder: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList(nn.Linear(4, 4) for _ in range(encoder))})
        self.encoder["norm"] = nn.LayerNorm(4)
        self.decoder = nn.ModuleDict({"layers": nn.ModuleList(nn.Linear(4, 4) for _ in range(decoder))})
        self.head = nn.Linear(4, 8)


@pytest.mark.parametrize(
    ("encoder", "decoder", "stages", "split"),
    [(2, 2, 2, 1), (6, 6, 4, 2), (6, 2, 4, 3), (1, 5, 4, 1), (5, 1, 4, 3), (12, 12, 8, 4), (3, 3, 6, 3)],
)
def test_encoder_decoder_split_rank_follows_the_layers(encoder: int, decoder: int, stages: int, split: int) -> None:
    """apex's split rank: the encoder's share of the stages, at least one each side, every stage with layers."""
    assert encoder_stage_count(encoder, decoder, stages) == split
    model = _EncoderDecoder(encoder, decoder)
    plan = plan_encoder_decoder_stages(
        ("encoder.layers", [str(i) for i in range(encoder)]),
        ("decoder.layers", [str(i) for i in range(decoder)]),
        stages,
        first_stage_modules=["embed"],
        last_stage_modules=["head"],
        encoder_modules=["encoder.norm"],
    )
    owned = [[k for _, per in plan.owned_layers() for k in per[s]] for s in range(stages)]
    assert all(owned) and sum(map(len, owned)) == encoder + decoder
    assert all(not plan.stage_layers[s] for s in range(split, stages))  # no encoder layer after the split
    assert all(not plan.later_containers[0][1][s] for s in range(split))  # nor a decoder layer before the split
    assert plan.stage_modules == {"encoder.norm": split - 1}
    for stage in range(stages):
        built = dict(build_stage(model, plan, stage).named_parameters())
        assert ("encoder.norm.weight" in built) == (stage == split - 1), stage
        assert ("embed.weight" in built) == (stage == 0) and ("head.weight" in built) == (stage == stages - 1)
        keys = [f"encoder.layers.{k}.weight" for k in plan.stage_layers[stage]]
        keys += [f"decoder.layers.{k}.weight" for k in plan.later_containers[0][1][stage]]
        assert sorted(n for n in built if ".layers." in n and n.endswith("weight")) == sorted(keys)
    assert "encoder.norm" in plan.describe()


@pytest.mark.parametrize(
    ("encoder", "decoder", "stages", "message"),
    [(2, 2, 1, "needs at least 2 stages"), (1, 2, 4, "cannot fill 4 pipeline stages")],
)
def test_encoder_decoder_splits_that_cannot_be_made_raise(encoder: int, decoder: int, stages: int, message: str):
    with pytest.raises(ValueError, match=message):
        encoder_stage_count(encoder, decoder, stages)
