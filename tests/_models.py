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


class TanhLayer(nn.Module):
    """A pipeline's repeated layer in miniature (what ``transformer_layer_cls`` names)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h))


class TiedLM(nn.Module):
    """A GPT-2-shaped model in miniature: the LM head is the input embedding (one parameter under two names); with
    ``share_layers`` the first and third layers also share their projection (under a virtual pipeline two chunks of
    one rank then hold copies). Given ``labels``, ``forward`` returns the loss (a traced pipeline's usage); a stage
    split by structure lacks the other stages' pieces (``None``) and passes its input on."""

    def __init__(self, width: int, vocab: int, share_layers: bool = False, seed: int = 7) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(TanhLayer(width) for _ in range(4))
        if share_layers:
            self.layers[2].linear.weight = self.layers[0].linear.weight
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(ids) if self.embed is not None else ids
        for layer in self.layers:
            h = layer(h)
        if self.head is None:
            return h
        logits = self.head(h)
        return logits if labels is None else token_loss(logits, labels)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, **_: torch.Tensor) -> torch.Tensor:
    """Cross entropy over every token (extra microbatch inputs ignored: a pipeline's ``loss_fn``)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
