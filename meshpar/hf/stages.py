"""Pipeline stage forwards for HuggingFace models.

Every causal or masked LM whose config carries transformers' ``base_model_pp_plan`` (or, without one or with one that
does not describe the model, whose base model, or the one module it wraps, holds a layer list: the plan is then read
from its children in the order the dense forward calls them) runs the model's *own* forward on each stage
(:func:`decoder_stage_forward`), on the microbatch's token ids. Each stage is built once from the pipeline's plan
(:func:`meshpar.pipeline.split.build_stage`: the layers and modules it owns, original FQNs) and set up once for that
forward (:class:`_StageRuntime`): its layer list is seen at the model's full depth, its own layers at their global
indices and a parameter-free pass-through at every other, so per-layer data the forward reads by index or from each
layer (``config.layer_types[i]``, ``layer.attention_type``) stays right; a later stage gets shape-only stand-ins for
the first stage's modules that hold parameters, so masks, positions, rotary tables and token-id routing are the
model's own, built with the user's attention implementation; an earlier stage gets stand-ins for the last stage's.
What a stage's layers are handed that the stage cannot compute itself (:class:`Carried`, read off one dense forward
with grads) crosses from the stage before: the hidden states (any shape: DeepSeek-V4's residual streams, Gemma-3n's
altup stack) and other loop state into a stage's first layer, and per-layer inputs computed before the layers
(Gemma's) from the first stage to their layer's; one pre-hook per owned layer, installed once, hands them over. A
non-first stage writes them into its own tensors, so loop code between layers that reads them (Inkling2 stacks the
hidden states it handed a layer) sees them too. Per call only the boundary changes (what was received, what is sent);
a non-last stage runs the base model's forward to its end on pass-throughs and stand-ins (no exception cuts it short)
and sends what its first pass-through after its own layers was handed; the last stage runs the model class's own
forward to the logits. :func:`check_stage_composition` builds the planned stages exactly so, one at a time, and
proves on the dense model that run one after another they reproduce its forward; what it cannot prove (layers that
share state outside their arguments) is refused.

GPT-2 and BERT ship no pipeline plan: meshpar's tables (:data:`PIPELINE_TABLES`, :data:`PIPELINE_PLAN_BUILDERS`)
give theirs in transformers' format.
Encoder-decoders (:func:`encoder_decoder_layout`) run the same way with their two layer lists numbered as one (the
decoder's after the encoder's): the encoder's output and T5's position bias are loop state the decoder's layers are
handed, the decoder's embedded inputs a per-layer input of its first layer computed on the first stage, and the
encoder's final norm runs on the encoder's last stage (apex's split rank: ``plan_encoder_decoder_stages`` in
:mod:`meshpar.pipeline.split`). A stand-in for a layer returns what the next layer is handed from its output (T5's
blocks hand on their position bias) as it was handed it.
Under sequence parallelism the hidden states cross stages as this rank's sequence shard (the first layer's style
splits them on the first stage, the final norm's gathers them on the last); models whose layers are handed more are
refused there.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshpar._compat import tree_flatten, tree_map_only
from meshpar._in_place import mix_into
from meshpar.hf.hf_plan import (
    base_model_name,
    dense_probe,
    ends_with_eos,
    eval_mode,
    folds_choices,
    layer_container,
    text_config,
)
from meshpar.pipeline.split import StagePlan, build_stage, plan_stages

_log = logging.getLogger(__name__)

# meshpar's pipeline plans, in the format of transformers' ``base_model_pp_plan`` (base-model children in run order,
# each with what it takes and gives), for families whose config ships none: GPT-2, and BERT and RoBERTa, whose layer
# list sits inside their encoder (a dotted name)
PIPELINE_TABLES: dict[str, dict[str, tuple[list[str], list[str]]]] = {
    "gpt2": {
        "wte": (["input_ids"], ["inputs_embeds"]),
        "wpe": (["position_ids"], ["position_embeds"]),
        "drop": (["hidden_states"], ["hidden_states"]),
        "h": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "ln_f": (["hidden_states"], ["hidden_states"]),
    },
    "distilbert": {
        "embeddings": (["input_ids"], ["hidden_states"]),
        "transformer.layer": (["hidden_states", "attention_mask"], ["hidden_states"]),
    },
}


def _bert_pipeline_plan(base: nn.Module) -> dict[str, tuple[list[str], list[str]]]:
    """BERT's (RoBERTa's modules are BERT's): embeddings, the layers inside the encoder, and the pooler after them
    where the head class has one (sequence classification); ELECTRA's adds the projection from a narrower
    embedding into the layers where it has one."""
    plan = {"embeddings": (["input_ids"], ["hidden_states"])}
    if _child(base, "embeddings_project") is not None:
        plan["embeddings_project"] = (["hidden_states"], ["hidden_states"])
    plan["encoder.layer"] = (["hidden_states", "attention_mask"], ["hidden_states"])
    if _child(base, "pooler") is not None:
        plan["pooler"] = (["hidden_states"], ["pooled_output"])
    return plan


# plans that depend on the modules the base model holds (which the head class decides), in the same format
PIPELINE_PLAN_BUILDERS: dict[str, Callable[[nn.Module], dict[str, tuple[list[str], list[str]]]]] = {
    family: _bert_pipeline_plan for family in ("bert", "roberta", "xlm-roberta", "camembert", "electra")
}


# where a layer's argument sits in its call: an index into the positional arguments, or a keyword's name
ArgPosition = int | str


@dataclass(frozen=True)
class Carried:
    """A tensor argument of a layer call that a stage cannot compute itself and receives from the stage before."""

    position: ArgPosition
    # True: the layers before compute it (the hidden states; Inkling2's block states), so it crosses into a stage's
    # first layer only and the stage's own layers carry it on. False: the forward computes it before the layers for
    # this one layer (Gemma's per-layer inputs), so the first stage computes it and it travels to its layer's stage.
    loop_state: bool


_STREAM = (Carried(0, True),)  # the hidden states alone, handed to each layer first


def tensors_crossing(layout: PipelineLayout, plan: StagePlan) -> list[int]:
    """How many tensors each stage boundary carries (one per boundary, in order): the loop state the next stage's
    first layer is handed, and every per-layer input a later stage's layer needs (computed on the first stage, it
    travels stage to stage). A layout read off no dense forward (built on meta) counts the hidden states alone."""
    if not layout.carried or plan.later_containers:
        return [1] * (plan.num_stages - 1)
    stage_of = {int(key): stage for stage, keys in enumerate(plan.stage_layers) for key in keys}
    counts = []
    for stage in range(plan.num_stages - 1):
        owned = [int(key) for key in plan.stage_layers[stage + 1]]
        loop = sum(1 for carried in layout.carried[min(owned)] if carried.loop_state) if owned else 1
        later = sum(
            1
            for layer, calls in enumerate(layout.carried)
            for carried in calls
            if not carried.loop_state and stage_of.get(layer, 0) > stage
        )
        counts.append(loop + later)
    return counts


@dataclass(frozen=True)
class PipelineLayout:
    """Where a causal LM's pieces are, from transformers' pipeline plan (full FQNs)."""

    container: str  # the transformer-layer list, e.g. "model.layers"
    # plan entries that run before the layers (embedding, dropout): those holding parameters live on the first stage,
    # later stages run shape-only stand-ins for them
    before: tuple[str, ...]
    after: tuple[str, ...]  # plan entries after them: last stage only (final norm)
    keep: tuple[str, ...]  # parameter-free base-model modules every stage needs (rotary embeddings)
    base: str  # the base model, whose forward non-last stages run
    num_layers: int
    # each layer's plain attributes (attention_type, block_type, ...): a forward may read them from every layer
    layer_attributes: tuple[tuple[tuple[str, object], ...], ...]
    # layers return a tuple of this length (hidden states first; GLM-MoE-DSA's layers add their top-k indices), so
    # stand-ins do too (with ``None`` after the hidden states); 0: a tensor
    layer_returns: int = 0
    # per layer, the arguments that cross stage boundaries (see Carried), read off a dense forward; empty: the
    # hidden states alone (a model on meta cannot run)
    carried: tuple[tuple[Carried, ...], ...] = ()
    # shape-only stand-ins for the modules of ``before`` that hold parameters, and for every module of ``after``:
    # later stages run the forward's steps before the layers too (masks, positions, what the layers are handed),
    # earlier ones the steps after them (on values nothing uses), without those modules' weights
    stand_ins: Mapping[str, nn.Module] = field(default_factory=dict, compare=False, repr=False)
    # for each returned slot after the hidden states, the argument of the next layer it becomes (T5's blocks return
    # the position bias the next one is handed), which a stand-in for a layer returns as it was handed; None: None
    handed_on: tuple[ArgPosition | None, ...] = ()
    # an encoder-decoder's further layer lists after ``container`` (the decoder's, with its length): layers are
    # numbered across all lists in run order (``num_layers`` counts them all)
    later_lists: tuple[tuple[str, int], ...] = ()
    # modules run between two lists that finish the list before (an encoder's final norm): on the stage holding that
    # list's last layer, stand-ins elsewhere
    middle: tuple[str, ...] = ()

    def carried_into(self, layer: int) -> tuple[Carried, ...]:
        return self.carried[layer] if self.carried else _STREAM

    def layer_lists(self) -> list[tuple[str, int, int]]:
        """(FQN, index of its first layer, length) of every layer list, in run order."""
        first = self.num_layers - sum(length for _, length in self.later_lists)
        lists, start = [(self.container, 0, first)], first
        for fqn, length in self.later_lists:
            lists.append((fqn, start, length))
            start += length
        return lists

    def stage_sides(self, model: nn.Module) -> tuple[list[str], list[str]]:
        """(first stage's, last stage's) modules of this layout that hold parameters, for the splitter."""
        holding = [n for n in (*self.before, *self.after) if _holds_parameters(model, n)]
        return [n for n in holding if n in self.before], [n for n in holding if n in self.after]


def head_modules(model: nn.Module, base: str) -> list[str]:
    """The model's children outside its base model that hold parameters (LM head, classifier): they run after the
    base model, so on the last stage, wherever the model registers them (XLM-R's head comes before its base). None
    where the model is its own base model (T5): its head is a piece of its layout."""
    if not base:
        return []
    return [n for n, m in model.named_children() if n != base and any(True for _ in m.parameters())]


def _holds_parameters(module: nn.Module, name: str) -> bool:
    return any(True for _ in module.get_submodule(name).parameters())


def _child(base: nn.Module, name: str) -> nn.Module | None:
    """``base``'s module ``name`` (dotted for one deeper: BERT's ``encoder.layer``), or ``None``."""
    try:
        return base.get_submodule(name)
    except AttributeError:
        return None


def pipeline_layout(model: nn.Module) -> PipelineLayout | None:
    """The layout from transformers' ``base_model_pp_plan`` (or meshpar's table for a family that ships none);
    ``None`` without either. Raises when the plan does not describe the model (it names modules the model lacks, or
    a base-model module outside the plan holds parameters)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    shipped = getattr(config, "base_model_pp_plan", None) or PIPELINE_TABLES.get(model_type)
    prefix = base_model_name(model)
    if not shipped and model_type in PIPELINE_PLAN_BUILDERS and prefix:
        shipped = PIPELINE_PLAN_BUILDERS[model_type](model.get_submodule(prefix))
    plan = list(dict(shipped or {}))
    if plan and prefix:
        base = model.get_submodule(prefix)
        missing = [n for n in plan if _child(base, n) is None]
        if missing:
            raise ValueError(
                f"{type(model).__name__}: the pipeline plan {plan} names {missing}, which "
                f"{type(base).__name__} does not have (its children: {[n for n, _ in base.named_children()]}): the "
                "plan does not describe this model, so pipeline parallelism cannot place its layers (use "
                "pipeline_parallel_size 1)"
            )
    return _layout(model, plan) if plan else None


