"""NxD's checkpoint converter (``meshpar.compat.nxd.scripts.checkpoint_converter``) as NxD's examples run it: a HF
Llama's full state cut into per-rank files and put back together unchanged at several tp / pp sizes, with and
without ``GQAQKVColumnParallelLinear``'s weights, replicated key / value heads in both hardware layouts and the fused
``weight_qkv``; experts cut over ep; the converted files loaded with ``load_checkpoint`` into a model written the
way NxD's Llama example writes it (tp2, and tp4 with key / value heads replicated twice) give the HF model's loss;
what does not fit is refused."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshpar.compat.nxd.scripts.checkpoint_converter import CheckpointConverterBase
from meshpar.testing import run_distributed

V, H, HEADS, KV_HEADS, FF, LAYERS = 32, 16, 4, 2, 24, 4
HEAD = H // HEADS


def _hf_config() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5, attn_implementation="eager",
    )  # fmt: skip


def _full_checkpoint(root: Path) -> tuple[Path, Path]:
    """A HF Llama's state dict (``full.pt``) and its ``config.json``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_hf_config())
    full, config = root / "full.pt", root / "config.json"
    torch.save(model.state_dict(), full)
    config.write_text(json.dumps(model.config.to_dict()))
    return full, config


def _convert(*argv: str) -> None:
    converter = CheckpointConverterBase()
    args, _ = converter.get_arg_parser().parse_known_args(list(argv))
    converter.run(args)


def _options(tp: int, pp: int, qkv_linear: bool, multiplier: int, backend: str, fuse: bool) -> list[str]:
    return [
        "--tp_size", str(tp), "--pp_size", str(pp), "--qkv_linear", str(qkv_linear),
        "--kv_size_multiplier", str(multiplier), "--hw_backend", backend, "--fuse_qkv", str(fuse),
    ]  # fmt: skip


LAYOUTS = [
    (2, 2, False, 1, "trn2", False),
    (1, 3, False, 1, "trn2", False),
    (2, 1, True, 1, "trn1", False),
    (4, 1, True, 2, "trn1", False),
    (4, 2, True, 2, "trn2", True),
]


