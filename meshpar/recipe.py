"""The recipe: one module (a whole model, or one pipeline stage) becomes this rank's parallel module.

The steps run in torchtitan's order (``parallelize_llama``): tensor parallelism from a plan dict (module FQN ->
style, applied by torch's ``parallelize_module``) -> the plan's fix-ups and parameter ties -> one input-grad
all-reduce per shared input -> allocation of a meta-built module's shards -> activation checkpointing per block ->
``torch.compile`` per block -> FSDP2 over dp (per block, then the root). Each step needs the one before: FSDP wraps
what TP sharded, checkpointing must see the sharded blocks, compile runs inside the checkpoint.

Nothing here knows HuggingFace. :func:`meshpar.parallelize` builds a :class:`Recipe` from the model's own metadata
(:mod:`meshpar.hf.plans`) and applies it to the model (pp = 1) or to each pipeline stage as the splitter makes it;
any ``nn.Module`` with a plan dict can call :func:`apply_recipe` directly with its :class:`ParallelDims`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from meshpar._compat import DeviceMesh
from meshpar.data import move_model_to_device
from meshpar.data_parallel import apply_activation_checkpointing, apply_fsdp
from meshpar.materialize import is_meta, make_replicas_agree, materialize_sharded
from meshpar.parallel_dims import ParallelDims
from meshpar.replicas import make_replicas_equal
from meshpar.tensor_parallel.shared_input import group_shared_inputs

Fixup = Callable[[nn.Module, int], None]


@dataclass(frozen=True)
class Recipe:
    """What to apply, independent of the mesh sizes (the same recipe serves every rank and every stage)."""

    tp_plan: Mapping[str, ParallelStyle] = field(default_factory=dict)
    blocks: str = ""  # FQN of the list of blocks: the units of checkpointing, compile and FSDP
    fixups: Sequence[Fixup] = ()  # run after TP with the tp size (e.g. divide a head count the forward reads)
    ties: Sequence[tuple[str, str]] = ()  # (target, source) parameter FQNs: target becomes the sharded source
    activation_checkpointing: bool = False
    compile: bool = False
    fsdp: bool = False  # FSDP2 over dp (when dp > 1); otherwise the caller averages grads over dp
    init_weights: Callable[[nn.Module], None] | None = None  # initialises a meta-built module's local shards


def block_classes(module: nn.Module, blocks: str) -> tuple[type, ...]:
    """The classes of the blocks (hybrid models mix several, e.g. linear and full attention layers)."""
    container = _submodule(module, blocks) if blocks else None
    return tuple(dict.fromkeys(type(block) for block in container)) if container is not None else ()


def apply_recipe(
    module: nn.Module,
    dims: ParallelDims,
    recipe: Recipe,
    *,
    initialised_per_rank: bool = False,
    replicas_equal: bool = False,
) -> nn.Module:
    """Shard ``module`` in place for this rank and return it (parameter FQNs unchanged, so DCP reshards).

    A module still on ``meta`` is allocated shard by shard and initialised with ``recipe.init_weights``;
    ``initialised_per_rank`` says its weights were already initialised independently on each rank (a meta-built
    pipeline stage the splitter allocated) and only need the replicas to agree. Otherwise every rank's dense copy is
    first made equal to its tp and dp group's first rank's (:mod:`meshpar.replicas`), unless the caller says it
    already is (``replicas_equal``)."""
    from_meta = is_meta(module)
    if from_meta and recipe.init_weights is None:
        raise ValueError("the module is on the meta device: the recipe needs init_weights to initialise its shards")
    if not (from_meta or initialised_per_rank or replicas_equal):
        make_replicas_equal(module, dims, over=("tp", "dp"))
    with warnings.catch_warnings():
        # plan keys for modules another pipeline stage holds
        warnings.filterwarnings("ignore", message="Parallelize plan key")
        for mesh, plan in _plans_by_mesh(recipe.tp_plan, dims):
            parallelize_module(module, mesh, plan)
    if not from_meta:
        move_model_to_device(module, dims.device)  # what tp left where the model was built
    for fixup in recipe.fixups:
        fixup(module, dims.tp)
    group_shared_inputs(module)  # q/k/v and gate/up: one input-grad all-reduce each (Megatron's count)
    _tie(module, recipe.ties)
    if from_meta:
        materialize_sharded(module, dims, recipe.init_weights)
    elif initialised_per_rank:
        make_replicas_agree(module, dims)
    classes = block_classes(module, recipe.blocks)
    if recipe.activation_checkpointing and classes:
        # with compile, each block's forward is compiled inside the checkpoint (see apply_activation_checkpointing)
        apply_activation_checkpointing(module, classes, compile_blocks=recipe.compile)
    elif recipe.compile and classes:
        for block in _submodule(module, recipe.blocks):
            block.compile(fullgraph=False)
    if recipe.fsdp and dims.grad_mesh.size() > 1:
        # under pp a stage runs each microbatch forward then backward: keep its gathered parameters between the two
        # instead of all-gathering them again (torchtitan: reshard_after_forward = not pp_enabled); under cp over
        # dp x cp, whose ranks all hold every weight and a share of each grad (summed, then divided by dp)
        apply_fsdp(
            module,
            dims.grad_mesh,
            block_cls=classes or None,
            reshard_after_forward=dims.pp == 1,
            divisor=dims.dp if dims.cp > 1 else None,
            expert_dp_mesh=dims.expert_dp_mesh,
        )
    return module


def _plans_by_mesh(
    tp_plan: Mapping[str, ParallelStyle], dims: ParallelDims
) -> list[tuple[DeviceMesh, dict[str, ParallelStyle]]]:
    """The plan split by the mesh each style shards over: tp, unless the style names another with
    ``mesh_for(dims)`` (experts over ``("ep", "tp")`` under expert parallelism)."""
    by_mesh: dict[object, tuple[DeviceMesh, dict[str, ParallelStyle]]] = {"tp": (dims.tp_mesh, {})}
    for pattern, style in tp_plan.items():
        mesh_for = getattr(style, "mesh_for", None)
        mesh = mesh_for(dims) if mesh_for is not None else dims.tp_mesh
        key = "tp" if mesh is by_mesh["tp"][0] or mesh_for is None else mesh.mesh_dim_names
        by_mesh.setdefault(key, (mesh, {}))[1][pattern] = style
    return list(by_mesh.values())


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    with contextlib.suppress(AttributeError):
        return module.get_submodule(name)
    return None


def has_parameter(module: nn.Module, name: str) -> bool:
    with contextlib.suppress(AttributeError):
        module.get_parameter(name)
        return True
    return False


def _tie(module: nn.Module, ties: Sequence[tuple[str, str]]) -> None:
    """Point each tied target at its (sharded) source: sharding both copies separately would untie them. A pipeline
    stage holding only one side of a tie keeps its copy (the caller syncs the two stages' grads)."""
    for target, source in ties:
        if not (has_parameter(module, target) and has_parameter(module, source)):
            continue
        owner, _, attr = target.rpartition(".")
        source_owner, _, source_attr = source.rpartition(".")
        setattr(module.get_submodule(owner), attr, getattr(module.get_submodule(source_owner), source_attr))
