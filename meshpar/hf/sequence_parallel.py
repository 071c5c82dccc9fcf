"""Sequence parallelism for families sharded from their own tensor-parallel plans (transformers' ``tp_plan``).

Megatron's layout: between the transformer sublayers every rank holds a sequence shard ``[b, s/tp, h]`` of the
residual stream; each module the plan shards (attention, MLP: a *region*) all-gathers its ``hidden_states`` input
once (:class:`GatherSequenceInput`; its column projections take the gathered input as is) and its row projection
reduce-scatters the output back into shards (projections sitting directly in the layer, OPT's ``fc1`` / ``fc2``,
gather and reduce-scatter on their own); the modules between the regions (norms) run on shards, their
parameters' grads summed over tp. The first layer splits its input into shards, the final norm gathers them back for
the (vocab-parallel) LM head.

A mixture-of-experts block (a region holding a ``moe_tp_experts`` module) is not gathered whole: Megatron's layout,
its router runs on the shards (its parameters' grads summed over tp, as a norm's), the experts module all-gathers
the tokens with their routes and reduce-scatters its output back into shards (:class:`ExpertsOverTP` with
``sequence_parallel``), and sharded modules inside the block (shared experts) form regions of their own.

A layer may hold its sublayers in lists (LongCat-Flash: two attentions, two MLPs and their norms per layer); a list
is never called itself, so each of its items is a region or a norm. A replicated child of a mixture-of-experts block
(a router) runs on the shards whole, whatever of its children holds the weights (LongCat-Flash's router reads its
classifier's weight itself).

A region module's own per-head parameters (an attention's ``sinks``, transformers' ``local_params``) stay sharded with
its heads (:class:`GatherSequenceInput` with ``own_parameters``): they meet the gathered, head-sharded activations.

A region whose plan gathers a column projection's output or splits a row projection's input itself (OLMo-2's
attention: ``colwise_gather_output`` q / k / v under norms spanning every head, ``rowwise_split_input`` o) computes
on whole, replicated activations between them. It runs as in plain tensor parallelism on the gathered sequence: its
column layers all-reduce their own input grads, so the grad reaching its gather is whole and the gather's backward
keeps this rank's chunk (``GatherSequenceInput(complete_grads=True)``), its replicated modules' grads are whole (not
summed), and its row layer reduce-scatters into sequence shards.

A module of a layer that the plan leaves whole and that is not a norm (a Mamba or convolution mixer, an attention
a shipped plan does not shard) runs replicated on the whole sequence, as it does without sequence parallelism: its
input gathered, its output cut back to this rank's shard, its grads whole (:class:`ReplicatedOnWholeSequence`). What
follows the layers is one final norm on the shards (its output gathered for the head), or else (post-norm layers'
heads, a final norm without parameters, a projection after it) runs on the last layer's gathered output.

transformers' plans say which projections are column- and row-parallel, not what runs on the residual stream, so the
plan is converted only where each layer is regions, norms and such whole modules; anything else (partial-sum
outputs, bare parameters of the layer, replicated key/value heads, the stacks of an encoder-decoder) is refused with
the modules named. The converted plan is proven by the same one-block verification
as the plan without sequence parallelism, on sequence shards.
"""

from __future__ import annotations

import torch
from torch import nn

from meshpar._compat import DeviceMesh, ParallelStyle
from meshpar.hf.conv1d import Conv1DColumn, Conv1DRow
from meshpar.hf.experts import ExpertsOverTP
from meshpar.hf.hf_plan import fqn_matches
from meshpar.tensor_parallel import (
    ColumnParallel,
    GatherSequenceInput,
    PackedColumnParallel,
    RowParallel,
    SequenceParallelNorm,
)
from meshpar.tensor_parallel._collectives import gather_from_tp, scatter_to_tp
from meshpar.tensor_parallel.style import LocalParameters, ReplicatedGradSum, RopeGradSum

# styles inside a region that sequence parallelism leaves as they are (they act on the region's full-sequence
# activations: per-head norms, rope-feature grads, per-head parameters)
_UNCHANGED = (ReplicatedGradSum, RopeGradSum)
_ROWS = (RowParallel, Conv1DRow)


