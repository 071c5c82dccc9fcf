"""meshpar's pipeline runtime (the executor every entry point uses) vs torch's ``torch.distributed.pipelining``
schedules on the same model split: 1F1B vs ``Schedule1F1B``, interleaved 1F1B (v=2) vs ``ScheduleInterleaved1F1B``.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_pipeline_runtime.py            # pp=2, 2 gloo processes, m in {4, 8}
    PYTHONPATH=. .venv/bin/python benchmarks/bench_pipeline_runtime.py --variable # a header on every activation

Both runtimes run in the same two processes, on separate copies of the same stages, alternating step by step
(meshpar, torch, meshpar, ...); the ratio is the median of the per-round ratios of the slower rank's step time, so
machine noise hits both sides alike. Also printed: the messages each rank receives per step, meshpar:torch. The
executor runs as NxD's and HF's pipelines run it: one activation shape per stage per step (``fixed_shapes``, the
microbatches being slices of one batch; apex's declared ``tensor_shape`` does the same), so only each stage's first
activation of a step carries a header. ``--variable`` sends one with every activation (apex's ``tensor_shape=None``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshpar.pipeline import split_model
from meshpar.pipeline.executor import run_schedule
from meshpar.pipeline.model import StageChunk
from meshpar.testing import run_distributed, setup_parallel
from meshpar.testing.torch_runtime import build_schedule, make_pipeline_stages

try:
    from benchmarks.bench_pipeline import HIDDEN, Block, Model
except ImportError:  # run as a script from benchmarks/
    from bench_pipeline import HIDDEN, Block, Model  # type: ignore[no-redef]

# (meshpar's schedule, v) against (a reference, v): "torch_*" names run on torch's runtime, others on meshpar's
ROWS = [
    (("1f1b", 1), ("torch_1f1b", 1)),
    (("interleaved_1f1b", 2), ("torch_interleaved_1f1b", 2)),
    (("zero_bubble", 1), ("1f1b", 1)),
    (("zero_bubble", 1), ("torch_interleaved_zero_bubble", 1)),
]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class RecvCounter:
    """Counts this process's point-to-point receives while active (``ProcessGroup.recv``, which both runtimes'
    ``recv`` / ``irecv`` reach)."""

    def __init__(self) -> None:
        self.count = 0
        # the class's own descriptor: ``dist.ProcessGroup.recv`` is the bare builtin, which put back on the class no
        # longer binds ``self`` (every later ``group.recv`` in this process would then fail)
        self._recv = dist.ProcessGroup.__dict__["recv"]

    def __enter__(self) -> RecvCounter:
        original = dist.ProcessGroup.recv

        def recv(group: dist.ProcessGroup, *args: object, **kwargs: object) -> object:
            self.count += 1
            return original(group, *args, **kwargs)

        dist.ProcessGroup.recv = recv
        return self

    def __exit__(self, *exc: object) -> None:
        dist.ProcessGroup.recv = self._recv


def _side(name: str, v: int, dims, m: int, ids: torch.Tensor, variable: bool) -> Callable[[], None]:
    """One step of ``name`` on its own copy of the stages (the same initial weights for every side)."""
    torch.manual_seed(0)
    stages, plan = split_model(Model(), dims.pp_rank, 2, transformer_layer_cls=Block, virtual_pipeline_size=v)
    if name.startswith("torch_"):
        schedule = build_schedule(
            name, make_pipeline_stages(stages, plan.num_stages, dims.pp_mesh, ids.device), m, loss_fn
        )
        return lambda: schedule.step(ids, target=ids) if dims.pp_rank == 0 else schedule.step(target=ids)
    chunks = [StageChunk(module, index, input_names=["x"]) for index, module in stages]
    microbatches = [{"x": x, "labels": x} for x in ids.chunk(m)]

    def forward_step(microbatch: dict, chunk: StageChunk) -> tuple:
        return chunk(**microbatch), lambda out: loss_fn(out, microbatch["labels"])

    schedule = "zero_bubble" if name == "zero_bubble" else "1f1b"
    options = {"loss_scale": 1.0 / m, "fixed_shapes": not variable}
    return lambda: run_schedule(dims, chunks, microbatches, forward_step, False, schedule, **options)


def measure(ours: tuple[str, int], theirs: tuple[str, int], m: int, rounds: int, batch: int, seq: int, variable: bool):
    dims = setup_parallel(pp=2)
    ids = torch.randint(0, 256, (batch, seq))
    steps = {"meshpar": _side(*ours, dims, m, ids, variable), "reference": _side(*theirs, dims, m, ids, variable)}
    times: dict[str, list[float]] = {"meshpar": [], "reference": []}
    recvs = {}
    for step in range(rounds + 1):
        for name, fn in steps.items():
            dist.barrier()
            with RecvCounter() as counter:
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
            if step:  # the first step initialises torch's stages (shape inference, buffers)
                times[name].append(elapsed)
                recvs[name] = counter.count
    return times, recvs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--variable", action="store_true", help="shapes may change per microbatch: header on each")
    args = parser.parse_args()
    print(f"pp=2 on 2 gloo processes (CPU), 8-layer MLP-block model, hidden {HIDDEN}, batch {args.batch}x{args.seq}")
    print(f"{'m':>3s} {'meshpar':18s} {'reference':30s} {'meshpar ms':>10s} {'ref ms':>9s} {'ratio':>6s} recvs/rank")
    for m in (4, 8):
        for ours, theirs in ROWS:
            per_rank = run_distributed(measure, 2, ours, theirs, m, args.rounds, args.batch, args.seq, args.variable)
            slowest = {
                k: [max(r[0][k][i] for r in per_rank) for i in range(args.rounds)] for k in ("meshpar", "reference")
            }
            ratio = statistics.median(a / b for a, b in zip(slowest["meshpar"], slowest["reference"], strict=True))
            recvs = "/".join(f"{r[1]['meshpar']}:{r[1]['reference']}" for r in per_rank)
            ms = {k: statistics.median(v) * 1e3 for k, v in slowest.items()}
            label = f"{theirs[0]} (meshpar)" if not theirs[0].startswith("torch_") else theirs[0]
            print(
                f"{m:3d} {ours[0]:18s} {label:30s} {ms['meshpar']:10.1f} {ms['reference']:9.1f} {ratio:5.2f}x {recvs}"
            )


if __name__ == "__main__":
    main()
