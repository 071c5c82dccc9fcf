"""NxD's attention entry points (``kernels.flash_attn.nki_flash_attn_func``, ``kernels.ring_attention_kernel.
nki_ring_attn_func``, what its Llama and DBRX training models call) against attention written out in float64: both of
NxD's input layouts, grouped key/value heads, causal or not, a given scale; outputs and the grads of q, k and v. The
ring checks the rank and ring it is handed against this rank's (``get_context_model_parallel_src_tgt_pairs``); at
context-parallel size 2 and 4 (with tp2 beside it) it attends each rank's contiguous piece of the sequence to the whole
sequence's keys, equal to the attention written out over the whole sequence; what it cannot do is refused."""

from __future__ import annotations

import pytest
import torch

from meshpar.compat.nxd.kernels.flash_attn import nki_flash_attn_func
from meshpar.testing import run_distributed

B, HEADS, KV_HEADS, S, D = 2, 4, 2, 10, 8  # a length Neuron's kernels would refuse (not a multiple of 2048)


def _inputs(kv_heads: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    q, cotangent = (torch.randn(B, HEADS, S, D, generator=generator) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, S, D, generator=generator) for _ in range(2))
    return q, k, v, cotangent


def _written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("transpose_nki_inputs", [True, False])
@pytest.mark.parametrize("kv_heads", [HEADS, KV_HEADS])
@pytest.mark.parametrize(("causal", "scale"), [(True, None), (False, 0.3)])
def test_flash_attention_in_nxds_layouts_matches_attention_written_out(
    transpose_nki_inputs: bool, kv_heads: int, causal: bool, scale: float | None
) -> None:
    q, k, v, cotangent = _inputs(kv_heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    given = [t.transpose(-1, -2) if transpose_nki_inputs else t for t in leaves]  # NxD's [b, h, d, s] when True
    out = nki_flash_attn_func(*given, softmax_scale=scale, causal=causal, transpose_nki_inputs=transpose_nki_inputs)
    (out * cotangent).sum().backward()
    dense = [t.double().requires_grad_() for t in (q, k, v)]
    want = _written_out(*dense, causal, D**-0.5 if scale is None else scale)
    (want * cotangent.double()).sum().backward()
    assert out.shape == (B, HEADS, S, D)
    torch.testing.assert_close(out.double(), want.detach(), atol=1e-5, rtol=1e-5)
    for name, got, ref in zip("qkv", leaves, dense, strict=True):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-5, rtol=1e-5, msg=f"grad of {name}")


def test_a_dropout_seed_for_neurons_generator_is_refused() -> None:
    q, k, v, _ = _inputs(HEADS)
    with pytest.raises(NotImplementedError, match="Neuron's RNG"):
        nki_flash_attn_func(q, k, v, dropout_p=0.1, seed=torch.tensor([3]), transpose_nki_inputs=False)


def ring_case() -> list[list[int]]:
    import torch.distributed as dist

    from meshpar.compat.nxd.kernels.ring_attention_kernel import nki_ring_attn_func
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    pairs = parallel_state.get_context_model_parallel_src_tgt_pairs()
    q, k, v, _ = _inputs(KV_HEADS)
    out = nki_ring_attn_func(q, k, v, dist.get_rank(), pairs)
    torch.testing.assert_close(out, nki_flash_attn_func(q, k, v, transpose_nki_inputs=False))
    for rank_id, ring in ((1 - dist.get_rank(), pairs), (dist.get_rank(), [[0, 1], [1, 0]])):
        with pytest.raises(ValueError, match="context-parallel ring is"):
            nki_ring_attn_func(q, k, v, rank_id, ring)
    return pairs


def test_ring_attention_at_context_parallel_size_1_is_the_local_attention_and_checks_its_ring() -> None:
    assert run_distributed(ring_case, 2) == [[[0, 0]], [[1, 1]]]


def ring_cp_case(tp: int, causal: bool) -> list[list[int]]:
    """Each cp rank holds its contiguous piece of q, k, v (NxD's ``get_batch_on_this_context_parallel_rank``)."""
    import torch.distributed as dist

    from meshpar.compat.nxd.kernels.ring_attention_kernel import nki_ring_attn_func
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=4 // tp)
    cp, cp_rank = parallel_state.get_context_model_parallel_size(), parallel_state.get_context_model_parallel_rank()
    generator = torch.Generator().manual_seed(0)
    seq = 4 * cp
    q, cotangent = (torch.randn(B, HEADS, seq, D, generator=generator) for _ in range(2))
    k, v = (torch.randn(B, KV_HEADS, seq, D, generator=generator) for _ in range(2))
    piece = slice(cp_rank * 4, cp_rank * 4 + 4)
    leaves = [t[:, :, piece].clone().requires_grad_() for t in (q, k, v)]
    pairs = parallel_state.get_context_model_parallel_src_tgt_pairs()
    out = nki_ring_attn_func(*leaves, dist.get_rank(), pairs, causal=causal, softmax_scale=0.4)
    (out * cotangent[:, :, piece]).sum().backward()
    dense = [t.double().requires_grad_() for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in dense[1:])
    scores = dense[0] @ kk.transpose(-1, -2) * 0.4
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(scores, -1) @ vv
    (want * cotangent.double()).sum().backward()
    torch.testing.assert_close(out.double(), want[:, :, piece].detach(), atol=1e-5, rtol=1e-5)
    for name, got, ref in zip("qkv", leaves, dense, strict=True):
        torch.testing.assert_close(got.grad.double(), ref.grad[:, :, piece], atol=1e-5, rtol=1e-5, msg=name)
    with pytest.raises(NotImplementedError, match="dropout"):
        nki_ring_attn_func(*leaves, dist.get_rank(), pairs, dropout_p=0.1)
    odd = [t[:, :, :3] for t in leaves]
    with pytest.raises(ValueError, match=f"multiple of 2 x cp = {2 * cp}"):
        nki_ring_attn_func(*odd, dist.get_rank(), pairs)
    # NxD's cp reduction: over the group it is given (its grads pass the cp group), else over tp as NxD's default
    from meshpar.compat.nxd.parallel_layers.mappings import reduce_from_context_model_parallel_region

    mine = torch.tensor([float(dist.get_rank())])
    cp_sum = reduce_from_context_model_parallel_region(mine.clone(), parallel_state.get_context_model_parallel_group())
    tp_sum = reduce_from_context_model_parallel_region(mine.clone())  # both sum in place, as NxD's
    groups = {"cp": parallel_state.get_context_model_parallel_replica_groups(),
              "tp": parallel_state.get_tensor_model_parallel_replica_groups()}  # fmt: skip
    for name, got in (("cp", cp_sum), ("tp", tp_sum)):
        (group,) = [g for g in groups[name] if dist.get_rank() in g]
        assert got.item() == sum(group), (name, got, group)
    assert parallel_state.rmsg("hello").endswith(f"_cp{cp_rank}] hello")
    return pairs


@pytest.mark.parametrize(("tp", "causal"), [(1, True), (2, True), (2, False)])
def test_ring_attention_over_context_parallel_ranks_matches_attention_written_out(tp: int, causal: bool) -> None:
    rings = run_distributed(ring_cp_case, 4, tp, causal)
    if tp == 1:  # one cp group of all four ranks, each sending to the next
        assert all(ring == [[0, 1], [1, 2], [2, 3], [3, 0]] for ring in rings), rings
    else:  # meshpar's mesh puts tp fastest: the cp groups are {0, 2} and {1, 3}
        assert rings == [[[0, 2], [2, 0]], [[1, 3], [3, 1]]] * 2, rings
