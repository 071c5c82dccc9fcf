"""Expert parallelism vs whole experts per tp rank at equal world size: step time, bytes each rank sends, parameters
and expert weights held per rank, in one invocation.

    .venv/bin/python benchmarks/bench_ep.py     # 4 local gloo processes; a Mixtral-shaped model, 8 experts, top-2

Layouts of the same global batch on 4 ranks: ``tp4`` (every rank sees every token, holds 2 of the 8 experts and a
quarter of every other weight; one all-reduce of the MoE output per layer), ``ep4`` (each rank a quarter of the
batch, 2 experts, every other weight whole; tokens routed by all-to-all), ``ep2 x tp2``, ``ep2 tp2 etp1``
(``expert_tensor_parallel_size`` 1: 4 experts whole on each tp rank, the tokens split over tp) and ``ep2 fsdp``
(FSDP2: the dense weights sharded over dp4, each ep rank's 4 experts over its 2 edp ranks). Bytes: what each rank
hands to its collectives per step (all-reduce counted as a ring sends it, ``2 (p-1)/p`` of the tensor; all-to-all as
the rows it sends, its own share included). Times are alternated round by round and paired against ``tp4``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rounds import alternate

import meshpar
from meshpar._compat import DTensor
from meshpar.testing import run_distributed, setup_parallel

# (tp, ep, config): under FSDP2 the dense weights are sharded over dp, the experts over edp (ranks holding the same
# ones); with expert_tensor_parallel_size 1 each ep rank's experts are whole on both its tp ranks, the tokens split
LAYOUTS = {
    "tp4": (4, 1, {}),
    "ep4": (1, 4, {}),
    "ep2 x tp2": (2, 2, {}),
    "ep2 tp2 etp1": (2, 2, {"expert_tensor_parallel_size": 1}),
    "ep2 fsdp": (1, 2, {"fsdp": True}),
}


class SentBytes(TorchDispatchMode):
    """Bytes this rank hands to all-reduces (ring: ``2 (p-1)/p`` of the tensor over ``p`` ranks), all-to-alls (the
    rows it sends), all-gathers and reduce-scatters (its own part to each other rank) and point-to-point sends,
    counted where the c10d ops are dispatched. ``groups``: the sizes of the groups flat (1-D) and activation
    all-reduces run over."""

    def __init__(self, groups: dict[str, int]) -> None:
        super().__init__()
        self.all_reduce = 0.0
        self.all_to_all = 0.0
        self.gathers = 0.0
        self.sends = 0.0
        self._p = groups

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if func.namespace == "c10d":
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if "alltoall" in name:
                self.all_to_all += tensors[1].numel() * tensors[1].element_size()  # (output, input, ...)
            elif "allreduce" in name:
                p = self._p["dp" if tensors[0].dim() == 1 else "tp"]
                self.all_reduce += sum(t.numel() * t.element_size() for t in tensors) * 2 * (p - 1) / max(p, 1)
            elif "allgather" in name or "reduce_scatter" in name:
                part = min(tensors, key=lambda t: t.numel())
                if len(tensors) == 2:  # one flat tensor each way (FSDP2's): (p - 1) parts of p leave this rank
                    whole = max(tensors, key=lambda t: t.numel())
                    self.gathers += (whole.numel() - part.numel()) * part.element_size()
                else:  # (outputs per rank..., input)
                    self.gathers += part.numel() * part.element_size() * (len(tensors) - 2)
            elif name.endswith("send"):
                self.sends += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=4, num_local_experts=args.experts, num_experts_per_tok=2,
        max_position_embeddings=args.seq, attn_implementation="sdpa",
    )  # fmt: skip
    return MixtralForCausalLM(config)


def ep_case(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    dense = _model(args)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    runs, report = {}, {}
    for key, (tp, ep, extra) in LAYOUTS.items():
        dims = setup_parallel(tp=tp, ep=ep)
        config = {"tensor_parallel_size": tp, "expert_parallel_size": ep, "overlap_grad_reduce": False, **extra}
        model = meshpar.parallelize(copy.deepcopy(dense), config)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        rows = args.batch // dims.dp
        mine = ids[dims.dp_rank * rows : (dims.dp_rank + 1) * rows]
        held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        experts = sum(p.to_local().numel() for n, p in model.named_parameters() if "experts" in n)

        def step(m=model, o=optimizer, batch=mine) -> None:
            o.zero_grad(set_to_none=True)
            m.train_step(input_ids=batch, labels=batch)
            o.step()

        with SentBytes({"dp": dims.dp, "tp": tp}) as sent:
            step()
        report[key] = {"held": held, "experts": experts, "bytes": (sent.all_reduce, sent.all_to_all, sent.gathers)}
        runs[key] = step
    report["times"] = alternate(runs, args.rounds)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    result = run_distributed(ep_case, 4, args, timeout=1800)[0]
    print(f"Mixtral-shaped: {args.layers} layers x hidden {args.hidden}, {args.experts} experts top-2, seq {args.seq},")
    print(f"global batch {args.batch}, fp32, SGD; 4 gloo processes (rank 0's view)\n")
    print(f"{'layout':12s} {'params/rank':>12s} {'experts/rank':>13s} {'all-reduce B':>14s} {'all-to-all B':>14s}"
          f" {'gather/scatter B':>17s} {'step ms':>9s} {'vs tp4':>8s}")  # fmt: skip
    base = result["times"]["tp4"]
    for key in LAYOUTS:
        r, times = result[key], result["times"][key]
        ratio = statistics.median(a / b for a, b in zip(times, base, strict=True))
        reduce, to_all, gathers = r["bytes"]
        print(f"{key:12s} {r['held']:12,d} {r['experts']:13,d} {reduce:14,.0f} {to_all:14,.0f} {gathers:17,.0f}"
              f" {statistics.median(times) * 1e3:9.1f} {ratio:7.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
