"""NxD's schedule task lists (``meshpar.compat.nxd.pipeline.scheduler``) checked by what a schedule must satisfy,
at many sizes: every microbatch (of every chunk) is run forward once and backward once, backward after forward;
what a stage sends is what its neighbour receives, in the same order; the grads are reduced once, last; and NxD's
1F1B runs its forwards and backwards in exactly the order of meshpar's own 1F1B schedule."""

from __future__ import annotations

import itertools

import pytest

from meshpar.compat.nxd.pipeline import scheduler as s
from meshpar.pipeline.schedule_ir import build_actions


def _tasks(schedule: s.PipeSchedule) -> list:
    return [task for step in schedule for task in step]


def _keys(tasks: list, kind: type) -> list[tuple[int, int]]:
    return [(t.mb, t.model_chunk) for t in tasks if type(t) is kind]


def _check(stage_tasks: list[list], m: int, chunks: int, forward_only: bool = False) -> None:
    stages = len(stage_tasks)
    for stage, tasks in enumerate(stage_tasks):
        expected = sorted(itertools.product(range(m), range(chunks)))
        assert sorted(_keys(tasks, s.ForwardStepTask)) == expected
        if forward_only:
            continue
        assert sorted(_keys(tasks, s.BackwardStepTask)) == expected
        order = [(type(t), t.mb, t.model_chunk) for t in tasks]
        for mb, chunk in expected:
            assert order.index((s.ForwardStepTask, mb, chunk)) < order.index((s.BackwardStepTask, mb, chunk))
        assert isinstance(tasks[-1], s.ReduceGradsTask) and sum(isinstance(t, s.ReduceGradsTask) for t in tasks) == 1
        if stage + 1 < stages:  # sends of this stage == receives of the next one, in order (one chunk per stage)
            sent = [k for k in _keys(tasks, s.ForwardPostprocessTask)]
            received = [k for k in _keys(stage_tasks[stage + 1], s.ForwardPreprocessTask)]
            if chunks == 1:
                assert [mb for mb, _ in sent] == [mb for mb, _ in received]
                grads_sent = _keys(stage_tasks[stage + 1], s.BackwardPostprocessTask)
                assert [mb for mb, _ in grads_sent] == [mb for mb, _ in _keys(tasks, s.BackwardPreprocessTask)]


@pytest.mark.parametrize("m,stages", [(1, 1), (2, 4), (4, 4), (6, 4), (5, 3), (8, 2)])
def test_nxd_1f1b_schedules(m: int, stages: int) -> None:
    for cls in (s.Train1F1BSchedule, s.TrainSchedule):
        _check([_tasks(cls(m, stages, stage)) for stage in range(stages)], m, 1)
    _check([_tasks(s.InferenceSchedule(m, stages, stage)) for stage in range(stages)], m, 1, forward_only=True)


@pytest.mark.parametrize("m,stages", [(2, 4), (4, 4), (6, 4), (5, 3), (8, 2)])
def test_nxd_1f1b_runs_in_meshpars_1f1b_order(m: int, stages: int) -> None:
    actions = build_actions("1f1b", stages, 1, m)
    for stage in range(stages):
        computed = [(t.mb, type(t) is s.ForwardStepTask) for t in _tasks(s.Train1F1BSchedule(m, stages, stage))
                    if type(t) in (s.ForwardStepTask, s.BackwardStepTask)]  # fmt: skip
        assert computed == [(a.microbatch, a.kind == "F") for a in actions[stage]]


@pytest.mark.parametrize("m,chunks,stages", [(4, 2, 2), (4, 2, 4), (8, 3, 4), (6, 2, 3), (2, 2, 2)])
@pytest.mark.parametrize("flags", [(False, False, False), (True, True, False), (False, False, True)])
def test_nxd_interleaved_schedule(m: int, chunks: int, stages: int, flags: tuple[bool, bool, bool]) -> None:
    per_stage = [_tasks(s.TrainInterleavedSchedule(m, chunks, stages, stage, *flags)) for stage in range(stages)]
    _check(per_stage, m, chunks)
    for tasks in per_stage:  # every forward of a chunk but the model's last gets sent, every input received once
        assert len(set(_keys(tasks, s.ForwardPreprocessTask))) == len(_keys(tasks, s.ForwardPreprocessTask))


def test_nxd_schedule_basics() -> None:
    with pytest.raises(ValueError, match="num_microbatches % pipeline_parallel_size"):
        s.TrainInterleavedSchedule(3, 2, 2, 0)
    schedule = s.Train1F1BSchedule(4, 4, 1)
    assert (schedule.num_warmup_steps, schedule.stage, schedule.num_stages) == (2, 1, 4)
    assert not schedule.is_first_stage and not schedule.is_last_stage
    assert list(schedule) == list(schedule)  # iterating again starts over
    assert s.ForwardStepTask(1) == s.ForwardStepTask(1, 0, True) != s.BackwardStepTask(1)
    assert repr(s.ForwardStepTask(2, 1, False)) == "ForwardStepTask_microbatch_2_modelchunk_1_graphbreak_False"
    assert s.ReduceGradsTask() == s.ReduceGradsTask() and s.ReduceGradsTask().mb == -1
