"""Schedule action lists and the inspector: bubble, in-flight bound, deadlock detection, rendering."""

from __future__ import annotations

import pytest

from meshpar.pipeline import Action, ScheduleDeadlockError, build_actions, inspect_schedule, simulate
from meshpar.pipeline.schedule_ir import _rounds, warmup_forwards

CONFIGS = [(pp, v, m) for pp in (2, 4, 8) for v in (1, 2, 4) for m in range(pp, 8 * pp + 1)]


@pytest.mark.parametrize(("pp", "v"), [(pp, v) for pp in (2, 4, 8) for v in (1, 2, 4)])
def test_interleaved_bubble_is_theory_for_every_m(pp: int, v: int) -> None:
    for m in range(pp, 8 * pp + 1):  # multiples of pp and every non-multiple
        timeline = inspect_schedule("interleaved_1f1b" if v > 1 else "1f1b", pp, v, m)
        assert timeline.bubble_fraction == pytest.approx((pp - 1) / (v * m), abs=1e-12), (pp, v, m)


@pytest.mark.parametrize(("pp", "v"), [(pp, v) for pp in (2, 4, 8) for v in (1, 2, 4)])
def test_in_flight_never_exceeds_the_1f1b_bound(pp: int, v: int) -> None:
    for m in range(pp, 8 * pp + 1):
        peaks = inspect_schedule("interleaved_1f1b" if v > 1 else "1f1b", pp, v, m).peak_in_flight()
        for rank, peak in peaks.items():
            assert peak == min(warmup_forwards(rank, pp, v, m) + 1, v * m)
            # 1F1B: at most pp microbatches in flight; interleaved: Megatron's v * pp + pp - 1 chunk activations when
            # pp divides m, and v * R + pp - 1 with the wider first round R (< 2 pp) otherwise
            width = len(_rounds(m, pp)[0]) if v > 1 else pp
            assert peak <= v * width + (pp - 1 if v > 1 else 0)
            if m % pp == 0:
                assert peak <= v * pp + (pp - 1 if v > 1 else 0)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zero_bubble_h1_has_a_third_of_the_bubble_in_1f1b_memory(pp: int) -> None:
    """ZB-H1: bubble (pp - 1) / (3 m) (1F1B's is (pp - 1) / m) and no rank holds more microbatches' activations than
    1F1B's first rank (pp); every forward, input grad and weight grad once, each weight grad after its input grad."""
    for m in range(pp, 8 * pp + 1):
        timeline = inspect_schedule("zb_h1", pp, 1, m)
        assert timeline.bubble_fraction == pytest.approx((pp - 1) / (3 * m), abs=1e-12), (pp, m)
        assert timeline.bubble_fraction < inspect_schedule("1f1b", pp, 1, m).bubble_fraction
        assert timeline.peak_in_flight() == dict.fromkeys(range(pp), pp)
        for rank, actions in timeline.actions.items():
            assert sorted(actions) == sorted(Action(k, rank, i) for k in "FIW" for i in range(m))
            assert all(actions.index(Action("I", rank, i)) < actions.index(Action("W", rank, i)) for i in range(m))


def test_gpipe_holds_every_microbatch_and_has_the_same_bubble() -> None:
    timeline = inspect_schedule("gpipe", 4, 1, 8)
    assert timeline.peak_in_flight() == dict.fromkeys(range(4), 8)
    assert timeline.bubble_fraction == pytest.approx(3 / 8)


def test_megatron_warmup_counts() -> None:
    assert [warmup_forwards(r, 4, 2, 8) for r in range(4)] == [10, 8, 6, 4]  # (pp-r-1)*2 + (v-1)*pp
    assert [warmup_forwards(r, 4, 1, 8) for r in range(4)] == [3, 2, 1, 0]
    assert [warmup_forwards(r, 2, 2, 2) for r in range(2)] == [4, 2]  # capped: m == pp


def test_every_rank_runs_each_forward_and_backward_once() -> None:
    for pp, v, m in [(2, 2, 3), (4, 2, 6), (4, 4, 9)]:
        actions = build_actions("interleaved_1f1b", pp, v, m)
        for rank, rank_actions in actions.items():
            stages = range(rank, pp * v, pp)
            expected = {Action(k, s, i) for k in "FB" for s in stages for i in range(m)}
            assert sorted(rank_actions) == sorted(expected)


def test_deadlock_is_detected_with_the_grid() -> None:
    actions = {0: [Action("F", 0, 0), Action("B", 0, 0)], 1: [Action("B", 1, 0), Action("F", 1, 0)]}
    with pytest.raises(ScheduleDeadlockError, match="each rank waits on"):
        simulate(actions, 2, 1, 1)


def test_grid_and_png(tmp_path) -> None:
    timeline = inspect_schedule("interleaved_1f1b", 2, 2, 4)
    grid = timeline.grid()
    assert grid.count("rank") == 2 and "B" in grid
    zero_bubble = inspect_schedule("zb_h1", 2, 1, 4).grid().splitlines()
    assert zero_bubble[1] == "rank 1: ..0F0I1F1I0W2F2I1W3F3I2W3W"  # the last rank holds back one W for the cool-down
    pytest.importorskip("matplotlib")
    timeline.plot(str(tmp_path / "schedule.png"))
    assert (tmp_path / "schedule.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("schedule", "pp", "v", "m", "message"),
    [
        ("interleaved_1f1b", 4, 2, 3, "num_microbatches=3 is smaller than pp=4"),
        ("interleaved_1f1b", 1, 2, 4, "needs pipeline parallelism \\(pp > 1\\)"),
        ("1f1b", 2, 2, 4, "use interleaved_1f1b"),
        ("zb_h1", 2, 2, 4, "zb_h1 runs one stage per rank"),
        ("zero_bubble", 2, 1, 4, "unknown schedule"),
    ],
)
def test_bad_schedule_arguments(schedule: str, pp: int, v: int, m: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_actions(schedule, pp, v, m)
