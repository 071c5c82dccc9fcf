"""Split a model into pipeline stages that keep the original parameter names (FQNs).

Contract (torchtitan's): the model keeps its transformer layers in one ``nn.ModuleList`` / ``nn.Sequential``; the
modules registered *before* that container (on the path from the root to it) run on the first stage, those
registered *after* it on the last stage (unless placed explicitly, for models that register a module on the other
side of the layers than it runs), and the model's ``forward`` skips a top-level piece that is ``None`` (e.g.
``x = self.tok_emb(ids) if self.tok_emb is not None else ids``). A stage is a copy of the model in which the pieces it
does not own are ``None`` and the layer container keeps only its own layers under their original indices, so
``layers.7.attn.q.weight`` keeps that name and a stage's state dict is a slice of the full one.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from meshpar.parallel_dims import check_virtual_pipeline_size


class PipelineLayers(nn.ModuleDict):
    """The layers one stage owns, keyed by their index in the full model; iterates over modules like a ModuleList."""

    def __iter__(self):
        return iter(self.values())


@dataclass
class StagePlan:
    """Which modules each of ``num_stages`` stages owns."""

    container: str  # FQN of the layer container, e.g. "layers" or "transformer.h"
    first_stage_modules: list[str]
    last_stage_modules: list[str]
    stage_layers: list[list[str]]  # per stage: the container keys it owns
    # an encoder-decoder's further layer lists, run after ``container`` (the decoder's), each with the keys every
    # stage owns of it (see :func:`plan_encoder_decoder_stages`)
    later_containers: list[tuple[str, list[list[str]]]] = field(default_factory=list)
    # modules run between two layer lists, each on one stage (an encoder's final norm: on the encoder's last stage)
    stage_modules: dict[str, int] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def owned_layers(self) -> list[tuple[str, list[list[str]]]]:
        """Every layer list with the keys each stage owns of it, in run order."""
        return [(self.container, self.stage_layers), *self.later_containers]

    def describe(self) -> str:
        lines = []
        for stage in range(self.num_stages):
            spans, count = [], 0
            for container, per_stage in self.owned_layers():
                layers = per_stage[stage]
                count += len(layers)
                if layers:
                    spans.append(f"{container}.{layers[0]}..{layers[-1]}")
            extra = []
            if stage == 0 and self.first_stage_modules:
                extra.append("+ " + ", ".join(self.first_stage_modules))
            placed = [name for name, owner in self.stage_modules.items() if owner == stage]
            if placed:
                extra.append("+ " + ", ".join(placed))
            if stage == self.num_stages - 1 and self.last_stage_modules:
                extra.append("+ " + ", ".join(self.last_stage_modules))
            span = ", ".join(spans) or "no layers"
            lines.append(f"stage {stage}: {count} layers ({span}) {' '.join(extra)}".rstrip())
        return "\n".join(lines)


def _find_container(model: nn.Module, layer_cls: type | tuple[type, ...] | None, cuts: Sequence[str] | None) -> str:
    if cuts:
        parents = {cut.rsplit(".", 1)[0] if "." in cut else "" for cut in cuts}
        if len(parents) != 1:
            raise ValueError(f"pipeline_cuts must name layers of one container, got parents {sorted(parents)}")
        return parents.pop()
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 0:
            children = list(module.children())
            if layer_cls is None or all(isinstance(c, layer_cls) for c in children):
                candidates.append((len(children), name))
    if layer_cls is not None and not candidates:
        raise ValueError(f"no nn.ModuleList or nn.Sequential of {layer_cls} found in {type(model).__name__}")
    if not candidates:
        raise ValueError("give transformer_layer_cls or pipeline_cuts so that meshpar can find the layers")
    return max(candidates)[1]


def _outside_modules(
    model: nn.Module, container: str, first_stage: Sequence[str] = (), last_stage: Sequence[str] = ()
) -> tuple[list[str], list[str]]:
    """Modules on the path to ``container``: (first stage's, last stage's). By registration order (before the path,
    after it) unless named in ``first_stage`` / ``last_stage``: a model may register a module on one side of its
    layers and run it on the other (OPT registers its final norm before its layers)."""
    before, after = [], []
    module, prefix = model, ""
    for part in container.split(".") if container else []:
        seen = False
        for name, _child in module.named_children():
            if name == part:
                seen = True
            elif not seen:
                before.append(prefix + name)
            else:
                after.append(prefix + name)
        module = getattr(module, part)
        prefix += part + "."
    outside = before + after
    unknown = [n for n in (*first_stage, *last_stage) if n not in outside]
    both = set(first_stage) & set(last_stage)
    if unknown or both:
        raise ValueError(
            f"first_stage_modules / last_stage_modules must name modules outside the layers on the path to "
            f"{container!r}, each once; unknown: {unknown}, on both stages: {sorted(both)}; outside modules: {outside}"
        )
    first = [n for n in outside if n in first_stage or (n in before and n not in last_stage)]
    last = [n for n in outside if n in last_stage or (n in after and n not in first_stage)]
    return first, last


def _balanced_split(costs: Sequence[float], num_stages: int, head: float, tail: float) -> list[int]:
    """Contiguous split of ``costs`` into ``num_stages`` non-empty parts minimising the most expensive stage
    (stage 0 also pays ``head``, the last ``tail``); among splits with the same maximum, the most even one (least
    sum of squared stage costs), so stages the maximum does not constrain are balanced too. Returns the part sizes."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, num_stages + 1):
        for end in range(s, n - (num_stages - s) + 1):
            for start in range(s - 1, end):
                cost = prefix[end] - prefix[start] + (head if s == 1 else 0.0) + (tail if s == num_stages else 0.0)
                worst, squares = best[s - 1][start]
                value = (max(worst, cost), squares + cost * cost)
                if value < best[s][end]:
                    best[s][end], choice[s][end] = value, start
    sizes, end = [], n
    for s in range(num_stages, 0, -1):
        start = choice[s][end]
        sizes.append(end - start)
        end = start
    return sizes[::-1]


