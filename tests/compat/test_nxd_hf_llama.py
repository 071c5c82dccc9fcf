"""NxD's Llama pretraining example model as NxD writes it: a subclass of transformers' ``LlamaForCausalLM`` whose
embedding, attention and MLP are NxD's parallel layers (``ParallelEmbedding``, ``GQAQKVColumnParallelLinear``,
column / row-parallel linears), whose head stays vocab-parallel and whose ``forward`` computes the loss with
``parallel_cross_entropy`` over the labelled tokens. Trained through NxD's trainer with the example's
``pipeline_config`` (no ``tracer_cls``: an HF model, cut by its structure; ``leaf_module_cls`` as class names),
SGD with momentum, gradient clipping, every layer recomputed in backward (the example's
``activation_checkpoint_config="full"``) and ZeRO-1 where dp > 1, at tp2 x pp2, pp2 x dp2 and tp2 x dp2, and with
sequence parallelism (NxD's seq-first layout between layers and across stages) at tp2 x pp2 and tp2 x dp2, against
the plain transformers model in one process: the loss of every step (left-padded rows, labels masked where
padded), every parameter after every step, and a checkpoint saved after the second step and loaded into a fresh
model and optimizer that run the third.

NxD's own ``modeling_llama_nxd.py`` cannot be imported with the installed transformers (it imports names
transformers 5 removed), so this is the example's model in meshpar's words."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from meshpar.testing import run_distributed
from tests.seeds._dense import assert_params_match, copy_dense_into

CONFIG = dict(
    vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, tie_word_embeddings=False, attn_implementation="eager",
)  # fmt: skip
ROWS, SEQ, MICROBATCHES = 4, 7, 2
SGD = {"lr": 0.2, "momentum": 0.9}  # state to checkpoint; errors in a grad show linearly (Adam's scaling hides them)


class NxDAttention(LlamaAttention):
    """q, k and v from one ``GQAQKVColumnParallelLinear`` (this rank's heads), the output through a
    ``RowParallelLinear``; the attention itself is transformers'. Under sequence parallelism (NxD's
    ``config.sequence_parallel_enabled``) the hidden states are NxD's ``[seq / tp, batch, hidden]``: the q/k/v layer
    gathers the sequence, the output layer reduce-scatters it."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        from meshpar.compat.nxd.modules.qkv_linear import GQAQKVColumnParallelLinear
        from meshpar.compat.nxd.parallel_layers import RowParallelLinear

        super().__init__(config, layer_idx)
        del self.q_proj, self.k_proj, self.v_proj
        heads, kv_heads, sp = config.num_attention_heads, config.num_key_value_heads, config.sequence_parallel_enabled
        self.qkv_proj = GQAQKVColumnParallelLinear(
            config.hidden_size, [heads * self.head_dim, kv_heads * self.head_dim], bias=False, gather_output=False,
            fuse_qkv=False, sequence_parallel_enabled=sp,
        )  # fmt: skip
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=False, input_is_parallel=True,
                                        sequence_parallel_enabled=sp)  # fmt: skip
        self.seq_first = sp

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        states = self.qkv_proj(hidden_states)  # [batch, seq, .] or, seq first, [seq, batch, .]
        lead = states[0].shape[:2]
        order = (1, 2, 0, 3) if self.seq_first else (0, 2, 1, 3)  # to [batch, heads, seq, head_dim]
        query, key, value = (state.view(*lead, -1, self.head_dim).permute(order) for state in states)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        out, weights = eager_attention_forward(self, query, key, value, attention_mask, scaling=self.scaling)
        out = out.transpose(0, 1) if self.seq_first else out  # transformers returns [batch, seq, heads, head_dim]
        return self.o_proj(out.reshape(*lead, -1)), weights


