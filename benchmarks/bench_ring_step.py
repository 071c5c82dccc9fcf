"""One step of ring attention, forward and backward, on one device: torch's fused attention kernels
(``meshpar._block_attention``: CPU flash attention, CUDA memory-efficient attention) against the plain matmul path
(scores and probabilities in fp32, recomputed in backward), in one invocation.

    .venv/bin/python benchmarks/bench_ring_step.py                       # CPU, a small shape
    python benchmarks/bench_ring_step.py --heads 32 --kv-heads 8 --seq 4096 --head-dim 128 --dtype bfloat16  # CUDA

A step is what each rank computes per ring exchange: its ``seq`` local queries (load-balanced chunks of a causal
sequence at cp=2, rank 0) against one other rank's ``seq`` keys, with the block's causal mask, then the backward of
that block given the merged output and log-sum-exp. "fused, pieces" is the step as the ring runs it: only the
half of the block that holds permitted pairs, with no mask (``context_parallel._step_pieces``). Peak memory is what
one step allocates beyond its inputs (CUDA only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from meshpar._block_attention import block_backward, block_forward
from meshpar.context_parallel import (
    AttentionMask,
    _attend,
    _attend_backward,
    _repeat_kv,
    _RingAttention,
    _step_backward,
    _step_forward,
    local_positions,
)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024, help="local queries, and the keys of one block")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    device, dtype = args.device, getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, {args.dtype}")
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, d_out = (torch.randn(shape, generator=generator).to(device, dtype) for _ in range(2))
    kv_shape = (args.batch, args.kv_heads, args.seq, args.head_dim)
    kv_heads = [torch.randn(kv_shape, generator=generator).to(device, dtype) for _ in range(2)]
    k, v = (_repeat_kv(t, args.heads) for t in kv_heads)
    q_pos = local_positions(2 * args.seq, 2, 0, device)
    allow = AttentionMask().allowed(q_pos, local_positions(2 * args.seq, 2, 1, device))
    scale = args.head_dim**-0.5
    ctx = SimpleNamespace(scale=scale, softcap=None)

    def fused() -> None:
        out, lse = block_forward(q, k, v, allow, scale)
        block_backward(d_out, q, k, v, out, lse.nan_to_num(neginf=0.0), allow, scale)

    def plain() -> None:
        out, lse = _attend(q, k, v, allow, scale)
        finite = lse.nan_to_num(neginf=0.0)
        delta = (d_out.float() * out).sum(-1, keepdim=True)
        _attend_backward(q.float(), k.float(), v.float(), d_out.float(), delta, finite, allow, ctx)

    ring = SimpleNamespace()
    _RingAttention.keep(ring, q, 2, 0, AttentionMask(), scale, None, [args.head_dim] * 2)
    kv = torch.cat(kv_heads, dim=-1)

    def pieces() -> None:
        out = torch.zeros(shape, dtype=torch.float32, device=device)
        lse = torch.full((*shape[:-1], 1), float("-inf"), device=device)
        _step_forward(q, kv, out, lse, 1, ring)
        grads = {"d_out": d_out, "out": out, "lse": lse.nan_to_num(neginf=0.0)}
        _step_backward(q, kv, grads, torch.zeros(shape, device=device), 1, ring)

    variants = {"plain (fp32 matmuls)": plain, "fused kernel": fused, "fused, pieces": pieces}
    times: dict[str, list[float]] = {key: [] for key in variants}
    peaks: dict[str, float] = {}
    for key, step in variants.items():  # warm-up, and each variant's peak on its own
        step()
        _sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            _sync(device)
            peaks[key] = (torch.cuda.max_memory_allocated() - base) / 2**20
    for _ in range(args.rounds):
        for key, step in variants.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times[key].append(time.perf_counter() - start)
    base = statistics.median(times["plain (fp32 matmuls)"])
    print(f"one ring step, batch {args.batch} x {args.heads} heads ({args.kv_heads} kv) x {args.seq} queries x "
          f"{args.seq} keys x {args.head_dim}, fwd+bwd, median of {args.rounds}")  # fmt: skip
    print(f"{'variant':24s} {'ms':>9s} {'vs plain':>9s} {'peak MiB':>9s}")
    for key, samples in times.items():
        ms = statistics.median(samples)
        peak = f"{peaks[key]:9.1f}" if key in peaks else f"{'n/a':>9s}"
        print(f"{key:24s} {ms * 1e3:9.3f} {ms / base:8.2f}x {peak}")


if __name__ == "__main__":
    main()
