"""Context parallelism: the sequence split over ``cp`` ranks *inside* attention (long-context training).

Every rank holds ``1 / cp`` of each sequence's tokens for the whole model: embeddings, norms, MLPs and the loss run on
them as they are. Attention is the one place tokens meet tokens: each rank's queries need every key and value they
may attend to, which the ranks exchange (:func:`context_parallel_attention`).

Causal attention makes early tokens cheap and late ones dear, so the sequence is cut into ``2 cp`` equal chunks and
rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (Megatron-Core's and torchtitan's load balancing): every rank then
has the same number of (query, key) pairs to compute::

    S = 8 tokens, cp = 2: chunks [0 1] [2 3] [4 5] [6 7]
    rank 0 holds chunks 0 and 3: tokens 0 1 6 7      rank 1 holds chunks 1 and 2: tokens 2 3 4 5

Two ways to bring the keys and values together, both exact (the same masks, the same softmax as one device):

- ``"all_gather"``: all-gather K and V over cp (backward: reduce-scatter their grads), then the attention of each
  local query chunk against the span of the sequence it may see (under causal masks, the keys up to its own chunk).
  One collective each way; K and V of the whole sequence held at once.
- ``"ring"``: K and V travel around the ring of cp ranks, ``cp - 1`` exchanges forward (and ``cp - 1`` of their
  grads backward), each started before a step's compute and waited for after it, so that the transfer overlaps it;
  each step attends to one rank's keys, and the partial results are merged by their log-sum-exp.
  Nothing of size ``queries x keys`` is kept for backward (flash attention's way): the forward keeps the K/V blocks
  it received, the merged output and the log-sum-exp of every query, and the backward recomputes each step's
  probabilities from them, one step at a time; each block's K/V grads travel back to their owner around the ring.
  Each step runs on torch's fused attention kernels (:mod:`meshpar._block_attention`: CPU flash attention, CUDA
  memory-efficient attention, which take a mask and give the log-sum-exp); soft-capped attention, which they cannot
  compute, runs the same steps as fp32 matmuls.

NxD cuts the sequence into ``cp`` contiguous pieces instead (rank ``r`` holds tokens ``r S / cp`` to
``(r + 1) S / cp``, so late ranks compute more); ``layout="contiguous"`` runs both implementations on that layout:
it is the same ``2 cp`` chunks, rank ``r`` holding chunks ``2 r`` and ``2 r + 1``.

Masks are given by what they mean, evaluated on global positions (:class:`AttentionMask`): causal, a sliding window,
documents packed into one row (a query attends to keys of its own document only), and key padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshpar._block_attention import block_backward, block_forward, fused_supported
from meshpar._compat import DeviceMesh

IMPLEMENTATIONS = ("all_gather", "ring")
LAYOUTS = ("balanced", "contiguous")  # which two of the 2 cp chunks a rank holds: see the module docstring


def check_sequence_length(seq_len: int, cp: int) -> None:
    """Both layouts cut the sequence into ``2 cp`` equal chunks: refused otherwise, with the remedy."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} cannot be split into 2 x cp = {2 * cp} equal chunks for context parallelism; "
            f"pad the sequences to a multiple of {2 * cp}"
        )


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}; one of {LAYOUTS}")


def rank_chunks(cp: int, rank: int, layout: str = "balanced") -> tuple[int, int]:
    """The two of the ``2 cp`` chunks rank ``rank`` holds, in its local order."""
    check_layout(layout)
    return (rank, 2 * cp - 1 - rank) if layout == "balanced" else (2 * rank, 2 * rank + 1)


def local_positions(
    seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu", layout: str = "balanced"
) -> torch.Tensor:
    """The global positions of the tokens rank ``rank`` holds, in its local order (:func:`rank_chunks`)."""
    check_sequence_length(seq_len, cp)
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in rank_chunks(cp, rank, layout)])


def shard_sequence(x: torch.Tensor, dim: int, mesh: DeviceMesh, layout: str = "balanced") -> torch.Tensor:
    """This cp rank's tokens of ``x`` along ``dim`` (a whole sequence on every rank in, the local tokens out). A
    plain index: the grad of the local tokens lands in their global places."""
    positions = local_positions(x.shape[dim], mesh.size(), mesh.get_local_rank(), x.device, layout)
    return x.index_select(dim, positions)


