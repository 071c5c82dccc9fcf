"""Projections at sizes no CI machine holds, with torch's fake process group: ``meshpar.parallelize`` shards a model
built on meta exactly as rank 0 of a large job would (the real plan, placements and meshes: expert weights over
``("ep", "tp")``), with no communication; the shards are left on meta (their allocation skipped), so no memory. What
a rank holds is read off the sharded model; what it sends per step is computed from the shapes (all-reduce as a ring
sends it, ``2 (p-1)/p`` of the tensor; all-to-all and all-gather: the rows leaving the rank).

    .venv/bin/python benchmarks/bench_projection.py   # DeepSeek-V3-shaped at ep8, Llama-3-8B-shaped at cp8

- DeepSeek-V3-shaped (61 layers, 3 dense then 58 MoE, 256 routed experts of 2048 and one shared, top-8, latent
  attention, vocab 129,280) on 64 ranks, the same global batch: experts whole per tp rank at tp8 x dp8, against ep8
  over dp64 and ep8 x tp8 (dp8). Per rank: parameters, the training state (bf16 weights, fp32 grads, fp32 master and
  two AdamW moments: 18 bytes per parameter; with ZeRO-1 the 12 optimizer bytes spread over dp for dense weights and
  over the expert-data-parallel group for expert weights), and the bytes one MoE layer sends per step (forward and
  backward) for a global batch of 8 x ``--tokens`` tokens (``--tokens`` per replica at dp8, an eighth of it at dp64).
- Llama-3-8B-shaped (32 layers, hidden 4096, 8 key/value heads of 128) at a ``--seq``-token sequence: cp1 against
  cp8 (and cp8 x tp2): parameters per rank (context parallelism shards no weight), tokens per rank, and the K/V bytes
  one layer's all-gather attention gathers and its backward reduce-scatters.

The layouts run one after another in this process, each in a fake job of its own (meshpar's mesh and the fake
process group are torn down between them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEEPSEEK_LAYOUTS = {"tp8": (8, 1), "ep8": (1, 8), "ep8tp8": (8, 8)}  # (tp, ep) on 64 ranks: dp 8, 64, 8
LLAMA_LAYOUTS = {"cp1": (1, 1), "cp8": (1, 8), "cp8tp2": (2, 8)}  # (tp, cp)
GiB = 2**30


def _deepseek(layers: int) -> tuple[object, object]:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(num_hidden_layers=layers, first_k_dense_replace=min(3, layers - 1))
    return DeepseekV3ForCausalLM(config), config


def _llama(layers: int) -> tuple[object, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
    )  # fmt: skip
    return LlamaForCausalLM(config), config


def _held(world: int, build: str, layers: int, parallel: dict) -> dict[str, float]:
    """Rank 0's parameters (all, and those sharded over ep) after ``parallelize`` in a fake job of ``world`` ranks."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import meshpar
    import meshpar.recipe
    from meshpar._compat import local_tensor
    from meshpar._dp_checks import is_expert_parallel

    # the shards stay on meta: sizes and placements are decided before a meta-built model's shards are allocated
    # (a DeepSeek-V3 rank's would not fit this machine), so that step is left out here (and put back after)
    materialize = meshpar.recipe.materialize_sharded
    meshpar.recipe.materialize_sharded = lambda *_args, **_kwargs: None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with torch.device("meta"):
            model, _ = (_deepseek if build == "deepseek" else _llama)(layers)
        total = sum(p.numel() for p in model.parameters())
        sharded = meshpar.parallelize(model, parallel)
        params = {id(p): p for module in sharded.local_modules() for p in module.parameters()}.values()
        experts = sum(local_tensor(p).numel() for p in params if is_expert_parallel(p))
        mine = sum(local_tensor(p).numel() for p in params)
        dims = sharded.dims
        return {"params": mine, "experts": experts, "total": total, "dp": dims.dp, "edp": dims.edp_mesh.size()}
    finally:
        meshpar.destroy_parallel(destroy_process_group=True)
        meshpar.recipe.materialize_sharded = materialize


