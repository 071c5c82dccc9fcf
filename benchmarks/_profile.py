"""Device time per kernel from the torch profiler, shared by the CUDA benchmarks: what a call costs once the host
runs ahead of the GPU, independent of host overhead and synchronisation."""

from __future__ import annotations

from collections.abc import Callable

import torch


def kernel_times(fn: Callable[[], object], calls: int) -> dict[str, tuple[int, float]]:
    """``{kernel name: (launches per call, device us per call)}`` over ``calls`` calls of ``fn`` (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {
        e.key: (e.count // calls, e.self_device_time_total / calls)
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    }
