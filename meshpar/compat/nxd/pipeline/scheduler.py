"""``neuronx_distributed.pipeline.scheduler``: NxD's pipeline schedules as its runtime consumes them: for one stage,
a sequence of steps, each a list of tasks (receive / compute / send of a forward or backward microbatch, then one
``ReduceGradsTask``). meshpar's own pipelines do not run these lists (their schedules are
:mod:`meshpar.pipeline.schedule_ir` actions, run by meshpar's executor); they are here for code that builds or
inspects NxD's schedules.

- :class:`InferenceSchedule`: receive, forward, send per microbatch.
- :class:`Train1F1BSchedule`: 1F1B by microbatch: ``stages - stage_id - 1`` warm-up forwards (at most all of
  them), then one forward and one backward per step, then the remaining backwards. A steady forward's send is issued
  in the step after it, with the backward.
- :class:`TrainInterleavedSchedule`: Megatron's interleaved 1F1B over ``num_model_chunks`` chunks per stage
  (``num_microbatches`` a multiple of ``stages``); each step receives for the next step and sends for its own, the
  last stage sending before it receives (or, with ``use_odd_even_scheduler``, even and odd stages alternating).
- :class:`TrainSchedule`: DeepSpeed's 1F1B in lock-step: every stage alternates forward and backward slots (odd
  stages starting with a backward slot), slots with no valid microbatch left idle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator


class PipelineTask:
    """One unit of a schedule step for microbatch ``mb`` of model chunk ``model_chunk``."""

    def __init__(self, mb: int, model_chunk: int = 0, graph_break: bool = True) -> None:
        self.mb, self.model_chunk, self.graph_break = mb, model_chunk, graph_break

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and (self.mb, self.model_chunk, self.graph_break) == (
            other.mb, other.model_chunk, other.graph_break)  # fmt: skip

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.mb, self.model_chunk, self.graph_break))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}_microbatch_{self.mb}_modelchunk_{self.model_chunk}"
                f"_graphbreak_{self.graph_break}")  # fmt: skip


class ForwardPreprocessTask(PipelineTask):
    """Receive a forward input."""


class ForwardStepTask(PipelineTask):
    """Run a forward."""


class ForwardPostprocessTask(PipelineTask):
    """Send a forward output."""


class BackwardPreprocessTask(PipelineTask):
    """Receive an output grad."""


class BackwardStepTask(PipelineTask):
    """Run a backward."""


class BackwardPostprocessTask(PipelineTask):
    """Send an input grad."""


class PostProcessTask:
    """A task after the pipeline ran (no microbatch: ``mb`` and ``model_chunk`` are -1)."""

    def __init__(self, graph_break: bool = True) -> None:
        self.mb, self.model_chunk, self.graph_break = -1, -1, graph_break


class ReduceGradsTask(PostProcessTask):
    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self).__name__)

    def __repr__(self) -> str:
        return "ReduceGradsTask"


Step = list[PipelineTask | PostProcessTask]


class PipeSchedule(ABC):
    """The steps stage ``stage_id`` of ``stages`` runs for ``num_microbatches`` microbatches; iterating yields
    them (a new iteration starts over)."""

    def __init__(self, num_microbatches: int, stages: int, stage_id: int) -> None:
        self.num_microbatches, self.stages, self.stage_id = num_microbatches, stages, stage_id
        self.prev_stage, self.next_stage = stage_id - 1, stage_id + 1

    @abstractmethod
    def steps(self) -> Iterator[Step]: ...

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.num_microbatches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __iter__(self) -> PipeSchedule:
        self.it = None
        return self

    def __next__(self) -> Step:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class InferenceSchedule(PipeSchedule):
    def steps(self) -> Iterator[Step]:
        for mb in range(self.num_microbatches):
            yield [ForwardPreprocessTask(mb), ForwardStepTask(mb), ForwardPostprocessTask(mb)]


class Train1F1BSchedule(PipeSchedule):
    def __init__(self, num_microbatches: int, stages: int, stage_id: int) -> None:
        super().__init__(num_microbatches, stages, stage_id)
        self.get_microbatche_schedule()

    def get_microbatche_schedule(self) -> None:
        self.num_warmup_steps = min(self.stages - self.stage_id - 1, self.num_microbatches)
        self.num_steady_state_microbatches = self.num_microbatches - self.num_warmup_steps
        self.num_remaining_microbatches = self.num_warmup_steps

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        """``(microbatch, is_forward)`` of step ``step_id``."""
        warmup, steady = self.num_warmup_steps, self.num_steady_state_microbatches
        if step_id < warmup:
            return step_id, True
        if step_id < warmup + 2 * steady:
            offset = step_id - warmup
            forward = offset % 2 == 0
            return offset // 2 + (warmup if forward else 0), forward
        return steady + step_id - warmup - 2 * steady, False

    def steps(self) -> Iterator[Step]:
        has_next, has_prev = self._valid_stage(self.next_stage), self._valid_stage(self.prev_stage)
        previous = -1
        for step_id in range(2 * self.num_microbatches):
            mb, forward = self._step_to_micro_batch(step_id)
            step: Step = []
            if forward:
                step += [ForwardPreprocessTask(mb), ForwardStepTask(mb)]
                if mb < self.num_warmup_steps and has_next:
                    step.append(ForwardPostprocessTask(mb))
            else:
                if has_next:
                    step.append(BackwardPreprocessTask(mb))
                    if mb < self.num_steady_state_microbatches:  # the steady forward just before sends now
                        step.append(ForwardPostprocessTask(previous))
                step.append(BackwardStepTask(mb))
                if has_prev:
                    step.append(BackwardPostprocessTask(mb))
            previous = mb
            yield step
        yield [ReduceGradsTask()]


class TrainInterleavedSchedule(PipeSchedule):
    def __init__(
        self,
        num_microbatches: int,
        num_model_chunks: int,
        stages: int,
        stage_id: int,
        fused_send_recv: bool = False,
        fused_fwd_bwd: bool = False,
        use_odd_even_scheduler: bool = False,
    ) -> None:
        super().__init__(num_microbatches, stages, stage_id)
        if num_microbatches <= stages:  # nothing to fuse when every forward is a warm-up forward
            fused_send_recv = fused_fwd_bwd = False
        self.num_model_chunks = num_model_chunks
        self.fused_send_recv, self.fused_fwd_bwd = fused_send_recv, fused_fwd_bwd
        self.use_odd_even_scheduler = use_odd_even_scheduler
        self.get_step_schedule()

    def get_step_schedule(self) -> None:
        if self.num_microbatches % self.stages != 0:
            raise ValueError(
                f"Interleaved pipeline requires num_microbatches % pipeline_parallel_size == 0, current "
                f"num_microbatches {self.num_microbatches} and pipeline_parallel_size {self.stages}"
            )
        self.num_microbatches_steps = self.num_microbatches * self.num_model_chunks
        if self.num_microbatches == self.stages:
            warmup = self.num_microbatches_steps
        else:
            warmup = (self.stages - self.stage_id - 1) * 2 + (self.num_model_chunks - 1) * self.stages
        self.num_warmup_steps = min(warmup, self.num_microbatches_steps)
        self.num_steady_state_steps = self.num_microbatches_steps - self.num_warmup_steps
        self.num_remaining_steps = self.num_warmup_steps

    def get_model_chunk_id(self, step_id: int, is_forward: bool = True) -> int:
        """Chunk of step ``step_id``'s forward (or backward: counted from the first backward, chunks reversed)."""
        if not is_forward:
            step_id -= self.num_warmup_steps
        chunk = (step_id % (self.stages * self.num_model_chunks)) // self.stages
        return chunk if is_forward else self.num_model_chunks - chunk - 1

    def get_microbatch_id(self, step_id: int, is_forward: bool = True) -> int:
        """Microbatch of step ``step_id``: groups of ``stages`` microbatches, each run through every chunk."""
        if not is_forward:
            step_id -= self.num_warmup_steps
        group, within = divmod(step_id, self.stages * self.num_model_chunks)
        return self.stages * group + within % self.stages

    def _should_recv_fwd_send_bwd(self, step_id: int, is_forward: bool = True) -> bool:
        """Whether a forward input is received for the next step / an input grad sent: not on the first stage's
        first chunk."""
        chunk = self.get_model_chunk_id(step_id + 1 if is_forward else step_id, is_forward=is_forward)
        return not (self.stage_id == 0 and chunk == 0)

    def _should_recv_bwd_send_fwd(self, step_id: int, is_forward: bool = True) -> bool:
        """Whether an output grad is received for the next step / an output sent: not on the last stage's last
        chunk."""
        chunk = self.get_model_chunk_id(step_id if is_forward else step_id + 1, is_forward=is_forward)
        return not (self.stage_id == self.stages - 1 and chunk == self.num_model_chunks - 1)

    def _task(self, kind: type[PipelineTask], step_id: int, forward: bool, graph_break: bool = True) -> PipelineTask:
        mb = self.get_microbatch_id(step_id, is_forward=forward)
        return kind(mb, model_chunk=self.get_model_chunk_id(step_id, is_forward=forward), graph_break=graph_break)

    def _get_forward_preprocess_task(self, step_id: int, graph_break: bool = True) -> PipelineTask:
        return self._task(ForwardPreprocessTask, step_id + 1, True, graph_break)  # received for the next step

    def _get_forward_postprocess_task(self, step_id: int, graph_break: bool = True) -> PipelineTask:
        return self._task(ForwardPostprocessTask, step_id, True, graph_break)

    def _get_backward_preprocess_task(self, step_id: int, graph_break: bool = True) -> PipelineTask:
        return self._task(BackwardPreprocessTask, step_id + 1, False, graph_break)  # received for the next step

    def _get_backward_postprocess_task(self, step_id: int, graph_break: bool = True) -> PipelineTask:
        return self._task(BackwardPostprocessTask, step_id, False, graph_break)

    def _get_forward_step_task(self, step_id: int, graph_break: bool = True) -> PipelineTask:
        return self._task(ForwardStepTask, step_id, True, graph_break)

    def _get_backward_step_task(self, step_id: int, graph_break: bool = True) -> PipelineTask:
        return self._task(BackwardStepTask, step_id, False, graph_break)

    def _add_pre_post_processing_tasks(
        self, step_id: int, cmds: Step, fwd_pre: bool = True, fwd_post: bool = True, bwd_pre: bool = True,
        bwd_post: bool = True,
    ) -> None:  # fmt: skip
        """The step's communication tasks, in an order every pair of neighbours agrees on."""
        fused = self.fused_send_recv
        fwd_pre_task = lambda: self._get_forward_preprocess_task(step_id, not fused or not bwd_post)  # noqa: E731
        fwd_post_task = lambda: self._get_forward_postprocess_task(step_id, not fused or not bwd_pre)  # noqa: E731
        bwd_pre_task = lambda: self._get_backward_preprocess_task(step_id)  # noqa: E731
        bwd_post_task = lambda: self._get_backward_postprocess_task(step_id)  # noqa: E731
        if self.use_odd_even_scheduler:
            fwd_pre_task = lambda: self._get_forward_preprocess_task(step_id)  # noqa: E731
            fwd_post_task = lambda: self._get_forward_postprocess_task(step_id)  # noqa: E731
            if self.stage_id % 2 == 0:
                order = [(fwd_pre, fwd_pre_task), (fwd_post, fwd_post_task), (bwd_post, bwd_post_task),
                         (bwd_pre, bwd_pre_task)]  # fmt: skip
            else:
                order = [(fwd_post, fwd_post_task), (fwd_pre, fwd_pre_task), (bwd_pre, bwd_pre_task),
                         (bwd_post, bwd_post_task)]  # fmt: skip
        elif self.stage_id != self.stages - 1:
            order = [(fwd_pre, fwd_pre_task), (bwd_post, bwd_post_task), (fwd_post, fwd_post_task),
                     (bwd_pre, bwd_pre_task)]  # fmt: skip
        else:  # the last stage sends before it receives
            order = [(fwd_post, fwd_post_task), (bwd_pre, bwd_pre_task), (fwd_pre, fwd_pre_task),
                     (bwd_post, bwd_post_task)]  # fmt: skip
        cmds.extend(make() for wanted, make in order if wanted)

    def steps(self) -> Iterator[Step]:
        warmup, steady = self.num_warmup_steps, self.num_steady_state_steps
        total = warmup + steady + self.num_remaining_steps
        for step_id in range(total):
            cmds: Step = []
            if step_id < warmup:
                if step_id == 0:
                    cmds.append(self._get_forward_preprocess_task(-1))
                cmds.append(self._get_forward_step_task(step_id))
                flags = {
                    "fwd_pre": step_id != self.num_microbatches_steps - 1,
                    "fwd_post": self._should_recv_bwd_send_fwd(step_id, is_forward=True),
                    "bwd_pre": step_id == warmup - 1 and self._should_recv_bwd_send_fwd(step_id, is_forward=False),
                    "bwd_post": False,
                }
            elif step_id < warmup + steady:
                cmds.append(self._get_forward_step_task(step_id, graph_break=not self.fused_fwd_bwd))
                cmds.append(self._get_backward_step_task(step_id))
                flags = {
                    "fwd_pre": step_id != warmup + steady - 1,
                    "fwd_post": self._should_recv_bwd_send_fwd(step_id, is_forward=True),
                    "bwd_pre": self._should_recv_bwd_send_fwd(step_id, is_forward=False),
                    "bwd_post": self._should_recv_fwd_send_bwd(step_id, is_forward=False),
                }
            else:
                cmds.append(self._get_backward_step_task(step_id))
                flags = {
                    "fwd_pre": False,
                    "fwd_post": False,
                    "bwd_pre": step_id != total - 1 and self._should_recv_bwd_send_fwd(step_id, is_forward=False),
                    "bwd_post": self._should_recv_fwd_send_bwd(step_id, is_forward=False),
                }
            self._add_pre_post_processing_tasks(step_id, cmds, **flags)
            yield cmds
        yield [ReduceGradsTask()]


