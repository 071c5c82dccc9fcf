"""Plan-dict styles for ``torch.distributed.tensor.parallel.parallelize_module``.

``parallelize_module(model, mesh["tp"], {"layers.*.attn.qkv": ColumnParallel(), "layers.*.attn.out": RowParallel(),
...})`` shards ``nn.Linear`` / ``nn.Embedding`` submodules *in place* into meshpar's layers: parameters become
DTensors with the placements below and the forward runs on local shards with Megatron's collectives.

============================  ========================  =============================================
style                         weight placement          activations in -> out
============================  ========================  =============================================
ColumnParallel                Shard(0)                  replicated (or seq shard) -> features shard
PackedColumnParallel          Shard per packed part     replicated (or seq shard) -> [p0_r | p1_r ...]
RowParallel                   Shard(1), bias Replicate  features shard -> replicated (or seq shard)
VocabParallel                 Shard(0) (or Shard(1))    ids -> replicated (or seq shard) embeddings
SequenceParallelNorm          Replicate                 seq shard -> seq shard
============================  ========================  =============================================

A vocab-parallel LM head is ``ColumnParallel()`` (``gather_output=False``) feeding
:func:`meshpar.parallel_cross_entropy`. torch's own ``ColwiseParallel`` / ``RowwiseParallel`` work in the same plan
dicts for modules meshpar does not cover.
"""

from __future__ import annotations

import torch
from torch import nn

from meshpar._compat import DeviceMesh, ParallelStyle, Shard
from meshpar.tensor_parallel._collectives import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
)
from meshpar.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    ReplicatedKVLinear,
    RowParallelLinear,
    distribute_parameter,
    make_sequence_parallel_norm,
    make_vocab_parallel_subclass,
)
from meshpar.tensor_parallel.packed import PackedColumnParallelLinear


def describe_style(style: object) -> str:
    """A style as one readable line: its class and the arguments it holds (``ColumnParallel(gather_output=False,
    ...)``); nested styles described alike. What :class:`meshpar.hf.plans.HFPlan` prints."""
    if not isinstance(style, ParallelStyle):
        return repr(style)
    fields = []
    for name, value in vars(style).items():
        if name.startswith("_"):
            continue
        shown = describe_style(value) if isinstance(value, ParallelStyle) else repr(value)
        fields.append(f"{name}={shown}")
    return f"{type(style).__name__}({', '.join(fields)})"


def _require(module: nn.Module, cls: type, style: str) -> None:
    if type(module) is not cls:
        raise TypeError(f"{style} applies to {cls.__name__} modules, got {type(module).__name__}")


class ColumnParallel(ParallelStyle):
    """Shard an ``nn.Linear`` by output features; output is the local feature shard unless ``gather_output``.

    Pass ``num_heads`` for attention projections so that a head count tp does not divide fails at sharding time
    instead of silently splitting heads. ``allow_uneven`` (LM heads over a vocab tp does not divide) splits the
    output like ``torch.chunk``; pass the true ``vocab_size`` to :func:`meshpar.parallel_cross_entropy`.
    ``input_gathered``: the input was all-gathered over the sequence by the enclosing module
    (:class:`GatherSequenceInput`), whose backward reduce-scatter already sums the input grads.
    ``regather_input`` (with ``sequence_parallel``): keep only the input's sequence shard for backward and all-gather
    it again there, as Megatron does: ``1/tp`` of the saved input for one more all-gather per layer input.
    """

    def __init__(
        self,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        num_heads: int | None = None,
        allow_uneven: bool = False,
        input_gathered: bool = False,
        regather_input: bool = False,
    ) -> None:
        super().__init__()
        if regather_input and not sequence_parallel:
            raise ValueError("ColumnParallel(regather_input=True) needs sequence_parallel=True")
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.num_heads = num_heads
        self.allow_uneven = allow_uneven
        self.input_gathered = input_gathered
        self.regather_input = regather_input

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _require(module, nn.Linear, type(self).__name__)
        return ColumnParallelLinear.from_linear(
            module,
            device_mesh,
            gather_output=self.gather_output,
            sequence_parallel_enabled=self.sequence_parallel,
            src_data_rank=self.src_data_rank,
            num_heads=self.num_heads,
            allow_uneven=self.allow_uneven,
            input_gathered=self.input_gathered,
            regather_input=self.regather_input,
        )


