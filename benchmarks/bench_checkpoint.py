"""Activation checkpointing with and without ``torch.compile`` on the HF path (``meshpar.parallelize``, GPT-2, tp=2):
step time, the graphs dynamo compiled, and the bytes autograd keeps for backward, in one invocation.

    .venv/bin/python benchmarks/bench_checkpoint.py --rounds 10     # 2 local gloo processes

The four variants are eager and compiled blocks, each with and without ``activation_checkpointing``. Rounds
alternate them (A B C D A B C D ...); paired per-round ratios cancel the machine's drift. "saved MiB" is the peak
of the tensors autograd holds for backward during one training step, counted outside recomputed blocks (a
checkpointed block keeps only its inputs; what its recompute rebuilds lives only while that block's backward runs).
"""

from __future__ import annotations

import copy
import statistics
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rounds import alternate, model_arguments
from bench_pipeline import SavedBytes

import meshpar
from meshpar.optim import DistributedOptimizer
from meshpar.testing import run_distributed, setup_parallel

VARIANTS = [(False, False), (False, True), (True, False), (True, True)]  # (compile, activation_checkpointing)


def _label(compiled: bool, checkpointed: bool) -> str:
    return f"{'compile' if compiled else 'eager'}{' + checkpointing' if checkpointed else ''}"


def checkpoint_case(args) -> dict:
    setup_parallel(tp=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    dense = GPT2LMHeadModel(config)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    steps, report = {}, {}
    for compiled, checkpointed in VARIANTS:
        model = meshpar.parallelize(
            copy.deepcopy(dense),
            {"tensor_parallel_size": 2, "compile": compiled, "activation_checkpointing": checkpointed},
        )
        optimizer = DistributedOptimizer(model, torch.optim.SGD, lr=1e-4)

        def step(model=model, optimizer=optimizer) -> torch.Tensor:
            optimizer.zero_grad()
            loss = model.train_step(input_ids=ids, labels=ids)
            optimizer.step()
            return loss

        torch._dynamo.reset()  # the variants compile the same code: count what this one compiles on its own
        torch._dynamo.utils.counters.clear()
        step()  # warm-up (and compile)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        saved = SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda holder: holder.tensor):
            loss = step()
        steps[(compiled, checkpointed)] = step
        report[(compiled, checkpointed)] = {"graphs": graphs, "saved_mib": saved.peak / 2**20, "loss": float(loss)}
    for step in steps.values():  # recompile what the resets dropped, outside the timed rounds
        step()
    times = alternate(steps, args.rounds)
    for key, samples in times.items():
        report[key]["rounds"] = samples
    return {_label(*key): value for key, value in report.items()}


_PAIRS = [
    ("compile + checkpointing", "eager + checkpointing"),
    ("compile", "eager"),
    ("eager + checkpointing", "eager"),
    ("compile + checkpointing", "compile"),
]


def main() -> None:
    parser = model_arguments()
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    report = run_distributed(checkpoint_case, 2, args, timeout=1800)[0]
    print(
        f"GPT-2 via meshpar.parallelize: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
        f"batch {args.batch}, vocab {args.vocab}; tp=2 on 2 gloo processes, {args.rounds} rounds"
    )
    print(f"{'variant':26s} {'graphs':>6s} {'step ms':>9s} {'saved MiB':>10s} {'loss':>8s}")
    for label, row in report.items():
        step_ms = statistics.median(row["rounds"]) * 1e3
        print(f"{label:26s} {row['graphs']:6d} {step_ms:9.1f} {row['saved_mib']:10.2f} {row['loss']:8.4f}")
    print("\nper-round paired ratios: median, and rounds where the first won")
    for first, second in _PAIRS:
        ratios = [a / b for a, b in zip(report[first]["rounds"], report[second]["rounds"], strict=True)]
        wins = sum(r < 1 for r in ratios)
        print(f"  {first:26s} / {second:26s} {statistics.median(ratios):6.3f}   {wins}/{len(ratios)}")


if __name__ == "__main__":
    main()
