"""pad_model keeps outputs exact and makes tp divide the heads; automatic and user plans."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

import meshpar
from meshpar.hf import plan_for
from meshpar.tensor_parallel import ColumnParallel, RowParallel
from meshpar.testing import run_distributed, setup_parallel
from tests.hf._configs import batch, build


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_padding_heads_keeps_outputs(family: str) -> None:
    dense = build(family, heads=6, kv_heads=6)
    padded = meshpar.pad_model(copy.deepcopy(dense), tp_degree=4, n_heads=6)
    data = batch(family)
    torch.testing.assert_close(padded(**data).logits, dense(**data).logits, atol=1e-6, rtol=1e-6)


def padded_tp_case(family: str) -> None:
    setup_parallel(tp=4)
    dense = build(family, heads=6)
    padded = meshpar.pad_model(copy.deepcopy(dense), tp_degree=4, n_heads=6)
    model = meshpar.parallelize(padded, {"tensor_parallel_size": 4})
    data = batch(family)
    torch.testing.assert_close(model(**data).loss, dense(**data).loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_six_heads_at_tp4_after_padding_match_dense(family: str) -> None:
    run_distributed(padded_tp_case, 4, family)


def test_pad_model_rejects_gqa_and_unknown_models() -> None:
    with pytest.raises(NotImplementedError, match="grouped-query"):
        meshpar.pad_model(build("llama", heads=4, kv_heads=2), tp_degree=3, n_heads=4)
    with pytest.raises(ValueError, match="found nothing to pad"):
        meshpar.pad_model(nn.Sequential(nn.Linear(4, 4)), tp_degree=4, n_heads=6)


class ToyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.o_proj = nn.Linear(16, 16)


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = ToyAttention()
        self.mlp = nn.ModuleDict({"up_proj": nn.Linear(16, 32), "down_proj": nn.Linear(32, 16)})


def test_no_plan_is_guessed_from_module_names() -> None:
    """Names that look like attention and MLP projections are not a plan: a model with neither a transformers plan
    nor a meshpar table is refused at tp > 1, naming the way out, and needs no plan at tp=1."""
    with pytest.raises(ValueError, match="neither a tensor-parallel plan in the installed transformers nor a meshpar"):
        plan_for(ToyModel(), 2)
    assert plan_for(ToyModel(), 1).styles == {}
    user = plan_for(ToyModel(), 2, plan={"mlp.up_proj": "colwise", "mlp.down_proj": RowParallel()})
    assert {name: type(style).__name__ for name, style in user.styles.items()} == {
        "mlp.up_proj": "ColumnParallel",
        "mlp.down_proj": "RowParallel",
    }
    with pytest.raises(ValueError, match=r"plan entries \['attn.mystery'\] match no module"):
        plan_for(ToyModel(), 2, plan={"attn.mystery": "colwise"})
    with pytest.raises(ValueError, match="'packed_rowwise'"):
        plan_for(ToyModel(), 2, plan={"mlp.down_proj": "packed_rowwise"})
    packed = plan_for(ToyModel(), 2, plan={"mlp.up_proj": "packed_colwise"}).styles["mlp.up_proj"]
    assert type(packed).__name__ == "PackedColumnParallel" and packed.parts == 2  # transformers' [gate | up]


def user_plan_case() -> bool:
    setup_parallel(tp=2)
    dense = build("llama")
    plan = {"model.layers.*.mlp.gate_proj": ColumnParallel(), "model.layers.*.mlp.up_proj": ColumnParallel(),
            "model.layers.*.mlp.down_proj": RowParallel()}  # fmt: skip
    model = meshpar.parallelize(copy.deepcopy(dense), {"tensor_parallel_size": 2}, plan=plan)
    data = batch("llama")
    torch.testing.assert_close(model(**data).loss, dense(**data).loss, atol=1e-5, rtol=1e-5)
    summary = model.plan_summary()
    return "mlp.down_proj: RowParallel" in summary and "self_attn" not in summary


def test_user_plan_shards_only_what_it_names() -> None:
    assert run_distributed(user_plan_case, 2) == [True, True]


class _TupleLayer(torch.nn.Module):
    def __init__(self, as_tuple: bool) -> None:
        super().__init__()
        self.linear, self.as_tuple = torch.nn.Linear(4, 4), as_tuple

    def forward(self, x: torch.Tensor) -> object:
        return (self.linear(x),) if self.as_tuple else self.linear(x)


class _Rotary(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.cos(), x.sin()


class _Holder(torch.nn.Module):
    """A base model whose norm is registered before its layers (run after them) and with a per-layer list of
    rotary tables (returning tuples) next to its layer list."""

    def __init__(self, as_tuple: bool) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=8)
        self.embed = torch.nn.Embedding(8, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.rotary = torch.nn.ModuleList([_Rotary(), _Rotary()])
        self.layers = torch.nn.ModuleList([_TupleLayer(as_tuple), _TupleLayer(as_tuple)])

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        x = self.embed(input_ids)
        for rotary, layer in zip(self.rotary, self.layers, strict=True):
            cos, _ = rotary(x)
            out = layer(x + cos)
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)


@pytest.mark.parametrize("as_tuple", [False, True])
def test_run_order_reads_call_order_and_what_the_layers_return(as_tuple: bool) -> None:
    """Stand-ins for other stages' layers return what the layers return (GPT-J's blocks: tuples); per-layer rotary
    tables returning tuples say nothing about the layers (GraniteMoE-SWA)."""
    from meshpar.hf.stages import _layer_calls, _run_order

    model = _Holder(as_tuple)
    assert list(dict.fromkeys(_run_order(model, model))) == ["embed", "rotary", "layers", "norm"]
    assert _layer_calls(model, "layers").returns == (1 if as_tuple else 0)


class _HandedLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, hidden: torch.Tensor, per_layer: torch.Tensor, stack: torch.Tensor, mask: torch.Tensor):
        return self.linear(hidden + per_layer + stack.sum(-2)) * mask.unsqueeze(-1)


class _Handing(torch.nn.Module):
    """Layers handed, besides the hidden states, a per-layer input computed before the layers (as Gemma's), a
    stack of earlier hidden states the loop extends between layers (as Inkling2's) and a mask without grads."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=8)
        self.embed = torch.nn.Embedding(8, 4)
        self.per_layer = torch.nn.Linear(4, 12)
        self.layers = torch.nn.ModuleList(_HandedLayer() for _ in range(3))

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        hidden = self.embed(input_ids)
        per_layer = self.per_layer(hidden).unflatten(-1, (3, 4))
        stack, mask = hidden.unsqueeze(-2), torch.ones(input_ids.shape)
        for i, layer in enumerate(self.layers):
            out = layer(hidden, per_layer[..., i, :], stack=stack, mask=mask)
            stack = torch.cat([stack, hidden.unsqueeze(-2)], -2)
            hidden = out
        return hidden


def test_what_stages_carry_is_read_off_the_layer_calls() -> None:
    """The hidden states are loop state; a per-layer input computed before the layers is carried to its layer's
    stage from the first; the stack is loop state from the layer where it holds a layer's output on; the mask
    (no grads) every stage builds itself."""
    from meshpar.hf.stages import Carried, _layer_calls

    carried = _layer_calls(_Handing(), "layers").carried
    before_the_layers = (Carried(0, True), Carried(1, False), Carried("stack", False))
    assert carried == (
        before_the_layers,
        before_the_layers,
        (Carried(0, True), Carried(1, False), Carried("stack", True)),
    )


def plan_round_trip_case(family: str) -> dict:
    """The plan meshpar applies, printed, passed back unchanged and edited: the unchanged one runs exactly as the
    automatic one (same loss and grads), the edited one leaves the modules it no longer names unsharded."""
    import dataclasses
    import logging

    from meshpar._compat import DTensor

    setup_parallel(tp=2)
    config = {"tensor_parallel_size": 2}
    torch.manual_seed(0)
    dense = build(family)
    plan = plan_for(copy.deepcopy(dense), config)
    text = str(plan)
    data = batch(family)

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("meshpar.hf.parallelize")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        automatic = meshpar.parallelize(copy.deepcopy(dense), config)
        passed_back = meshpar.parallelize(copy.deepcopy(dense), config, plan=plan)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    losses = [model.train_step(**data) for model in (automatic, passed_back)]
    grads = [
        {n: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for n, p in m.module.named_parameters()}
        for m in (automatic, passed_back)
    ]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)

    edited = dataclasses.replace(plan, styles={k: v for k, v in plan.styles.items() if "mlp" not in k})
    partial = meshpar.parallelize(copy.deepcopy(dense), config, plan=edited)
    kinds = {n: isinstance(p, DTensor) and p.to_local().shape != p.shape for n, p in partial.module.named_parameters()}
    return {
        "text": text,
        "logged": [m for m in logged if m == text],
        "losses": [float(loss) for loss in losses],
        "dense_loss": float(dense(**data).loss.detach()),
        "mlp_sharded": [n for n, sharded in kinds.items() if "mlp" in n and sharded],
        "attention_sharded": [n for n, sharded in kinds.items() if "attn" in n and sharded],
    }


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        (
            "llama",
            ["model.layers.*.self_attn.q_proj: ColumnParallel(", "lm_head: ColumnParallel(", "layers: model.layers"],
        ),
        # GPT-2: its fused attention's split_size is divided after sharding, its head tied to the embedding
        ("gpt2", ["transformer.h.*.attn.c_attn: ", "fix-ups after sharding:", "tied (one parameter, saved once):"]),
    ],
)
def test_the_printed_plan_is_the_one_that_runs_and_round_trips(family: str, expected: list[str]) -> None:
    result = run_distributed(plan_round_trip_case, 2, family)[0]
    text = result["text"]
    for line in expected:
        assert line in text, text
    assert result["logged"] == [text] * 2  # parallelize logs the plan it applies, automatic or passed back
    automatic, passed_back = result["losses"]
    assert automatic == passed_back and abs(automatic - result["dense_loss"]) < 1e-5
    assert result["mlp_sharded"] == [] and result["attention_sharded"], result
