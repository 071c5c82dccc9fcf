"""Small dense models shared by the tests, with their tensor-parallel plans."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshpar.tensor_parallel import ColumnParallel, RowParallel, SequenceParallelNorm, VocabParallel


class Block(nn.Module):
    """A pre-norm transformer block with a Megatron-layout fused QKV projection.

    ``qkv`` produces ``[heads, 3, head_dim]`` along its output features, so splitting its rows over tp gives each
    rank whole heads with their own q, k and v. The block infers the local head count from the local width, so the
    same code runs dense and sharded.
    """

    def __init__(self, hidden: int, heads: int, ffn: int, bias: bool = True) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out = nn.Linear(hidden, hidden, bias=bias)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))
        b, s, width = qkv.shape
        heads = width // (3 * self.head_dim)
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, heads * self.head_dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class TinyTransformer(nn.Module):
    def __init__(self, hidden: int = 16, heads: int = 4, ffn: int = 24, layers: int = 2, bias: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, heads, ffn, bias) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def block_plan(
    sequence_parallel: bool = False, prefix: str = "layers.*.", heads: int = 4, regather: bool = False
) -> dict:
    plan = {
        f"{prefix}qkv": ColumnParallel(sequence_parallel=sequence_parallel, num_heads=heads, regather_input=regather),
        f"{prefix}out": RowParallel(sequence_parallel=sequence_parallel),
        f"{prefix}fc1": ColumnParallel(sequence_parallel=sequence_parallel, regather_input=regather),
        f"{prefix}fc2": RowParallel(sequence_parallel=sequence_parallel),
    }
    if sequence_parallel:
        plan[f"{prefix}ln1"] = SequenceParallelNorm()
        plan[f"{prefix}ln2"] = SequenceParallelNorm()
    return plan


class PipeGPT(nn.Module):
    """A tiny GPT following the pipeline contract: top-level pieces may be ``None`` on a stage."""

    def __init__(self, vocab: int = 32, hidden: int = 16, heads: int = 4, layers: int = 4, seq: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, 2 * hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            x = layer(x)
        if self.ln_f is not None:
            x = self.head(self.ln_f(x))
        return x


def pipe_gpt_plan() -> dict:
    return {
        "tok": VocabParallel(),
        **block_plan(),
        "head": ColumnParallel(gather_output=True),
    }


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
