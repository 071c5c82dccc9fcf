"""``neuronx_distributed.pipeline.partition``: NxD's helpers for placing layers on pipeline stages, and for
reading a traced model split at its marked cuts.

``create_partitions(stages, layer_names)`` gives the ``pipeline_cuts`` NxD's examples pass to ``NxDPPModel``: the
layers dealt out evenly, the remainder to the *last* stages (NxD's rule; meshpar's own even split gives it to the
first ones), one cut after each stage's last layer. ``stage_to_pipeline_parallel_rank`` says which pp rank runs a
(virtual) stage.

The analysis helpers work on a torch.fx graph whose cut nodes carry ``node.meta["partition"] = True`` (what
``NxDPPModel.cut_pipeline_stage`` marks on ``NxDPPModel.traced_model``): ``partition_traced_model`` splits it into one
``submod_<i>`` per stage (torch.fx's ``split_module``), ``analyze_pipeline_module`` says what each stage receives
and sends (``PipelineIO`` records, values passed through the stages between their producer and their last user),
``analyze_shared_weights_across_stages`` which parameters stages on different pp ranks share. They describe a
split; they do not drive meshpar's runtime, which builds its stages from the same cuts itself
(:mod:`meshpar.pipeline.trace`: one activation crosses each cut there, and a cut more values cross is refused).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from meshpar.compat.nxd.parallel_layers.parallel_state import (
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_size,
)

__all__ = [
    "PipelineIO",
    "adding_live_obj_for_previous_stages",
    "analyze_pipeline_module",
    "analyze_shared_weights_across_stages",
    "create_partitions",
    "iterate_graph_model_outputs",
    "partition_traced_model",
    "stage_to_pipeline_parallel_rank",
]


class TooFewLayersError(ValueError, AssertionError):
    """Fewer layers than pipeline stages. NxD asserts this (``AssertionError``, what its tests expect); meshpar
    raises ``ValueError`` for bad sizes: this is both."""


def create_partitions(pipeline_parallel_size: int, model_layer_names: Sequence[str]) -> list[str]:
    """The names of the layers each stage but the last ends with (NxD's ``pipeline_cuts``): ``len // stages`` layers
    per stage, one more on each of the last ``len % stages`` stages."""
    layers = len(model_layer_names)
    if pipeline_parallel_size < 1 or layers < pipeline_parallel_size:
        raise TooFewLayersError(
            f"create_partitions: {layers} layers cannot fill {pipeline_parallel_size} pipeline stages (each needs one)"
        )
    base, extra = divmod(layers, pipeline_parallel_size)
    sizes = [base + (1 if stage >= pipeline_parallel_size - extra else 0) for stage in range(pipeline_parallel_size)]
    cuts, end = [], 0
    for size in sizes[:-1]:
        end += size
        cuts.append(model_layer_names[end - 1])
    return cuts


def stage_to_pipeline_parallel_rank(stage: int, pp_size: int | None = None) -> int:
    """The pp rank that runs ``stage`` (virtual stages go round the ranks: stage ``s`` on rank ``s % pp``)."""
    return stage % (pp_size if pp_size is not None else get_pipeline_model_parallel_size())


_CUT = "pipeline_cut"  # where a marked cut is remembered once meta["partition"] holds the node's stage


def partition_traced_model(traced_model: fx.GraphModule, qualname_map: dict[str, str] | None = None) -> fx.GraphModule:
    """``traced_model`` split into ``submod_0`` ... ``submod_<cuts>``: a node marked ``meta["partition"] = True``
    is the last of its stage. Each node's stage is left in ``meta["partition"]`` (NxD's convention; the marks are
    kept, so splitting again gives the same stages). ``qualname_map`` (filled in) maps the split model's names to
    the traced model's."""
    stage = 0
    for node in traced_model.graph.nodes:
        is_cut = node.meta.get(_CUT, False) or node.meta.get("partition") is True
        node.meta[_CUT] = is_cut
        node.meta["partition"] = stage
        stage += int(is_cut)
    return split_module(
        traced_model, None, lambda node: node.meta["partition"], qualname_map=qualname_map, keep_original_order=True
    )


class PipelineIO:
    """A value a stage receives from the previous one or sends to the next: the fx node ``name``, its position among
    the stage's inputs (``input_idx``) and among the previous stage's outputs it comes from, or this stage's
    outputs (``output_idx``); ``None`` where it is not one (a value only passed along). ``metadata``: its tensors'
    shapes once known; ``obj``: the Python object carrying it (``None``: a tensor)."""

    def __init__(
        self,
        name: str,
        input_idx: int | None = None,
        output_idx: int | None = None,
        metadata: list[Any] | None = None,
        obj: Any = None,
    ) -> None:
        self.name, self.input_idx, self.output_idx, self.metadata, self.obj = name, input_idx, output_idx, metadata, obj

    def __repr__(self) -> str:  # NxD's spelling (its tests compare printed analyses)
        return (
            f"PipelineIO_{self.name}_input_idx_{self.input_idx}_output_idx_{self.output_idx}_metadata_{self.metadata}"
        )


