"""meshpar's fused norms and gated MLPs inside HF models (``fused_kernels`` in :func:`meshpar.parallelize`'s config).

Each family ships its own norm classes (``LlamaRMSNorm``, ``Qwen3RMSNorm``, ``nn.LayerNorm`` in GPT-2 and BERT, ...),
and some that share a name do other math (Gemma's RMSNorm scales by ``1 + weight``). So nothing is replaced by name
alone: every candidate (a module whose class name ends in ``RMSNorm``, an ``nn.LayerNorm`` with weight and bias, or a
``*MLP`` made of ``gate_proj`` / ``up_proj`` / ``down_proj`` linears and an ``act_fn``: SwiGLU where the act is SiLU) is
first run against its fused twin on a random input, with random weights of its own shapes, and replaced only where
outputs and input and weight grads agree to the dtype's tolerance. The twin holds the very same ``Parameter`` objects,
so names (FQNs), tensor-parallel styles, sequence parallelism, optimizers and checkpoints see no difference. What is
left stock, and why, is returned.

The fused ops are Triton kernels on CUDA and their torch references on CPU (:mod:`meshpar.ops`), custom ops with
fakes and autograd, so ``torch.compile`` traces them. Rotary embeddings are applied inside the families' attention
forwards (a function, not a module) and stay stock.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from meshpar.ops import layer_norm, rms_norm, swiglu


class FusedRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` with meshpar's fused op; ``weight`` is the replaced module's."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class FusedLayerNorm(nn.Module):
    """LayerNorm over the last dim with meshpar's fused op; ``weight`` and ``bias`` are the replaced module's."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = weight, bias, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class FusedGatedMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with meshpar's fused SwiGLU; the projections are the replaced
    MLP's own modules (same names, so tensor-parallel styles and shared-input grouping apply alike)."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


_GATED = ("gate_proj", "up_proj", "down_proj")


def _gated_mlp_twin(module: nn.Module) -> nn.Module | str:
    children = dict(module.named_children())
    if set(children) - {*_GATED, "act_fn"} or next(module.parameters(recurse=False), None) is not None:
        return f"holds more than {', '.join(_GATED)} and act_fn"
    if not all(isinstance(children.get(name), nn.Linear) for name in _GATED):
        return "projections are not nn.Linear"
    return FusedGatedMLP(*(children[name] for name in _GATED))


def _input_width(module: nn.Module) -> int:
    return module.gate_proj.in_features if isinstance(module, FusedGatedMLP) else module.weight.shape[0]


def _fused_twin(module: nn.Module) -> nn.Module | str | None:
    """The fused module for ``module`` (sharing its parameters), why a candidate has none, or ``None`` for a module
    that is no candidate."""
    if type(module).__name__.endswith("MLP") and all(hasattr(module, name) for name in (*_GATED, "act_fn")):
        return _gated_mlp_twin(module)
    if not (isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")):
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return "no 1-D weight"
    if isinstance(module, nn.LayerNorm):
        if not isinstance(module.bias, nn.Parameter) or len(module.normalized_shape) != 1:
            return "LayerNorm without bias or over several dims"
        return FusedLayerNorm(weight, module.bias, module.eps)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(eps, float):
        return "no float eps (variance_epsilon / eps)"
    extra = [name for name, _ in module.named_parameters(recurse=False) if name != "weight"]
    if extra or any(True for _ in module.children()):
        return f"holds more than a weight ({extra or 'submodules'})"
    return FusedRMSNorm(weight, eps)


def _same_math(module: nn.Module, seed: int = 0) -> str | None:
    """Run a copy of ``module`` (random weights of its shapes and dtype, on CPU) and its fused twin on one random
    input; ``None`` where outputs and grads agree, else what differs."""
    probe = copy.deepcopy(module)
    if any(p.is_meta for p in probe.parameters()):
        probe = probe.to_empty(device="cpu")
    probe = probe.to("cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in probe.parameters():  # matrices at 1/sqrt(fan_in), as trained weights are: O(1) activations
            value = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_((value / param.shape[-1] ** 0.5 if param.dim() > 1 else value).to(param.dtype))
    twin = _fused_twin(probe)
    dtype = next(probe.parameters()).dtype
    x = torch.randn(2, 5, _input_width(twin), generator=generator, dtype=torch.float32).to(dtype)
    dy = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(dtype)
    results = []
    for candidate in (probe, twin):
        inp = x.clone().requires_grad_()
        out = candidate(inp)
        if not torch.is_tensor(out) or out.shape != x.shape:
            return f"returns {type(out).__name__} {getattr(out, 'shape', '')}, not a tensor of the input's shape"
        grads = torch.autograd.grad(out, [inp, *probe.parameters()], dy, allow_unused=True)
        results.append((out.detach(), *grads))
    names = ["output", "input grad", *(f"grad of {n}" for n, _ in probe.named_parameters())]
    for what, stock, fused in zip(names, *results, strict=True):
        try:
            torch.testing.assert_close(fused, stock)
        except AssertionError:
            return f"{what} differs from the stock module's"
    return None


def use_fused_modules(model: nn.Module) -> dict[str, str]:
    """Replace every norm and gated MLP of ``model`` that has a proven fused twin (see the module docstring); returns
    the candidates left stock, by FQN, with the reason (other modules are not listed)."""
    kept: dict[str, str] = {}
    proven: dict[tuple[type, torch.dtype], str | None] = {}
    for name, module in list(model.named_modules()):
        if not name:
            continue
        twin = _fused_twin(module)
        if isinstance(twin, str):
            kept[name] = twin
        if not isinstance(twin, nn.Module):
            continue
        key = (type(module), next(module.parameters()).dtype)
        if key not in proven:  # one probe per class and dtype: the math is the class's
            proven[key] = _same_math(module)
        if proven[key] is not None:
            kept[name] = f"{type(module).__name__}: {proven[key]}"
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, twin)
    return kept
