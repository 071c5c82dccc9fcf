"""``torch.compile(fullgraph=True)`` of tensor-parallel blocks: same results as the dense model, and the compiled
backward keeps Megatron's overlap of the input-grad all-reduce with the weight-grad matmul."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch.distributed.tensor.parallel import parallelize_module

from meshpar.testing import assert_matches_dense, run_distributed, setup_parallel
from tests._models import TinyTransformer, block_plan

pytestmark = pytest.mark.slow  # not in make test-fast: torch.compile


def compiled_block_case(tp: int) -> None:
    dims = setup_parallel(tp=tp)
    torch.manual_seed(0)
    dense = TinyTransformer(hidden=16, heads=4, ffn=24, layers=2)
    model = parallelize_module(copy.deepcopy(dense), dims.tp_mesh, block_plan())
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, fullgraph=True)
    x = torch.randn(2, 8, 16)
    expected = dense(x)
    expected.square().sum().backward()
    y = model(x)
    y.square().sum().backward()
    torch.testing.assert_close(y, expected.detach(), atol=1e-5, rtol=1e-5)
    dense_params = dict(dense.named_parameters())
    for name, param in model.named_parameters():
        dense_name = name.replace("._orig_mod", "")
        assert_matches_dense(param.grad, dense_params[dense_name].grad, atol=1e-5, rtol=1e-5, msg=name)


def test_fullgraph_compiled_blocks_match_dense() -> None:
    """tp=2 (a compiled block at tp=1 is a plain block: tests/ops/test_compile.py compiles those)."""
    torch._dynamo.reset()
    run_distributed(compiled_block_case, 2, 2, timeout=600)


def backward_graph_case() -> list[list[str]]:
    """For each all-reduce in the compiled backward: the ops between it and its wait."""
    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    model = parallelize_module(TinyTransformer(hidden=16, heads=4, ffn=24, layers=1), dims.tp_mesh, block_plan())
    graphs = []

    def keep_backward(gm: torch.fx.GraphModule, _inputs: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=keep_backward)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(torch.randn(2, 8, 16)).sum().backward()
    (graph,) = graphs
    nodes = list(graph.graph.nodes)
    windows = []
    for start, node in enumerate(nodes):
        if node.op == "call_function" and "all_reduce" in str(node.target):
            end = next(i for i, n in enumerate(nodes) if "wait_tensor" in str(n.target) and node in n.args)
            windows.append([str(n.target) for n in nodes[start + 1 : end] if n.op == "call_function"])
    return windows


def test_compiled_backward_overlaps_input_grad_all_reduce_with_weight_grad() -> None:
    windows = run_distributed(backward_graph_case, 2)[0]
    assert len(windows) == 2  # qkv and fc1: Megatron's two backward all-reduces per layer
    for between in windows:
        assert any("mm" in op for op in between), between  # the weight-grad matmul runs while the all-reduce flies
