"""Grouped matrix multiply for mixture-of-experts layers: the rows of ``x`` sorted by expert, each block of rows
multiplied by its own expert's weight, in one launch.

``grouped_mm(x [S, K], w [E, K, N], offs [E]) -> [S, N]``: rows ``offs[e-1] <= r < offs[e]`` (``offs[-1]`` taken as
0) use ``w[e]``; rows at or past ``offs[E-1]`` are zero (torch's ``_grouped_mm`` leaves them unwritten). The layout is
torch's ``_grouped_mm`` / transformers' ``grouped_mm`` experts: cumulative row ends per expert, which an
expert-parallel dispatcher produces from its per-expert token counts.

Ops: ``meshpar::grouped_mm(x, w, offs)`` and ``meshpar::grouped_mm_bwd(dy, x, w, offs) -> (dx, dw)``. The forward
kernel's program ``(e, m, n)`` owns row tile ``m`` of expert ``e`` (a program past its expert's last row returns at
once: no host sync to learn the group sizes, so the op also runs inside CUDA graphs and ``torch.compile``) and
column tile ``n``. ``dx`` is the same kernel with each ``w[e]`` read transposed (strides, no copy); ``dw[e]`` is
``x_e^T dy_e``, one program per ``(e, k tile, n tile)`` walking its expert's rows (an expert with no rows gets a
zero grad).

On Hopper GPUs in bf16, where its alignment holds, the ops run torch's own grouped GEMM (``torch._grouped_mm``,
CUTLASS) instead: on an H200 it ran the forward at 591-614 TFLOP/s on Mixtral-shaped experts, where these Triton
kernels (before their tiles were swept) reached about a third of that (``benchmarks/README.md``). The Triton kernels
serve every other CUDA case (fp32, fp16, older GPUs, widths that are not multiples of 8).
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from meshpar._compat import vendor_grouped_mm
from meshpar.ops._dispatch import interpreting, run_triton
from meshpar.ops._eager import call, register_autograd
from meshpar.ops._triton import tl, triton

# Tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the best of a sweep on an H200 for each operand size
# (benchmarks/README.md); fp32's are smaller (twice the shared memory per element, exact dots on the CUDA cores).
_PRODUCT_TILES = {2: (128, 256, 64, 8, 3), 4: (64, 128, 32, 4, 4)}
# the weight grad: rows stepped BLOCK_M at a time, a BLOCK_K x BLOCK_N tile of dw per program
_WEIGHT_GRAD_TILES = {2: (64, 128, 128, 8, 3), 4: (32, 128, 128, 8, 3)}


def _tiles(table: dict[int, tuple[int, ...]], t: torch.Tensor) -> dict[str, int]:
    bm, bn, bk, warps, stages = table[min(t.element_size(), 4)]
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


@triton.jit
def _rows_of(OFFS, e):
    start = tl.load(OFFS + e - 1, mask=e > 0, other=0)
    return start, tl.load(OFFS + e)


@triton.jit
def _accumulate(acc, a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32: fp32 operands exactly (no TF32), half-precision ones on the tensor cores; the
    interpreter (CPU tests) gets fp32 operands, as its half-precision dot is not numpy's to do."""
    if UPCAST:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return acc + tl.dot(a, b, input_precision="ieee")
    return acc + tl.dot(a, b)


