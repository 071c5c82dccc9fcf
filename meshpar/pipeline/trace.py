"""Pipeline stages of a model whose forward is not a plain stack of layers, by tracing it (NxD's ``NxDPPModel``).

NxD traces the module with torch.fx and cuts the graph after chosen layers; so does this module. The tracer treats
``transformer_layer_cls`` and ``leaf_module_cls`` modules as leaves (NxD's rule), takes ``autowrap_modules`` /
``autowrap_functions`` and NxD's ``tracer_cls`` (``"torch"``, ``"hf"`` or a ``torch.fx.Tracer`` subclass), and
traces only ``input_names`` (other arguments keep their defaults). Which layers each stage holds is decided as for
the structural split (:func:`meshpar.pipeline.split.plan_stages`: ``pipeline_cuts``, ``auto_partition`` or an
even split). Each stage is a ``GraphModule`` over the original model: its parameters keep their FQNs.

Every node goes to the stage of the layers around it. Nodes computed from the inputs alone (an attention mask, the
positions) are recomputed in each stage that needs them, and every stage receives the model inputs it reads
(the labels of a loss computed inside ``forward``, say) from the microbatch, so what crosses a cut is the hidden
state: meshpar's pipeline sends one activation between stages, and a cut that more values cross is refused naming
them. The last stage returns what the model's ``forward`` returns; ``output_loss_value_spec`` picks the loss.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from meshpar.pipeline.split import StagePlan, plan_stages

# GraphModule.meta key: the input names a trace was made over
_INPUTS_KEY = "meshpar_traced_inputs"


def _tracer_class(tracer_cls: Any) -> type[fx.Tracer]:
    if tracer_cls is None or tracer_cls == "torch":
        return fx.Tracer
    if tracer_cls == "hf":
        try:
            from transformers.utils.fx import HFTracer
        except ImportError as error:  # transformers 5 dropped its fx tracer
            raise NotImplementedError(
                "tracer_cls='hf': the installed transformers has no fx tracer (transformers.utils.fx.HFTracer); use "
                "tracer_cls='torch' or meshpar.parallelize for HuggingFace models"
            ) from error
        return HFTracer
    if isinstance(tracer_cls, type) and issubclass(tracer_cls, fx.Tracer):
        return tracer_cls
    raise ValueError(f"tracer_cls must be 'torch', 'hf' or a torch.fx.Tracer subclass, got {tracer_cls!r}")


def trace(
    module: nn.Module,
    input_names: Sequence[str],
    leaves: tuple[type, ...],
    *,
    tracer_cls: Any = None,
    autowrap_modules: tuple | None = None,
    autowrap_functions: tuple | None = None,
) -> fx.GraphModule:
    """``module``'s forward as an fx graph over ``input_names``, with ``leaves`` kept as calls."""
    base = _tracer_class(tracer_cls)
    kwargs: dict[str, Any] = {}
    if autowrap_modules is not None:
        kwargs["autowrap_modules"] = tuple(autowrap_modules)
    if autowrap_functions is not None:
        kwargs["autowrap_functions"] = tuple(autowrap_functions)

    class LeafTracer(base):  # type: ignore[misc, valid-type]
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, leaves) or super().is_leaf_module(m, qualname)

    parameters = inspect.signature(module.forward).parameters
    unknown = [n for n in input_names if n not in parameters]
    if unknown:
        raise ValueError(f"input_names {unknown} are not arguments of {type(module).__name__}.forward")
    concrete = {
        name: p.default
        for name, p in parameters.items()
        if name not in input_names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    missing = [name for name, value in concrete.items() if value is inspect.Parameter.empty]
    if missing:
        raise ValueError(f"input_names must name every argument of forward without a default; missing {missing}")
    try:
        graph = LeafTracer(**kwargs).trace(module, concrete_args=concrete or None)
    except Exception as error:  # data-dependent control flow, untraceable calls, ...
        from transformers import PreTrainedModel

        hint = (
            " (a HuggingFace model: NxD traces those with transformers' fx tracer, which transformers 5 removed; "
            "meshpar.parallelize pipelines them from their own base_model_pp_plan)"
            if isinstance(module, PreTrainedModel) and base is fx.Tracer
            else ""
        )
        raise ValueError(
            f"NxDPPModel could not trace {type(module).__name__}.forward with torch.fx ({type(error).__name__}: "
            f"{error}){hint}; pass leaf_module_cls=[...] for the modules that cannot be traced, autowrap_functions "
            "for such functions, or loss_fn=... to split the model by its module structure instead"
        ) from error
    traced = fx.GraphModule(module, graph)
    traced.meta[_INPUTS_KEY] = list(input_names)  # what it was traced over (fx adds placeholders for the others)
    return traced


def _cut_layers(plan: StagePlan) -> list[str]:
    """The FQN of the last layer of every stage but the last: a new stage starts after each."""
    return [f"{plan.container}.{layers[-1]}" for layers in plan.stage_layers[:-1]]


def _stage_of_nodes(graph: fx.Graph, cuts: list[str]) -> dict[fx.Node, int]:
    """Stage per node that computes something (not placeholders, not the output): ``get_attr`` nodes go with their
    first user, nodes of the inputs alone are left out (recomputed where needed)."""
    from_inputs: set[fx.Node] = set()
    stage_of: dict[fx.Node, int] = {}
    stage, pending = 0, list(cuts)
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            if node.op == "placeholder":
                from_inputs.add(node)
            continue
        if node.op in ("call_function", "call_method") and all(a in from_inputs for a in node.all_input_nodes):
            from_inputs.add(node)
            continue
        if node.op != "get_attr":
            stage_of[node] = stage
        if node.op == "call_module" and pending and node.target == pending[0]:
            pending.pop(0)
            stage += 1
    missing = [c for c in cuts if c in pending]
    if missing:
        raise ValueError(f"the traced forward never calls the layers {missing} where the pipeline is cut")
    for node in graph.nodes:  # a parameter read by functional code lives in the stage that reads it
        if node.op == "get_attr":
            stage_of[node] = min((stage_of[u] for u in node.users if u in stage_of), default=0)
    return stage_of


def _stage_graph(graph: fx.Graph, stage_of: dict[fx.Node, int], stage: int, last: int) -> tuple[fx.Graph, list[str]]:
    """The graph of one stage: ``(activation, *inputs it reads) -> next activation`` (the last stage: the model's
    output). Returns it with the names of the model inputs it reads."""
    crossing_in = _crossing(graph, stage_of, stage) if stage > 0 else []
    out_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if crossing_in:
        env[crossing_in[0]] = out_graph.placeholder("activation")
    inputs: list[str] = []

    def lookup(node: fx.Node) -> fx.Node:
        if node in env:
            return env[node]
        if node.op == "placeholder":
            inputs.append(node.target)
            env[node] = out_graph.placeholder(node.target)
        else:  # computed from the inputs alone (or a parameter read): recompute it here
            env[node] = out_graph.node_copy(node, lookup)
        return env[node]

    for node in graph.nodes:
        if stage_of.get(node) == stage and node.op != "get_attr":
            env[node] = out_graph.node_copy(node, lookup)
    if stage == last:
        output = next(n for n in graph.nodes if n.op == "output")
        out_graph.output(fx.map_arg(output.args[0], lookup))
    else:
        out_graph.output(lookup(_crossing(graph, stage_of, stage + 1)[0]))
    out_graph.lint()
    return out_graph, inputs


def _crossing(graph: fx.Graph, stage_of: dict[fx.Node, int], stage: int) -> list[fx.Node]:
    """The computed values made before ``stage`` and used from ``stage`` on: exactly one, the activation."""
    crossing = []
    for node in graph.nodes:
        if stage_of.get(node, stage) < stage and node.op != "get_attr":
            users = [u for u in node.users if stage_of.get(u, -1) >= stage or u.op == "output"]
            if users:
                crossing.append(node)
    if len(crossing) != 1:
        names = [n.name for n in crossing] or ["nothing"]
        raise ValueError(
            f"the cut before pipeline stage {stage} is crossed by {names}: meshpar's pipeline sends one activation "
            "between stages; cut after another layer, or compute those values from the model inputs"
        )
    return crossing


def _check_is_trace_of(traced: fx.GraphModule, module: nn.Module, input_names: Sequence[str]) -> None:
    """A trace handed in must be of ``module`` (the same parameter objects) and over ``input_names``: cutting
    another model's graph would run stages whose weights are not the pipeline's."""
    traced_over = traced.meta.get(_INPUTS_KEY)
    if traced_over != list(input_names):
        raise ValueError(f"the trace given was made over inputs {traced_over}, the pipeline traces {list(input_names)}")
    ours = {id(p) for p in module.parameters()}
    if any(id(p) not in ours for p in traced.parameters()):
        raise ValueError(f"the trace given holds parameters that are not {type(module).__name__}'s")


def traced_input_names(module: nn.Module, input_names: Sequence[str] | None) -> list[str]:
    """The arguments of ``module.forward`` a trace takes as inputs: ``input_names``, or (``None``) its arguments
    without a default."""
    if input_names is not None:
        return list(input_names)
    parameters = inspect.signature(module.forward).parameters.values()
    return [p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind in (
        p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]  # fmt: skip


def leaf_classes(
    transformer_layer_cls: type | tuple[type, ...] | None, leaf_module_cls: Sequence[type] | None = None
) -> tuple[type, ...]:
    """The module classes a trace keeps as calls: the layers the cuts fall after, then ``leaf_module_cls``."""
    layers = transformer_layer_cls if isinstance(transformer_layer_cls, tuple) else (transformer_layer_cls,)
    return tuple(c for c in (*layers, *(leaf_module_cls or ())) if c is not None)


def traced_stages(
    module: nn.Module,
    pp_rank: int,
    pp: int,
    *,
    input_names: Sequence[str] | None,
    transformer_layer_cls: type | tuple[type, ...] | None,
    leaf_module_cls: Sequence[type] | None = None,
    pipeline_cuts: Sequence[str] | None = None,
    auto_partition: bool = False,
    virtual_pipeline_size: int = 1,
    tracer_cls: Any = None,
    autowrap_modules: tuple | None = None,
    autowrap_functions: tuple | None = None,
    device: torch.device | None = None,
    traced: fx.GraphModule | None = None,
) -> tuple[list[tuple[int, nn.Module, list[str]]], StagePlan]:
    """This rank's stages ``[(stage_index, GraphModule, model inputs it reads), ...]`` and the stage plan.
    ``traced``: ``module`` already traced over ``input_names`` with these leaves (by :func:`trace`), cut as it is
    rather than traced again; it must be a trace of ``module`` itself and over exactly those inputs."""
    input_names = traced_input_names(module, input_names)
    if any(p.is_meta for p in module.parameters()):
        raise NotImplementedError("a traced pipeline of a model built on meta: build it on CPU (or pass loss_fn)")
    num_stages = pp * virtual_pipeline_size
    plan = plan_stages(
        module,
        num_stages,
        transformer_layer_cls=transformer_layer_cls,
        pipeline_cuts=pipeline_cuts,
        auto_partition=auto_partition,
    )
    if traced is None:
        traced = trace(
            module,
            input_names,
            leaf_classes(transformer_layer_cls, leaf_module_cls),
            tracer_cls=tracer_cls,
            autowrap_modules=autowrap_modules,
            autowrap_functions=autowrap_functions,
        )
    else:
        _check_is_trace_of(traced, module, input_names)
    stage_of = _stage_of_nodes(traced.graph, _cut_layers(plan))
    stages = []
    for index in range(pp_rank, num_stages, pp):
        graph, inputs = _stage_graph(traced.graph, stage_of, index, num_stages - 1)
        stage = fx.GraphModule(module, graph)  # holds only what the graph reads, at its original FQNs
        stages.append((index, stage.to(device) if device is not None else stage, inputs))
    return stages, plan
