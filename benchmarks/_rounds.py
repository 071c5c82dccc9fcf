"""Alternating timed rounds for the distributed benchmarks: every round runs each variant once (A B C A B C ...),
after a barrier, so machine drift hits all variants alike and per-round paired ratios cancel it. Also the model-size
and round-count arguments those benchmarks share."""

from __future__ import annotations

import argparse
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


def model_arguments(batch_help: str | None = None) -> argparse.ArgumentParser:
    """A parser with the benchmark GPT's size (4 layers x hidden 256, 4 heads, seq 256, batch 4) and ``--rounds``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help=batch_help)
    parser.add_argument("--rounds", type=int, default=10)
    return parser