@triton.jit
def _grouped_mm_kernel(
    X, W, OFFS, Y, K, N, sx_m, sx_k, sw_e, sw_k, sw_n, sy_m, sy_n,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    e, m, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _rows_of(OFFS, e)
    row0 = start + m * BLOCK_M
    if row0 < end:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask, col_mask = rows < end, cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a_ptrs = X + rows[:, None].to(tl.int64) * sx_m + ks[None, :] * sx_k
            b_ptrs = W + e.to(tl.int64) * sw_e + ks[:, None] * sw_k + cols[None, :] * sw_n
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = _accumulate(acc, a, b, IEEE, UPCAST)
        out = Y + rows[:, None].to(tl.int64) * sy_m + cols[None, :] * sy_n
        tl.store(out, acc.to(Y.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_weight_grad_kernel(
    X, DY, OFFS, DW, K, N, sx_m, sx_k, sd_m, sd_n, sw_e, sw_k, sw_n,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    e, kt, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _rows_of(OFFS, e)
    ks = kt * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, col_mask = ks < K, cols < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for row0 in range(start, end, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        xt_ptrs = X + rows[None, :].to(tl.int64) * sx_m + ks[:, None] * sx_k
        dy_ptrs = DY + rows[:, None].to(tl.int64) * sd_m + cols[None, :] * sd_n
        xt = tl.load(xt_ptrs, mask=k_mask[:, None] & row_mask[None, :], other=0.0)
        dy = tl.load(dy_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _accumulate(acc, xt, dy, IEEE, UPCAST)
    out = DW + e.to(tl.int64) * sw_e + ks[:, None] * sw_k + cols[None, :] * sw_n
    tl.store(out, acc.to(DW.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _traced(offs: torch.Tensor) -> bool:
    """Under a tracer (``torch.compile``, ``make_fx``, fake tensors) the group sizes are unknown: no host sync."""
    return type(offs) is not torch.Tensor or torch.compiler.is_compiling()


def _row_groups(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[S, E]`` bool: row ``r`` belongs to expert ``e`` (rows past the last group to none)."""
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    return (rows >= starts) & (rows < offs)


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """One matmul per expert in fp32 (the CPU kernel and the test oracle). Traced, every expert's matmul runs on the
    rows masked to its group (E times the work, no host sync)."""
    if _traced(offs):
        groups = _row_groups(x, offs).float()
        return sum(groups[:, e, None] * (x.float() @ w[e].float()) for e in range(w.shape[0])).to(x.dtype)
    out = x.new_zeros(x.shape[0], w.shape[2])
    for e, (start, end) in enumerate(_group_bounds(offs)):
        out[start:end] = (x[start:end].float() @ w[e].float()).to(x.dtype)
    return out


def grouped_mm_bwd_reference(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if _traced(offs):
        groups = _row_groups(x, offs).float()
        dyf, xf = dy.float(), x.float()
        dx = sum(groups[:, e, None] * (dyf @ w[e].float().t()) for e in range(w.shape[0]))
        dw = torch.stack([(xf * groups[:, e, None]).t() @ dyf for e in range(w.shape[0])])
        return dx.to(x.dtype), dw.to(w.dtype)
    dx, dw = torch.zeros_like(x), torch.zeros_like(w)
    for e, (start, end) in enumerate(_group_bounds(offs)):
        dx[start:end] = (dy[start:end].float() @ w[e].float().t()).to(x.dtype)
        dw[e] = (x[start:end].float().t() @ dy[start:end].float()).to(w.dtype)
    return dx, dw


def _vendor_kernel_fits(x: torch.Tensor, k: int, n: int) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: bf16 on a Hopper (or newer) GPU, rows of 16-byte
    multiples."""
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and vendor_grouped_mm is not None
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and k % 8 == 0
        and n % 8 == 0
        and x.shape[0] > 0
    )


def _zero_past_last_group(y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` leaves rows past the last group unwritten; ours are zero (without a host sync)."""
    return y.masked_fill((torch.arange(y.shape[0], device=y.device) >= offs[-1])[:, None], 0)


def _launch_grouped_mm(x: torch.Tensor, w: torch.Tensor, w_strides: tuple[int, int, int], offs: torch.Tensor,
                       n: int) -> torch.Tensor:  # fmt: skip
    """``x @ w[e]`` per group with ``w[e]`` read as ``[K, n]`` through ``w_strides`` (expert, k, n)."""
    y = torch.zeros(x.shape[0], n, dtype=x.dtype, device=x.device)
    tiles = _tiles(_PRODUCT_TILES, x)
    grid = (offs.numel(), triton.cdiv(max(x.shape[0], 1), tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]))
    wrap_triton(_grouped_mm_kernel)[grid](
        x, w, offs, y, x.shape[1], n, x.stride(0), x.stride(1), *w_strides, y.stride(0), y.stride(1),
        IEEE=x.dtype == torch.float32, UPCAST=interpreting(), **tiles,
    )  # fmt: skip
    return y


def _input_grad(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``dy @ w[e]^T`` per group on the forward kernel. 16-bit ``w`` is read through transposed strides; fp32 ``w``
    is copied transposed first, as its strided loads are slow: on an H200 (Mixtral-shaped experts) the copy made
    fp32's forward + backward 68.6 ms where the strided read took 86.5 (cuBLAS's per-expert loop 72.9), while for
    fp16 it cost time (9.5 ms, strided 6.4). The copy holds one more weight-sized buffer while it runs."""
    if w.element_size() < 4:
        return _launch_grouped_mm(dy, w, (w.stride(0), w.stride(2), w.stride(1)), offs, w.shape[1])
    wt = w.transpose(1, 2).contiguous()
    return _launch_grouped_mm(dy, wt, (wt.stride(0), wt.stride(1), wt.stride(2)), offs, w.shape[1])


@triton_op("meshpar::grouped_mm", mutates_args=())
def grouped_mm_fwd(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if not run_triton(x):
        return grouped_mm_reference(x, w, offs)
    if _vendor_kernel_fits(x, w.shape[1], w.shape[2]):
        return _zero_past_last_group(vendor_grouped_mm(x, w, offs=offs.to(torch.int32)), offs)
    return _launch_grouped_mm(x, w, (w.stride(0), w.stride(1), w.stride(2)), offs, w.shape[2])


@triton_op("meshpar::grouped_mm_bwd", mutates_args=())
def grouped_mm_bwd(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if not run_triton(x):
        return grouped_mm_bwd_reference(dy, x, w, offs)
    k, n = w.shape[1], w.shape[2]
    if _vendor_kernel_fits(x, k, n):
        ends = offs.to(torch.int32)
        dx = _zero_past_last_group(vendor_grouped_mm(dy, w.transpose(1, 2), offs=ends), offs)
        dw = vendor_grouped_mm(x.t(), dy, offs=ends)
        empty = torch.diff(ends, prepend=ends.new_zeros(1)) == 0  # an expert with no rows: a zero grad
        return dx, dw.masked_fill(empty[:, None, None], 0)
    dx = _input_grad(dy, w, offs)
    dw = torch.empty_like(w)
    tiles = _tiles(_WEIGHT_GRAD_TILES, x)
    grid = (offs.numel(), triton.cdiv(k, tiles["BLOCK_K"]), triton.cdiv(n, tiles["BLOCK_N"]))
    wrap_triton(_grouped_weight_grad_kernel)[grid](
        x, dy, offs, dw, k, n, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), *dw.stride(),
        IEEE=x.dtype == torch.float32, UPCAST=interpreting(), **tiles,
    )  # fmt: skip
    return dx, dw


@grouped_mm_fwd.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@grouped_mm_bwd.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _save(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: object, dy: torch.Tensor) -> tuple:
    x, w, offs = ctx.saved_tensors
    dx, dw = call(grouped_mm_bwd, dy.contiguous(), x, w, offs)
    return dx, dw, None


register_autograd(grouped_mm_fwd, _backward, _save)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x [S, K]`` (rows sorted by expert) times ``w [E, K, N]`` per group; ``offs [E]``: each expert's cumulative
    row end (int32 or int64, non-decreasing, at most ``S``). Rows past ``offs[-1]`` come out zero."""
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1:
        raise ValueError(f"grouped_mm takes x [S, K], w [E, K, N], offs [E]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(offs.shape)}")  # fmt: skip
    if x.shape[1] != w.shape[1] or offs.numel() != w.shape[0]:
        raise ValueError(f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)} and offs of {offs.numel()} experts do "
                         "not fit (x's columns must be w's dim 1, one offset per expert)")  # fmt: skip
    if x.dtype != w.dtype or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_mm: x and w must share a dtype ({x.dtype}, {w.dtype}); offs must be int32 or int64")
    return call(grouped_mm_fwd, x.contiguous(), w, offs.contiguous())
