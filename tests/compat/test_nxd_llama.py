"""A Llama written the way NxD's Llama pretraining example writes it (vocab-parallel embedding, grouped-query
attention through ``GQAQKVColumnParallelLinear``, NxD's rotary embedding, RMSNorm, column / row-parallel MLP and a
vocab-parallel head with ``parallel_cross_entropy``, the loss computed inside ``forward``), trained through NxD's
trainer API as the example drives it (``neuronx_distributed_config`` with a ``pipeline_config``, the model traced
and cut at pp > 1, ``AdamW_FP32OptimParams``, ZeRO-1 at dp > 1) at tp2, pp2 and tp2 x pp2, against the same model
built from plain torch layers in one process: the loss of every step and every parameter after every step. With
context parallelism (cp2 x tp2 with and without sequence parallelism, cp2 x dp2 with ZeRO-1, cp2 x pp2, cp4) as the
example runs it: the batch cut by
``get_batch_on_this_context_parallel_rank``, rotary positions offset by the cp rank, ``nki_ring_attn_func`` over
``get_context_model_parallel_src_tgt_pairs()``, the loss of each rank's piece averaged over its labelled tokens.

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
    """``sequence_parallel``: NxD's layout, ``[seq / tp, batch, hidden]`` in and out (q, k, v gathered over tp)."""

    def __init__(self, parallel: bool, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sp = sequence_parallel
        if parallel:
            from meshpar.compat.nxd.modules.qkv_linear import GQAQKVColumnParallelLinear
            from meshpar.compat.nxd.parallel_layers import RowParallelLinear, parallel_state

            tp = parallel_state.get_tensor_model_parallel_size()
            self.qkv_proj = GQAQKVColumnParallelLinear(
                H, [HEADS * HEAD, KV_HEADS * HEAD], bias=False, gather_output=False, fuse_qkv=False,
                init_method=lambda w: nn.init.normal_(w, std=0.2), sequence_parallel_enabled=sequence_parallel,
            )  # fmt: skip
            self.o_proj = RowParallelLinear(HEADS * HEAD, H, bias=False, input_is_parallel=True,
                                            sequence_parallel_enabled=sequence_parallel)  # fmt: skip
        else:
            tp = 1
            self.qkv_proj = DenseQKV()
            self.o_proj = nn.Linear(HEADS * HEAD, H, bias=False)
        self.heads, self.kv_heads, self.parallel = HEADS // tp, KV_HEADS // tp, parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from meshpar.compat.nxd.overrides.transformer_overrides import apply_rotary_pos_emb

        cp, cp_rank = 1, 0
        if self.parallel:
            from meshpar.compat.nxd.parallel_layers import parallel_state

            cp, cp_rank = (
                parallel_state.get_context_model_parallel_size(),
                parallel_state.get_context_model_parallel_rank(),
            )
        q, k, v = self.qkv_proj(x)
        if self.sp:  # [seq, batch, features], the whole sequence
            s, b, _ = q.shape
            q, k, v = (t.view(s, b, -1, HEAD).permute(1, 2, 0, 3) for t in (q, k, v))
        else:
            b, s, _ = q.shape
            q, k, v = (t.view(b, s, -1, HEAD).transpose(1, 2) for t in (q, k, v))
        cos, sin = _rotary(s * cp, x.device)  # this rank's piece starts at cp_rank * s (the example's offset)
        positions = (cp_rank * s + torch.arange(s, device=x.device)).unsqueeze(0).expand(b, s)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, positions, flash_attn=False)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if cp > 1:
            from meshpar.compat.nxd.kernels.ring_attention_kernel import nki_ring_attn_func

            ring = parallel_state.get_context_model_parallel_src_tgt_pairs()
            attn = nki_ring_attn_func(q, k, v, torch.distributed.get_rank(), ring)
            if self.sp:
                return self.o_proj(attn.permute(2, 0, 1, 3).reshape(s, b, self.heads * HEAD))
            return self.o_proj(attn.transpose(1, 2).reshape(b, s, self.heads * HEAD))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.o_proj(attn.transpose(1, 2).reshape(b, s, self.heads * HEAD))


