"""HF families sharded from their own plans (transformers' ``tp_plan``, meshpar's tables in the same format, user
plans): loss, logits, every grad and the parameters after an optimizer step equal the dense model's; what cannot be
sharded exactly is refused before any process group exists, or by the one-block verification."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import MptConfig, MptForCausalLM

import meshpar
from meshpar._compat import DTensor
from meshpar._shards import in_parameter_layout, local_slice
from meshpar.hf import PlanVerificationError
from meshpar.hf.hf_plan import divide_attribute
from meshpar.hf.stages import inferred_pipeline_layout, install_decoder_stage
from meshpar.optim import DistributedOptimizer
from meshpar.testing import run_distributed, setup_parallel
from tests.hf._configs import GENERIC, batch, build

# not in make test-fast: every family; the fast tier keeps one per code path (tests/hf/test_parallelize.py)
pytestmark = pytest.mark.slow

# every family here has a transformers plan except OPT and GPT-J (meshpar's tables); Qwen3 has q/k norms between
# column and row layers, Gemma2 a scaled embedding tied to the head over a vocab tp does not divide, Phi3 packed
# projections, Mixtral experts (whole experts per tp rank)
FAMILIES = ["mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt_neox", "olmo2", "phi", "opt", "gptj", "mixtral"]

_OPT_ATTENTION = {
    "model.decoder.layers.*.self_attn.q_proj": "colwise",
    "model.decoder.layers.*.self_attn.k_proj": "colwise",
    "model.decoder.layers.*.self_attn.v_proj": "colwise",
    "model.decoder.layers.*.self_attn.out_proj": "rowwise",
}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def family_case(
    family: str, tp: int, kv_heads: int | None = None, plan: dict | None = None, sp: bool = False, layers: int = 2
) -> str:
    """One training step at tp (the rest of the world is dp, each dp rank on its rows) against the dense model."""
    dims = setup_parallel(tp=tp)
    dense = build(family, kv_heads=kv_heads, layers=layers)
    config = {"tensor_parallel_size": tp, "sequence_parallel": sp}
    model = meshpar.parallelize(copy.deepcopy(dense), config, plan=plan)
    data = batch(family, rows=4)
    data["labels"][0, :7] = -100  # dp rank 0 scores fewer tokens: the step weighs every token alike
    expected = dense(**data)
    expected.loss.backward()
    torch.optim.SGD(dense.parameters(), lr=0.5).step()
    optimizer = DistributedOptimizer(model, torch.optim.SGD, lr=0.5)
    rows = 4 // dims.dp
    mine = {k: v[dims.dp_rank * rows : (dims.dp_rank + 1) * rows] for k, v in data.items()}
    with torch.no_grad():
        logits = model(**mine).logits
    want = expected.logits.detach()[dims.dp_rank * rows : (dims.dp_rank + 1) * rows]
    if model.vocab_sharded:
        want = want.chunk(tp, -1)[dims.tp_rank]
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    loss = model.train_step(**mine)
    torch.testing.assert_close(loss, expected.loss.detach(), atol=1e-5, rtol=1e-5)
    for name, param in model.module.named_parameters():
        dense_grad = dense.get_parameter(name).grad
        if dense_grad is None:  # unused by the dense model (an embedding the model keeps but does not call)
            assert param.grad is None or not _local(param.grad).any(), name
            continue
        want = local_slice(in_parameter_layout(dense_grad, model.module, name), param)
        torch.testing.assert_close(_local(param.grad), want, atol=1e-5, rtol=1e-4, msg=f"grad of {name}")
    optimizer.step()
    for name, param in model.module.named_parameters():
        full = dense.get_parameter(name).detach()
        want = local_slice(in_parameter_layout(full, model.module, name), param)
        torch.testing.assert_close(_local(param), want, atol=1e-5, rtol=1e-4, msg=name)
    return model.plan_summary().splitlines()[-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_matches_dense(family: str) -> None:
    summary = run_distributed(family_case, 2, family, 2)[0]
    local, total = (int(n.replace(",", "")) for n in summary.split()[3:6:2])
    assert local < 0.6 * total, summary  # embedding, head and every block's projections are sharded


# meshpar's tables for families OSLO's tensor parallelism covered, and Falcon and Bloom (transformers ships no plan)
TABLE_FAMILIES = ["gpt_neo", "electra", "distilbert", "bloom", "falcon", "falcon_grouped", "falcon_alibi"]


@pytest.mark.parametrize("family", TABLE_FAMILIES)
def test_table_families_at_tp2_x_dp2_match_dense(family: str) -> None:
    """GPT-Neo (global and sliding-window layers), ELECTRA (a narrower embedding projected in), DistilBERT, Bloom
    (ALiBi's per-head slopes kept with their heads), Falcon in its three layouts that tp can split (per-head
    [q | k | v], per key/value group, ALiBi folded into a per-head mask): tp=2 x dp=2 with uneven scored tokens
    across the dp ranks, loss, logits, every grad and the step equal dense."""
    summary = run_distributed(family_case, 4, family, 2)[0]
    local, total = (int(n.replace(",", "")) for n in summary.split()[3:6:2])
    assert local < 0.6 * total, summary


@pytest.mark.parametrize("family", TABLE_FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_table_families_through_pipelines_match_dense(family: str, tp: int) -> None:
    """The same families at pp=2 and tp=2 x pp=2 (meshpar's pipeline plans for ELECTRA and DistilBERT, whose layers
    sit inside their encoder; DistilBERT's head registers its activation before the base model)."""
    run_distributed(pipeline_case, 2 * tp, family, tp, 2)


@pytest.mark.parametrize("family", ["t5", "mt5", "bart", "blenderbot", "blenderbot_small", "pegasus"])
def test_encoder_decoders_at_tp2_x_dp2_match_dense(family: str) -> None:
    """Encoder-decoders from meshpar's tables: both stacks' attentions (self and cross) and feed-forwards sharded;
    T5's relative position bias kept per head with the heads (computed by each stack's first block, handed on as
    this rank's heads); the shared embedding vocab-parallel with the encoder's and decoder's embed_tokens tied to it
    (and to the LM head where the model ties it; BART's scaled embeddings keep their own forward, its head's output
    is gathered for the bias it adds over the whole vocabulary); the decoder's inputs built from the labels as the
    model does, the token loss over the global batch; both stacks proven by the verification."""
    summary = run_distributed(family_case, 4, family, 2)[0]
    local, total = (int(n.replace(",", "")) for n in summary.split()[3:6:2])
    assert local < 0.6 * total, summary


@pytest.mark.parametrize("layout", ["dp2", "pp2", "tp2xpp2"])
def test_causal_lm_whose_labels_come_shifted_keeps_its_alignment(layout: str) -> None:
    """BART's ForCausalLM scores the logits at t against the labels at t (the caller shifts them); meshpar's loss does
    what the model does, proven on the dense model at parallelize time (it shifted them again before: a silently
    different loss at every layout, dp=2 included)."""
    if layout == "dp2":
        run_distributed(family_case, 2, "bart_causal", 1)
    else:
        tp = 2 if layout == "tp2xpp2" else 1
        run_distributed(pipeline_case, 2 * tp, "bart_causal", tp, 2)


def meta_shifted_labels_case() -> str:
    setup_parallel(dp=2)
    with torch.device("meta"):
        skeleton = type(build("bart_causal"))(build("bart_causal").config)
    try:
        meshpar.parallelize(skeleton, {"data_parallel_size": 2})
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_models_own_label_alignment_that_cannot_be_proven_is_refused() -> None:
    for message in run_distributed(meta_shifted_labels_case, 2):
        assert "computes its own causal-LM loss, whose label alignment meshpar proves on the dense model" in message


def test_albert_at_tp2_x_dp2_matches_dense() -> None:
    """ALBERT from meshpar's table: its one layer, shared across the depth, sharded once and run at every depth."""
    run_distributed(family_case, 4, "albert", 2)


def pipeline_refusal_case(family: str) -> str:
    setup_parallel(pp=2)
    try:
        meshpar.parallelize(build(family), {"pipeline_parallel_size": 2, "num_microbatches": 2})
    except ValueError as error:
        return str(error)
    return "accepted"


def test_pipelines_refuse_layers_shared_across_the_depth() -> None:
    for message in run_distributed(pipeline_refusal_case, 2, "albert"):
        assert "runs 2 layers on the weights of 1 (shared across its depth" in message, message


ENCODER_DECODERS = ["t5", "mt5", "bart", "blenderbot", "blenderbot_small", "pegasus"]
# (family, tp, pp, vpp, schedule): every family at pp=2; T5 and BART also at tp=2 x pp=2, pp=4, two chunks per rank
ENCODER_DECODER_LAYOUTS = [(f, 1, 2, 1, "1f1b") for f in ENCODER_DECODERS] + [
    (f, *layout) for f in ("t5", "bart") for layout in ((2, 2, 1, "1f1b"), (1, 4, 1, "1f1b"), (1, 2, 2, "1f1b"))
]


@pytest.mark.parametrize(
    ("family", "tp", "pp", "vpp", "schedule"),
    [
        pytest.param(*case, marks=() if case[0] in ("t5", "bart") else pytest.mark.slow)
        for case in ENCODER_DECODER_LAYOUTS
    ],
)
def test_encoder_decoder_pipelines_match_dense(family: str, tp: int, pp: int, vpp: int, schedule: str) -> None:
    """apex's split-rank layout: the first stages run the encoder, the rest the decoder (pp=2: one each; pp=4 and two
    interleaved chunks per rank: two each), every stage running the model's own forward. The encoder's output is
    carried to every decoder stage, the decoder's embedded inputs from the first stage (the shared embedding lives
    there once, tied to the head on the last), T5's relative position bias handed from each stack's first block to
    its later ones across stages; left-padded encoder inputs, labels with -100: logits, loss and the step equal
    dense."""
    run_distributed(pipeline_case, tp * pp, family, tp, pp, vpp, None, False, schedule)


@pytest.mark.parametrize("family", ["glm4_moe_qk_norm", "dory"])
def test_plan_gaps_are_filled_or_kept_whole(family: str) -> None:
    """GLM-4-MoE with its per-head q/k norms on (Sarvam-MoE's default): the shipped plan leaves them replicated, so
    their grads would cover one rank's heads; meshpar's amendment sums them over tp. Dory's LM head is a Linear
    subclass with a per-token logit scale: it stays whole (full logits, the plain loss) instead of failing."""
    import transformers

    if not hasattr(transformers, GENERIC[family][1]):
        pytest.skip(f"the installed transformers has no {GENERIC[family][1]}")
    run_distributed(family_case, 2, family, 2)


@pytest.mark.parametrize(("sp", "layers"), [(False, 2), (True, 2), (True, 1)])
def test_encoder_table_with_masked_lm_head_matches_dense(sp: bool, layers: int) -> None:
    """RoBERTa from meshpar's BERT-encoder table at tp=2, with and without sequence parallelism (post-norm layers:
    each norm after its row projection runs on sequence shards; the last layer's output is gathered for the head;
    one layer both enters and leaves the sequence-parallel region): the masked-LM head is vocab-parallel and tied to
    the embedding, its bias (registered twice) follows it."""
    run_distributed(family_case, 2, "roberta", 2, None, None, sp, layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_data_parallel_needs_no_plan(family: str) -> None:
    """tp=1: nothing is sharded (families whose plan meshpar cannot apply train at dp too)."""
    run_distributed(family_case, 2, family, 1)


@pytest.mark.parametrize(
    "family",
    ["mistral", "qwen3", "gemma2", "phi3", "gpt_neox", "phi", "olmo2", "jamba", "lfm2", "nanochat", "bart_causal"],
)
def test_sequence_parallel_from_transformers_plans_matches_dense(family: str) -> None:
    """Sequence parallelism converted from the model's own plan (attention / MLP gather their input once and
    reduce-scatter their output, norms on shards with their grads summed), proven by the one-block verification on
    sequence shards: Qwen3's per-head norms, Gemma2's four norms per layer and a tied embedding over an uneven
    vocab, Phi-3's packed projections, GPT-NeoX's parallel attention and MLP. OLMo-2's attention gathers its q / k /
    v outputs (its q / k norms span every head) and splits the o projection's input: it runs as in plain tensor
    parallelism on the gathered sequence, the gather's backward keeping this rank's chunk of a whole grad, its
    norms' grads not summed. Jamba's Mamba mixer and attention and LFM2's short convolution and attention, which
    the shipped plans leave whole, run replicated on the whole sequence (input gathered, output cut back to the
    shard), their grads whole; Jamba's experts around them take the tokens of the shards. NanoChat's final norm
    has no parameters and BART's causal LM (post-norm layers) has none after its layers: the last layer's output is
    gathered and what follows runs on the whole sequence."""
    run_distributed(family_case, 2, family, 2, None, None, True)


@pytest.mark.parametrize(
    "family",
    ["mixtral", "qwen2_moe", "deepseek_v3", "nemotron_h", "qwen3_next",
     pytest.param("deepseek_v2", marks=pytest.mark.slow), pytest.param("olmoe", marks=pytest.mark.slow)],
)  # fmt: skip
def test_sequence_parallel_with_experts_matches_dense(family: str) -> None:
    """Megatron's sequence parallelism around mixture-of-experts blocks: the router runs on the shards (its grads
    summed over tp), the experts all-gather the tokens with their routes and reduce-scatter their output back
    (Mixtral); Qwen2-MoE's shared expert, run on flattened tokens, is a region of its own and its gate runs on the
    shards; DeepSeek's latent attention keeps ``q_a_proj``, its norms and ``kv_a_proj_with_mqa`` replicated on the
    gathered input, their grads (partial over tp: the column projections after them leave the input grad to the
    region's reduce-scatter) summed over tp; Nemotron-H names its Mamba mixers and its experts blocks alike
    (``mixer``): the experts blocks take the shards' tokens, the Mamba mixers run on the whole sequence; Qwen3-Next's
    gated delta-net gathers every projection's output (no row projection): it runs sharded as in plain tensor
    parallelism on the gathered sequence, its whole output cut back to the shard; loss, every grad and the step
    equal dense."""
    run_distributed(family_case, 2, family, 2, None, None, True)


def sequence_parallel_verification_case(family: str = "opt") -> str:
    setup_parallel(tp=2)
    try:
        meshpar.parallelize(build(family), {"tensor_parallel_size": 2, "sequence_parallel": True})
    except PlanVerificationError as error:
        return str(error)
    return "not refused"


def test_sequence_parallel_plans_are_verified_on_sequence_shards() -> None:
    """OPT's MLP projections sit directly in its layer (each would gather and scatter on its own), but the layer
    flattens batch and sequence before them: the gather would join features, not positions. The verification runs
    the block on sequence shards and refuses on every rank."""
    for message in run_distributed(sequence_parallel_verification_case, 2):
        assert "block model.decoder.layers.0 does not match the dense one at tp=2" in message, message


def test_key_value_heads_below_tp_are_replicated() -> None:
    run_distributed(family_case, 2, "qwen2", 2, 1)  # one KV head, tp=2
    run_distributed(family_case, 4, "mistral", 4, 2)  # two KV heads, tp=4
    run_distributed(family_case, 4, "mixtral", 4, 2)  # and one of four experts per rank


def test_attention_sinks_are_sharded_with_their_heads() -> None:
    """transformers' ``local_params``: each rank keeps the sinks of its own heads (``Shard(0)``) and the attention's
    forward reads them as local tensors; loss, every grad and the step equal dense, at tp=2, tp=2 x pp=2 and with
    sequence parallelism (the attention gathers its input and keeps its sinks sharded with its heads)."""
    run_distributed(family_case, 2, "granite_swa", 2)
    run_distributed(pipeline_case, 4, "granite_swa", 2, 2)
    run_distributed(family_case, 2, "granite_swa", 2, None, None, True)


def test_per_head_gates_from_every_local_head_stay_with_their_heads() -> None:
    """Doge: its attention gates each key/value head by ``dt_proj`` (over all of that rank's value features) times
    ``A``; transformers' rowwise ``dt_proj`` would hand every rank the gates of all heads. meshpar's amendment keeps
    this rank's gates (``RowParallel(local_output=True)``) and ``A``'s entries, and sums its per-head q/k norms'
    grads; tp=2 and tp=2 x pp=2 equal dense."""
    run_distributed(family_case, 2, "doge", 2)
    run_distributed(pipeline_case, 4, "doge", 2, 2)


def test_statistics_over_the_features_tp_splits_are_taken_over_all_of_them() -> None:
    """Gemma-3n: the activation sparsity of its first layers cuts each token's gate activations at mean + k * std of
    all its MLP features, which tp splits; meshpar's fix-up sums both statistics over tp (and their grads); loss,
    every grad and the step equal dense at tp=2 (dp=2 beside it)."""
    run_distributed(family_case, 2, "gemma3n_text", 2)
    run_distributed(family_case, 4, "gemma3n_text", 2)


def attention_placements_case(family: str) -> list[str]:
    setup_parallel(tp=2)
    model = meshpar.parallelize(build(family), {"tensor_parallel_size": 2})
    attention = model.module.model.layers[0].self_attn
    return [repr(getattr(attention, n).weight.placements) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]


def test_plans_that_shard_only_the_experts_get_the_attention_sharded_too() -> None:
    """GraniteMoE's shipped plan (as PhiMoE's, HunYuan-MoE's, AFMoE's) has entries for its experts only, which
    would keep every attention weight on every rank; meshpar's amendment shards q/k/v by heads and o_proj by its
    input, and the step equals dense with sequence parallelism too."""
    placements = run_distributed(attention_placements_case, 2, "granitemoe")[0]
    assert placements == ["(Shard(dim=0),)"] * 3 + ["(Shard(dim=1),)"], placements
    run_distributed(family_case, 2, "granitemoe", 2)
    run_distributed(family_case, 2, "granitemoe", 2, None, None, True)


def experts_placements_case(family: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The placements and local shapes of the first experts module's weights at tp=2."""
    setup_parallel(tp=2)
    model = meshpar.parallelize(build(family), {"tensor_parallel_size": 2})
    experts = next(m for name, m in model.module.named_modules() if name.endswith("mlp.experts"))
    return {n: (str(p.placements), tuple(p.to_local().shape)) for n, p in experts.named_parameters()}


_ROWS, _FEAT = "(Shard(dim=0),)", "(Shard(dim=2),)"


@pytest.mark.parametrize(
    "family,layout",
    [
        # 4 experts and 2 identity experts: gate_up_proj as 2 groups (2 experts' rows and 1 identity row each)
        ("longcat_flash", {"gate_up_proj": (_ROWS, (1, 3, 32, 32)), "down_proj": (_ROWS, (2, 32, 16))}),
        # one identity expert: every expert with half its features ([gate | up] split per part)
        ("longcat_flash_one_identity", {"gate_up_proj": (_FEAT, (5, 2, 8, 32)), "down_proj": (_FEAT, (4, 32, 8))}),
    ],
)  # fmt: skip
def test_identity_experts_match_dense(family: str, layout: dict) -> None:
    """LongCat-Flash: its fused gate/up weights hold rows for its identity experts too. Where both counts split
    over tp, each rank holds whole experts and runs the identity experts of its tokens itself (first tp rank only:
    counted once); where they do not, every expert keeps half its features and the identity output is divided by
    tp inside the sum (transformers' ``moe_identity_expert``). tp=2 (and tp=2 x pp=2) equal dense."""
    assert run_distributed(experts_placements_case, 2, family) == [layout, layout]
    run_distributed(family_case, 2, family, 2)
    if family == "longcat_flash":
        run_distributed(pipeline_case, 4, family, 2, 2)


def test_lists_of_sublayers_and_routers_reading_their_childs_weight_under_sequence_parallelism() -> None:
    """LongCat-Flash's layers hold their two attentions, MLPs and norms in lists (never called themselves): each
    item is a region or a norm; its router reads its classifier's weight itself, so the router runs on the shards
    whole, its grads summed over tp. The plan says so, and tp=2 with sequence parallelism equals dense."""
    from meshpar.hf import plan_for
    from meshpar.hf.config import load_config

    plan = plan_for(build("longcat_flash"), load_config({"tensor_parallel_size": 2, "sequence_parallel": True}))
    kinds = {pattern: type(style).__name__ for pattern, style in plan.styles.items()}
    inside = "model.layers.*."
    assert kinds[inside + "self_attn.*"] == kinds[inside + "mlps.*"] == "GatherSequenceInput", kinds
    assert kinds[inside + "input_layernorm.1"] == kinds[inside + "post_attention_layernorm.0"] == "SequenceParallelNorm"
    assert kinds[inside + "mlp.router"] == "ReplicatedGradSum" and inside + "mlp.router.classifier" not in kinds
    run_distributed(family_case, 2, "longcat_flash", 2, None, None, True)


def test_latent_attention_and_shared_experts_match_dense() -> None:
    """DeepSeek-V3: transformers ships no attention entries for it; meshpar's amendment shards its latent attention
    as V2's plan does (the rope features of ``kv_a_proj_with_mqa`` feed every rank's heads: their grad is summed over
    tp), with routed and shared experts; tp=2 and tp=2 x pp=2."""
    run_distributed(family_case, 2, "deepseek_v3", 2)
    run_distributed(pipeline_case, 4, "deepseek_v3", 2, 2)


def test_experts_fed_blocks_of_tokens_match_dense() -> None:
    """Llama-4: the experts get ``[experts * tokens, hidden]`` blocks (each rank runs its own experts' blocks and
    all-gathers them back); its causal LM names a base model it does not hold (stages find it by its embedding)."""
    run_distributed(family_case, 2, "llama4_text", 2)
    run_distributed(pipeline_case, 4, "llama4_text", 2, 2)


def test_user_plan_with_fixup_shards_a_model_no_table_covers() -> None:
    """OPT's attention reshapes with its own head count: a user plan divides it with a fix-up."""
    plan = {**_OPT_ATTENTION, "model.decoder.layers.*.self_attn": divide_attribute("num_heads")}
    run_distributed(family_case, 2, "opt", 2, None, plan)


def verification_case() -> str:
    setup_parallel(tp=2)
    try:
        meshpar.parallelize(build("opt"), {"tensor_parallel_size": 2}, plan=_OPT_ATTENTION)
    except PlanVerificationError as error:
        return str(error)
    return "not refused"


def test_verification_refuses_a_plan_that_changes_the_math() -> None:
    """Without the fix-up OPT's attention reads each rank's half of the features as half the sequence: no error
    would show it, so the one-block verification refuses on every rank and names the attention."""
    messages = run_distributed(verification_case, 2)
    for message in messages:
        assert "block model.decoder.layers.0 does not match the dense one at tp=2" in message, message
        assert "self_attn" in message and "grad of self_attn.q_proj.weight" in message, message


def _refusal(model: torch.nn.Module, config: dict) -> str:
    with pytest.raises(ValueError) as error:  # no process group exists in this process: the plan fails first
        meshpar.parallelize(model, config)
    return str(error.value)


def test_bad_layouts_are_refused_before_any_process_group() -> None:
    assert "6 attention heads cannot be split over tp=4" in _refusal(
        build("qwen3", heads=6), {"tensor_parallel_size": 4}
    )
    for family in ("gpt2", "llama"):  # meshpar's own plans too
        message = _refusal(build(family, heads=6, kv_heads=6), {"tensor_parallel_size": 4})
        assert "6 attention heads cannot be split over tp=4" in message, message
    message = _refusal(build("qwen2", heads=6, kv_heads=3), {"tensor_parallel_size": 2})
    assert "3 key/value heads can neither be split over tp=2 nor replicated evenly" in message
    assert "4 experts cannot be split into whole experts over tp=3" in _refusal(
        build("mixtral", heads=6, kv_heads=3), {"tensor_parallel_size": 3}
    )
    mpt = MptForCausalLM(MptConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, eos_token_id=2))
    assert "neither a tensor-parallel plan in the installed transformers nor a meshpar table" in _refusal(
        mpt, {"tensor_parallel_size": 2}
    )
    message = _refusal(build("falcon_multi_query"), {"tensor_parallel_size": 2})
    assert "1 key/value heads can neither be split over tp=2 nor replicated evenly inside the fused projection" in (
        message
    ), message
    message = _refusal(build("t5"), {"tensor_parallel_size": 2, "sequence_parallel": True})
    assert "sequence parallelism from the model's tensor-parallel plan" in message, message
    assert "decoder.block: one stack of an encoder-decoder" in message, message
    message = _refusal(build("qwen2", kv_heads=1), {"tensor_parallel_size": 2, "sequence_parallel": True})
    assert "key/value heads replicated over tp is not supported" in message, message


def generation_case(family: str, tp: int = 2, pp: int = 1) -> bool:
    setup_parallel(tp=tp, pp=pp)
    dense = build(family, layers=2 * pp)
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "num_microbatches": 2 * pp}
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    prompt = batch(family, rows=2, seq=5)["input_ids"]
    if pp > 1:
        prompt = prompt.clamp_min(3)  # no pad token inside (the padded case is below)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    return torch.equal(model.generate(prompt, **kwargs), dense.generate(prompt, **kwargs))


def padded_generation_case(family: str) -> bool:
    """Left-padded prompts of different lengths at pp=2: HF's loop masks the padding and counts positions from each
    row's first real token; both must reach every stage (the case first checks that each changes the dense tokens)."""
    setup_parallel(pp=2)
    dense = build(family, layers=4)
    with torch.no_grad():  # sharper learned positions, so that shifted positions change the greedy tokens
        for name, param in dense.named_parameters():
            if name.endswith(("wpe.weight", "embed_positions.weight")):
                param.mul_(10.0)
    config = {"pipeline_parallel_size": 2, "num_microbatches": 4}
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    prompt = torch.randint(3, 64, (4, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :2] = mask[3, :1] = 0
    prompt = prompt.masked_fill(mask == 0, 0)  # 0: the pad token
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "attention_mask": mask}
    want = dense.generate(prompt, **kwargs)
    assert not torch.equal(want, dense.generate(prompt, **(kwargs | {"attention_mask": torch.ones_like(mask)})))
    assert not torch.equal(want, dense.generate(prompt, position_ids=torch.arange(5).expand(4, 5), **kwargs))
    return torch.equal(model.generate(prompt, **kwargs), want)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "phi3", "xlm_roberta", "t5", "bart"])  # XLM-R: lm_head.decoder
