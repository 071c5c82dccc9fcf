"""Optimizer-state bytes per rank with and without ZeRO-1, and checkpoint save/load vs ``torch.save``.

    .venv/bin/python benchmarks/bench_state.py            # 4 local gloo processes; --params-m 100 for ~100M params

1. AdamW state bytes per rank for dp in {1, 2, 4} (tp=1) with and without ZeRO-1, against the ideal ``1/dp``.
2. A ~``--params-m`` million parameter MLP stack at tp=2 (2 processes): meshpar.checkpoint.save / load time and
   bytes on disk vs one process ``torch.save`` / ``torch.load`` of the full state dict, measured in one invocation.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from meshpar import checkpoint
from meshpar.optim import DistributedOptimizer
from meshpar.tensor_parallel import ColumnParallel, RowParallel
from meshpar.testing import run_distributed, setup_parallel


def _model(hidden: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(hidden, hidden) for _ in range(2 * layers)))


def state_case(dp: int, zero1: bool) -> int:
    setup_parallel(tp=4 // dp)
    torch.manual_seed(0)
    model = _model(256, 4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = DistributedOptimizer(model, torch.optim.AdamW, zero1=zero1, lr=1e-3)
    opt.step()
    return opt.state_bytes()


def ckpt_case(hidden: int, layers: int, root: str) -> tuple[float, float]:
    dims = setup_parallel(tp=2)
    plan = {str(i): ColumnParallel() if i % 2 == 0 else RowParallel() for i in range(2 * layers)}
    model = parallelize_module(_model(hidden, layers), dims.tp_mesh, plan)
    start = time.perf_counter()
    checkpoint.save(root, model, step=1)
    saved = time.perf_counter() - start
    start = time.perf_counter()
    checkpoint.load(root, model)
    return saved, time.perf_counter() - start


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params-m", type=float, default=100.0)
    args = parser.parse_args()
    print("AdamW state bytes per rank, 0.53M fp32 params replicated on 4 ranks, ZeRO-1 over a dp group of size dp")
    print(f"{'dp':>3s} {'plain MiB':>10s} {'ZeRO-1 max MiB':>15s} {'ratio':>6s} {'ideal':>6s}")
    for dp in (1, 2, 4):
        plain = max(run_distributed(state_case, 4, dp, False))
        zero = max(run_distributed(state_case, 4, dp, True))
        print(f"{dp:3d} {plain / 2**20:10.2f} {zero / 2**20:15.2f} {zero / plain:6.2f} {1 / dp:6.2f}")

    hidden = 1024
    layers = max(1, round(args.params_m * 1e6 / (2 * (hidden * hidden + hidden))))
    params = 2 * layers * (hidden * hidden + hidden)
    print(f"\ncheckpoint of {params / 1e6:.0f}M parameters (fp32) at tp=2 on 2 processes vs torch.save on one")
    root = Path(tempfile.mkdtemp())
    try:
        save_s, load_s = run_distributed(ckpt_case, 2, hidden, layers, str(root / "dcp"))[0]
        dense = _model(hidden, layers)
        start = time.perf_counter()
        torch.save(dense.state_dict(), root / "full.pt")
        torch_save = time.perf_counter() - start
        start = time.perf_counter()
        torch.load(root / "full.pt")
        torch_load = time.perf_counter() - start
        dcp_bytes, torch_bytes = _dir_bytes(root / "dcp"), (root / "full.pt").stat().st_size
        print(f"{'':22s} {'save s':>8s} {'load s':>8s} {'MiB':>8s}")
        print(f"{'meshpar.checkpoint':22s} {save_s:8.2f} {load_s:8.2f} {dcp_bytes / 2**20:8.0f}")
        print(f"{'torch.save (1 proc)':22s} {torch_save:8.2f} {torch_load:8.2f} {torch_bytes / 2**20:8.0f}")
        print(f"ratios meshpar/torch: save {save_s / torch_save:.2f}x, load {load_s / torch_load:.2f}x")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