def _global_order(seq_len: int, cp: int, device: torch.device, layout: str) -> torch.Tensor:
    """Where each position sits in the concatenation of every rank's local tokens (rank order)."""
    gathered = torch.cat([local_positions(seq_len, cp, r, device, layout) for r in range(cp)])
    return torch.argsort(gathered)


class _GatherSequence(torch.autograd.Function):
    """All-gather the local tokens of every cp rank along ``dim`` into global order; backward: the grads of all
    ranks summed (reduce-scatter), each rank keeping its own tokens'. For keys and values, which every rank's
    queries use."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, mesh: DeviceMesh, layout: str) -> torch.Tensor:  # noqa: ANN001
        ctx.dim, ctx.mesh, ctx.layout = dim, mesh, layout
        cp = mesh.size()
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=mesh.get_group())
        whole = torch.cat(parts, dim)
        return whole.index_select(dim, _global_order(whole.shape[dim], cp, x.device, layout))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # noqa: ANN001
        cp, dim = ctx.mesh.size(), ctx.dim
        seq_len = grad.shape[dim]
        order = torch.cat([local_positions(seq_len, cp, r, grad.device, ctx.layout) for r in range(cp)])
        by_rank = grad.index_select(dim, order)
        parts = [p.contiguous() for p in by_rank.chunk(cp, dim)]
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts, group=ctx.mesh.get_group())
        return mine, None, None, None


def gather_sequence(x: torch.Tensor, dim: int, mesh: DeviceMesh, layout: str = "balanced") -> torch.Tensor:
    """Every cp rank's tokens of ``x`` along ``dim`` in global order (grads summed over cp and returned to their
    owners in backward)."""
    return _GatherSequence.apply(x, dim, mesh, layout)


class _Shift:
    """One ring exchange in flight: ``x`` sent to the rank ``step`` ahead on the ring, the one ``step`` behind's
    received. Started before the step's attention and waited for after it, so the transfer overlaps the compute
    (gloo moves it on its own threads, NCCL on its own stream)."""

    def __init__(self, x: torch.Tensor, mesh: DeviceMesh, step: int) -> None:
        group, cp, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        to = dist.get_global_rank(group, (rank + step) % cp)
        source = dist.get_global_rank(group, (rank - step) % cp)
        self._sent, self._received = x.contiguous(), torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, self._sent, to, group), dist.P2POp(dist.irecv, self._received, source, group)]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self._received


@dataclass
class AttentionMask:
    """Which keys a query may attend to, on global positions: ``causal`` (key position <= query position),
    ``sliding_window`` (query position - key position < window), ``document_ids`` (``[batch, seq]``, whole
    sequence: documents packed into one row attend within their own document) and ``key_padding`` (``[batch, seq]``
    bool, whole sequence: False for padding keys)."""

    causal: bool = True
    sliding_window: int | None = None
    document_ids: torch.Tensor | None = None
    key_padding: torch.Tensor | None = None

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """``[batch or 1, 1, queries, keys]`` bool."""
        allow = torch.ones(q_pos.numel(), k_pos.numel(), dtype=torch.bool, device=q_pos.device)
        distance = q_pos[:, None] - k_pos[None, :]
        if self.causal:
            allow &= distance >= 0
        if self.sliding_window is not None:
            allow &= distance < self.sliding_window
        allow = allow[None, None]
        if self.document_ids is not None:
            docs = self.document_ids
            allow = allow & (docs[:, q_pos][:, None, :, None] == docs[:, k_pos][:, None, None, :])
        if self.key_padding is not None:
            allow = allow & self.key_padding[:, k_pos][:, None, None, :].bool()
        return allow


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allow: torch.Tensor, scale: float, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over the keys ``allow`` permits: (output, log-sum-exp per query); a query with no
    permitted key gets output 0 and log-sum-exp -inf (so that merging ignores it). ``softcap``: Gemma-2's logit
    soft-capping, ``softcap * tanh(scores / softcap)``."""
    scores = _masked_scores(q.float(), k.float(), allow, scale, softcap)[0]
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite)  # exp(-inf) = 0 where masked
    return torch.matmul(probs, v.float()), lse


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``heads / kv_heads`` query heads."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    mask: AttentionMask,
    *,
    scale: float | None = None,
    implementation: str = "all_gather",
    softcap: float | None = None,
    layout: str = "balanced",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this cp rank's queries over the whole sequence's keys and values.

    ``q`` ``[batch, heads, local, head_dim]``, ``k`` / ``v`` ``[batch, kv_heads, local, head_dim]``: this rank's
    tokens in ``layout`` (:func:`local_positions`). Returns ``[batch, heads, local, head_dim]`` in ``q``'s dtype,
    equal to the rows of one device's attention over the whole sequence for these queries (computed in fp32).

    ``sinks`` (``[heads]``, GPT-OSS's attention sinks): one more logit per head in every query's softmax, whose
    value is zero; it only adds ``exp(sink)`` to the normaliser. The ring starts each query's running softmax from
    it; the all-gather scales each query's output by ``sigmoid(lse - sink)`` (its scores then kept, as the models'
    own eager attention keeps them)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown context-parallel attention {implementation!r}; one of {IMPLEMENTATIONS}")
    check_layout(layout)
    cp, rank = mesh.size(), mesh.get_local_rank()
    seq_len = q.shape[2] * cp
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_pos = local_positions(seq_len, cp, rank, q.device, layout)
    heads = q.shape[1]
    if implementation == "all_gather":
        k_all, v_all = gather_sequence(k, 2, mesh, layout), gather_sequence(v, 2, mesh, layout)
        k_all, v_all = _repeat_kv(k_all, heads), _repeat_kv(v_all, heads)
        k_pos = torch.arange(seq_len, device=q.device)
        parts = []
        for piece in _gathered_pieces(mask, cp, rank, q.shape[2] // 2, layout):
            qp, kp, vp = q[:, :, piece.rows], k_all[:, :, piece.cols], v_all[:, :, piece.cols]
            if piece.kind == "none":  # a query with no permitted key: 0, as the ring gives
                parts.append(q.new_zeros(*qp.shape[:-1], v.shape[-1]))
                continue
            if sinks is not None:  # each query's log-sum-exp is needed: the scores' own path
                out, lse = _attend(qp, kp, vp, mask.allowed(q_pos[piece.rows], k_pos[piece.cols]), scale, softcap)
                parts.append((out * torch.sigmoid(lse - sinks.float().view(1, -1, 1, 1))).to(q.dtype))
                continue
            if softcap is None and piece.kind == "full":  # torch's fused attention, no mask to build
                parts.append(torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, scale=scale))
                continue
            allow = mask.allowed(q_pos[piece.rows], k_pos[piece.cols])
            if softcap is not None:
                parts.append(_attend(qp, kp, vp, allow, scale, softcap)[0].to(q.dtype))
            else:  # torch's fused attention: no [queries, keys] scores kept for backward
                out = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, attn_mask=allow, scale=scale)
                parts.append(torch.nan_to_num(out, nan=0.0))  # a query with no permitted key: 0
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return _RingAttention.apply(q, k, v, mesh, mask, scale, softcap, layout, sinks)


