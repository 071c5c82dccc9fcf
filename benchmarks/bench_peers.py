"""meshpar against its peers on HuggingFace models, side by side in one invocation.

    .venv/bin/python benchmarks/bench_peers.py          # Llama and GPT-2, 4 layers x 256, batch 8 x 256, vocab 8192
    .venv/bin/python benchmarks/bench_peers.py --family llama --compile

Two groups of rows, each timed in alternating rounds (A B C A B C ...) and compared by the median of per-round
ratios, so machine noise hits every variant alike:

- **tp=1, one process**: the plain HF model (``model(**batch).loss.backward()``) against ``meshpar.parallelize`` at
  tp=1 (``train_step``): meshpar's overhead on one device; and ``fused_kernels: true`` against the stock norms (on CPU
  the fused ops run their torch references: what switching them on costs there).
- **tp=2, two gloo processes**: meshpar (vocab-parallel embedding, LM head and loss) against torch-native TP, i.e.
  torch's ``ColwiseParallel`` / ``RowwiseParallel`` with torchtitan's Llama plan (embedding row-wise, LM head
  column-wise with ``Shard(-1)`` logits) and ``loss_parallel``; and against HF's own TP plan
  (``config.base_model_tp_plan`` applied by transformers' ``distribute_model``, which gathers full-vocabulary logits
  on every rank) where the installed transformers can apply it. torch's styles shard ``nn.Linear`` only, so GPT-2
  (``Conv1D``) has no torch-native row. ``--compile`` adds compiled rows (meshpar ``compile: true`` and the torch-native
  blocks under ``torch.compile``).

A step is forward + loss + backward + SGD. Also printed per variant: collectives per step (all-reduce, all-gather,
reduce-scatter, from torch's dispatch) and the bytes autograd saves for backward (``saved_tensors_hooks``).
"""

from __future__ import annotations

import copy
import re
import statistics
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _rounds import alternate, model_arguments
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import meshpar
from meshpar.hf.parallelize import ParallelizedModel
from meshpar.testing import run_distributed, setup_parallel
from meshpar.testing.dispatch import AtenOps


def _model(family: str, args) -> nn.Module:
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


