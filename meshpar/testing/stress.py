"""Checkpoint protocols under any scheduling: random delays on every rank before each step that orders ranks.

A save or load is a protocol between ranks: barriers, broadcasts, agreements, DCP's own collectives, and file
operations that only rank 0 does. A protocol that is right only when ranks arrive in a particular order fails on a
loaded machine. :func:`random_delays` makes every rank sleep a random time (its own seeded stream) before each such
step, so many iterations with different seeds walk through many interleavings; :func:`checkpoint_stress` runs
save / load / re-save iterations under it and checks every result: the manifest, ``latest``, and a reload equal to
what was saved (model and optimizer). The test suite runs a short version; run a long one by hand::

    python -m meshpar.testing.stress --iterations 300 --layouts tp2xpp2,tp2xdp2

Delays are injected by patching the functions the protocol calls (test-only: production code has no hooks).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from meshpar import checkpoint
from meshpar._compat import local_tensor
from meshpar.optim import DistributedOptimizer
from meshpar.testing.reference import setup_parallel

# what a save or load calls that orders the ranks or touches the shared file system
_ORDERING_STEPS = (
    (checkpoint, "_barrier"),
    (checkpoint, "_broadcast"),
    (checkpoint, "first_failure_on_any_rank"),
    (checkpoint, "_write_atomic"),
    (checkpoint, "_fsync_files"),
    (checkpoint, "_verify_manifest"),
    (dcp, "save"),
    (dcp, "load"),
    (os, "rename"),
    (os, "replace"),
    (shutil, "rmtree"),
)


class InjectedFailureError(RuntimeError):
    """Raised by :func:`random_delays` at the step it was told to fail at."""


@contextlib.contextmanager
def random_delays(seed: int, max_delay_s: float, fail_at: int | None = None) -> Iterator[list[str]]:
    """Sleep ``uniform(0, max_delay_s)`` on this rank before every ordering step of a checkpoint protocol (each rank
    its own stream, from ``seed`` and the rank); yields the list of steps delayed, in order. With ``fail_at``, this
    rank raises :class:`InjectedFailureError` instead of running its ``fail_at``-th step."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = random.Random(seed * 1009 + rank)
    delayed: list[str] = []

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            delayed.append(name)
            time.sleep(rng.uniform(0.0, max_delay_s))
            if len(delayed) - 1 == fail_at:
                raise InjectedFailureError(f"injected failure on rank {rank} at {name} (step {fail_at})")
            return original(*args, **kwargs)

        return run

    with contextlib.ExitStack() as stack:
        for owner, name in _ORDERING_STEPS:
            original = getattr(owner, name)
            stack.enter_context(mock.patch.object(owner, name, wrap(name, original)))
        yield delayed


class _Stage(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)


def _model(dims: Any, hidden: int = 16) -> nn.Module:
    """A model whose pipeline rank ``r`` holds ``stages.<r>`` only (disjoint FQNs, as pipeline stages), tp-sharded."""
    from torch.distributed.tensor.parallel import parallelize_module

    from meshpar.tensor_parallel import ColumnParallel, RowParallel

    torch.manual_seed(0)
    model = nn.Module()
    model.stages = nn.ModuleDict({str(dims.pp_rank): _Stage(hidden)})
    plan = {f"stages.{dims.pp_rank}.up": ColumnParallel(), f"stages.{dims.pp_rank}.down": RowParallel()}
    return parallelize_module(model, dims.tp_mesh, plan)


def _locals(model: nn.Module, optimizer: DistributedOptimizer) -> dict[str, torch.Tensor]:
    """Everything a reload must restore, as this rank's local tensors (copies)."""
    values = {f"model.{n}": local_tensor(p).detach().clone() for n, p in model.named_parameters()}
    for fqn, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                values[f"optim.{fqn}.{key}"] = local_tensor(value).detach().clone()
    return values


def checkpoint_stress(
    directory: str,
    layout: dict[str, int],
    iterations: int,
    seed: int,
    max_delay_s: float,
    fail: tuple[int, int] | None = None,
) -> int:
    """On every rank: ``iterations`` rounds of train-ish update -> save (a new step or a re-save of the last) ->
    checks -> scramble -> load -> compare, each under :func:`random_delays`. Raises on the first wrong result;
    returns the number of ordering steps delayed. ``fail=(rank, k)``: that rank fails at its k-th delayed step of
    the first iteration (every rank must then raise, none hang)."""
    dims = setup_parallel(**layout)
    model = _model(dims)
    optimizer = DistributedOptimizer(
        list(model.named_parameters()), torch.optim.AdamW, zero1=dims.dp > 1, dims=dims, lr=0.1
    )
    plan = random.Random(seed)  # the same choices on every rank
    step, total = 0, 0
    for iteration in range(iterations):
        for param in model.parameters():
            param.grad = torch.full_like(param, 0.01 * (iteration + 1))
        optimizer.step()
        step = step if plan.random() < 0.3 and iteration else step + 1  # sometimes a re-save of the same step
        fail_at = fail[1] if fail is not None and iteration == 0 and dist.get_rank() == fail[0] else None
        with random_delays(seed * 7919 + iteration, max_delay_s, fail_at) as delayed:
            saved = checkpoint.save(directory, model, optimizer, step=step, extra={"iteration": iteration})
            expected = _locals(model, optimizer)
            problem = checkpoint._verify_manifest(saved)
            assert problem is None, problem
            assert checkpoint.latest_checkpoint(directory) == saved, (checkpoint.latest_checkpoint(directory), saved)
            with torch.no_grad():
                for param in model.parameters():
                    local_tensor(param).fill_(float("nan"))
            meta = checkpoint.load(directory, model, optimizer, step=step if plan.random() < 0.5 else None)
        assert meta == {"step": step, "extra": {"iteration": iteration}}, meta
        got = _locals(model, optimizer)
        assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"iteration {iteration}: {name} differs after the reload"
        others = sorted(p.name for p in Path(directory).iterdir() if p.name.startswith(f"step_{step:08d}"))
        assert others == [saved.name], f"iteration {iteration}: older copies of step {step} remain: {others}"
        total += len(delayed)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description="save / load / re-save with random delays on every rank")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=1, help="runs per layout, each with its own seed")
    parser.add_argument("--max-delay", type=float, default=0.05, help="seconds")
    parser.add_argument("--layouts", default="tp2xpp2,tp2xdp2")
    args = parser.parse_args()
    from meshpar.testing import run_distributed

    layouts = {"tp2xpp2": {"tp": 2, "pp": 2}, "tp2xdp2": {"tp": 2, "dp": 2}}
    for name in args.layouts.split(","):
        for seed in range(args.seeds):
            with tempfile.TemporaryDirectory() as directory:
                delayed = run_distributed(
                    checkpoint_stress, 4, directory, layouts[name], args.iterations, seed, args.max_delay, timeout=3600
                )
            print(f"{name} seed {seed}: {args.iterations} iterations OK, {sum(delayed)} delayed steps")


if __name__ == "__main__":
    main()
