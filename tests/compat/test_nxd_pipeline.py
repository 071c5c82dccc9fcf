"""NxD's manually partitioned pipeline (a model given as a list of layers, ``manual_pp_partition=True``) against a
dense single-process run: NxD's even split (remainder on the last stage) and a custom ``partition_fn``, at pp2 x dp2
and pp4, losses and the parameters after SGD steps equal to dense, also with a weight shared by layers on two stages
(``mark_weight_sharing``: kept one weight); refusals for two marked tensors on one stage, a non-contiguous partition
and a list without ``manual_pp_partition``; the scheduler-free surface of ``PipelineStageModule``. Then NxD's
traced pipelines: traced at the first step over its inputs when given no cuts nor input names (with LoRA and
activation checkpointing around it), the analysis of a traced model split at its marked cuts, and ``run_eval``
without a loss returning the outputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from meshpar.testing import run_distributed
from tests._models import TanhLayer, TiedLM, token_loss

H, CLASSES = 8, 5


def _layers() -> list[nn.Module]:
    torch.manual_seed(1234)
    linears = [nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, CLASSES)]
    return [linears[0], nn.Tanh(), linears[1], nn.ReLU(), linears[2], nn.Tanh(), linears[3], nn.Identity()]


def _train_like_dense(model: nn.Module, dense: nn.Module, dp: int, dp_rank: int) -> None:
    """Three SGD steps of the pipeline (this dp rank's four samples, two microbatches) and of the dense model (every
    dp rank's samples, the same microbatch means): the losses of every step, then every local parameter, equal."""
    optimizer = torch.optim.SGD(model.local_parameters(), lr=0.5)
    dense_optimizer = torch.optim.SGD(dense.parameters(), lr=0.5)
    for step in range(3):
        torch.manual_seed(step)
        inputs, labels = torch.randn(4 * dp, H), torch.randint(0, CLASSES, (4 * dp,))
        mine = slice(4 * dp_rank, 4 * dp_rank + 4)
        loss = model.run_train(inputs=inputs[mine], labels=labels[mine])
        optimizer.step()
        optimizer.zero_grad()
        pieces = [slice(r * 4 + k * 2, r * 4 + k * 2 + 2) for r in range(dp) for k in range(2)]
        dense_loss = torch.stack([nn.functional.cross_entropy(dense(inputs[p]), labels[p]) for p in pieces]).mean()
        dense_loss.backward()
        dense_optimizer.step()
        dense_optimizer.zero_grad()
        assert loss.device.type == "cpu"  # return_loss_on_cpu, NxD's default
        torch.testing.assert_close(loss, dense_loss.detach(), atol=1e-6, rtol=1e-5)
    dense_params = dict(dense.named_parameters(remove_duplicate=False))  # a tied weight under each of its names
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param.detach(), dense_params[name.removeprefix("layers.")].detach(), msg=name)


