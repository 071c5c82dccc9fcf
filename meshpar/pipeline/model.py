"""neuronx-distributed's ``NxDPPModel`` API: ``NxDPPModel(module, ...)`` (also ``PipelineModel``) with
``run_train`` / ``run_eval``.

The module is split by :func:`meshpar.pipeline.split.split_model` (FQNs kept) and run by meshpar's executor with
the interleaved 1F1B schedule (plain 1F1B for ``virtual_pipeline_size=1``), or ZB-H1 with
``schedule="zero_bubble"``. Every stage receives the microbatch's keyword inputs; the first stage calls the module
with the ``input_names`` inputs, later stages with the received activation, and the last stage computes the loss with
``loss_fn(output, **microbatch)`` or, NxD-style, picks it from the module's output with ``output_loss_value_spec``.

Two ways to cut the module, both keeping the original FQNs. Given a ``loss_fn``, meshpar splits by module structure
(the layers of ``transformer_layer_cls`` in one container, see :mod:`meshpar.pipeline.split`) and stages run the
module's own submodules. Without one (NxD's own usage: the loss is computed inside ``forward`` and picked with
``output_loss_value_spec``), or when one of NxD's tracing arguments is given (``leaf_module_cls``,
``autowrap_functions``, ``autowrap_modules``, ``tracer_cls``, ``trace_file_path``), the forward is traced with
torch.fx and cut after layers (:mod:`meshpar.pipeline.trace`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar.data_parallel import DataParallelGrads
from meshpar.grad_sync import OverlappedGradSync
from meshpar.parallel_dims import ParallelDims, check_virtual_pipeline_size, get_parallel
from meshpar.pipeline.executor import check_pipeline_schedule, refuse_split_backward_with_fsdp, run_schedule
from meshpar.pipeline.microbatches import split_microbatches
from meshpar.pipeline.split import split_model
from meshpar.pipeline.trace import traced_stages
from meshpar.replicas import make_replicas_equal


class StageChunk(nn.Module):
    """One stage with apex's ``set_input_tensor`` contract: the received activation replaces the model inputs.

    ``stage_kwargs`` names microbatch inputs (an attention mask, say) that every stage receives as keywords, the
    first one next to its ``input_names`` inputs, later ones next to the received activation."""

    def __init__(
        self,
        stage: nn.Module,
        stage_index: int,
        input_names: Sequence[str] | None,
        stage_kwargs: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.stage = stage
        self.stage_index = stage_index
        self.input_names = input_names
        self.stage_kwargs = tuple(stage_kwargs)
        self._input: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self._input = tensor

    def forward(self, **inputs: torch.Tensor) -> Any:
        extras = {n: inputs[n] for n in self.stage_kwargs if n in inputs}
        if self._input is not None:
            return self.stage(self._input, **extras)
        names = (
            self.input_names
            if self.input_names is not None
            else [n for n in inputs if n != "labels" and n not in self.stage_kwargs]
        )
        return self.stage(*(inputs[n] for n in names), **extras)


def _pick_loss(output: Any, spec: Any) -> torch.Tensor:
    """NxD's ``output_loss_value_spec``: ``(True, False)`` picks from a tuple output, ``{"loss": True, ...}`` from a
    dict (or HF ``ModelOutput``); ``None``: the output is the loss."""
    if spec is None:
        return output
    if isinstance(spec, str):
        return output[spec]
    if isinstance(spec, dict):
        picked = [output[key] for key, take in spec.items() if take]
        if len(picked) != 1:
            raise ValueError(f"output_loss_value_spec {spec} must select exactly one output")
        return picked[0]
    picked = [o for o, take in zip(output, spec, strict=True) if take]
    if len(picked) != 1:
        raise ValueError(f"output_loss_value_spec {spec} must select exactly one output")
    return picked[0]


class PipelineModel(nn.Module):
    """NxD's ``NxDPPModel``. Grads after :meth:`run_train` are those of the mean loss over the microbatches, averaged
    over dp (NxD's default; with ``use_zero1_optimizer`` the optimizer averages them: meshpar's
    ``DistributedOptimizer(zero1=True)``). How they are averaged is one :class:`meshpar.data_parallel.DataParallelGrads`
    (``dp_mode``, meshpar's keyword; by default from ``overlap_grad_reduce`` and ``use_zero1_optimizer``);
    ``average_grads_over_dp=False`` leaves its :meth:`~meshpar.data_parallel.DataParallelGrads.finish` to the
    caller."""

    def __init__(
        self,
        module: nn.Module,
        transformer_layer_cls: type | None = None,
        num_microbatches: int = 1,
        virtual_pipeline_size: int = 1,
        output_loss_value_spec: Any = None,
        return_mb_loss: bool = False,
        broadcast_and_average_loss: bool = False,
        pipeline_cuts: Sequence[str] | None = None,
        input_names: Sequence[str] | None = None,
        leaf_module_cls: Sequence[type] | None = None,
        autowrap_functions: tuple | None = None,
        autowrap_modules: tuple | None = None,
        tracer_cls: Any = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        trace_file_path: str | None = None,
        use_zero1_optimizer: bool = False,
        auto_partition: bool = False,
        deallocate_pipeline_outputs: bool = False,
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        keep_modules: Sequence[str] = (),
        stage_transform: Callable[[nn.Module], nn.Module] | None = None,
        overlap_grad_reduce: bool = False,
        stage_kwargs: Sequence[str] = (),
        stage_init_fn: Callable[[nn.Module], None] | None = None,
        average_grads_over_dp: bool | None = None,
        dp_mode: str | None = None,
        schedule: str = "1f1b",
        dims: ParallelDims | None = None,
        first_stage_modules: Sequence[str] = (),
        last_stage_modules: Sequence[str] = (),
    ) -> None:
        super().__init__()
        tracing = {
            "leaf_module_cls": leaf_module_cls,
            "autowrap_functions": autowrap_functions,
            "autowrap_modules": autowrap_modules,
            "tracer_cls": tracer_cls,
            "trace_file_path": trace_file_path,
        }
        trace_it = loss_fn is None or any(value is not None for value in tracing.values())
        if trace_it and (keep_modules or stage_init_fn is not None or param_init_fn is not None):
            raise NotImplementedError(
                "NxDPPModel: a traced pipeline (no loss_fn, or a tracing argument) takes no param_init_fn, "
                "stage_init_fn or keep_modules: build the model on CPU, or pass loss_fn to split it by structure"
            )
        if return_mb_loss and broadcast_and_average_loss:
            raise ValueError("NxDPPModel: broadcast_and_average_loss=True requires return_mb_loss=False (as in NxD)")
        if pipeline_cuts is not None and auto_partition:
            raise ValueError("NxDPPModel: pass pipeline_cuts or auto_partition=True, not both (as in NxD)")
        dims = dims if dims is not None else get_parallel()  # meshpar's parallelize passes its mesh
        self.dims = dims
        if num_microbatches < dims.pp:
            raise ValueError(f"num_microbatches={num_microbatches} must be >= pp={dims.pp}")
        check_virtual_pipeline_size(dims.pp, virtual_pipeline_size)
        check_pipeline_schedule(schedule, virtual_pipeline_size)
        # every rank built the whole model: the first rank's values along pp and dp before splitting (DDP's rule;
        # tp-sharded parameters by their shards, which these ranks share); a meta-built model has none yet
        make_replicas_equal(module, dims, over=("pp", "dp"))
        if trace_it:
            traced, self.plan = traced_stages(
                module, dims.pp_rank, dims.pp, input_names=input_names, transformer_layer_cls=transformer_layer_cls,
                pipeline_cuts=pipeline_cuts, auto_partition=auto_partition,
                virtual_pipeline_size=virtual_pipeline_size, device=dims.device, **tracing,
            )  # fmt: skip
            # each traced stage reads the model inputs it needs from the microbatch, by name
            stages = [(index, stage) for index, stage, _ in traced]
            calls = [((), reads) for _, _, reads in traced]
        else:
            stages, self.plan = split_model(
                module,
                dims.pp_rank,
                dims.pp,
                transformer_layer_cls=transformer_layer_cls,
                pipeline_cuts=pipeline_cuts,
                auto_partition=auto_partition,
                virtual_pipeline_size=virtual_pipeline_size,
                param_init_fn=param_init_fn,
                stage_init_fn=stage_init_fn,
                device=dims.device,
                keep_modules=keep_modules,
                first_stage_modules=first_stage_modules,
                last_stage_modules=last_stage_modules,
            )
            calls = [(input_names, stage_kwargs)] * len(stages)
        if stage_transform is not None:
            stages = [(index, stage_transform(stage)) for index, stage in stages]
        self.chunks = nn.ModuleList(
            StageChunk(stage, index, names, kwargs)
            for (index, stage), (names, kwargs) in zip(stages, calls, strict=True)
        )
        if schedule == "zero_bubble":
            refuse_split_backward_with_fsdp(self.chunks)
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.output_loss_value_spec = output_loss_value_spec
        self.return_mb_loss = return_mb_loss
        self.broadcast_and_average_loss = broadcast_and_average_loss
        self.deallocate_pipeline_outputs = deallocate_pipeline_outputs
        # run_train ends with the dp mean of the grads unless the caller (parallelize's train_step) or the ZeRO-1
        # optimizer reduces them
        self.average_grads_over_dp = (
            (not use_zero1_optimizer) if average_grads_over_dp is None else average_grads_over_dp
        )
        self.loss_fn = loss_fn
        if dp_mode is None:
            dp_mode = "overlapped" if overlap_grad_reduce else ("optimizer" if use_zero1_optimizer else "allreduce")
        self.data_parallel = DataParallelGrads(dp_mode, dims.dp_mesh, [chunk.stage for chunk in self.chunks])

    @property
    def grad_syncs(self) -> list[OverlappedGradSync] | None:
        """With ``overlap_grad_reduce`` (and dp > 1): the dp grad sync of each chunk, else ``None``."""
        return self.data_parallel.syncs or None

    def finish_grad_sync(self) -> None:
        """With ``overlap_grad_reduce``: wait for the dp all-reduces ``run_train`` started; grads are then the
        dp-mean."""
        for sync in self.data_parallel.syncs:
            sync.finish()

    # -- NxD accessors: names are the original model's FQNs ------------------------------------------------
    def local_modules(self) -> list[nn.Module]:
        """This rank's stage modules (what :mod:`meshpar.checkpoint` saves and loads)."""
        return [chunk.stage for chunk in self.chunks]

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for chunk in self.chunks:
            yield from chunk.stage.named_parameters()

    def local_parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.local_named_parameters():
            yield param

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        for chunk in self.chunks:
            yield from chunk.stage.named_modules()

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            state.update(chunk.stage.state_dict())
        return state

    @property
    def is_last_stage_rank(self) -> bool:
        return any(c.stage_index == self.plan.num_stages - 1 for c in self.chunks)

    def _forward_step(self, microbatch: dict[str, torch.Tensor], chunk: StageChunk) -> tuple[Any, Callable]:
        output = chunk(**microbatch)

        def loss_func(out: Any) -> torch.Tensor:
            if self.loss_fn is not None:
                return self.loss_fn(out, **microbatch)
            return _pick_loss(out, self.output_loss_value_spec)

        return output, loss_func

    def _run(self, forward_only: bool, inputs: dict[str, torch.Tensor], keep_outputs: bool = False) -> Any:
        dims = self.dims
        executor = run_schedule(
            dims,
            list(self.chunks),
            split_microbatches(inputs, self.num_microbatches),
            self._forward_step,
            forward_only,
            schedule=self.schedule,
            fixed_shapes=True,  # the microbatches are equal slices of one batch
            deallocate_pipeline_outputs=self.deallocate_pipeline_outputs,
            loss_scale=1.0 / self.num_microbatches,
            keep_outputs=keep_outputs,
            grad_syncs=self.grad_syncs,
        )
        losses = executor.losses
        self.last_outputs = [executor.outputs[i] for i in sorted(executor.outputs)]
        if not forward_only and self.average_grads_over_dp:
            self.data_parallel.finish()
        if self.return_mb_loss:
            return losses
        loss = torch.stack(losses).mean() if losses else None
        if self.broadcast_and_average_loss:
            loss = self._broadcast_loss(loss)
        return loss

    def _broadcast_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """NxD's ``broadcast_and_average_loss``: the last stage's mean loss on every pipeline rank, averaged over
        the data-parallel replicas."""
        dims = self.dims
        value = loss.detach().clone() if loss is not None else torch.zeros((), device=dims.device)
        dist.broadcast(value, group=dims.pp_mesh.get_group(), group_src=dims.pp - 1)
        if dims.dp > 1:
            dist.all_reduce(value, group=dims.dp_mesh.get_group())
            value /= dims.dp
        return value

    def run_train(self, **inputs: torch.Tensor) -> Any:
        """Forward and backward over ``num_microbatches`` microbatches; grads are those of the mean loss."""
        return self._run(forward_only=False, inputs=inputs)

    def run_eval(self, return_outputs: bool = False, **inputs: torch.Tensor) -> Any:
        """Forward only. With ``return_outputs`` also the last stage's outputs of every microbatch (``[]`` on other
        ranks): ``(loss, outputs)``."""
        with torch.no_grad():
            loss = self._run(forward_only=True, inputs=inputs, keep_outputs=return_outputs)
        return (loss, self.last_outputs) if return_outputs else loss


NxDPPModel = PipelineModel
