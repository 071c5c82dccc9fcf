"""meshpar's HF path at tp=1 against the plain HF model: the overhead of ``parallelize`` itself, in one invocation.

    .venv/bin/python benchmarks/bench_hf_step.py                  # Llama 4 layers x 256, batch 8 x 256, vocab 8192
    .venv/bin/python benchmarks/bench_hf_step.py --family gpt2

One process (a one-rank gloo group). A step is forward + loss + backward + SGD: ``model(**batch).loss.backward()``
for the plain model, ``train_step(**batch)`` for meshpar's (the same weights, the same batch). Rounds alternate the
two variants; the verdict is the median of the per-round ratios meshpar / plain (<= 1.00: no overhead).
"""

from __future__ import annotations

import copy
import statistics

import torch
from _rounds import alternate, model_arguments
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import meshpar
from meshpar.testing import run_distributed


def _model(family: str, args) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                            n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            attn_implementation="sdpa")  # fmt: skip
        return GPT2LMHeadModel(config)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=args.seq, attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def bench_case(args) -> dict:
    torch.set_num_threads(args.threads)
    plain = _model(args.family, args)
    parallel = meshpar.parallelize(copy.deepcopy(plain), {"tensor_parallel_size": 1})
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-4)
    parallel_opt = meshpar.DistributedOptimizer(parallel, torch.optim.SGD, lr=1e-4)

    def plain_step() -> None:
        plain_opt.zero_grad()
        plain(**batch).loss.backward()
        plain_opt.step()

    def parallel_step() -> None:
        parallel_opt.zero_grad()
        parallel.train_step(**batch)
        parallel_opt.step()

    for step in (plain_step, parallel_step):  # warm-up
        step()
    return alternate({"plain HF": plain_step, "meshpar tp=1": parallel_step}, args.rounds)


def main() -> None:
    parser = model_arguments()
    parser.set_defaults(batch=8)
    parser.add_argument("--family", choices=["llama", "gpt2"], default="llama")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    times = run_distributed(bench_case, 1, args, timeout=1800)[0]
    plain, ours = times["plain HF"], times["meshpar tp=1"]
    ratios = [b / a for a, b in zip(plain, ours, strict=True)]
    print(f"{args.family} {args.layers} layers x {args.hidden}, batch {args.batch} x {args.seq}, vocab {args.vocab}")
    print(f"plain HF      {statistics.median(plain) * 1e3:8.1f} ms/step")
    print(f"meshpar tp=1  {statistics.median(ours) * 1e3:8.1f} ms/step")
    print(f"meshpar / plain: median of {len(ratios)} paired ratios {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
