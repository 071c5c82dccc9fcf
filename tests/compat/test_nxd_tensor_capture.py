"""NxD's debugging aids through the view: ``utils.tensor_capture`` (the outputs and inputs of named modules and
tensors registered by hand, named and ordered as NxD names and orders them, kept as detached copies) and
``utils.tensor_replacement`` (module outputs forced to given tensors where a mask says so)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from meshpar.compat.nxd.utils import tensor_capture as tc
from meshpar.compat.nxd.utils.tensor_capture.model_modification import (
    modify_hf_eager_model_for_tensor_capture,
    restore_model,
)
from meshpar.compat.nxd.utils.tensor_capture.registry import TensorRegistry
from meshpar.compat.nxd.utils.tensor_replacement import modify_model_for_tensor_replacement
from meshpar.compat.nxd.utils.tensor_replacement.registry import RuntimeRegister


@dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor
    label: str = "not a tensor"


class Branches(nn.Module):
    """A module whose output nests a tuple, a dict and a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor | None = None, note: str = "") -> tuple:
        y = self.proj(x) if scale is None else self.proj(x) * scale
        return y, {"half": y / 2, "pair": Pair(y + 1, y - 1)}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
        self.head = Branches()

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x, scale=scale, note="n")[0]


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[TensorRegistry]:
    registry = TensorRegistry.get_instance()
    registry.configure(enabled=False)
    yield registry
    registry.remove_hooks()
    registry.configure(enabled=False)


def test_outputs_of_watched_modules_are_captured_by_name_with_nested_outputs_flattened() -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 3)
    tc.enable_tensor_capture(net, ["blocks.1", "head"])
    out = net(x)
    captured = tc.get_captured_tensors_dict()
    hidden = torch.relu(net.blocks[1](torch.relu(net.blocks[0](x))))
    y = net.head.proj(hidden)
    expected = {
        "blocks.1.outputs": net.blocks[1](torch.relu(net.blocks[0](x))),
        "head.outputs.0": y,
        "head.outputs.1.half": y / 2,
        "head.outputs.1.pair.first": y + 1,
        "head.outputs.1.pair.second": y - 1,
    }
    assert list(captured) == list(expected)  # per module in the order asked, each module's keys sorted
    for key, value in expected.items():
        torch.testing.assert_close(captured[key], value, rtol=0, atol=0)
    torch.testing.assert_close(out, y, rtol=0, atol=0)


def test_inputs_come_before_outputs_and_only_tensor_kwargs_are_kept() -> None:
    net, x, scale = Net(), torch.randn(2, 3), torch.tensor(2.0)
    tc.enable_tensor_capture(net, ["head"], capture_inputs=True)
    net(x, scale)
    keys = list(tc.get_captured_tensors_dict())
    assert keys[:2] == ["head.inputs.0", "head.inputs.kwargs.scale"]
    assert "head.inputs.kwargs.note" not in keys and keys[2].startswith("head.outputs")


def test_captured_tensors_are_detached_copies() -> None:
    net, x = Net(), torch.randn(2, 3, requires_grad=True)
    tc.enable_tensor_capture(net, ["blocks.0"], capture_inputs=True)
    net(x)
    before = x.detach().clone()
    kept = tc.get_captured_tensors_dict()
    assert not kept["blocks.0.outputs"].requires_grad
    with torch.no_grad():
        x.add_(1.0)  # a later in-place update of the input does not reach the capture
    torch.testing.assert_close(kept["blocks.0.inputs.0"], before, rtol=0, atol=0)


def test_manual_tensors_are_prefixed_numbered_on_repeats_and_capped_at_max_tensors() -> None:
    net = Net()
    tc.enable_tensor_capture(net, ["blocks.0"], max_tensors=3)
    for value in range(5):
        tc.register_tensor("act", torch.tensor([float(value)]))
    net(torch.randn(2, 3))
    captured = tc.get_captured_tensors_dict()
    assert list(captured) == ["blocks.0.outputs", "manual_act", "manual_act_1", "manual_act_2"]
    assert [captured[k].item() for k in ("manual_act", "manual_act_1", "manual_act_2")] == [0.0, 1.0, 2.0]


def test_nothing_is_captured_while_disabled_and_restore_takes_the_hooks_off() -> None:
    tc.register_tensor("early", torch.ones(1))
    assert len(tc.get_captured_tensors_dict()) == 0
    net = Net()
    tc.enable_tensor_capture(net, ["blocks.0"])
    net(torch.randn(2, 3))
    restore_model(net)
    assert all(not module._forward_hooks for module in net.modules())
    first = tc.get_captured_tensors_dict()["blocks.0.outputs"].clone()
    net(torch.randn(2, 3))  # not captured: the earlier capture stays readable and unchanged
    torch.testing.assert_close(tc.get_captured_tensors_dict()["blocks.0.outputs"], first, rtol=0, atol=0)
    tc.disable_tensor_capture(net)
    assert len(tc.get_captured_tensors_dict()) == 0


