"""The fused ring step (meshpar._block_attention) against autograd through one device's attention: the keys split
into blocks, each block's output and log-sum-exp from the fused kernel, merged as the ring merges them, and each
block's backward given the merged output and log-sum-exp; outputs and q, k, v grads equal the whole attention's.
Keys wider and narrower than values, grouped heads repeated, queries with no key in a block or none at all; on CPU
and, where there is one, on CUDA (the memory-efficient kernel)."""

from __future__ import annotations

import pytest
import torch

from meshpar._block_attention import block_backward, block_forward, fused_supported

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allow: torch.Tensor, scale: float) -> torch.Tensor:
    scores = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(~allow, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a query with no key: output 0
    return probs @ v.double()


def _allow(batch: int, queries: int, keys: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    allow = torch.rand(batch, 1, queries, keys, generator=generator) > 0.5
    allow[0, 0, 2] = False  # no key anywhere
    allow[1, 0, 3, : keys // 2] = False  # no key in the first block
    allow[1, 0, 5, keys // 2 :] = False  # no key in the second block
    return allow.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dk", "dv"), [(16, 16), (24, 8), (8, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_merged_equal_one_attention(device: str, dk: int, dv: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    batch, heads, queries, keys, scale = 2, 3, 40, 48, 0.3  # lengths the CUDA kernel's alignments do not divide
    q, d_out = (torch.randn(batch, heads, queries, d, generator=generator) for d in (dk, dv))
    k, v = (torch.randn(batch, heads, keys, d, generator=generator) for d in (dk, dv))
    allow = _allow(batch, queries, keys, device)
    q, k, v, d_out = (t.to(device, dtype) for t in (q, k, v, d_out))
    assert fused_supported(q, None) and not fused_supported(q, 2.0)

    halves = [slice(0, keys // 2), slice(keys // 2, keys)]
    parts = [block_forward(q, k[:, :, h], v[:, :, h], allow[..., h], scale) for h in halves]
    total = torch.logsumexp(torch.stack([lse for _, lse in parts]), 0)
    total = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    merged = sum(torch.exp(lse - total) * out for out, lse in parts)
    grads = [block_backward(d_out, q, k[:, :, h], v[:, :, h], merged, total, allow[..., h], scale) for h in halves]

    ref = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    want = _dense(*ref, allow.cpu(), scale)
    want.backward(d_out.double().cpu())
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(merged.double().cpu(), want.detach(), **tol)
    got = {
        "q": sum(g[0] for g in grads),
        "k": torch.cat([g[1] for g in grads], 2),
        "v": torch.cat([g[2] for g in grads], 2),
    }
    for (name, grad), leaf in zip(got.items(), ref, strict=True):
        assert grad.dtype == torch.float32 and grad.shape == leaf.shape, name
        torch.testing.assert_close(grad.double().cpu(), leaf.grad, **tol, msg=f"grad of {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_without_a_mask_and_causal_on_the_diagonal(device: str, dtype: torch.dtype) -> None:
    """The maskless forms the ring uses where a block's structure is known: a block whose every key is permitted
    (``allow=None``) and a square block on the diagonal (``causal=True``), merged with a masked one, against causal
    attention over all the keys: keys 0..7 before the queries, keys 8..15 at the queries' own positions."""
    generator = torch.Generator().manual_seed(2)
    batch, heads, queries, dk, dv, scale = 2, 3, 8, 16, 8, 0.4
    q, d_out = (torch.randn(batch, heads, queries, d, generator=generator) for d in (dk, dv))
    k = torch.randn(batch, heads, 2 * queries, dk, generator=generator)
    v = torch.randn(batch, heads, 2 * queries, dv, generator=generator)
    q, k, v, d_out = (t.to(device, dtype) for t in (q, k, v, d_out))
    before, own = slice(0, queries), slice(queries, 2 * queries)
    parts = [block_forward(q, k[:, :, before], v[:, :, before], None, scale)]
    parts.append(block_forward(q, k[:, :, own], v[:, :, own], None, scale, causal=True))
    total = torch.logsumexp(torch.stack([lse for _, lse in parts]), 0)
    merged = sum(torch.exp(lse - total) * out for out, lse in parts)
    grads = [
        block_backward(d_out, q, k[:, :, before], v[:, :, before], merged, total, None, scale),
        block_backward(d_out, q, k[:, :, own], v[:, :, own], merged, total, None, scale, causal=True),
    ]

    allow = torch.ones(queries, 2 * queries, dtype=torch.bool).tril(queries)
    ref = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    want = _dense(*ref, allow, scale)
    want.backward(d_out.double().cpu())
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(merged.double().cpu(), want.detach(), **tol)
    got = [sum(g[0] for g in grads), torch.cat([g[1] for g in grads], 2), torch.cat([g[2] for g in grads], 2)]
    for name, grad, leaf in zip("qkv", got, ref, strict=True):
        torch.testing.assert_close(grad.double().cpu(), leaf.grad, **tol, msg=f"grad of {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["masked", "no mask", "causal"])
def test_the_cuda_kernels_calls_are_well_formed_on_meta_tensors(dtype: torch.dtype, form: str) -> None:
    """Meta tensors take the CUDA branch (the memory-efficient kernel's forward and backward, whose meta functions
    check their arguments): every form of block the ring runs gets outputs, log-sum-exps and grads of the right
    shapes in fp32 on machines without a GPU too (the numbers are checked on CUDA above, where there is one)."""
    batch, heads, queries, keys, dk, dv = 2, 3, 40, 40, 16, 8  # lengths the kernel's alignments do not divide
    q, k = (torch.empty(batch, heads, n, dk, device="meta", dtype=dtype) for n in (queries, keys))
    v, d_out = (torch.empty(batch, heads, n, dv, device="meta", dtype=dtype) for n in (keys, queries))
    allow = torch.empty(batch, 1, queries, keys, device="meta", dtype=torch.bool) if form == "masked" else None
    out, lse = block_forward(q, k, v, allow, 0.3, causal=form == "causal")
    grads = block_backward(d_out, q, k, v, out, lse, allow, 0.3, causal=form == "causal")
    assert (out.shape, lse.shape) == ((batch, heads, queries, dv), (batch, heads, queries, 1))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert {t.dtype for t in (out, lse, *grads)} == {torch.float32}