def manual_case(pp: int, custom: bool) -> None:
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    dense = nn.Sequential(*_layers())
    layers = _layers()

    def partition(layers: list[nn.Module], stages: int) -> dict[nn.Module, int]:  # the first stage takes one layer
        return {
            layer: (0 if i == 0 else 1 + (i - 1) * (stages - 1) // (len(layers) - 1)) for i, layer in enumerate(layers)
        }

    partition_fn = partition if custom else None
    model = NxDPPModel(
        layers,
        num_microbatches=2,
        manual_pp_partition=True,
        manual_pp_stage_partition_fn=partition_fn,
        manual_pp_loss_fn=nn.CrossEntropyLoss(),
        broadcast_and_average_loss=True,
    )  # fmt: skip  (at pp4: fewer microbatches than stages, as NxD's own manual-pipeline test runs)
    _train_like_dense(model, dense, dp, dp_rank)


@pytest.mark.parametrize("pp,custom", [(2, False), (4, False), (2, True), (4, True)])
def test_nxd_manual_pipeline_trains_like_dense(pp: int, custom: bool) -> None:
    run_distributed(manual_case, 4, pp, custom)


def shared_weight_case(pp: int) -> None:
    """The first and the fifth layer share their weight (a tied embedding / head in miniature), on different stages:
    the later stage's copy starts from the first stage's values (the layers were built apart, with different values)
    and both copies follow the dense tied weight through SGD steps, the grads of its two uses summed."""
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel
    from meshpar.compat.nxd.pipeline.manual_pipe_stage import PipelineStageModule

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    dense, layers = nn.Sequential(*_layers()), _layers()
    dense[4].weight = dense[0].weight
    # not tied in this process: the fifth layer's own initial weight differs until the pipeline copies stage 0's
    assert not torch.equal(layers[4].weight, layers[0].weight)
    PipelineStageModule.mark_weight_sharing([(layers[0], "weight"), (layers[4], "weight")], "tied")
    model = NxDPPModel(layers, num_microbatches=2, manual_pp_partition=True, manual_pp_loss_fn=nn.CrossEntropyLoss(),
                       broadcast_and_average_loss=True)  # fmt: skip
    holds = {0: 0, 4: 4 * pp // 8}  # layer -> stage: eight layers, evenly
    expected = ["tied"] if parallel_state.get_pipeline_model_parallel_rank() in holds.values() else []
    assert list(model.manually_shared_weights) == expected
    _train_like_dense(model, dense, dp, dp_rank)


@pytest.mark.parametrize("pp", [2, 4])
def test_nxd_manual_pipeline_keeps_a_weight_shared_across_stages_one_weight(pp: int) -> None:
    run_distributed(shared_weight_case, 4, pp)


def refusal_case(kind: str) -> None:
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel
    from meshpar.compat.nxd.pipeline.manual_pipe_stage import PipelineStageModule

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    layers = [nn.Linear(H, H) for _ in range(4)]
    kwargs = {"num_microbatches": 2, "manual_pp_partition": True, "manual_pp_loss_fn": nn.MSELoss()}
    if kind == "shared_on_one_stage":  # layers 0 and 1 both sit on stage 0 but hold two tensors
        PipelineStageModule.mark_weight_sharing([(layers[0], "weight"), (layers[1], "weight")], "tied")
        NxDPPModel(layers, **kwargs)
    elif kind == "scattered":
        NxDPPModel(layers, manual_pp_stage_partition_fn=lambda ls, n: {m: i % 2 for i, m in enumerate(ls)}, **kwargs)
    elif kind == "list_without_manual":
        NxDPPModel(layers, num_microbatches=2)


@pytest.mark.parametrize(
    "kind,message",
    [
        ("shared_on_one_stage", "hold different tensors"),
        ("scattered", "contiguous"),
        ("list_without_manual", "manual_pp_partition=True"),
    ],
)
def test_nxd_manual_pipeline_refusals(kind: str, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        run_distributed(refusal_case, 2, kind)


def test_pipeline_stage_module_partitions_like_nxd() -> None:
    from meshpar.compat.nxd.pipeline.manual_pipe_stage import PipelineStageModule

    layers = [nn.Linear(H, H) for _ in range(7)]
    mapping = PipelineStageModule._partition_evenly(layers, 3)
    assert [mapping[layer] for layer in layers] == [0, 0, 1, 1, 2, 2, 2]
    stage = PipelineStageModule(layers, num_stages=3, stage_index=2)
    assert list(stage.stage_modules) == layers[4:]
    x = torch.randn(2, H)
    torch.testing.assert_close(stage(x), layers[6](layers[5](layers[4](x))))
    PipelineStageModule.mark_weight_sharing([(layers[0], "weight"), (layers[6], "weight")], "tied")
    first = PipelineStageModule(layers, num_stages=3, stage_index=0)
    assert first.shared_weights_on_pp_stages == {"tied": [[0, 2], [layers[0], "weight"]]}
    with pytest.raises(ValueError, match="cannot fill"):
        PipelineStageModule._partition_evenly(layers[:2], 3)


def pipeline_checkpoint_case(tmp: str) -> None:
    """NxD's checkpoint API on a bare NxDPPModel: each rank saves its stage, a fresh pipeline loads it back."""
    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    kwargs = {"num_microbatches": 2, "manual_pp_partition": True, "manual_pp_loss_fn": nn.CrossEntropyLoss()}
    model = NxDPPModel(_layers(), **kwargs)
    nxd.save_checkpoint(tmp, "t", model=model)
    torch.manual_seed(99)
    fresh = NxDPPModel([nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, H), nn.Tanh(),
                        nn.Linear(H, CLASSES), nn.Identity()], **kwargs)  # fmt: skip
    nxd.load_checkpoint(tmp, model=fresh)
    saved = dict(model.local_named_parameters())
    for name, param in fresh.local_named_parameters():
        torch.testing.assert_close(param, saved[name], msg=name)


def test_nxd_checkpoint_of_a_pipeline_model(tmp_path) -> None:
    run_distributed(pipeline_checkpoint_case, 4, str(tmp_path))


def nxd_files_case(root: str) -> None:
    """Per-pp-rank model files as NxD writes them for a 5-layer model at pp2 (layers 0-1 with the embeddings on pp
    rank 0, layers 2-4 with the final norm and head on pp rank 1: NxD's placement, the remainder on the last stage),
    bare state dicts with no layout, loaded into ``NxDPPModel`` built without ``pipeline_cuts``."""
    from pathlib import Path

    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel
    from tests._models import Block, PipeGPT, lm_loss

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    torch.manual_seed(0)
    saved = PipeGPT(layers=5)
    on_rank = {
        0: ("tok.", "pos.", "layers.0.", "layers.1."),
        1: ("layers.2.", "layers.3.", "layers.4.", "ln_f.", "head."),
    }
    if torch.distributed.get_rank() == 0:
        (Path(root) / "from_nxd" / "model").mkdir(parents=True)
        for pp_rank, prefixes in on_rank.items():
            state = {k: v for k, v in saved.state_dict().items() if k.startswith(prefixes)}
            torch.save(state, Path(root) / "from_nxd" / "model" / f"dp_rank_00_tp_rank_00_pp_rank_{pp_rank:02d}.pt")
    torch.distributed.barrier()
    torch.manual_seed(1)  # other values, replaced by the load
    model = NxDPPModel(PipeGPT(layers=5), transformer_layer_cls=Block, num_microbatches=2, input_names=["ids"],
                       loss_fn=lambda logits, ids, labels: lm_loss(logits, labels))  # fmt: skip
    nxd.load_checkpoint(root, tag="from_nxd", model=model)
    names = [name for name, _ in model.local_named_parameters()]
    assert names and all(name.startswith(on_rank[parallel_state.get_pipeline_model_parallel_rank()]) for name in names)
    expected = dict(saved.named_parameters())
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=0, atol=0)


def test_nxds_per_pp_rank_files_load_at_an_uneven_layer_count(tmp_path) -> None:
    run_distributed(nxd_files_case, 2, str(tmp_path))


class _OptionalInputs(nn.Module):
    """An HF-style forward: the mask and the labels are optional, the loss computed inside (NxD's usage)."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.width = H
        self.embed = nn.Linear(H, H)
        self.layers = nn.ModuleList(TanhLayer(H) for _ in range(layers))
        self.head = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        h = self.embed(x)
        if mask is not None:
            h = h * mask
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return loss, logits


class _Untraceable(_OptionalInputs):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.missing(x)  # fails the moment it is traced


def delayed_tracing_case() -> None:
    """Given no cuts and no input names, NxD traces the pipeline at its first step, over the names of that step's
    inputs: the optional mask and labels the step gives are inputs of the trace (traced at construction over the
    required ``x`` alone, the mask would be dropped and the labels never reach the loss). Until then nothing is
    traced (a forward that cannot be traced builds) and the local views refuse; a later step with other inputs is
    refused on every rank."""
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    untraced = NxDPPModel(_Untraceable(), transformer_layer_cls=TanhLayer, num_microbatches=2)
    with pytest.raises(RuntimeError, match="not partitioned yet"):
        untraced.local_modules()
    torch.manual_seed(0)
    dense = _OptionalInputs()
    module = _OptionalInputs()
    module.load_state_dict(dense.state_dict())
    model = NxDPPModel(module, transformer_layer_cls=TanhLayer, num_microbatches=2,
                       output_loss_value_spec=(True, False), broadcast_and_average_loss=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="not partitioned yet"):
        list(model.local_parameters())
    assert model.width == H and model.head is module.head  # what the pipeline lacks is the model's, as in NxD
    with pytest.raises(AttributeError):
        getattr(model, "no_such_attribute")  # noqa: B009 - the lookup is what is tested
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # every parameter: the stages do not exist yet
    dense_optimizer = torch.optim.SGD(dense.parameters(), lr=0.5)
    for step in range(2):
        torch.manual_seed(10 + step)
        x, labels = torch.randn(4 * dp, H), torch.randint(0, CLASSES, (4 * dp,))
        mask = (torch.rand(4 * dp, H) > 0.5).float()
        mine = slice(4 * dp_rank, 4 * dp_rank + 4)
        loss = model.run_train(x=x[mine], mask=mask[mine], labels=labels[mine])
        optimizer.step()
        optimizer.zero_grad()
        pieces = [slice(r * 4 + k * 2, r * 4 + k * 2 + 2) for r in range(dp) for k in range(2)]
        dense_loss = torch.stack([dense(x[p], mask[p], labels[p])[0] for p in pieces]).mean()
        dense_loss.backward()
        dense_optimizer.step()
        dense_optimizer.zero_grad()
        torch.testing.assert_close(loss, dense_loss.detach(), atol=1e-6, rtol=1e-5)
    assert model.partitioned and list(model.local_parameters())
    dense_params = dict(dense.named_parameters())
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param.detach(), dense_params[name].detach(), msg=name)
    _adapters_of_a_pipeline_traced_later(dp, dp_rank)
    with pytest.raises(RuntimeError, match="traced input names"):
        model.run_train(x=x[mine], labels=labels[mine])


def _adapters_of_a_pipeline_traced_later(dp: int, dp_rank: int) -> None:
    """LoRA and activation checkpointing around a pipeline not traced yet: the adapters go into its model before
    the trace (as NxD adapts it), the recomputed layers into its stages once built; the adapters' grads after the
    first step equal dense ones."""
    import copy

    from meshpar.compat.nxd.modules.lora import LoraConfig, LoraModel
    from meshpar.compat.nxd.pipeline import NxDPPModel
    from meshpar.compat.nxd.utils.activation_checkpoint import NxDCheckpointWrapper, apply_activation_checkpointing

    config = LoraConfig(lora_rank=2, lora_alpha=4, target_modules=["head", "linear"], init_lora_weights="gaussian")
    torch.manual_seed(3)
    base = _OptionalInputs()
    pipeline = NxDPPModel(copy.deepcopy(base), transformer_layer_cls=TanhLayer, num_microbatches=2,
                          output_loss_value_spec=(True, False))  # fmt: skip
    lora = LoraModel(pipeline, config)
    apply_activation_checkpointing(pipeline)
    dense = LoraModel(base, config)
    dense.module.load_state_dict(pipeline.original_torch_module.state_dict())  # the same adapters' values
    torch.manual_seed(20)
    x, labels = torch.randn(4 * dp, H), torch.randint(0, CLASSES, (4 * dp,))
    mine = slice(4 * dp_rank, 4 * dp_rank + 4)
    lora.run_train(x=x[mine], labels=labels[mine])
    pieces = [slice(r * 4 + k * 2, r * 4 + k * 2 + 2) for r in range(dp) for k in range(2)]
    torch.stack([dense(x[p], labels=labels[p])[0] for p in pieces]).mean().backward()
    wrapped = [m for stage in pipeline.local_modules() for m in stage.modules() if isinstance(m, NxDCheckpointWrapper)]
    assert wrapped and all(isinstance(m, TanhLayer) for m in wrapped)  # the stages' layers, recomputed in backward
    dense_params = dict(dense.module.named_parameters())
    adapters = [(name, p) for name, p in pipeline.local_named_parameters() if "lora_" in name]
    assert adapters
    for name, param in adapters:
        torch.testing.assert_close(param.grad, dense_params[name].grad, atol=1e-6, rtol=1e-5, msg=name)


def test_nxd_pipeline_without_cuts_is_traced_at_its_first_step_over_its_inputs() -> None:
    run_distributed(delayed_tracing_case, 4)


class _Skip(_OptionalInputs):
    """The embedding's output is used again after the last layer (a skip over every cut), and a second head holds
    the embedding's weight (tied: a weight two stages share)."""

    def __init__(self) -> None:
        super().__init__()
        self.tied = nn.Linear(H, H)
        self.tied.weight = self.embed.weight

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        h0 = self.embed(x)
        h = h0 * mask if mask is not None else h0
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h + h0) + self.tied(h).sum(-1, keepdim=True)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return loss, logits