def _numel(model: nn.Module, names: Sequence[str]) -> float:
    return float(sum(p.numel() for name in names for p in model.get_submodule(name).parameters()))


def plan_stages(
    model: nn.Module,
    num_stages: int,
    *,
    transformer_layer_cls: type | tuple[type, ...] | None = None,
    pipeline_cuts: Sequence[str] | None = None,
    auto_partition: bool = False,
    first_stage_modules: Sequence[str] = (),
    last_stage_modules: Sequence[str] = (),
) -> StagePlan:
    """Decide the layers of each stage: explicit cuts (a new stage starts *after* each named layer), parameter-count
    balancing (``auto_partition``), or equal layer counts (the first stages take the remainder). Modules outside the
    layers go by registration order unless ``first_stage_modules`` / ``last_stage_modules`` place them."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    container = _find_container(model, transformer_layer_cls, pipeline_cuts)
    keys = list(model.get_submodule(container)._modules.keys()) if container else list(model._modules.keys())
    first, last = _outside_modules(model, container, first_stage_modules, last_stage_modules)
    if len(keys) < num_stages:
        raise ValueError(f"{len(keys)} layers cannot fill {num_stages} pipeline stages; use at most {len(keys)} stages")
    if pipeline_cuts:
        prefix = container + "." if container else ""
        unknown = [c for c in pipeline_cuts if not c.startswith(prefix) or c[len(prefix) :] not in keys]
        if unknown:
            raise ValueError(
                f"pipeline_cuts name unknown layers {unknown}; layers are {prefix}{{{keys[0]}..{keys[-1]}}}"
            )
        if len(pipeline_cuts) != num_stages - 1:
            raise ValueError(
                f"{len(pipeline_cuts)} pipeline_cuts make {len(pipeline_cuts) + 1} stages, need {num_stages}"
            )
        positions = sorted(keys.index(c[len(prefix) :]) + 1 for c in pipeline_cuts)
        if positions[-1] == len(keys) or len(set(positions)) != len(positions):
            raise ValueError(f"pipeline_cuts {list(pipeline_cuts)} leave a stage without layers")
        bounds = [0, *positions, len(keys)]
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
    elif auto_partition:
        costs = [_numel(model, [f"{container}.{k}" if container else k]) for k in keys]
        sizes = _balanced_split(costs, num_stages, _numel(model, first), _numel(model, last))
    else:
        base, extra = divmod(len(keys), num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    stage_layers, start = [], 0
    for size in sizes:
        stage_layers.append(keys[start : start + size])
        start += size
    return StagePlan(container, first, last, stage_layers)


def encoder_stage_count(encoder_layers: int, decoder_layers: int, num_stages: int) -> int:
    """How many of ``num_stages`` run the encoder (apex's ``pipeline_model_parallel_split_rank``): the share of the
    layers the encoder holds, at least one stage each side and no stage without layers."""
    if num_stages < 2:
        raise ValueError(f"an encoder-decoder pipeline needs at least 2 stages (one per stack), got {num_stages}")
    if encoder_layers + decoder_layers < num_stages:
        raise ValueError(
            f"{encoder_layers} encoder and {decoder_layers} decoder layers cannot fill {num_stages} pipeline stages "
            "(every stage needs layers of one stack)"
        )
    share = round(num_stages * encoder_layers / (encoder_layers + decoder_layers))
    return min(max(share, 1, num_stages - decoder_layers), num_stages - 1, encoder_layers)


def plan_encoder_decoder_stages(
    encoder: tuple[str, list[str]],
    decoder: tuple[str, list[str]],
    num_stages: int,
    *,
    first_stage_modules: Sequence[str] = (),
    last_stage_modules: Sequence[str] = (),
    encoder_modules: Sequence[str] = (),
) -> StagePlan:
    """apex's split-rank layout for an encoder-decoder: the first :func:`encoder_stage_count` stages run the encoder's
    layers (``encoder``: the list's FQN and keys), the rest the decoder's, each stack dealt out evenly (earlier stages
    take the remainder). ``encoder_modules`` run after the encoder's layers and before the decoder's (the encoder's
    final norm): on the encoder's last stage, which sends the encoder's output on to every decoder stage."""
    split = encoder_stage_count(len(encoder[1]), len(decoder[1]), num_stages)

    def deal(keys: list[str], stages: int) -> list[list[str]]:
        base, extra = divmod(len(keys), stages)
        dealt, start = [], 0
        for stage in range(stages):
            size = base + (1 if stage < extra else 0)
            dealt.append(keys[start : start + size])
            start += size
        return dealt

    encoder_layers = deal(encoder[1], split) + [[] for _ in range(num_stages - split)]
    decoder_layers = [[] for _ in range(split)] + deal(decoder[1], num_stages - split)
    return StagePlan(
        encoder[0],
        list(first_stage_modules),
        list(last_stage_modules),
        encoder_layers,
        later_containers=[(decoder[0], decoder_layers)],
        stage_modules={name: split - 1 for name in encoder_modules},
    )


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _parameter_attributes(module: nn.Module) -> dict[str, dict[str, object]]:
    """The Python attributes of each parameter of ``module``, by FQN: NxD's and apex's ``tensor_model_parallel`` /
    ``partition_dim`` say how a plain local shard is split, and grad norms and checkpoints read them."""
    return {name: dict(vars(p)) for name, p in module.named_parameters(remove_duplicate=False)}


def _restore_parameter_attributes(module: nn.Module, attributes: dict[str, dict[str, object]]) -> None:
    """Give ``module``'s parameters back the attributes :func:`_parameter_attributes` read (``deepcopy`` and
    ``to_empty`` make new Parameter objects without them)."""
    for name, param in module.named_parameters(remove_duplicate=False):
        for key, value in attributes.get(name, {}).items():
            if not key.startswith("_") and not hasattr(param, key):
                setattr(param, key, value)


def build_stage(
    model: nn.Module, plan: StagePlan, stage: int, keep_modules: Sequence[str] = (), share_tensors: bool = False
) -> nn.Module:
    """A copy of ``model`` holding only what ``stage`` owns (FQNs unchanged); other pieces are ``None``.
    ``keep_modules`` (e.g. Llama's ``model.rotary_emb``) are copied to every stage, and so is every module outside
    the layers that holds no parameters or buffers (an activation or loss module registered before the base model,
    as DistilBERT's head does): it costs nothing and its stage's forward may call it. With ``share_tensors`` the
    stage's modules are new but its parameters and buffers are ``model``'s own objects (NxD's stages are the
    model's modules: what was built from the model, an optimizer over its parameters say, trains the stage)."""
    dropped = []
    for fqn, per_stage in plan.owned_layers():
        owned = set(per_stage[stage])
        container = model.get_submodule(fqn) if fqn else model
        dropped += [m for k, m in container._modules.items() if k not in owned]
    elsewhere = [name for name, owner in plan.stage_modules.items() if owner != stage and name not in keep_modules]
    if stage != 0:
        elsewhere += [n for n in plan.first_stage_modules if n not in keep_modules]
    if stage != plan.num_stages - 1:
        elsewhere += [n for n in plan.last_stage_modules if n not in keep_modules]
    dropped += [m for m in map(model.get_submodule, elsewhere) if _holds_state(m)]
    memo: dict[int, object] = {id(m): None for m in dropped}
    if share_tensors:
        memo.update({id(t): t for t in (*model.parameters(), *model.buffers())})
    stage_model = copy.deepcopy(model, memo)
    _restore_parameter_attributes(stage_model, _parameter_attributes(model))
    for fqn, _ in plan.owned_layers():
        new_container = stage_model.get_submodule(fqn) if fqn else stage_model
        kept = {k: m for k, m in new_container._modules.items() if m is not None}
        if isinstance(new_container, nn.ModuleList):
            if not fqn:
                raise ValueError("the model itself cannot be a ModuleList; wrap it in nn.Sequential")
            parent, _, name = fqn.rpartition(".")
            setattr(stage_model.get_submodule(parent) if parent else stage_model, name, PipelineLayers(kept))
        else:
            new_container._modules.clear()
            new_container._modules.update(kept)
    stage_model.meshpar_stage_index = stage
    return stage_model


def _materialize(
    module: nn.Module,
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
    stage_init_fn: Callable[[nn.Module], None] | None,
) -> None:
    """Allocate a meta-built stage on ``device`` and initialise it: ``stage_init_fn(stage)`` once, or NxD's
    ``param_init_fn(module)`` for every module (each initialises its own parameters, not its submodules'), or every
    submodule's ``reset_parameters()``."""
    attributes = _parameter_attributes(module)
    module.to_empty(device=device)
    _restore_parameter_attributes(module, attributes)
    if stage_init_fn is not None:
        stage_init_fn(module)
    elif param_init_fn is not None:
        for sub in module.modules():
            param_init_fn(sub)
    else:
        for sub in module.modules():
            if hasattr(sub, "reset_parameters") and sub is not module:
                sub.reset_parameters()


def build_stages(
    model: nn.Module,
    plan: StagePlan,
    pp_rank: int,
    pp: int,
    *,
    keep_modules: Sequence[str] = (),
    param_init_fn: Callable[[nn.Module], None] | None = None,
    stage_init_fn: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
    share_tensors: bool = False,
) -> list[tuple[int, nn.Module]]:
    """The stages of ``plan`` that pipeline rank ``pp_rank`` runs (``pp_rank + k * pp``), each built once:
    ``[(stage_index, module), ...]`` (``share_tensors``: see :func:`build_stage`).

    A model built on ``meta`` is materialised stage by stage on ``device`` (``stage_init_fn(stage)``, NxD's
    ``param_init_fn`` per module, or every submodule's ``reset_parameters()``; see :func:`_materialize`), so a rank
    only ever allocates its own stages.
    """
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} is out of range for pp={pp}")
    if plan.num_stages % pp != 0:
        raise ValueError(f"{plan.num_stages} stages cannot be dealt out evenly to pp={pp} ranks")
    is_meta = any(p.is_meta for p in model.parameters())
    stages = []
    for stage in range(pp_rank, plan.num_stages, pp):
        module = build_stage(model, plan, stage, keep_modules, share_tensors)
        if is_meta:
            _materialize(module, torch.device(device or "cpu"), param_init_fn, stage_init_fn)
        elif device is not None:
            module.to(device)
        stages.append((stage, module))
    return stages


def split_model(
    model: nn.Module,
    pp_rank: int,
    pp: int,
    *,
    transformer_layer_cls: type | tuple[type, ...] | None = None,
    pipeline_cuts: Sequence[str] | None = None,
    auto_partition: bool = False,
    virtual_pipeline_size: int = 1,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
    keep_modules: Sequence[str] = (),
    stage_init_fn: Callable[[nn.Module], None] | None = None,
    first_stage_modules: Sequence[str] = (),
    last_stage_modules: Sequence[str] = (),
) -> tuple[list[tuple[int, nn.Module]], StagePlan]:
    """:func:`plan_stages` for ``pp * virtual_pipeline_size`` stages, then :func:`build_stages` for ``pp_rank``:
    ``([(stage_index, module), ...], plan)``."""
    check_virtual_pipeline_size(pp, virtual_pipeline_size)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} is out of range for pp={pp}")
    plan = plan_stages(
        model,
        pp * virtual_pipeline_size,
        transformer_layer_cls=transformer_layer_cls,
        pipeline_cuts=pipeline_cuts,
        auto_partition=auto_partition,
        first_stage_modules=first_stage_modules,
        last_stage_modules=last_stage_modules,
    )
    stages = build_stages(
        model, plan, pp_rank, pp, keep_modules=keep_modules, param_init_fn=param_init_fn,
        stage_init_fn=stage_init_fn, device=device,
    )  # fmt: skip
    return stages, plan
