"""How many microbatches a step runs: a constant count, or Megatron's batch-size ramp-up.

``global batch = micro_batch_size * num_microbatches * data_parallel_size``. With a ramp-up the global batch starts
at ``start`` rows and grows by ``increment`` rows each time another ``ramp_samples / ((global - start) /
increment)`` samples have been consumed, until it reaches ``global_batch_size`` after ``ramp_samples`` samples;
``update(consumed_samples)`` moves it on (apex's view keeps one and reads the count through its
``get_num_microbatches``); errors name the sizes instead of asserting. :func:`split_microbatches` cuts a batch into
the microbatches a pipeline step runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _per_step(micro_batch_size: int, data_parallel_size: int) -> int:
    if micro_batch_size < 1 or data_parallel_size < 1:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} and data_parallel_size={data_parallel_size} must be >= 1"
        )
    return micro_batch_size * data_parallel_size


class NumMicroBatchesCalculator:
    """The current microbatch count (``get()``) and global batch size; ``update`` follows consumed samples."""

    def __init__(self, micro_batch_size: int, data_parallel_size: int) -> None:
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.rows_per_microbatch_step = _per_step(micro_batch_size, data_parallel_size)
        self.num_micro_batches: int | None = None
        self.current_global_batch_size: int | None = None

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        raise NotImplementedError


class ConstantNumMicroBatches(NumMicroBatchesCalculator):
    """``global_batch_size / (micro_batch_size * data_parallel_size)`` microbatches, always."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> None:
        super().__init__(micro_batch_size, data_parallel_size)
        if global_batch_size < 1 or global_batch_size % self.rows_per_microbatch_step:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a positive multiple of micro_batch_size="
                f"{micro_batch_size} x data_parallel_size={data_parallel_size}"
            )
        self.current_global_batch_size = global_batch_size
        self.num_micro_batches = global_batch_size // self.rows_per_microbatch_step

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        """Nothing changes with a constant count."""


class RampupBatchsizeNumMicroBatches(NumMicroBatchesCalculator):
    """Megatron's batch-size ramp-up from ``start_batch_size`` to ``global_batch_size`` in steps of
    ``batch_size_increment`` rows, spread evenly over the first ``ramup_samples`` samples (apex's spelling)."""

    def __init__(
        self,
        start_batch_size: int,
        batch_size_increment: int,
        ramup_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
    ) -> None:
        super().__init__(micro_batch_size, data_parallel_size)
        if not 0 < start_batch_size <= global_batch_size or batch_size_increment < 1 or ramup_samples < 0:
            raise ValueError(
                f"ramp-up from {start_batch_size} to {global_batch_size} rows in steps of {batch_size_increment} over "
                f"{ramup_samples} samples: need 0 < start <= global batch size, an increment >= 1 and samples >= 0"
            )
        increments, rest = divmod(global_batch_size - start_batch_size, batch_size_increment)
        if rest:
            raise ValueError(
                f"the ramp from {start_batch_size} to {global_batch_size} rows is not a whole number of increments "
                f"of {batch_size_increment}"
            )
        self.start_batch_size = start_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        self.global_batch_size = global_batch_size
        # samples consumed per increment (no ramp at all when start == global)
        self.rampup_samples_per_increment = ramup_samples / increments if increments else float("inf")
        self.update(0, consistency_check=False)

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        """The global batch after ``consumed_samples`` samples; with ``consistency_check`` it must split into whole
        microbatches on every replica."""
        if consumed_samples > self.ramup_samples:
            size = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            size = min(self.start_batch_size + steps * self.batch_size_increment, self.global_batch_size)
        if consistency_check and size % self.rows_per_microbatch_step:
            raise ValueError(
                f"the ramp-up's global batch of {size} rows is not a multiple of micro_batch_size="
                f"{self.micro_batch_size} x data_parallel_size={self.data_parallel_size}"
            )
        self.current_global_batch_size = size
        self.num_micro_batches = size // self.rows_per_microbatch_step


def build_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Sequence[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> NumMicroBatchesCalculator:
    """Constant without ``rampup_batch_size``; else ``[start batch size, increment, ramp-up samples]``."""
    del rank  # apex logs with it
    if rampup_batch_size is None:
        return ConstantNumMicroBatches(global_batch_size, micro_batch_size, data_parallel_size)
    if len(rampup_batch_size) != 3:
        raise ValueError(
            f"rampup_batch_size={list(rampup_batch_size)}: expected [start batch size, batch size increment, "
            "ramp-up samples]"
        )
    start, increment, samples = (int(v) for v in rampup_batch_size)
    return RampupBatchsizeNumMicroBatches(
        start, increment, samples, global_batch_size, micro_batch_size, data_parallel_size
    )


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """``num_microbatches`` equal row slices of every tensor of a list / tuple / dict batch, and of every value with a
    ``row_slice(start, stop)`` method (an object holding per-row tensors: it returns its own slice); other values, 0-d
    tensors included, are repeated in each; any other object (``None``, an iterator a step function draws from) is
    handed to every microbatch as it is. Refuses a batch with fewer rows than microbatches, rows that do not divide,
    or tensors of unequal rows."""
    m = num_microbatches
    if m < 1:
        raise ValueError(f"num_microbatches={m} must be >= 1")
    if batch is None or not isinstance(batch, (list, tuple, dict)):
        return [batch] * m
    values = list(batch.values() if isinstance(batch, dict) else batch)
    sizes = {x.shape[0] for x in values if torch.is_tensor(x) and x.dim() > 0}
    if len(sizes) > 1:
        raise ValueError(f"the tensors of the batch have different sizes along dim 0: {sorted(sizes)}")
    size = sizes.pop() if sizes else 0
    if 0 < size < m:
        raise ValueError(
            f"the batch has {size} row(s), fewer than num_microbatches={m}: every microbatch needs at least one; "
            f"pass at least {m} rows (per data-parallel rank) or lower num_microbatches"
        )
    if size % m != 0:
        raise ValueError(f"batch size {size} is not divisible into {m} microbatches")
    rows = size // m

    def part(x: Any, k: int) -> Any:
        if torch.is_tensor(x) and x.dim() > 0:
            return x[k * rows : (k + 1) * rows]
        if size and callable(getattr(x, "row_slice", None)):
            return x.row_slice(k * rows, (k + 1) * rows)
        return x

    if isinstance(batch, dict):
        return [{name: part(x, k) for name, x in batch.items()} for k in range(m)]
    return [[part(x, k) for x in batch] for k in range(m)]