def _as_sequence_parallel(style: ParallelStyle, in_region: bool) -> ParallelStyle | None:
    """The style under sequence parallelism; ``None`` if there is none. A column projection inside a region takes
    the region's gathered input; one sitting directly in the layer (OPT's ``fc1``) gathers its own."""
    own = {"sequence_parallel": True} if not in_region else {"input_gathered": True}
    if isinstance(style, Conv1DColumn) and not (style.gather_output or style.sequence_parallel or style.input_gathered):
        return Conv1DColumn(fused=style.fused, num_heads=style.num_heads, **own)
    if isinstance(style, Conv1DRow) and not style.sequence_parallel:
        return Conv1DRow(sequence_parallel=True)
    if isinstance(style, PackedColumnParallel):
        return PackedColumnParallel(parts=style.parts, unit=style.unit, **own)
    if type(style) is ColumnParallel and not style.gather_output and not style.sequence_parallel:
        return ColumnParallel(num_heads=style.num_heads, **own)
    if type(style) is RowParallel and style.input_is_parallel:
        return RowParallel(sequence_parallel=True)
    return style if in_region and _is_per_head(style) else None


def _is_per_head(style: ParallelStyle) -> bool:
    """A style inside a region that acts on its full-sequence, head-sharded activations as it is (per-head norms,
    rope-feature grads, per-head parameters), with or without sequence parallelism."""
    return isinstance(style, _UNCHANGED) or (isinstance(style, LocalParameters) and not style.partial_output)


def _needs_whole_grads(style: ParallelStyle) -> bool:
    """A projection that gathers its output features or splits a replicated input itself (OLMo-2's attention:
    ``colwise_gather_output`` q / k / v, ``rowwise_split_input`` o): what follows it runs on whole, replicated
    activations, so its region runs as in plain tensor parallelism (see :func:`_in_whole_grads_region`)."""
    return (type(style) is ColumnParallel and style.gather_output) or (
        type(style) is RowParallel and not style.input_is_parallel
    )


def _in_whole_grads_region(style: ParallelStyle) -> ParallelStyle | None:
    """The style inside a region that runs as in plain tensor parallelism on the gathered sequence (its gather's
    backward keeps this rank's chunk of a whole grad: ``GatherSequenceInput(complete_grads=True)``): column layers
    unchanged (each all-reduces its input grad), row layers reduce-scattering their output into sequence shards,
    per-head styles unchanged; ``None`` for anything else."""
    if type(style) is RowParallel:
        return RowParallel(input_is_parallel=style.input_is_parallel, sequence_parallel=True)
    if type(style) is ColumnParallel and not style.sequence_parallel and not style.input_gathered:
        return style
    return style if _is_per_head(style) else None


def _describe(style: ParallelStyle) -> str:
    """``ColumnParallel(gather_output=True)``: the style and the switches that keep it out of sequence parallelism."""
    switches = {"gather_output": True, "input_is_parallel": False, "partial_output": True}
    shown = [f"{k}={v}" for k, v in switches.items() if getattr(style, k, None) == v]
    return f"{type(style).__name__}({', '.join(shown)})" if shown else type(style).__name__


def _is_per_token(module: nn.Module) -> bool:
    """A module whose parameters are all vectors (a norm's weight and bias): it acts on each token alone."""
    params = list(module.parameters())
    return bool(params) and all(p.dim() == 1 for p in params)


