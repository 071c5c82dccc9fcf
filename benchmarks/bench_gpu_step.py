"""One-device training step of the benchmark GPT: dense vs meshpar's layers (tp=1 mesh), eager and compiled, with MFU.

    python benchmarks/bench_gpu_step.py                  # CUDA, bf16: all four variants alternating in one process
    python benchmarks/bench_gpu_step.py --isolate        # each variant in its own fresh process, passes alternating
    python benchmarks/bench_gpu_step.py --device cpu --layers 2 --hidden 128 --seq 128 --batch 2   # CPU smoke run

MFU counts 6 * (non-embedding parameters) + 12 * layers * seq * hidden FLOPs per token (forward + backward)
against the dense bf16 peak given by ``--peak-tflops`` (989 for an H100 SXM). The script also prints the aten ops
each variant dispatches per eager step, split into compute ops, collectives and host syncs, which is the same on
any device: a meshpar step that launched more kernels or synchronised with the host would show up there. The
"host ms" column is the time until the host has enqueued the step (on CPU it equals the step time); when it
approaches the step time the GPU is starved and host overhead is what is being measured. A synchronising op inside
the step (on CUDA, the embedding backward copies a count to the host) makes the host wait for the device, so on
CUDA the script also profiles a few steps of each variant: "device ms" is the sum of the step's kernel times, and
"busy" is device ms over step ms. A step that is slower with the same device ms is paying host overhead; one whose
device ms grew runs slower kernels, which ``--breakdown`` lists (kernels whose time differs most between dense
eager and meshpar eager).

``--isolate`` exists to separate the layers' own cost from process state: in one process the four resident models
and two compiled graphs share the caching allocator and the compiler's caches, which a step time in a fresh process
does not see. TP=2 timings need two GPUs (see bench_tp.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, str(Path(__file__).parent))
from _profile import kernel_times
from bench_tp import GPT, MESHPAR_PLAN

import meshpar
from meshpar.optim import DistributedOptimizer
from meshpar.testing.dispatch import AtenOps

VARIANTS = ("dense:eager", "dense:compile", "meshpar:eager", "meshpar:compile")


def build_step(variant: str, args: argparse.Namespace, dims, ids: torch.Tensor) -> Callable[[], None]:
    kind, mode = variant.split(":")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = GPT(256, args.hidden, args.heads, args.layers, args.seq).to(args.device, dtype)
    if kind == "meshpar":
        model = parallelize_module(model, dims.tp_mesh, MESHPAR_PLAN)
        opt = DistributedOptimizer(model, torch.optim.AdamW, dims=dims, lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = torch.compile(model) if mode == "compile" else model

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(run(ids).flatten(0, 1).float(), ids.flatten()).backward()
        opt.step()

    for _ in range(3):
        step()
    return step


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def print_host_profile(variant: str, step: Callable[[], None], steps: int = 5, top: int = 22) -> None:
    """Where a step's host time goes: the Python functions with the most own time (cProfile, ``steps`` steps)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    print(f"\nhost profile of {variant}, {steps} steps, by own time:")
    print("\n".join(line[:160] for line in out.getvalue().splitlines() if line.strip()))


def time_variants(variants: list[str], args: argparse.Namespace) -> tuple[dict, dict, dict, dict]:
    """Step times and host (enqueue) times, alternating the variants round by round, and the per-step op counts
    of the eager variants. A host time close to the step time means the step is bound by the host, not the
    device: Python and dispatch overhead then shows up one to one in the step time."""
    dims = meshpar.init_parallel(device_type=args.device)
    ids = torch.randint(0, 256, (args.batch, args.seq), device=args.device)
    steps = {v: build_step(v, args, dims, ids) for v in variants}
    ops = {}
    for variant, step in steps.items():
        if variant.endswith(":eager"):
            with AtenOps() as counter:
                step()
            ops[variant] = {"compute": sum(counter.compute.values()), "collectives": counter.collectives,
                            "host syncs": counter.syncs}  # fmt: skip
    times: dict[str, list[float]] = {v: [] for v in variants}
    host: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant, step in steps.items():
            _sync(args.device)
            start = time.perf_counter()
            step()
            host[variant].append(time.perf_counter() - start)  # until the host has enqueued the whole step
            _sync(args.device)
            times[variant].append(time.perf_counter() - start)
    kernels = {}  # variant -> {kernel: device us per step}
    if args.device == "cuda":
        for variant, step in steps.items():
            kernels[variant] = {name: us for name, (_, us) in kernel_times(step, calls=3).items()}
    for variant in args.cprofile or []:
        print_host_profile(variant, steps[variant])
    meshpar.destroy_parallel(destroy_process_group=True)
    return times, host, ops, kernels


