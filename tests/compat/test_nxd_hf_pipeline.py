"""NxD's pipeline of a HuggingFace model, as NxD documents it (``NxDPPModel(hf_model, transformer_layer_cls=...,
tracer_cls="hf", output_loss_value_spec=...)``, the loss computed by the model from the labels): cut by the model's
structure (each stage runs the model's own forward), against the same HF model trained in one process. GPT-2 (its
embedding tied to the LM head across stages) and Llama, at pp2 x dp2, pp4 and pp2 x vpp2, built at once from
``input_names``, at the first step over that step's inputs, and by hand (``trace`` / ``cut_pipeline_stage`` /
``partition``): the loss of every step (padded rows, labels masked where padded), ``run_eval``'s loss and every
parameter after SGD steps. Then the refusals: an input the model does not take, a step without ``input_ids``, an
encoder-decoder, a ``leaf_module_cls`` name no module has, a cut that is not a layer."""

from __future__ import annotations

import copy

import pytest
import torch

from meshpar.testing import run_distributed
from tests.hf._configs import build

LAYERS, SEQ = 4, 7
SPECS = {"dict": {"loss": True, "logits": False}, "tuple": (True, False)}


def _layer_class(model: torch.nn.Module) -> type:
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return type(layers[0])


def _batch(step: int, rows: int, vocab: int) -> dict[str, torch.Tensor]:
    """Token ids, an attention mask that pads every third row on the left, and the ids as labels (-100 where
    padded)."""
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (rows, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[::3, :2] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _dense_loss(dense: torch.nn.Module, batch: dict[str, torch.Tensor], microbatches: int) -> torch.Tensor:
    """The dense model's loss as the pipeline takes it: the mean of its microbatches' losses."""
    pieces = zip(*(value.chunk(microbatches) for value in batch.values()), strict=True)
    return torch.stack([dense(**dict(zip(batch, piece, strict=True))).loss for piece in pieces]).mean()


def _built(model: torch.nn.Module, pp: int, virtual: int, how: str, spec: str) -> torch.nn.Module:
    from meshpar.compat.nxd.pipeline import NxDPPModel

    names = ["input_ids", "attention_mask", "labels"]
    common = {
        "transformer_layer_cls": _layer_class(model), "num_microbatches": 2 * pp, "virtual_pipeline_size": virtual,
        "output_loss_value_spec": SPECS[spec], "broadcast_and_average_loss": True, "tracer_cls": "hf",
    }  # fmt: skip
    if how == "names":
        return NxDPPModel(model, input_names=names, **common)
    if how == "deferred":  # no tracer_cls either: an HF model's default, as in NxD
        common.pop("tracer_cls")
        return NxDPPModel(model, **common)
    pipeline = NxDPPModel(model, **common)
    pipeline.trace(input_names=names, leaf_modules=[_layer_class(model).__name__])
    layers = [n for n, m in model.named_modules() if isinstance(m, _layer_class(model))]
    per_stage = len(layers) // (pp * virtual)
    for cut in layers[per_stage - 1 : -1 : per_stage]:
        pipeline.cut_pipeline_stage(cut)
    pipeline.partition()
    return pipeline


def hf_case(family: str, pp: int, virtual: int, how: str, spec: str) -> None:
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    dense = build(family, layers=LAYERS).train()
    vocab = dense.config.vocab_size
    model = _built(copy.deepcopy(dense), pp, virtual, how, spec)
    # NxD's usage: the optimizer over the pipeline's parameters (the model's), made before the first step builds a
    # deferred pipeline's stages; the stages train those very tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dense_optimizer = torch.optim.SGD(dense.parameters(), lr=0.5)
    per_rank = 2 * pp
    for step in range(3):
        batch = _batch(step, per_rank * dp, vocab)
        mine = {k: v[per_rank * dp_rank : per_rank * (dp_rank + 1)] for k, v in batch.items()}
        loss = model.run_train(**mine)
        optimizer.step()
        optimizer.zero_grad()
        dense_loss = _dense_loss(dense, batch, dp * per_rank)
        dense_loss.backward()
        dense_optimizer.step()
        dense_optimizer.zero_grad()
        torch.testing.assert_close(loss, dense_loss.detach(), atol=1e-6, rtol=1e-5)
    dense_params = dict(dense.named_parameters(remove_duplicate=False))  # a tied weight under each of its names
    local = dict(model.local_named_parameters())
    assert local and all(name in dense_params for name in local)
    original = dict(model.original_torch_module.named_parameters(remove_duplicate=False))
    assert [name for name, _ in model.named_parameters()] == list(dict(dense.named_parameters()))  # NxD's: the model's
    for name, param in local.items():
        torch.testing.assert_close(param.detach(), dense_params[name].detach(), msg=name)
        assert original[name] is param and model.get_parameter(name) is param, name  # the model's view is trained
    batch = _batch(7, per_rank * dp, vocab)
    mine = {k: v[per_rank * dp_rank : per_rank * (dp_rank + 1)] for k, v in batch.items()}
    with torch.no_grad():
        dense_eval = _dense_loss(dense, batch, dp * per_rank)
    torch.testing.assert_close(model.run_eval(**mine), dense_eval, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "family,pp,virtual,how,spec",
    [
        ("gpt2", 2, 1, "names", "dict"),  # pp2 x dp2; the tied embedding on the first and last stage
        ("llama", 4, 1, "by_hand", "tuple"),
        ("llama", 2, 2, "deferred", "dict"),
        ("gpt2", 2, 2, "deferred", "tuple"),
    ],
)
def test_nxd_pipeline_of_an_hf_model_trains_like_dense(family: str, pp: int, virtual: int, how: str, spec: str) -> None:
    run_distributed(hf_case, 4, family, pp, virtual, how, spec)


def refusal_case(kind: str) -> None:
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    model = build("t5" if kind == "encoder_decoder" else "llama", layers=LAYERS)
    if kind == "encoder_decoder":
        NxDPPModel(model, transformer_layer_cls=type(model.encoder.block[0]), input_names=["input_ids", "labels"])
    layer = _layer_class(model)
    if kind == "leaf_name":
        NxDPPModel(model, transformer_layer_cls=layer, input_names=["input_ids"], leaf_module_cls=["NoSuchLayer"])
    if kind == "cut":
        pipeline = NxDPPModel(model, transformer_layer_cls=layer, tracer_cls="hf")
        pipeline.trace(input_names=["input_ids", "labels"])
        pipeline.cut_pipeline_stage("model.norm")
    pipeline = NxDPPModel(model, transformer_layer_cls=layer, num_microbatches=2, output_loss_value_spec=(True, False))
    batch = _batch(0, 4, model.config.vocab_size)
    if kind == "unknown_input":
        pipeline.run_train(**batch, lables=batch["labels"])
    if kind == "no_ids":
        pipeline.run_train(labels=batch["labels"])


@pytest.mark.parametrize(
    "kind,message",
    [
        ("unknown_input", r"\['lables'\] it does not take"),
        ("no_ids", "must include .input_ids."),
        ("encoder_decoder", "NotImplementedError: .*encoder-decoder"),
        ("leaf_name", "ValueError: .*NoSuchLayer"),
        ("cut", "RuntimeError: .*no transformer layer"),
    ],
)
def test_nxd_pipeline_of_an_hf_model_refuses_what_it_cannot_run(kind: str, message: str) -> None:
    with pytest.raises(AssertionError, match=message):  # raised on every rank
        run_distributed(refusal_case, 2, kind)


def modes_case() -> None:
    """NxD's modes: ``run_eval`` runs the stages in eval mode (a model with dropout evaluates as the dense model in
    eval mode), ``run_train`` in train mode again; ``forward()``, ``train()`` and ``eval()`` are refused as in NxD."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=48, n_positions=16, n_embd=16, n_layer=LAYERS, n_head=2, resid_pdrop=0.3,
                        embd_pdrop=0.3, attn_pdrop=0.3)  # fmt: skip
    dense = GPT2LMHeadModel(config)
    model = NxDPPModel(copy.deepcopy(dense), transformer_layer_cls=_layer_class(dense), num_microbatches=2,
                       output_loss_value_spec=(True, False), broadcast_and_average_loss=True)  # fmt: skip
    batch = _batch(0, 4, config.vocab_size)
    model.run_train(**batch)
    assert all(module.training for stage in model.local_modules() for module in stage.modules())
    with torch.no_grad():
        dense_eval = _dense_loss(dense.eval(), batch, 2 * parallel_state.get_data_parallel_size())
    torch.testing.assert_close(model.run_eval(**batch), dense_eval, atol=1e-6, rtol=1e-5)  # dropout off
    assert not any(module.training for stage in model.local_modules() for module in stage.modules())
    model.run_train(**batch)
    assert all(module.training for stage in model.local_modules() for module in stage.modules())
    for call in (lambda: model(**batch), model.train, model.eval):
        with pytest.raises(RuntimeError, match="run_train"):
            call()


def test_nxd_pipeline_of_an_hf_model_evaluates_in_eval_mode_and_trains_in_train_mode() -> None:
    run_distributed(modes_case, 2)
