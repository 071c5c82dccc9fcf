"""torch.compile(fullgraph=True) of a block that uses meshpar's ops matches eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshpar import ops

pytestmark = pytest.mark.slow  # not in make test-fast: torch.compile


class FusedBlock(nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm_w = nn.Parameter(torch.randn(hidden))
        self.ln_w, self.ln_b = nn.Parameter(torch.randn(hidden)), nn.Parameter(torch.randn(hidden))
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.gate_up = nn.Linear(hidden, 4 * hidden)
        self.fc = nn.Linear(hidden, hidden, bias=False)
        self.fc_bias = nn.Parameter(torch.randn(hidden))
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = ops.rms_norm(x, self.norm_w)
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        angles = torch.arange(s, dtype=x.dtype, device=x.device).unsqueeze(-1) * torch.linspace(
            0.1, 1.0, self.head_dim // 2, device=x.device
        )
        q = ops.rotary_embedding(q, angles.cos(), angles.sin())
        k = ops.rotary_embedding(k, angles.cos(), angles.sin(), interleaved=True)
        scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1)
        probs = ops.scaled_upper_triang_masked_softmax(scores, self.head_dim**-0.5)
        x = x + (probs @ v.transpose(1, 2)).transpose(1, 2).reshape(b, s, -1)
        h = ops.layer_norm(x, self.ln_w, self.ln_b)
        gate, up = self.gate_up(h).chunk(2, -1)
        x = x + self.down(ops.swiglu(gate, up))
        return ops.bias_gelu(self.fc(x), self.fc_bias)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_compiled_block_matches_eager() -> None:
    """On CPU the ops run their torch references; on CUDA inductor sees the Triton kernels of the triton_ops."""
    torch.manual_seed(0)
    block = FusedBlock().to(DEVICE)
    x = torch.randn(2, 6, 32, device=DEVICE, requires_grad=True)
    expected = block(x)
    expected.sum().backward()
    eager_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    actual = compiled(x)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    actual.sum().backward()
    for p, want in zip(block.parameters(), eager_grads, strict=True):
        torch.testing.assert_close(p.grad, want, atol=1e-4, rtol=1e-4)