def _layer_holder(base: nn.Module, prefix: str) -> str:
    """FQN of the module whose children are the layer list and its neighbours: the base model, or the one module
    it wraps (OPT's ``model.decoder``)."""
    holder, path = base, prefix
    while True:
        holding = [(n, m) for n, m in holder.named_children() if _holds_parameters(holder, n)]
        if len(holding) != 1 or any(isinstance(m, nn.ModuleList) for _, m in holding):
            return path
        name, holder = holding[0]
        path = f"{path}.{name}"


def _layer_list(model: nn.Module, holder: nn.Module) -> str | None:
    """The child of ``holder`` that is the layer list: its one list holding parameters, or, among several (Gemma-3n
    also keeps its altup projections in lists), the one of the model's unsplittable block classes."""
    lists = [n for n, m in holder.named_children() if isinstance(m, nn.ModuleList) and _holds_parameters(holder, n)]
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    if len(lists) > 1:
        lists = [n for n in lists if any(type(m).__name__ in blocks for m in holder.get_submodule(n))]
    return lists[0] if len(lists) == 1 else None


def _run_order(model: nn.Module, holder: nn.Module) -> list[str]:
    """Every call of a child of ``holder`` (a list: its first element's) in order, in the dense model's forward on a
    tiny batch: registration order need not be run order.
    A model on meta cannot run: its registration order (nothing proves that guess, so :mod:`meshpar.hf.parallelize`
    refuses it)."""
    if any(p.is_meta for p in model.parameters()):
        return [name for name, _ in holder.named_children()]
    calls_seen: list[str] = []
    handles = []
    for name, child in holder.named_children():
        calls = child[0] if isinstance(child, nn.ModuleList) and len(child) > 0 else child
        handles.append(calls.register_forward_pre_hook(lambda *_, n=name: calls_seen.append(n)))
    _probe_with_hooks(model, handles)
    return calls_seen


