"""Optimizer-state bytes per rank with and without ZeRO-1, and checkpoint save/load vs ``torch.save``.

    .venv/bin/python benchmarks/bench_state.py            # 4 local gloo processes; --params-m 100 for ~100M params

1. AdamW state bytes per rank for dp in {1, 2, 4} (tp=1) with and without ZeRO-1, against the ideal ``1/dp``.
2. A GPT-2 (HF, built from a config) under ``meshpar.parallelize`` at tp x pp in {1x1, 2x1, 1x2, 2x2, 4x1, 1x4}:
   parameter and AdamW-state bytes on the fullest rank against the ideal ``1/(tp*pp)`` of the dense model, the
   bound with TP-replicated tensors (norms, row biases, position embedding) counted whole, and peak RSS per rank;
   pp=4 also with ``auto_partition`` (stages balanced by parameters, embedding and head included).
3. A ~``--params-m`` million parameter MLP stack at tp=2 (2 processes): meshpar.checkpoint.save / load time and
   bytes on disk vs one process ``torch.save`` / ``torch.load`` of the full state dict, measured in one invocation.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

import meshpar
from meshpar import checkpoint
from meshpar._compat import DTensor, Shard
from meshpar.optim import DistributedOptimizer
from meshpar.tensor_parallel import ColumnParallel, RowParallel
from meshpar.testing import DistributedPool, run_distributed, setup_parallel


def _model(hidden: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(hidden, hidden) for _ in range(2 * layers)))


def state_case(dp: int, zero1: bool) -> int:
    dims = setup_parallel(tp=4 // dp)
    torch.manual_seed(0)
    model = _model(256, 4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = DistributedOptimizer(model, torch.optim.AdamW, zero1=zero1, dims=dims, lr=1e-3)
    opt.step()
    return opt.state_bytes()


def _tp_sharded(param: torch.Tensor) -> bool:
    """Whether the tp mesh dim splits ``param`` (FSDP2 adds a dp dim in front of it, or is the only dim at tp=1)."""
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return "tp" in names and isinstance(param.placements[names.index("tp")], Shard)


def layout_case(
    tp: int, pp: int, layers: int, hidden: int, auto_partition: bool = False, fsdp: bool = False, meta: bool = False
) -> dict:
    """This rank's parameter and AdamW-state bytes, split into TP-sharded and TP-replicated dense sizes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    dims = setup_parallel(tp=tp, pp=pp)
    config = GPT2Config(vocab_size=50304, n_positions=256, n_embd=hidden, n_layer=layers, n_head=hidden // 64)
    torch.manual_seed(0)
    layout = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "num_microbatches": pp}
    layout["auto_partition"] = auto_partition
    layout["fsdp"] = fsdp
    with torch.device("meta") if meta else contextlib.nullcontext():
        dense = GPT2LMHeadModel(config)
    model = meshpar.parallelize(dense, layout)
    opt = DistributedOptimizer(model, torch.optim.AdamW, dims=dims, lr=1e-4)
    local_bytes = sharded = replicated = 0
    for module in model.local_modules():
        for param in module.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            local_bytes += local.numel() * local.element_size()
            if _tp_sharded(param):
                sharded += param.numel() * param.element_size()  # the dense (global) size
            else:
                replicated += param.numel() * param.element_size()
    opt.init_state()
    return {
        "stage": dims.pp_rank,
        "tp_rank": dims.tp_rank,
        "param_bytes": local_bytes,
        "state_bytes": opt.state_bytes(),
        "sharded_dense": sharded,
        "replicated": replicated,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def layout_table(layers: int, hidden: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=50304, n_positions=256, n_embd=hidden, n_layer=layers, n_head=hidden // 64)
    dense = sum(p.numel() * p.element_size() for p in GPT2LMHeadModel(config).parameters())  # tied head counted once
    print(f"\nGPT-2 {layers} layers x hidden {hidden}, vocab 50304 ({dense / 2**20:.0f} MiB fp32 dense) under "
          "meshpar.parallelize on 4 processes (dp = 4 / (tp*pp)); fullest rank shown")  # fmt: skip
    print(f"{'tp x pp':>21s} {'params MiB':>11s} {'of dense':>9s} {'ideal':>6s} {'w/ repl.':>9s} {'AdamW MiB':>10s} "
          f"{'state/params':>13s} {'RSS MiB':>8s}")  # fmt: skip
    layouts = [(1, 1, False, False, False), (2, 1, False, False, False), (4, 1, False, False, False),
               (1, 2, False, False, False), (2, 2, False, False, False), (1, 4, False, False, False),
               (1, 4, True, False, False), (1, 1, False, True, False), (2, 1, False, True, False),
               (1, 2, False, True, False), (4, 1, False, False, True), (1, 4, True, False, True),
               (1, 1, False, True, True)]  # fmt: skip
    for tp, pp, auto, fsdp, meta in layouts:
        pool = DistributedPool(4)  # fresh processes per layout, so peak RSS is this layout's own
        try:
            ranks = pool.run(layout_case, tp, pp, layers, hidden, auto, fsdp, meta, timeout=900)
        finally:
            pool.close()
        fullest = max(ranks, key=lambda r: r["param_bytes"])
        # every rank's share if TP split everything it can, replicated tensors stayed whole, stages were balanced
        # (and FSDP split every tensor over dp)
        shards = tp * pp * (4 // (tp * pp) if fsdp else 1)
        stages = {r["stage"]: r for r in ranks if r["tp_rank"] == 0}
        bound = sum(r["sharded_dense"] / tp + r["replicated"] for r in stages.values()) / (shards // tp)
        ratio = fullest["state_bytes"] / fullest["param_bytes"]
        name = f"{tp} x {pp}" + (" auto" if auto else "") + (" fsdp" if fsdp else "") + (" meta" if meta else "")
        print(f"{name:>21s} {fullest['param_bytes'] / 2**20:11.2f} {fullest['param_bytes'] / dense:9.3f} "
              f"{1 / shards:6.3f} {bound / dense:9.3f} {fullest['state_bytes'] / 2**20:10.2f} "
              f"{ratio:13.2f} {max(r['rss_mib'] for r in ranks):8.0f}")  # fmt: skip


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
    parser.add_argument("--gpt-layers", type=int, default=8)
    parser.add_argument("--gpt-hidden", type=int, default=512)
    args = parser.parse_args()
    print("AdamW state bytes per rank, 0.53M fp32 params replicated on 4 ranks, ZeRO-1 over a dp group of size dp")
    print(f"{'dp':>3s} {'plain MiB':>10s} {'ZeRO-1 max MiB':>15s} {'ratio':>6s} {'ideal':>6s}")
    for dp in (1, 2, 4):
        plain = max(run_distributed(state_case, 4, dp, False))
        zero = max(run_distributed(state_case, 4, dp, True))
        print(f"{dp:3d} {plain / 2**20:10.2f} {zero / 2**20:15.2f} {zero / plain:6.2f} {1 / dp:6.2f}")

    layout_table(args.gpt_layers, args.gpt_hidden)

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
