"""Alternating timed rounds for the distributed benchmarks: every round runs each variant once (A B C A B C ...),
after a barrier, so machine drift hits all variants alike and per-round paired ratios cancel it."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping

import torch.distributed as dist


def alternate(runs: Mapping[Hashable, Callable[[], None]], rounds: int) -> dict[Hashable, list[float]]:
    """Seconds per step of each variant, one entry per round (this rank's view)."""
    times: dict[Hashable, list[float]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, step in runs.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - start)
    return times