def test_unknown_module_names_are_refused_before_anything_changes() -> None:
    net = Net()
    with pytest.raises(ValueError, match=r"blocks\.7"):
        tc.enable_tensor_capture(net, ["blocks.0", "blocks.7"])
    assert all(not module._forward_hooks for module in net.modules())
    assert set(tc.get_available_modules(net)) == {"blocks", "blocks.0", "blocks.1", "head", "head.proj"}


def test_moe_expert_indices_are_stacked_into_one_entry() -> None:
    registry = TensorRegistry.get_instance()
    registry.configure(enabled=True, modules=[], max_tensors=None)
    registry.register_tensor("moe_auto_expert_index", torch.tensor([0, 2]))
    registry.register_tensor("moe_auto_expert_index", torch.tensor([1, 3]))
    registry.register_tensor("other", torch.ones(1))
    manual = registry.get_manual_tensors()
    assert set(manual) == {"manual_other", "auto_moe_stats.expert_index"}
    assert manual["auto_moe_stats.expert_index"].tolist() == [[0, 2], [1, 3]]


class _PaddedHead(nn.Linear):
    """Stands for a vocabulary-padded, gathered lm_head layer (NxD's attributes)."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__(3, 8)
        self.pad, self.pad_size, self.output_size, self.keep_padded_output = True, 3, 8, False
        self.sequence_parallel_enabled = sequence_parallel


def test_an_lm_head_capture_drops_vocab_padding_and_refuses_sequence_parallel_slices() -> None:
    model = nn.Sequential()
    model.add_module("lm_head", _PaddedHead(sequence_parallel=False))
    tc.enable_tensor_capture(model, ["lm_head"])
    logits = model(torch.randn(2, 3))
    torch.testing.assert_close(tc.get_captured_tensors_dict()["lm_head.outputs"], logits[:, :5], rtol=0, atol=0)
    model.lm_head.sequence_parallel_enabled = True
    with pytest.raises(ValueError, match="sequence parallel"):
        model(torch.randn(2, 3))


def test_the_hf_eager_variant_saves_each_call_to_its_own_file(tmp_path) -> None:
    net = Net()
    _, handles, original = modify_hf_eager_model_for_tensor_capture(net, ["blocks.0"], str(tmp_path))
    net(torch.randn(2, 3))
    net(torch.randn(2, 3))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "captured_tensors_cte_step_1_module_blocks.0_output.pt",
        "captured_tensors_tkg_step_2_module_blocks.0_output.pt",
    ]
    for handle in handles:
        handle.remove()
    assert original.__func__ is Net.forward


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        return self.b(self.a(x)) + shift


@pytest.fixture
def superset() -> Iterator[None]:
    RuntimeRegister.module_superset = ["a", "b"]
    yield
    RuntimeRegister.module_superset = []
    RuntimeRegister.clear_runtime_args()


def test_replacement_forces_masked_elements_of_each_module_output(superset: None) -> None:
    torch.manual_seed(1)
    chain = Chain()
    x = torch.randn(3, 2)
    forced_a = torch.full((3, 2), 5.0)
    mask_a = torch.tensor([[True, False]] * 3)
    no_b = torch.zeros(3, 2, dtype=torch.bool)
    with torch.no_grad():
        expected = chain.b(torch.where(mask_a, forced_a, chain.a(x))) + 0.5
    modify_model_for_tensor_replacement(chain)
    out = chain(x, 0.5, forced_a, torch.zeros(3, 2), mask_a, no_b)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert RuntimeRegister._tr_runtime_list == {} and RuntimeRegister._tr_mask_list == {}


def test_replacement_refuses_wrong_argument_counts_and_absent_modules(superset: None) -> None:
    chain = Chain()
    modify_model_for_tensor_replacement(chain)
    with pytest.raises(ValueError, match="expected 4 trailing replacement args"):
        chain(torch.randn(1, 2), 0.0, torch.zeros(1, 2))
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        RuntimeRegister.register_runtime_args([torch.zeros(1), 3], [torch.ones(1, dtype=torch.bool)] * 2)
    RuntimeRegister.module_superset = ["a", "c"]
    with pytest.raises(ValueError, match=r"no modules named \['c'\]"):
        modify_model_for_tensor_replacement(Chain())


def test_replacements_are_dropped_even_when_the_forward_raises(superset: None) -> None:
    chain = Chain()
    modify_model_for_tensor_replacement(chain)
    bad = torch.zeros(3, 3)  # not broadcastable to a's (1, 2) output
    with pytest.raises(RuntimeError):
        chain(torch.randn(1, 2), 0.0, bad, bad, torch.ones(3, 3, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool))
    assert RuntimeRegister._tr_runtime_list == {}