def split_analysis_case() -> None:
    """NxD's analysis of a traced model split at its marked cuts: trace() fills traced_model, cut_pipeline_stage
    marks its cut calls (an unknown cut is refused there), partition_traced_model splits it into one submodule per
    stage, analyze_pipeline_module says what each stage receives (the skip value passed along by the middle stage)
    and which model inputs it reads, analyze_shared_weights_across_stages which weight two pp ranks share (none when
    the stages holding it run on one rank). meshpar's runtime sends one activation across a cut, so partitioning
    where the skip crosses too is refused."""
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel
    from meshpar.compat.nxd.pipeline import partition as nxd_partition

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    model = NxDPPModel(_Skip(), transformer_layer_cls=TanhLayer, num_microbatches=2)
    assert model.traced_model is None
    model.trace(input_names=["x", "mask", "labels"])
    with pytest.raises(RuntimeError, match="calls no module"):
        model.cut_pipeline_stage("layers.9")
    for cut in ("layers.0", "layers.2"):  # three stages, to see a value passed through the middle one
        model.cut_pipeline_stage(cut)
    marked = [n.target for n in model.traced_model.graph.nodes if n.meta.get("partition") is True]
    assert marked == ["layers.0", "layers.2"]
    split = nxd_partition.partition_traced_model(model.traced_model)
    again = nxd_partition.partition_traced_model(model.traced_model)  # the marks survive a split
    held = {name: {p for p, _ in child.named_parameters()} for name, child in split.named_children()}
    assert held == {name: {p for p, _ in child.named_parameters()} for name, child in again.named_children()}
    linear = ("linear.weight", "linear.bias")
    assert held == {
        "submod_0": {"embed.weight", "embed.bias", *(f"layers_0.{p}" for p in linear)},
        "submod_1": {f"layers_{i}.{p}" for i in (1, 2) for p in linear},
        "submod_2": {*(f"layers_3.{p}" for p in linear), "head.weight", "head.bias", "tied.weight", "tied.bias"},
    }
    received, model_inputs, input_count, output_count = nxd_partition.analyze_pipeline_module(split)
    assert model_inputs == {0: {"x": 0, "mask": 1}, 1: {}, 2: {"labels": 2}}
    assert input_count == {0: 2, 1: 1, 2: 3} and output_count == {0: 2, 1: 1, 2: 2}
    sent_by_0 = [n.name for n in next(n for n in split.submod_0.graph.nodes if n.op == "output").args[0]]
    position = {name: (io.input_idx, io.output_idx) for stage in (1, 2) for name, io in received[stage].items()}
    assert (
        received[0] == {} and list(received[1]) == ["layers_0", "embed"] and list(received[2]) == ["layers_2", "embed"]
    )
    # stage 1 takes layers_0 as its input 0 and passes the embedding along (no input of its own); stage 2 takes
    # both, the embedding as its input 1, from stage 1's pass-through (no output position)
    assert position == {"layers_0": (0, sent_by_0.index("layers_0")), "embed": (1, None), "layers_2": (0, 0)}
    assert (received[1]["embed"].input_idx, received[1]["embed"].output_idx) == (None, sent_by_0.index("embed"))
    stages = [child for _, child in split.named_children()]
    assert nxd_partition.analyze_shared_weights_across_stages(model.traced_model, stages) == []  # stages 0, 2: rank 0
    tied = model.original_torch_module.embed.weight  # held twice by pp rank 0: one copy, not shared
    assert getattr(tied, "shared", None) == (False if pp_rank == 0 else None)
    two = NxDPPModel(_Skip(), transformer_layer_cls=TanhLayer, num_microbatches=2)
    two.trace(input_names=["x", "mask", "labels"])
    two.cut_pipeline_stage("layers.1")
    halves = [child for _, child in nxd_partition.partition_traced_model(two.traced_model).named_children()]
    shared = nxd_partition.analyze_shared_weights_across_stages(two.traced_model, halves)
    assert shared == [[("embed.weight", 0), ("tied.weight", 1)]]
    assert two.original_torch_module.embed.weight.shared == (pp_rank == 1)  # counted once: on the first rank
    with pytest.raises(ValueError, match="sends one activation"):
        two.partition()