@pytest.mark.parametrize(("tp", "pp", "qkv_linear", "multiplier", "backend", "fuse"), LAYOUTS)
def test_full_state_cut_into_ranks_and_put_back_is_unchanged(
    tmp_path: Path, tp: int, pp: int, qkv_linear: bool, multiplier: int, backend: str, fuse: bool
) -> None:
    full, config = _full_checkpoint(tmp_path)
    options = _options(tp, pp, qkv_linear, multiplier, backend, fuse)
    shards = tmp_path / "pretrained_weight"
    _convert("--convert_from_full_state", "--input_dir", str(full), "--output_dir", str(shards), "--config",
             str(config), *options)  # fmt: skip
    files = sorted(os.listdir(shards / "model"))
    assert files == [f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt" for t in range(tp) for p in range(pp)]
    rank0 = torch.load(shards / "model" / files[0])
    q_rows, kv_rows = HEADS * HEAD // tp, KV_HEADS * multiplier * HEAD // tp
    if qkv_linear and fuse:
        assert rank0["model.layers.0.self_attn.qkv_proj.weight_qkv"].shape == (q_rows + 2 * kv_rows, H)
    elif qkv_linear:
        assert rank0["model.layers.0.self_attn.qkv_proj.weight_k"].shape == (kv_rows, H)
    else:
        assert rank0["model.layers.0.self_attn.k_proj.weight"].shape == (kv_rows, H)
    assert rank0["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * FF // tp, H)
    assert rank0["model.embed_tokens.weight"].shape == (V // tp, H)
    # pipeline cuts as NxD's create_partitions makes them: the extra layers on the last stages
    layers = {int(k.split(".")[2]) for k in rank0 if k.startswith("model.layers.")}
    assert layers == set(range(LAYERS // pp)) and ("lm_head.weight" in rank0) == (pp == 1)
    merged = tmp_path / "merged"
    _convert("--convert_to_full_state", "--input_dir", str(shards / "model"), "--output_dir", str(merged),
             "--config", str(config), *options)  # fmt: skip
    back, original = torch.load(merged / "checkpoint.pt"), torch.load(full)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("backend", ["trn1", "trn2"])
def test_biases_convert_with_their_layers(tmp_path: Path, backend: str) -> None:
    """Qwen2's q / k / v biases (cut and replicated as their weights) and row-parallel biases (whole on every rank),
    cut at tp4 with key / value heads replicated and put back unchanged."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
    ))  # fmt: skip
    state = model.state_dict()
    state["model.layers.0.self_attn.o_proj.bias"] = torch.randn(H)  # as a family with row-parallel biases has
    state["model.layers.0.mlp.down_proj.bias"] = torch.randn(H)
    full, config = tmp_path / "full.pt", tmp_path / "config.json"
    torch.save(state, full)
    config.write_text(json.dumps(model.config.to_dict()))
    options = _options(4, 1, True, 2, backend, False)
    _convert("--convert_from_full_state", "--input_dir", str(full), "--output_dir", str(tmp_path / "out"), "--config",
             str(config), *options)  # fmt: skip
    rank3 = torch.load(tmp_path / "out" / "model" / "dp_rank_00_tp_rank_03_pp_rank_00.pt")
    k_bias = state["model.layers.0.self_attn.k_proj.bias"].view(KV_HEADS, HEAD)
    assert torch.equal(rank3["model.layers.0.self_attn.qkv_proj.bias_k"], k_bias[1])  # rank 3: head 1 either way
    assert torch.equal(rank3["model.layers.0.mlp.down_proj.bias"], state["model.layers.0.mlp.down_proj.bias"])
    _convert("--convert_to_full_state", "--input_dir", str(tmp_path / "out" / "model"), "--output_dir",
             str(tmp_path / "back"), "--config", str(config), *options)  # fmt: skip
    back = torch.load(tmp_path / "back" / "checkpoint.pt")
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())


def test_trn2_replicates_each_key_value_head_in_place_and_trn1_the_whole_set(tmp_path: Path) -> None:
    """tp4 with 2 key / value heads replicated twice: on trn2 ranks 0 and 1 hold head 0 (and query heads 0, 1),
    on trn1 ranks 0 and 2 do (query heads 0 and 1 sit on ranks 0 and 2)."""
    full, config = _full_checkpoint(tmp_path)
    state = torch.load(full)
    k = state["model.layers.0.self_attn.k_proj.weight"].view(KV_HEADS, HEAD, H)
    q = state["model.layers.0.self_attn.q_proj.weight"].view(HEADS, HEAD, H)
    for backend, kv_of_rank, q_of_rank in (("trn2", [0, 0, 1, 1], [0, 1, 2, 3]), ("trn1", [0, 1, 0, 1], [0, 2, 1, 3])):
        out = tmp_path / backend
        _convert("--convert_from_full_state", "--input_dir", str(full), "--output_dir", str(out), "--config",
                 str(config), *_options(4, 1, True, 2, backend, False))  # fmt: skip
        for rank in range(4):
            part = torch.load(out / "model" / f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_00.pt")
            assert torch.equal(part["model.layers.0.self_attn.qkv_proj.weight_k"], k[kv_of_rank[rank]]), backend
            assert torch.equal(part["model.layers.0.self_attn.qkv_proj.weight_q"], q[q_of_rank[rank]]), backend


class ExpertConverter(CheckpointConverterBase):
    """As NxD's Mixtral converter sets it: experts stacked ``[experts, in, out]`` by the model's own hooks."""

    gate_up_proj_partition_dim = 2
    down_proj_partition_dim = 1


def test_experts_are_cut_over_ep_then_tp_and_put_back(tmp_path: Path) -> None:
    full, config = _full_checkpoint(tmp_path)
    state = torch.load(full)
    for i in range(LAYERS):  # the dense MLP replaced by 4 experts, as Mixtral's converter does it
        for part in ("gate_proj", "up_proj", "down_proj"):
            del state[f"model.layers.{i}.mlp.{part}.weight"]
        for part, shape in (("gate_proj", (4, H, FF)), ("up_proj", (4, H, FF)), ("down_proj", (4, FF, H))):
            state[f"model.layers.{i}.mlp.expert_mlps.mlp_op.{part}.weight"] = torch.randn(shape)
    torch.save(state, full)
    out, options = tmp_path / "ep", ["--tp_size", "2", "--ep_size", "2", "--hw_backend", "trn2"]
    converter = ExpertConverter()

    def convert(*argv: str) -> None:
        args, _ = converter.get_arg_parser().parse_known_args([*argv, "--config", str(config), *options])
        converter.run(args)

    convert("--convert_from_full_state", "--input_dir", str(full), "--output_dir", str(out))
    for ep in range(2):
        part = torch.load(out / "model" / f"dp_rank_00_ep_rank_{ep:02d}_tp_rank_01_pp_rank_00.pt")
        fused = part["model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight"]
        gate = state["model.layers.0.mlp.expert_mlps.mlp_op.gate_proj.weight"][2 * ep : 2 * ep + 2, :, FF // 2 :]
        assert fused.shape == (2, H, FF) and torch.equal(fused[..., : FF // 2], gate)
        assert ("model.embed_tokens.weight" in part) == (ep == 0)  # other parameters on ep rank 0 only
    convert("--convert_to_full_state", "--input_dir", str(out / "model"), "--output_dir", str(tmp_path / "back"))
    back = torch.load(tmp_path / "back" / "checkpoint.pt")
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())


def test_command_line_flags_and_refusals(tmp_path: Path) -> None:
    parser = CheckpointConverterBase().get_arg_parser()
    required = ["--output_dir", str(tmp_path), "--hw_backend", "trn2"]
    args = parser.parse_args([*required, "--qkv_linear", "False", "--fuse_qkv", "True"])
    assert args.qkv_linear is False and args.fuse_qkv is True  # NxD's type=bool would read "False" as true
    with pytest.raises(ValueError, match="Exactly one"):
        _convert(*required)
    for conversion in ("--convert_to_xser", "--convert_from_xser"):
        with pytest.raises(ValueError, match="--input_dir must name"):
            _convert(*required, conversion)
    with pytest.raises(NotImplementedError, match="pad_attn_heads"):
        _convert(*required, "--convert_from_full_state", "--pad_attn_heads", "True")
    full, config = _full_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="do not split over tp=8"):
        _convert("--convert_from_full_state", "--input_dir", str(full), "--output_dir", str(tmp_path / "x"),
                 "--config", str(config), *_options(8, 1, True, 1, "trn2", False))  # fmt: skip


def test_an_nxdt_yaml_config_gives_the_sizes_the_converter_reads(tmp_path: Path) -> None:
    from meshpar.compat.nxd.scripts.yaml_converter import convert_yaml_to_json

    yaml_file = tmp_path / "nxdt.yaml"
    yaml_file.write_text(
        "model:\n  num_layers: 4\n  num_attention_heads: 4\n  hidden_size: 16\n  num_kv_heads: 2\n"
        "  moe:\n    num_experts: 8\n"
    )
    written = convert_yaml_to_json(str(yaml_file), str(tmp_path / "config.json"))
    assert json.loads(Path(written).read_text()) == {
        "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 16, "num_key_value_heads": 2,
        "num_local_experts": 8,
    }  # fmt: skip


def _rewrite_as_xser(path: Path) -> None:
    """The plain torch file at ``path`` rewritten as torch_xla writes a split-tensor checkpoint (``use_xser=True``):
    a pickle naming ``torch_xla.utils.serialization.TensorReference`` in each tensor's place, the tensors in
    ``<path>.tensors/tensor_<tid>.pt``. A stand-in module plays torch_xla while writing and is gone when reading."""

    class TensorReference:
        def __init__(self, tid: int) -> None:
            self.tid = tid

    names = ("torch_xla", "torch_xla.utils", "torch_xla.utils.serialization")
    stand_in = {name: types.ModuleType(name) for name in names}
    TensorReference.__module__, TensorReference.__qualname__ = names[-1], "TensorReference"
    stand_in[names[-1]].TensorReference = TensorReference
    folder = Path(f"{path}.tensors")
    folder.mkdir()
    count = iter(range(1 << 30))

    def referenced(value: object) -> object:
        if isinstance(value, dict):
            return {k: referenced(v) for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            tid = next(count)
            torch.save(value, folder / f"tensor_{tid}.pt")
            return TensorReference(tid)
        return value

    structure = referenced(torch.load(path))
    sys.modules.update(stand_in)
    try:
        torch.save(structure, path)
    finally:
        for name in names:
            sys.modules.pop(name)


def test_split_tensor_files_nxd_wrote_are_read_without_torch_xla(tmp_path: Path) -> None:
    full, config = _full_checkpoint(tmp_path)
    options = _options(2, 2, True, 1, "trn2", False)
    shards = tmp_path / "shards"
    _convert("--convert_from_full_state", "--input_dir", str(full), "--output_dir", str(shards), "--config",
             str(config), *options)  # fmt: skip
    plain = {f.name: torch.load(f) for f in (shards / "model").iterdir()}
    for name in plain:
        _rewrite_as_xser(shards / "model" / name)
    assert "torch_xla" not in sys.modules
    _convert("--convert_from_xser", "--input_dir", str(shards / "model"), "--output_dir", str(tmp_path / "plain"),
             *options)  # fmt: skip
    for name, state in plain.items():
        again = torch.load(tmp_path / "plain" / "model" / name)
        assert again.keys() == state.keys() and all(torch.equal(again[k], v) for k, v in state.items())
    _convert("--convert_to_full_state", "--load_xser", "True", "--input_dir", str(shards / "model"), "--output_dir",
             str(tmp_path / "merged"), "--config", str(config), *options)  # fmt: skip
    back, original = torch.load(tmp_path / "merged" / "checkpoint.pt"), torch.load(full)
    assert back.keys() == original.keys() and all(torch.equal(back[k], v) for k, v in original.items())


def _read_as_torch_xla(path: Path) -> object:
    """What torch_xla's loader gets from a split-tensor file: its object unpickled with torch_xla's
    ``TensorReference`` class (a stand-in module plays torch_xla; each reference must be of that class), each
    reference replaced by ``<path>.tensors/tensor_<tid>.pt``."""

    class TensorReference:
        tid: int

    names = ("torch_xla", "torch_xla.utils", "torch_xla.utils.serialization")
    stand_in = {name: types.ModuleType(name) for name in names}
    TensorReference.__module__, TensorReference.__qualname__ = names[-1], "TensorReference"
    stand_in[names[-1]].TensorReference = TensorReference
    sys.modules.update(stand_in)
    try:
        structure = torch.load(path, weights_only=False)
    finally:
        for name in names:
            sys.modules.pop(name)

    def resolved(value: object) -> object:
        assert not isinstance(value, torch.Tensor), "torch_xla's files hold references, not tensors"
        if isinstance(value, dict):
            return {k: resolved(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(resolved(v) for v in value)
        if isinstance(value, TensorReference):
            return torch.load(Path(f"{path}.tensors") / f"tensor_{value.tid}.pt")
        return value

    return resolved(structure)


def test_split_tensor_files_are_written_as_torch_xla_writes_them(tmp_path: Path) -> None:
    """``--save_xser`` and ``--convert_to_xser`` write files torch_xla (NxD on Neuron) reads back equal to the plain
    ones, under NxD's names, and meshpar reads them too."""
    from meshpar.compat.nxd import _xser

    full, config = _full_checkpoint(tmp_path)
    options = _options(2, 2, True, 1, "trn2", False)
    plain, split, converted = tmp_path / "plain", tmp_path / "split", tmp_path / "converted"
    _convert("--convert_from_full_state", "--input_dir", str(full), "--output_dir", str(plain), "--config",
             str(config), *options)  # fmt: skip
    _convert("--convert_from_full_state", "--input_dir", str(full), "--output_dir", str(split), "--config",
             str(config), "--save_xser", "True", *options)  # fmt: skip
    _convert("--convert_to_xser", "--input_dir", str(plain / "model"), "--output_dir", str(converted), *options)
    files = sorted(f.name for f in (plain / "model").iterdir())
    assert len(files) == 4
    for name in files:
        want = torch.load(plain / "model" / name)
        for folder in (split, converted):
            assert (folder / "model" / f"{name}.tensors").is_dir()
            for got in (_read_as_torch_xla(folder / "model" / name), _xser.load(folder / "model" / name)):
                assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    assert "torch_xla" not in sys.modules
    with pytest.raises(IsADirectoryError, match="is a folder"):
        _xser.save({"w": torch.ones(1)}, tmp_path)


def test_an_ep_ranks_split_tensor_file_reads_the_shared_tensors_from_ep_rank_0(tmp_path: Path) -> None:
    """Under expert parallelism NxD's trainer writes every ep rank's object file whole, but the tensors that are not
    experts' only into ep rank 0's folder (same tids on every ep rank: the same model in the same order): ep rank
    1's file reads its experts from its own folder and the rest from rank 0's; a tensor in neither is named."""
    from meshpar.compat.nxd import _xser

    generator = torch.Generator().manual_seed(4)
    shared = {"embed.weight": torch.randn(4, 3, generator=generator)}
    shared["norm.weight"] = torch.randn(3, generator=generator)
    experts = [{"experts.gate_up.weight": torch.randn(2, 3, 4, generator=generator)} for _ in range(2)]
    files = []
    for ep in range(2):
        file = tmp_path / f"dp_rank_00_ep_rank_{ep:02d}_tp_rank_00_pp_rank_00.pt"
        torch.save({"model": {**shared, **experts[ep]}, "epoch": 3}, file)
        _rewrite_as_xser(file)
        files.append(file)
    for tid in (0, 1):  # the shared tensors' files, written by ep rank 0 only
        (tmp_path / f"{files[1].name}.tensors" / f"tensor_{tid}.pt").unlink()
    for ep in range(2):
        loaded = _xser.load(files[ep])
        assert loaded["epoch"] == 3 and loaded["model"].keys() == {**shared, **experts[ep]}.keys()
        assert all(torch.equal(loaded["model"][k], v) for k, v in {**shared, **experts[ep]}.items())
    (tmp_path / f"{files[0].name}.tensors" / "tensor_1.pt").unlink()
    with pytest.raises(FileNotFoundError, match="tensor 1 is in neither"):
        _xser.load(files[1])


# ---------------------------------------------------------------- loaded into a model as NxD's example writes it


class Attention(nn.Module):
    def __init__(self, fuse: bool, multiplier: int) -> None:
        super().__init__()
        from meshpar.compat.nxd.modules.qkv_linear import GQAQKVColumnParallelLinear
        from meshpar.compat.nxd.parallel_layers import RowParallelLinear, parallel_state

        tp = parallel_state.get_tensor_model_parallel_size()
        self.qkv_proj = GQAQKVColumnParallelLinear(
            H, [HEADS * HEAD, KV_HEADS * HEAD], bias=False, gather_output=False, fuse_qkv=fuse,
            kv_size_multiplier=multiplier,
        )  # fmt: skip
        self.o_proj = RowParallelLinear(HEADS * HEAD, H, bias=False, input_is_parallel=True)
        self.heads, self.kv_heads = HEADS // tp, KV_HEADS * multiplier // tp

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x)
        q = q.view(b, s, self.heads, HEAD).transpose(1, 2)
        k, v = (t.view(b, s, self.kv_heads, HEAD).transpose(1, 2) for t in (k, v))
        q, k = apply_rotary_pos_emb(q, k, *rotary)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(attn.transpose(1, 2).reshape(b, s, self.heads * HEAD))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from meshpar.compat.nxd.parallel_layers import ColumnParallelLinear, RowParallelLinear

        self.gate_up_proj = ColumnParallelLinear(H, 2 * FF, bias=False, gather_output=False, stride=2)
        self.down_proj = RowParallelLinear(FF, H, bias=False, input_is_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, fuse: bool, multiplier: int) -> None:
        super().__init__()
        from meshpar.compat.nxd.modules.rms_norm import RMSNorm

        self.self_attn, self.mlp = Attention(fuse, multiplier), MLP()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps=1e-5), RMSNorm(H, eps=1e-5)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, fuse: bool, multiplier: int) -> None:
        super().__init__()
        from meshpar.compat.nxd.modules.rms_norm import RMSNorm
        from meshpar.compat.nxd.parallel_layers import ParallelEmbedding

        self.embed_tokens = ParallelEmbedding(V, H)
        self.layers = nn.ModuleList(Layer(fuse, multiplier) for _ in range(LAYERS))
        self.norm = RMSNorm(H, eps=1e-5)


class NxDLlama(nn.Module):
    """NxD's Llama example's module names: ``model.*`` and a vocab-parallel ``lm_head``."""

    def __init__(self, fuse: bool, multiplier: int) -> None:
        super().__init__()
        from meshpar.compat.nxd.parallel_layers import ColumnParallelLinear

        self.model = Body(fuse, multiplier)
        self.lm_head = ColumnParallelLinear(H, V, bias=False, gather_output=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, rotary: tuple[torch.Tensor, ...]) -> torch.Tensor:
        from meshpar.compat.nxd.parallel_layers.loss_functions import parallel_cross_entropy

        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h, rotary)
        return parallel_cross_entropy(self.lm_head(self.model.norm(h)), labels).mean()


def loaded_case(root: str, multiplier: int, fuse: bool, platform: str) -> None:
    with mock.patch.dict(os.environ, {"NEURON_PLATFORM_TARGET_OVERRIDE": platform}):
        _loaded_case(root, multiplier, fuse)


def _loaded_case(root: str, multiplier: int, fuse: bool) -> None:
    from transformers import LlamaForCausalLM

    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=torch.distributed.get_world_size())
    dense = LlamaForCausalLM(_hf_config())
    dense.load_state_dict(torch.load(os.path.join(root, "full.pt")))
    model = NxDLlama(fuse, multiplier)
    nxd.load_checkpoint(root, tag="pretrained_weight", model=model, strict=True)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(4))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(inputs.shape[1])[None].expand_as(inputs)
    rotary = dense.model.rotary_emb(dense.model.embed_tokens(inputs), positions)
    loss = model(inputs, labels, rotary)
    want = F.cross_entropy(dense(inputs).logits.reshape(-1, V), labels.reshape(-1))
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("tp", "multiplier", "fuse", "xser", "platform"),
    [(2, 1, False, True, "trn2"), (4, 2, True, False, "trn2"), (4, 2, False, False, "trn1")],
)
def test_converted_files_load_into_the_examples_model_and_give_the_hf_loss(
    tmp_path: Path, tp: int, multiplier: int, fuse: bool, xser: bool, platform: str
) -> None:
    """Also from torch_xla's split-tensor files (NxD's ``use_xser=True``) at tp2, and files cut for Trn1's layout
    into a model run on it (``NEURON_PLATFORM_TARGET_OVERRIDE=trn1``)."""
    full, config = _full_checkpoint(tmp_path)
    _convert("--convert_from_full_state", "--input_dir", str(full), "--output_dir", str(tmp_path / "pretrained_weight"),
             "--config", str(config), *_options(tp, 1, True, multiplier, platform, fuse))  # fmt: skip
    if xser:
        for file in list((tmp_path / "pretrained_weight" / "model").iterdir()):
            _rewrite_as_xser(file)
    run_distributed(loaded_case, tp, str(tmp_path), multiplier, fuse, platform)