def sequence_parallel_styles(
    model: nn.Module,
    styles: dict[str, ParallelStyle],
    layers: str,
    final: list[str],
    scatter: ParallelStyle,
    final_norm: ParallelStyle,
) -> dict[str, ParallelStyle]:
    """``styles`` (a plan without sequence parallelism) converted; see the module docstring. ``final``: the modules
    after the layer list that hold parameters (the final norm); ``scatter`` / ``final_norm``: the styles that enter
    and leave the sequence-parallel region."""
    name = type(model).__name__
    out: dict[str, ParallelStyle] = {}
    refused: list[str] = []
    regions: set[str] = set()
    with_rows: set[str] = set()  # regions whose output a row projection reduce-scatters back into shards
    direct: set[str] = set()  # projections sitting directly in the layer, each gathering / scattering on its own
    own: dict[str, LocalParameters] = {}  # a region module's own per-head parameters (an attention's sinks)
    inside = f"{layers}.*."
    # mixture-of-experts blocks: layer child -> its experts child
    moe = {
        pattern[len(inside) :].split(".")[0]: pattern[len(inside) :].split(".")[1]
        for pattern, style in styles.items()
        if pattern.startswith(inside) and isinstance(style, ExpertsOverTP) and pattern[len(inside) :].count(".") == 1
    }
    layer_list = model.get_submodule(layers)
    rows = {p[len(inside) :] for p, st in styles.items() if p.startswith(inside) and isinstance(st, _ROWS)}
    planned = {p[len(inside) :] for p in styles if p.startswith(inside)}
    post_norm = _post_norm_modules(layer_list[0], rows, planned)

    def region_of(path: list[str]) -> tuple[str, bool]:
        """(the region a plan entry inside the layers falls in, whether it is inside it rather than the region)."""
        # inside a mixture-of-experts block, its children are the regions (shared experts); so are the children of
        # a post-norm sublayer (BERT's attention and its output: a row projection, then the norm of the residual sum)
        depth = 2 if path[0] in moe and len(path) > 1 else 1
        while depth < len(path) and (
            ".".join(path[:depth]) in post_norm or _is_container(layer_list[0], path[:depth])
        ):  # a list of sublayers (LongCat-Flash's two attentions per layer) is not called: its items are the units
            depth += 1
        return ".".join(path[:depth]), len(path) > depth

    # regions holding a projection that gathers its output or splits its input: run as in plain tensor parallelism
    whole_grads = set()
    for pattern, style in styles.items():
        if pattern.startswith(inside) and _needs_whole_grads(style):
            region, in_region = region_of(pattern[len(inside) :].split("."))
            if in_region:
                whole_grads.add(region)
    for pattern, style in styles.items():
        if not pattern.startswith(inside):
            out[pattern] = style  # embedding, head: full sequence
            continue
        path = pattern[len(inside) :].split(".")
        if path[0] in moe and len(path) == 2 and path[1] == moe[path[0]]:
            out[pattern] = ExpertsOverTP(style.features, sequence_parallel=True)
            continue
        region, in_region = region_of(path)
        if not in_region and isinstance(style, LocalParameters) and not style.partial_output:  # its own sinks
            own[region] = style
            continue
        if region in whole_grads:  # plain tensor parallelism inside: every style keeps its meaning
            converted = _in_whole_grads_region(style)
        else:
            converted = _as_sequence_parallel(style, in_region)
            # a rope slice's output grad is partial as a whole now: see _unplanned_in_regions
            if isinstance(converted, RopeGradSum):
                converted = ReplicatedGradSum()
        if converted is None:
            refused.append(f"{pattern}: {_describe(style)}")
            continue
        out[pattern] = converted
        if not in_region:
            direct.add(region)
            continue
        regions.add(region)
        if isinstance(converted, _ROWS):
            with_rows.add(region)
    direct_rows = any(isinstance(out.get(f"{inside}{name}"), _ROWS) for name in direct)
    for region in sorted(regions):
        key = f"{inside}{region}"
        if region in whole_grads and region not in with_rows:
            # its column outputs gathered, no row projection: its output is whole on every rank, cut back to shards
            out[key] = ReplicatedOnWholeSequence(own.pop(region, None))
            continue
        if region not in with_rows and not (post_norm and direct_rows):  # BERT's intermediate: output.dense's
            refused.append(f"{key}: sharded, but no row-parallel projection hands back sequence shards")
        out[key] = GatherSequenceInput(own.pop(region, None), complete_grads=region in whole_grads)
    refused += [f"{inside}{name}: {_describe(style)} outside an attention / MLP region" for name, style in own.items()]
    norms: set[str] = set()
    whole: set[str] = set()  # modules of a layer the plan leaves whole (not norms)
    routers: set[str] = set()  # replicated modules of a mixture-of-experts block, run on shards
    for index, layer in enumerate(layer_list):
        if any(True for _ in layer.parameters(recurse=False)):
            refused.append(f"{layers}.{index}: parameters of the layer itself")
        units = list(layer.named_children())
        while units:
            child_name, child = units.pop(0)
            if child_name in post_norm or isinstance(child, _CONTAINERS):  # its children are the units
                units += [(f"{child_name}.{n}", m) for n, m in child.named_children()]
                continue
            # a hybrid's layers may name an experts block and a mixer alike (Nemotron-H's ``mixer``)
            is_moe_block = child_name in moe and moe[child_name] in dict(child.named_children())
            if is_moe_block:
                routers |= _replicated_in_block(child, child_name, moe[child_name], regions | direct)
                if any(p.requires_grad for p in child.parameters(recurse=False)):  # frozen ones: replicated as is
                    refused.append(f"{layers}.{index}.{child_name}: parameters of the experts block itself")
                continue
            if _holds_any(regions | direct, child_name) or not any(True for _ in child.parameters()):
                continue  # sharded (or holding what is: DeepSeek's dense first MLP), or nothing to sync
            if _is_per_token(child):
                norms.add(child_name)
            else:  # a mixer or MLP the plan leaves whole: replicated on the whole sequence, as without SP
                whole.add(f"{layers}.{index}.{child_name}" if child_name in moe else f"{inside}{child_name}")
    for norm in sorted(norms):
        out[f"{inside}{norm}"] = SequenceParallelNorm()
    for key in sorted(whole):
        out[key] = ReplicatedOnWholeSequence()
    for router in sorted(routers):
        out[f"{inside}{router}"] = ReplicatedGradSum()
    for module in sorted(  # a region run as in plain tensor parallelism has whole grads everywhere
        _unplanned_in_regions(
            layer_list, regions - whole_grads, {p[len(inside) :] for p in out if p.startswith(inside)}
        )
    ):
        out[f"{inside}{module}"] = ReplicatedGradSum()
    # one final norm runs on the shards and gathers them; anything else after the layers (post-norm layers' pooler
    # and heads, no final norm, a parameter-free one, a projection after it) runs on the last layer's gathered
    # output, the whole sequence, as without sequence parallelism
    final_norm_only = len(final) == 1 and _is_per_token(model.get_submodule(final[0]))
    gather_after_layers = not final_norm_only
    if gather_after_layers and getattr(model.config, "is_encoder_decoder", False):
        refused.append(f"{layers}: one stack of an encoder-decoder (sequence parallelism takes one stack of layers)")
    if refused:
        raise ValueError(
            f"{name}: sequence parallelism from the model's tensor-parallel plan needs each layer to be sharded "
            f"attention / MLP modules and norms; not so for: {'; '.join(dict.fromkeys(refused))}. Turn "
            "'sequence_parallel' off, or pass plan={...} with sequence-parallel styles"
        )
    if gather_after_layers:  # the last layer's output is gathered for what follows
        count = len(layer_list)
        out[f"{layers}.0"] = scatter if count > 1 else _Both(scatter, GatherSequenceOutput())
        if count > 1:
            out[f"{layers}.{count - 1}"] = GatherSequenceOutput()
        return out
    out[f"{layers}.0"] = scatter
    out[final[0]] = final_norm
    return out