def test_greedy_generation_matches_dense(family: str) -> None:
    assert run_distributed(generation_case, 2, family) == [True, True]


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v4"])
def test_greedy_generation_across_pipeline_stages_matches_dense(family: str) -> None:
    """Every stage runs the model's own forward on the prompt's ids (DeepSeek-V4: residual streams between
    stages, routing by token ids on every stage)."""
    assert run_distributed(generation_case, 2, family, 1, 2) == [True, True]


def encoder_decoder_refusal_case(case: str) -> str:
    setup_parallel(pp=4 if case == "too_deep" else 2)
    config = {"pipeline_parallel_size": 2, "num_microbatches": 2}
    model = build("t5", layers=1)
    if case == "auto_partition":
        config["auto_partition"] = True
    elif case == "zero_bubble":
        config["pipeline_schedule"] = "zero_bubble"
    elif case == "too_deep":
        config["pipeline_parallel_size"] = config["num_microbatches"] = 4
    elif case == "meta":
        with torch.device("meta"):
            model = type(model)(model.config)
    try:
        meshpar.parallelize(model, config)
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("auto_partition", "an encoder-decoder's stages split at the encoder's end (apex's split rank)"),
        ("too_deep", "1 encoder and 1 decoder layers cannot fill 4 pipeline stages"),
        ("zero_bubble", "an encoder-decoder's decoder stages pass on the encoder's output too: use pipeline_schedule"),
        ("meta", "reads an encoder-decoder's pipeline layout off a dense forward, which a model built on meta"),
    ],
)
def test_encoder_decoder_pipelines_refuse_what_they_cannot_split(case: str, message: str) -> None:
    world = 4 if case == "too_deep" else 2
    for result in run_distributed(encoder_decoder_refusal_case, world, case):
        assert message in result, result


