"""DCP checkpoints hold every parameter (and its optimizer state) in the HF model's own shape and names, so torch's
standard tools read them: ``dcp_to_torch_save`` + ``load_state_dict``, and ``dcp.load`` into a plain model's full
state dict (a tied weight is stored once and readable under both names)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import meshpar
from meshpar import checkpoint
from meshpar._compat import DTensor
from meshpar._shards import in_model_layout
from meshpar.optim import DistributedOptimizer
from meshpar.testing import run_distributed, setup_parallel
from tests.hf._configs import batch, build

pytestmark = pytest.mark.slow  # not in make test-fast: every packed layout saved and reloaded

PACKED = "transformer.h.0.attn.c_attn.weight"  # meshpar keeps it [in, 3, hidden]; HF has [in, 3 * hidden]


def _full(tensor: torch.Tensor, model: torch.nn.Module, name: str) -> torch.Tensor:
    """The whole tensor of parameter ``name`` (or of its state), in the HF model's own shape."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return in_model_layout(full.detach(), model, name).clone()


def save_case(
    directory: str, family: str, tp: int, fsdp: bool, kv_heads: int | None
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]] | None:
    """Train one AdamW step in a sharded layout, save, and return the whole tensors in HF's shapes (rank 0)."""
    setup_parallel(tp=tp)
    dense = build(family, kv_heads=kv_heads)
    model = meshpar.parallelize(copy.deepcopy(dense), {"tensor_parallel_size": tp, "fsdp": fsdp})
    optimizer = DistributedOptimizer(model, torch.optim.AdamW, lr=0.01)
    model.train_step(**batch(family))
    optimizer.step()
    checkpoint.save(directory, model, optimizer, step=1)
    module = model.local_modules()[0]
    params = dict(module.named_parameters())
    state = optimizer.state_dict()["state"]
    full = {
        "model": {name: _full(p, module, name) for name, p in params.items()},
        "exp_avg": {name: _full(entry["exp_avg"], module, name) for name, entry in state.items()},
    }
    return (full, model.tied_parameters) if torch.distributed.get_rank() == 0 else None


CASES = {  # world, family, tp, fsdp, kv heads
    "gpt2-tp2": (2, "gpt2", 2, False, None),  # packed QKV
    "gpt2-tp2-fsdp-dp2": (4, "gpt2", 2, True, None),
    "llama-tp2-kv1": (2, "llama", 2, False, 1),  # KV heads replicated
    "mixtral-tp2": (2, "mixtral", 2, False, None),  # 3-D experts
    "qwen3-tp2": (2, "qwen3", 2, False, None),
    "phi3-tp2": (2, "phi3", 2, False, None),  # packed grouped-query [q | k | v] and [gate | up]
    "phi3-tp2-fsdp-dp2": (4, "phi3", 2, True, None),
    "bert-tp2": (2, "bert", 2, False, None),
}


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_stores_hf_shapes_that_torch_tools_read(tmp_path: Path, case: str) -> None:
    world, family, tp, fsdp, kv_heads = CASES[case]
    expected, tied = run_distributed(save_case, world, str(tmp_path), family, tp, fsdp, kv_heads)[0]
    reference = build(family, kv_heads=kv_heads)
    path = checkpoint.latest_checkpoint(tmp_path)
    if family == "gpt2":
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        hidden = reference.config.n_embd
        assert tuple(metadata[f"model.{PACKED}"].size) == (hidden, 3 * hidden)
        assert tuple(metadata[f"optim.state.{PACKED}.exp_avg"].size) == (hidden, 3 * hidden)

    # dcp_to_torch_save + load_state_dict (strict) into the stock HF class
    dcp_to_torch_save(str(path), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    plain = type(reference)(reference.config)
    weights = dict(whole["model"])
    for alias, source in tied.items():  # tied: both names readable, the data stored once
        assert torch.equal(weights[alias], weights[source]), alias
        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
        chunks = {i.fqn: info for i, info in storage.items() if i.fqn in (f"model.{alias}", f"model.{source}")}
        assert chunks[f"model.{alias}"] == chunks[f"model.{source}"], chunks
    plain.load_state_dict(weights, strict=True)
    for name, param in plain.named_parameters():
        torch.testing.assert_close(param.detach(), expected["model"][name], rtol=0, atol=0, msg=name)
    for name, value in expected["exp_avg"].items():
        torch.testing.assert_close(whole["optim"]["state"][name]["exp_avg"], value, rtol=0, atol=0, msg=name)

    # dcp.load into a plain, unsharded model's own full state dict, tied names included
    other = type(reference)(reference.config).eval()
    state = {k: v for k, v in other.state_dict().items() if k in weights}
    assert set(tied) <= set(state)
    dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    for name, value in state.items():
        if name in expected["model"]:
            torch.testing.assert_close(value, expected["model"][name], rtol=0, atol=0, msg=name)
    data = batch(family)
    torch.testing.assert_close(other(**data).loss, plain.eval()(**data).loss, rtol=0, atol=0)


def load_case(directory: str, family: str, tp: int, fsdp: bool) -> dict[str, torch.Tensor] | None:
    """Load the checkpoint into a fresh model in another layout; the whole parameters in HF's shapes (rank 0)."""
    setup_parallel(tp=tp)
    model = meshpar.parallelize(build(family), {"tensor_parallel_size": tp, "fsdp": fsdp})
    optimizer = DistributedOptimizer(model, torch.optim.AdamW, lr=0.01)
    checkpoint.load(directory, model, optimizer)
    module = model.local_modules()[0]
    full = {name: _full(p, module, name) for name, p in module.named_parameters()}
    return full if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("world, tp, fsdp", [(4, 2, True), (1, 1, False)])
def test_packed_grouped_query_weights_reshard_on_load(tmp_path: Path, world: int, tp: int, fsdp: bool) -> None:
    """Phi-3's grouped-query [q | k | v] saved at tp=2 loads into tp=2 x FSDP dp=2 (boxes of whole groups split
    again by FSDP) and into one process: every parameter equals the saved one."""
    expected, _ = run_distributed(save_case, 2, str(tmp_path), "phi3", 2, False, None)[0]
    loaded = run_distributed(load_case, world, str(tmp_path), "phi3", tp, fsdp)[0]
    assert loaded.keys() == expected["model"].keys()
    for name, value in loaded.items():
        torch.testing.assert_close(value, expected["model"][name], rtol=0, atol=0, msg=name)