class NxDLlamaModel(LlamaModel):
    """transformers' Llama body of NxD's layers. Under sequence parallelism its ``forward`` is NxD's example's own
    (transformers' reads the batch and sequence off the embedding's output, which is then ``[seq / tp, batch, .]``):
    the causal and padding mask, the rotary angles, the layers and the norm, seq first throughout."""

    def __init__(self, config: LlamaConfig) -> None:
        from meshpar.compat.nxd.parallel_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear

        super().__init__(config)
        hidden, inner, sp = config.hidden_size, config.intermediate_size, config.sequence_parallel_enabled
        self.embed_tokens = ParallelEmbedding(config.vocab_size, hidden, sequence_parallel_enabled=sp)
        for index, layer in enumerate(self.layers):
            layer.self_attn = NxDAttention(config, index)
            mlp = layer.mlp
            mlp.gate_proj = ColumnParallelLinear(hidden, inner, bias=False, gather_output=False,
                                                 sequence_parallel_enabled=sp)  # fmt: skip
            mlp.up_proj = ColumnParallelLinear(hidden, inner, bias=False, gather_output=False,
                                               sequence_parallel_enabled=sp)  # fmt: skip
            mlp.down_proj = RowParallelLinear(inner, hidden, bias=False, input_is_parallel=True,
                                              sequence_parallel_enabled=sp)  # fmt: skip
        for norm in (self.norm, *(n for layer in self.layers for n in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm))):  # fmt: skip
            norm.weight.sequence_parallel_enabled = sp  # NxD's norm: its grads are partial over tp under sp

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        if not self.config.sequence_parallel_enabled:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        rows, seq = input_ids.shape
        hidden = self.embed_tokens(input_ids)
        lowest = torch.finfo(torch.float32).min
        mask = torch.full((seq, seq), lowest, device=input_ids.device).triu(1)[None, None]
        if attention_mask is not None:  # padded keys masked too
            mask = (mask + (1.0 - attention_mask[:, None, None, :].float()) * lowest).clamp(min=lowest)
        positions = torch.arange(seq, device=input_ids.device)[None]
        rotary = self.rotary_emb(torch.empty(rows, seq, 1, device=input_ids.device), positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))


class NxDLlamaForCausalLM(LlamaForCausalLM):
    """transformers' Llama with NxD's layers; ``forward`` returns the loss over the labelled tokens (labels shifted
    inside, -100 ignored) from vocab-parallel logits, as NxD's example model does."""

    def __init__(self, config: LlamaConfig) -> None:
        from meshpar.compat.nxd.parallel_layers import ColumnParallelLinear

        super().__init__(config)
        self.model = NxDLlamaModel(config)
        self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, bias=False, gather_output=False,
                                            sequence_parallel_enabled=config.sequence_parallel_enabled)  # fmt: skip

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        from meshpar.compat.nxd.parallel_layers.loss_functions import parallel_cross_entropy

        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        logits = self.lm_head(hidden)
        if self.config.sequence_parallel_enabled:  # the head gathered the sequence: [seq, batch, vocab / tp]
            logits = logits.transpose(0, 1)
        loss = None
        if labels is not None:
            shifted_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
            shifted_labels = labels[:, 1:].reshape(-1)
            valid = (shifted_labels != -100).float()
            loss = (parallel_cross_entropy(shifted_logits, shifted_labels) * valid).sum() / valid.sum()
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def _dense_name(name: str) -> str:
    """The plain model's name of an NxD model's parameter (``qkv_proj.weight_q`` is ``q_proj.weight``)."""
    for part in "qkv":
        name = name.replace(f"qkv_proj.weight_{part}", f"{part}_proj.weight")
    return name


def _decay_groups(model: torch.nn.Module) -> list[dict]:
    """The example's param groups: weight decay on all but biases and norms (by name)."""
    named = list(model.named_parameters())
    plain = [p for n, p in named if "bias" not in n and "norm" not in n]
    return [{"params": plain, "weight_decay": 0.01},
            {"params": [p for n, p in named if "bias" in n or "norm" in n], "weight_decay": 0.0}]  # fmt: skip