class ReplicatedOnWholeSequence(ParallelStyle):
    """A module of a layer that the plan leaves whole (a Mamba or convolution mixer, an attention or MLP the shipped
    plan does not shard): under sequence parallelism it runs as it does without, on the whole sequence on every
    rank. Its input is gathered (backward: this rank's chunk of the whole grad, the same on every rank) and its
    output cut back to this rank's shard (backward: all-gathered), so its parameters' grads are whole and are not
    summed. The one-block verification proves it per model (a module that reshapes its tokens is refused there).

    ``own_parameters`` as for :class:`GatherSequenceInput`: a region whose column projections all gather their
    outputs and that has no row projection (Qwen3-Next's linear attention) runs this way too, sharded inside as in
    plain tensor parallelism, its output whole on every rank."""

    def __init__(self, own_parameters: LocalParameters | None = None) -> None:
        super().__init__()
        self.own_parameters = own_parameters

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        entry = GatherSequenceInput(self.own_parameters, complete_grads=True)
        entry.src_data_rank = self.src_data_rank
        module = entry._apply(module, device_mesh)
        module.register_forward_hook(lambda _m, _args, out: _scatter_first(out, device_mesh))
        return module


def _scatter_first(out: object, device_mesh: DeviceMesh) -> object:
    """This rank's sequence shard of the hidden states (a module's output or its first element)."""
    if isinstance(out, tuple):
        return (scatter_to_tp(out[0], device_mesh, -2), *out[1:])
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"a module run on the whole sequence returned {type(out).__name__}, not its hidden states")
    return scatter_to_tp(out, device_mesh, -2)


