"""meshpar's pipeline runtime for one rank: its stages, built once, run by the executor.

A pipeline is decided once (:func:`meshpar.pipeline.split.plan_stages`: which layers and modules each stage owns),
each of this rank's stages is built once from that plan (:func:`meshpar.pipeline.split.build_stages`, original FQNs
kept) and wrapped as a :class:`StageChunk` (how the stage is called), and :class:`PipelineModel` runs them with
meshpar's executor (1F1B, interleaved 1F1B for several chunks per rank, ZB-H1 with ``schedule="zero_bubble"``, or
GPipe with ``schedule="gpipe"``).
Every entry point builds its pipeline this way: HF ``parallelize`` (:mod:`meshpar.hf.parallelize`), NxD's
``NxDPPModel`` (:mod:`meshpar.compat.nxd.pipeline`, which translates NxD's arguments), and user code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar.data_parallel import DataParallelGrads
from meshpar.grad_sync import OverlappedGradSync
from meshpar.parallel_dims import ParallelDims
from meshpar.pipeline.executor import check_pipeline_schedule, refuse_split_backward_with_fsdp, run_schedule
from meshpar.pipeline.microbatches import split_microbatches
from meshpar.pipeline.split import StagePlan
from meshpar.pipeline.tied import TiedCopies


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


def _each_object_once(pairs: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``pairs`` without a value already given under an earlier name."""
    seen: set[int] = set()
    for name, value in pairs:
        if id(value) not in seen:
            seen.add(id(value))
            yield name, value


