"""NxD's tracing helpers (``pipeline.trace``) with NxD's signatures and rules: which tracer class is picked, which
arguments stay concrete, which modules stay calls (names matched inside class names or as qualified names, NxD's
parallel layers always), and that the traced module computes what the model computes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from meshpar.compat.nxd.pipeline import trace as nxd_trace
from meshpar.testing import run_distributed


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.first(x) * math.sqrt(2.0) + self.second(x)).transpose(0, 1)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head, self.unused = Inner(), nn.Linear(4, 2), nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, scale: float = 2.0, *rest: object, **extra: object) -> torch.Tensor:
        self.unused(x[:, :1])  # dead code: NxD's trace drops the call and the module
        return self.head(self.block(x)) * scale


def _calls(traced: torch.fx.GraphModule) -> list[tuple[str, str]]:
    return [(node.op, str(node.target)) for node in traced.graph.nodes if node.op in ("call_module", "call_method")]


def test_tracer_classes_by_model_and_by_name() -> None:
    assert nxd_trace.get_tracer_class(Outer()) is nxd_trace.TorchTracerWrapper
    assert nxd_trace.get_tracer_class(Outer(), "torch") is nxd_trace.TorchTracerWrapper

    class Custom(torch.fx.Tracer):
        pass

    assert nxd_trace.get_tracer_class(Outer(), Custom) is Custom
    with pytest.raises(ValueError, match="Unsupported tracer_cls 'jit'"):
        nxd_trace.get_tracer_class(Outer(), "jit")
    if not hasattr(nxd_trace, "HFTracerWrapper"):  # transformers 5: no fx tracer to wrap
        with pytest.raises(NotImplementedError, match="no fx tracer"):
            nxd_trace.get_tracer_class(Outer(), "hf")


def test_concrete_args_from_names_or_from_a_call() -> None:
    model = Outer()
    assert nxd_trace.get_concrete_args(model, ["x"]) == {"scale": 2.0}
    assert set(nxd_trace.get_concrete_args(model, [])) == {"x", "scale"}  # *rest / **extra take no value
    assert nxd_trace.get_concrete_args(model, args=[torch.ones(1)]) == {"scale": 2.0}  # the first parameter
    assert nxd_trace.get_concrete_args(model, kwargs={"scale": 3.0}).keys() == {"x"}
    with pytest.raises(ValueError, match="does not have input\\(s\\) named: y"):
        nxd_trace.get_concrete_args(model, ["x", "y"])


def test_trace_model_in_nxds_argument_order_computes_the_model() -> None:
    torch.manual_seed(0)
    model, x = Outer(), torch.randn(4, 3)
    traced = nxd_trace.trace_model(model, None, None, ["x"])  # model, args, kwargs, input_names
    assert _calls(traced) == [
        ("call_module", "block.first"),
        ("call_module", "block.second"),
        ("call_method", "transpose"),
        ("call_module", "head"),
    ]
    assert not hasattr(traced, "unused")  # a call whose result nothing reads is dropped, and its module
    torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("leaf", ["Inner", "Inn", "block", Inner])
def test_leaves_by_part_of_the_class_name_qualified_name_or_class(leaf: object) -> None:
    traced = nxd_trace.trace_model(Outer(), input_names=["x"], leaf_modules=[leaf])
    assert _calls(traced) == [("call_module", "block"), ("call_module", "head")]


class WithParallelLayer(nn.Module):
    def __init__(self) -> None:
        from meshpar.compat.nxd.parallel_layers.layers import ColumnParallelLinear

        super().__init__()
        self.column = ColumnParallelLinear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.column(x)


def parallel_leaf_case() -> None:
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    traced = nxd_trace.trace_model(WithParallelLayer(), input_names=["x"])
    assert _calls(traced) == [("call_module", "column")]


def test_nxds_parallel_layers_are_always_leaves() -> None:
    run_distributed(parallel_leaf_case, 1)  # a parallel layer needs a parallel state: in a process of its own


def test_patching_object_methods_is_refused_and_nothing_else_is() -> None:
    with nxd_trace.patch_obj_method(None):
        pass
    refused = nxd_trace.patch_obj_method({object(): ["f"]})
    with pytest.raises(NotImplementedError, match="autowrap_obj_methods"), refused:
        pass
    with pytest.raises(NotImplementedError, match="autowrap_obj_methods"):
        nxd_trace.trace_model(Outer(), input_names=["x"], autowrap_obj_methods={Outer(): ["forward"]})


def test_a_huggingface_model_that_torch_fx_cannot_trace_is_refused_naming_the_missing_hf_tracer() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from meshpar.pipeline.trace import trace

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    with pytest.raises(ValueError, match=r"transformers 5 removed; meshpar\.parallelize pipelines them"):
        trace(model, ["input_ids"], (GPT2Block,))

    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    with pytest.raises(ValueError, match=r"DataDependent.forward with torch.fx \(\w+: [^)]*\); pass leaf_module_cls"):
        trace(DataDependent(), ["x"], ())  # no HuggingFace hint for another model
