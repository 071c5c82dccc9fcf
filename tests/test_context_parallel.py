"""Context-parallel attention (meshpar.context_parallel) against one device's attention over the whole sequence:
outputs and the grads of q, k and v for the local tokens (load-balanced, and NxD's contiguous layout), at cp 2 and 4,
both implementations, with
causal, sliding-window, packed-document and key-padding masks and grouped-query heads; the collectives pinned; bad
lengths refused."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from meshpar.context_parallel import AttentionMask, context_parallel_attention, local_positions, shard_sequence
from meshpar.testing import run_distributed
from meshpar.testing.dispatch import AtenOps

B, H, KV, S, D = 2, 4, 2, 16, 8


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=generator)
    k = torch.randn(B, KV, S, D, generator=generator)
    v = torch.randn(B, KV, S, D, generator=generator)
    cotangent = torch.randn(B, H, S, D, generator=generator)
    return q, k, v, cotangent


def _mask(kind: str) -> AttentionMask:
    if kind == "causal":
        return AttentionMask()
    if kind == "sliding":
        return AttentionMask(sliding_window=5)
    if kind == "short_window":  # narrower than a chunk at cp 4: the ring skips whole steps
        return AttentionMask(sliding_window=2)
    if kind == "documents":  # three documents packed per row, boundaries not on chunk edges
        ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 3 + [1] * 3 + [2] * 10])
        return AttentionMask(document_ids=ids)
    if kind == "padding":  # right padding, uneven across rows and chunks
        padding = torch.ones(B, S, dtype=torch.bool)
        padding[0, 11:] = False
        padding[1, 14:] = False
        return AttentionMask(key_padding=padding)
    if kind == "bidirectional":
        return AttentionMask(causal=False)
    raise ValueError(kind)


def _dense(kind: str) -> tuple[torch.Tensor, ...]:
    q, k, v, cotangent = _inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    allow = _mask(kind).allowed(torch.arange(S), torch.arange(S))
    rep = H // KV
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=allow)
    (out * cotangent).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def cp_case(kind: str, implementation: str, layout: str = "balanced") -> None:
    import torch.distributed as dist

    from meshpar._compat import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    q, k, v, cotangent = _inputs()
    mine = [shard_sequence(t, 2, mesh, layout).clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*mine, mesh, _mask(kind), implementation=implementation, layout=layout)
    (out * shard_sequence(cotangent, 2, mesh, layout)).sum().backward()
    positions = local_positions(S, mesh.size(), mesh.get_local_rank(), layout=layout)
    want = _dense(kind)
    torch.testing.assert_close(out, want[0][:, :, positions], atol=1e-5, rtol=1e-5)
    for name, got, dense_grad in zip("qkv", (t.grad for t in mine), want[1:], strict=True):
        torch.testing.assert_close(got, dense_grad[:, :, positions], atol=1e-5, rtol=1e-5, msg=f"grad of {name}")


@pytest.mark.parametrize("implementation", ["all_gather", "ring"])
@pytest.mark.parametrize("kind", ["causal", "sliding", "short_window", "documents", "padding", "bidirectional"])
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_attention_matches_one_device(cp: int, kind: str, implementation: str) -> None:
    run_distributed(cp_case, cp, kind, implementation)


@pytest.mark.parametrize("implementation", ["all_gather", "ring"])
@pytest.mark.parametrize("kind", ["causal", "short_window", "documents", "bidirectional"])
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_contiguous_layout_matches_one_device(cp: int, kind: str, implementation: str) -> None:
    """NxD's layout (rank r holds the r-th contiguous 1 / cp of the sequence): under causal masks the ring's steps
    against later ranks compute nothing."""
    run_distributed(cp_case, cp, kind, implementation, "contiguous")


def collectives_case(implementation: str) -> dict[str, int]:
    import torch.distributed as dist

    from meshpar._compat import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    q, k, v, _ = _inputs()
    mine = [shard_sequence(t, 2, mesh).clone().requires_grad_() for t in (q, k, v)]
    with AtenOps() as forward:
        out = context_parallel_attention(*mine, mesh, AttentionMask(), implementation=implementation)
    with AtenOps() as backward:
        out.sum().backward()
    return {"forward": dict(forward.collective_names), "backward": dict(backward.collective_names)}


def test_collectives_are_pinned() -> None:
    """Ring at cp=4: cp - 1 = 3 exchanges of the packed K/V forward, 3 of their grads backward (each a send and a
    receive); all-gather: one all-gather each of K and V forward, one reduce-scatter each backward."""
    exchanges = {"send": 3, "recv_": 3}
    ring = run_distributed(collectives_case, 4, "ring")
    assert all(r == {"forward": exchanges, "backward": exchanges} for r in ring), ring
    gathered = run_distributed(collectives_case, 4, "all_gather")
    expected = {"forward": {"allgather_": 2}, "backward": {"reduce_scatter_": 2}}
    assert all(r == expected for r in gathered), gathered


def overlap_case() -> list[str]:
    import torch.distributed as dist

    from meshpar import context_parallel as module
    from meshpar._compat import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    events: list[str] = []
    shift_init, shift_wait = module._Shift.__init__, module._Shift.wait
    forward, backward = module._step_forward, module._step_backward

    def logged(name: str, fn: Callable) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            events.append(name)
            return fn(*args, **kwargs)

        return call

    module._Shift.__init__, module._Shift.wait = logged("send", shift_init), logged("wait", shift_wait)
    module._step_forward, module._step_backward = logged("attend", forward), logged("grads", backward)
    try:
        q, k, v, _ = _inputs()
        mine = [shard_sequence(t, 2, mesh).clone().requires_grad_() for t in (q, k, v)]
        context_parallel_attention(*mine, mesh, AttentionMask(), implementation="ring").sum().backward()
    finally:
        module._Shift.__init__, module._Shift.wait = shift_init, shift_wait
        module._step_forward, module._step_backward = forward, backward
    return events


def test_the_ring_overlaps_each_transfer_with_a_steps_compute() -> None:
    """Ring at cp=4: every exchange is started before a step's attention (forward) or grads (backward) and waited
    for after it, so the transfer runs while the step computes."""
    per_step = ["send", "attend", "wait"] * 3 + ["attend"]
    backward = ["grads", "send"] + ["grads", "wait", "send"] * 2 + ["grads", "wait"]
    assert all(events == per_step + backward for events in run_distributed(overlap_case, 4)), per_step + backward


def test_a_length_that_does_not_split_into_2cp_chunks_is_refused() -> None:
    with pytest.raises(ValueError, match="pad the sequences to a multiple of 8"):
        local_positions(20, 4, 0)
    with pytest.raises(ValueError, match="pad the sequences to a multiple of 8"):
        local_positions(20, 4, 0, layout="contiguous")
    with pytest.raises(ValueError, match="unknown context-parallel layout 'striped'"):
        local_positions(16, 4, 0, layout="striped")


def _structural_masks() -> list[AttentionMask]:
    ids = torch.tensor([[0] * 9 + [1] * 15, [0] * 20 + [1] * 4])  # 24 positions: documents and padding, two rows
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[1, 17:] = False
    masks = [AttentionMask(causal=causal, sliding_window=w) for causal in (True, False) for w in (None, 1, 2, 3, 5, 9)]
    return [*masks, AttentionMask(document_ids=ids), AttentionMask(sliding_window=4, key_padding=padding)]


@pytest.mark.parametrize("layout", ["balanced", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_the_ring_computes_exactly_the_pieces_that_hold_permitted_pairs(cp: int, layout: str) -> None:
    """Every ring step's pieces against the mask evaluated in full: they do not overlap, they cover every permitted
    pair, a piece run without a mask permits all its pairs ("full") or exactly key <= query ("causal")."""
    from meshpar.context_parallel import _step_pieces

    seq_len = 24
    chunk = seq_len // (2 * cp)
    for mask in _structural_masks():
        for rank in range(cp):
            for source in range(cp):
                q_pos, k_pos = (local_positions(seq_len, cp, r, layout=layout) for r in (rank, source))
                allow = mask.allowed(q_pos, k_pos)
                covered = torch.zeros(2 * chunk, 2 * chunk, dtype=torch.int64)
                for piece in _step_pieces(mask, cp, rank, source, chunk, layout):
                    covered[piece.rows, piece.cols] += 1
                    block = allow[..., piece.rows, piece.cols]
                    if piece.kind == "full":
                        assert block.all(), (mask, rank, source, piece)
                    elif piece.kind == "causal":
                        assert block.shape[-1] == block.shape[-2], piece
                        assert torch.equal(block, torch.ones_like(block).tril()), (mask, rank, source, piece)
                assert covered.max() <= 1, (mask, rank, source)
                assert not (allow & (covered == 0)).any(), (mask, rank, source)


@pytest.mark.parametrize("layout", ["balanced", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_the_all_gather_computes_each_query_chunk_over_the_span_it_may_see(cp: int, layout: str) -> None:
    """The all-gather's pieces against the mask evaluated in full: one per query row, covering every permitted pair,
    "full" ones (no mask) permitting every pair, "none" rows permitted no key."""
    from meshpar.context_parallel import _gathered_pieces

    seq_len = 24
    chunk = seq_len // (2 * cp)
    for mask in _structural_masks():
        for rank in range(cp):
            allow = mask.allowed(local_positions(seq_len, cp, rank, layout=layout), torch.arange(seq_len))
            covered = torch.zeros(2 * chunk, seq_len, dtype=torch.int64)
            rows = torch.zeros(2 * chunk, dtype=torch.int64)
            for piece in _gathered_pieces(mask, cp, rank, chunk, layout):
                rows[piece.rows] += 1
                if piece.kind == "none":
                    assert not allow[..., piece.rows, :].any(), (mask, rank, piece)
                    continue
                covered[piece.rows, piece.cols] += 1
                if piece.kind == "full":
                    assert allow[..., piece.rows, piece.cols].all(), (mask, rank, piece)
            assert torch.equal(rows, torch.ones_like(rows)), (mask, rank)
            assert not (allow & (covered == 0)).any(), (mask, rank)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_attention_computes_about_half_of_the_pairs(cp: int) -> None:
    """Under causal attention (load-balanced chunks) a ring step against another rank's block computes half of it,
    and the step against its own block three quarters, with no mask at all: (2 cp + 1) chunk^2 pairs per rank, of
    4 cp; the all-gather computes as many."""
    from meshpar.context_parallel import _gathered_pieces, _step_pieces

    chunk = 3
    for rank in range(cp):
        pieces = [p for source in range(cp) for p in _step_pieces(AttentionMask(), cp, rank, source, chunk)]
        area = sum((p.rows.stop - p.rows.start) * (p.cols.stop - p.cols.start) for p in pieces)
        assert area == (2 * cp + 1) * chunk**2
        assert {p.kind for p in pieces} == {"full", "causal"}
        # the all-gather: each query chunk against the keys up to its own chunk, the same (2 cp + 1) chunk^2 pairs
        gathered = _gathered_pieces(AttentionMask(), cp, rank, chunk)
        assert sum((p.rows.stop - p.rows.start) * (p.cols.stop - p.cols.start) for p in gathered) == area


def test_load_balanced_layout() -> None:
    """Rank r holds chunks r and 2cp-1-r: every rank the same amount of causal work."""
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([local_positions(16, 4, r) for r in range(4)]).tolist()) == list(range(16))


def test_contiguous_layout() -> None:
    """Rank r holds the r-th contiguous 1 / cp of the sequence (NxD's): under causal masks rank r's ring steps
    compute the whole blocks of the ranks before it, three quarters of its own, nothing of the ranks after it."""
    from meshpar.context_parallel import _step_pieces

    assert local_positions(8, 2, 0, layout="contiguous").tolist() == [0, 1, 2, 3]
    assert local_positions(8, 2, 1, layout="contiguous").tolist() == [4, 5, 6, 7]
    chunk, cp = 3, 4
    for rank in range(cp):
        for source in range(cp):
            pieces = _step_pieces(AttentionMask(), cp, rank, source, chunk, "contiguous")
            area = sum((p.rows.stop - p.rows.start) * (p.cols.stop - p.cols.start) for p in pieces)
            assert area == (0 if source > rank else 3 * chunk**2 if source == rank else 4 * chunk**2)


def _matches_one_device(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cotangent: torch.Tensor,
    dense_attention: Callable[..., torch.Tensor],
    implementation: str,
    **options: float,
) -> None:
    """Causal context-parallel attention of this rank's tokens against ``dense_attention(q, k, v)`` over the whole
    sequence on one device: the output and the grads of q, k and v."""
    import torch.distributed as dist

    from meshpar._compat import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    mine = [shard_sequence(t, 2, mesh).clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*mine, mesh, AttentionMask(), implementation=implementation, **options)
    (out * shard_sequence(cotangent, 2, mesh)).sum().backward()
    dense = [t.clone().requires_grad_() for t in (q, k, v)]
    want = dense_attention(*dense)
    (want * cotangent).sum().backward()
    positions = local_positions(S, mesh.size(), mesh.get_local_rank())
    torch.testing.assert_close(out, want.detach()[:, :, positions], atol=1e-5, rtol=1e-5)
    for name, got, full in zip("qkv", (t.grad for t in mine), (t.grad for t in dense), strict=True):
        torch.testing.assert_close(got, full[:, :, positions], atol=1e-5, rtol=1e-5, msg=f"grad of {name}")


def softcap_case(implementation: str) -> None:
    """Gemma-2's logit soft-capping through both implementations, against one device's capped attention."""
    generator = torch.Generator().manual_seed(3)  # 3 rows and one key/value head (batch and heads told apart)
    q, cotangent = torch.randn(3, H, S, D, generator=generator), torch.randn(3, H, S, D, generator=generator)
    k, v = torch.randn(3, 1, S, D, generator=generator), torch.randn(3, 1, S, D, generator=generator)

    def capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ k.repeat_interleave(H, 1).transpose(-1, -2) * D**-0.5
        causal = AttentionMask().allowed(torch.arange(S), torch.arange(S))
        scores = (torch.tanh(scores / 2.0) * 2.0).masked_fill(~causal, float("-inf"))
        return torch.softmax(scores, -1) @ v.repeat_interleave(H, 1)

    _matches_one_device(q, k, v, cotangent, capped, implementation, softcap=2.0)


@pytest.mark.parametrize("implementation", ["all_gather", "ring"])
def test_soft_capped_attention_matches_one_device(implementation: str) -> None:
    run_distributed(softcap_case, 2, implementation)


def narrow_values_case(implementation: str) -> None:
    """Latent attention's values are narrower than its queries and keys (DeepSeek: 16 and 8 features here): both
    implementations against one device's attention, the ring carrying K and V as one block."""
    generator = torch.Generator().manual_seed(5)
    q, k = torch.randn(B, H, S, 2 * D, generator=generator), torch.randn(B, KV, S, 2 * D, generator=generator)
    v, cotangent = torch.randn(B, KV, S, D, generator=generator), torch.randn(B, H, S, D, generator=generator)
    rep = H // KV

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
        )

    _matches_one_device(q, k, v, cotangent, causal, implementation)