class PackedColumnParallel(ParallelStyle):
    """Shard an ``nn.Linear`` whose output packs parts (``[q | k | v]``, ``[gate | up]``) per part: the output is
    ``[p0_r | p1_r | ...]`` (:mod:`meshpar.tensor_parallel.packed`). ``parts``: rows of each part; ``unit``: rows per
    head; an int: that many equal parts. ``input_gathered`` as for :class:`ColumnParallel`."""

    def __init__(
        self,
        *,
        parts: tuple[int, ...] | int,
        unit: int = 1,
        sequence_parallel: bool = False,
        input_gathered: bool = False,
    ) -> None:
        super().__init__()
        self.parts, self.unit, self.sequence_parallel = parts, unit, sequence_parallel
        self.input_gathered = input_gathered

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _require(module, nn.Linear, type(self).__name__)
        return PackedColumnParallelLinear.from_linear(
            module,
            device_mesh,
            parts=self.parts,
            unit=self.unit,
            sequence_parallel_enabled=self.sequence_parallel,
            input_gathered=self.input_gathered,
            src_data_rank=self.src_data_rank,
        )


class RowParallel(ParallelStyle):
    """Shard an ``nn.Linear`` by input features; output is all-reduced (reduce-scattered under SP).

    ``local_output``: the reduced output features are split over tp and each rank keeps its chunk (its grad
    all-gathered in backward): a per-head quantity computed from every local head's features, such as Doge's
    ``dt_proj`` (value heads -> one gate per head), whose consumers hold only this rank's heads.

    ``input_is_parallel=False`` with ``sequence_parallel``: the input is the whole sequence with every feature, the
    same on every rank (a region run as in plain tensor parallelism on the gathered sequence, see
    :class:`GatherSequenceInput`); each rank takes its features' slice (backward: all-gathered) and the output is
    reduce-scattered into sequence shards. (:class:`RowParallelLinear` itself refuses the pair, as Megatron's does:
    there the input of a sequence-parallel row layer is a sequence shard.)"""

    def __init__(
        self, *, input_is_parallel: bool = True, sequence_parallel: bool = False, local_output: bool = False
    ) -> None:
        super().__init__()
        if sequence_parallel and local_output:
            raise ValueError("RowParallel: local_output and sequence_parallel both shard the output; pick one")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.local_output = local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _require(module, nn.Linear, type(self).__name__)
        split_here = self.sequence_parallel and not self.input_is_parallel  # a whole input, split before the layer
        layer = RowParallelLinear.from_linear(
            module,
            device_mesh,
            input_is_parallel=self.input_is_parallel or split_here,
            sequence_parallel_enabled=self.sequence_parallel,
            src_data_rank=self.src_data_rank,
        )
        if split_here:
            layer.register_forward_pre_hook(lambda _m, args: (scatter_to_tp(args[0], device_mesh, -1), *args[1:]))
        if self.local_output:
            if layer.out_features % device_mesh.size():
                raise ValueError(
                    f"RowParallel(local_output=True): {layer.out_features} output features of {type(module).__name__} "
                    f"cannot be split over tp={device_mesh.size()}"
                )
            layer.register_forward_hook(lambda _m, _args, out: scatter_to_tp(out, device_mesh, -1))
        return layer


class ReplicatedKV(ParallelStyle):
    """Grouped-query K/V projection with fewer heads than tp ranks: replicate heads instead of splitting them."""

    def __init__(self, *, num_kv_heads: int) -> None:
        super().__init__()
        self.num_kv_heads = num_kv_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _require(module, nn.Linear, type(self).__name__)
        return ReplicatedKVLinear.from_linear(module, device_mesh, num_kv_heads=self.num_kv_heads)


class VocabParallel(ParallelStyle):
    """Shard an ``nn.Embedding`` over the vocabulary (or the embedding dim with ``shard_across_embedding``)."""

    def __init__(self, *, shard_across_embedding: bool = False, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.shard_across_embedding = shard_across_embedding
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding) and type(module) is not nn.Embedding:
            # a subclass with its own forward (Gemma's scaled embedding) keeps it; see make_vocab_parallel_subclass
            if self.shard_across_embedding or self.sequence_parallel:
                raise ValueError(
                    f"VocabParallel on {type(module).__name__} (an nn.Embedding subclass) shards the vocabulary "
                    "only: shard_across_embedding and sequence_parallel need a plain nn.Embedding"
                )
            return make_vocab_parallel_subclass(module, device_mesh, src_data_rank=self.src_data_rank)
        _require(module, nn.Embedding, type(self).__name__)
        return ParallelEmbedding.from_embedding(
            module,
            device_mesh,
            shard_across_embedding=self.shard_across_embedding,
            sequence_parallel_enabled=self.sequence_parallel,
            src_data_rank=self.src_data_rank,
        )