def _masked_scores(
    q: torch.Tensor, k: torch.Tensor, allow: torch.Tensor, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scaled (and soft-capped) scores, -inf where ``allow`` forbids; and the soft-capping's ``tanh`` (for its
    derivative; ``None`` without soft-capping)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = capped * softcap
    return scores.masked_fill(~allow, float("-inf")), capped


def _attend_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    d_out: torch.Tensor,
    delta: torch.Tensor,
    lse: torch.Tensor,
    allow: torch.Tensor,
    ctx: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's q, k, v grads from its recomputed probabilities, normalised by the merged (finite) log-sum-exp
    ``lse``; ``delta`` is softmax's backward term per query. The plain path of soft-capped attention, in fp32."""
    scores, capped = _masked_scores(q, k, allow, ctx.scale, ctx.softcap)
    probs = torch.exp(scores - lse)
    dv = torch.matmul(probs.transpose(-1, -2), d_out)
    d_scores = probs * (torch.matmul(d_out, v.transpose(-1, -2)) - delta)
    if capped is not None:
        d_scores = d_scores * (1 - capped * capped)
    dq = torch.matmul(d_scores, k) * ctx.scale
    dk = torch.matmul(d_scores.transpose(-1, -2), q) * ctx.scale
    return dq, dk, dv


