"""ZeRO-1 over dp: collectives and bytes per step per rank against the minimum, optimizer state per rank, step time.

    .venv/bin/python benchmarks/bench_zero.py                  # dp=2 on 2 local gloo processes
    .venv/bin/python benchmarks/bench_zero.py --dp 4 --rounds 10

Every variant trains the same GPT-2-style model (``bench_tp.GPT``) with AdamW, each dp rank on its own slice:

- ``replicated``: grads all-reduced, every rank steps every parameter (plain data parallelism).
- ``ZeRO-1 all-reduce``: grads all-reduced, each rank steps the ~1/dp of the parameters it owns and the updated
  parameters are all-gathered (NxD's ``use_zero1_optimizer``; meshpar's ``zero1=True``).
- ``ZeRO-1 reduce-scatter``: each rank receives only its owned grads (one reduce-scatter), steps them and all-gathers
  the parameters (Megatron's distributed optimizer; meshpar's ``zero1=True, reduce_scatter_grads=True``).

The minimum a step must send to average the grads over dp is one all-reduce's worth: ``2 (p-1)/p N`` bytes per rank
for ``N`` bytes of grads (ring algorithms). A reduce-scatter plus an all-gather *is* that all-reduce, split around
the optimizer step; an all-reduce plus an all-gather is 1.5x it. Bytes come from the collectives the step dispatches
(``_wire.WireBytes``); ratios above 1.00 from the reduce-scatter variant are the padding of the owners' segments.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _rounds import alternate, model_arguments
from _wire import WireBytes
from bench_dp import dp_model_and_batch
from bench_tp import GPT

from meshpar._compat import CommDebugMode
from meshpar.data_parallel import allreduce_gradients
from meshpar.optim import DistributedOptimizer
from meshpar.testing import run_distributed
from meshpar.testing.dispatch import comm_counts

VARIANTS = {  # name: (zero1, reduce_scatter_grads)
    "replicated": (False, False),
    "ZeRO-1 all-reduce": (True, False),
    "ZeRO-1 reduce-scatter": (True, True),
}


COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")


def zero_case(args: argparse.Namespace) -> dict:
    dims, base, ids = dp_model_and_batch(args)
    runs, report = {}, {}
    for name, (zero1, reduce_scatter) in VARIANTS.items():
        model = GPT(args.vocab, args.hidden, args.heads, args.layers, args.seq)
        model.load_state_dict(base.state_dict())
        opt = DistributedOptimizer(
            model, torch.optim.AdamW, zero1=zero1, reduce_scatter_grads=reduce_scatter, dims=dims, lr=1e-4
        )

        def step(m=model, o=opt, all_reduce=not reduce_scatter) -> None:
            o.zero_grad()
            F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
            if all_reduce:
                allreduce_gradients(m.parameters(), dims.dp_mesh)
            o.step()

        step()  # warm-up; creates the AdamW state
        with CommDebugMode() as mode, WireBytes(dims.dp) as wire:
            step()
        report[name] = {"counts": dict(comm_counts(mode)), "bytes": wire.total, "state": opt.state_bytes()}
        runs[name] = step
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    return {
        "rounds": alternate(runs, args.rounds),
        "collectives": alternate(_raw_collectives(grad_bytes // 4, dims.dp_mesh.get_group(), dims.dp), args.rounds),
        "report": report,
        "grad_bytes": grad_bytes,
    }


def _raw_collectives(numel: int, group: object, p: int) -> dict:
    """The backend's own collectives on a flat fp32 buffer the size of the grads: what a step's sync costs here."""
    numel -= numel % p
    full, shard = torch.randn(numel), torch.empty(numel // p)
    return {
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, shard, group=group),
    }


def main() -> None:
    parser = model_arguments(batch_help="per dp rank")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dp", type=int, default=2)
    args = parser.parse_args()
    per_rank = run_distributed(zero_case, args.dp, args, timeout=1800)
    # a step ends for everyone at the slowest rank: per round, take the maximum over ranks
    rounds = {v: [max(r["rounds"][v][i] for r in per_rank) for i in range(args.rounds)] for v in VARIANTS}
    grad_bytes, p = per_rank[0]["grad_bytes"], args.dp
    minimum = 2 * (p - 1) / p * grad_bytes
    print(
        f"GPT: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch} per rank, vocab "
        f"{args.vocab}; {grad_bytes / 2**20:.1f} MiB of fp32 grads; dp={p} on {p} gloo processes, AdamW, "
        f"{args.rounds} rounds; minimum dp bytes per rank per step (one all-reduce) {minimum / 2**20:.2f} MiB"
    )
    base = "ZeRO-1 all-reduce"
    header = ("variant", "MiB sent/rank", "vs minimum", "max state MiB", "step ms", "vs ZeRO-1 AR", "wins")
    print("{:22s} {:>13s} {:>10s} {:>13s} {:>8s} {:>12s} {:>6s}   collectives per step".format(*header))
    for name in VARIANTS:
        sent = max(r["report"][name]["bytes"] for r in per_rank)
        state = max(r["report"][name]["state"] for r in per_rank)
        ratios = [a / b for a, b in zip(rounds[name], rounds[base], strict=True)]
        wins = sum(r < 1 for r in ratios)
        print(
            f"{name:22s} {sent / 2**20:13.2f} {sent / minimum:9.2f}x {state / 2**20:13.2f} "
            f"{statistics.median(rounds[name]) * 1e3:8.1f} {statistics.median(ratios):11.3f}x "
            f"{wins:>2d}/{len(ratios):<3d}  {per_rank[0]['report'][name]['counts']}"
        )
    collectives = {c: [max(r["collectives"][c][i] for r in per_rank) for i in range(args.rounds)] for c in COLLECTIVES}
    print(f"\nthe backend's own collectives on a flat buffer of {grad_bytes / 2**20:.1f} MiB (median, paired vs AR):")
    for name, times in collectives.items():
        paired = statistics.median(a / b for a, b in zip(times, collectives["all_reduce"], strict=True))
        print(f"  {name:24s} {statistics.median(times) * 1e3:8.1f} ms  {paired:6.3f}x")


if __name__ == "__main__":
    main()