@pytest.mark.parametrize("implementation", ["all_gather", "ring"])
def test_values_narrower_than_keys_match_one_device(implementation: str) -> None:
    run_distributed(narrow_values_case, 2, implementation)


def saved_case(seq: int, softcap: float | None) -> list[tuple[int, ...]]:
    import torch.distributed as dist

    from meshpar._compat import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    local = seq // mesh.size()
    q = torch.randn(B, H, local, D, requires_grad=True)
    k, v = (torch.randn(B, KV, local, D, requires_grad=True) for _ in range(2))
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = context_parallel_attention(q, k, v, mesh, AttentionMask(), implementation="ring", softcap=softcap)
    out.sum().backward()
    return shapes


@pytest.mark.parametrize("softcap", [None, 2.0])  # torch's fused kernels; the plain matmuls of soft-capping
def test_the_ring_keeps_nothing_of_size_queries_by_keys_for_backward(softcap: float | None) -> None:
    """What the ring saves for backward grows with the sequence, not with its square: no saved tensor ends in a
    (queries, keys) pair of dims, and doubling the sequence doubles the saved elements."""
    short, long = (run_distributed(saved_case, 2, seq, softcap)[0] for seq in (64, 128))
    for shapes, local in ((short, 32), (long, 64)):
        assert shapes and not any(shape[-2:] == (local, local) for shape in shapes), shapes
    assert sum(math.prod(s) for s in long) == 2 * sum(math.prod(s) for s in short)


