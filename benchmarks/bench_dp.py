"""Data-parallel step time: dp grad all-reduce after backward vs overlapped with backward (meshpar's
``OverlappedGradSync``) vs torch's ``DistributedDataParallel``, against the same step with no dp sync at all.

    .venv/bin/python benchmarks/bench_dp.py                       # dp=2 on 2 local gloo processes (CPU)
    .venv/bin/python benchmarks/bench_dp.py --hidden 512 --layers 8

Every variant is the same GPT-2-style model (``bench_tp.GPT``), same weights, each rank its own slice of the batch.
A step is forward + backward + dp grad sync + SGD. Rounds alternate the variants (A B C D A B C D ...); the table
shows medians and per-round paired ratios, and how much of the exposed all-reduce time the overlap hides:
``hidden = 1 - (overlapped - no sync) / (after backward - no sync)``.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.nn.functional as F
from _rounds import alternate, model_arguments
from bench_tp import GPT
from torch.nn.parallel import DistributedDataParallel

from meshpar.data_parallel import allreduce_gradients
from meshpar.grad_sync import OverlappedGradSync
from meshpar.parallel_dims import ParallelDims
from meshpar.testing import run_distributed, setup_parallel


def dp_model_and_batch(args: argparse.Namespace) -> tuple[ParallelDims, GPT, torch.Tensor]:
    """A pure-dp mesh, the benchmark GPT (same weights on every rank) and this dp rank's own token batch."""
    dims = setup_parallel(tp=1)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.hidden, args.heads, args.layers, args.seq)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(dims.dp_rank))
    return dims, model, ids


def bench_case(args: argparse.Namespace) -> dict:
    dims, dense, ids = dp_model_and_batch(args)
    grad_mib = sum(p.numel() for p in dense.parameters()) * 4 / 2**20
    runs, syncs = {}, {}
    overlapped = {f"overlapped {mb:g} MiB": mb for mb in args.bucket_mb}
    for variant in ("no sync", "after backward", *overlapped, "torch DDP"):
        model = copy.deepcopy(dense)
        finish = None
        if variant == "after backward":
            finish = lambda m=model: allreduce_gradients(m.parameters(), dims.dp_mesh)  # noqa: E731
        elif variant in overlapped:
            syncs[variant] = OverlappedGradSync(model.parameters(), dims.dp_mesh, bucket_mb=overlapped[variant])
            finish = syncs[variant].finish
        elif variant == "torch DDP":
            model = DistributedDataParallel(model, process_group=dims.dp_mesh.get_group())
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(m=model, o=opt, finish=finish) -> None:
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
            if finish is not None:
                finish()
            o.step()

        step()  # warm-up (DDP rebuilds its buckets after the first step)
        step()
        runs[variant] = step
    times = alternate(runs, args.rounds)
    return {
        "rounds": times,
        "buckets": {v: s.num_buckets for v, s in syncs.items()},
        "grad_mib": grad_mib,
    }


def main() -> None:
    parser = model_arguments(batch_help="per dp rank")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 4.0], help="OverlappedGradSync caps")
    args = parser.parse_args()
    # each rank's round times: a step ends for everyone at the slowest rank, so take the per-round maximum
    per_rank = run_distributed(bench_case, 2, args, timeout=1800)
    variants = list(per_rank[0]["rounds"])
    rounds = {v: [max(r["rounds"][v][i] for r in per_rank) for i in range(args.rounds)] for v in variants}
    medians = {v: statistics.median(t) for v, t in rounds.items()}
    result = per_rank[0]
    print(
        f"GPT: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch} per rank, vocab "
        f"{args.vocab}; {result['grad_mib']:.1f} MiB of fp32 grads; dp=2 on 2 gloo processes, {args.rounds} rounds"
    )
    base, floor = medians["after backward"], medians["no sync"]
    header = ("variant", "buckets", "step ms", "vs after bwd", "paired", "wins", "hidden", "paired vs DDP")
    print("{:24s} {:>7s} {:>9s} {:>13s} {:>7s} {:>6s} {:>7s} {:>14s}".format(*header))
    for variant in variants:
        t = medians[variant]
        ratios = [a / b for a, b in zip(rounds[variant], rounds["after backward"], strict=True)]
        wins = sum(r < 1 for r in ratios)
        hidden = 1 - (t - floor) / (base - floor) if variant != "no sync" and base > floor else float("nan")
        buckets = result["buckets"].get(variant, "")
        vs_ddp = [a / b for a, b in zip(rounds[variant], rounds["torch DDP"], strict=True)]
        ddp_wins = sum(r < 1 for r in vs_ddp)
        print(
            f"{variant:24s} {buckets!s:>7s} {t * 1e3:9.1f} {t / base:12.3f}x {statistics.median(ratios):7.3f} "
            f"{wins:>3d}/{len(ratios):<2d} {hidden:7.2f} {statistics.median(vs_ddp):8.3f} "
            f"{ddp_wins:>2d}/{len(vs_ddp)}"
        )


if __name__ == "__main__":
    main()