def test_nxd_analysis_of_a_traced_model_split_at_its_cuts() -> None:
    run_distributed(split_analysis_case, 2)


class _Logits(_OptionalInputs):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def eval_outputs_case(microbatches: int) -> None:
    """Without output_loss_value_spec (nor a loss function) NxD's pipeline has no loss: run_eval returns the last
    stage's output (one per microbatch), None on the other ranks; with the spec it returns the mean loss."""
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    last = parallel_state.get_pipeline_model_parallel_rank() == 1
    torch.manual_seed(0)
    dense = _Logits()
    model = NxDPPModel(copy.deepcopy(dense), transformer_layer_cls=TanhLayer, num_microbatches=microbatches)
    x = torch.randn(4, H)
    outputs = model.run_eval(x=x)
    expected = [dense(piece).detach() for piece in x.chunk(microbatches)]
    if not last:
        assert outputs is None
    elif microbatches == 1:
        torch.testing.assert_close(outputs, expected[0])
    else:
        assert len(outputs) == microbatches
        for got, want in zip(outputs, expected, strict=True):
            torch.testing.assert_close(got, want)
    with_loss = NxDPPModel(_OptionalInputs(), transformer_layer_cls=TanhLayer, num_microbatches=microbatches,
                           output_loss_value_spec=(True, False), input_names=["x", "labels"])  # fmt: skip
    labels = torch.randint(0, CLASSES, (4,))
    loss = with_loss.run_eval(x=x, labels=labels)
    assert (loss is not None and loss.dim() == 0) == last