_NOT_FORWARDED = ("isolate", "only", "breakdown", "cprofile", "passes", "variants")


def time_isolated(args: argparse.Namespace) -> tuple[dict, dict]:
    """Each variant in a fresh process; ``--passes`` passes over the variants, alternating, medians pooled."""
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    host: dict[str, list[float]] = {v: [] for v in args.variants}
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in _NOT_FORWARDED]
    for _ in range(args.passes):
        for variant in args.variants:
            cmd = [sys.executable, __file__, *forwarded, f"--only={variant}"]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            step_times, host_times = json.loads(out.strip().splitlines()[-1])
            times[variant] += step_times
            host[variant] += host_times
    return times, host


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--passes", type=int, default=2, help="with --isolate: passes over the variants")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--isolate", action="store_true", help="time each variant in its own fresh process")
    parser.add_argument("--breakdown", action="store_true", help="CUDA: kernels that differ, dense vs meshpar eager")
    parser.add_argument("--cprofile", nargs="*", choices=VARIANTS, help="print these variants' host profiles")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="the variants to time (dense:eager, the baseline, always among them)")  # fmt: skip
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # child of --isolate: one variant, JSON out
    args = parser.parse_args()
    if "dense:eager" not in args.variants:
        parser.error("--variants must include dense:eager, the baseline of every ratio")
    if args.only:
        times, host, _, _ = time_variants([args.only], args)
        print(json.dumps([times[args.only], host[args.only]]))
        return
    ops, kernels = {}, {}
    if args.isolate:
        times, host = time_isolated(args)
    else:
        times, host, ops, kernels = time_variants(list(args.variants), args)

    n_params = sum(p.numel() for n, p in GPT(256, args.hidden, args.heads, args.layers, args.seq).named_parameters()
                   if "tok" not in n and "pos" not in n)  # fmt: skip
    flops_per_token = 6 * n_params + 12 * args.layers * args.seq * args.hidden
    tokens = args.batch * args.seq
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    how = "each variant in its own process" if args.isolate else "all variants alternating in one process"
    print(f"{device} | GPT {args.layers}x{args.hidden}, seq {args.seq}, batch {args.batch} | {how}")
    base = statistics.median(times["dense:eager"])
    header = ("variant", "mode", "step ms", "host ms", "device ms", "busy", "tokens/s", "MFU", "vs dense eager")
    print("{:10s} {:8s} {:>8s} {:>8s} {:>9s} {:>5s} {:>10s} {:>6s} {:>15s}".format(*header))
    for variant, values in times.items():
        kind, mode = variant.split(":")
        t, h = statistics.median(values), statistics.median(host[variant])
        mfu = f"{flops_per_token * tokens / t / (args.peak_tflops * 1e12):6.1%}" if args.device == "cuda" else "   n/a"
        dev = sum(kernels[variant].values()) / 1e3 if variant in kernels else float("nan")
        busy = f"{dev / (t * 1e3):5.0%}" if variant in kernels else "  n/a"
        line = f"{kind:10s} {mode:8s} {t * 1e3:8.2f} {h * 1e3:8.2f} {dev:9.2f} {busy} {tokens / t:10.0f} {mfu}"
        print(f"{line} {t / base:14.2f}x")
    if ops:
        print("\naten ops per eager step (compute ops launch kernels; metadata-only views not counted)")
        for variant, counts in ops.items():
            print(f"{variant.split(':')[0]:10s} {counts}")
    if args.breakdown and {"dense:eager", "meshpar:eager"} <= kernels.keys():
        print_kernel_diff(kernels["dense:eager"], kernels["meshpar:eager"])


def print_kernel_diff(dense: dict[str, float], meshpar_: dict[str, float], top: int = 15) -> None:
    """The kernels whose device time per step differs most between the dense and the meshpar eager step."""
    names = sorted(dense.keys() | meshpar_.keys(), key=lambda k: -abs(meshpar_.get(k, 0.0) - dense.get(k, 0.0)))
    print(f"\nkernels, device us per step: {'dense':>9s} {'meshpar':>9s} {'diff':>8s}  name")
    for name in names[:top]:
        a, b = dense.get(name, 0.0), meshpar_.get(name, 0.0)
        print(f"{'':28s}{a:9.1f} {b:9.1f} {b - a:8.1f}  {name[:100]}")


if __name__ == "__main__":
    main()
