"""Host cost of one fused-op call: where the microseconds go between a raw Triton launch and a training step's op.

    python benchmarks/bench_launch.py        # CUDA; on CPU the ops run their torch references (no raw-launch row)

On a tiny input (device work of a few microseconds) the time per call of many back-to-back calls is the host's
cost: Triton's launcher, the custom-op dispatcher, the registered autograd, torch.compile's guards and wrappers.
Rows alternate round by round and report the median, so they compare within this one invocation. This is what a
step pays per op when the GPU is not the bottleneck (small models, small batches, tensor parallel shards).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from meshpar import ops
from meshpar.ops.rms_norm import _rms_norm_fwd_kernel, rms_norm_fwd_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    return (time.perf_counter() - start) / calls * 1e6


def variants(rows: int, hidden: int, compile_reference: bool = True) -> dict[str, Callable[[], object]]:
    x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y, rstd = torch.empty_like(x), torch.empty(rows, device=DEVICE)
    dy = torch.randn_like(x)

    def reference(t: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
        return rms_norm_fwd_reference(t, ww, 1e-6)[0]

    compiled = torch.compile(reference) if compile_reference else None

    def fwd_bwd(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        return lambda: torch.autograd.grad(fn(x, w), [x, w], dy)

    def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return fn()

        return run

    runs: dict[str, Callable[[], object]] = {}
    if DEVICE == "cuda":
        block = 1 << (hidden - 1).bit_length()
        runs["raw Triton launch, forward kernel"] = lambda: _rms_norm_fwd_kernel[(rows,)](
            x, w, y, rstd, x.stride(0), y.stride(0), hidden, 1e-6, BLOCK=block, num_warps=4
        )
    runs |= {
        "meshpar::rms_norm_fwd op, forward": no_grad(lambda: torch.ops.meshpar.rms_norm_fwd(x, w, 1e-6)),
        "meshpar.ops.rms_norm (eager fast path), forward": no_grad(lambda: ops.rms_norm(x, w)),
        "meshpar::rms_norm_fwd op, fwd+bwd": fwd_bwd(lambda t, ww: torch.ops.meshpar.rms_norm_fwd(t, ww, 1e-6)[0]),
        "meshpar.ops.rms_norm (eager fast path), fwd+bwd": fwd_bwd(ops.rms_norm),
        "torch reference, forward": no_grad(lambda: reference(x, w)),
        "torch reference, fwd+bwd": fwd_bwd(reference),
    }
    if compiled is not None:
        runs["torch.compile(reference), fwd+bwd"] = fwd_bwd(compiled)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    args = parser.parse_args()
    runs = variants(args.rows, args.hidden, compile_reference=not args.no_compile)
    for fn in runs.values():  # compile, autotune and warm the caches
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(per_call_us(fn, args.calls))
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"{device}, torch {torch.__version__} | rms_norm on [{args.rows}, {args.hidden}] bf16, host us per call")
    for name, values in times.items():
        print(f"{name:40s} {statistics.median(values):9.1f}")


if __name__ == "__main__":
    main()