def _probe_with_hooks(
    model: nn.Module, handles: Sequence[torch.utils.hooks.RemovableHandle], grad: bool = False
) -> None:
    """One dense forward (:func:`dense_probe`) with the hooks of ``handles`` installed, removed after it."""
    try:
        with dense_probe(model, grad=grad) as (forward, _):
            forward()
    finally:
        for handle in handles:
            handle.remove()


def _argument(args: Sequence[object], kwargs: Mapping[str, object], position: ArgPosition) -> object:
    return args[position] if isinstance(position, int) else kwargs[position]


def block_lists(model: nn.Module) -> list[str]:
    """FQNs of every list of the model's unsplittable blocks (its transformer layers), wherever they are."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and any(type(m).__name__ in blocks for m in module)
    ]


@dataclass(frozen=True)
class _LayerCalls:
    """What one dense forward with grads shows about the layers' calls."""

    carried: tuple[tuple[Carried, ...], ...]
    returns: int  # see PipelineLayout.layer_returns
    handed_on: tuple[ArgPosition | None, ...] = ()  # see PipelineLayout.handed_on


def _layer_calls(model: nn.Module, containers: str | Sequence[str]) -> _LayerCalls:
    """Per layer of ``containers`` (one list, or an encoder-decoder's lists in run order, numbered across them), the
    tensor arguments of its call computed with grads (the hidden states always, first), each marked loop state when
    it depends on what an earlier layer returned (the hidden states always, except into the first layer of a later
    list: the decoder's are computed before its layers). Arguments without grads (masks, positions, rotary tables,
    token ids) every stage computes itself; parameters handed to layers (leaves) live where they are."""
    lists = [containers] if isinstance(containers, str) else list(containers)
    layers = [layer for fqn in lists for layer in model.get_submodule(fqn)]
    later_firsts = set(itertools.accumulate(len(model.get_submodule(fqn)) for fqn in lists[:-1]))
    seen: dict[int, list[tuple[ArgPosition, torch.Tensor]]] = {}
    handed: dict[int, tuple[tuple[object, ...], dict[str, object]]] = {}
    returned: dict[int, object] = {}
    outputs: list[torch.Tensor] = []

    def carries(value: object) -> bool:
        return isinstance(value, torch.Tensor) and value.grad_fn is not None

    def record(layer: int, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        stream: ArgPosition = 0 if args else "hidden_states"
        found = [(stream, _argument(args, kwargs, stream))]
        found += [(i, a) for i, a in enumerate(args) if i and carries(a)]
        found += [(k, v) for k, v in kwargs.items() if k != stream and carries(v)]
        seen.setdefault(layer, found)
        handed.setdefault(layer, (args, kwargs))

    def output(layer: int, out: object) -> None:
        returned.setdefault(layer, out)
        outputs.extend(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda _m, a, k, i=index: record(i, a, k), with_kwargs=True))
        handles.append(layer.register_forward_hook(lambda _m, _a, out, i=index: output(i, out)))
    _probe_with_hooks(model, handles, grad=True)
    from_layers = _GraphReach({t.grad_fn for t in outputs if t.grad_fn is not None})
    carried = tuple(
        tuple(
            Carried(pos, (pos in (0, "hidden_states") and i not in later_firsts) or from_layers(t))
            for pos, t in seen.get(i, [(0, None)])
        )
        for i in range(len(layers))
    )
    returns = max((len(out) if isinstance(out, tuple) else 0 for out in returned.values()), default=0)
    return _LayerCalls(carried, returns, _handed_on(returned, handed, later_firsts, returns))


def _handed_on(
    returned: Mapping[int, object],
    handed: Mapping[int, tuple[tuple[object, ...], dict[str, object]]],
    later_firsts: set[int],
    returns: int,
) -> tuple[ArgPosition | None, ...]:
    """For each returned slot after the hidden states, the argument of the next layer (of the same list) that is
    the very tensor a layer returned there, as a dense forward shows it; None where none is."""
    found: list[ArgPosition | None] = [None] * max(returns - 1, 0)
    for layer, out in returned.items():
        following = handed.get(layer + 1)
        if not isinstance(out, tuple) or following is None or layer + 1 in later_firsts:
            continue
        args, kwargs = following
        positions = [*((i, a) for i, a in enumerate(args) if i), *kwargs.items()]
        for slot, value in enumerate(out[1:]):
            if found[slot] is None and isinstance(value, torch.Tensor):
                found[slot] = next((p for p, a in positions if a is value and p != "hidden_states"), None)
    return tuple(found)


class _GraphReach:
    """Whether a tensor's autograd graph reaches one of ``targets`` (the grad nodes of layer outputs); nodes found
    not to reach them are remembered across queries."""

    def __init__(self, targets: set[object]) -> None:
        self.targets, self.cleared = targets, set()

    def __call__(self, tensor: torch.Tensor | None) -> bool:
        if tensor is None or tensor.grad_fn is None:
            return False
        stack, seen = [tensor.grad_fn], set()
        while stack:
            node = stack.pop()
            if node in self.targets:
                return True
            if node in seen or node in self.cleared:
                continue
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions if n is not None)
        self.cleared |= seen
        return False


def inferred_pipeline_layout(model: nn.Module) -> PipelineLayout | None:
    """For a causal LM without transformers' pipeline plan: the plan read from the module holding its layer list
    (the base model, or the single module it wraps): the list and the children holding parameters, in the order a
    forward of the dense model calls them; ``None`` when there is no layer list. Only a guess until
    :func:`check_stage_composition` proves it on the dense model."""
    prefix = base_model_name(model)
    if not prefix:
        return None
    holder_path = _layer_holder(model.get_submodule(prefix), prefix)
    holder = model.get_submodule(holder_path)
    layer_list = _layer_list(model, holder)
    if layer_list is None:
        return None
    # parameter-free children (rotary tables) run on every stage, as they are
    order = [n for n in dict.fromkeys(_run_order(model, holder)) if n == layer_list or _holds_parameters(holder, n)]
    if layer_list not in order:
        return None
    return _layout(model, order, holder_path, layer_list)