@pytest.mark.parametrize("microbatches", [1, 2])
def test_nxd_pipeline_without_a_loss_evaluates_to_its_outputs(microbatches: int) -> None:
    run_distributed(eval_outputs_case, 2, microbatches)


VOCAB = 11


def tied_weights_case(pp: int, virtual: int, traced: bool) -> None:
    """A weight the model ties, held by stages on different pp ranks (the embedding and the head) and by two chunks
    of one rank (under a virtual pipeline), stays one weight: the losses, the grad norm (each weight counted once)
    and every local parameter after SGD steps equal the dense tied model's, at pp x dp."""
    from meshpar.compat.nxd.parallel_layers import grads, parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    dense = TiedLM(H, VOCAB, share_layers=True)
    split = {"input_names": ["ids", "labels"]} if traced else {"loss_fn": token_loss, "input_names": ["ids"]}
    model = NxDPPModel(TiedLM(H, VOCAB, share_layers=True), transformer_layer_cls=TanhLayer, num_microbatches=2 * pp,
                       virtual_pipeline_size=virtual, broadcast_and_average_loss=True, **split)  # fmt: skip
    assert len(model.tied.names) == 2  # embed/head, layers 0/2
    optimizer = torch.optim.SGD(model.local_parameters(), lr=0.5)
    dense_optimizer = torch.optim.SGD(dense.parameters(), lr=0.5)
    per_rank = 2 * pp
    for step in range(3):
        torch.manual_seed(step)
        ids = torch.randint(0, VOCAB, (per_rank * dp, 5))
        mine = slice(per_rank * dp_rank, per_rank * (dp_rank + 1))
        loss = model.run_train(ids=ids[mine], labels=ids[mine].roll(1, 1))
        norm = grads.get_grad_norm(list(model.local_parameters()))
        optimizer.step()
        optimizer.zero_grad()
        dense_loss = torch.stack([dense(piece, piece.roll(1, 1)) for piece in ids.chunk(dp * 2 * pp)]).mean()
        dense_loss.backward()
        dense_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in dense.parameters()]))
        dense_optimizer.step()
        dense_optimizer.zero_grad()
        torch.testing.assert_close(loss, dense_loss.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(norm.cpu(), dense_norm, atol=1e-6, rtol=1e-5)
    dense_params = dict(dense.named_parameters(remove_duplicate=False))  # a tied weight under each of its names
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param.detach(), dense_params[name].detach(), msg=name)