def sinks_case(kind: str, implementation: str) -> None:
    """Attention sinks (GPT-OSS's ``s_aux``: one logit per head in every query's softmax, its value zero) through
    both implementations against one device's eager attention with the sinks: the output and the grads of q, k, v
    and the sinks. Left padding leaves the first queries of a row without a permitted key: output 0, as dense."""
    import torch.distributed as dist

    from meshpar._compat import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    q, k, v, cotangent = _inputs()
    sinks = torch.linspace(-1.0, 2.0, H)
    mask = _mask(kind) if kind != "left_padding" else AttentionMask(key_padding=torch.arange(S).expand(B, S) >= 3)
    mine = [shard_sequence(t, 2, mesh).clone().requires_grad_() for t in (q, k, v)]
    my_sinks = sinks.clone().requires_grad_()
    out = context_parallel_attention(*mine, mesh, mask, implementation=implementation, sinks=my_sinks)
    (out * shard_sequence(cotangent, 2, mesh)).sum().backward()
    dense = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    rep = H // KV
    scores = dense[0] @ dense[1].repeat_interleave(rep, 1).transpose(-1, -2) * D**-0.5
    scores = scores.masked_fill(~mask.allowed(torch.arange(S), torch.arange(S)), float("-inf"))
    logits = torch.cat([scores, dense[3].view(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
    want = torch.softmax(logits, dim=-1)[..., :-1] @ dense[2].repeat_interleave(rep, 1)
    (want * cotangent).sum().backward()
    positions = local_positions(S, mesh.size(), mesh.get_local_rank())
    torch.testing.assert_close(out, want.detach()[:, :, positions], atol=1e-5, rtol=1e-5)
    for name, got, full in zip("qkv", (t.grad for t in mine), dense[:3], strict=True):
        torch.testing.assert_close(got, full.grad[:, :, positions], atol=1e-5, rtol=1e-5, msg=f"grad of {name}")
    dist.all_reduce(my_sinks.grad)  # each cp rank's share: its queries' part of the sum
    torch.testing.assert_close(my_sinks.grad, dense[3].grad, atol=1e-5, rtol=1e-5, msg="grad of the sinks")


@pytest.mark.parametrize("implementation", ["all_gather", "ring"])
@pytest.mark.parametrize("kind", ["causal", "sliding", "documents", "left_padding"])
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_attention_sinks_match_one_device(cp: int, kind: str, implementation: str) -> None:
    run_distributed(sinks_case, cp, kind, implementation)