def encoder_decoder_layout(model: nn.Module) -> PipelineLayout:
    """The layout of an encoder-decoder (T5, BART and their kin): its two layer lists in run order (numbered across
    both: the decoder's after the encoder's) and every other module holding parameters placed by when a dense forward
    first calls it: before the encoder's layers (the embeddings) on the first stage; between the two lists, the
    encoder's own modules (its final norm) on the encoder's last stage, which sends the encoder's output on, and the
    rest (the decoder's embedding and positions) on the first stage too, whose output travels to the decoder's first
    stage as a per-layer input (so a shared embedding lives on one stage); after the decoder's layers on the last
    stage. Raises for a model this cannot describe; :func:`check_stage_composition` proves the rest."""
    name = type(model).__name__
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"{name}: meshpar reads an encoder-decoder's pipeline layout off a dense forward, which a model built on "
            "meta cannot run; build it on cpu, or use pipeline_parallel_size 1"
        )
    # the lists of its unsplittable blocks, or (a family that names none: Blenderbot) its lists of modules
    lists = block_lists(model) or [
        fqn
        for fqn, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1
        and any(True for _ in module.parameters())
    ]  # fmt: skip
    if len(lists) != 2:
        raise ValueError(
            f"{name}: an encoder-decoder pipeline needs one layer list per stack, found {lists}; use "
            "pipeline_parallel_size 1"
        )
    base_path = base_model_name(model)
    base = model.get_submodule(base_path) if base_path else model
    pieces = _pieces_beside(base, base_path, lists)
    regions, lists = _regions(model, pieces, lists)
    encoder_holder = lists[0].rpartition(".")[0]
    before, middle, after, keep = [], [], [], []
    for fqn in pieces:
        region = regions.get(fqn, _tied_region(model, fqn, regions))
        if not _holds_parameters(model, fqn):
            keep.append(fqn)
        elif region == "inside":
            raise ValueError(
                f"{name}: {fqn} holds parameters but its forward calls it among a stack's layers, so no pipeline "
                "stage can own it; use pipeline_parallel_size 1"
            )
        elif region is None or region == 0 or (region == 1 and not fqn.startswith(f"{encoder_holder}.")):
            # never called (BART's ``shared`` when the stacks' embeddings are untied from it: no grad in the dense
            # model either): kept with the embeddings
            before.append(fqn)
        elif region == 1:
            middle.append(fqn)
        else:
            after.append(fqn)
    calls = _layer_calls(model, lists)
    every_layer = [layer for fqn in lists for layer in model.get_submodule(fqn)]
    return PipelineLayout(
        container=lists[0],
        before=tuple(before),
        after=tuple(after),
        keep=tuple(keep),
        base=base_path,
        num_layers=len(every_layer),
        layer_attributes=tuple(_plain_attributes(layer) for layer in every_layer),
        layer_returns=calls.returns,
        carried=calls.carried,
        stand_ins={f: _shape_only(model.get_submodule(f)) for f in (*before, *middle, *after)},
        handed_on=calls.handed_on,
        later_lists=((lists[1], len(model.get_submodule(lists[1]))),),
        middle=tuple(middle),
    )


def _tied_region(model: nn.Module, fqn: str, regions: Mapping[str, object]) -> object:
    """For a module the forward never calls whose parameters are all those of modules it does call (BART's
    ``shared`` embedding, tied to both stacks' ``embed_tokens``): the earliest of their regions; else None."""
    own = {id(p) for p in model.get_submodule(fqn).parameters()}
    found = [
        region
        for other, region in regions.items()
        if isinstance(region, int) and own and own <= {id(p) for p in model.get_submodule(other).parameters()}
    ]
    return min(found, default=None)


def _pieces_beside(base: nn.Module, path: str, lists: Sequence[str]) -> list[str]:
    """FQNs of the modules beside the layer lists: every child of a module on the way from the base model to a list
    that is neither a list nor on the way to one (the shared embedding, each stack's embeddings and norms)."""
    found = []
    for name, child in base.named_children():
        fqn = f"{path}.{name}" if path else name
        if fqn in lists:
            continue
        if any(layers.startswith(f"{fqn}.") for layers in lists):
            found += _pieces_beside(child, fqn, lists)
        else:
            found.append(fqn)
    return found


def _regions(model: nn.Module, pieces: Sequence[str], lists: Sequence[str]) -> tuple[dict[str, object], list[str]]:
    """When a dense forward first calls each piece (a module may be reached by several names: the shared embedding):
    0 before the first list's layers, 1 between the lists, 2 after both, "inside" among a list's layers, absent when
    never; and the lists in the order the forward runs them."""
    events: list[tuple[str, object]] = []
    handles = []
    for fqn in lists:
        layers = model.get_submodule(fqn)
        if len(layers) == 0:
            raise ValueError(f"{type(model).__name__}: its layer list {fqn} is empty")
        handles.append(layers[0].register_forward_pre_hook(lambda *_, f=fqn: events.append(("start", f))))
        handles.append(layers[-1].register_forward_hook(lambda *_, f=fqn: events.append(("end", f))))
    by_module: dict[int, list[str]] = {}
    for fqn in pieces:
        by_module.setdefault(id(model.get_submodule(fqn)), []).append(fqn)
    for fqn in pieces:
        module = model.get_submodule(fqn)
        if by_module[id(module)][0] == fqn:
            handles.append(module.register_forward_pre_hook(lambda m, *_: events.append(("piece", id(m)))))
    _probe_with_hooks(model, handles)
    order = list(dict.fromkeys(f for kind, f in events if kind == "start"))
    if sorted(order) != sorted(lists):
        raise ValueError(f"{type(model).__name__}: a dense forward runs the layer lists {order}, not {list(lists)}")
    regions: dict[str, object] = {}
    done, running = 0, False
    for kind, what in events:
        if kind == "start":
            running = True
        elif kind == "end":
            running, done = False, done + 1
        else:
            for fqn in by_module[what]:
                regions.setdefault(fqn, "inside" if running else done)
    return regions, order