def _batch(step: int, rows: int, seq: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CONFIG["vocab_size"], (rows, seq), generator=generator)
    mask = torch.ones_like(ids)
    mask[1::3, :3] = 0  # left padding on some rows: the padded positions carry no loss
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def hf_llama_case(tp: int, pp: int, tmp: str, sp: bool = False, seq: int = SEQ) -> None:
    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.parallel_layers import mappings, parallel_state
    from meshpar.compat.nxd.utils.activation_checkpoint import NxDCheckpointWrapper

    dp = 4 // (tp * pp)
    pipeline_config = {  # the example's keys, with its values for a CPU run
        "transformer_layer_cls": LlamaDecoderLayer, "num_microbatches": MICROBATCHES,
        "output_loss_value_spec": (True, False), "input_names": ["input_ids", "attention_mask", "labels"],
        "virtual_pipeline_size": 1, "auto_partition": True, "trace_file_path": None, "param_init_fn": None,
        "leaf_module_cls": [LlamaRMSNorm.__name__, LlamaRotaryEmbedding.__name__], "autowrap_modules": [mappings],
        "use_zero1_optimizer": dp > 1, "use_optimizer_wrapper": True, "deallocate_pipeline_outputs": False,
        "fuse_microbatches": False, "broadcast_and_average_loss": True,
    }  # fmt: skip
    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_config=pipeline_config if pp > 1 else None,
        optimizer_config={"zero_one_enabled": dp > 1, "grad_clipping": True, "max_grad_norm": 1.0},
        sequence_parallel=sp, activation_checkpoint_config="full", model_init_config=None,
        mixed_precision_config={"use_master_weights": False, "use_fp32_grad_acc": False,
                                "use_master_weights_in_ckpt": False},
    )  # fmt: skip
    llama = LlamaConfig(**CONFIG, sequence_parallel_enabled=sp)
    torch.manual_seed(0)
    dense = LlamaForCausalLM(llama).train()
    dense_params = dict(dense.named_parameters())

    def built() -> NxDLlamaForCausalLM:
        model = NxDLlamaForCausalLM(llama)
        copy_dense_into(model, dense_params, _dense_name)
        return model

    model = nxd.initialize_parallel_model(config, built)
    layers = [module for _, module in model.named_modules() if isinstance(module, LlamaDecoderLayer)]
    assert layers and all(isinstance(layer, NxDCheckpointWrapper) for layer in layers)  # the example's "full"
    optimizer = nxd.initialize_parallel_optimizer(config, torch.optim.SGD, _decay_groups(model), **SGD)
    dense_optimizer = torch.optim.SGD(_decay_groups(dense), **SGD)
    dp_rank = parallel_state.get_data_parallel_rank()
    for step in range(3):
        if step == 2:
            nxd.save_checkpoint(tmp, "step2", model=model, optimizer=optimizer)
            model = nxd.initialize_parallel_model(config, lambda: NxDLlamaForCausalLM(llama))
            optimizer = nxd.initialize_parallel_optimizer(config, torch.optim.SGD, _decay_groups(model), **SGD)
            nxd.load_checkpoint(tmp, model=model, optimizer=optimizer)
            assert_params_match(model, dense_params, _dense_name, atol=2e-6, rtol=1e-5)
        batch = _batch(step, ROWS * dp, seq)
        mine = {key: value[ROWS * dp_rank : ROWS * (dp_rank + 1)] for key, value in batch.items()}
        if pp > 1:  # the mean of the microbatches' losses, on every stage
            loss = model.run_train(**mine).detach()
        else:  # the example at pp 1: the model's own output, then backward
            loss = model(**mine).loss
            loss.backward()
            loss = loss.detach()
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        optimizer.step()
        optimizer.zero_grad()
        pieces = dp * (MICROBATCHES if pp > 1 else 1)  # one dense loss per (replica, microbatch)
        chunked = zip(*(value.chunk(pieces) for value in batch.values()), strict=True)
        dense_loss = torch.stack([dense(**dict(zip(batch, piece, strict=True))).loss for piece in chunked]).mean()
        dense_loss.backward()
        torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
        dense_optimizer.step()
        dense_optimizer.zero_grad()
        torch.testing.assert_close(loss / dp, dense_loss.detach(), atol=2e-6, rtol=1e-5, msg=f"step {step}")
        assert_params_match(model, dense_params, _dense_name, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("tp,pp,sp", [(2, 2, False), (1, 2, False), (2, 1, False), (2, 2, True), (2, 1, True)])
def test_nxd_llama_example_as_an_hf_model_trains_like_dense(tp: int, pp: int, sp: bool, tmp_path) -> None:
    # under sequence parallelism the sequence is one tp divides: NxD's layout crosses the stages seq first
    run_distributed(hf_llama_case, 4, tp, pp, str(tmp_path), sp, SEQ + 1 if sp else SEQ)


def test_nxd_llama_example_as_an_hf_model_refuses_a_sequence_tp_does_not_divide_under_sp(tmp_path) -> None:
    with pytest.raises(AssertionError, match=r"ValueError: .*the sequence length must be divisible by tp"):
        run_distributed(hf_llama_case, 4, 2, 2, str(tmp_path), True, SEQ)  # raised on every rank