def mismatch_case(root: str) -> list[str]:
    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=torch.distributed.get_world_size())
    errors = []
    for model, strict in ((NxDLlama(False, 1), True), (NxDLlama(False, 1).model, False)):
        try:
            nxd.load_checkpoint(root, tag="pretrained_weight", model=model, strict=strict)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_files_cut_for_another_layout_or_model_are_refused_on_every_rank(tmp_path: Path) -> None:
    """Files cut for tp2 loaded at tp4 (shapes differ); the same files into a model lacking ``lm_head`` with
    ``strict=False`` (keys it does not hold: refused, not skipped)."""
    full, config = _full_checkpoint(tmp_path)
    _convert("--convert_from_full_state", "--input_dir", str(full), "--output_dir", str(tmp_path / "pretrained_weight"),
             "--config", str(config), *_options(2, 1, True, 1, "trn2", False))  # fmt: skip
    for tp in (2, 4):
        for rank_errors in run_distributed(mismatch_case, tp, str(tmp_path)):
            if tp == 4:  # ranks 2 and 3 have no file; 0 and 1 find tp2's shapes (and, without lm_head, its keys)
                assert len(rank_errors) == 2, rank_errors
                assert all(e.startswith("load_checkpoint failed on rank") for e in rank_errors)
                assert "size mismatch" in rank_errors[0] or "does not exist" in rank_errors[0], rank_errors
            else:
                assert len(rank_errors) == 1 and "keys this rank's model does not hold" in rank_errors[0]