def _layout(
    model: nn.Module, names: list[str], holder_path: str | None = None, layer_list: str | None = None
) -> PipelineLayout | None:
    """The layout of ``names`` (modules of ``holder_path``, the base model by default, in run order; ``layer_list``
    among them, by default their one list); ``None`` for a model without a head (an LM head or a classifier outside
    the base model: the last stage's output comes from it)."""
    prefix = base_model_name(model)
    if not prefix or (model.get_output_embeddings() is None and not head_modules(model, prefix)):
        return None
    holder_path = holder_path or prefix
    base = model.get_submodule(holder_path)
    if layer_list is None:
        lists = [name for name in names if isinstance(_child(base, name), nn.ModuleList)]
        if len(lists) != 1:
            return None
        layer_list = lists[0]
    index = names.index(layer_list)
    others = [n for n, _ in base.named_children() if n not in names and not any(x.startswith(f"{n}.") for x in names)]
    holding = [n for n in others if _holds_parameters(base, n)]
    if holding:
        raise ValueError(
            f"{type(model).__name__}: the pipeline plan {names} leaves out {holding}, which hold "
            "parameters; pipeline parallelism cannot place them (use pipeline_parallel_size 1)"
        )
    full = [f"{holder_path}.{n}" for n in names]
    # parameter-free plan pieces (dropouts) run on every stage, as the steps before the layers do
    free = [f for f, n in zip(full, names, strict=True) if n != layer_list and not _holds_parameters(base, n)]
    container = full[index]
    calls = None if any(p.is_meta for p in model.parameters()) else _layer_calls(model, container)
    return PipelineLayout(
        container=container,
        before=tuple(full[:index]),
        after=tuple(full[index + 1 :]),
        keep=tuple(f"{holder_path}.{n}" for n in others) + tuple(free),
        base=prefix,
        num_layers=len(base.get_submodule(layer_list)),
        layer_attributes=tuple(_plain_attributes(layer) for layer in base.get_submodule(layer_list)),
        layer_returns=calls.returns if calls else 0,
        carried=calls.carried if calls else (),
        handed_on=calls.handed_on if calls else (),
        stand_ins={
            f: _shape_only(model.get_submodule(f))
            for i, f in enumerate(full)
            if i > index or (i < index and _holds_parameters(model, f))
        },
    )


def _plain_attributes(module: nn.Module) -> tuple[tuple[str, object], ...]:
    """A layer's plain attributes, its class's included (Inkling2 sets ``attention_type`` on the class)."""
    plain = (str, int, float, bool, type(None))
    found: dict[str, object] = {}
    for owner in (*reversed(type(module).__mro__), module):
        if owner in nn.Module.__mro__:
            continue
        found.update((k, v) for k, v in vars(owner).items() if not k.startswith("_") and isinstance(v, plain))
    found.pop("training", None)
    return tuple(found.items())


def _meta_copy(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer on meta, without copying their data."""
    memo: dict[int, object] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _shape_only(module: nn.Module) -> nn.Module:
    """A stand-in for ``module`` on stages that do not hold it (lists stay lists of stand-ins)."""
    if isinstance(module, nn.ModuleList):
        return nn.ModuleList(_shape_only(m) for m in module)
    if isinstance(module, nn.ModuleDict):
        return nn.ModuleDict({k: _shape_only(m) for k, m in module.items()})
    return _ShapeOnly(module)


class _ShapeOnly(nn.Module):
    """Stands in for a first-stage module (an embedding, a per-layer-input projection) on later stages: its output
    only feeds what the stage replaces with received tensors, so zeros of the right shape and dtype do; a copy of the
    module on meta gives them, and the attributes the forward reads (an embedding's scale; its weight's device,
    where Llama-4 moves the ids: tensors read are zeros on the stage's device that take no memory)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_meta", _meta_copy(module))  # not a submodule: the stage holds no extra parameters
        self.on: torch.device | None = None  # the stage's device, set for each run

    def forward(self, *args: object, **kwargs: object) -> object:
        on_meta = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        with torch.no_grad():
            shapes = self._meta(*on_meta[0], **on_meta[1])
        return tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=self.on), shapes)

    def __getattr__(self, name: str) -> object:
        try:
            return super().__getattr__(name)
        except AttributeError:
            value = getattr(self._meta, name)
        if isinstance(value, torch.Tensor):
            return torch.zeros((), dtype=value.dtype, device=self.on).expand(value.shape)
        return value


def _present(model: nn.Module, fqn: str) -> bool:
    """Whether this stage holds the module ``fqn`` (the splitter sets the pieces of other stages to ``None``)."""
    parent, _, name = fqn.rpartition(".")
    return (model.get_submodule(parent) if parent else model)._modules.get(name) is not None


