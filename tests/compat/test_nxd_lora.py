"""NxD's LoRA (``meshpar.compat.nxd.modules.lora``) against dense references: each LoRA layer adds
``scaling * B(A(x))`` to its base and merges / unmerges that delta exactly; ``LoraModel`` on a transformers model
picks the default targets, freezes all but the adapters, saves and loads an adapter and a merged base (which plain
transformers loads); through NxD's trainer at tp 2 (with dp 2, with sequence parallelism) and pp 2 a LoRA model
trains like the same adapters on the dense model (loss, grad norm, every parameter after each step, the base
frozen), its saved adapter is the dense adapter whatever the tp, and NxD's checkpoints carry it; the grouped q/k/v
layer's adapters at tp 4 with replicated kv heads give the dense heads and grads."""

from __future__ import annotations

import copy
import json
import os
from unittest import mock

import pytest
import torch
from torch import nn

from meshpar.compat.nxd.modules.lora import LoraConfig, LoraModel, get_lora_model
from meshpar.compat.nxd.modules.lora.layer import LoraConv2d, LoraEmbedding, LoraLinear
from meshpar.testing import run_distributed
from tests.compat.test_nxd_trainer import Block, Net, S, V
from tests.seeds._dense import assert_params_match, copy_dense_into


def _config(**overrides: object) -> LoraConfig:
    values = {"lora_rank": 4, "lora_alpha": 8, "init_lora_weights": "gaussian"}
    values.update(overrides)
    return LoraConfig(**values)


