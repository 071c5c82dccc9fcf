"""Microbatch calculators (meshpar.pipeline.microbatches, apex's ``microbatches`` module): constant counts and
Megatron's batch-size ramp-up, with sizes that do not fit refused by name; the ramp-up drives apex's schedules."""

from __future__ import annotations

import pytest

from meshpar.compat.apex.enums import ModelType
from meshpar.compat.apex.microbatches import (
    ConstantNumMicroBatches,
    RampupBatchsizeNumMicroBatches,
    build_num_microbatches_calculator,
)


def test_constant_count() -> None:
    calculator = build_num_microbatches_calculator(0, None, 24, 2, 3)
    assert isinstance(calculator, ConstantNumMicroBatches)
    calculator.update(10_000, True)
    assert (calculator.get(), calculator.get_current_global_batch_size(), calculator.micro_batch_size) == (4, 24, 2)


def test_rampup_grows_by_increments_over_the_samples() -> None:
    """From 4 to 16 rows in steps of 4 over 90 samples: one step every 30 samples, then the full batch."""
    calculator = build_num_microbatches_calculator(0, [4, 4, 90], 16, 2, 2)
    assert isinstance(calculator, RampupBatchsizeNumMicroBatches)
    seen = []
    for consumed in (0, 29, 30, 59, 60, 89, 90, 91, 10_000):
        calculator.update(consumed, True)
        seen.append((calculator.get_current_global_batch_size(), calculator.get()))
    assert seen == [(4, 1), (4, 1), (8, 2), (8, 2), (12, 3), (12, 3), (16, 4), (16, 4), (16, 4)]


@pytest.mark.parametrize(
    ("rampup", "global_batch", "message"),
    [
        (None, 10, "not a positive multiple of micro_batch_size=2 x data_parallel_size=2"),
        ([4, 4], 16, "expected \\[start batch size, batch size increment, ramp-up samples\\]"),
        ([4, 5, 90], 16, "not a whole number of increments of 5"),
        ([20, 4, 90], 16, "need 0 < start <= global batch size"),
    ],
)
def test_sizes_that_do_not_fit_are_refused_by_name(rampup: list | None, global_batch: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_num_microbatches_calculator(0, rampup, global_batch, 2, 2)


def test_a_ramp_step_that_does_not_split_into_microbatches_is_refused() -> None:
    calculator = build_num_microbatches_calculator(0, [2, 2, 30], 8, 4, 1)  # 2 rows: half a microbatch of 4
    with pytest.raises(ValueError, match="global batch of 2 rows is not a multiple"):
        calculator.update(0, True)


def rampup_schedule_case() -> list[int]:
    """apex's pipeline utils at pp2: the schedule splits each step's batch into the ramp-up's current count."""
    from meshpar.compat.apex.pipeline_parallel import utils
    from meshpar.testing import setup_parallel

    setup_parallel(pp=2)
    utils.setup_microbatch_calculator(0, [4, 4, 8], 8, 2, 1)
    counts = []
    for consumed in (0, 4, 8, 12):
        utils.update_num_microbatches(consumed)
        counts.append(utils.get_num_microbatches())
    return counts


def test_rampup_through_apexs_pipeline_utils() -> None:
    from meshpar.testing import run_distributed

    # 4 -> 8 rows in one increment of 4 over 8 samples: 4 rows (2 microbatches) before 8 samples, then 8 rows (4)
    assert run_distributed(rampup_schedule_case, 2) == [[2, 2, 4, 4]] * 2


def test_model_type_names_and_values_are_apexs() -> None:
    assert (ModelType.encoder_or_decoder.value, ModelType.encoder_and_decoder.value) == (1, 2)
