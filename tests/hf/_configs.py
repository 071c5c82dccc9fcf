"""Tiny HuggingFace models built from configs (never downloaded)."""

from __future__ import annotations

import inspect

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

VOCAB = 64

# multi-head latent attention and routed + shared experts at the tiny size
_MLA = dict(
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16, n_routed_experts=4,
    n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
    moe_intermediate_size=16, num_key_value_heads=4,
)  # fmt: skip

_BART = dict(
    d_model=32, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=2, forced_eos_token_id=None,
)  # fmt: skip

# Families sharded from transformers' own tp plans (config class, model class, extra config keys). Gemma ties its
# scaled embedding to the head; its vocab (67) is one tp does not divide.
GENERIC = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # q_norm / k_norm: grads partial over tp
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"vocab_size": 67, "tie_word_embeddings": True, "attn_implementation": "eager"},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # packed qkv / gate_up: gathered column outputs
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": None}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "opt": ("OPTConfig", "OPTForCausalLM", {}),  # no transformers plan: meshpar's table
    # OPT-350m's layout: embeddings narrower than the layers, projected in before them and out after them
    "opt_projected": ("OPTConfig", "OPTForCausalLM", {"word_embed_proj_dim": 16, "do_layer_norm_before": False}),
    # attention sinks: one bare parameter per head (transformers' 'local_params')
    "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM", {"attn_implementation": "eager"}),
    # multi-head latent attention (transformers' 'mla_kv_a_proj': the rope features' grad summed over tp) and
    # routed + shared experts
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _MLA),
    # experts handed one block of tokens per expert; the causal LM keeps its base model under another name than its
    # base_model_prefix
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {"num_local_experts": 4, "intermediate_size_mlp": 48, "attention_chunk_size": 8, "attn_implementation": "sdpa"},
    ),
    # per-head gates computed from every local value head (dt_proj) and per-head q/k norms: meshpar's amendment
    "doge": ("DogeConfig", "DogeForCausalLM", {"keep_window_size": 4}),
    # identity ("zero-computation") experts next to routed ones, whose fused gate/up weights also hold their rows
    # (4 experts, 2 identity experts: whole experts and an identity expert per rank at 2 ranks); layers of two
    # sublayers (4 hidden layers = 2 layers)
    "longcat_flash": (
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        {**_MLA, "zero_expert_num": 2, "num_hidden_layers": 4, "attn_implementation": "eager"},
    ),
    # one identity expert, which no 2 ranks can share evenly: tp splits every expert by features instead
    "longcat_flash_one_identity": (
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        {**_MLA, "zero_expert_num": 1, "num_hidden_layers": 4, "attn_implementation": "eager"},
    ),
    # routed experts next to a gated shared expert that runs on flattened tokens
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
        },
    ),
    # activation sparsity in its first layer: a cutoff at statistics over all of a token's MLP features
    "gemma3n_text": (
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        {
            "activation_sparsity_pattern": [0.95, 0.0],
            "layer_types": ["sliding_attention", "full_attention"],
            "vocab_size_per_layer_input": 64,
            "hidden_size_per_layer_input": 8,
            "num_kv_shared_layers": 0,
            "attn_implementation": "eager",
        },
    ),
    # a shipped pipeline plan that leaves out a module holding parameters (the image / audio embedder that runs
    # before the layers): meshpar reads the plan off the model and proves it
    "phi4_multimodal": (
        "Phi4MultimodalConfig",
        "Phi4MultimodalForCausalLM",
        {
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 48,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "image_size": 28,
                "crop_size": 28,
                "patch_size": 14,
            },
            "audio_config": {
                "hidden_size": 32,
                "intermediate_size": 48,
                "num_blocks": 1,
                "num_attention_heads": 4,
                "ext_pw_out_channel": 32,
                "depthwise_separable_out_channel": 32,
                "nemo_conv_channels": 32,
                "depthwise_multiplier": 1,
            },
        },
    ),
    # layers handed more than the hidden states (see meshpar.hf.stages.Carried): DeepSeek-V4's residual streams
    # (hc_mult copies of the hidden states) and its routing by token ids; Inkling2's stack of earlier hidden states
    # (every layer a block boundary), which the forward extends between layers; GLM-MoE-DSA's layers return their
    # top-k indices too, which the next layer may reuse
    "deepseek_v4": (
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        {
            "attn_implementation": "eager",
            "num_key_value_heads": 1,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "q_lora_rank": 16,
            "o_lora_rank": 16,
        },
    ),
    "inkling2_text": (
        "Inkling2TextConfig",
        "Inkling2ForCausalLM",
        {
            "attn_implementation": "eager",
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "swa_head_dim": 8,
            "n_layers_per_attn_res_block": 1,
        },
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        _MLA,
    ),
    # two layer stacks run in turn, over and over (a recurrent model): no order of pipeline stages exists
    "hrm_text": ("HrmTextConfig", "HrmTextForCausalLM", {"attn_implementation": "eager"}),
    # a shipped plan that shards the experts only: meshpar's amendment shards the attention (Megatron's layout)
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # no transformers pipeline plan: meshpar reads one from the base model's children and proves it
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", {}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 1},
    ),
    # stacked experts with biases and a clamped SwiGLU, attention sinks (meshpar's amendment shards the experts)
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "attn_implementation": "eager",
        },
    ),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {**_MLA, "q_lora_rank": None}),
    # a Mamba mixer and an MLP (layer 0), an attention and experts (layer 1): the mixers left whole by the shipped plan
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "num_experts": 4,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts_per_tok": 2,
            "mamba_d_state": 4,
            "mamba_dt_rank": 4,
            "use_mamba_kernels": False,
        },
    ),
    # a Mamba mixer and an experts block, both named ``mixer`` (its shipped plan shards the experts only)
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        {
            "layers_block_type": ["linear_attention", "moe"],
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 16,
            "moe_shared_expert_intermediate_size": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 8,
            "n_groups": 1,
            "ssm_state_size": 8,
            "use_mamba_kernels": False,
            "use_cache": False,
        },
    ),
    # a gated delta-net whose projections all gather their outputs (no row projection), then attention and experts
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "decoder_sparse_step": 1,
        },
    ),
    # short convolutions and attention (left whole by the shipped plan, as Jamba's mixers)
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {"layer_types": ["conv", "full_attention"]}),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        {"rotary_dim": 4, "num_key_value_heads": None, "attn_implementation": "eager"},
    ),  # meshpar's table
    # per-head q/k norms the shipped plan leaves out (meshpar's amendment sums their grads over tp)
    "glm4_moe_qk_norm": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {
            "use_qk_norm": True,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    # meshpar's BERT-encoder table: post-norm layers, a masked-LM head whose bias is registered twice, positions
    # counted from the padding index
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", {"num_key_value_heads": None, "tie_word_embeddings": True}),
    # XLM-R registers its head before its base model (the head must still go to the last pipeline stage)
    "xlm_roberta": (
        "XLMRobertaConfig",
        "XLMRobertaForCausalLM",
        {"num_key_value_heads": None, "is_decoder": True, "attn_implementation": "eager"},
    ),
    # families OSLO's tensor parallelism covered, and Falcon / Bloom, from meshpar's tables (no transformers plan)
    "gpt_neo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        {
            "attention_types": [[["global", "local"], 1]],
            "window_size": 8,
            "num_key_value_heads": None,
            "attn_implementation": "eager",
        },
    ),  # a global and a local (sliding-window) layer
    "electra": ("ElectraConfig", "ElectraForMaskedLM", {"num_key_value_heads": None, "embedding_size": 16}),
    # one layer shared across the depth, a narrower embedding projected in
    "albert": (
        "AlbertConfig",
        "AlbertForMaskedLM",
        {"num_key_value_heads": None, "embedding_size": 16, "hidden_dropout_prob": 0.0, "classifier_dropout_prob": 0.0},
    ),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        {"num_key_value_heads": None, "dim": 32, "n_heads": 4, "hidden_dim": 48},
    ),
    # ALiBi: one bias slope per head, built by the base model for all heads
    "bloom": ("BloomConfig", "BloomForCausalLM", {"num_key_value_heads": None, "attn_implementation": "eager"}),
    # [q | k | v] per head, rotary positions, parallel attention and MLP
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        {"num_key_value_heads": None, "multi_query": False, "new_decoder_architecture": False},
    ),
    # Falcon-40B / 180B: [q ... q | k | v] per key/value group
    "falcon_grouped": (
        "FalconConfig",
        "FalconForCausalLM",
        {"num_key_value_heads": None, "new_decoder_architecture": True, "num_kv_heads": 2},
    ),
    # Falcon-RW: ALiBi folded into a per-head attention mask
    "falcon_alibi": (
        "FalconConfig",
        "FalconForCausalLM",
        {"num_key_value_heads": None, "multi_query": False, "alibi": True, "attn_implementation": "eager"},
    ),
    # Falcon-7B's multi-query layout: its one key/value head follows all query heads in the packed projection
    "falcon_multi_query": ("FalconConfig", "FalconForCausalLM", {"num_key_value_heads": None, "multi_query": True}),
    # encoder-decoders: T5 (relative position bias per head, shared embedding tied to the head) and T5 v1.1 / mT5's
    # gated feed-forward with an untied head
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        {"num_key_value_heads": None, "d_kv": 8, "d_ff": 48, "decoder_start_token_id": 0, "dropout_rate": 0.0},
    ),
    "mt5": (
        "MT5Config",
        "MT5ForConditionalGeneration",
        {"num_key_value_heads": None, "d_kv": 8, "d_ff": 48, "decoder_start_token_id": 0, "dropout_rate": 0.0},
    ),
    # BART and its kind: scaled word embeddings shared by both stacks and tied to the head, a bias added to the
    # whole vocabulary's logits (the head's output gathered for it)
    **{
        family: (config_cls, model_cls, {"num_key_value_heads": None, "tie_word_embeddings": True, **_BART})
        for family, config_cls, model_cls in (
            ("bart", "BartConfig", "BartForConditionalGeneration"),
            ("blenderbot", "BlenderbotConfig", "BlenderbotForConditionalGeneration"),
            ("blenderbot_small", "BlenderbotSmallConfig", "BlenderbotSmallForConditionalGeneration"),
            ("pegasus", "PegasusConfig", "PegasusForConditionalGeneration"),
            # a decoder alone whose loss takes labels already shifted (logits at t scored against labels at t)
            ("bart_causal", "BartConfig", "BartForCausalLM"),
        )
    },
    # an LM head that is a Linear subclass with a per-token logit scale (kept whole: full logits, plain loss)
    "dory": ("DoryConfig", "DoryForCausalLM", {"n_input_layers": 1, "n_recurrent_layers": 0, "n_output_layers": 1}),
}