def encoder_decoder_generation_case(family: str, tp: int) -> list[bool]:
    """Greedy and beam search (the prompt repeated per beam) from padded prompts of an encoder-decoder split into
    an encoder and a decoder stage: the decoder's sequences equal the dense model's (the case first checks that the
    prompt's mask changes them in one of the two)."""
    setup_parallel(tp=tp, pp=2)
    dense = build(family, layers=2)
    model = meshpar.parallelize(copy.deepcopy(dense), {"tensor_parallel_size": tp, "pipeline_parallel_size": 2})
    prompt = torch.randint(3, 64, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, 4:] = mask[2, 5:] = 0
    results, masked = [], []
    for extra in ({"do_sample": False}, {"num_beams": 2, "do_sample": False}):
        kwargs = {"max_new_tokens": 5, "min_new_tokens": 5, "attention_mask": mask, **extra}
        want = dense.generate(prompt, **kwargs)
        masked.append(
            not torch.equal(want, dense.generate(prompt, **(kwargs | {"attention_mask": torch.ones_like(mask)})))
        )
        results.append(torch.equal(model.generate(prompt, **kwargs), want))
    assert any(masked)
    return results


@pytest.mark.parametrize("family", ["t5", "bart"])
@pytest.mark.parametrize("tp", [1, 2])
def test_encoder_decoder_generation_across_pipeline_stages_matches_dense(family: str, tp: int) -> None:
    assert run_distributed(encoder_decoder_generation_case, 2 * tp, family, tp) == [[True, True]] * 2 * tp