class SequenceParallelNorm(ParallelStyle):
    """A norm (LayerNorm, RMSNorm, any module that works row by row with its own parameters) run on sequence shards.

    torch's ``SequenceParallel`` mechanism: its parameters become ``Replicate()`` DTensors and its unchanged forward
    runs in DTensor on this rank's rows (hooks turn the input into a ``Shard(0)`` DTensor and the output back into
    local rows). Each rank sees only its sequence shard, so each parameter's grad is a partial sum, all-reduced as it
    is accumulated (Megatron's sequence-parallel grad all-reduce): the grads are complete and replicated when backward
    ends. Activations outside the norm stay local tensors.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return make_sequence_parallel_norm(module, device_mesh, src_data_rank=self.src_data_rank)


class GatherSequenceInput(ParallelStyle):
    """Sequence-parallel entry for a whole attention or MLP module: its ``hidden_states`` input (a sequence shard)
    is all-gathered once (backward: reduce-scatter), so code inside that reshapes by the input's sequence length sees
    the full sequence and several column layers share one gather (``ColumnParallel(input_gathered=True)``). The
    sequence is the second-to-last dim: ``[b, s, h]``, or the tokens of ``[tokens, h]`` (an MoE block's shared
    experts run on flattened tokens; a row layer's sequence-parallel reduce-scatter takes the same dim).

    ``own_parameters``: the module's own per-head parameters (an attention's ``sinks``), sharded as that style says;
    they meet the region's gathered, head-sharded activations, as without sequence parallelism.

    ``complete_grads``: the module runs as in plain tensor parallelism on the gathered sequence (its column layers
    all-reduce their input grads themselves, as a plan whose columns gather their outputs needs: OLMo-2's attention),
    so the grad reaching the gather is whole on every rank and its backward keeps this rank's chunk of it instead of
    reduce-scattering."""

    def __init__(self, own_parameters: LocalParameters | None = None, complete_grads: bool = False) -> None:
        super().__init__()
        self.own_parameters = own_parameters
        self.complete_grads = complete_grads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.own_parameters is not None:
            self.own_parameters.src_data_rank = self.src_data_rank
            module = self.own_parameters._apply(module, device_mesh)

        gather_sequence = gather_from_tp if self.complete_grads else gather_from_sp

        def gather(_module: nn.Module, args: tuple, kwargs: dict) -> tuple:
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": gather_sequence(kwargs["hidden_states"], device_mesh, -2)}
                return args, kwargs
            return (gather_sequence(args[0], device_mesh, -2), *args[1:]), kwargs

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


class ReplicatedGradSum(ParallelStyle):
    """Replicated parameters whose grads are partial over tp and must be summed: a norm between a column and a row
    layer that normalises each rank's own heads (Qwen3 / Gemma3 ``q_norm`` / ``k_norm``, transformers'
    ``replicated_with_grad_allreduce``). Forward unchanged; backward all-reduces the module's grads as one buffer
    (the mechanism of :class:`SequenceParallelNorm`, whose grads are partial over sequence shards instead)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return make_sequence_parallel_norm(module, device_mesh, src_data_rank=self.src_data_rank)