class NormedEmbedding(torch.nn.Embedding):
    """An embedding with a norm over the looked-up rows (as Inkling2's): per token, with a parameter inside."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__(num, dim)
        self.embed_norm = torch.nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(ids))


class MixingEmbedding(torch.nn.Embedding):
    """An embedding whose forward mixes tokens (a running sum): vocab parallelism cannot shard it exactly."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).cumsum(1)


def with_embedding(model: torch.nn.Module, cls: type) -> torch.nn.Module:
    old = model.get_input_embeddings()
    new = cls(old.num_embeddings, old.embedding_dim)
    torch.manual_seed(1)
    if isinstance(getattr(new, "embed_norm", None), torch.nn.LayerNorm):
        torch.nn.init.normal_(new.embed_norm.weight, 1.0, 0.1)  # not the identity: its grad must be right
    with torch.no_grad():
        new.weight.copy_(old.weight)
    model.set_input_embeddings(new)
    return model


def build_generic(family: str, *, heads: int = 4, kv_heads: int | None = None, layers: int = 2) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config_cls, model_cls, extra = GENERIC[family]
    keys = dict(
        vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or max(1, heads // 2), max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa", tie_word_embeddings=False,
    )  # fmt: skip
    if family.startswith("opt"):
        keys = dict(
            vocab_size=VOCAB, hidden_size=8 * heads, ffn_dim=48, num_hidden_layers=layers, num_attention_heads=heads,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, dropout=0.0,
            word_embed_proj_dim=8 * heads, attn_implementation="sdpa",
        )  # fmt: skip
    keys.update({k: v for k, v in extra.items() if v is not None})
    if family in ("t5", "mt5"):  # its decoder's depth is its own key (defaulting to 6, not the encoder's)
        keys["num_layers"] = keys["num_decoder_layers"] = layers
    if family in ("bart", "blenderbot", "blenderbot_small", "pegasus", "bart_causal"):
        keys["encoder_layers"] = keys["decoder_layers"] = layers
    if family == "gpt_neo":  # a global and a local layer in turn, as many as there are layers
        keys["attention_types"] = [[["global", "local"], layers // 2]] if layers % 2 == 0 else [[["global"], layers]]
    keys = {k: v for k, v in keys.items() if (k, None) not in extra.items()}
    config_type = getattr(transformers, config_cls)
    if "head_dim" in inspect.signature(config_type.__init__).parameters:
        keys["head_dim"] = 8  # some families default to 128 whatever the hidden size
    config = config_type(**keys)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # attention sinks start at zero: make each head's differ, so their sharding shows
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):
                param.copy_(torch.linspace(-1.0, 1.0, param.numel()))
    return model


def build(
    family: str, *, heads: int = 4, layers: int = 2, kv_heads: int | None = None, vocab: int = VOCAB
) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(
            vocab_size=vocab, n_positions=32, n_embd=8 * heads, n_layer=layers, n_head=heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
        )  # fmt: skip
        return GPT2LMHeadModel(config).eval()
    if family == "llama":
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads or max(1, heads // 2), max_position_embeddings=32,
            attn_implementation="sdpa",
        )  # fmt: skip
        return LlamaForCausalLM(config).eval()
    if family in ("bert", "bert_cls"):
        config = BertConfig(
            vocab_size=vocab, hidden_size=8 * heads, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation="sdpa",
        )  # fmt: skip
        cls = BertForMaskedLM if family == "bert" else BertForSequenceClassification
        return cls(config).eval()
    if family in GENERIC:
        return build_generic(family, heads=heads, kv_heads=kv_heads, layers=layers)
    if family == "qwen3_normed_embedding":
        return with_embedding(build_generic("qwen3", heads=heads, kv_heads=kv_heads, layers=layers), NormedEmbedding)
    raise ValueError(family)


def batch(family: str, rows: int = 4, seq: int = 16, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    if family == "bert":
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = ids[:, ::3]
        return {"input_ids": ids, "labels": labels}
    if family == "bert_cls":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (rows,), generator=generator)}
    return {"input_ids": ids, "labels": ids.clone()}


def adamw_for(model: torch.nn.Module, zero1: str, **adamw: float) -> object:
    """The step's optimizer: torch's AdamW over the model's parameters (``zero1`` empty), or meshpar's ZeRO-1
    (``"zero1"``; ``"reduce_scatter"``: reducing the raw grads itself, so ``train_step(sync_dp_grads=False)``)."""
    if not zero1:
        return torch.optim.AdamW(model.parameters(), **adamw)
    from meshpar.optim import DistributedOptimizer

    scatter = zero1 == "reduce_scatter"
    return DistributedOptimizer(model, torch.optim.AdamW, zero1=True, reduce_scatter_grads=scatter, **adamw)