@pytest.mark.parametrize("family", ["gpt2", "opt"])  # learned absolute positions: they must follow the padding
def test_generation_across_pipeline_stages_from_left_padded_prompts_matches_dense(family: str) -> None:
    assert run_distributed(padded_generation_case, 2, family) == [True, True]


def reshard_case(directory: str, family: str) -> str:
    """Saved at tp=2, loaded at tp=1 x dp=2 (plain parameters, no plan): the same model."""
    setup_parallel(tp=2)
    model = meshpar.parallelize(build(family), {"tensor_parallel_size": 2})
    with torch.no_grad():
        for param in model.parameters():
            _local(param).add_(0.01)  # differ from the seed init
    data = batch(family)
    want = model.eval_loss(**data)
    step = model.save_parallelized(directory)
    setup_parallel(tp=1)
    fresh = meshpar.parallelize(build(family), {"tensor_parallel_size": 1}).from_parallelized(directory)
    torch.testing.assert_close(fresh.eval_loss(**data), want, atol=1e-6, rtol=1e-6)
    return str(step)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "mixtral", "longcat_flash"])
def test_checkpoints_reshard_and_load_with_torch_tools(tmp_path, family: str) -> None:
    """The DCP checkpoint holds every parameter under its FQN in the HF model's own shape: torch's
    ``dcp_to_torch_save`` gives a state dict the plain model loads (a tied head is stored once)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = run_distributed(reshard_case, 2, str(tmp_path / "dcp"), family)[0]
    dcp_to_torch_save(step, tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    plain = build(family)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    assert torch.equal(plain.get_parameter("model.embed_tokens.weight"), state["model.embed_tokens.weight"])


def pipeline_case(
    family: str, tp: int, pp: int, vpp: int = 1, layers: int | None = None, sp: bool = False, schedule: str = "1f1b"
) -> None:
    """One step through the pipeline (each stage runs the model's own forward) against the dense model, on a
    left-padded batch: every stage builds the model's own masks."""
    setup_parallel(tp=tp, pp=pp)
    dense = build(family, layers=layers or 2 * pp * vpp)
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "virtual_pipeline_size": vpp}
    config["sequence_parallel"], config["pipeline_schedule"] = sp, schedule
    model = meshpar.parallelize(copy.deepcopy(dense), {**config, "num_microbatches": 2 * pp})
    data = batch(family, rows=max(4, 2 * pp))
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    data["attention_mask"][1, :4] = 0
    data["labels"][1, :4] = -100
    expected = dense(**data)
    expected.loss.backward()
    torch.optim.SGD(dense.parameters(), lr=0.5).step()
    optimizer = DistributedOptimizer(model, torch.optim.SGD, lr=0.5)
    logits = model.eval_logits(**data)
    if logits is not None:  # the ranks of the last stage
        want = expected.logits.detach()
        want = want.chunk(tp, -1)[model.dims.tp_rank] if model.vocab_sharded else want
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.train_step(**data), expected.loss.detach(), atol=1e-5, rtol=1e-5)
    optimizer.step()
    for module in model.local_modules():
        for name, param in module.named_parameters():
            full = dense.get_parameter(name).detach()
            want = local_slice(in_parameter_layout(full, module, name), param)
            torch.testing.assert_close(_local(param), want, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma2", "phi3", "gpt_neox", "phi", "mixtral"])
def test_pipeline_from_transformers_pp_plan_matches_dense(family: str) -> None:
    run_distributed(pipeline_case, 2, family, 1, 2)


@pytest.mark.parametrize(("family", "vpp"), [("qwen3", 1), ("gemma2", 1), ("olmo2", 2)])
def test_tp_x_pp_from_transformers_plans_matches_dense(family: str, vpp: int) -> None:
    """tp=2 x pp=2 (Gemma2: a tied, vocab-parallel embedding over an uneven vocab on the first and last stage;
    OLMo-2 with two interleaved chunks per rank)."""
    run_distributed(pipeline_case, 4, family, 2, 2, vpp)


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_sequence_parallel_inside_pipeline_stages_matches_dense(family: str) -> None:
    """tp=2 x pp=2 with sequence parallelism, every stage running the model's own forward: the hidden states cross
    stages as each rank's sequence shard (Qwen3: q/k norms over gathered heads; Phi-3: packed projections)."""
    run_distributed(pipeline_case, 4, family, 2, 2, 1, None, True)


def test_sequence_parallel_refused_where_pipeline_layers_are_handed_more_than_hidden_states() -> None:
    """Gemma-3n's layers take per-layer inputs besides the hidden states; stages under sequence parallelism carry
    only the hidden states' shard, so the layout is refused naming what its layers are handed (the stage check
    itself: today's shipped plans already refuse sequence parallelism for every such family earlier)."""
    model = build("gemma3n_text")
    layout = inferred_pipeline_layout(model)  # its shipped plan leaves out the per-layer-input modules
    with pytest.raises(ValueError, match=r"sequence parallelism inside pipeline stages.*handed more \(\['2'\]\)"):
        install_decoder_stage(model, layout, sequence_shards=2)


@pytest.mark.parametrize(
    ("family", "world", "tp"),
    [("nemotron", 2, 1), ("olmoe", 4, 2), ("opt", 2, 1), ("opt", 4, 2), ("opt_projected", 2, 1), ("nanochat", 2, 1)],
)
def test_pipeline_from_a_plan_read_off_the_model_matches_dense(family: str, world: int, tp: int) -> None:
    """Families without transformers' pipeline plan: the plan is read from the module holding the layer list (the
    base model, or OPT's decoder inside it) in the order the dense forward calls its children, proven on the dense
    model, and the pipelined step equals the dense one (OLMoE: experts under tp too; OPT: its final norm is
    registered before the layers but runs on the last stage, its learned positions add nothing after the first
    stage, OPT-350m's projections in and out of narrower embeddings; NanoChat's one parameter-free norm is applied
    to the embeddings and to the last hidden states: its first call acts on the first stage, its last on the last)."""
    assert not getattr(build(family).config, "base_model_pp_plan", None)
    run_distributed(pipeline_case, world, family, tp, 2)


def test_encoder_table_pipeline_with_the_head_registered_first_matches_dense() -> None:
    """XLM-R as a causal LM at tp=2 x pp=2 from meshpar's BERT-encoder tables (tp and pp): its ``lm_head`` is
    registered before its base model, and still runs on the last stage."""
    run_distributed(pipeline_case, 4, "xlm_roberta", 2, 2)


def test_pipeline_plan_that_leaves_out_a_module_is_read_off_the_model() -> None:
    """Phi-4-multimodal's shipped pipeline plan leaves out its image / audio embedder, which runs before the layers:
    the plan is read off the model instead (the embedder with the first stage) and proven on the dense model."""
    run_distributed(pipeline_case, 2, "phi4_multimodal", 1, 2)


@pytest.mark.parametrize(
    ("family", "world", "tp", "layers"),
    [
        ("gemma3n_text", 2, 1, 2),
        ("deepseek_v4", 4, 2, None),
        ("inkling2_text", 2, 1, None),
        ("glm_moe_dsa", 2, 1, None),
    ],
)
def test_pipeline_stages_carry_what_layers_are_handed_besides_hidden_states(
    family: str, world: int, tp: int, layers: int | None
) -> None:
    """Every stage runs the model's own forward on the microbatch's ids; what a stage's layers are handed that it
    cannot compute itself crosses from the stage before (meshpar.hf.stages.Carried): Gemma-3n's per-layer inputs
    (computed before the layers by first-stage modules, for every layer) next to its altup streams; DeepSeek-V4's
    residual streams, with routing by token ids on every stage, at tp=2 too; Inkling2's stack of earlier hidden
    states, which its forward extends between layers from the hidden states it handed a layer; GLM-MoE-DSA's
    layers, which return their top-k indices too."""
    run_distributed(pipeline_case, world, family, tp, 2, 1, layers)


def zero_bubble_refusal_case(family: str) -> str:
    try:
        meshpar.parallelize(build(family), {"pipeline_parallel_size": 2, "pipeline_schedule": "zero_bubble"})
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize("family", ["gemma3n_text", "inkling2_text"])
def test_zero_bubble_refuses_stages_passing_more_than_one_tensor_at_parallelize(family: str) -> None:
    """ZB-H1 splits a stage's backward for one tensor crossing each boundary: Gemma-3n's per-layer inputs and
    Inkling2's stack of hidden states cross too, refused before any step (the first step refused them before)."""
    for message in run_distributed(zero_bubble_refusal_case, 2, family):
        assert f"{family}'s stages pass on [2]" in message, message


def test_gptj_pipeline_matches_dense() -> None:
    """GPT-J at tp=2 x pp=2 however the installed transformers describes it: 5.23 ships no pipeline plan (read off
    the model) and its blocks return tuples (so do the stand-ins for other stages' blocks); 5.24 ships a plan."""
    run_distributed(pipeline_case, 4, "gptj", 2, 2)


def inferred_meta_case() -> None:
    setup_parallel(pp=2)
    with torch.device("meta"):
        skeleton = build("nemotron", layers=4)
    meshpar.parallelize(skeleton, {"pipeline_parallel_size": 2, "num_microbatches": 2})


def test_a_plan_read_off_a_meta_model_is_refused() -> None:
    """Nothing can prove the read plan on a model without values: refused, not guessed."""
    with pytest.raises(AssertionError, match=r"has no pipeline plan.*built on meta cannot run"):
        run_distributed(inferred_meta_case, 2)


def recurrent_case() -> None:
    setup_parallel(pp=2)
    meshpar.parallelize(build("hrm_text"), {"pipeline_parallel_size": 2, "num_microbatches": 2})


def test_a_model_that_is_not_one_layer_stack_is_refused_for_pipelines() -> None:
    """HRM runs its two layer stacks in turn, over and over, and its shipped pipeline plan names modules it does not
    have: no split into stages run once in order exists, so it is refused with its layer lists named."""
    with pytest.raises(AssertionError, match=r"keeps its layers in \['model.L_module.layers', 'model.H_module.layers'"):
        run_distributed(recurrent_case, 2)


def merged_case(directory: str, family: str) -> float:
    setup_parallel(tp=2)
    model = meshpar.parallelize(build(family), {"tensor_parallel_size": 2})
    with torch.no_grad():
        for param in model.parameters():
            _local(param).add_(0.01)
    model.save_parallelized(directory, merge_checkpoints=True)
    return model.eval_loss(**batch(family)).item()


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_merged_checkpoint_loads_with_from_pretrained(tmp_path, family: str) -> None:
    loss = run_distributed(merged_case, 2, str(tmp_path / "hf"), family)[0]
    plain = type(build(family)).from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert abs(plain(**batch(family)).loss.item() - loss) < 1e-5


def test_embedding_subclass_with_a_norm_inside_matches_dense() -> None:
    """Each rank runs the embedding's own forward on the tokens it owns: the norm's grad is summed over tp."""
    run_distributed(family_case, 2, "qwen3_normed_embedding", 2)


def mixing_embedding_case() -> str:
    from tests.hf._configs import MixingEmbedding, with_embedding

    setup_parallel(tp=2)
    try:
        meshpar.parallelize(with_embedding(build("qwen3"), MixingEmbedding), {"tensor_parallel_size": 2})
    except PlanVerificationError as error:
        return str(error)
    return "not refused"


def test_verification_refuses_an_embedding_that_mixes_tokens() -> None:
    for message in run_distributed(mixing_embedding_case, 2):
        assert "embedding or block does not match" in message and "the output of model.embed_tokens" in message


def meta_case(directory: str, family: str, tp: int, pp: int) -> None:
    """A model built on meta allocates only its shards, trains, and loads a checkpoint to the dense model's loss."""
    setup_parallel(tp=tp, pp=pp)
    dense = build(family, layers=2 * pp)
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "num_microbatches": 2 * pp}
    meshpar.parallelize(copy.deepcopy(dense), config).save_parallelized(directory)
    with torch.device("meta"):
        skeleton = type(dense)(dense.config)
    model = meshpar.parallelize(skeleton, config)
    data = batch(family)
    assert torch.isfinite(model.train_step(**data))
    model.from_parallelized(directory)
    torch.testing.assert_close(model.eval_loss(**data), dense(**data).loss.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("family", "tp", "pp"), [("mixtral", 2, 1), ("gemma2", 1, 2)])
def test_meta_built_model_from_transformers_plans(tmp_path, family: str, tp: int, pp: int) -> None:
    run_distributed(meta_case, 2, str(tmp_path / "ckpt"), family, tp, pp)
