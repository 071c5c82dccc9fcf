"""Tensor-parallel step time, collectives and memory: meshpar vs torch's DTensor styles vs a Megatron-style
plain-tensor TP vs the dense model, eager and ``torch.compile``d, in one invocation.

    .venv/bin/python benchmarks/bench_tp.py                    # TP=2 on 2 local gloo processes (CPU)
    .venv/bin/python benchmarks/bench_tp.py --hidden 512 --seq 512

Every variant is the same GPT-2-style model (fused QKV in Megatron's [heads, 3, head_dim] layout, pre-norm blocks,
replicated embedding and head), same weights, same batch. A step is forward + backward + SGD. Rounds alternate the
variants (A B C D A B C D ...) and medians are compared.
"""

from __future__ import annotations

import argparse
import resource
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _rounds import alternate, model_arguments
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from meshpar._compat import CommDebugMode
from meshpar.optim import DistributedOptimizer
from meshpar.tensor_parallel import ColumnParallel, RowParallel
from meshpar.testing import run_distributed, setup_parallel
from meshpar.testing.dispatch import comm_counts


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x))
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


# -- a plain-tensor Megatron-style TP, written here as the peer baseline (picotron / Megatron-Core style) --------
class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class MegatronColumn(nn.Module):
    def __init__(self, linear: nn.Linear, rank: int, tp: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().chunk(tp, 0)[rank].clone())
        self.bias = nn.Parameter(linear.bias.detach().chunk(tp, 0)[rank].clone())
        self.group = group

    def forward(self, x):
        return F.linear(_Copy.apply(x, self.group), self.weight, self.bias)


class MegatronRow(nn.Module):
    def __init__(self, linear: nn.Linear, rank: int, tp: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().chunk(tp, 1)[rank].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())
        self.group = group

    def forward(self, x):
        return _Reduce.apply(F.linear(x, self.weight), self.group) + self.bias


def megatron_tp(model: GPT, rank: int, tp: int, group) -> GPT:
    for block in model.layers:
        block.qkv, block.fc1 = (MegatronColumn(m, rank, tp, group) for m in (block.qkv, block.fc1))
        block.proj, block.fc2 = (MegatronRow(m, rank, tp, group) for m in (block.proj, block.fc2))
    return model


MESHPAR_PLAN = {
    "layers.*.qkv": ColumnParallel(),
    "layers.*.proj": RowParallel(),
    "layers.*.fc1": ColumnParallel(),
    "layers.*.fc2": RowParallel(),
}
TORCH_PLAN = {
    "layers.*.qkv": ColwiseParallel(),
    "layers.*.proj": RowwiseParallel(),
    "layers.*.fc1": ColwiseParallel(),
    "layers.*.fc2": RowwiseParallel(),
}