class LocalParameters(ParallelStyle):
    """A module whose own bare parameters are sharded: ``shards`` maps each parameter name to the dim it is split
    along (a ``Shard(dim)`` DTensor); its forward runs on the local shards, handed in by a pre-hook and put back by
    an always-called hook (no subclass, no replaced forward). Parameters not named stay as they are.

    Two uses in transformers' plans. ``local_params`` with ``colwise`` parameters (an attention's per-head
    ``sinks``): each shard only meets this rank's heads, inputs and output are already per rank.
    ``partial_output=True`` (``all_reduce`` over ``colwise`` / ``rowwise`` parameters: shared experts stored as 3-D
    weights) is Megatron's MLP around one module: every floating-point input enters through ``copy_to_tp`` (its grad
    summed over tp in backward) and the output, a partial sum over the rank's intermediate features, is all-reduced.
    The one-block verification proves either per model.

    Why the local shards are handed in rather than the forward run in DTensor: the module's forward combines these
    parameters with activations that are already per rank (this rank's heads, its intermediate features) as plain
    tensors, which DTensor refuses to mix, and torch's styles have no layout for them (transformers keeps such
    parameters as plain local tensors, losing their global layout for DCP).

    A shard given as ``(dim, parts)`` splits a packed parameter (``[gate | up]`` along ``dim``) per part: it is kept
    as ``[..., parts, size / parts, ...]`` sharded on the part rows, checkpointed in the model's shape
    (``checkpoint_shapes``, :mod:`meshpar._stored_layout`), and the forward gets this rank's rows of every part
    merged back along ``dim`` (a view)."""

    def __init__(self, shards: dict[str, int | tuple[int, int]], *, partial_output: bool = False) -> None:
        super().__init__()
        self.shards = {name: spec if isinstance(spec, tuple) else (spec, 1) for name, spec in shards.items()}
        self.partial_output = partial_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        # a pattern may name modules of which only some hold the parameters (MiMo-V2's sliding-window attentions have
        # sinks, its full attentions none): the others run as they are, unless their output is meant to be partial
        shards = {n: d for n, d in self.shards.items() if module._parameters.get(n) is not None}
        if not shards and not self.partial_output:
            return module
        merged: dict[str, int] = {}  # packed parameters: the dim their parts are merged back along
        for name, (dim, parts) in self.shards.items():
            param = module._parameters.get(name)
            if param is None:
                if not self.partial_output:
                    continue
                raise ValueError(f"LocalParameters: {type(module).__name__} has no parameter {name!r}")
            dim %= param.dim()
            if param.shape[dim] % (tp * parts):
                raise ValueError(
                    f"LocalParameters: {type(module).__name__}.{name} of shape {tuple(param.shape)} cannot be split "
                    f"along dim {dim}" + (f" into {parts} parts" if parts > 1 else "") + f" over tp={tp}"
                )
            if parts > 1:
                shapes = module.__dict__.setdefault("checkpoint_shapes", {})
                shapes[name] = tuple(param.shape)
                param, merged[name] = nn.Parameter(param.detach().unflatten(dim, (parts, -1)), param.requires_grad), dim
                dim += 1
            module._parameters[name] = distribute_parameter(param, device_mesh, [Shard(dim)], self.src_data_rank)
        names = tuple(shards)
        saved: list[dict[str, nn.Parameter]] = []

        def local(name: str, param: nn.Parameter) -> torch.Tensor:
            shard = param.to_local()
            return shard.flatten(merged[name], merged[name] + 1) if name in merged else shard

        def to_local(_module: nn.Module, _args: tuple) -> None:
            params = _module._parameters
            saved.append({n: params[n] for n in names})
            params.update({n: local(n, params[n]) for n in names})

        def restore(_module: nn.Module, _args: tuple, _out: object) -> None:
            if saved:
                _module._parameters.update(saved.pop())

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore, always_call=True)
        if self.partial_output:

            def enter(_module: nn.Module, args: tuple, kwargs: dict) -> tuple:
                def f(x: object) -> object:
                    return copy_to_tp(x, device_mesh) if torch.is_tensor(x) and x.is_floating_point() else x

                return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}

            module.register_forward_pre_hook(enter, with_kwargs=True)
            AllReduceOutput()._apply(module, device_mesh)
        return module


class AllReduceOutput(ParallelStyle):
    """The module's output is a partial sum over tp ranks (its inputs were feature shards): all-reduce it forward,
    identity backward (transformers' ``all_reduce``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda _m, _args, out: reduce_from_tp(out, device_mesh))
        return module


class RopeGradSum(ParallelStyle):
    """DeepSeek-style MLA ``kv_a_proj_with_mqa`` (transformers' ``mla_kv_a_proj``): the last ``qk_rope_head_dim``
    output features bypass the column-parallel ``kv_b_proj`` and feed every rank's heads directly, so their grad is
    partial over tp and is all-reduced in backward; the rest of the output is left alone."""

    def __init__(self, *, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope_dim = self.rope_dim

        def hook(_module: nn.Module, _args: tuple, out: object) -> object:
            passed, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
            return torch.cat([passed, copy_to_tp(rope, device_mesh)], dim=-1)

        module.register_forward_hook(hook)
        return module