@dataclass(frozen=True)
class _Piece:
    """A rectangle of (query, key) pairs attention computes: local query ``rows``, key ``cols`` (of a ring step's
    block, or of the gathered sequence), and ``kind``: ``"full"`` (every pair permitted: no mask), ``"causal"`` (keys
    at the queries' own positions, key <= query: the kernels' causal flag, no mask), ``"masked"`` (a mask from
    :class:`AttentionMask`) or, among the all-gather's, ``"none"`` (rows with no permitted key: output 0)."""

    rows: slice
    cols: slice
    kind: str


def _sub_block_kind(mask: AttentionMask, query_chunk: int, key_chunk: int, chunk: int) -> str | None:
    """What the structure of ``mask`` (causal, sliding window) says of the pairs of two chunks of ``chunk``
    positions: ``None`` where none is permitted, else the :class:`_Piece` kind. Decided from the chunks' ranges of
    query - key distances, never from tensors: documents and padding only forbid more, so a block they touch is
    ``"masked"`` (evaluated in full), and only a block the structure forbids whole is skipped."""
    offset = (query_chunk - key_chunk) * chunk
    nearest, farthest = offset - (chunk - 1), offset + (chunk - 1)  # the distances of the block's pairs
    low = 0 if mask.causal else -float("inf")
    high = mask.sliding_window - 1 if mask.sliding_window is not None else float("inf")
    if max(nearest, low) > min(farthest, high):
        return None
    data_masked = mask.document_ids is not None or mask.key_padding is not None
    if not data_masked and nearest >= low and farthest <= high:
        return "full"
    if not data_masked and query_chunk == key_chunk and mask.causal and farthest <= high:
        return "causal"
    return "masked"


def _step_pieces(
    mask: AttentionMask, cp: int, rank: int, source: int, chunk: int, layout: str = "balanced"
) -> list[_Piece]:
    """The rectangles rank ``rank``'s queries compute against rank ``source``'s keys. Each holds two chunks, so a
    step is four sub-blocks; those no pair of which is permitted are skipped (under causal attention in the balanced
    layout half of every other rank's block: Megatron-Core's halving; in the contiguous one the whole block of every
    later rank), neighbours of one kind joined."""
    chunks = {"q": rank_chunks(cp, rank, layout), "k": rank_chunks(cp, source, layout)}
    halves = (slice(0, chunk), slice(chunk, 2 * chunk))
    both = slice(0, 2 * chunk)
    per_row = []
    for query_chunk in chunks["q"]:
        kinds = [_sub_block_kind(mask, query_chunk, key_chunk, chunk) for key_chunk in chunks["k"]]
        if kinds[0] == kinds[1] and kinds[0] in ("full", "masked"):
            per_row.append([(both, kinds[0])])
        else:
            per_row.append([(cols, kind) for cols, kind in zip(halves, kinds, strict=True) if kind is not None])
    if per_row[0] == per_row[1]:
        return [_Piece(both, cols, kind) for cols, kind in per_row[0]]
    return [_Piece(rows, cols, kind) for rows, row in zip(halves, per_row, strict=True) for cols, kind in row]


def _gathered_pieces(mask: AttentionMask, cp: int, rank: int, chunk: int, layout: str = "balanced") -> list[_Piece]:
    """What the all-gather computes: each of this rank's two query chunks against the span of the whole sequence's
    keys from its first to its last chunk holding a permitted pair (under causal masks the keys up to its own chunk,
    about half of the sequence on average), ``"full"`` where the structure permits every pair of the span (no mask),
    ``"none"`` for a chunk with no key at all; both chunks as one piece where their spans and kinds agree."""
    halves = (slice(0, chunk), slice(chunk, 2 * chunk))
    pieces = []
    for rows, query_chunk in zip(halves, rank_chunks(cp, rank, layout), strict=True):
        kinds = [_sub_block_kind(mask, query_chunk, key_chunk, chunk) for key_chunk in range(2 * cp)]
        live = [i for i, kind in enumerate(kinds) if kind is not None]
        if not live:
            pieces.append(_Piece(rows, slice(0, 0), "none"))
            continue
        span = kinds[live[0] : live[-1] + 1]
        kind = "full" if all(k == "full" for k in span) else "masked"
        pieces.append(_Piece(rows, slice(live[0] * chunk, (live[-1] + 1) * chunk), kind))
    if (pieces[0].cols, pieces[0].kind) == (pieces[1].cols, pieces[1].kind):
        return [_Piece(slice(0, 2 * chunk), pieces[0].cols, pieces[0].kind)]
    return pieces