class _Boundary:
    """What one run of a stage receives and sends. Carried tensors (see :class:`Carried`) cross as the tensors of
    one message (the runtime sends a tuple per microbatch, each tensor in its own shape and dtype): the loop state
    handed to the next stage's first layer, then the per-layer arguments of every later layer in call order. The
    receiver takes them in that order and checks each against the shape its own forward gives the same argument (it
    runs the steps before the layers too, on stand-ins). With nothing but the hidden states to carry, they cross
    alone."""

    def __init__(
        self,
        layout: PipelineLayout,
        owned: Sequence[int],
        received: torch.Tensor | Sequence[torch.Tensor] | None,
        sequence_shards: int = 1,
    ) -> None:
        self.layout = layout
        self.sequence_shards = sequence_shards  # tp under sequence parallelism: the hidden states cross as shards
        self.start, self.stop = min(owned), max(owned) + 1
        self.received: tuple[torch.Tensor, ...] | None = (
            None if received is None else (received,) if isinstance(received, torch.Tensor) else tuple(received)
        )
        self.taken = 0
        self.sent: list[torch.Tensor] = []
        self.rest: tuple[torch.Tensor, ...] = ()  # per-layer arguments received for later stages, handed on
        self.reached_stop = False  # the forward called the first layer after this stage's: ``sent`` is complete

    def _take(self, like: object, what: str) -> torch.Tensor:
        """The next received tensor, checked against ``like`` (what this stage's own forward gives the same
        argument); ``like`` None: the stage has nothing to check against (T5's position bias, which the stand-ins
        for earlier layers hand on as they were handed it: none)."""
        piece = self.received[self.taken] if self.taken < len(self.received) else None
        if like is None and piece is not None:
            self.taken += 1
            return piece
        if not isinstance(like, torch.Tensor) or piece is None or piece.shape != like.shape:
            got = "nothing" if piece is None else f"a tensor of shape {list(piece.shape)}"
            raise RuntimeError(
                f"pipeline stage: {what} (shape {list(getattr(like, 'shape', []))}) does not match what the previous "
                f"stage sent ({got})"
            )
        self.taken += 1
        return piece if piece.dtype == like.dtype else piece.to(like.dtype)

    def feed(self, layer: int, args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[tuple, dict] | None:
        """Pre-hook of an owned layer: its carried arguments get the received values (loop state: first layer only).
        Written into the stage's own tensor where it can be (it was computed from stand-ins and holds no grad), so
        the forward's variable holds them too: loop code between layers reads it (Inkling2 stacks the hidden states
        it handed a layer); replaced in the call otherwise."""
        if self.received is None:
            return None
        new_args, new_kwargs = list(args), dict(kwargs)
        carried = self.layout.carried_into(layer)
        for entry in [c for c in carried if c.loop_state and layer == self.start] + [
            c for c in carried if not c.loop_state
        ]:
            local = _argument(new_args, new_kwargs, entry.position)
            # under sequence parallelism: this rank's sequence shard of the stage's full-length tensor
            if self.sequence_shards > 1 and local is not None:
                shape = list(local.shape)
                shape[1] //= self.sequence_shards
                local = torch.empty(shape, dtype=local.dtype, device="meta")
            value = self._take(local, f"layer {layer}'s argument {entry.position!r}")
            if local is not None and not local.requires_grad and not local.is_meta:
                try:
                    local.copy_(value)
                    continue
                except RuntimeError:  # overlapping memory (an expanded view), an inference tensor
                    pass
            if isinstance(entry.position, int):
                new_args[entry.position] = value
            else:
                new_kwargs[entry.position] = value
        return tuple(new_args), new_kwargs

    def passed(self, layer: int, args: tuple[object, ...], kwargs: dict[str, object], hidden: object) -> object:
        """A layer this stage does not own was called with ``hidden``: the first one after its layers gets the loop
        state to send; the first stage also sends the per-layer arguments of every later one. Returns what the
        pass-through hands on: ``hidden``, except that under sequence parallelism the first one after this stage's
        layers hands on zeros of the full sequence, since all that follows on this stage (pass-throughs, stand-ins
        for the final modules, the forward's reshapes to the input's shape) needs only the dense shape."""
        if layer < self.stop:
            return hidden
        carried = self.layout.carried_into(layer)
        if layer == self.stop:
            self.sent += [_argument(args, kwargs, c.position) for c in carried if c.loop_state]
            if self.received is not None:
                self.rest, self.taken = self.received[self.taken :], len(self.received)
        if self.received is None:
            self.sent += [_argument(args, kwargs, c.position) for c in carried if not c.loop_state]
        self.reached_stop = True
        if layer == self.stop and self.sequence_shards > 1 and isinstance(hidden, torch.Tensor):
            shape = list(hidden.shape)
            shape[1] *= self.sequence_shards
            return hidden.new_zeros(shape)
        return hidden

    def output(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What crosses to the next stage: the hidden states alone, or every carried tensor in order."""
        pieces = (*self.sent, *self.rest)
        return pieces[0] if len(pieces) == 1 else pieces

    def check_used(self) -> None:
        if self.received is not None and self.taken != len(self.received):
            raise RuntimeError(
                f"pipeline stage: {len(self.received) - self.taken} received tensors were not used by its layers"
            )


class _PassThrough(nn.Module):
    """Stands in for a layer another stage owns: hands its hidden states on unchanged, tells this call's boundary it
    was called, and carries that layer's plain attributes (a forward may read ``layer.attention_type`` of every
    layer to pick its mask). Built once per stage; holds no parameters."""

    def __init__(self, index: int, runtime: _StageRuntime, layout: PipelineLayout):
        super().__init__()
        for name, value in layout.layer_attributes[index]:
            setattr(self, name, value)
        self._index, self._returns = index, layout.layer_returns
        self._handed_on = (*layout.handed_on, *(None,) * (self._returns - 1 - len(layout.handed_on)))
        object.__setattr__(self, "_runtime", runtime)  # not a submodule

    def forward(self, *args: object, **kwargs: object) -> object:
        hidden = _argument(args, kwargs, 0 if args else "hidden_states")
        hidden = self._runtime.boundary.passed(self._index, args, kwargs, hidden)
        if not self._returns:
            return hidden
        rest = [None if p is None else _argument_or_none(args, kwargs, p) for p in self._handed_on]
        return (hidden, *rest)


def _argument_or_none(args: Sequence[object], kwargs: Mapping[str, object], position: ArgPosition) -> object:
    if isinstance(position, int):
        return args[position] if position < len(args) else None
    return kwargs.get(position)


class _FullDepthLayers:
    """Mixed into a stage's layer container (:class:`meshpar.pipeline.split.PipelineLayers`, which registers only
    the stage's own layers, under their global indices): iterating, indexing and ``len`` see the model's full depth,
    the stage's layers at their indices and a :class:`_PassThrough` at every other, so the model's own forward loops
    over every layer index as in the dense model. State dict, parameters and submodules stay the stage's own."""

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._meshpar_depth)

    def __len__(self) -> int:
        return len(self._meshpar_depth)

    def __getitem__(self, index: object) -> object:
        if isinstance(index, slice):
            return list(self._meshpar_depth[index])
        if isinstance(index, int):
            return self._meshpar_depth[index]
        return super().__getitem__(index)  # type: ignore[misc]


class _StageRuntime:
    """What a built stage needs to run the model's own forward, set up once (at its first call: after the recipe
    sharded, wrapped or compiled its modules): shape-only stand-ins where a later stage lacks the first stage's
    modules or an earlier stage the last stage's, the layer list seen at full depth, and one pre-hook per owned layer
    that hands it what was received. Per call only :attr:`boundary` changes: what this call received and sends."""

    def __init__(self, stage: nn.Module, layout: PipelineLayout, last: bool, device: torch.device) -> None:
        self.boundary: _Boundary | None = None
        self.owned: dict[int, nn.Module] = {}
        self.first = all(_present(stage, name) for name in layout.before)
        for fqn, stand_in in layout.stand_ins.items():
            elsewhere = fqn in layout.middle and not _present(stage, fqn)
            if elsewhere or (fqn in layout.before and not self.first) or (fqn in layout.after and not last):
                for shape_only in stand_in.modules():
                    if isinstance(shape_only, _ShapeOnly):
                        shape_only.on = device
                _set_module(stage, fqn, stand_in)
        for fqn, start, length in layout.layer_lists():
            container = stage.get_submodule(fqn)
            mine = {start + int(key): layer for key, layer in container._modules.items()}
            self.owned |= mine
            depth = [mine.get(i) or _PassThrough(i, self, layout) for i in range(start, start + length)]
            object.__setattr__(container, "_meshpar_depth", depth)
            mix_into(container, _FullDepthLayers, "FullDepth")
        for index, layer in self.owned.items():
            # first among the pre-hooks: FSDP's may cast the inputs it is handed
            layer.register_forward_pre_hook(
                lambda _m, a, k, i=index: self.boundary.feed(i, a, k), with_kwargs=True, prepend=True
            )


