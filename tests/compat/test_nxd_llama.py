"""A Llama written the way NxD's Llama pretraining example writes it (vocab-parallel embedding, grouped-query
attention through ``GQAQKVColumnParallelLinear``, NxD's rotary embedding, RMSNorm, column / row-parallel MLP and a
vocab-parallel head with ``parallel_cross_entropy``, the loss computed inside ``forward``), trained through NxD's
trainer API as the example drives it (``neuronx_distributed_config`` with a ``pipeline_config``, the model traced
and cut at pp > 1, ``AdamW_FP32OptimParams``, ZeRO-1 at dp > 1) at tp2, pp2 and tp2 x pp2, against the same model
built from plain torch layers in one process: the loss of every step and every parameter after every step.

NxD's own example module cannot be imported with the installed transformers (it imports docstring constants
transformers 5 removed), so this is the example's model in meshpar's words, not NxD's file."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshpar.testing import run_distributed
from tests.seeds._dense import assert_params_match, copy_dense_into

V, H, HEADS, KV_HEADS, FF, LAYERS, S = 32, 16, 4, 2, 24, 4, 8
HEAD = H // HEADS


class DenseQKV(nn.Module):
    """The dense twin of ``GQAQKVColumnParallelLinear(fuse_qkv=False)``: the same parameter names."""

    def __init__(self) -> None:
        super().__init__()
        self.weight_q = nn.Parameter(torch.empty(HEADS * HEAD, H))
        self.weight_k = nn.Parameter(torch.empty(KV_HEADS * HEAD, H))
        self.weight_v = nn.Parameter(torch.empty(KV_HEADS * HEAD, H))
        for weight in (self.weight_q, self.weight_k, self.weight_v):
            nn.init.normal_(weight, std=0.2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return F.linear(x, self.weight_q), F.linear(x, self.weight_k), F.linear(x, self.weight_v)


def _rotary(seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD, 2, device=device).float() / HEAD))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, parallel: bool) -> None:
        super().__init__()
        if parallel:
            from meshpar.compat.nxd.modules.qkv_linear import GQAQKVColumnParallelLinear
            from meshpar.compat.nxd.parallel_layers import RowParallelLinear, parallel_state

            tp = parallel_state.get_tensor_model_parallel_size()
            self.qkv_proj = GQAQKVColumnParallelLinear(
                H, [HEADS * HEAD, KV_HEADS * HEAD], bias=False, gather_output=False, fuse_qkv=False,
                init_method=lambda w: nn.init.normal_(w, std=0.2),
            )  # fmt: skip
            self.o_proj = RowParallelLinear(HEADS * HEAD, H, bias=False, input_is_parallel=True)
        else:
            tp = 1
            self.qkv_proj = DenseQKV()
            self.o_proj = nn.Linear(HEADS * HEAD, H, bias=False)
        self.heads, self.kv_heads = HEADS // tp, KV_HEADS // tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from meshpar.compat.nxd.overrides.transformer_overrides import apply_rotary_pos_emb

        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x)
        q = q.view(b, s, self.heads, HEAD).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, HEAD).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, HEAD).transpose(1, 2)
        cos, sin = _rotary(s, x.device)
        positions = torch.arange(s, device=x.device).unsqueeze(0).expand(b, s)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, positions, flash_attn=False)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.o_proj(attn.transpose(1, 2).reshape(b, s, self.heads * HEAD))


class DecoderLayer(nn.Module):
    def __init__(self, parallel: bool) -> None:
        super().__init__()
        from meshpar.compat.nxd.modules.rms_norm import RMSNorm

        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps=1e-5), RMSNorm(H, eps=1e-5)
        self.self_attn = Attention(parallel)
        if parallel:
            from meshpar.compat.nxd.parallel_layers import ColumnParallelLinear, RowParallelLinear

            self.gate_up = ColumnParallelLinear(H, FF, bias=False, gather_output=False)
            self.down = RowParallelLinear(FF, H, bias=False, input_is_parallel=True)
        else:
            self.gate_up, self.down = nn.Linear(H, FF, bias=False), nn.Linear(FF, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.down(F.silu(self.gate_up(self.post_attention_layernorm(x))))


class Llama(nn.Module):
    """``layer(parallel)`` builds each decoder layer (this file's ``DecoderLayer`` by default; the Mixtral test passes
    its MoE layer)."""

    def __init__(self, parallel: bool, layer: type[nn.Module] | None = None, layers: int = LAYERS) -> None:
        super().__init__()
        from meshpar.compat.nxd.modules.rms_norm import RMSNorm

        self.parallel = parallel
        if parallel:
            from meshpar.compat.nxd.parallel_layers import ColumnParallelLinear, ParallelEmbedding

            self.embed_tokens = ParallelEmbedding(V, H)
            self.lm_head = ColumnParallelLinear(H, V, bias=False, gather_output=False)
        else:
            self.embed_tokens, self.lm_head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
        self.layers = nn.ModuleList((layer or DecoderLayer)(parallel) for _ in range(layers))
        self.norm = RMSNorm(H, eps=1e-5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h))
        if self.parallel:
            from meshpar.compat.nxd.parallel_layers.loss_functions import parallel_cross_entropy

            return parallel_cross_entropy(logits, labels).mean()
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def llama_case(tp: int, pp: int) -> None:
    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.utils.adamw_fp32_optim_params import AdamW_FP32OptimParams

    pipeline_config = {"transformer_layer_cls": DecoderLayer, "num_microbatches": 2, "output_loss_value_spec": True,
                       "input_names": ["input_ids", "labels"], "auto_partition": True,
                       "leaf_module_cls": ["RMSNorm"], "broadcast_and_average_loss": True}  # fmt: skip
    dp = 4 // (tp * pp)
    zero1 = dp > 1
    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_config=pipeline_config if pp > 1 else None,
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": True, "max_grad_norm": 1.0},
    )  # fmt: skip
    torch.manual_seed(0)
    dense = Llama(parallel=False)

    def build() -> nn.Module:
        torch.manual_seed(1)
        module = Llama(parallel=True)
        copy_dense_into(module, dict(dense.named_parameters()))
        return module

    model = nxd.initialize_parallel_model(config, build)
    optimizer = nxd.initialize_parallel_optimizer(config, AdamW_FP32OptimParams, model.parameters(), lr=3e-3)
    dense_optimizer = AdamW_FP32OptimParams(dense.parameters(), lr=3e-3)
    for step in range(3):
        train_step_like_dense(model, optimizer, dense, dense_optimizer, step, rows=4, max_norm=1.0)
        assert_params_match(model, dict(dense.named_parameters()), atol=3e-5)


def train_step_like_dense(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dense: nn.Module,
    dense_optimizer: torch.optim.Optimizer,
    step: int,
    *,
    rows: int,
    max_norm: float,
) -> None:
    """One step of the parallel model through NxD's trainer API (``rows`` sequences per dp rank) and of the dense
    model on every dp rank's rows (clipped to ``max_norm``); their losses must be equal."""
    from meshpar.compat.nxd.parallel_layers import parallel_state

    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    torch.manual_seed(50 + step)
    ids = torch.randint(0, V, (rows * dp, S + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    mine = slice(rows * dp_rank, rows * dp_rank + rows)
    if parallel_state.get_pipeline_model_parallel_size() > 1:
        loss = model.run_train(input_ids=inputs[mine], labels=labels[mine])
    else:
        loss = model.run_train(inputs[mine], labels[mine]).detach()
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss = loss / dp
    optimizer.step()
    optimizer.zero_grad()
    dense_loss = dense(inputs, labels)
    dense_loss.backward()
    torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)
    dense_optimizer.step()
    dense_optimizer.zero_grad()
    torch.testing.assert_close(loss.reshape(()).cpu(), dense_loss.detach(), atol=2e-5, rtol=1e-5, msg=f"step {step}")


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_nxd_llama_example_model_trains_like_dense(tp: int, pp: int) -> None:
    run_distributed(llama_case, 4, tp, pp)