def _merge(acc: torch.Tensor, acc_lse: torch.Tensor, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one piece's output and log-sum-exp into the running ones of its rows (flash attention's online softmax);
    rows with no key so far keep output 0 and log-sum-exp -inf."""
    old = acc_lse[:, :, rows]
    new = torch.logaddexp(old, lse)
    finite = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    acc[:, :, rows] = acc[:, :, rows] * torch.exp(old - finite) + out * torch.exp(lse - finite)
    acc_lse[:, :, rows] = new


def _step_forward(
    q: torch.Tensor, kv: torch.Tensor, acc: torch.Tensor, acc_lse: torch.Tensor, source: int, ctx: Any
) -> None:
    """One ring step: this rank's queries against the block ``kv`` of rank ``source``, merged into ``acc`` /
    ``acc_lse``."""
    k_block, v_block = (_repeat_kv(t, q.shape[1]) for t in kv.split(ctx.split, dim=-1))
    for piece in _step_pieces(ctx.mask, ctx.cp, ctx.rank, source, ctx.chunk, ctx.layout):
        qp, k, v = q[:, :, piece.rows], k_block[:, :, piece.cols], v_block[:, :, piece.cols]
        if ctx.fused:
            allow = ctx.allowed(piece, source) if piece.kind == "masked" else None
            out, lse = block_forward(qp, k, v, allow, ctx.scale, causal=piece.kind == "causal")
        else:
            out, lse = _attend(qp, k, v, ctx.allowed(piece, source), ctx.scale, ctx.softcap)
        _merge(acc, acc_lse, piece.rows, out, lse)


def _step_backward(
    q: torch.Tensor, kv: torch.Tensor, grads: dict[str, torch.Tensor], dq: torch.Tensor, source: int, ctx: Any
) -> torch.Tensor:
    """One ring step's grads: adds the queries' into ``dq`` and returns the block's K/V grads (per query head,
    ``[batch, heads, local, dk + dv]``, fp32). ``grads``: the merged output's grad, output and log-sum-exp (and, on
    the matmul path, their fp32 forms and softmax's backward term)."""
    k_block, v_block = (_repeat_kv(t, q.shape[1]) for t in kv.split(ctx.split, dim=-1))
    d_kv = torch.zeros(*k_block.shape[:-1], sum(ctx.split), dtype=torch.float32, device=q.device)
    for piece in _step_pieces(ctx.mask, ctx.cp, ctx.rank, source, ctx.chunk, ctx.layout):
        rows, cols = piece.rows, piece.cols
        k, v = k_block[:, :, cols], v_block[:, :, cols]
        if ctx.fused:
            allow = ctx.allowed(piece, source) if piece.kind == "masked" else None
            d_out, out, lse = (grads[name][:, :, rows] for name in ("d_out", "out", "lse"))
            dq_p, dk, dv = block_backward(
                d_out, q[:, :, rows], k, v, out, lse, allow, ctx.scale, causal=piece.kind == "causal"
            )
        else:
            d_out, delta, lse, qf = (grads[name][:, :, rows] for name in ("d_out_fp32", "delta", "lse", "q_fp32"))
            dq_p, dk, dv = _attend_backward(
                qf, k.float(), v.float(), d_out, delta, lse, ctx.allowed(piece, source), ctx
            )
        dq[:, :, rows] += dq_p
        d_kv[:, :, cols] += torch.cat([dk, dv], dim=-1)
    return d_kv