def _build(variant: str, args: argparse.Namespace, dims, torch_mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(256, args.hidden, args.heads, args.layers, args.seq)
    if variant == "meshpar":
        model = parallelize_module(model, dims.tp_mesh, MESHPAR_PLAN)
    elif variant == "torch DTensor":
        model = parallelize_module(model, torch_mesh, TORCH_PLAN)
    elif variant == "Megatron-style":
        model = megatron_tp(model, dims.tp_rank, dims.tp, dims.tp_mesh.get_group())
    return model


class CommBytes(TorchDispatchMode):
    """Bytes handed to collectives (c10d and functional), per direction of the pass it wraps."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # eager c10d ops and the functional ops; the legacy "c10d_functional" wrappers forward to the latter
        if func.namespace in ("c10d", "_c10d_functional") and not any(k in func.name() for k in ("wait", "_wrap")):
            tensor = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            self.bytes += tensor.numel() * tensor.element_size()
        return func(*args, **(kwargs or {}))


def _ideal_fraction(model: GPT, tp: int) -> float:
    """Parameters per rank if every block linear weight/bias that TP can split were split, the rest replicated."""
    sharded = replicated = 0
    for name, p in model.named_parameters():
        splittable = any(k in name for k in ("qkv", "fc1")) or (
            any(k in name for k in ("proj", "fc2")) and "weight" in name
        )
        if splittable and "layers." in name:
            sharded += p.numel()
        else:
            replicated += p.numel()
    return (sharded / tp + replicated) / (sharded + replicated)


def _local_numel(model: nn.Module) -> int:
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())


def bench_case(args: argparse.Namespace) -> dict:
    dims = setup_parallel(tp=2)
    # torch's styles get a plain 1-D tp mesh: on meshpar's sliced (dp, pp, tp) mesh, compiling them after another
    # model was run eagerly and compiled in the same process fails in torch 2.13 (InductorError
    # "device_mesh._get_submesh is not an OpOverload"). Same ranks and group size, so eager timings are unaffected.
    torch_mesh = init_device_mesh("cpu", (dims.tp,), mesh_dim_names=("tp",))
    torch.set_num_threads(1)
    variants = ["dense", "meshpar", "torch DTensor", "Megatron-style"]
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    runs = {}
    failures: dict[str, str] = {}
    for compiled in (False, True) if args.compile else (False,):
        for variant in variants:
            model = _build(variant, args, dims, torch_mesh)
            step_model = torch.compile(model) if compiled else model
            if variant == "meshpar":  # meshpar's optimizer steps on local shards (no DTensor dispatch)
                opt = DistributedOptimizer(model, torch.optim.SGD, dims=dims, lr=1e-3)
            else:
                opt = torch.optim.SGD(model.parameters(), lr=1e-3)

            def step(m=step_model, o=opt) -> None:
                o.zero_grad(set_to_none=True)
                F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
                o.step()

            try:
                step()  # warm-up (and compile)
                step()
            except Exception as error:
                failures[f"{variant}|{compiled}"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
                torch._dynamo.reset()
                continue
            runs[(variant, compiled)] = (step, model)
    times = alternate({key: step for key, (step, _) in runs.items()}, args.rounds)
    comms, comm_bytes = {}, {}
    for variant in ("meshpar", "torch DTensor", "Megatron-style"):
        model = _build(variant, args, dims, torch_mesh)
        with CommDebugMode() as fwd:
            out = model(ids)
        with CommDebugMode() as bwd:
            F.cross_entropy(out.flatten(0, 1), ids.flatten()).backward()
        comms[variant] = (comm_counts(fwd), comm_counts(bwd))
        model = _build(variant, args, dims, torch_mesh)
        with CommBytes() as fwd_bytes:
            out = model(ids)
        with CommBytes() as bwd_bytes:
            F.cross_entropy(out.flatten(0, 1), ids.flatten()).backward()
        comm_bytes[variant] = (fwd_bytes.bytes, bwd_bytes.bytes)
    numel = {v: _local_numel(runs[(v, False)][1]) for v in variants}
    return {
        "times": {f"{v}|{c}": statistics.median(t) for (v, c), t in times.items()},
        "rounds": {f"{v}|{c}": t for (v, c), t in times.items()},
        "failures": failures,
        "comms": comms,
        "comm_bytes": comm_bytes,
        "numel": numel,
        "ideal": _ideal_fraction(GPT(256, args.hidden, args.heads, args.layers, args.seq), dims.tp),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


_PAIRS = [
    ("meshpar|True", "meshpar|False"),
    ("meshpar|False", "Megatron-style|False"),
    ("meshpar|False", "torch DTensor|False"),
    ("meshpar|True", "Megatron-style|True"),
    ("meshpar|True", "torch DTensor|True"),
]


def _label(key: str) -> str:
    variant, compiled = key.split("|")
    return f"{variant} {'compile' if compiled == 'True' else 'eager'}"


def main() -> None:
    parser = model_arguments()
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    args = parser.parse_args()
    result = run_distributed(bench_case, 2, args, timeout=1800)[0]
    tokens = args.batch * args.seq
    print(
        f"GPT: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}; TP=2 on 2 gloo processes"
    )
    print(f"{'variant':16s} {'mode':8s} {'step ms':>9s} {'tokens/s':>9s} {'vs best peer':>13s}")
    for mode in ("eager", "compile") if args.compile else ("eager",):
        compiled = mode == "compile"
        times = result["times"]
        peers = min(times[f"{p}|{compiled}"] for p in ("torch DTensor", "Megatron-style") if f"{p}|{compiled}" in times)
        for variant in ("dense", "meshpar", "torch DTensor", "Megatron-style"):
            key = f"{variant}|{compiled}"
            if key not in times:
                print(f"{variant:16s} {mode:8s} {'n/a':>9s}  ({result['failures'][key]})")
                continue
            t = times[key]
            print(f"{variant:16s} {mode:8s} {t * 1e3:9.1f} {tokens / t:9.0f} {t / peers:12.2f}x")
    print("\nper-round paired ratios (same round, so machine drift cancels): median, and rounds where the first won")
    for first, second in _PAIRS:
        a, b = result["rounds"].get(first), result["rounds"].get(second)
        if a is None or b is None:
            continue
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        wins = sum(r < 1 for r in ratios)
        print(f"  {_label(first):26s} / {_label(second):26s} {statistics.median(ratios):6.3f}   {wins}/{len(ratios)}")
    print(
        "\ncollectives per step per rank (forward | backward), Megatron minimum per layer: 2 all-reduce | 2 all-reduce"
    )
    for variant, (fwd, bwd) in result["comms"].items():
        per_layer = (sum(fwd.values()) / args.layers, sum(bwd.values()) / args.layers)
        print(f"{variant:16s} {dict(fwd)} | {dict(bwd)}  -> per layer {per_layer[0]:.2f} | {per_layer[1]:.2f}"
              f"  (ratio to minimum {per_layer[0] / 2:.2f} | {per_layer[1] / 2:.2f})")  # fmt: skip
    minimum = 2 * args.layers * args.batch * args.seq * args.hidden * 4  # 2 fp32 [b, s, h] all-reduces per layer
    print(f"\nbytes handed to collectives per step per rank (forward | backward); Megatron minimum {minimum:,} each")
    for variant, (fwd_b, bwd_b) in result["comm_bytes"].items():
        print(f"{variant:16s} {fwd_b:>12,} | {bwd_b:>12,}  (ratio {fwd_b / minimum:.2f} | {bwd_b / minimum:.2f})")
    dense = result["numel"]["dense"]
    print(f"\nparameters per rank; ideal with embedding, head, norms and row biases replicated: {result['ideal']:.3f}")
    for variant, numel in result["numel"].items():
        print(f"{variant:16s} {numel:>10,} ({numel / dense:.3f} of dense)")
    print(f"peak RSS of a rank process (all variants built in turn): {result['max_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
