"""``apex.transformer.microbatches``: the microbatch calculators (constant and batch-size ramp-up)."""

from meshpar.pipeline.microbatches import (
    ConstantNumMicroBatches,
    NumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatches,
    build_num_microbatches_calculator,
)

__all__ = [
    "ConstantNumMicroBatches",
    "NumMicroBatchesCalculator",
    "RampupBatchsizeNumMicroBatches",
    "build_num_microbatches_calculator",
]
