"""Every Triton kernel against its torch reference (forward and backward), opcheck, and torch.compile.

Without CUDA the kernels run through the Triton interpreter on CPU tensors; with CUDA they run for real.
"""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch
import torch.nn.functional as F

from meshpar import ops
from meshpar.ops import cross_entropy, softmax
from meshpar.ops._dispatch import interpreting, triton_available
from meshpar.ops.layer_norm import layer_norm_fwd_reference
from meshpar.ops.rms_norm import rms_norm_fwd_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
    pytest.mark.skipif(DEVICE == "cpu" and not interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"),
    pytest.mark.triton_interpret if DEVICE == "cpu" else pytest.mark.gpu,
]
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype, loose: float = 1.0) -> dict:
    base = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    return {k: v * loose for k, v in base.items()}


def _compare(triton_fn, reference_fn, inputs: list[torch.Tensor], grad_out: torch.Tensor, tol: dict) -> None:
    """Forward and every input grad of ``triton_fn`` (kernels forced on) vs ``reference_fn`` in fp32."""
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    expected = reference_fn(*ref_inputs)
    expected_grads = torch.autograd.grad(expected, ref_inputs, grad_out.float())
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with ops.triton_enabled(True):
        actual = triton_fn(*leaves)
        grads = torch.autograd.grad(actual, leaves, grad_out)
    assert actual.dtype == inputs[0].dtype
    torch.testing.assert_close(actual.float(), expected.float(), **tol)
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.float(), want.float(), **{k: v * 4 for k, v in tol.items()})


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


ROW_SHAPES = [(1, 64), (3, 5, 37), (2, 4099), (17, 96)]


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(shape: tuple, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, w = _randn(*shape, dtype=dtype), _randn(shape[-1], dtype=dtype)

    def reference(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    _compare(lambda x, w: ops.rms_norm(x, w, 1e-6), reference, [x, w], _randn(*shape, dtype=dtype), _tol(dtype))


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm(shape: tuple, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, w, b = _randn(*shape, dtype=dtype) * 3 + 1, _randn(shape[-1], dtype=dtype), _randn(shape[-1], dtype=dtype)
    _compare(
        lambda x, w, b: ops.layer_norm(x, w, b, 1e-5),
        lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5),
        [x, w, b],
        _randn(*shape, dtype=dtype),
        _tol(dtype, loose=2.0),
    )


MASKS = {
    "none": lambda b, h, sq, sk: None,
    "per_batch_padding": lambda b, h, sq, sk: torch.rand(b, 1, 1, sk, device=DEVICE) > 0.6,
    "per_query": lambda b, h, sq, sk: torch.rand(b, 1, sq, sk, device=DEVICE) > 0.5,
    "full_per_head": lambda b, h, sq, sk: torch.rand(b, h, sq, sk, device=DEVICE) > 0.5,
    "all_masked": lambda b, h, sq, sk: torch.ones(1, 1, sq, sk, dtype=torch.bool, device=DEVICE),
    "nothing_masked": lambda b, h, sq, sk: torch.zeros(1, 1, 1, sk, dtype=torch.bool, device=DEVICE),
}


@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 5, 37), (1, 1, 1, 1), (1, 2, 3, 1030)])
def test_scaled_masked_softmax(mask_kind: str, dtype: torch.dtype, shape: tuple) -> None:
    torch.manual_seed(0)
    mask = MASKS[mask_kind](*shape)
    scale = 0.37
    _compare(
        lambda x: ops.scaled_masked_softmax(x, mask, scale),
        lambda x: softmax.scaled_masked_softmax_reference(x, mask, scale),
        [_randn(*shape, dtype=dtype) * 3],
        _randn(*shape, dtype=dtype),
        _tol(dtype),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (1, 2, 1, 1), (1, 1, 33, 33), (1, 1, 4, 9)])
def test_scaled_upper_triang_masked_softmax(dtype: torch.dtype, shape: tuple) -> None:
    torch.manual_seed(0)

    def reference(x):
        causal = torch.ones(shape[-2:], dtype=torch.bool, device=DEVICE).triu(1)
        return torch.softmax((x * 1.5).masked_fill(causal, float("-inf")), -1)

    _compare(
        lambda x: ops.scaled_upper_triang_masked_softmax(x, 1.5),
        reference,
        [_randn(*shape, dtype=dtype)],
        _randn(*shape, dtype=dtype),
        _tol(dtype),
    )