class _RingAttention(torch.autograd.Function):
    """The ring implementation (see the module docstring): forward keeps the received K/V blocks, the output and the
    log-sum-exp; backward recomputes each step's probabilities and sends each block's K/V grads back to its owner
    (``cp - 1`` exchanges, accumulated on the way: the grads for one owner's block meet on the ranks that held it).
    Each step computes only the rectangles of its block that hold permitted pairs (:func:`_step_pieces`)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mesh: DeviceMesh,
        mask: AttentionMask,
        scale: float,
        softcap: float | None,
        layout: str,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cp, rank = mesh.size(), mesh.get_local_rank()
        batch, heads, local, _ = q.shape
        ctx.mesh = mesh
        _RingAttention.keep(ctx, q, cp, rank, mask, scale, softcap, [k.shape[-1], v.shape[-1]], layout)
        # K and V travel as one block, joined along the feature dim (latent attention's V is narrower than its K)
        kv = torch.cat([k, v], dim=-1)
        acc = torch.zeros(batch, heads, local, v.shape[-1], dtype=torch.float32, device=q.device)
        acc_lse = torch.full((batch, heads, local, 1), float("-inf"), dtype=torch.float32, device=q.device)
        if sinks is not None:  # a sink is a key of value zero: the running softmax starts from its logit
            acc_lse.copy_(sinks.float().view(1, heads, 1, 1).expand_as(acc_lse))
        blocks = []
        for step in range(cp):
            incoming = _Shift(kv, mesh, +1) if step < cp - 1 else None  # the next block, while this one computes
            _step_forward(q, kv, acc, acc_lse, (rank - step) % cp, ctx)
            blocks.append(kv)
            if incoming is not None:
                kv = incoming.wait()
        total = torch.where(torch.isinf(acc_lse), torch.zeros_like(acc_lse), acc_lse)  # a query with no key: 0
        ctx.save_for_backward(q, acc, total, torch.stack(blocks), *([sinks] if sinks is not None else []))
        return acc.to(q.dtype)

    @staticmethod
    def keep(
        ctx: Any,
        q: torch.Tensor,
        cp: int,
        rank: int,
        mask: AttentionMask,
        scale: float,
        softcap: float | None,
        split: list[int],
        layout: str = "balanced",
    ) -> None:
        """Record on ``ctx`` what the steps of both passes read (:func:`_step_forward`, :func:`_step_backward`): the
        layout, the mask and how to evaluate it on a piece, which path computes."""
        seq_len = q.shape[2] * cp
        ctx.cp, ctx.rank, ctx.mask, ctx.scale, ctx.softcap, ctx.split = cp, rank, mask, scale, softcap, split
        ctx.chunk, ctx.fused, ctx.layout = q.shape[2] // 2, fused_supported(q, softcap), layout
        q_pos = local_positions(seq_len, cp, rank, q.device, layout)

        def allowed(piece: _Piece, source: int) -> torch.Tensor:
            k_pos = local_positions(seq_len, cp, source, q.device, layout)
            return mask.allowed(q_pos[piece.rows], k_pos[piece.cols])

        ctx.allowed = allowed

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, out, lse, blocks, *sinks = ctx.saved_tensors
        mesh, cp, rank = ctx.mesh, ctx.cp, ctx.rank
        batch, heads, local, _ = q.shape
        kv_heads = blocks.shape[2]  # blocks: [cp, batch, kv_heads, local, k_dim + v_dim]
        grads = {"d_out": grad_out, "out": out, "lse": lse}
        if not ctx.fused:  # the matmul path's fp32 operands and softmax's backward term per query (kernels: their own)
            grads["q_fp32"], grads["d_out_fp32"] = q.float(), grad_out.float()
            grads["delta"] = (grads["d_out_fp32"] * out).sum(-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # The block of step s belongs to rank - s. Its grads are summed on their way back: walking the steps from the
        # last, each rank adds its grads for a block to what arrived for that block and passes the sum on, the
        # transfer running while the next (earlier) step's grads are computed.
        in_flight: _Shift | None = None
        for step in range(cp - 1, -1, -1):
            d_kv = _step_backward(q, blocks[step], grads, dq, (rank - step) % cp, ctx)
            # grouped-query heads: each key/value head's grad is the sum over the query heads it served
            acc = d_kv.reshape(batch, kv_heads, heads // kv_heads, local, -1).sum(2)
            if in_flight is not None:
                acc = acc + in_flight.wait()
            in_flight = _Shift(acc, mesh, -1) if step > 0 else None
        dk, dv = acc.to(blocks.dtype).split(ctx.split, dim=-1)
        d_sinks = None
        if sinks:  # d sink = -sum over queries of its probability times softmax's backward term (its value is 0)
            delta = grads["delta"] if "delta" in grads else (grad_out.float() * out).sum(-1, keepdim=True)
            d_sinks = -(torch.exp(sinks[0].float().view(1, heads, 1, 1) - lse) * delta).sum((0, 2, 3))
            d_sinks = d_sinks.to(sinks[0].dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, d_sinks