def _torch_native(model: LlamaForCausalLM, mesh, compiled: bool) -> Callable[[dict], torch.Tensor]:
    """torchtitan's Llama TP plan with torch's styles; the loss under ``loss_parallel`` on ``Shard(-1)`` logits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for index in range(len(model.model.layers)):
        prefix = f"model.layers.{index}"
        plan |= {f"{prefix}.self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
        plan |= {f"{prefix}.mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")}
        plan |= {f"{prefix}.self_attn.o_proj": RowwiseParallel(), f"{prefix}.mlp.down_proj": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    if compiled:
        for index, layer in enumerate(model.model.layers):
            model.model.layers[index] = torch.compile(layer)

    def loss(batch: dict) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"]).logits
        labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # shift the labels, not the logits
        with loss_parallel():
            value = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            value.backward()
        return value

    return loss


def _hf_plan(model: nn.Module, mesh) -> Callable[[dict], torch.Tensor] | str:
    """transformers' own TP (``apply_tensor_parallelism`` with the model's ``tp_plan``, layer wildcards expanded), or
    why it cannot run here."""
    try:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        patterns = dict(model.tp_plan)
        names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
        plan = {
            name: style
            for pattern, style in patterns.items()
            for name in names
            if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name)
        }
        if not plan:
            return "n/a (transformers ships no tp_plan for this family)"
        apply_tensor_parallelism(model, mesh, plan)
    except Exception as error:  # the API moves between transformers versions
        return f"n/a ({type(error).__name__}: {str(error).splitlines()[0][:100]})"

    def loss(batch: dict) -> torch.Tensor:
        value = model(**batch).loss
        value.backward()
        return value

    return loss


_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast_")


def _saved_bytes_and_collectives(fn: Callable[[], object]) -> tuple[int, Counter]:
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with AtenOps() as ops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    collectives = Counter({k: n for k, n in ops.collective_names.items() if k in _COLLECTIVES})
    return saved, collectives


def _variant_step(loss: Callable[[dict], object], model: nn.Module, batch: dict) -> Callable[[], None]:
    """A training step; meshpar's models step with meshpar's optimizer (on local shards), the others with SGD."""
    if isinstance(model, ParallelizedModel):
        optimizer = meshpar.DistributedOptimizer(model, torch.optim.SGD, lr=1e-4)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(batch)
        optimizer.step()

    return step


def tp1_case(args, family: str) -> dict:
    torch.set_num_threads(args.threads)
    plain = _model(family, args)
    ours = meshpar.parallelize(copy.deepcopy(plain), {"tensor_parallel_size": 1})
    fused = meshpar.parallelize(copy.deepcopy(plain), {"tensor_parallel_size": 1, "fused_kernels": True})
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    losses = {
        "plain HF": lambda b: plain(**b).loss.backward(),
        "meshpar tp=1": lambda b: ours.train_step(**b),
        "meshpar tp=1 fused": lambda b: fused.train_step(**b),
    }
    models = (plain, ours, fused)
    steps = {name: _variant_step(loss, m, batch) for (name, loss), m in zip(losses.items(), models, strict=True)}
    return _measure(steps, losses, batch, args.rounds)


def tp2_case(args, family: str) -> dict:
    torch.set_num_threads(1)
    dims = setup_parallel(tp=2)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    losses: dict[str, Callable[[dict], object]] = {}
    steps: dict[str, Callable[[], None]] = {}
    notes: dict[str, str] = {}
    for compiled in (False, True) if args.compile else (False,):
        suffix = " compiled" if compiled else ""
        ours = meshpar.parallelize(_model(family, args), {"tensor_parallel_size": 2, "compile": compiled})
        losses[f"meshpar{suffix}"] = lambda b, m=ours: m.train_step(**b)
        steps[f"meshpar{suffix}"] = _variant_step(losses[f"meshpar{suffix}"], ours, batch)
        if family == "llama":
            native = _model(family, args)
            losses[f"torch-native{suffix}"] = _torch_native(native, dims.tp_mesh, compiled)
            steps[f"torch-native{suffix}"] = _variant_step(losses[f"torch-native{suffix}"], native, batch)
    hf = _model(family, args)
    hf_loss = _hf_plan(hf, dims.tp_mesh)
    if isinstance(hf_loss, str):
        notes["HF tp_plan"] = hf_loss
    else:
        losses["HF tp_plan"] = hf_loss
        steps["HF tp_plan"] = _variant_step(hf_loss, hf, batch)
    result = _measure(steps, losses, batch, args.rounds)
    result["notes"] |= notes
    return result


def _measure(steps: dict, losses: dict, batch: dict, rounds: int) -> dict:
    """Every rank runs the same variants in the same order, so one that fails fails on every rank alike."""
    failures = {}
    for name, step in list(steps.items()):  # warm-up (and compile)
        try:
            step()
            step()
        except Exception as error:
            failures[name] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:100]}"
            del steps[name], losses[name]
            torch._dynamo.reset()
    times = alternate(steps, rounds)
    counts = {name: _saved_bytes_and_collectives(lambda f=fn: f(batch)) for name, fn in losses.items()}
    return {"times": times, "counts": counts, "notes": failures}


def _report(title: str, result: dict, pairs: list[tuple[str, str]]) -> None:
    print(title)
    times = result["times"]
    for name, seconds in times.items():
        saved, collectives = result["counts"][name]
        comm = ", ".join(f"{n} {k}" for k, n in sorted(collectives.items())) or "none"
        print(f"  {name:24s} {statistics.median(seconds) * 1e3:9.1f} ms/step  saved {saved / 2**20:7.1f} MiB  {comm}")
    for name, why in result.get("notes", {}).items():
        print(f"  {name:24s} {why}")
    for ours, theirs in pairs:
        if ours in times and theirs in times:
            ratios = [a / b for a, b in zip(times[ours], times[theirs], strict=True)]
            print(
                f"  {ours} / {theirs}: {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
            )


def main() -> None:
    parser = model_arguments()
    parser.set_defaults(batch=8)
    parser.add_argument("--family", choices=["llama", "gpt2", "both"], default="both")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the one-process (tp=1) rows")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--groups", nargs="+", choices=["tp1", "tp2"], default=["tp1", "tp2"])
    args = parser.parse_args()
    families = ["llama", "gpt2"] if args.family == "both" else [args.family]
    print(f"{args.layers} layers x {args.hidden}, batch {args.batch} x {args.seq}, vocab {args.vocab}, SGD step")
    for family in families:
        if "tp1" in args.groups:
            tp1 = run_distributed(tp1_case, 1, args, family, timeout=1800)[0]
            pairs = [("meshpar tp=1", "plain HF"), ("meshpar tp=1 fused", "meshpar tp=1")]
            _report(f"{family}, tp=1 (one process)", tp1, pairs)
        if "tp2" not in args.groups:
            continue
        # the slower rank's view is what a step costs; rank 0's rounds are representative (barrier per step)
        tp2 = run_distributed(tp2_case, 2, args, family, timeout=1800)[0]
        pairs = [(f"meshpar{s}", f"{peer}{s}") for s in ("", " compiled") for peer in ("torch-native", "HF tp_plan")]
        _report(f"{family}, tp=2 (two gloo processes)", tp2, pairs)


if __name__ == "__main__":
    main()