class PipelineModel(nn.Module):
    """This rank's built stages (``chunks``, one per virtual stage, in stage order) of ``plan``, run over
    ``num_microbatches`` equal slices of each batch. The last stage computes ``loss_fn(output, **microbatch)``;
    grads after :meth:`run_train` are those of the mean loss over the microbatches.

    ``dp_mode`` says how grads are averaged over dp (:class:`meshpar.data_parallel.DataParallelGrads`); with
    ``average_grads_over_dp=False`` its :meth:`~meshpar.data_parallel.DataParallelGrads.finish` is left to the
    caller. ``broadcast_loss``: every pipeline rank gets the last stage's mean loss, averaged over dp.
    ``grads_over_cp``: whether the dense grads are summed over dp x cp (meshpar's context parallelism: each cp rank
    computed a part of one replica's grads); ``False`` leaves cp to the caller (NxD averages them over cp in its
    optimizer step) and reduces over dp alone. ``between_forwards_and_backwards``: see
    :class:`meshpar.pipeline.executor.PipelineExecutor` (schedule ``"gpipe"``). ``tied_parameters``: groups of FQNs
    that are one weight of the model (:func:`meshpar.pipeline.tied.tied_parameter_groups`): the stages' copies start
    equal and get the sum of their grads after each backward (:class:`meshpar.pipeline.tied.TiedCopies`).
    ``chunks=None`` (with ``plan`` and
    ``dims`` ``None``): the stages are built later, ``dims`` set and :meth:`install_stages` called before the first
    step (NxD's view traces a pipeline it is given no cuts for at its first step)."""

    def __init__(
        self,
        chunks: Sequence[StageChunk] | None,
        plan: StagePlan | None,
        dims: ParallelDims | None,
        *,
        num_microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
        schedule: str = "1f1b",
        dp_mode: str = "allreduce",
        average_grads_over_dp: bool = True,
        broadcast_loss: bool = False,
        deallocate_pipeline_outputs: bool = False,
        grads_over_cp: bool = True,
        between_forwards_and_backwards: Callable[[], None] | None = None,
        tied_parameters: Sequence[Sequence[str]] = (),
    ) -> None:
        super().__init__()
        self.dims = dims
        self.tied_parameter_groups = [list(group) for group in tied_parameters]
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        self.broadcast_loss = broadcast_loss
        self.deallocate_pipeline_outputs = deallocate_pipeline_outputs
        self.average_grads_over_dp = average_grads_over_dp
        self.between_forwards_and_backwards = between_forwards_and_backwards
        self._dp_mode, self._grads_over_cp = dp_mode, grads_over_cp
        if chunks is not None:
            self.install_stages(chunks, plan)
        self.last_losses: list[torch.Tensor] = []
        self.last_outputs: list[Any] = []

    def install_stages(self, chunks: Sequence[StageChunk], plan: StagePlan) -> None:
        """Run ``chunks`` (this rank's stages of ``plan``) from now on, their grads averaged over dp as configured
        (called once when built, by :meth:`__init__` or, for ``chunks=None`` there, by the caller once ``dims`` is
        set; NxD's view again when a pipeline is re-cut before its first step)."""
        if len(chunks) != len(getattr(self, "chunks", chunks)):
            raise ValueError(f"{len(chunks)} stage chunks for a pipeline built with {len(self.chunks)} per rank")
        dims = self.dims
        if self.num_microbatches < dims.pp and len(chunks) > 1:
            raise ValueError(f"num_microbatches={self.num_microbatches} must be >= pp={dims.pp} with virtual stages")
        check_pipeline_schedule(self.schedule, len(chunks))
        previous = getattr(self, "data_parallel", None)
        for sync in previous.syncs if previous is not None else ():
            sync.remove()  # the replaced stages' grad hooks (the new stages may hold the same parameters)
        self.plan = plan
        self.chunks = nn.ModuleList(chunks)
        if self.schedule == "zero_bubble":
            refuse_split_backward_with_fsdp(self.chunks)
        self.data_parallel = DataParallelGrads(
            self._dp_mode,
            dims.grad_mesh if self._grads_over_cp else dims.dp_mesh,
            [chunk.stage for chunk in self.chunks],
            expert_dp_mesh=dims.expert_dp_mesh,
            divisor=dims.dp,
        )
        self.tied = TiedCopies(self.tied_parameter_groups, [chunk.stage for chunk in self.chunks], dims)
        if self.tied.sums_grads and self.data_parallel.syncs and not self.average_grads_over_dp:
            raise ValueError(
                "a pipeline whose stages hold copies of a tied weight sums their grads once the overlapped dp "
                "reductions are done, which average_grads_over_dp=False leaves to the caller: use dp_mode "
                "'allreduce' or 'optimizer', or average_grads_over_dp=True"
            )

    @property
    def grad_syncs(self) -> list[OverlappedGradSync] | None:
        """With overlapped dp grad reduction (and dp > 1): the grad sync of each chunk, else ``None``."""
        return self.data_parallel.syncs or None

    def finish_grad_sync(self) -> None:
        """Wait for the dp all-reduces :meth:`run_train` started; grads are then the dp-mean."""
        for sync in self.data_parallel.syncs:
            sync.finish()

    # -- this rank's modules: names are the original model's FQNs -------------------------------------------------
    def local_modules(self) -> list[nn.Module]:
        """This rank's stage modules (what :mod:`meshpar.checkpoint` saves and loads)."""
        return [chunk.stage for chunk in self.chunks]

    def _each_once(self, named: Callable[[nn.Module], Iterator[tuple[str, Any]]]) -> Iterator[tuple[str, Any]]:
        """``named(stage)`` over this rank's stages, each object once (traced chunks of one rank share the model's
        modules: a weight the model ties is one object in both, which an optimizer must step once). The stages are
        taken at the call, so a pipeline whose stages do not exist yet refuses there, not at the first item."""
        stages = self.local_modules()
        return _each_object_once(pair for stage in stages for pair in named(stage))

    def local_named_parameters(self, recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """Each parameter of this rank's stages once."""
        return self._each_once(lambda stage: stage.named_parameters(recurse=recurse))

    def local_parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (param for _, param in self.local_named_parameters(recurse=recurse))

    def local_named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        """Every module of this rank's stages (each stage itself first, under ``prefix``); with ``remove_duplicate``
        a module two stages share comes once."""
        memo = (set() if memo is None else memo) if remove_duplicate else None
        stages = self.local_modules()  # at the call, as in _each_once
        return (
            item
            for stage in stages
            for item in stage.named_modules(memo=memo, prefix=prefix, remove_duplicate=remove_duplicate)
        )

    def local_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The stages' state dicts merged (keys: the model's FQNs, after ``prefix=`` where given)."""
        state: dict[str, Any] = {}
        for stage in self.local_modules():
            state.update(stage.state_dict(*args, **kwargs))
        return state

    @property
    def is_last_stage_rank(self) -> bool:
        return any(c.stage_index == self.plan.num_stages - 1 for c in self.chunks)

    # -- running ---------------------------------------------------------------------------------------------------
    def _forward_step(self, microbatch: dict[str, torch.Tensor], chunk: StageChunk) -> tuple[Any, Callable]:
        return chunk(**microbatch), lambda out: self.loss_fn(out, **microbatch)

    @staticmethod
    def _forward_step_without_loss(microbatch: dict[str, torch.Tensor], chunk: StageChunk) -> tuple[Any, None]:
        return chunk(**microbatch), None

    def _run(
        self, forward_only: bool, inputs: dict[str, torch.Tensor], keep_outputs: bool = False, with_loss: bool = True
    ) -> Any:
        """One step over ``inputs``; ``with_loss=False`` (forward only): no loss is computed, the last stage's
        outputs are kept and the step returns ``None``."""
        executor = run_schedule(
            self.dims,
            list(self.chunks),
            split_microbatches(inputs, self.num_microbatches),
            self._forward_step if with_loss else self._forward_step_without_loss,
            forward_only,
            schedule=self.schedule,
            fixed_shapes=True,  # the microbatches are equal slices of one batch
            deallocate_pipeline_outputs=self.deallocate_pipeline_outputs,
            loss_scale=1.0 / self.num_microbatches,
            keep_outputs=keep_outputs or not with_loss,
            grad_syncs=self.grad_syncs,
            between_forwards_and_backwards=self.between_forwards_and_backwards,
        )
        self.last_losses = executor.losses
        self.last_outputs = [executor.outputs[i] for i in sorted(executor.outputs)]
        if not forward_only:
            if self.average_grads_over_dp:
                self.data_parallel.finish()
            self.tied.sum_grads()  # after the overlapped dp reductions (the sum is linear: the order is free)
        loss = torch.stack(self.last_losses).mean() if self.last_losses else None
        return self._broadcast(loss) if self.broadcast_loss and with_loss else loss

    def _broadcast(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's mean loss on every pipeline rank, averaged over the data-parallel replicas."""
        dims = self.dims
        value = loss.detach().clone() if loss is not None else torch.zeros((), device=dims.device)
        dist.broadcast(value, group=dims.pp_mesh.get_group(), group_src=dims.pp - 1)
        if dims.dp > 1:
            dist.all_reduce(value, group=dims.dp_mesh.get_group())
            value /= dims.dp
        return value

    def run_train(self, **inputs: torch.Tensor) -> Any:
        """Forward and backward over ``num_microbatches`` microbatches; grads are those of the mean loss. Returns the
        mean loss (last stage, or every rank with ``broadcast_loss``; ``None`` elsewhere)."""
        return self._run(forward_only=False, inputs=inputs)

    def run_eval(self, return_outputs: bool = False, **inputs: torch.Tensor) -> Any:
        """Forward only. With ``return_outputs`` also the last stage's outputs of every microbatch (``[]`` on other
        ranks): ``(loss, outputs)``."""
        with torch.no_grad():
            loss = self._run(forward_only=True, inputs=inputs, keep_outputs=return_outputs)
        return (loss, self.last_outputs) if return_outputs else loss