class GatherSequenceOutput(ParallelStyle):
    """Leave the sequence-parallel region after this module (an encoder's last layer): its output is gathered to
    the full sequence for the replicated modules after it; backward keeps this rank's chunk of the (complete,
    identical on every rank) grad."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda _m, _args, out: _gather_first(out, device_mesh))
        return module


def _gather_first(out: object, device_mesh: DeviceMesh) -> object:
    """The hidden states (a layer's output or its first element) gathered over the sequence."""
    if isinstance(out, tuple):
        return (gather_from_tp(out[0], device_mesh, 1), *out[1:])
    return gather_from_tp(out, device_mesh, 1)


class _Both(ParallelStyle):
    """Two styles on one module (a one-layer encoder enters and leaves the sequence-parallel region)."""

    def __init__(self, first: ParallelStyle, second: ParallelStyle) -> None:
        super().__init__()
        self.first, self.second = first, second

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return self.second._apply(self.first._apply(module, device_mesh), device_mesh)


def _post_norm_modules(layer: nn.Module, rows: set[str], planned: set[str]) -> set[str]:
    """Modules of ``layer`` (names relative to it) that are post-norm sublayers or hold one: a module whose children
    are row projections of the plan (no other sharded ones) and a norm the plan leaves alone (BERT's
    ``attention.output``: dense, then LayerNorm of the residual sum; not an attention with norms inside it). That
    norm must run on sequence shards after the row projection's reduce-scatter, so such a module cannot be a region
    gathered whole: its children are the units."""
    found: set[str] = set()
    for name, module in layer.named_modules():
        children = {f"{name}.{n}" if name else n: m for n, m in module.named_children()}
        planned_children = [c for c in children if c in planned]
        if (
            planned_children
            and all(c in rows for c in planned_children)  # the sublayer's output part: no projections into it
            and any(c not in planned and _is_per_token(m) for c, m in children.items())
        ):
            parts = name.split(".") if name else []
            found |= {".".join(parts[: i + 1]) for i in range(len(parts))}
    return found


def _unplanned_in_regions(layer_list: nn.Module, regions: set[str], planned: set[str]) -> set[str]:
    """The modules inside a region that hold parameters the plan leaves replicated (DeepSeek's latent attention:
    ``q_a_proj``, ``q_a_layernorm``, ``kv_a_layernorm``), relative to the layer. Without sequence parallelism they
    sit before column projections, whose input grad is all-reduced, so their grads are whole; under it the column
    projections take the region's gathered input and leave the input grad partial over tp (the region's gather
    reduce-scatters it once), so these modules' grads are partial too and are summed over tp. For the same reason a
    ``RopeGradSum`` there (the rope slice of ``kv_a_proj_with_mqa``'s output grad all-reduced) becomes this sum of
    the whole module's grads: all-reducing the slice would count it tp times in the region's reduce-scatter."""
    found = set()
    for layer in layer_list:
        for region in regions:
            # the region's modules in this layer (none in a layer of another structure: hybrid models); a region
            # inside a list of sublayers names its items by ``*``
            blocks = [block for name, block in layer.named_modules() if name and fqn_matches(region, name)]
            found |= {
                f"{region}.{sub}"
                for block in blocks
                for sub, module in block.named_modules()
                if sub and f"{region}.{sub}" not in planned and any(True for _ in module.parameters(recurse=False))
            }
    return found


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _is_container(layer: nn.Module, path: list[str]) -> bool:
    """Whether ``path`` (relative to ``layer``, ``*`` for any item) names a list or dict of modules."""
    module: nn.Module | None = layer
    for atom in path:
        children = dict(module.named_children())
        module = next(iter(children.values()), None) if atom == "*" else children.get(atom)
        if module is None:
            return False
    return isinstance(module, _CONTAINERS)


def _holds_any(patterns: set[str], name: str) -> bool:
    """Whether the module ``name`` is one of ``patterns`` or holds one (a pattern under it)."""
    depth = name.count(".") + 1
    return any(
        fqn_matches(".".join(pattern.split(".")[:depth]), name)
        for pattern in patterns
        if pattern.count(".") >= depth - 1
    )


def _replicated_in_block(block: nn.Module, name: str, experts: str, sharded: set[str]) -> set[str]:
    """The modules of a mixture-of-experts block that hold parameters the plan leaves replicated (routers, shared
    experts' gates), relative to the layer: on sequence shards each sees only this rank's tokens, so their grads
    are summed over tp."""
    found = set()
    for child_name, child in block.named_children():
        key = f"{name}.{child_name}"
        if child_name == experts or key in sharded:
            continue
        # the child whole: its forward may read a submodule's weight itself (LongCat-Flash's router reads its
        # classifier's), so it runs on the shards in DTensor with everything it holds
        if any(True for _ in child.parameters()):
            found.add(key)
    return found
