"""``neuronx_distributed.pipeline.model``: ``NxDPPModel(module, ...)`` with NxD's arguments, translated to meshpar's
pipeline (:mod:`meshpar.pipeline.model`): the split decided once, this rank's stages built once, run by meshpar's
executor with ``run_train`` / ``run_eval``.

Two ways to cut the module, both keeping the original FQNs. Given a ``loss_fn`` (meshpar's keyword), the module is
split by structure (the layers of ``transformer_layer_cls`` in one container, :mod:`meshpar.pipeline.split`) and
stages run the module's own submodules; the last stage computes ``loss_fn(output, **microbatch)``. Without one (NxD's
own usage: the loss is computed inside ``forward`` and picked with ``output_loss_value_spec``), or when one of NxD's
tracing arguments is given (``leaf_module_cls``, ``autowrap_functions``, ``autowrap_modules``, ``tracer_cls``), the
forward is traced with torch.fx and cut after layers (:mod:`meshpar.pipeline.trace`).
Every stage receives the microbatch's keyword inputs; the first stage calls the module with the ``input_names``
inputs, later stages with the received activation. Without ``pipeline_cuts`` (``auto_partition`` or not) the layers
are placed as NxD places them: evenly, the remainder on the last stages.

When it is built: with ``pipeline_cuts``, ``auto_partition``, ``manual_pp_partition``, ``input_names`` or ``loss_fn``,
at construction. A traced pipeline given none of them is traced at its first ``run_train`` / ``run_eval`` over the
names of that step's inputs, as NxD does (an optional argument such as a mask or the labels is an input exactly when
the step gives it); until then ``local_*`` raise (NxD's rule), ``parameters()`` is every parameter of the model, and
LoRA adapters go into the model before the trace. A traced pipeline's every step must give exactly its traced
inputs: an input the trace does not take would be ignored. NxD's post-partition hooks (``trainer.hooks``) run when
the stages are built. An attribute the pipeline lacks is the wrapped model's, as in NxD. Without
``output_loss_value_spec`` and ``loss_fn`` there is no loss: ``run_eval`` returns the last stage's outputs (NxD's
rule), ``run_train`` takes the output as the loss.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from meshpar._compat import IncompatibleKeys
from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.compat.nxd.pipeline.timeline import PPTimeline
from meshpar.failure import stop_all_ranks_on_error
from meshpar.parallel_dims import ParallelDims, check_virtual_pipeline_size, get_parallel
from meshpar.pipeline.executor import check_pipeline_schedule
from meshpar.pipeline.model import PipelineModel, StageChunk
from meshpar.pipeline.split import build_stages, plan_stages
from meshpar.pipeline.tied import merged_groups, tied_parameter_groups
from meshpar.pipeline.trace import leaf_classes, traced_input_names, traced_stages
from meshpar.pipeline.trace import trace as fx_trace
from meshpar.replicas import make_replicas_equal

_log = logging.getLogger(__name__)

__all__ = ["INPUTS_ARG_NAME", "LABLES_ARG_NAME", "NxDPPModel", "mark_timeline"]


@contextmanager
def mark_timeline(timeline: PPTimeline, msg: str) -> Iterator[None]:
    """A span named ``msg`` on ``timeline`` around the block (ended even if the block raises)."""
    timeline.mark_event_start(msg)
    try:
        yield
    finally:
        timeline.mark_event_end(msg)


INPUTS_ARG_NAME = "inputs"  # a manually partitioned pipeline's model input
LABLES_ARG_NAME = "labels"  # and its labels (NxD's spelling)


def _pick_loss(output: Any, spec: Any) -> torch.Tensor:
    """NxD's ``output_loss_value_spec``: ``True`` (or meshpar's ``None``) the output is the loss; ``(True, False)``
    picks from a tuple, ``{"loss": True, ...}`` from a dict (or HF ``ModelOutput``, also by a key string)."""
    if spec is None or spec is True:
        return output
    if isinstance(spec, str):
        return output[spec]
    if isinstance(spec, dict):
        picked = [output[key] for key, take in spec.items() if take]
    else:  # by position: an HF ModelOutput's fields in order (iterating one would give its keys)
        values = output.to_tuple() if hasattr(output, "to_tuple") else output
        picked = [o for o, take in zip(values, spec, strict=True) if take]
    if len(picked) != 1:
        raise ValueError(f"output_loss_value_spec {spec} must select exactly one output")
    return picked[0]


def _leaf_classes(module: nn.Module | None, leaf_module_cls: Sequence[Any] | None) -> list[type]:
    """``leaf_module_cls`` as classes (NxD also takes class names: each resolves to the classes of that name among
    the model's modules) plus NxD's parallel layers, MoE layer and LoRA layers, which the tracer never enters (their
    collectives are leaves; the MoE's routing depends on the values it routes; a LoRA layer branches on its input's
    dtype)."""
    from meshpar.compat.nxd.modules.lora.layer import LoraLayer
    from meshpar.compat.nxd.modules.moe import MoE
    from meshpar.compat.nxd.modules.qkv_linear import GQAQKVColumnParallelLinear
    from meshpar.compat.nxd.parallel_layers import PARALLEL_MODULES

    classes: list[type] = [*PARALLEL_MODULES, GQAQKVColumnParallelLinear, MoE, LoraLayer]
    names = {type(m).__name__: type(m) for m in module.modules()} if module is not None else {}
    for entry in leaf_module_cls or ():
        if isinstance(entry, str):
            if entry not in names:
                raise ValueError(f"leaf_module_cls names {entry!r}, which is the class of no module in the model")
            classes.append(names[entry])
        else:
            classes.append(entry)
    return classes


def get_model_layers(module: nn.Module, target_module_type: type | tuple[type, ...]) -> list[str]:
    """The FQNs of ``module``'s ``target_module_type`` layers in order (not looking inside one), as NxD lists them."""
    found = []
    for name, child in module.named_children():
        if isinstance(child, target_module_type):
            found.append(name)
        else:
            found.extend(f"{name}.{inner}" for inner in get_model_layers(child, target_module_type))
    return found


def _nxd_cuts(module: nn.Module, layer_cls: type | tuple[type, ...] | None, stages: int) -> list[str] | None:
    """NxD's own placement when no ``pipeline_cuts`` are given (``auto_partition`` or not): its transformer layers
    dealt out evenly, the remainder to the last stages (``partition.create_partitions``). meshpar's even split
    gives it to the first ones; NxD's is kept so that each pp rank holds the layers it holds under NxD (its
    per-pp-rank checkpoint files then load here)."""
    if layer_cls is None or stages == 1:
        return None
    from meshpar.compat.nxd.pipeline.partition import create_partitions

    names = get_model_layers(module, layer_cls)
    if not names:
        raise ValueError(f"NxDPPModel: the model has no {layer_cls} layers (transformer_layer_cls) to place on stages")
    return create_partitions(stages, names)


class _ManualStages(nn.Module):
    """The layers of a manually partitioned pipeline as one module (``layers.0`` ... ``layers.N``): stage ``s``
    runs its layers in order on the previous stage's output. NxD passes stage outputs as lists: a one-tensor list
    or tuple crosses a cut as its tensor (the next layer takes either, as NxD's do)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = _UnwrappingSequential(*layers)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.layers(inputs)


class _UnwrappingSequential(nn.Sequential):
    def forward(self, x: Any) -> Any:
        for layer in self:
            x = layer(x)
        return x[0] if isinstance(x, (list, tuple)) and len(x) == 1 else x


def _manual_placement(layers: Sequence[nn.Module], stages: int, partition_fn: Callable[..., Any] | None) -> dict:
    """``partition_fn(layers, stages)``: each layer's stage (NxD's default: ``len(layers) // stages`` layers each,
    the remainder on the last stage)."""
    from meshpar.compat.nxd.pipeline.manual_pipe_stage import PipelineStageModule

    return (partition_fn or PipelineStageModule._partition_evenly)(layers, stages)


def _manual_cuts(layers: Sequence[nn.Module], stages: int, mapping: dict) -> list[str]:
    """The cut after each stage's last layer of the placement ``mapping``; stages must be contiguous."""
    order = [mapping[layer] for layer in layers]
    if order != sorted(order) or sorted(set(order)) != list(range(stages)):
        raise ValueError(
            f"manual_pp_stage_partition_fn must give every stage 0..{stages - 1} contiguous layers: {order}"
        )
    return [f"layers.{i}" for i in range(len(order) - 1) if order[i + 1] != order[i]]


