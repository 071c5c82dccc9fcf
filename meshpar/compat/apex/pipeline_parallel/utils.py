"""``apex.transformer.pipeline_parallel.utils``: the microbatch calculator and loss helpers."""

from meshpar.pipeline.apex import (
    average_losses_across_data_parallel_group,
    build_model,
    get_current_global_batch_size,
    get_kth_microbatch,
    get_micro_batch_size,
    get_num_microbatches,
    setup_microbatch_calculator,
    update_num_microbatches,
)

__all__ = [
    "average_losses_across_data_parallel_group",
    "build_model",
    "get_current_global_batch_size",
    "get_kth_microbatch",
    "get_micro_batch_size",
    "get_num_microbatches",
    "setup_microbatch_calculator",
    "update_num_microbatches",
]
