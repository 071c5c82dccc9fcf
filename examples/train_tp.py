"""A tiny GPT trained with tensor parallelism (and data parallelism over the remaining ranks) on CPU or GPU.

    torchrun --standalone --nproc-per-node 4 examples/train_tp.py --tp 2     # tp=2 x dp=2

The model is built densely from one seed on every rank and sharded with a plan dict by meshpar's recipe
(``meshpar.apply_recipe``); the LM head emits vocab-sharded logits that go straight into
``meshpar.parallel_cross_entropy``; the dp all-reduce of the grads runs during backward
(``OverlappedGradSync``). The corpus is the source text of Python's own ``textwrap`` module, tokenised by bytes.
"""

from __future__ import annotations

import argparse
import inspect
import math
import textwrap
import time

import torch
import torch.nn.functional as F
from torch import nn

import meshpar
import meshpar.testing
from meshpar.grad_sync import OverlappedGradSync
from meshpar.tensor_parallel import ColumnParallel, RowParallel, VocabParallel


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)  # Megatron layout: [heads, (q, k, v), head_dim]
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x))
        heads = qkv.shape[-1] // (3 * self.head_dim)  # local heads under tp
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))  # vocab-sharded logits under tp


TP_PLAN = {
    "tok": VocabParallel(),
    "layers.*.qkv": ColumnParallel(),
    "layers.*.proj": RowParallel(),
    "layers.*.fc1": ColumnParallel(),
    "layers.*.fc2": RowParallel(),
    "head": ColumnParallel(),  # gather_output=False: logits stay sharded over the vocabulary
}


def batches(data: torch.Tensor, batch: int, seq: int, dp_rank: int, dp: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch * dp,), generator=generator)[dp_rank::dp]
        x = torch.stack([data[s : s + seq] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts.tolist()])
        yield x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over dp)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    dims = meshpar.init_parallel(tp=args.tp, seed=0)
    is_logger = torch.distributed.get_rank() == 0
    device = dims.device
    data = torch.tensor(list(inspect.getsource(textwrap).encode()), dtype=torch.long)
    model = TinyGPT(256, args.hidden, args.heads, args.layers, args.seq)
    model = meshpar.apply_recipe(model, dims, meshpar.Recipe(tp_plan=TP_PLAN))  # TP, then (none asked) AC/FSDP
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    grad_sync = OverlappedGradSync(model.parameters(), dims.dp_mesh)  # dp all-reduce in buckets during backward
    if is_logger:
        local_params = sum(meshpar.testing.local(p).numel() for p in model.parameters())
        print(f"{dims} | corpus {len(data)} bytes | params per rank {local_params}")

    local_batch = args.batch // dims.dp
    stream = batches(data, local_batch, args.seq, dims.dp_rank, dims.dp, seed=0)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in next(stream))
        loss = meshpar.parallel_cross_entropy(model(x), y, tp_mesh=dims.tp_mesh).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_sync.finish()
        optimizer.step()
        if is_logger:
            tokens = step * args.batch * args.seq
            print(
                f"step {step:3d} | loss {loss.item():.4f} | ppl {math.exp(loss.item()):8.2f} | "
                f"{tokens / (time.perf_counter() - start):8.0f} tokens/s"
            )
    meshpar.destroy_parallel(destroy_process_group=True)


if __name__ == "__main__":
    main()