def _with_nxd_leaves(module: nn.Module, tracing: dict[str, Any]) -> dict[str, Any]:
    """NxD's tracing arguments with NxD's own leaves added: its parallel layers and functions (collectives) and the
    modules of :func:`_leaf_classes`."""
    from meshpar.compat.nxd.parallel_layers import PARALLEL_FUNCTIONS

    return {
        **tracing,
        "leaf_module_cls": _leaf_classes(module, tracing["leaf_module_cls"]),
        "autowrap_functions": (*PARALLEL_FUNCTIONS, *(tracing["autowrap_functions"] or ())),
    }


def _splits_as_hf(module: nn.Module, tracer_cls: Any) -> bool:
    """Whether a pipeline NxD would trace with transformers' fx tracer (``tracer_cls`` ``"hf"``, or none for an HF
    model) is cut by the model's structure instead (:func:`_hf_stages`): transformers 5 has no fx tracer, and its
    models' forwards build masks with control flow on their inputs that torch.fx cannot trace."""
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel) and tracer_cls in (None, "hf")


def _hf_arguments(module: nn.Module) -> list[str]:
    """The named arguments of an HF model's forward: what a step of its pipeline may give."""
    parameters = inspect.signature(module.forward).parameters.values()
    return [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _hf_stages(
    build: dict[str, Any], pipeline_cuts: Sequence[str] | None, auto_partition: bool
) -> tuple[list[StageChunk], Any]:
    """This rank's stage chunks of an HF model as HF ``parallelize`` builds them (:mod:`meshpar.hf.stages`: the
    model's own forward on every stage, transformers' pipeline plan or one read off the model, proven on the dense
    model), cut after ``transformer_layer_cls`` layers as NxD cuts them. The microbatch's inputs reach every stage;
    those only the model's head takes (the labels) reach the last stage's forward alone, which returns what the
    model's forward returns, so ``output_loss_value_spec`` picks the loss the model computes itself (NxD's usage)."""
    from meshpar.hf.stages import decoder_pipeline_plan, install_decoder_stage

    module, dims = build["module"], build["dims"]
    if getattr(module.config, "is_encoder_decoder", False):
        raise NotImplementedError(
            f"NxDPPModel of {type(module).__name__}: an encoder-decoder's stages need the encoder's output on every "
            "decoder stage; use meshpar.parallelize, which pipelines encoder-decoders"
        )
    if build["input_names"] is not None and "input_ids" not in build["input_names"]:
        raise ValueError(
            f"NxDPPModel of {type(module).__name__}: input_names {list(build['input_names'])} must include "
            "'input_ids' (every stage runs the model's own forward on the token ids)"
        )
    layout, plan = decoder_pipeline_plan(
        module, dims.pp * build["virtual_pipeline_size"], transformer_layer_cls=build["transformer_layer_cls"],
        pipeline_cuts=pipeline_cuts, auto_partition=auto_partition,
    )  # fmt: skip
    base = module.get_submodule(layout.base) if layout.base else module
    arguments = _hf_arguments(module)
    head_only = [name for name in arguments if name not in _hf_arguments(base)]
    stages = build_stages(
        module, plan, dims.pp_rank, dims.pp, keep_modules=layout.keep, device=dims.device, share_tensors=True
    )
    chunks = [
        StageChunk(install_decoder_stage(stage, layout, own_loss_inputs=head_only), index, ["input_ids"], arguments)
        for index, stage in stages
    ]
    return chunks, plan


def _built_stages(
    build: dict[str, Any],
    pipeline_cuts: Sequence[str] | None,
    auto_partition: bool,
    tracing: dict[str, Any] | None,
    traced: torch.fx.GraphModule | None = None,
) -> tuple[list[StageChunk], Any]:
    """This rank's stage chunks and the plan: the forward traced with torch.fx (or ``traced``, the trace
    :meth:`NxDPPModel.trace` made) and cut after layers (``tracing``: NxD's tracing arguments), or the module split
    by structure."""
    module, dims = build["module"], build["dims"]
    common = {
        "transformer_layer_cls": build["transformer_layer_cls"],
        "pipeline_cuts": pipeline_cuts,
        "auto_partition": auto_partition,
    }
    if tracing is not None and _splits_as_hf(module, tracing["tracer_cls"]):
        _leaf_classes(module, tracing["leaf_module_cls"])  # names that match no module are refused as in NxD
        return _hf_stages(build, pipeline_cuts, auto_partition)
    if tracing is not None:
        tracing = _with_nxd_leaves(module, tracing)
        stages, plan = traced_stages(
            module, dims.pp_rank, dims.pp, input_names=build["input_names"],
            virtual_pipeline_size=build["virtual_pipeline_size"], device=dims.device, traced=traced, **common,
            **tracing,
        )  # fmt: skip
        # each traced stage reads the model inputs it needs from the microbatch, by name
        return [StageChunk(stage, index, (), reads) for index, stage, reads in stages], plan
    plan = plan_stages(module, dims.pp * build["virtual_pipeline_size"], **common)
    stages = build_stages(
        module, plan, dims.pp_rank, dims.pp, param_init_fn=build["param_init_fn"], device=dims.device,
        share_tensors=True,
    )  # fmt: skip
    return [StageChunk(stage, index, build["input_names"]) for index, stage in stages], plan


class NxDPPModel(PipelineModel):
    """NxD's pipeline model, with NxD's arguments in NxD's order. Grads after :meth:`run_train` are those of the mean
    loss over the microbatches, averaged over dp (NxD's default); with ``use_zero1_optimizer`` the ZeRO-1 optimizer
    averages them, with ``use_model_wrapper`` (set by ``initialize_parallel_model``) NxD's optimizer wrapper does.

    Arguments of NxD's that tune its XLA runtime (``_all_reduce_send_recv``, ``_fused_send_recv``, ``_fused_fwd_bwd``,
    ``_mark_step_*``, ``_deallocate_send_tensors``, ``_use_gloo_for_metadata_comm``, ``_turn_off_odd_even_scheduler``,
    ``_delay_tracing``, ``use_optimizer_wrapper``) change nothing here; ``autowrap_obj_methods``,
    ``fuse_microbatches`` and ``_debug_mode`` are refused."""

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        transformer_layer_cls: type | None = None,
        num_microbatches: int = 1,
        virtual_pipeline_size: int = 1,
        output_loss_value_spec: Any = None,
        return_mb_loss: bool = False,
        broadcast_and_average_loss: bool = False,
        use_zero1_optimizer: bool = False,
        use_model_wrapper: bool = False,
        use_optimizer_wrapper: bool = False,
        pipeline_cuts: Sequence[str] | None = None,
        input_names: Sequence[str] | None = None,
        leaf_module_cls: Sequence[Any] | None = None,
        autowrap_functions: tuple | None = None,
        autowrap_modules: tuple | None = None,
        autowrap_obj_methods: dict | None = None,
        tracer_cls: Any = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        trace_file_path: str | None = None,
        return_loss_on_cpu: bool = True,
        deallocate_pipeline_outputs: bool = False,
        auto_partition: bool = False,
        fuse_microbatches: bool = False,
        manual_pp_partition: bool = False,
        manual_pp_stage_partition_fn: Callable[..., Any] | None = None,
        manual_pp_loss_fn: Callable[..., torch.Tensor] | None = None,
        _delay_tracing: bool = False,
        _turn_off_odd_even_scheduler: bool = False,
        _all_reduce_send_recv: bool = False,
        _fused_send_recv: bool = False,
        _fused_fwd_bwd: bool = False,
        _mark_step_before_pp_runtime: bool = True,
        _mark_step_after_pp_runtime: bool = True,
        _deallocate_send_tensors: bool = True,
        _use_gloo_for_metadata_comm: bool = False,
        _debug_mode: bool = False,
        _debug_pp_size: int = 8,
        _debug_pp_rank: int = 0,
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        overlap_grad_reduce: bool = False,
        schedule: str = "1f1b",
        dims: ParallelDims | None = None,
    ) -> None:
        for name, value in (("autowrap_obj_methods", autowrap_obj_methods), ("fuse_microbatches", fuse_microbatches),
                            ("_debug_mode", _debug_mode)):  # fmt: skip
            if value:
                raise NotImplementedError(f"NxDPPModel({name}=...) is not supported by meshpar's pipeline")
        if return_mb_loss and broadcast_and_average_loss:
            raise ValueError("NxDPPModel: broadcast_and_average_loss=True requires return_mb_loss=False (as in NxD)")
        if pipeline_cuts is not None and auto_partition:
            raise ValueError("NxDPPModel: pass pipeline_cuts or auto_partition=True, not both (as in NxD)")
        original = module
        shared_groups: dict[str, list[tuple[int, int, str]]] = {}
        if manual_pp_partition:
            if not isinstance(module, (list, tuple)):
                raise ValueError("NxDPPModel(manual_pp_partition=True) takes the model as a list of layers")
            from meshpar.compat.nxd.pipeline.manual_pipe_stage import shared_weight_groups

            layers = list(module)
            dims_for_cuts = dims if dims is not None else get_parallel()
            placement = _manual_placement(layers, dims_for_cuts.pp, manual_pp_stage_partition_fn)
            pipeline_cuts = _manual_cuts(layers, dims_for_cuts.pp, placement)
            shared_groups = shared_weight_groups(layers, placement)
            module = _ManualStages(layers)
            input_names = [INPUTS_ARG_NAME]
            if manual_pp_loss_fn is not None and loss_fn is None:

                def loss_fn(output: torch.Tensor, **microbatch: torch.Tensor) -> torch.Tensor:
                    return manual_pp_loss_fn(output, microbatch[LABLES_ARG_NAME])

            elif loss_fn is None:
                output_loss_value_spec = True
        elif isinstance(module, (list, tuple)):
            raise ValueError("NxDPPModel takes a list of layers only with manual_pp_partition=True")
        tracing = {
            "leaf_module_cls": leaf_module_cls,
            "autowrap_functions": autowrap_functions,
            "autowrap_modules": autowrap_modules,
            "tracer_cls": tracer_cls,
        }
        trace_it = loss_fn is None or any(value is not None for value in tracing.values())
        if trace_it and param_init_fn is not None:
            raise NotImplementedError(
                "NxDPPModel: a traced pipeline (no loss_fn, or a tracing argument) takes no param_init_fn: build the "
                "model on CPU, or pass loss_fn to split it by structure"
            )
        # NxD partitions at construction only given cuts (or auto_partition); a traced pipeline without them is
        # traced at its first step, over the names of that step's inputs (or when the user calls trace /
        # cut_pipeline_stage / partition first), so its stages exist only from then on. Given input_names, the
        # trace's inputs are known: it is built now, at NxD's first-step placement (every step must then give those
        # inputs); so is a split by structure (meshpar's loss_fn), which has no inputs to learn.
        partitioned = pipeline_cuts is not None or auto_partition or manual_pp_partition
        deferred = trace_it and not partitioned and input_names is None
        if dims is None and not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("NxDPPModel: call initialize_model_parallel(...) before building the pipeline model")
        if deferred and transformer_layer_cls is None:
            raise ValueError("NxDPPModel requires transformer_layer_cls (the layers the pipeline is cut after)")
        if dims is None and not deferred:
            dims = get_parallel()
        pp = dims.pp if dims is not None else parallel_state.get_pipeline_model_parallel_size()
        pp_rank = dims.pp_rank if dims is not None else parallel_state.get_pipeline_model_parallel_rank()
        if virtual_pipeline_size > 1 and num_microbatches < pp:
            raise ValueError(f"num_microbatches={num_microbatches} must be >= pp={pp} with virtual_pipeline_size > 1")
        check_virtual_pipeline_size(pp, virtual_pipeline_size)
        check_pipeline_schedule(schedule, virtual_pipeline_size)
        if deferred and not get_model_layers(module, transformer_layer_cls):
            raise ValueError(f"NxDPPModel: the model has no {transformer_layer_cls} layers (transformer_layer_cls)")
        if pipeline_cuts is None and not manual_pp_partition and not deferred:
            pipeline_cuts = _nxd_cuts(module, transformer_layer_cls, pp * virtual_pipeline_size)
            auto_partition = auto_partition and pipeline_cuts is None
        build = {
            "module": module, "dims": dims, "input_names": input_names, "transformer_layer_cls": transformer_layer_cls,
            "virtual_pipeline_size": virtual_pipeline_size, "param_init_fn": param_init_fn,
        }  # fmt: skip
        chunks = plan = None
        if not deferred:
            # every rank built the whole model: the first rank's values along pp and dp before splitting (DDP's
            # rule; tp-sharded parameters by their shards, which these ranks share); a meta-built model has none yet
            make_replicas_equal(module, dims, over=("pp", "dp"))
            chunks, plan = _built_stages(build, pipeline_cuts, auto_partition, tracing if trace_it else None)

        def picked_loss(output: Any, **microbatch: torch.Tensor) -> torch.Tensor:
            if loss_fn is not None:
                return loss_fn(output, **microbatch)
            return _pick_loss(output, output_loss_value_spec)

        # weight-sharing groups marked by hand (``mark_weight_sharing``), by their FQNs in the stages
        manual_groups = {name: sorted({f"layers.{index}.{path}" for _, index, path in entries})
                         for name, entries in shared_groups.items()}  # fmt: skip
        optimizer_reduces = use_zero1_optimizer or use_model_wrapper
        dp_mode = "overlapped" if overlap_grad_reduce else ("optimizer" if optimizer_reduces else "allreduce")
        super().__init__(
            chunks,
            plan,
            dims,
            num_microbatches=num_microbatches,
            loss_fn=picked_loss,
            schedule=schedule,
            dp_mode=dp_mode,
            # run_train ends with the dp mean of the grads unless an optimizer (wrapper) reduces them
            average_grads_over_dp=not optimizer_reduces,
            broadcast_loss=broadcast_and_average_loss,
            deallocate_pipeline_outputs=deallocate_pipeline_outputs,
            grads_over_cp=False,  # NxD averages grads over cp itself (grads.allreduce_context_parallel_gradients)
            # a weight the model ties (a GPT-2 embedding and LM head) or one marked shared stays one weight
            tied_parameters=merged_groups([*tied_parameter_groups(module), *manual_groups.values()]),
        )
        self._manual_groups = {name: next(g for g in self.tied_parameter_groups if set(group) <= set(g))
                               for name, group in manual_groups.items() if len(group) > 1}  # fmt: skip
        self.original_torch_module = original
        self._build = build
        self.partitioned = partitioned
        self.pipeline_cuts: list[str] = list(pipeline_cuts or []) if partitioned else []
        self._tracing: dict[str, Any] | None = None  # what trace() was given, until partition()
        self.traced_model: torch.fx.GraphModule | None = None  # NxD's: the forward trace() traced, cuts marked
        # a deferred pipeline: the tracing arguments its first step builds it with (at NxD's placement)
        self._first_step = tracing if deferred else None
        # a traced pipeline's input names: every step must give exactly these (NxD's rule)
        traced = trace_it and not deferred and not manual_pp_partition
        # an HF model split by its structure (no trace): its steps give any of its forward's arguments
        self._hf_split = trace_it and not manual_pp_partition and _splits_as_hf(module, tracer_cls)
        traced = traced and not (self._hf_split and input_names is None)
        self._traced_inputs = set(traced_input_names(module, input_names)) if traced else None
        self._after_partition: list[Callable[[], None]] = []
        self.model_moved_to_device = not deferred
        self.transformer_layer_cls = transformer_layer_cls
        self.output_loss_value_spec = output_loss_value_spec
        # NxD's pipeline without a loss (no output_loss_value_spec, no loss function): run_eval returns the outputs
        self._evaluates_outputs = output_loss_value_spec is None and loss_fn is None
        self.return_mb_loss = return_mb_loss
        self.return_loss_on_cpu = return_loss_on_cpu
        self.use_model_wrapper, self.use_zero1_optimizer = use_model_wrapper, use_zero1_optimizer
        self.pipeline_parallel_size, self.pipeline_parallel_rank = pp, pp_rank
        self.virtual_pipeline_size = virtual_pipeline_size
        self.timeline = PPTimeline(trace_file_path, pp_rank)  # NxD's trace file: a timeline of the steps
        if chunks is not None:
            self._point_model_at_stages()
        if chunks is not None and not manual_pp_partition:  # NxD runs them when it partitions (here: built)
            from meshpar.compat.nxd.trainer import hooks

            hooks.execute_all_hooks(self)

    # -- NxD's step-by-step partitioning: trace, cut, partition (before the first step) ---------------------------
    def trace(
        self,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        input_names: Sequence[str] | None = None,
        leaf_modules: Sequence[Any] | None = None,
        autowrap_functions: Sequence[Callable] | None = None,
        autowrap_modules: Sequence[Any] | None = None,
        autowrap_obj_methods: dict | None = None,
        tracer_cls: Any = None,
    ) -> None:
        """NxD's first step of partitioning by hand: the forward traced with torch.fx into :attr:`traced_model`
        (``transformer_layer_cls`` and NxD's parallel layers leaves; ``input_names`` default to ``kwargs``' keys),
        on which :meth:`cut_pipeline_stage` marks the cuts; :meth:`partition` builds the stages at them. Skipped,
        as in NxD, once the model is partitioned."""
        if self.partitioned or self._tracing is not None:
            _log.warning("NxDPPModel.trace(): the model is traced or partitioned already; nothing to do")
            return
        if self.transformer_layer_cls is None:
            raise RuntimeError("NxDPPModel.trace() needs transformer_layer_cls (the layers the cuts fall after)")
        if args:
            raise NotImplementedError("NxDPPModel.trace(args=...): give the traced inputs by name (input_names)")
        if autowrap_obj_methods:
            raise NotImplementedError("NxDPPModel.trace(autowrap_obj_methods=...) is not supported by meshpar")
        if self._build["param_init_fn"] is not None:
            raise NotImplementedError("NxDPPModel: a traced pipeline takes no param_init_fn: build the model on CPU")
        if input_names is None and kwargs:
            input_names = list(kwargs)
        tracing = {
            "leaf_module_cls": leaf_modules, "autowrap_functions": autowrap_functions,
            "autowrap_modules": autowrap_modules, "tracer_cls": tracer_cls,
        }  # fmt: skip
        module = self._build["module"]
        if self._hf_split or _splits_as_hf(module, tracer_cls):  # cut by structure: nothing to trace
            _leaf_classes(module, leaf_modules)
            self._hf_split = True
            self._build = {**self._build, "input_names": input_names}
            self._tracing = tracing
            return
        leafy = _with_nxd_leaves(module, tracing)
        traced = fx_trace(
            module, traced_input_names(module, input_names),
            leaf_classes(self.transformer_layer_cls, leafy["leaf_module_cls"]), tracer_cls=tracer_cls,
            autowrap_modules=autowrap_modules, autowrap_functions=leafy["autowrap_functions"],
        )  # fmt: skip
        object.__setattr__(self, "traced_model", traced)  # not a submodule: it holds the model's own modules
        self._build = {**self._build, "input_names": input_names}
        self._tracing = tracing

    def cut_pipeline_stage(self, cut_point: str) -> None:
        """Mark a stage boundary after the layer ``cut_point`` (after :meth:`trace`, before :meth:`partition`): its
        call in :attr:`traced_model` gets ``meta["partition"] = True`` (NxD's mark, which
        :func:`~meshpar.compat.nxd.pipeline.partition.partition_traced_model` splits at)."""
        if cut_point in self.pipeline_cuts:
            raise AssertionError(f"cut_pipeline_stage({cut_point!r}): that cut is marked already")
        if self.partitioned:
            raise AssertionError(f"cut_pipeline_stage({cut_point!r}): the model is partitioned already")
        if self._tracing is None:
            raise AssertionError("cut_pipeline_stage() comes after trace()")
        if self._hf_split:  # an HF model is cut by its structure: after one of its layers
            if cut_point not in get_model_layers(self._build["module"], self.transformer_layer_cls):
                raise RuntimeError(f"cut_pipeline_stage({cut_point!r}): the model has no transformer layer so named")
        else:
            graph = self.traced_model.graph
            calls = [n for n in graph.nodes if n.op == "call_module" and n.target == cut_point]
            if not calls:
                raise RuntimeError(f"cut_pipeline_stage({cut_point!r}): the traced model calls no module so named")
            calls[0].meta["partition"] = True
        self.pipeline_cuts.append(cut_point)

    def partition(self) -> None:
        """Build this rank's stages at the marked cuts (one per stage boundary of pp x virtual_pipeline_size) in
        place of the placement built when the model was constructed. Skipped, as in NxD, once partitioned."""
        if self.partitioned:
            _log.warning("NxDPPModel.partition(): the model is partitioned already; nothing to do")
            return
        stages = self.pipeline_parallel_size * self._build["virtual_pipeline_size"]
        if len(self.pipeline_cuts) + 1 != stages:
            raise ValueError(
                f"NxDPPModel.partition(): {len(self.pipeline_cuts)} cuts make {len(self.pipeline_cuts) + 1} stages, "
                f"but the pipeline has {stages} (pp x virtual_pipeline_size)"
            )
        if self._tracing is None:
            raise AssertionError("NxDPPModel.partition() comes after trace()")
        self._install(self.pipeline_cuts, self._tracing, self._build["input_names"], self.traced_model)
        self.partitioned = True

    def _install(
        self,
        cuts: Sequence[str] | None,
        tracing: dict[str, Any],
        input_names: Sequence[str] | None,
        traced: torch.fx.GraphModule | None = None,
    ) -> None:
        """Cut the module's trace over ``input_names`` (``traced``, or traced now) at ``cuts`` and run this rank's
        stages from now on; a pipeline deferred to its first step takes its mesh and makes its replicas equal first.
        Then the callbacks waiting for the stages run, and NxD's post-partition hooks (``trainer.hooks``), as NxD
        runs them."""
        module = self._build["module"]
        if self.dims is None:
            self.dims = get_parallel()
            make_replicas_equal(module, self.dims, over=("pp", "dp"))
        build = {**self._build, "dims": self.dims, "input_names": input_names}
        chunks, plan = _built_stages(build, cuts, False, tracing, traced)
        self.install_stages(chunks, plan)
        self._point_model_at_stages()
        hf_any = self._hf_split and input_names is None  # any arguments of its forward (checked at each step)
        self._traced_inputs = None if hf_any else set(traced_input_names(module, input_names))
        self._first_step = None
        self.model_moved_to_device = True
        callbacks, self._after_partition = self._after_partition, []
        for callback in callbacks:
            callback()
        from meshpar.compat.nxd.trainer import hooks

        hooks.execute_all_hooks(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused, as in NxD: a pipeline runs whole steps."""
        raise RuntimeError("NxDPPModel.forward() is not supported (as in NxD): use run_train() or run_eval()")

    def train(self, mode: bool = True) -> NxDPPModel:
        """Refused, as in NxD (``eval()`` too): ``run_train`` runs the stages in train mode, ``run_eval`` in eval
        mode."""
        raise RuntimeError(
            "NxDPPModel.train() / eval() are not supported (as in NxD): run_train() runs the stages in train mode, "
            "run_eval() in eval mode"
        )

    def _point_model_at_stages(self) -> None:
        """The wrapped model's entries for what this rank's stages hold become the stages' own tensors. NxD's stages
        are the model's modules, so ``original_torch_module``, :meth:`parameters` and attributes read through the
        pipeline (``model.lm_head``) see the weights that train; meshpar's stages share the model's tensors when
        built (``share_tensors``), and a stage materialised from meta has new ones, which its model takes here."""
        original = self._wrapped_model()
        if original is None:
            return
        for slots, named in (("_parameters", self.local_named_parameters()), ("_buffers", self.local_named_buffers())):
            for fqn, tensor in named:
                prefix, _, leaf = fqn.rpartition(".")
                try:
                    held = getattr(original.get_submodule(prefix), slots)
                except AttributeError:  # a stage's own module the model lacks
                    continue
                if held.get(leaf) is not None and held[leaf].shape == tensor.shape:
                    held[leaf] = tensor

    # NxD's module views of the pipeline itself: the wrapped model's (this rank's stages' tensors where it holds them)
    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        original = self._wrapped_model()
        return (
            super().named_parameters(*args, **kwargs)
            if original is None
            else original.named_parameters(*args, **kwargs)
        )

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        original = self._wrapped_model()
        return super().named_buffers(*args, **kwargs) if original is None else original.named_buffers(*args, **kwargs)

    def _wrapped_model(self) -> nn.Module | None:
        """The model NxD's views read (``None`` for manual partitioning, whose model was a list of layers)."""
        original = self._modules.get("original_torch_module")
        return original if original is self._build["module"] else None

    # the runtime's own attributes, which exist once the stages are built: never looked up on the wrapped model
    _OWN_LATER = frozenset({"chunks", "plan", "data_parallel"})

    def __getattr__(self, name: str) -> Any:
        """An attribute the pipeline lacks is the wrapped model's (``model.config``, say), as in NxD."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_modules", {}).get("original_torch_module")
            if original is None or name in self._OWN_LATER or name.startswith("__"):
                raise
            return getattr(original, name)

    def _check_hf_inputs(self, inputs: dict[str, torch.Tensor]) -> None:
        """An HF model's step gives its token ids and only arguments of its forward (another would be ignored)."""
        module = self._build["module"]
        unknown = sorted(set(inputs) - set(_hf_arguments(module)))
        if unknown or "input_ids" not in inputs:
            raise RuntimeError(
                f"NxDPPModel of {type(module).__name__}: a step gives input_ids and arguments of its forward; got "
                f"{sorted(inputs)}" + (f" ({unknown} it does not take)" if unknown else "")
            )

    @property
    def built(self) -> bool:
        """Whether this rank's stages exist (a traced pipeline given no cuts has them from its first step on)."""
        return self.dims is not None and "chunks" in self._modules

    def when_partitioned(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once this rank's stages exist: now if they do, else when the pipeline is partitioned."""
        if self.built:
            callback()
        else:
            self._after_partition.append(callback)

    def _validate_partitioned(self) -> None:
        if not self.built:
            raise RuntimeError(
                "NxDPPModel: the model is not partitioned yet; a traced pipeline given no pipeline_cuts, "
                "auto_partition or input_names is traced and partitioned at its first run_train / run_eval, over that "
                "step's inputs (as in NxD): call this after the first step, or give pipeline_cuts, "
                "auto_partition=True or input_names"
            )

    # NxD's local views: this rank's stages under the model's own FQNs (meshpar's stages keep them, so NxD's
    # local <-> original name translation is the identity on the names this rank holds), once the stages exist;
    # every local view goes through local_modules (parameters, modules and state dict as the core gives them)
    def local_modules(self) -> list[nn.Module]:
        """This rank's stage modules (meshpar's protocol: what :mod:`meshpar.checkpoint` saves). NxD's yields every
        submodule of them: that is :meth:`local_named_modules`."""
        self._validate_partitioned()
        return super().local_modules()

    def local_named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self._each_once(lambda stage: stage.named_buffers(prefix=prefix, recurse=recurse))

    def local_buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return (buffer for _, buffer in self.local_named_buffers(recurse=recurse))

    def local_named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return self._each_once(lambda stage: stage.named_children())

    def local_children(self) -> Iterator[nn.Module]:
        return (child for _, child in self.local_named_children())

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Refused, as in NxD: this rank holds only its stages, and the wrapped model's own copy of a stage split by
        structure is not the one that trains (a save of it would hold stale weights under the wrapper's names)."""
        raise RuntimeError(
            "NxDPPModel.state_dict() is not supported (as in NxD): use local_state_dict() for this rank's stages under "
            "the model's names, or nxd.save_checkpoint / meshpar.checkpoint.save for the whole model"
        )

    def translate_origin_state_dict_to_local_state_dict(self, origin_state_dict: dict[str, Any]) -> dict[str, Any]:
        """The entries of a whole model's state dict that this rank's stages hold (the others' are dropped)."""
        held = self.local_state_dict(keep_vars=True)
        return {name: value for name, value in origin_state_dict.items() if name in held}

    def translate_local_state_dict_to_origin_state_dict(
        self, local_state_dict: dict[str, Any], prefix: str = ""
    ) -> dict[str, Any]:
        """``local_state_dict`` under the model's names (the same names: meshpar's stages keep them); a key no local
        stage holds is refused, as in NxD."""
        held = self.local_state_dict(keep_vars=True)
        for name in local_state_dict:
            bare = name[len(prefix) :] if name.startswith(prefix) else name
            if bare not in held:
                raise ValueError(f"parameter {bare} in local_state_dict does not exist in local module")
        return dict(local_state_dict)

    def construct_state_dict_per_model_chunk(
        self, origin_state_dict_all_model_chunks: dict[str, Any], strict: bool = True
    ) -> dict[int, dict[str, Any]]:
        """A whole model's (or this rank's) state dict split by local model chunk: ``{chunk: {name: value}}``, each
        name given to the first chunk that holds it (``strict`` is NxD's check that every local name lies in some
        chunk, which holds by construction here)."""
        names = [set(stage.state_dict(keep_vars=True)) for stage in self.local_modules()]
        per_chunk: dict[int, dict[str, Any]] = {index: {} for index in range(len(names))}
        for name, value in origin_state_dict_all_model_chunks.items():
            holder = next((index for index, held in enumerate(names) if name in held), None)
            if holder is not None:  # another stage's entry: not this rank's
                per_chunk[holder][name] = value
        return per_chunk

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """A whole model's (or this rank's) state dict into this rank's stages, as NxD loads it: each stage takes
        the keys it holds, other stages' keys are ignored, and with ``strict`` a key a local stage holds but
        ``state_dict`` lacks is refused."""
        pieces = self.construct_state_dict_per_model_chunk(state_dict, strict=strict)
        results = [
            stage.load_state_dict(pieces[index], strict=strict, assign=assign)
            for index, stage in enumerate(self.local_modules())
        ]
        missing = [key for result in results for key in result.missing_keys]
        unexpected = [key for result in results for key in result.unexpected_keys]
        return IncompatibleKeys(missing, unexpected)

    def get_current_stage(self, model_chunk_id: int) -> int:
        """The pipeline stage of this rank's model chunk ``model_chunk_id`` (chunks go round the pp ranks)."""
        return self.pipeline_parallel_size * model_chunk_id + self.pipeline_parallel_rank

    def is_last_pp_rank_last_model_chunk(self, model_chunk_id: int) -> bool:
        """Whether this rank's chunk ``model_chunk_id`` is the pipeline's last stage."""
        return self.get_current_stage(model_chunk_id) == self.pipeline_parallel_size * self.virtual_pipeline_size - 1

    def is_last_stage(self) -> bool:
        """Whether this rank holds the pipeline's last stage (the one that computes the loss)."""
        return self.is_last_pp_rank_last_model_chunk(self.virtual_pipeline_size - 1)

    # NxD's overridable device steps (its "methods for non-XLA devices")
    def move_model_to_device(self) -> None:
        """This rank's stages on the process's device: built there already (a deferred pipeline at its first step)."""
        if self.built:
            self.model_moved_to_device = True

    def _create_pg_with_ranks(self, ranks: Sequence[int]) -> torch.distributed.ProcessGroup | None:
        """The group of the pp stages ``ranks`` across this rank's (dp, tp, ...) position (NxD's hook)."""
        return parallel_state.create_pg_with_ranks(list(ranks))

    def _mark_step(self) -> None:
        """Nothing to cut: eager PyTorch runs each op as it is called."""

    def get_model_layers(self, module: nn.Module, target_module_type: type | tuple[type, ...]) -> list[str]:
        """The FQNs of ``module``'s layers of ``target_module_type``, in order (NxD's method)."""
        return get_model_layers(module, target_module_type)

    @property
    def local_stage_modules(self) -> list[nn.Module]:
        """This rank's stage modules (NxD's name for :meth:`local_modules`)."""
        return self.local_modules()

    @property
    def manually_shared_weights(self) -> dict[str, list]:
        """NxD's map of each weight-sharing group (``mark_weight_sharing``) spanning this rank and another stage's to
        ``[process group of those stages' ranks, this rank's copy]``: kept one weight by :attr:`tied`."""
        tied = self.__dict__.get("tied")
        if tied is None:
            return {}
        shared = {}
        for name, group in self._manual_groups.items():
            index = tied.names.index(group)
            if index in tied.process_groups:
                shared[name] = [tied.process_groups[index], tied.copies[index][0]]
        return shared

    def _run(self, forward_only: bool, inputs: dict[str, torch.Tensor], keep_outputs: bool = False) -> Any:
        if self._tracing is not None and not self.partitioned:
            raise RuntimeError(
                "NxDPPModel.trace() was called but not partition(): mark the cuts with cut_pipeline_stage() and call "
                "partition() before the first step"
            )
        with stop_all_ranks_on_error("NxDPPModel's step inputs"):  # a rank that raises here stops the others
            if self._first_step is not None:  # NxD's delayed tracing: over this step's input names
                stages = self.pipeline_parallel_size * self._build["virtual_pipeline_size"]
                cuts = _nxd_cuts(self._build["module"], self.transformer_layer_cls, stages)
                self._install(cuts, self._first_step, list(inputs))
            if self._traced_inputs is not None and set(inputs) != self._traced_inputs:
                raise RuntimeError(
                    f"NxDPPModel: the step's inputs {sorted(inputs)} must be the traced input names "
                    f"{sorted(self._traced_inputs)} (as in NxD: an input the trace does not take would be ignored)"
                )
            if self._hf_split:
                self._check_hf_inputs(inputs)
        self.partitioned = True  # NxD partitions at the first step at the latest
        # NxD's modes: a training step runs the stages in train mode, an evaluation in eval mode (dropout off)
        self.training = not forward_only
        for stage in self.local_modules():
            stage.train(not forward_only)
        outputs_only = forward_only and self._evaluates_outputs
        with mark_timeline(self.timeline, "eval_step" if forward_only else "train_step"):
            loss = super()._run(forward_only, inputs, keep_outputs, with_loss=not outputs_only)
        self.timeline.mark_step_end()
        if outputs_only:  # NxD's run_eval without a loss: the last stage's output (one per microbatch)
            outputs = self.last_outputs
            return None if not outputs else (outputs[0] if len(outputs) == 1 else outputs)
        result = self.last_losses if self.return_mb_loss else loss
        if self.return_loss_on_cpu and result is not None:
            if isinstance(result, list):
                return [value.detach().cpu() for value in result]
            return result.detach().cpu()
        return result