class TrainSchedule(PipeSchedule):
    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        """Even stages run forwards in even slots, odd stages in odd ones; a slot's microbatch counts the slots of
        its kind so far, less the stage's start-up delay (negative or past the end: an idle slot)."""
        half, half_odd = step_id // 2, (step_id - 1) // 2
        even_step, even_stage = step_id % 2 == 0, self.stage_id % 2 == 0
        if even_step == even_stage:  # a forward slot
            return (half if even_step else half_odd) - self.stage_id // 2, True
        if even_step:  # odd stage, backward slot
            return half - self.stages + (self.stage_id + 1) // 2, False
        return half_odd - self.stages + 1 + self.stage_id // 2, False  # even stage, backward slot

    def steps(self) -> Iterator[Step]:
        previous = -1
        total = 2 * (self.num_microbatches + self.stages - 1)
        for step_id in range(total):
            mb, forward = self._step_to_micro_batch(step_id)
            valid, previous_valid = self._valid_micro_batch(mb), self._valid_micro_batch(previous)
            cmds: Step = []
            if forward:
                if previous_valid and self._valid_stage(self.prev_stage):
                    cmds.append(BackwardPostprocessTask(previous))
                if valid:
                    cmds.append(ForwardPreprocessTask(mb))
            else:
                if valid and self._valid_stage(self.next_stage):
                    cmds.append(BackwardPreprocessTask(mb))
                if previous_valid and self._valid_stage(self.next_stage):
                    cmds.append(ForwardPostprocessTask(previous))
            if valid:
                cmds.append(ForwardStepTask(mb) if forward else BackwardStepTask(mb))
            if step_id == total - 1:
                cmds.append(ReduceGradsTask())
            previous = mb
            yield cmds


__all__ = [
    "BackwardPostprocessTask",
    "BackwardPreprocessTask",
    "BackwardStepTask",
    "ForwardPostprocessTask",
    "ForwardPreprocessTask",
    "ForwardStepTask",
    "InferenceSchedule",
    "PipeSchedule",
    "PipelineTask",
    "PostProcessTask",
    "ReduceGradsTask",
    "Train1F1BSchedule",
    "TrainInterleavedSchedule",
    "TrainSchedule",
]