@pytest.mark.parametrize("pp,virtual,traced", [(2, 1, False), (4, 1, True), (2, 2, True), (2, 2, False)])
def test_nxd_pipeline_keeps_a_tied_weight_one_weight_across_stages(pp: int, virtual: int, traced: bool) -> None:
    run_distributed(tied_weights_case, 4, pp, virtual, traced)


def local_views_case(virtual: int, traced: bool) -> None:
    """NxD's local views of a partitioned pipeline: buffers, children and modules of this rank's stages under the
    model's names; a whole model's state dict loads on every pp rank (other stages' keys ignored, a missing local
    key refused under ``strict``), through the pipeline and through NxDModel; the name translations; the chunk ->
    stage arithmetic."""
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.pipeline import NxDPPModel
    from meshpar.compat.nxd.trainer.model import NxDModel

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()

    def with_buffers(seed: int) -> TiedLM:
        model = TiedLM(H, VOCAB, share_layers=True, seed=seed)  # layers 0 and 2: one rank's two chunks at vpp2
        for index, layer in enumerate(model.layers):
            layer.register_buffer("step", torch.full((1,), float(index)))
        return model

    split = {"input_names": ["ids", "labels"]} if traced else {"loss_fn": token_loss, "input_names": ["ids"]}
    model = NxDPPModel(with_buffers(1), transformer_layer_cls=TanhLayer, num_microbatches=4,
                       virtual_pipeline_size=virtual, **split)  # fmt: skip
    layers = {index for index in range(4) if (index * 2 * virtual // 4) % 2 == pp_rank}  # chunk i -> rank i % pp
    assert {name for name, _ in model.local_named_buffers()} == {f"layers.{index}.step" for index in layers}
    assert [b.item() for b in model.local_buffers()] == sorted(float(index) for index in layers)
    modules = list(model.local_named_modules())
    assert {f"layers.{index}" for index in layers} <= {name for name, _ in modules}
    assert len({id(module) for _, module in modules}) == len(modules)  # a module two chunks share comes once
    params = list(model.local_parameters())
    assert len({id(param) for param in params}) == len(params)  # a weight two chunks share: stepped once
    assert {c for c in model.local_children()} == {child for _, child in model.local_named_children()}
    stages = [chunk.stage_index for chunk in model.chunks]
    assert [model.get_current_stage(chunk) for chunk in range(virtual)] == stages
    assert model.is_last_stage() == (2 * virtual - 1 in stages)

    dense = with_buffers(2)
    full = dense.state_dict()
    result = model.load_state_dict(full, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    dense_values = dict(dense.named_parameters(remove_duplicate=False))
    # NxD's views of the pipeline itself are the model's, whose entries for this rank's stages are the stages' own
    original = model.original_torch_module
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in original.named_parameters()]
    assert [name for name, _ in model.named_buffers()] == [name for name, _ in original.named_buffers()]
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param, dense_values[name], rtol=0, atol=0, msg=name)
        assert original.get_parameter(name) is param, name
    for name, buffer in model.local_named_buffers():
        assert original.get_buffer(name) is buffer, name
    local = model.local_state_dict()
    assert model.translate_origin_state_dict_to_local_state_dict(full).keys() == local.keys()
    assert model.translate_local_state_dict_to_origin_state_dict(local) == local
    foreign = next(name for name in full if name not in local)
    with pytest.raises(ValueError, match=foreign):
        model.translate_local_state_dict_to_origin_state_dict({foreign: full[foreign]})
    pieces = model.construct_state_dict_per_model_chunk(full)
    assert sorted(pieces) == list(range(virtual)) and sum(len(piece) for piece in pieces.values()) == len(local)

    lacking = {name: value for name, value in full.items() if name != next(iter(local))}
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(lacking, strict=True)
    assert model.load_state_dict(lacking, strict=False).missing_keys == [next(iter(local))]
    wrapped = NxDModel(model, {"pipeline_parallel_size": 2})
    wrapped.load_state_dict(with_buffers(3).state_dict())
    assert {name for name, _ in wrapped.named_buffers()} == {name for name, _ in model.local_named_buffers()}
    assert wrapped.state_dict().keys() == local.keys()
    with pytest.raises(RuntimeError, match="local_state_dict"):
        model.state_dict()  # as in NxD: the wrapper's names and the wrapped model's copy would be a wrong save


@pytest.mark.parametrize("virtual,traced", [(1, False), (2, True)])
def test_nxd_pipeline_local_views_and_state_dict_loading(virtual: int, traced: bool) -> None:
    run_distributed(local_views_case, 2, virtual, traced)