# ---------------------------------------------------------------- parallel_layers.save / load with NxD's keywords


class Pair(nn.Module):
    def __init__(self, parallel: bool) -> None:
        super().__init__()
        if parallel:
            from meshpar.compat.nxd.parallel_layers import ColumnParallelLinear, RowParallelLinear

            self.up = ColumnParallelLinear(H, FF, bias=True, gather_output=False)
            self.down = RowParallelLinear(FF, H, bias=True, input_is_parallel=True)
        else:
            self.up, self.down = nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def parallel_layers_case(tmp: str) -> None:
    from meshpar.compat.nxd import parallel_layers
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=torch.distributed.get_world_size())
    torch.manual_seed(0)
    dense, x = Pair(False), torch.randn(3, H)
    if torch.distributed.get_rank() == 0:
        torch.save({"model": dense.state_dict(), "step": 7}, os.path.join(tmp, "full.pt"))
    torch.distributed.barrier()
    # a full (unsharded) checkpoint cut for the model: NxD's sharded=False
    model = Pair(True)
    rest = parallel_layers.load(os.path.join(tmp, "full.pt"), model_or_optimizer=model, sharded=False)
    assert rest == {"step": 7}  # NxD returns the checkpoint without the entry it loaded
    torch.testing.assert_close(model(x), dense(x))
    # NxD's positional order: save(checkpoint, dir, save_serially, save_xser, down_cast_bf16, master_dp_only)
    parallel_layers.save({"model": model.state_dict()}, os.path.join(tmp, "bf16"), True, False, True)
    again = Pair(True)
    assert parallel_layers.load(os.path.join(tmp, "bf16"), None, again, "model", False, True, True) == {}
    assert all(p.dtype == torch.float32 for p in again.parameters())  # loaded into fp32 parameters
    torch.testing.assert_close(again(x), dense(x), atol=3e-2, rtol=3e-2)  # from bf16 copies
    # a file NxD wrote itself, in torch_xla's split-tensor format (load_xser), and one with a key the model lacks
    nxd_dir = os.path.join(tmp, "nxd", f"tp_rank_{torch.distributed.get_rank():02d}_pp_rank_00")
    os.makedirs(os.path.dirname(nxd_dir), exist_ok=True)
    torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, nxd_dir)
    _rewrite_as_xser(Path(nxd_dir))
    third = Pair(True)
    parallel_layers.load(os.path.join(tmp, "nxd"), model_or_optimizer=third, load_xser=True)
    torch.testing.assert_close(third(x), dense(x))
    # save_xser: NxD's object file and tensors folder per rank, read back by torch_xla as by meshpar; every dp rank's
    # own (master_dp_only=False) named as NxD names it
    rank = torch.distributed.get_rank()
    for master_dp_only, name in (
        (True, f"tp_rank_{rank:02d}_pp_rank_00"),
        (False, f"tp_rank_{rank:02d}_pp_rank_00_dp_rank_00"),
    ):
        folder = os.path.join(tmp, f"xser_{master_dp_only}")
        parallel_layers.save(
            {"model": model.state_dict(), "step": 3}, folder, save_xser=True, master_dp_only=master_dp_only
        )
        assert {name, f"{name}.tensors"} <= set(os.listdir(folder)) and len(os.listdir(folder)) == 4  # 2 tp ranks
        written = _read_as_torch_xla(Path(folder) / name)
        assert written["step"] == 3 and written["model"].keys() == model.state_dict().keys()
        fourth = Pair(True)
        rest = parallel_layers.load(folder, model_or_optimizer=fourth, load_xser=True, master_dp_only=master_dp_only)
        assert rest == {"step": 3}
        torch.testing.assert_close(fourth(x), dense(x))
    with pytest.raises(ValueError, match="holds keys ColumnParallelLinear does not"):
        bare = os.path.join(tmp, "bare", f"tp_rank_{torch.distributed.get_rank():02d}_pp_rank_00", "checkpoint.pt")
        os.makedirs(os.path.dirname(bare), exist_ok=True)
        torch.save({"model": model.state_dict()}, bare)
        parallel_layers.load(os.path.join(tmp, "bare"), model_or_optimizer=model.up, strict=False)


