"""One-GPU training step of the benchmark GPT: dense vs meshpar's layers (tp=1 mesh), eager and compiled, with MFU.

    python benchmarks/bench_gpu_step.py          # needs CUDA; bf16; TP=2 timings need two GPUs (see bench_tp.py)

MFU counts 6 * (non-embedding parameters) + 12 * layers * seq * hidden FLOPs per token (forward + backward)
against the dense bf16 peak given by ``--peak-tflops`` (989 for an H100 SXM).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, str(Path(__file__).parent))
from bench_tp import GPT, MESHPAR_PLAN

import meshpar
from meshpar.optim import DistributedOptimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    dims = meshpar.init_parallel()
    ids = torch.randint(0, 256, (args.batch, args.seq), device="cuda")
    runs = {}
    for variant in ("dense", "meshpar"):
        for compiled in (False, True):
            torch.manual_seed(0)
            model = GPT(256, args.hidden, args.heads, args.layers, args.seq).to("cuda", torch.bfloat16)
            if variant == "meshpar":
                model = parallelize_module(model, dims.tp_mesh, MESHPAR_PLAN)
                opt = DistributedOptimizer(model, torch.optim.AdamW, lr=1e-4)
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            run = torch.compile(model) if compiled else model

            def step(m=run, o=opt) -> None:
                o.zero_grad(set_to_none=True)
                F.cross_entropy(m(ids).flatten(0, 1).float(), ids.flatten()).backward()
                o.step()

            for _ in range(3):
                step()
            runs[(variant, compiled)] = step
    n_params = sum(p.numel() for n, p in GPT(256, args.hidden, args.heads, args.layers, args.seq).named_parameters()
                   if "tok" not in n and "pos" not in n)  # fmt: skip
    flops_per_token = 6 * n_params + 12 * args.layers * args.seq * args.hidden
    tokens = args.batch * args.seq
    times = {k: [] for k in runs}
    for _ in range(args.rounds):
        for key, step in runs.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times[key].append(time.perf_counter() - start)
    print(f"{torch.cuda.get_device_name()} | GPT {args.layers}x{args.hidden}, seq {args.seq}, batch {args.batch}, bf16")
    base = statistics.median(times[("dense", False)])
    print(f"{'variant':10s} {'mode':8s} {'step ms':>8s} {'tokens/s':>10s} {'MFU':>6s} {'vs dense eager':>15s}")
    for (variant, compiled), values in times.items():
        t = statistics.median(values)
        mfu = flops_per_token * tokens / t / (args.peak_tflops * 1e12)
        mode = "compile" if compiled else "eager"
        print(f"{variant:10s} {mode:8s} {t * 1e3:8.2f} {tokens / t:10.0f} {mfu:6.1%} {t / base:14.2f}x")
    meshpar.destroy_parallel(destroy_process_group=True)


if __name__ == "__main__":
    main()