def _randomise_b(model: nn.Module, seed: int = 3) -> None:
    """B starts at zero; a random B makes the adapter visible (and A's grad non-zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_B" in name or "lora_embedding_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


# -- single layers -----------------------------------------------------------------------------------------------------
def _linear_reference(lora: LoraLinear, x: torch.Tensor) -> torch.Tensor:
    a, b = lora.lora_A.weight, lora.lora_B.weight
    return lora.get_base_layer()(x) + lora.scaling * (x @ a.T @ b.T)


@pytest.mark.parametrize("rslora", [False, True])
def test_lora_layers_add_the_scaled_low_rank_update_and_merge_it_exactly(rslora: bool) -> None:
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    config = _config(use_rslora=rslora)
    scale = 8 / (2.0 if rslora else 4)  # alpha / sqrt(r) or alpha / r
    x = torch.randn(3, 6)
    cases = [
        (LoraLinear(nn.Linear(6, 5), config), x, _linear_reference),
        (LoraLinear(Conv1D(5, 6), config, is_conv_1d_layer=True), x, _linear_reference),
        (LoraEmbedding(nn.Embedding(10, 5, padding_idx=0), config), torch.tensor([[0, 3, 9]]),
         lambda m, ids: m.get_base_layer()(ids) + m.scaling * (m.lora_embedding_A.T[ids] @ m.lora_embedding_B.T)),
        (LoraConv2d(nn.Conv2d(3, 4, 3, padding=1), config), torch.randn(2, 3, 5, 5),
         lambda m, img: m.get_base_layer()(img) + m.scaling * m.lora_B(m.lora_A(img))),
        (LoraConv2d(nn.Conv2d(3, 4, 1), config), torch.randn(2, 3, 5, 5),
         lambda m, img: m.get_base_layer()(img) + m.scaling * m.lora_B(m.lora_A(img))),
    ]  # fmt: skip
    for layer, inputs, reference in cases:
        assert layer.scaling == scale and "lora." in repr(layer)
        torch.testing.assert_close(layer(inputs), layer.get_base_layer()(inputs))  # B (or A) starts at zero
        _randomise_b(layer)
        expected = reference(layer, inputs)
        torch.testing.assert_close(layer(inputs), expected, atol=1e-5, rtol=1e-5)
        base_weight = layer.get_base_layer().weight.detach().clone()
        layer.merge(safe_merge=True)
        torch.testing.assert_close(layer(inputs), expected, atol=1e-5, rtol=1e-5)  # the base alone, merged
        torch.testing.assert_close(layer.get_base_layer()(inputs), expected, atol=1e-5, rtol=1e-5)
        layer.unmerge()
        torch.testing.assert_close(layer.get_base_layer().weight, base_weight, atol=1e-6, rtol=0)
        with pytest.warns(UserWarning, match="Already unmerged"):
            layer.unmerge()


def test_lora_layer_refusals() -> None:
    with pytest.raises(ValueError, match="positive integer"):
        LoraLinear(nn.Linear(4, 4), _config(lora_rank=0))
    with pytest.raises(ValueError, match="grouped convolution"):
        LoraConv2d(nn.Conv2d(4, 4, 3, groups=2), _config())
    with pytest.raises(ValueError, match="Unknown LoRA parameters initialization"):
        LoraLinear(nn.Linear(4, 4), _config(init_lora_weights="uniform"))
    broken = LoraLinear(nn.Linear(4, 4), _config())
    with torch.no_grad():
        broken.lora_B.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaNs"):
        broken.merge(safe_merge=True)
    assert not broken.merged and torch.isfinite(broken.get_base_layer().weight).all()

    class WithNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.proj = nn.LayerNorm(4), nn.Linear(4, 4)

    with pytest.raises(ValueError, match="not supported"):
        LoraModel(WithNorm(), _config(target_modules=["norm"]))
    with pytest.raises(ValueError, match="not found in the base model"):
        LoraModel(WithNorm(), _config(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="target modules automatically"):
        LoraModel(WithNorm(), _config())


# -- LoraModel on a transformers model -----------------------------------------------------------------------------
def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("bias", ["none", "all", "lora_only"])
def test_lora_model_targets_freezes_and_trains_only_adapters(bias: str, tmp_path) -> None:
    base = _llama()
    ids = torch.randint(0, 32, (2, 7))
    before = base(ids).logits.detach()
    model = LoraModel(base, _config(bias=bias, lora_save_dir=str(tmp_path), modules_to_save=["lm_head"]))
    assert model.lora_config.target_modules == ["q_proj", "v_proj"]  # llama's default targets
    adapted = [name for name, module in model.module.named_modules() if isinstance(module, LoraLinear)]
    assert sorted(adapted) == sorted(f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj"))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n or n.startswith("lm_head") for n in trainable), trainable
    assert any(n.startswith("lm_head") for n in trainable)  # modules_to_save
    torch.testing.assert_close(model(ids).logits, before)  # B = 0: the base model
    assert model.config is base.config and model.get_base_model() is base
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in frozen.items():
        torch.testing.assert_close(dict(model.named_parameters())[name], value, msg=name)
    assert not torch.allclose(model(ids).logits, before)
    trained, total = model.get_nb_trainable_parameters()
    assert 0 < trained < total


def test_lora_adapter_saves_and_loads_and_merged_base_loads_in_plain_transformers(tmp_path) -> None:
    ids = torch.randint(0, 32, (2, 7))
    model = LoraModel(_llama(), _config(lora_save_dir=str(tmp_path)))
    _randomise_b(model.module)
    logits = model(ids).logits.detach()
    keys = set(model.state_dict())
    assert keys and all("lora_" in key for key in keys)
    model.save_lora(adapter_tag="t1")
    saved_config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved_config["r"] == 4 and saved_config["lora_alpha"] == 8  # HF PEFT's reading of the rank
    # a fresh base and the adapter read back: the same model
    fresh = LoraModel(_llama(), _config(lora_save_dir=str(tmp_path), load_lora_from_ckpt=True, lora_load_tag="t1"))
    assert fresh.is_checkpoint_loaded and not fresh.is_lora_enabled
    result = fresh.load_lora()
    assert not result.unexpected_keys
    torch.testing.assert_close(fresh(ids).logits, logits)
    # the base with the adapter merged in, under the base model's own names: plain transformers loads it
    merged_config = _config(save_lora_base=True, merge_lora=True, merge_sharded_lora=False, lora_save_dir=str(tmp_path))
    merged = LoraModel(_llama(), merged_config)
    merged.load_state_dict({k: v for k, v in model.module_state_dict().items() if "lora_" in k})
    state = merged.state_dict()
    plain = _llama()
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state)
    torch.testing.assert_close(plain(ids).logits, logits, atol=1e-5, rtol=1e-5)
    assert not merged.is_lora_merged  # saving merged a copy into the weights and took it out again
    torch.testing.assert_close(merged(ids).logits, logits, atol=1e-5, rtol=1e-5)
    # save_lora_config_adapter: the config travels inside the adapter
    inside = LoraModel(_llama(), _config(save_lora_config_adapter=True, lora_save_dir=str(tmp_path / "in")))
    assert inside.state_dict()["lora_config"]["r"] == 4


def test_get_lora_model_wraps_plain_modules_and_passes_none_through() -> None:
    plain = Net(parallel=False, layers=1)
    assert get_lora_model(plain, None) is plain
    wrapped = get_lora_model(plain, _config(target_modules=["up", "down"]))
    assert isinstance(wrapped, LoraModel) and "LoraModel" in str(wrapped)


# -- NxD's tensor-parallel layers through the trainer ----------------------------------------------------------------
def lora_train_case(tp: int, pp: int, sequence_parallel: bool, tmp: str) -> None:
    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.parallel_layers import parallel_state

    lora = dict(target_modules=["up", "down"], lora_save_dir=tmp)
    pipeline_config = {"transformer_layer_cls": Block, "num_microbatches": 2, "output_loss_value_spec": True,
                       "input_names": ["ids", "labels"], "broadcast_and_average_loss": True}  # fmt: skip
    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_config=pipeline_config if pp > 1 else None,
        optimizer_config={"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 0.5},
        sequence_parallel=sequence_parallel, lora_config=_config(**lora),
    )  # fmt: skip
    plain = Net(parallel=False)
    dense = LoraModel(copy.deepcopy(plain), _config(**lora))
    _randomise_b(dense.module)
    adapter = {k: v.detach().clone() for k, v in dense.module_state_dict().items() if "lora_" in k}

    def build() -> nn.Module:
        module = Net(parallel=True, sequence_parallel=sequence_parallel)
        copy_dense_into(module, dict(plain.named_parameters()))
        return module

    model = nxd.initialize_parallel_model(config, build)
    lora_model = model.module
    assert isinstance(lora_model, LoraModel)
    assert set(lora_model.lora_module_parallel_types.values()) == {"LoraColumnParallelLinear", "LoraRowParallelLinear"}
    lora_model.load_state_dict(adapter, strict=True)  # the dense adapter, cut to this rank's shards
    optimizer = nxd.initialize_parallel_optimizer(config, torch.optim.AdamW, model.parameters(), lr=2e-2)
    dense_optimizer = torch.optim.AdamW([p for p in dense.parameters() if p.requires_grad], lr=2e-2)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    for step in range(3):
        torch.manual_seed(100 + step)
        ids, labels = torch.randint(0, V, (4 * dp, S)), torch.randint(0, V, (4 * dp, S))
        mine = slice(4 * dp_rank, 4 * dp_rank + 4)
        if pp > 1:
            loss = model.run_train(ids=ids[mine], labels=labels[mine])
        else:
            loss = model.run_train(ids[mine], labels[mine]).detach().clone()
            torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss /= dp
        optimizer.step()
        optimizer.zero_grad()
        pieces = [(ids[r * 4 + k * 2 : r * 4 + k * 2 + 2], labels[r * 4 + k * 2 : r * 4 + k * 2 + 2])
                  for r in range(dp) for k in range(2)]  # fmt: skip
        dense_loss = torch.stack([dense(i, lab) for i, lab in pieces]).mean()
        dense_loss.backward()
        dense_norm = torch.nn.utils.clip_grad_norm_([p for p in dense.parameters() if p.requires_grad], 0.5)
        dense_optimizer.step()
        dense_optimizer.zero_grad()
        torch.testing.assert_close(loss.reshape(()), dense_loss.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(optimizer.grad_norm.reshape(()), dense_norm, atol=1e-5, rtol=1e-4)
        assert_params_match(model, dict(dense.named_parameters()), atol=2e-5)
    for name, param in model.named_parameters():  # the base never moved
        assert param.requires_grad == ("lora_" in name), name
    trained = {k: v for k, v in dense.module_state_dict().items() if "lora_" in k}
    if pp == 1:
        # the saved adapter is the dense one on every rank, whatever tp
        saved = model.state_dict()
        assert set(saved) == set(trained)
        for key, value in trained.items():
            torch.testing.assert_close(saved[key], value, atol=2e-5, rtol=1e-4, msg=key)
    # NxD's checkpoint of the LoRA model loads into a fresh one built from the same base
    nxd.save_checkpoint(tmp, "lora", model=model)
    fresh = nxd.initialize_parallel_model(config, build)
    nxd.load_checkpoint(tmp, tag="lora", model=fresh)
    assert_params_match(fresh, dict(dense.named_parameters()), atol=2e-5)


@pytest.mark.parametrize(
    "tp,pp,sequence_parallel",
    [
        (2, 1, False),
        pytest.param(2, 1, True, marks=pytest.mark.slow),
        pytest.param(2, 2, False, marks=pytest.mark.slow),
    ],
)
def test_nxd_lora_trains_like_dense_lora(tp: int, pp: int, sequence_parallel: bool, tmp_path) -> None:
    run_distributed(lora_train_case, 4, tp, pp, sequence_parallel, str(tmp_path))


def lora_gqa_case(fuse_qkv: bool, platform: str) -> None:
    """:func:`_lora_gqa_case` with the platform that selects the kv replica layout (restored after: pooled workers serve
    later tests)."""
    with mock.patch.dict(os.environ, {"NEURON_PLATFORM_TARGET_OVERRIDE": platform}):
        _lora_gqa_case(fuse_qkv, platform)


def _lora_gqa_case(fuse_qkv: bool, platform: str) -> None:
    """LoRA around GQAQKVColumnParallelLinear at tp 4 with 2 kv heads (each replicated on 2 ranks: adjacent ones on
    Trn2, ranks 2 apart on Trn1): q / k / v equal each rank's heads of the dense projections plus the dense
    adapter's; after a grouped attention's backward A's grad is the dense one and B's are the dense grads of each
    rank's heads; merging gives the same outputs; the adapter gathered for saving is the dense adapter."""
    from meshpar.compat.nxd.modules.lora.model import _local_qkv
    from meshpar.compat.nxd.modules.qkv_linear import GQAQKVColumnParallelLinear
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=4)
    rank, tp, heads, kv_heads, d, hidden, r = parallel_state.get_tensor_model_parallel_rank(), 4, 8, 2, 4, 16, 4
    torch.manual_seed(5)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = GQAQKVColumnParallelLinear(
                hidden, [heads * d, kv_heads * d], bias=False, gather_output=False, keep_master_weight=True,
                kv_size_multiplier=2, fuse_qkv=fuse_qkv,
            )  # fmt: skip

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return self.qkv(x)

    module = Attention()
    base = module.qkv
    masters = (base.master_weight_qkv.split([heads * d, kv_heads * d, kv_heads * d]) if fuse_qkv
               else (base.master_weight_q, base.master_weight_k, base.master_weight_v))  # fmt: skip
    model = LoraModel(module, _config(target_modules=["qkv"], merge_sharded_lora=True, lora_save_dir=None,
                                      save_lora_config_adapter=True))  # fmt: skip
    generator = torch.Generator().manual_seed(9)
    a = torch.randn(r, hidden, generator=generator)
    bq, bk, bv = (torch.randn(n, r, generator=generator) * 0.3 for n in (heads * d, kv_heads * d, kv_heads * d))
    names = ["qkv.lora_B.weight_qkv"] if fuse_qkv else ["qkv.lora_B.weight_q", "qkv.lora_B.weight_k",
                                                         "qkv.lora_B.weight_v"]  # fmt: skip
    dense_b = [torch.cat([bq, bk, bv])] if fuse_qkv else [bq, bk, bv]
    model.load_state_dict({"qkv.lora_A.weight": a, **dict(zip(names, dense_b, strict=True))}, strict=True)
    x = torch.randn(2, S, hidden)
    q, k, v = model(x)
    s = model.lora_config.lora_alpha / r
    dense = [x @ w.T + s * (x @ a.T @ b.T) for w, b in zip(masters, (bq, bk, bv), strict=True)]
    kv_of_rank = [t % kv_heads if platform == "trn1" else t // 2 for t in range(tp)]
    my_kv = kv_of_rank[rank]
    torch.testing.assert_close(q, dense[0][..., rank * heads * d // tp : (rank + 1) * heads * d // tp])
    torch.testing.assert_close(k, dense[1][..., my_kv * d : (my_kv + 1) * d])
    torch.testing.assert_close(v, dense[2][..., my_kv * d : (my_kv + 1) * d])
    # grads through a grouped attention of this rank's heads vs the dense attention over all heads
    (q.view(2, S, heads // tp, d) * k.view(2, S, 1, d)).sum().backward()
    a_d, bq_d, bk_d = a.clone().requires_grad_(), bq.clone().requires_grad_(), bk.clone().requires_grad_()
    qd = (x @ masters[0].T + s * (x @ a_d.T @ bq_d.T)).view(2, S, heads, d)
    kv_of_q = torch.tensor([kv_of_rank[h // (heads // tp)] for h in range(heads)])  # each rank's q heads, its kv
    kd = (x @ masters[1].T + s * (x @ a_d.T @ bk_d.T)).view(2, S, kv_heads, d).index_select(2, kv_of_q)
    (qd * kd).sum().backward()
    lora = model.module.qkv
    torch.testing.assert_close(lora.lora_A.weight.grad, a_d.grad, atol=1e-4, rtol=1e-4)
    dense_grads = torch.cat([bq_d.grad, bk_d.grad, torch.zeros_like(bv)])
    if fuse_qkv:
        expected = _local_qkv(lora.lora_B, "weight_qkv", dense_grads)
        torch.testing.assert_close(lora.lora_B.weight_qkv.grad, expected, atol=1e-4, rtol=1e-4)
    else:
        expected_k = _local_qkv(lora.lora_B, "weight_k", bk_d.grad)
        torch.testing.assert_close(lora.lora_B.weight_k.grad, expected_k, atol=1e-4, rtol=1e-4)
    # merged into the base weights: the same outputs from the base alone
    model.merge_lora()
    for merged, unmerged in zip(lora.get_base_layer()(x), (q, k, v), strict=True):
        torch.testing.assert_close(merged, unmerged.detach(), atol=1e-5, rtol=1e-5)
    model.unmerge_lora()
    saved = model.state_dict()
    assert saved["lora_config"]["r"] == r
    torch.testing.assert_close(saved["qkv.lora_A.weight"], a)
    for name, value in zip(names, dense_b, strict=True):
        torch.testing.assert_close(saved[name], value, msg=name)


@pytest.mark.parametrize("fuse_qkv,platform", [(True, "trn2"), (False, "trn2"), (True, "trn1"), (False, "trn1")])
def test_nxd_lora_gqa_qkv_equals_dense_heads(fuse_qkv: bool, platform: str) -> None:
    run_distributed(lora_gqa_case, 4, fuse_qkv, platform)


def overlapped_pipeline_case() -> str:
    import meshpar.compat.nxd as nxd

    pipeline_config = {"transformer_layer_cls": Block, "num_microbatches": 2, "output_loss_value_spec": True,
                       "input_names": ["ids", "labels"], "overlap_grad_reduce": True}  # fmt: skip
    config = nxd.neuronx_distributed_config(
        pipeline_parallel_size=2, pipeline_config=pipeline_config, lora_config=_config(target_modules=["up", "down"])
    )
    try:
        nxd.initialize_parallel_model(config, lambda: Net(parallel=True, layers=2))
    except ValueError as error:
        return str(error)
    return "accepted"


def test_lora_refuses_a_pipeline_whose_dp_buckets_were_fixed_before_the_adapters() -> None:
    """pp2 x dp2 with overlapped dp grad reduction: the buckets hold the parameters the pipeline had when built, so
    the adapters' grads would never be averaged over dp; refused on every rank, naming the fix."""
    messages = run_distributed(overlapped_pipeline_case, 4)
    assert all("overlap_grad_reduce" in m for m in messages), messages
