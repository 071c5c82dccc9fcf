"""Context parallelism: a sequence cp times longer at the same tokens per rank, against cp=1; step time, bytes each
rank sends and activations saved for backward, for both attention implementations, in one invocation.

    .venv/bin/python benchmarks/bench_cp.py            # 2 local gloo processes; a Qwen3-shaped model
    .venv/bin/python benchmarks/bench_cp.py --cp 4     # 4 processes: 4x the sequence

Layouts on ``cp`` ranks, each holding ``seq`` tokens of one row: ``cp1`` (dp=cp, one row of ``seq`` per rank), and
``cp<N>`` (one row of ``cp * seq`` split over the ranks) with the all-gather and the ring attention. The cp runs
attend over cp times the keys per query on average (the sequence is that much longer), so the same tokens per rank
cost more attention: that is the price of the longer context, which no cp=1 layout of these ranks could hold at all
past its memory. Bytes: what
rank 0 hands to collectives in one step: grad all-reduces as a ring sends them, and the K/V exchanges (all-gathers,
reduce-scatters, ring sends) with their grads.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rounds import alternate
from bench_ep import SentBytes
from bench_pipeline import SavedBytes

import meshpar
from meshpar.testing import run_distributed, setup_parallel


def layouts(cp: int) -> dict[str, tuple[int, str]]:
    return {"cp1": (1, "all_gather"), f"cp{cp} all_gather": (cp, "all_gather"), f"cp{cp} ring": (cp, "ring")}


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4, max_position_embeddings=4 * args.seq,
        attn_implementation="sdpa",
    )  # fmt: skip
    return Qwen3ForCausalLM(config)


def cp_case(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    dense = _model(args)
    generator = torch.Generator().manual_seed(1)
    runs, report = {}, {}
    for key, (cp, implementation) in layouts(args.cp).items():
        dims = setup_parallel(cp=cp)
        config = {"context_parallel_size": cp, "context_parallel_implementation": implementation}
        model = meshpar.parallelize(copy.deepcopy(dense), {**config, "overlap_grad_reduce": False})
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        # every rank holds args.seq tokens: cp1 one row of seq per dp rank, cp<N> one row of N seq over the ranks
        rows = torch.randint(0, 512, (dims.dp, args.seq * cp), generator=generator)
        mine = rows[dims.dp_rank : dims.dp_rank + 1]

        def step(m=model, o=optimizer, batch=mine) -> None:
            o.zero_grad(set_to_none=True)
            m.train_step(input_ids=batch, labels=batch)
            o.step()

        saved = SavedBytes()
        with (
            SentBytes({"dp": args.cp, "tp": 1}) as sent,
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda held: held.tensor),
        ):
            step()
        report[key] = {"bytes": (sent.all_reduce, sent.gathers + sent.sends), "saved": saved.peak}
        runs[key] = step
    report["times"] = alternate(runs, args.rounds)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512, help="tokens per rank")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cp", type=int, default=2, help="ranks (and the sequence's multiple of --seq)")
    args = parser.parse_args()
    result = run_distributed(cp_case, args.cp, args, timeout=1800)[0]
    print(f"Qwen3-shaped: {args.layers} layers x hidden {args.hidden}, {args.seq} tokens per rank, fp32, SGD;")
    print(f"{args.cp} gloo processes (rank 0's view)\n")
    print(f"{'layout':16s} {'sequence':>9s} {'grad B':>11s} {'K/V B':>11s} {'saved MiB':>10s} {'step ms':>9s}"
          f" {'vs cp1':>8s}")  # fmt: skip
    base = result["times"]["cp1"]
    for key, (cp, _) in layouts(args.cp).items():
        r, times = result[key], result["times"][key]
        ratio = statistics.median(a / b for a, b in zip(times, base, strict=True))
        grads, kv = r["bytes"]
        print(f"{key:16s} {args.seq * cp:9d} {grads:11,.0f} {kv:11,.0f} {r['saved'] / 2**20:10.1f}"
              f" {statistics.median(times) * 1e3:9.1f} {ratio:7.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