@pytest.mark.parametrize("shape", [(1, 1), (3, 5, 37), (2, 3000), (70, 130)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu(shape: tuple, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    _compare(
        ops.bias_gelu,
        lambda x, b: F.gelu(x + b, approximate="tanh"),
        [_randn(*shape, dtype=dtype) * 2, _randn(shape[-1], dtype=dtype)],
        _randn(*shape, dtype=dtype),
        _tol(dtype, loose=4.0),
    )


@pytest.mark.parametrize(("programs", "n_cols"), [(1, 1), (150, 70), (528, 33)])
def test_sum_partials(programs: int, n_cols: int) -> None:
    """The norm and bias-gelu backward kernels sum their per-program fp32 partials with this kernel."""
    from meshpar.ops._rows import sum_partials

    torch.manual_seed(0)
    partials = _randn(programs, n_cols)
    with ops.triton_enabled(True):
        total = sum_partials(partials, torch.bfloat16)
    assert total.dtype == torch.bfloat16 and total.shape == (n_cols,)
    torch.testing.assert_close(total.float(), partials.sum(0).bfloat16().float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("shape", [(1,), (3, 5, 37), (2, 3000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(shape: tuple, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    _compare(
        ops.swiglu,
        lambda g, u: F.silu(g) * u,
        [_randn(*shape, dtype=dtype) * 2, _randn(*shape, dtype=dtype)],
        _randn(*shape, dtype=dtype),
        _tol(dtype),
    )


def _hf_rotate_half(x, cos, sin, seq_dim):
    shape = [1] * x.dim()
    shape[seq_dim], shape[-1] = x.shape[seq_dim], x.shape[-1]
    c, s = torch.cat([cos, cos], -1).view(shape), torch.cat([sin, sin], -1).view(shape)
    x1, x2 = x.chunk(2, -1)
    return x * c + torch.cat([-x2, x1], -1) * s


def _gptj_interleaved(x, cos, sin, seq_dim):
    shape = [1] * x.dim()
    shape[seq_dim], shape[-1] = x.shape[seq_dim], x.shape[-1] // 2
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    ("shape", "seq_dim"), [((2, 5, 3, 10), 1), ((2, 3, 5, 64), 2), ((1, 1, 1, 2), 1), ((3, 40, 5, 16), 1)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding(interleaved: bool, shape: tuple, seq_dim: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    angles = torch.randn(shape[seq_dim], shape[-1] // 2, device=DEVICE)
    cos, sin = angles.cos(), angles.sin()
    reference = _gptj_interleaved if interleaved else _hf_rotate_half
    _compare(
        lambda x: ops.rotary_embedding(x, cos, sin, interleaved=interleaved, seq_dim=seq_dim),
        lambda x: reference(x, cos, sin, seq_dim),
        [_randn(*shape, dtype=dtype)],
        _randn(*shape, dtype=dtype),
        _tol(dtype),
    )


# (rows per expert, K, N): uneven groups, an empty expert, groups and K / N off the 64 / 32 tiles, rows past the last
# group; the last case's K / N are multiples of 8, where bf16 on a Hopper GPU runs torch's grouped GEMM
GROUPS = [([3], 5, 7), ([0, 70, 1, 0], 40, 33), ([65, 2, 31], 96, 130), ([9, 0, 40], 64, 48)]


@pytest.mark.parametrize(("counts", "k", "n"), GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tail", [0, 3])
def test_grouped_mm(counts: list[int], k: int, n: int, dtype: torch.dtype, tail: int) -> None:
    torch.manual_seed(0)
    offs = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    rows = int(offs[-1]) + tail  # rows past the last group (an expert-parallel dispatcher's padding) stay zero
    x, w = _randn(rows, k, dtype=dtype), _randn(len(counts), k, n, dtype=dtype)

    def dense(x, w):  # every group its own matmul, rows past the last group zero
        bounds = [0, *offs.tolist()]
        parts = [x[a:b] @ w[e] for e, (a, b) in enumerate(itertools.pairwise(bounds))]
        return torch.cat([*parts, x[bounds[-1] :] @ w.new_zeros(k, n)])

    _compare(lambda x, w: ops.grouped_mm(x, w, offs), dense, [x, w], _randn(rows, n, dtype=dtype), _tol(dtype, 4))


@pytest.mark.slow  # compiles
def test_grouped_mm_reference_traces_without_a_host_sync() -> None:
    """The torch reference (CPU without the kernels, and every fallback) must trace: under fake tensors the group
    sizes are unknown, so it may not read them on the host (torch 2.11's opcheck failed on that under dynamic
    shapes). Checked under fake tensors, by opcheck with the kernels off, and compiled with dynamic shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshpar.ops import grouped_mm as gm_op
    from meshpar.ops._dispatch import triton_enabled

    module = importlib.import_module("meshpar.ops.grouped_mm")
    offs = torch.tensor([2, 2, 4], dtype=torch.int32)
    x, w, dy = torch.randn(5, 4), torch.randn(3, 4, 6), torch.randn(5, 6)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (x, w, offs, dy)]
        assert module.grouped_mm_reference(*fakes[:3]).shape == (5, 6)
        assert [t.shape for t in module.grouped_mm_bwd_reference(fakes[3], *fakes[:3])] == [x.shape, w.shape]
    with triton_enabled(False):
        torch.library.opcheck(torch.ops.meshpar.grouped_mm, (x.requires_grad_(), w.requires_grad_(), offs))
        torch.library.opcheck(torch.ops.meshpar.grouped_mm_bwd, (dy, x.detach(), w.detach(), offs))
        compiled = torch.compile(lambda a, b: gm_op(a, b, offs), dynamic=True, fullgraph=True)
        torch.testing.assert_close(compiled(x, w), module.grouped_mm_reference(x.detach(), w.detach(), offs))


def test_grouped_mm_refuses_what_does_not_fit() -> None:
    x, w, offs = torch.randn(4, 3), torch.randn(2, 3, 5), torch.tensor([1, 4])
    for bad, match in [
        ((x, w[:, :2], offs), "do not fit"),
        ((x, w, offs[:1]), "do not fit"),
        ((x.double(), w, offs), "share a dtype"),
        ((x, w, offs.float()), "int32 or int64"),
        ((x[None], w, offs), "x \\[S, K\\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            ops.grouped_mm(*bad)


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (7, 37), (3, 5000), (4, 4096)])
@pytest.mark.parametrize("vocab_start", [0, 11])
@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_ce_stats_and_grad(rows: int, vocab: int, vocab_start: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = (_randn(rows, vocab) * 5).to(dtype)
    labels = torch.randint(0, vocab + 2 * vocab_start, (rows,), device=DEVICE)
    labels[0] = vocab_start  # owned, first column
    with ops.triton_enabled(True):
        stats = ops.vocab_ce_stats(logits, labels, vocab_start)
    expected = cross_entropy.vocab_ce_stats_reference(logits, labels, vocab_start)
    # a (max, sum-exp) pair only matters through max + log(sum): the CPU reference reports (logZ, 1)
    log_z = expected[:, 0] + expected[:, 1].log()
    torch.testing.assert_close(stats[:, 0] + stats[:, 1].log(), log_z, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(stats[:, 2:], expected[:, 2:], atol=1e-4, rtol=1e-5)
    scale = torch.rand(rows, device=DEVICE)
    args = (logits, labels, log_z, scale, vocab_start, vocab + 2 * vocab_start, 0.1)
    with ops.triton_enabled(True):
        grad = ops.vocab_ce_grad(*args)
    torch.testing.assert_close(grad.float(), cross_entropy.vocab_ce_grad_reference(*args).float(), **_tol(dtype))


def _opcheck_cases() -> list:
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    scores = torch.randn(2, 2, 3, 5)
    mask = torch.rand(2, 1, 3, 5) > 0.5
    angles = torch.randn(4, 3)
    logits, labels = torch.randn(3, 7), torch.tensor([0, 3, 9])
    offs = torch.tensor([2, 2, 4], dtype=torch.int32)  # an expert with no rows, one row past the last group
    m = torch.ops.meshpar
    _, rstd = rms_norm_fwd_reference(x, w, 1e-6)
    _, mean, lrstd = layer_norm_fwd_reference(x, w, b, 1e-5)
    return [
        (m.rms_norm_fwd, (x.requires_grad_(), w.requires_grad_(), 1e-6)),
        (m.rms_norm_bwd, (torch.randn(3, 8), x.detach(), w.detach(), rstd)),
        (
            m.layer_norm_fwd,
            (torch.randn(3, 8, requires_grad=True), w.detach().requires_grad_(), b.requires_grad_(), 1e-5),
        ),
        (m.layer_norm_bwd, (torch.randn(3, 8), x.detach(), w.detach(), mean, lrstd)),
        (m.scaled_masked_softmax, (scores.clone().requires_grad_(), mask, 0.5)),
        (m.scaled_masked_softmax, (scores.clone().requires_grad_(), None, 0.5)),
        (m.scaled_upper_triang_masked_softmax, (torch.randn(2, 2, 4, 4, requires_grad=True), 0.5)),
        (m.scaled_softmax_bwd, (torch.randn(2, 2, 3, 5), torch.rand(2, 2, 3, 5), 0.5)),
        (m.bias_gelu_fwd, (torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True))),
        (m.bias_gelu_bwd, (torch.randn(3, 8), torch.randn(3, 8), torch.randn(8))),
        (m.swiglu_fwd, (torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True))),
        (m.swiglu_bwd, (torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8))),
        (
            m.rotary_embedding,
            (torch.randn(2, 4, 2, 6, requires_grad=True), angles.cos(), angles.sin(), False, 2, False),
        ),
        (m.rotary_embedding, (torch.randn(2, 4, 2, 6, requires_grad=True), angles.cos(), angles.sin(), True, 2, True)),
        (m.grouped_mm, (torch.randn(5, 4, requires_grad=True), torch.randn(3, 4, 6, requires_grad=True), offs)),
        (m.grouped_mm_bwd, (torch.randn(5, 6), torch.randn(5, 4), torch.randn(3, 4, 6), offs)),
        (m.vocab_ce_stats, (logits, labels, 2)),
        (m.vocab_ce_grad, (logits, labels, torch.randn(3), torch.rand(3), 2, 14, 0.1)),
    ]


_OPCHECK = _opcheck_cases()


@pytest.mark.parametrize(
    ("op", "args"), _OPCHECK, ids=[f"{op._qualified_op_name.split('::')[-1]}-{i}" for i, (op, _) in enumerate(_OPCHECK)]
)
def test_opcheck(op: object, args: tuple) -> None:
    torch.library.opcheck(op, args)


def test_opcheck_covers_every_meshpar_op() -> None:
    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("meshpar::")}
    checked = {op._qualified_op_name for op, _ in _OPCHECK}
    assert registered and registered <= checked, f"ops without an opcheck case: {sorted(registered - checked)}"


def test_meshpar_imports_and_runs_references_without_triton() -> None:
    """No triton (macOS, slim CPU installs): ``import meshpar`` works and the ops run their torch references."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch, meshpar\n"
        "from meshpar.ops import layer_norm, triton_available\n"
        "x = torch.randn(3, 8, requires_grad=True)\n"
        "y = layer_norm(x, torch.ones(8), torch.zeros(8))\n"
        "y.sum().backward()\n"
        "ref = torch.nn.functional.layer_norm(x.detach(), (8,))\n"
        "assert not triton_available() and torch.allclose(y.detach(), ref, atol=1e-5)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _public_op_cases() -> list[tuple[str, object, list[torch.Tensor]]]:
    x, w, b = _randn(6, 40), _randn(40), _randn(40)
    q = _randn(2, 5, 3, 16)
    angles = torch.randn(5, 8, device=DEVICE)
    scores, mask = _randn(2, 3, 5, 5), torch.rand(2, 1, 5, 5, device=DEVICE) > 0.7
    return [
        ("rms_norm", lambda t, ww: ops.rms_norm(t, ww), [x, w]),
        ("layer_norm", lambda t, ww, bb: ops.layer_norm(t, ww, bb), [x, w, b]),
        ("bias_gelu", ops.bias_gelu, [x, b]),
        ("swiglu", ops.swiglu, [x, _randn(6, 40)]),
        ("rotary", lambda t: ops.rotary_embedding(t, angles.cos(), angles.sin(), seq_dim=1), [q]),
        ("masked_softmax", lambda t: ops.scaled_masked_softmax(t, mask, 0.5), [scores]),
        ("causal_softmax", lambda t: ops.scaled_upper_triang_masked_softmax(t, 0.5), [scores]),
    ]


@pytest.mark.parametrize("case", range(7))
def test_eager_fast_path_matches_the_dispatched_op(case: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain eager calls skip the dispatcher (``ops._eager.call``); the outputs and grads are bit-identical to the
    dispatched op's, whose autograd is the one ``torch.compile`` and the tracers use."""
    from meshpar.ops import _eager

    torch.manual_seed(0)
    name, fn, inputs = _public_op_cases()[case]

    def run() -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        with ops.triton_enabled(True):
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        return out, out.grad_fn, grads

    out, grad_fn, grads = run()
    assert type(grad_fn).__name__.startswith("Eager_"), (name, grad_fn)  # the fast path ran
    monkeypatch.setattr(_eager, "plain_eager_context", lambda _args: False)
    dispatched, dispatched_fn, dispatched_grads = run()
    assert not type(dispatched_fn).__name__.startswith("Eager_"), (name, dispatched_fn)
    torch.testing.assert_close(out, dispatched, rtol=0, atol=0)
    for grad, want in zip(grads, dispatched_grads, strict=True):
        torch.testing.assert_close(grad, want, rtol=0, atol=0)


def test_tracers_see_the_custom_op() -> None:
    """Under a dispatch mode (here: make_fx) the op is dispatched, so graphs record ``meshpar::rms_norm_fwd``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(lambda t, ww: ops.rms_norm(t, ww))(_randn(4, 8), _randn(8))
    assert "meshpar.rms_norm_fwd" in str(graph.code)
