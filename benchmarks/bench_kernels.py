"""Time and effective bandwidth of meshpar's Triton kernels vs the torch eager reference vs torch.compile of it.

    python benchmarks/bench_kernels.py                 # CUDA: all three columns; CPU: reference vs compiled only
    python benchmarks/bench_kernels.py --breakdown     # CUDA: also each variant's kernels, device us per call

Each case is forward + backward. Ratios are measured in this one invocation, alternating the variants per round
(A B C A B C ...) and taking the median, so machine noise hits all of them alike. Two times per variant on CUDA:
"call ms", one call timed on the host with a synchronize before and after (what a step pays when the op's host
work is not hidden behind queued device work), and "device ms", the sum of the call's kernel times from the
profiler (what it costs when the host runs ahead). Bandwidth counts the bytes each op must read and write at least
once (inputs, outputs, grads), divided by the device time.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _profile import kernel_times

from meshpar import ops
from meshpar.ops import softmax as softmax_ops
from meshpar.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _time(fn: Callable[[], object]) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _device_ms(fn: Callable[[], object], calls: int = 5) -> tuple[float, list[tuple[str, int, float]]]:
    """Kernel time per call, and (kernel, launches per call, us per call), longest first."""
    kernels = sorted(((name, n, us) for name, (n, us) in kernel_times(fn, calls).items()), key=lambda k: -k[2])
    return sum(k[2] for k in kernels) / 1e3, kernels


def _fwd_bwd(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        out = fn(*inputs)
        torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad)

    return run


def cases(scale: int) -> dict[str, tuple]:
    bf16 = torch.bfloat16
    rows, hidden = 4096 // scale, 4096 // scale
    x = torch.randn(rows, hidden, device=DEVICE, dtype=bf16, requires_grad=True)
    w = torch.randn(hidden, device=DEVICE, dtype=bf16, requires_grad=True)
    b = torch.randn(hidden, device=DEVICE, dtype=bf16, requires_grad=True)
    norm_bytes = 4 * x.numel() * 2  # read x, dy; write y, dx
    s = 2048 // scale
    scores = torch.randn(8 // min(scale, 8), 32 // scale, s, s, device=DEVICE, dtype=bf16, requires_grad=True)
    softmax_bytes = 4 * scores.numel() * 2  # read x, dy, y; write y, dx (y re-read counted once)
    ffn = torch.randn(8192 // scale, 4096 // scale, device=DEVICE, dtype=bf16, requires_grad=True)
    up = torch.randn_like(ffn, requires_grad=True)
    fb = torch.randn(ffn.shape[-1], device=DEVICE, dtype=bf16, requires_grad=True)
    q = torch.randn(4, 2048 // scale, 32, 128, device=DEVICE, dtype=bf16, requires_grad=True)
    angles = torch.randn(q.shape[1], 64, device=DEVICE)
    cos, sin = angles.cos(), angles.sin()
    tokens, vocab = 4096 // scale, 131072 // scale
    logits = torch.randn(tokens, vocab, device=DEVICE, dtype=bf16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device=DEVICE)

    # Mixtral-sized experts at 1/scale: 8 experts, top-2 pairs of 4096 tokens sorted by expert, uneven groups
    experts, pairs = 8, 8192 // scale
    cuts = torch.randint(0, pairs, (experts - 1,), generator=torch.Generator().manual_seed(0)).sort().values
    offs = torch.cat([cuts, torch.tensor([pairs])]).to(DEVICE, torch.int32)  # each expert's cumulative row end
    routed = torch.randn(pairs, 4096 // scale, device=DEVICE, dtype=bf16, requires_grad=True)
    expert_w = torch.randn(experts, 4096 // scale, 14336 // scale, device=DEVICE, dtype=bf16, requires_grad=True)
    bounds = [0, *offs.tolist()]

    def experts_loop(t: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:  # the eager experts forward's matmuls
        return torch.cat([t[a:b] @ ww[e] for e, (a, b) in enumerate(itertools.pairwise(bounds))])

    def ce_fused(lg: torch.Tensor) -> torch.Tensor:
        from meshpar.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy

        return _VocabParallelCrossEntropy.apply(lg, labels, None, 0, vocab, 0.0, -100)

    def causal_ref(t: torch.Tensor) -> torch.Tensor:
        return softmax_ops.scaled_upper_triang_masked_softmax_reference(t, 0.125)

    def rotary_ref(t: torch.Tensor) -> torch.Tensor:
        c, sn = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
        t1, t2 = t.float().chunk(2, -1)
        return (t.float() * c + torch.cat([-t2, t1], -1) * sn).to(t.dtype)

    return {
        f"rms_norm {rows}x{hidden}": (
            lambda t, ww: ops.rms_norm(t, ww),
            lambda t, ww: (t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6) * ww).to(t.dtype),
            [x, w],
            norm_bytes,
        ),
        f"layer_norm {rows}x{hidden}": (
            lambda t, ww, bb: ops.layer_norm(t, ww, bb),
            lambda t, ww, bb: F.layer_norm(t.float(), t.shape[-1:], ww.float(), bb.float()).to(t.dtype),
            [x, w, b],
            norm_bytes,
        ),
        f"causal softmax {tuple(scores.shape)}": (
            lambda t: ops.scaled_upper_triang_masked_softmax(t, 0.125),
            causal_ref,
            [scores],
            softmax_bytes,
        ),
        f"bias_gelu {tuple(ffn.shape)}": (
            ops.bias_gelu,
            lambda t, bb: F.gelu(t.float() + bb.float(), approximate="tanh").to(t.dtype),
            [ffn, fb],
            4 * ffn.numel() * 2,
        ),
        f"swiglu {tuple(ffn.shape)}": (
            ops.swiglu,
            lambda g, u: (F.silu(g.float()) * u.float()).to(g.dtype),
            [ffn, up],
            7 * ffn.numel() * 2,
        ),
        f"rotary {tuple(q.shape)}": (
            lambda t: ops.rotary_embedding(t, cos, sin, seq_dim=1),
            rotary_ref,
            [q],
            4 * q.numel() * 2,
        ),
        f"grouped_mm {pairs}x{routed.shape[1]} @ {tuple(expert_w.shape)}": (
            lambda t, ww: ops.grouped_mm(t, ww, offs),
            experts_loop,
            [routed, expert_w],
            (3 * routed.numel() + 2 * expert_w.numel() + 2 * pairs * expert_w.shape[2]) * 2,
        ),
        f"vocab CE {tokens}x{vocab}": (
            ce_fused,
            lambda lg: F.cross_entropy(lg.float(), labels, reduction="none"),
            [logits],
            3 * logits.numel() * 2,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--scale", type=int, default=1 if DEVICE == "cuda" else 8, help="divide the shapes by this")
    parser.add_argument("--breakdown", action="store_true", help="CUDA: list each variant's kernels")
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}, torch {torch.__version__}")
    header = f"{'op (fwd+bwd, bf16)':38s} {'eager ms':>9s} {'compile ms':>10s}"
    if DEVICE == "cuda":
        header += f" {'triton ms':>9s} | device ms: {'eager':>7s} {'compile':>7s} {'triton':>7s} {'GB/s':>6s}"
        header += f" | triton vs compile: {'call':>5s} {'device':>6s}"
    print(header)
    breakdowns: list[str] = []
    for name, case in cases(args.scale).items():
        if args.only and args.only not in name:
            continue
        fused, reference, inputs, nbytes = case
        grad = torch.randn_like(reference(*inputs))
        variants = {
            "eager": _fwd_bwd(reference, inputs, grad),
            "compile": _fwd_bwd(torch.compile(reference), inputs, grad),
        }
        if DEVICE == "cuda":
            variants["triton"] = _fwd_bwd(fused, inputs, grad)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for fn in variants.values():  # warm-up and compile
            fn()
            fn()
        for _ in range(args.rounds):
            for key, fn in variants.items():
                times[key].append(_time(fn))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        line = f"{name:38s} {med['eager']:9.3f} {med['compile']:10.3f}"
        if DEVICE == "cuda":
            device = {key: _device_ms(fn) for key, fn in variants.items()}
            dev = {key: ms for key, (ms, _) in device.items()}
            gbps = nbytes / (dev["triton"] / 1e3) / 1e9
            line += f" {med['triton']:9.3f} | {'':11s}{dev['eager']:7.3f} {dev['compile']:7.3f} {dev['triton']:7.3f}"
            call_ratio, device_ratio = med["compile"] / med["triton"], dev["compile"] / dev["triton"]
            line += f" {gbps:6.0f} | {'':19s}{call_ratio:4.2f}x {device_ratio:5.2f}x"
            for key, (ms, kernels) in device.items():
                breakdowns.append(f"{name} / {key}: {ms * 1e3:.1f} us")
                breakdowns += [f"    {us:8.1f} us  x{count:<3d} {kernel[:110]}" for kernel, count, us in kernels]
        print(line, flush=True)
    if args.breakdown:
        print("\nkernels per call (device us, launches, name):")
        print("\n".join(breakdowns))
    if DEVICE == "cuda":
        print_ce_memory()


def print_ce_memory() -> None:
    """Peak extra memory of the fused vocab CE (fwd+bwd) vs F.cross_entropy on the same bf16 logits."""
    title = "vocab CE peak memory (fwd+bwd), 4096 tokens, bf16"
    print(f"\n{title:52s} {'meshpar MiB':>11s} {'F.cross_entropy MiB':>20s} {'ratio':>6s}")
    for vocab in (50304, 131072):
        logits = torch.randn(4096, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, vocab, (4096,), device="cuda")
        peaks = []
        for fn in (
            lambda lg=logits, lb=labels, v=vocab: _VocabParallelCrossEntropy.apply(lg, lb, None, 0, v, 0.0, -100),
            lambda lg=logits, lb=labels: F.cross_entropy(lg.float(), lb, reduction="none"),
        ):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = fn()
            loss.sum().backward()
            logits.grad = None
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
        print(f"{'vocab ' + str(vocab):52s} {peaks[0]:11.0f} {peaks[1]:20.0f} {peaks[1] / peaks[0]:5.2f}x")


if __name__ == "__main__":
    main()
