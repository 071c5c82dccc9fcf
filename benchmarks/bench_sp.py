"""Sequence parallelism vs plain tensor parallelism at tp=2: collectives and bytes against Megatron's minimum,
activation memory saved for backward, and step time, in one invocation.

    .venv/bin/python benchmarks/bench_sp.py                 # 2 local gloo processes; pre-norm blocks, bias, GeLU MLP

Megatron's sequence parallelism replaces each layer's two all-reduces per direction by an all-gather before the
column-parallel linears and a reduce-scatter after the row-parallel ones: the same bytes (an all-reduce *is* a
reduce-scatter plus an all-gather), with the norms, dropout and residual adds running on 1/tp of the sequence.
In backward the replicated norm weights and biases and the row-parallel biases see only a sequence shard, so their
grads need one all-reduce each (small: [hidden]). Bytes below are what each rank sends: the share of each
collective's full tensor sends with a ring algorithm, so a correct SP layer equals the TP layer's bytes exactly.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rounds import alternate, model_arguments
from _wire import WireBytes
from bench_pipeline import SavedBytes

from meshpar._compat import CommDebugMode
from meshpar.optim import DistributedOptimizer
from meshpar.testing import run_distributed, setup_parallel, shard_of
from meshpar.testing.dispatch import comm_counts
from tests._models import TinyTransformer, block_plan

# SP regather: the column linears save the input's sequence shard and all-gather it again in backward (Megatron)
VARIANTS = ("TP", "SP", "SP regather")


def sp_case(args: argparse.Namespace) -> dict:
    dims = setup_parallel(tp=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x_full = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    runs, report = {}, {}
    for key in VARIANTS:
        sp, regather = key != "TP", key == "SP regather"
        torch.manual_seed(0)
        model = TinyTransformer(hidden=args.hidden, heads=args.heads, ffn=4 * args.hidden, layers=args.layers)
        model = parallelize_module(model, dims.tp_mesh, block_plan(sequence_parallel=sp, regather=regather))
        x = shard_of(x_full, dims.tp_mesh, 1).contiguous() if sp else x_full
        opt = DistributedOptimizer(model, torch.optim.SGD, dims=dims, lr=1e-3)
        with CommDebugMode() as fwd_mode, WireBytes(2) as fwd_bytes:
            saved = SavedBytes()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda held: held.tensor):
                out = model(x)
        with CommDebugMode() as bwd_mode, WireBytes(2) as bwd_bytes:
            out.square().mean().backward()
        report[key] = {
            "fwd": dict(comm_counts(fwd_mode)),
            "bwd": dict(comm_counts(bwd_mode)),
            "bytes": (fwd_bytes.activations, bwd_bytes.activations, bwd_bytes.flat),
            "saved": saved.peak,
        }

        def step(m=model, o=opt, inp=x) -> None:
            o.zero_grad(set_to_none=True)
            m(inp).square().mean().backward()
            o.step()

        step()
        runs[key] = step
    times = alternate(runs, args.rounds)
    report["times"] = times
    return report


def main() -> None:
    parser = model_arguments()
    args = parser.parse_args()
    result = run_distributed(sp_case, 2, args, timeout=1800)[0]
    layers = args.layers
    full = args.batch * args.seq * args.hidden * 4
    shape = f"hidden {args.hidden}, seq {args.seq}, batch {args.batch}"
    print(f"{layers} pre-norm blocks, {shape}, fp32; tp=2 on 2 gloo processes")
    print("\ncollectives per layer (forward | backward); Megatron: TP 2 all-reduce | 2 all-reduce;")
    print("  SP 2 all-gather + 2 reduce-scatter | the same + small all-reduces of the replicated norm / bias grads")
    for key in VARIANTS:
        r = result[key]
        per_layer = ({k: v / layers for k, v in r["fwd"].items()}, {k: v / layers for k, v in r["bwd"].items()})
        print(f"  {key}: {per_layer[0]} | {per_layer[1]}")
    minimum = 2 * layers * full * 2 * (2 - 1) / 2  # two all-reduces of [b, s, h] per layer, ring, p = 2
    print(f"\nbytes each rank sends for activation collectives per step (forward | backward); Megatron minimum "
          f"{minimum:,.0f} each way")  # fmt: skip
    for key in VARIANTS:
        fwd, bwd, small = result[key]["bytes"]
        print(f"  {key}: {fwd:,.0f} | {bwd:,.0f}  (ratio {fwd / minimum:.2f} | {bwd / minimum:.2f});"
              f" small grad all-reduces {small:,.0f}")  # fmt: skip
    tp_saved = result["TP"]["saved"]
    print("\nactivations saved for backward per rank, and step time (fwd + bwd + SGD) paired against TP:")
    tp_t = result["times"]["TP"]
    for key in VARIANTS:
        saved, times = result[key]["saved"], result["times"][key]
        ratios = [a / b for a, b in zip(times, tp_t, strict=True)]
        wins = sum(r < 1 for r in ratios)
        print(
            f"  {key:12s} {saved / 2**20:6.1f} MiB ({saved / tp_saved:.2f}x)   {statistics.median(times) * 1e3:7.1f} ms"
            f"  paired {statistics.median(ratios):.3f} ({wins}/{len(ratios)} rounds faster than TP)"
        )


if __name__ == "__main__":
    main()
