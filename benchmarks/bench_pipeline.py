"""Pipeline schedules side by side: step time and peak saved-activation memory per rank, and the bubble table.

    .venv/bin/python benchmarks/bench_pipeline.py        # pp=2 on 2 local gloo processes, m in {4, 8}

The measured bubble is, per rank, (step time - busy time) / busy time, where busy time is the same stages' forward
and backward of all microbatches run back to back with nothing to wait for; it includes the p2p transfers and the
schedule runtime's overhead, which the unit-time theory (pp - 1) / (v * m) leaves out.

Memory is measured exactly, without an allocator: every tensor autograd saves for backward is counted while it is
alive (``saved_tensors_hooks``), and the peak per rank is reported. Step times alternate the schedules round by round
in one invocation; ratios are against GPipe.
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from meshpar._compat import local_tensor
from meshpar.pipeline import inspect_schedule, split_model
from meshpar.testing import run_distributed, setup_parallel
from meshpar.testing.torch_runtime import build_schedule, make_pipeline_stages

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]
HIDDEN = 128


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Model(nn.Module):
    def __init__(self, vocab: int = 256, hidden: int = HIDDEN, layers: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


class SavedBytes:
    """Live bytes saved for backward, and their peak (a DTensor counted by its local shard: its own storage reports
    the global size)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> object:
        size = local_tensor(tensor).untyped_storage().nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        holder = _Holder(tensor)
        weakref.finalize(holder, self._release, size)
        return holder

    def _release(self, size: int) -> None:
        self.live -= size


class _Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def busy_time(stages: list[tuple[int, nn.Module]], num_stages: int, ids: torch.Tensor, m: int) -> float:
    """Seconds this rank's stages need for forward + backward of all ``m`` microbatches with nothing to wait for
    (random inputs and output grads stand in for the neighbours'): the pipeline's compute without its bubble."""
    start = time.perf_counter()
    for index, module in stages:
        for micro in ids.chunk(m):
            x = micro if index == 0 else torch.randn(*micro.shape, HIDDEN, requires_grad=True)
            out = module(x)
            if index == num_stages - 1:
                loss_fn(out, micro).backward()
            else:
                out.backward(torch.randn_like(out))
    return time.perf_counter() - start


def measure(schedule: str, v: int, m: int, rounds: int, batch: int, seq: int) -> tuple[float, int, float]:
    dims = setup_parallel(pp=2)
    torch.manual_seed(0)
    stages_and_modules, plan = split_model(
        Model(), dims.pp_rank, 2, transformer_layer_cls=Block, virtual_pipeline_size=v
    )
    stages = make_pipeline_stages(stages_and_modules, plan.num_stages, dims.pp_mesh, torch.device("cpu"))
    sched = build_schedule(schedule, stages, m, loss_fn=loss_fn)
    ids = torch.randint(0, 256, (batch, seq))
    counter = SavedBytes()
    times = []
    for step in range(rounds + 1):
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda holder: holder.tensor):
            sched.step(ids, target=ids)
        if step:  # the first step initialises the stages
            times.append(time.perf_counter() - start)
    busy = busy_time(stages_and_modules, plan.num_stages, ids, m)
    return statistics.median(times), counter.peak, busy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    print("pp=2 on 2 gloo processes (CPU), 8-layer MLP-block model, hidden 128")
    columns = f"{'m':>3s} {'schedule':18s} {'step ms':>9s} {'vs gpipe':>9s}"
    print(f"{columns} {'peak saved MiB r0/r1':>22s} {'bubble theory':>14s} {'measured':>9s}")
    for m in (4, 8):
        results: dict[str, list] = {name: [] for name, _ in SCHEDULES}
        for _ in range(args.rounds):  # A B C A B C ...
            for name, v in SCHEDULES:
                results[name].append(run_distributed(measure, 2, name, v, m, 1, args.batch, args.seq))
        base = statistics.median(r[0][0] for r in results["gpipe"])
        for name, v in SCHEDULES:
            step = statistics.median(r[0][0] for r in results[name])
            peaks = results[name][-1]
            bubble = inspect_schedule(name, 2, v, m).bubble_fraction
            # idle time over busy time per rank, as the theory counts it: (pp - 1) / (v * m)
            measured = statistics.median(
                statistics.mean(rank_step / rank_busy - 1 for rank_step, _, rank_busy in r) for r in results[name]
            )
            mem = f"{peaks[0][1] / 2**20:.1f}/{peaks[1][1] / 2**20:.1f}"
            print(f"{m:3d} {name:18s} {step * 1e3:9.1f} {step / base:8.2f}x {mem:>22s} {bubble:14.3f} {measured:9.3f}")
    print("\nbubble fraction (unit-time model, B = 2F): interleaved 1F1B, rows pp x v, columns m")
    for pp in (2, 4, 8):
        for v in (1, 2, 4):
            ms = range(pp, 8 * pp + 1, pp)
            name = "interleaved_1f1b" if v > 1 else "1f1b"
            cells = " ".join(f"m={m}:{inspect_schedule(name, pp, v, m).bubble_fraction:.3f}" for m in ms)
            print(f"pp={pp} v={v}: {cells}")


if __name__ == "__main__":
    main()
