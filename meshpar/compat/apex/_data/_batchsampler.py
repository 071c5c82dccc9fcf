"""``apex.transformer._data._batchsampler``: apex's Megatron-style batch samplers, which yield a whole local
minibatch of dataset indices at a time (the schedules split it into microbatches).

Both keep apex's exact index sequences, quirks included: ``MegatronPretrainingSampler`` collects
``local_minibatch_size`` indices and yields this data-parallel rank's ``[rank * size, (rank + 1) * size)`` slice of
them (so with ``data_parallel_size > 1`` only rank 0 gets indices, as in apex); ``MegatronPretrainingRandomSampler``
shuffles each rank's own bucket with the epoch as seed and resumes from ``consumed_samples``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["MegatronPretrainingRandomSampler", "MegatronPretrainingSampler"]


def _check_sizes(local_minibatch_size: int, data_parallel_rank: int, data_parallel_size: int, error: type) -> None:
    if local_minibatch_size <= 0:
        raise error(f"local minibatch size must be greater than 0: {local_minibatch_size}")
    if data_parallel_size <= 0:
        raise error(f"data parallel size must be greater than 0: {data_parallel_size}")
    if data_parallel_rank >= data_parallel_size:
        raise error(
            f"data_parallel_rank {data_parallel_rank} must be smaller than data_parallel_size {data_parallel_size}"
        )


class _MinibatchSampler:
    """What both samplers share: sizes, ``len`` (the dataset's samples) and the resizable local minibatch."""

    def __init__(self, total_samples: int, consumed_samples: int, local_minibatch_size: int, dp_rank: int, dp: int):
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.data_parallel_rank, self.data_parallel_size = dp_rank, dp
        self.local_minibatch_size = local_minibatch_size

    def __len__(self) -> int:
        return self.total_samples

    @property
    def local_minibatch_size(self) -> int:
        return self._local_minibatch_size

    @local_minibatch_size.setter
    def local_minibatch_size(self, size: int) -> None:
        self._local_minibatch_size = size
        self.local_minibatch_times_data_parallel_size = size * self.data_parallel_size


class MegatronPretrainingSampler(_MinibatchSampler):
    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        local_minibatch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise RuntimeError(f"no sample to consume: {total_samples}")
        if consumed_samples >= total_samples:
            raise RuntimeError(f"no samples left to consume: {consumed_samples}, {total_samples}")
        _check_sizes(local_minibatch_size, data_parallel_rank, data_parallel_size, RuntimeError)
        super().__init__(total_samples, consumed_samples, local_minibatch_size, data_parallel_rank, data_parallel_size)
        self.drop_last = drop_last

    def get_start_end_idx(self) -> tuple[int, int]:
        start = self.data_parallel_rank * self.local_minibatch_size
        return start, start + self.local_minibatch_size

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for index in range(self.consumed_samples, self.total_samples):
            batch.append(index)
            if len(batch) == self.local_minibatch_size:
                start, end = self.get_start_end_idx()
                yield batch[start:end]
                batch = []
        if batch and not self.drop_last:
            start, end = self.get_start_end_idx()
            yield batch[start:end]


class MegatronPretrainingRandomSampler(_MinibatchSampler):
    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        local_minibatch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"no sample to consume: total_samples of {total_samples}")
        _check_sizes(local_minibatch_size, data_parallel_rank, data_parallel_size, ValueError)
        super().__init__(total_samples, consumed_samples, local_minibatch_size, data_parallel_rank, data_parallel_size)
        self.last_batch_size = total_samples % self.local_minibatch_times_data_parallel_size

    def __iter__(self) -> Iterator[list[int]]:
        usable = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // usable
        into_epoch = self.consumed_samples % usable
        bucket = (self.total_samples // self.local_minibatch_times_data_parallel_size) * self.local_minibatch_size
        offset = into_epoch // self.data_parallel_size
        first = self.data_parallel_rank * bucket
        generator = torch.Generator()
        generator.manual_seed(self.epoch)
        order = torch.randperm(bucket, generator=generator).tolist()
        batch: list[int] = []
        for index in (first + i for i in order[offset:]):
            batch.append(index)
            if len(batch) == self.local_minibatch_size:
                self.consumed_samples += self.local_minibatch_times_data_parallel_size
                yield batch
                batch = []
