"""meshpar.pipeline.trace cuts a trace it is handed (the one NxD's ``trace()`` made) instead of tracing again, and
refuses one that is not of this model or not over these inputs: its stages would run other weights or drop an
input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshpar.pipeline.trace import leaf_classes, trace, traced_stages


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x if scale is None else x * scale


def _stages(model: nn.Module, names: list[str], traced=None) -> list[tuple[nn.Module, list[str]]]:
    stages, _ = traced_stages(
        model, 0, 1, input_names=names, transformer_layer_cls=_Layer, virtual_pipeline_size=3, traced=traced
    )
    return [(stage, reads) for _, stage, reads in stages]


def _run(stages: list[tuple[nn.Module, list[str]]], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The first stage takes the model inputs it reads; each later one the activation, then those it reads."""
    first, reads = stages[0]
    out = first(**{name: inputs[name] for name in reads})
    for stage, reads in stages[1:]:
        out = stage(out, **{name: inputs[name] for name in reads})
    return out


def test_leaf_classes_are_the_layers_then_the_leaves() -> None:
    assert leaf_classes(_Layer, [nn.Embedding]) == (_Layer, nn.Embedding)
    assert leaf_classes((_Layer, nn.Linear), None) == (_Layer, nn.Linear)
    assert leaf_classes(None, None) == ()


def test_a_given_trace_is_cut_as_it_is() -> None:
    torch.manual_seed(0)
    model, x, scale = _Model(), torch.randn(2, 4), torch.randn(2, 4)
    traced = trace(model, ["x", "scale"], leaf_classes(_Layer))
    given = _stages(model, ["x", "scale"], traced)
    anew = _stages(model, ["x", "scale"])
    assert [(s.code, r) for s, r in given] == [(s.code, r) for s, r in anew]
    torch.testing.assert_close(_run(given, {"x": x, "scale": scale}), model(x, scale))


def test_a_trace_over_other_inputs_is_refused() -> None:
    model = _Model()
    traced = trace(model, ["x"], leaf_classes(_Layer))  # scale kept at its default: the stages would drop it
    with pytest.raises(ValueError, match=r"made over inputs \['x'\], the pipeline traces \['x', 'scale'\]"):
        _stages(model, ["x", "scale"], traced)


def test_a_trace_of_another_model_is_refused() -> None:
    model = _Model()
    traced = trace(_Model(), ["x"], leaf_classes(_Layer))
    with pytest.raises(ValueError, match="holds parameters that are not _Model's"):
        _stages(model, ["x"], traced)