class DecoderLayer(nn.Module):
    def __init__(self, parallel: bool, sequence_parallel: bool = False) -> None:
        super().__init__()
        from meshpar.compat.nxd.modules.rms_norm import RMSNorm

        self.input_layernorm, self.post_attention_layernorm = (
            RMSNorm(H, eps=1e-5, sequence_parallel_enabled=sequence_parallel) for _ in range(2)
        )
        self.self_attn = Attention(parallel, sequence_parallel)
        if parallel:
            from meshpar.compat.nxd.parallel_layers import ColumnParallelLinear, RowParallelLinear

            sp = {"sequence_parallel_enabled": sequence_parallel}
            self.gate_up = ColumnParallelLinear(H, FF, bias=False, gather_output=False, **sp)
            self.down = RowParallelLinear(FF, H, bias=False, input_is_parallel=True, **sp)
        else:
            self.gate_up, self.down = nn.Linear(H, FF, bias=False), nn.Linear(FF, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.down(F.silu(self.gate_up(self.post_attention_layernorm(x))))


class Llama(nn.Module):
    """``layer(parallel)`` builds each decoder layer (this file's ``DecoderLayer`` by default; the Mixtral test passes
    its MoE layer)."""

    def __init__(
        self,
        parallel: bool,
        layer: type[nn.Module] | None = None,
        layers: int = LAYERS,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        from meshpar.compat.nxd.modules.rms_norm import RMSNorm

        self.parallel, self.sp = parallel, sequence_parallel
        if parallel:
            from meshpar.compat.nxd.parallel_layers import ColumnParallelLinear, ParallelEmbedding

            self.embed_tokens = ParallelEmbedding(V, H)
            self.lm_head = ColumnParallelLinear(H, V, bias=False, gather_output=False)
        else:
            self.embed_tokens, self.lm_head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
        if sequence_parallel:
            self.layers = nn.ModuleList(DecoderLayer(parallel, sequence_parallel=True) for _ in range(layers))
        else:
            self.layers = nn.ModuleList((layer or DecoderLayer)(parallel) for _ in range(layers))
        self.norm = RMSNorm(H, eps=1e-5, sequence_parallel_enabled=sequence_parallel)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.sp:  # NxD's example: [seq, batch, hidden], the sequence split over tp
            from meshpar.compat.nxd.parallel_layers import mappings

            h = mappings.scatter_to_sequence_parallel_region(h.transpose(0, 1).contiguous())
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        if self.sp:
            h = mappings.gather_from_sequence_parallel_region(h, to_model_parallel=False).transpose(0, 1)
        return self.lm_head(h)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.logits(input_ids)
        if self.parallel:  # as the example: per-token losses, averaged over the labelled tokens (-100: none)
            from meshpar.compat.nxd.parallel_layers.loss_functions import parallel_cross_entropy

            valid = (labels != -100).float()
            return (parallel_cross_entropy(logits, labels) * valid).sum() / valid.sum().clamp_min(1.0)
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


def llama_cp_case(tp: int, cp: int, tmp: str, dcp: bool, pp: int = 1, sp: bool = False) -> None:
    """NxD's example at context-parallel size ``cp`` (dp takes the rest of 4 ranks, ZeRO-1 where dp > 1): each step
    the batch of every dp rank is cut by ``get_batch_on_this_context_parallel_rank`` (labels shifted first, the last
    one -100). NxD's loss is the mean over the cp pieces of each piece's mean over its labelled tokens (the pieces'
    grads averaged over cp), then over dp; the dense model computes that same quantity from its per-token losses.
    After the second step the model and optimizer are saved (``use_zero1_dcp``: ZeRO-1 state through DCP), loaded
    into fresh ones, and the third step runs on those."""
    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.utils.adamw_fp32_optim_params import AdamW_FP32OptimParams
    from meshpar.compat.nxd.utils.batch_utils import get_batch_on_this_context_parallel_rank

    dp = 4 // (tp * cp * pp)
    pipeline_config = {"transformer_layer_cls": DecoderLayer, "num_microbatches": 2, "output_loss_value_spec": True,
                       "input_names": ["input_ids", "labels"], "auto_partition": True,
                       "leaf_module_cls": ["RMSNorm"], "broadcast_and_average_loss": True}  # fmt: skip
    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, context_parallel_size=cp, sequence_parallel=sp,
        pipeline_config=pipeline_config if pp > 1 else None,
        optimizer_config={"zero_one_enabled": dp > 1, "grad_clipping": True, "max_grad_norm": 1.0},
    )  # fmt: skip
    assert parallel_state.get_data_parallel_size() == dp and parallel_state.get_context_model_parallel_size() == cp
    torch.manual_seed(0)
    dense = Llama(parallel=False)

    def build() -> nn.Module:
        torch.manual_seed(1)
        module = Llama(parallel=True, sequence_parallel=sp)
        copy_dense_into(module, dict(dense.named_parameters()))
        return module

    model = nxd.initialize_parallel_model(config, build)
    optimizer = nxd.initialize_parallel_optimizer(config, AdamW_FP32OptimParams, model.parameters(), lr=3e-3)
    dense_optimizer = AdamW_FP32OptimParams(dense.parameters(), lr=3e-3)
    dp_rank, rows, seq = parallel_state.get_data_parallel_rank(), 2, 2 * S
    for step in range(3):
        if step == 2:
            nxd.save_checkpoint(tmp, "step2", model=model, optimizer=optimizer, use_zero1_dcp=dcp)
            model = nxd.initialize_parallel_model(config, lambda: Llama(parallel=True, sequence_parallel=sp))
            optimizer = nxd.initialize_parallel_optimizer(config, AdamW_FP32OptimParams, model.parameters(), lr=3e-3)
            nxd.load_checkpoint(tmp, model=model, optimizer=optimizer, use_zero1_dcp=dcp)
            assert_params_match(model, dict(dense.named_parameters()), atol=3e-5)
        torch.manual_seed(50 + step)
        ids = torch.randint(0, V, (rows * dp, seq))
        mine = slice(rows * dp_rank, rows * dp_rank + rows)
        batch = get_batch_on_this_context_parallel_rank({"input_ids": ids[mine], "labels": ids[mine]})
        if pp > 1:  # the mean of the microbatches' losses (one row each), on every stage
            loss = model.run_train(input_ids=batch["input_ids"], labels=batch["labels"]).detach().reshape(())
        else:
            loss = model.run_train(batch["input_ids"], batch["labels"]).detach()
        for group in (parallel_state.get_context_model_parallel_group(), parallel_state.get_data_parallel_group()):
            torch.distributed.all_reduce(loss, group=group)  # the example's running-loss averages
        loss = loss / (cp * dp)
        optimizer.step()
        optimizer.zero_grad()
        labels = torch.cat([ids[:, 1:], torch.full((rows * dp, 1), -100)], dim=1)
        per_token = F.cross_entropy(dense.logits(ids).reshape(-1, V), labels.reshape(-1), reduction="none")
        per_token, valid = per_token.view(dp, rows, cp, -1), (labels != -100).view(dp, rows, cp, -1)
        dense_loss = (per_token.sum((1, 3)) / valid.sum((1, 3))).mean()  # pieces' means, over cp and dp
        dense_loss.backward()
        torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
        dense_optimizer.step()
        dense_optimizer.zero_grad()
        torch.testing.assert_close(loss.reshape(()), dense_loss.detach(), atol=2e-5, rtol=1e-5, msg=f"step {step}")
        assert_params_match(model, dict(dense.named_parameters()), atol=3e-5)


@pytest.mark.parametrize(
    "tp,cp,dcp,pp,sp",
    [(2, 2, False, 1, False), (2, 2, False, 1, True), (1, 2, False, 1, False), (1, 2, True, 1, False),
     (1, 4, False, 1, False), (1, 2, False, 2, False)],
)  # fmt: skip
def test_nxd_llama_example_model_with_context_parallelism_trains_like_dense(tp: int, cp: int, dcp: bool, pp: int,
                                                                            sp: bool, tmp_path) -> None:  # fmt: skip
    run_distributed(llama_cp_case, 4, tp, cp, str(tmp_path), dcp, pp, sp)