def test_parallel_layers_save_and_load_take_nxds_keywords(tmp_path: Path) -> None:
    """``load(sharded=False)`` cuts a full checkpoint, ``model_or_optimizer`` / positional order / return value as
    NxD's, ``save(down_cast_bf16=True)``, NxD's own split-tensor files, keys the model lacks refused."""
    run_distributed(parallel_layers_case, 2, str(tmp_path))


def test_a_split_tensor_save_over_another_never_leaves_references_to_the_other(tmp_path: Path, monkeypatch) -> None:
    """Saving again at a path replaces object and tensors together; a save cut short (here: the tensors folder's
    rename fails) leaves no object file, so a load fails instead of reading the old references against the new
    tensors."""
    from meshpar.compat.nxd import _xser

    path = tmp_path / "tp_rank_00_pp_rank_00"
    _xser.save({"a": torch.zeros(2), "b": torch.ones(3)}, path)
    _xser.save({"b": torch.full((3,), 7.0), "a": torch.full((2,), 5.0)}, path)  # other order: other tids
    again = _xser.load(path)
    assert torch.equal(again["a"], torch.full((2,), 5.0)) and torch.equal(again["b"], torch.full((3,), 7.0))
    real_replace = os.replace

    def failing_replace(src: object, dst: object) -> None:
        if str(src).endswith(".tensors.tmp"):
            raise OSError("cut short")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="cut short"):
        _xser.save({"a": torch.full((2,), 9.0), "b": torch.full((3,), 9.0)}, path)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not path.exists()
    with pytest.raises(FileNotFoundError):
        _xser.load(path)