def deepseek(layers: int, tokens: int, layouts: list[str]) -> list[tuple[str, ...]]:
    """Rows of the DeepSeek-V3-shaped projection (``layers`` layers; the shapes per MoE layer)."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config()
    hidden, top_k = config.hidden_size, config.num_experts_per_tok
    world, rows = 64, []
    for name, (tp, ep) in DEEPSEEK_LAYOUTS.items():
        if name not in layouts:
            continue
        held = _held(world, "deepseek", layers, {"tensor_parallel_size": tp, "expert_parallel_size": ep})
        replica = tokens * 8 // held["dp"]  # the same global batch in every layout
        dense = held["params"] - held["experts"]
        state = 18 * held["params"]
        zero1 = 6 * held["params"] + 12 * (dense / held["dp"] + held["experts"] / held["edp"])
        # every tp rank of a replica sees all of its tokens
        if ep == 1:  # whole experts per tp rank: the MoE output all-reduced over tp, its input grad in backward
            sent = 2 * (2 * (tp - 1) / tp) * replica * hidden * 2
        else:  # dispatch and combine forward, both again backward: top-k rows per token, those leaving the ep group
            sent = 4 * replica * top_k * hidden * 2 * (ep - 1) / ep / tp
            if tp > 1:  # each tp rank routes to its own whole experts: their outputs summed over tp (and grads)
                sent += 2 * (2 * (tp - 1) / tp) * replica * hidden * 2
        rows.append(
            (name, f"{held['params'] / 1e9:.2f} B", f"{held['experts'] / held['params']:.0%}", f"{state / GiB:.0f}",
             f"{zero1 / GiB:.0f}", f"{sent / 2**20:.0f}")
        )  # fmt: skip
    return rows


def llama(layers: int, seq: int, layouts: list[str]) -> list[tuple[str, ...]]:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    kv = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    rows = []
    for name, (tp, cp) in LLAMA_LAYOUTS.items():
        if name not in layouts:
            continue
        held = _held(tp * cp, "llama", layers, {"tensor_parallel_size": tp, "context_parallel_size": cp})
        heads_kv = kv / tp  # this rank's key/value heads
        gathered = 2 * seq * heads_kv * 2  # K and V of the whole sequence, bf16, held during the layer
        sent = 2 * 2 * (seq / cp) * heads_kv * 2 * (cp - 1)  # its chunk of K, V to the cp-1 others, and dK, dV back
        rows.append(
            (name, f"{held['params'] / 1e9:.2f} B", f"{seq // cp:,}", f"{gathered / 2**20:.0f}", f"{sent / 2**20:.0f}")
        )
    return rows


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepseek-layers", type=int, default=61)
    parser.add_argument("--llama-layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per dp replica per step (DeepSeek rows)")
    parser.add_argument("--seq", type=int, default=131072, help="sequence length (Llama rows)")
    parser.add_argument("--layouts", nargs="*", default=[*DEEPSEEK_LAYOUTS, *LLAMA_LAYOUTS])
    args = parser.parse_args()
    print(f"DeepSeek-V3-shaped, {args.deepseek_layers} layers, 64 ranks, {8 * args.tokens} tokens per step in all")
    header = ("layout", "params/rank", "over ep", "state GiB", "ZeRO-1 GiB", "MiB sent/MoE layer")
    print(_table(header, deepseek(args.deepseek_layers, args.tokens, args.layouts)))
    print(f"\nLlama-3-8B-shaped, {args.llama_layers} layers, one {args.seq:,}-token sequence")
    header = ("layout", "params/rank", "tokens/rank", "K/V MiB gathered/layer", "MiB sent/layer")
    print(_table(header, llama(args.llama_layers, args.seq, args.layouts)))


if __name__ == "__main__":
    main()