def adding_live_obj_for_previous_stages(
    stage_id_to_IO_input_names: dict[int, OrderedDict[str, PipelineIO]],  # noqa: N803 - NxD's keyword
    stage_id_to_IO_output_names: dict[int, OrderedDict[str, PipelineIO]],  # noqa: N803 - NxD's keyword
    obj_name: str,
    current_stage: int,
) -> None:
    """Make ``obj_name``, which a later stage needs, leave ``current_stage``: sent by the stage that computes or
    uses it last, and received and sent on by every stage between it and the one that made it. Raises when no
    earlier stage has it."""
    if current_stage < 0:
        raise RuntimeError(f"{obj_name} is made by no earlier stage (stage outputs: {stage_id_to_IO_output_names})")
    inputs, outputs = stage_id_to_IO_input_names[current_stage], stage_id_to_IO_output_names[current_stage]
    if obj_name in outputs:
        return
    if obj_name not in inputs:  # made further back: this stage only passes it on
        adding_live_obj_for_previous_stages(
            stage_id_to_IO_input_names, stage_id_to_IO_output_names, obj_name, current_stage - 1
        )
        inputs[obj_name] = PipelineIO(obj_name)
    outputs[obj_name] = PipelineIO(obj_name)


def iterate_graph_model_outputs(output_node_args: tuple) -> Iterator[Any]:
    """The values an fx graph's output node returns, one by one (its ``args`` are ``(value,)`` or
    ``((value, ...),)``)."""
    if not (isinstance(output_node_args, tuple) and len(output_node_args) == 1):
        raise AssertionError(f"an fx output node's args are a 1-tuple, got {output_node_args}")
    returned = output_node_args[0]
    yield from returned if isinstance(returned, tuple) else (returned,)


def _name(value: Any) -> str:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, str):
        return value
    raise RuntimeError(f"a stage input or output must be an fx node, got {value!r} ({type(value).__name__})")


def analyze_pipeline_module(
    top_mod: fx.GraphModule,
) -> tuple[dict[int, OrderedDict[str, PipelineIO]], dict[int, dict[str, int]], dict[int, int], dict[int, int]]:
    """For a model split by :func:`partition_traced_model`, per stage: the values it receives from the previous
    stage (name -> ``PipelineIO`` with its input position and the previous stage's output position it comes from,
    in the order both sides agree on), the model inputs it reads (name -> input position), and how many inputs and
    outputs it has. Raises when a stage's received values are not what the previous stage sends."""
    model_inputs = {node.name for node in top_mod.graph.nodes if node.op == "placeholder"}
    received: dict[int, OrderedDict[str, PipelineIO]] = {}
    sent: dict[int, OrderedDict[str, PipelineIO]] = {}
    model_inputs_read: dict[int, dict[str, int]] = {}
    input_count: dict[int, int] = {}
    output_count: dict[int, int] = {}
    stages = list(top_mod.named_children())
    for stage, (child_name, child) in enumerate(stages):
        if not child_name.startswith("submod_"):
            raise AssertionError(f"a split model's stages are its submod_<i> children, got {child_name!r}")
        received[stage], sent[stage], model_inputs_read[stage] = OrderedDict(), OrderedDict(), {}
        count = 0
        for node in child.graph.nodes:
            if node.op == "placeholder":
                name = _name(node)
                if name in model_inputs:
                    model_inputs_read[stage][name] = count
                else:
                    adding_live_obj_for_previous_stages(received, sent, name, stage - 1)
                    received[stage][name] = PipelineIO(name, input_idx=count)
                count += 1
            elif node.op == "output":
                outputs = list(iterate_graph_model_outputs(node.args))
                for index, value in enumerate(outputs):
                    sent[stage][_name(value)] = PipelineIO(_name(value), output_idx=index)
                output_count[stage] = len(outputs)
        input_count[stage] = count
        output_count.setdefault(stage, 0)
    for stage in range(1, len(stages)):
        if set(received[stage]) != set(sent[stage - 1]):
            raise RuntimeError(
                f"stage {stage} receives {sorted(received[stage])}, but stage {stage - 1} sends "
                f"{sorted(sent[stage - 1])}"
            )
        for name, io in received[stage].items():
            io.output_idx = sent[stage - 1][name].output_idx
    return received, model_inputs_read, input_count, output_count


def analyze_shared_weights_across_stages(top_module: nn.Module, partitions: Sequence[nn.Module]) -> list[list[tuple]]:
    """The parameters that stages on different pp ranks hold: for each, ``[(its name in the stage, pp rank), ...]``
    (one entry per pp rank, in stage order). This rank's parameters get ``shared`` set: ``True`` on each later pp
    rank's copy of a shared one (so that a grad norm counts it once), else ``False``."""
    this_rank = get_pipeline_model_parallel_rank()
    holders: dict[torch.nn.Parameter, list[tuple[str, int]]] = {p: [] for p in top_module.parameters()}
    for stage, partition in enumerate(partitions):
        rank = stage_to_pipeline_parallel_rank(stage)
        for name, param in partition.named_parameters():
            seen = holders.setdefault(param, [])
            on_this_rank_already = any(held_rank == rank for _, held_rank in seen)
            if rank == this_rank:
                param.shared = bool(seen) and not on_this_rank_already
            if not on_this_rank_already:
                seen.append((name, rank))
    return [held for held in holders.values() if len(held) > 1]
