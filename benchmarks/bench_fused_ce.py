"""Peak memory (and time) of the LM-head loss at a 128k vocabulary: fused chunked vs unfused vs F.cross_entropy.

    .venv/bin/python benchmarks/bench_fused_ce.py                 # CUDA: allocator peaks; CPU: peak RSS per run

Variants, each forward + backward of ``loss(hidden @ W.T, labels)`` with ``hidden [tokens, H]`` and ``W [V, H]``:
``F.cross_entropy`` on materialised fp32 logits, meshpar's ``parallel_cross_entropy`` on materialised logits
(one process, tp=1), and ``fused_linear_cross_entropy`` (logits never materialised beyond one chunk). On CPU each
variant runs in its own fresh process and the peak resident set above the inputs is reported.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

VARIANTS = ("F.cross_entropy", "parallel_cross_entropy", "fused_linear_cross_entropy")


def run_variant(name: str, tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: str) -> dict:
    import meshpar

    dims = meshpar.get_parallel() if meshpar.is_initialized() else None
    dims = dims or meshpar.init_parallel(device_type="cpu" if device == "cpu" else "cuda")
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, device=device, dtype=dtype, requires_grad=True) * 0.02
    w = w.detach().requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)

    def loss_fn() -> torch.Tensor:
        if name == "F.cross_entropy":
            return F.cross_entropy((h @ w.t()).float(), labels)
        if name == "parallel_cross_entropy":
            return meshpar.parallel_cross_entropy(h @ w.t(), labels, tp_mesh=dims.tp_mesh).mean()
        return meshpar.fused_linear_cross_entropy(h, w, labels, tp_mesh=dims.tp_mesh)

    if device == "cuda":  # warm-up: Triton compiles its kernels on first use
        loss_fn().backward()
        h.grad = w.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    loss = loss_fn()
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"peak": peak, "seconds": time.perf_counter() - start, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = args.tokens or (8192 if device == "cuda" else 2048)
    hidden = args.hidden or (4096 if device == "cuda" else 256)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.child:
        print(json.dumps(run_variant(args.child, tokens, hidden, args.vocab, dtype, device)))
        return
    print(f"device {device}, {tokens} tokens, hidden {hidden}, vocab {args.vocab}, {dtype}")
    results = {}
    for name in VARIANTS:
        if device == "cuda":
            results[name] = run_variant(name, tokens, hidden, args.vocab, dtype, device)
        else:  # a fresh process per variant: peak RSS is per process
            cmd = [sys.executable, __file__, "--child", name, "--tokens", str(tokens), "--hidden", str(hidden),
                   "--vocab", str(args.vocab)]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[name] = json.loads(out.strip().splitlines()[-1])
    base = results["F.cross_entropy"]["peak"]
    print(f"{'variant':28s} {'peak MiB':>10s} {'vs F.ce':>8s} {'seconds':>8s} {'loss':>10s}")
    for name, r in results.items():
        print(f"{name:28s} {r['peak'] / 2**20:10.0f} {r['peak'] / base:7.2f}x {r['seconds']:8.3f} {r['loss']:10.4f}")


if __name__ == "__main__":
    main()