def _set_module(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    (model.get_submodule(parent) if parent else model)._modules[name] = module


def head_output(output: object) -> torch.Tensor:
    """What a model's head hands the loss, as one tensor: its ``logits``, or a question-answering head's start and
    end scores stacked on a last dim (``[batch, seq, 2]``)."""
    logits = getattr(output, "logits", None)
    if logits is not None:
        return logits
    start, end = getattr(output, "start_logits", None), getattr(output, "end_logits", None)
    if start is not None and end is not None:
        return torch.stack([start, end], -1)
    raise ValueError(f"{type(output).__name__} holds neither logits nor start / end logits")


def _run_stage(
    stage: nn.Module,
    runtime: _StageRuntime,
    layout: PipelineLayout,
    last: bool,
    received: torch.Tensor | None,
    inputs: dict[str, object],
    sequence_shards: int,
    whole_output: bool = False,
) -> Any:
    """One call of a built stage: the model's own forward on the microbatch's ids (masks, positions and rotary
    tables are the model's own, for the full sequence); a non-first stage's layers take the tensors ``received``
    from the previous stage (under sequence parallelism the hidden states' sequence shard: the first layer's style
    split them, the last stage's final norm gathers them). The last stage runs the model class's own forward to the
    logits (``whole_output``: to what that forward returns); the others run the base model's forward to its end
    (the later stages' layers are pass-throughs, their final modules shape-only stand-ins) and send what the
    pass-through after their last layer was handed."""
    runtime.boundary = boundary = _Boundary(layout, sorted(runtime.owned), received, sequence_shards)
    own = super(_DecoderStage, stage).forward if isinstance(stage, _DecoderStage) else stage.forward
    try:
        if last:
            output = own(**inputs)
            boundary.check_used()
            return output if whole_output else head_output(output)
        # the base model's forward; T5's model is its own base (its head a stand-in here)
        (stage.get_submodule(layout.base) if layout.base else own)(**inputs)
    finally:
        runtime.boundary = None
    if not boundary.reached_stop:
        raise RuntimeError(
            f"{type(stage).__name__}: its forward returned without calling layer {boundary.stop}, so this pipeline "
            f"stage has nothing to send (received {received is not None})"
        )
    return boundary.output()


def decoder_stage_forward(
    self: nn.Module,
    x: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    decoder_input_ids: torch.Tensor | None = None,
    decoder_attention_mask: torch.Tensor | None = None,
    **context: Any,
) -> torch.Tensor:
    """One stage of a model split by :func:`pipeline_layout` or :func:`encoder_decoder_layout`: token ids (first
    stage) or the received tensor in, with the microbatch's ``input_ids`` (and mask and positions, and an
    encoder-decoder's decoder ids and mask, where given) on every stage; what the next stage needs or (last stage)
    logits out. ``context``: what the model's forward carries down to its attention layers (context parallelism's
    inputs: :data:`meshpar.hf.context_parallel.INPUTS_KEY`), and, for a stage installed with ``own_loss_inputs``,
    those inputs, which only the last stage's forward is given (it returns what the model's forward returns: the
    model computes its own loss from them)."""
    layout: PipelineLayout = self.meshpar_layout
    runtime = self.__dict__.get("_meshpar_runtime")
    if runtime is None:  # once, at the first call: after the recipe sharded, wrapped or compiled the stage
        device = x.device if torch.is_tensor(x) else input_ids.device
        runtime = _StageRuntime(self, layout, self.meshpar_last_stage, device)
        object.__setattr__(self, "_meshpar_runtime", runtime)
    ids = x if runtime.first else input_ids
    if ids is None:
        raise ValueError("a pipeline stage after the first needs the microbatch's input_ids")
    inputs = {"input_ids": ids, "attention_mask": attention_mask, "use_cache": False, **context}
    inputs |= {"position_ids": position_ids} if position_ids is not None else {}  # generation from padded prompts
    if getattr(text_config(self.config), "output_router_logits", False):
        # the routers' load-balancing loss of a pipeline is meshpar's (meshpar.hf.router_loss.PipelineRouterLoss):
        # the model's own would score this stage's routers alone (and cannot run on sequence shards)
        inputs["output_router_logits"] = False
    decoder = {"decoder_input_ids": decoder_input_ids, "decoder_attention_mask": decoder_attention_mask}
    inputs |= {k: v for k, v in decoder.items() if v is not None}
    if self.meshpar_fold_choices and not self.meshpar_last_stage:
        # a multiple-choice head's forward folds [batch, choices, seq] into [batch * choices, seq] before the base
        # model; stages before the head run the base model alone, so they fold as it does
        inputs = {k: v.flatten(0, 1) if torch.is_tensor(v) else v for k, v in inputs.items()}
    own_loss = self.meshpar_own_loss_inputs
    if own_loss is not None:  # the head's inputs (the labels) go to the last stage's forward alone
        head_inputs = {name: inputs.pop(name) for name in own_loss if name in inputs}
        inputs |= head_inputs if self.meshpar_last_stage else {}
    received = None if runtime.first else x
    return _run_stage(
        self, runtime, layout, self.meshpar_last_stage, received, inputs, self.meshpar_sequence_shards,
        whole_output=own_loss is not None,
    )  # fmt: skip


def check_stage_composition(model: nn.Module, layout: PipelineLayout, plan: StagePlan) -> None:
    """Raise unless the stages of ``plan``, each built as the pipeline builds it (:func:`build_stage`,
    :func:`install_decoder_stage`) and run one after another, give the dense model's logits on a small padded batch:
    a forward step that transformers' pipeline plan does not describe (state handed between layers outside their
    arguments, say) would otherwise be repeated or lost on some stage, silently. Stages are built one at a time, so
    at most one stage's copy exists besides the model."""
    misplaced = [n for n in layout.before if n not in plan.first_stage_modules and n not in layout.keep]
    if misplaced:
        raise ValueError(
            f"{type(model).__name__}: {misplaced} run before the layers in transformers' pipeline plan but are "
            "registered after them, so the splitter would give them to the last stage; use pipeline_parallel_size 1"
        )
    vocab = getattr(model.config, "vocab_size", 2)
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding exercises the model's own mask building on every stage
    if folds_choices(model):  # one row of two choices
        ids, mask = ids.unsqueeze(0), mask.unsqueeze(0)
    device = next(iter(model.parameters())).device
    ids, mask = ids.to(device), mask.to(device)
    ids = ends_with_eos(model, ids)
    decoder = {}
    if layout.later_lists:  # decoder ids of their own, the second row padded at the end (as long as the encoder's:
        # BART's classifiers pool the decoder's states where the encoder's ids end)
        decoder_ids = ids.flip(-1).contiguous()
        decoder = {"decoder_input_ids": decoder_ids, "decoder_attention_mask": torch.ones_like(decoder_ids)}
        decoder["decoder_attention_mask"][1, -2:] = 0
    try:
        with eval_mode(model), torch.no_grad(), torch.random.fork_rng(devices=[]):
            want = head_output(model(input_ids=ids, attention_mask=mask, use_cache=False, **decoder))
            x = ids
            for index in range(plan.num_stages):
                stage = install_decoder_stage(build_stage(model, plan, index, layout.keep), layout)
                x = stage(x, attention_mask=mask, input_ids=ids, **decoder)
                del stage
    except Exception as error:  # the forward needs something a stage does not have
        raise ValueError(
            f"{type(model).__name__}: its forward cannot run stage by stage ({type(error).__name__}: {error}); use "
            "pipeline_parallel_size 1"
        ) from error
    error = ((x.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    if x.shape != want.shape or error > 1e-5:
        raise ValueError(
            f"{type(model).__name__}: its pipeline stages do not reproduce the dense forward (relative error "
            f"{error:.1e}): its forward does something its pipeline plan (transformers', or read from its "
            "modules) does not describe; use pipeline_parallel_size 1"
        )


def decoder_pipeline_plan(
    model: nn.Module,
    num_stages: int,
    *,
    transformer_layer_cls: type | tuple[type, ...] | None = None,
    pipeline_cuts: Sequence[str] | None = None,
    auto_partition: bool = False,
    from_meta: bool = False,
) -> tuple[PipelineLayout, StagePlan]:
    """A decoder-only (or encoder-only) model's pipeline layout and its plan for ``num_stages`` stages: transformers'
    pipeline plan (or meshpar's table), else one read off the model, with its layers cut at ``pipeline_cuts``, by
    ``auto_partition`` or evenly, proven on the dense model (:func:`check_stage_composition`; a model built on meta
    cannot run and is not proven, and one without a shipped plan is refused). Decided alike on every rank (no
    collective). What both HF ``parallelize`` and NxD's ``NxDPPModel`` of an HF model build."""
    try:
        layout = pipeline_layout(model)
        inferred = layout is None
    except ValueError as plan_error:  # the plan does not describe the model: read one off it
        layout = None if from_meta else inferred_pipeline_layout(model)
        if layout is None:
            lists = block_lists(model)
            raise ValueError(
                f"{plan_error}; nor can a plan be read off the model: "
                + (
                    f"it keeps its layers in {lists}, not in one list its forward runs once in order"
                    if len(lists) > 1
                    else "its base model holds no single list of layers"
                )
            ) from plan_error
        inferred = True
        _log.info("%s; reading the pipeline plan off the model instead (proven below)", plan_error)
    if inferred and layout is None:
        layout = inferred_pipeline_layout(model)
    if layout is None:
        depth = getattr(text_config(model.config), "num_hidden_layers", None)
        lists = block_lists(model) or [name for name in (layer_container(model),) if name]
        blocks = sum(len(model.get_submodule(name)) for name in lists)
        if isinstance(depth, int) and 0 < blocks < depth:
            raise ValueError(
                f"{type(model).__name__} runs {depth} layers on the weights of {blocks} (shared across its depth, "
                "as ALBERT's): no pipeline stage can own its layers apart; use pipeline_parallel_size 1 (tensor "
                "and data parallelism work for it)"
            )
        raise ValueError(
            "pipeline parallelism needs a model whose config carries transformers' pipeline plan "
            "(base_model_pp_plan), or one meshpar has a table for, or whose base model holds one list of layers; "
            f"{type(model).__name__} is none of these"
        )
    if from_meta and inferred:
        raise ValueError(
            f"{type(model).__name__} has no pipeline plan: meshpar reads one from the model's modules and proves "
            "it on the dense model, which a model built on meta cannot run; build it on cpu, or use "
            "pipeline_parallel_size 1"
        )
    first, last = layout.stage_sides(model)
    plan = plan_stages(
        model,
        num_stages,
        transformer_layer_cls=transformer_layer_cls,
        pipeline_cuts=pipeline_cuts,
        auto_partition=auto_partition,
        first_stage_modules=first,
        last_stage_modules=[*last, *head_modules(model, layout.base)],
    )
    if from_meta:
        _log.warning(
            "%s: pipeline stages are not checked against the dense model (built on meta)", type(model).__name__
        )
    else:  # the plan proven here is the plan built
        check_stage_composition(model, layout, plan)
    return layout, plan


def install_decoder_stage(
    stage: nn.Module,
    layout: PipelineLayout,
    sequence_shards: int = 1,
    own_loss_inputs: Sequence[str] | None = None,
) -> nn.Module:
    """Give a stage of a model split by :func:`pipeline_layout` its forward (the user's attention implementation is
    kept); ``sequence_shards``: tp under sequence parallelism. ``own_loss_inputs`` (NxD's way: the model computes
    its loss in its forward): the microbatch inputs only the model's head takes (the labels), handed to the last
    stage's forward alone, which then returns the model's whole output instead of its logits."""
    carried = {c for layer in range(layout.num_layers) for c in layout.carried_into(layer)} - set(_STREAM)
    if sequence_shards > 1 and carried:
        raise ValueError(
            f"{type(stage).__name__}: sequence parallelism inside pipeline stages hands each stage the hidden "
            f"states' sequence shard only, but its layers are handed more "
            f"({sorted(str(c.position) for c in carried)}); "
            "turn 'sequence_parallel' off, or use pipeline_parallel_size 1"
        )
    stage.meshpar_layout = layout
    stage.meshpar_sequence_shards = sequence_shards
    stage.meshpar_own_loss_inputs = tuple(own_loss_inputs) if own_loss_inputs is not None else None
    stage.meshpar_fold_choices = folds_choices(stage)
    # the last stage holds the head: the LM head, or a classifier outside the base model (the other stages hold none)
    stage.meshpar_last_stage = _output_embeddings(stage) is not None or bool(head_modules(stage, layout.base))
    return mix_into(stage, _DecoderStage, "PipelineStage")


def _output_embeddings(stage: nn.Module) -> nn.Module | None:
    """The stage's LM head, ``None`` where it lives on another stage (some heads' getters then fail: BERT's reads
    ``self.cls.predictions``)."""
    try:
        return stage.get_output_embeddings()
    except AttributeError:
        return None


class _DecoderStage:
    forward = decoder_stage_forward
