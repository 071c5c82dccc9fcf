"""``neuronx_distributed.pipeline.model``: ``NxDPPModel(module, ...)`` with NxD's arguments, translated to meshpar's
pipeline (:mod:`meshpar.pipeline.model`): the split decided once, this rank's stages built once, run by meshpar's
executor with ``run_train`` / ``run_eval``.

Two ways to cut the module, both keeping the original FQNs. Given a ``loss_fn`` (meshpar's keyword), the module is
split by structure (the layers of ``transformer_layer_cls`` in one container, :mod:`meshpar.pipeline.split`) and
stages run the module's own submodules; the last stage computes ``loss_fn(output, **microbatch)``. Without one (NxD's
own usage: the loss is computed inside ``forward`` and picked with ``output_loss_value_spec``), or when one of NxD's
tracing arguments is given (``leaf_module_cls``, ``autowrap_functions``, ``autowrap_modules``, ``tracer_cls``,
``trace_file_path``), the forward is traced with torch.fx and cut after layers (:mod:`meshpar.pipeline.trace`).
Every stage receives the microbatch's keyword inputs; the first stage calls the module with the ``input_names``
inputs, later stages with the received activation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from meshpar.parallel_dims import ParallelDims, check_virtual_pipeline_size, get_parallel
from meshpar.pipeline.executor import check_pipeline_schedule
from meshpar.pipeline.model import PipelineModel, StageChunk
from meshpar.pipeline.split import build_stages, plan_stages
from meshpar.pipeline.trace import traced_stages
from meshpar.replicas import make_replicas_equal

__all__ = ["NxDPPModel"]


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


class NxDPPModel(PipelineModel):
    """NxD's pipeline model. Grads after :meth:`run_train` are those of the mean loss over the microbatches, averaged
    over dp (NxD's default; with ``use_zero1_optimizer`` the optimizer averages them: meshpar's
    ``DistributedOptimizer(zero1=True)``)."""

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
        overlap_grad_reduce: bool = False,
        schedule: str = "1f1b",
        dims: ParallelDims | None = None,
    ) -> None:
        tracing = {
            "leaf_module_cls": leaf_module_cls,
            "autowrap_functions": autowrap_functions,
            "autowrap_modules": autowrap_modules,
            "tracer_cls": tracer_cls,
            "trace_file_path": trace_file_path,
        }
        trace_it = loss_fn is None or any(value is not None for value in tracing.values())
        if trace_it and param_init_fn is not None:
            raise NotImplementedError(
                "NxDPPModel: a traced pipeline (no loss_fn, or a tracing argument) takes no param_init_fn: build the "
                "model on CPU, or pass loss_fn to split it by structure"
            )
        if return_mb_loss and broadcast_and_average_loss:
            raise ValueError("NxDPPModel: broadcast_and_average_loss=True requires return_mb_loss=False (as in NxD)")
        if pipeline_cuts is not None and auto_partition:
            raise ValueError("NxDPPModel: pass pipeline_cuts or auto_partition=True, not both (as in NxD)")
        dims = dims if dims is not None else get_parallel()
        if num_microbatches < dims.pp:
            raise ValueError(f"num_microbatches={num_microbatches} must be >= pp={dims.pp}")
        check_virtual_pipeline_size(dims.pp, virtual_pipeline_size)
        check_pipeline_schedule(schedule, virtual_pipeline_size)
        # every rank built the whole model: the first rank's values along pp and dp before splitting (DDP's rule;
        # tp-sharded parameters by their shards, which these ranks share); a meta-built model has none yet
        make_replicas_equal(module, dims, over=("pp", "dp"))
        if trace_it:
            traced, plan = traced_stages(
                module, dims.pp_rank, dims.pp, input_names=input_names, transformer_layer_cls=transformer_layer_cls,
                pipeline_cuts=pipeline_cuts, auto_partition=auto_partition,
                virtual_pipeline_size=virtual_pipeline_size, device=dims.device, **tracing,
            )  # fmt: skip
            # each traced stage reads the model inputs it needs from the microbatch, by name
            chunks = [StageChunk(stage, index, (), reads) for index, stage, reads in traced]
        else:
            plan = plan_stages(
                module,
                dims.pp * virtual_pipeline_size,
                transformer_layer_cls=transformer_layer_cls,
                pipeline_cuts=pipeline_cuts,
                auto_partition=auto_partition,
            )
            stages = build_stages(module, plan, dims.pp_rank, dims.pp, param_init_fn=param_init_fn, device=dims.device)
            chunks = [StageChunk(stage, index, input_names) for index, stage in stages]

        def picked_loss(output: Any, **microbatch: torch.Tensor) -> torch.Tensor:
            if loss_fn is not None:
                return loss_fn(output, **microbatch)
            return _pick_loss(output, output_loss_value_spec)

        dp_mode = "overlapped" if overlap_grad_reduce else ("optimizer" if use_zero1_optimizer else "allreduce")
        super().__init__(
            chunks,
            plan,
            dims,
            num_microbatches=num_microbatches,
            loss_fn=picked_loss,
            schedule=schedule,
            dp_mode=dp_mode,
            # run_train ends with the dp mean of the grads unless the ZeRO-1 optimizer reduces them
            average_grads_over_dp=not use_zero1_optimizer,
            broadcast_loss=broadcast_and_average_loss,
            deallocate_pipeline_outputs=deallocate_pipeline_outputs,
        )
        self.output_loss_value_spec = output_loss_value_spec
        self.return_mb_loss = return_mb_loss

    def _run(self, forward_only: bool, inputs: dict[str, torch.Tensor], keep_outputs: bool = False) -> Any:
        loss = super()._run(forward_only, inputs, keep_outputs)
        return self.last_losses if self.return_mb_loss else loss
