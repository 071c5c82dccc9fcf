"""Which HuggingFace families ``meshpar.parallelize`` shards exactly: every causal-LM and encoder-decoder model type
of the installed transformers that ships a tensor-parallel plan, plus meshpar's own tables, built tiny from its config
(never downloaded) and run against the same model on one process.

For each family and layout (tp=2, dp=2, tp=2 with sequence parallelism on 2 gloo processes; pp=2 and tp2 x pp2 on 2
and 4; for mixture-of-experts families ep=2 over dp=2, and ep2 x tp2 on 4; cp=2 on 2, cp2 x tp2 on 4) one training
step: the loss, every parameter grad (this rank's shard of the dense grad; a grad near zero is judged against 1% of
the largest grad norm) and the parameters after an SGD step must equal dense within 1e-4 relative. Verdicts: ``OK``;
``refused`` (meshpar raised a clear error before computing anything: the reason is listed); ``FAIL`` (a mismatch or
a crash: a defect); ``-`` (the tiny model could not be built from the config alone, e.g. a multimodal family, so
nothing ran). Checks at tp=2 (``--layouts gen,merged,per-rank``): greedy generation equal to dense, the merged
checkpoint loaded by the family's ``from_pretrained`` giving the sharded model's loss (1e-5 relative), and the share
of the parameters each rank holds.

    .venv/bin/python benchmarks/hf_coverage.py [--types llama,qwen3] [--layouts tp2,dp2,tp2sp,gen] [--markdown]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_MAX_PARAMETERS = 5_000_000  # one process per rank holds a dense copy: 4 ranks x (model + grads + optimizer)
# tp, pp, world, sequence parallelism, expert parallelism (mixture-of-experts families only; "-" for the others),
# context parallelism
LAYOUTS = {
    "tp2": (2, 1, 2, False, 1, 1),
    "dp2": (1, 1, 2, False, 1, 1),
    "pp2": (1, 2, 2, False, 1, 1),
    "tp2pp2": (2, 2, 4, False, 1, 1),
    "tp2sp": (2, 1, 2, True, 1, 1),
    "ep2": (1, 1, 2, False, 2, 1),
    "ep2tp2": (2, 1, 4, False, 2, 1),
    "cp2": (1, 1, 2, False, 1, 2),
    "cp2tp2": (2, 1, 4, False, 1, 2),
}
# checks at tp=2 besides the training step: greedy generation against the dense model's, the merged checkpoint
# loaded by the family's own ``from_pretrained`` giving the sharded model's loss, and parameters held per rank
CHECKS = ("gen", "merged", "per-rank")
# the family's other heads (sequence and token classification, question answering, where transformers has the class),
# each at tp=2, dp=2 (3 + 1 rows, labels padded with -100 unevenly) and pp=2: one cell, "OK n/n" or the first
# refusal or failure
HEAD_LAYOUTS = {"tp2": (2, 1, 2), "dp2": (1, 1, 2), "pp2": (1, 2, 2)}
HEAD_MAPPINGS = {
    "sequence": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "qa": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
}


# the row of a family's encoder-decoder class where the family also has a causal-LM class (BART's ForCausalLM is
# its decoder alone): "bart+seq2seq"
SEQ2SEQ = "+seq2seq"


def _model_type(row: str) -> str:
    return row.removesuffix(SEQ2SEQ)


def _families() -> dict[str, str]:
    """row -> class name, for every model type with a transformers tp plan or a meshpar table: its causal-LM class
    (row: the model type) and its encoder-decoder class (row: the model type, with :data:`SEQ2SEQ` after it where
    it has both)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    from meshpar.hf.hf_plan import TABLES

    found = {}
    for model_type, config_name in CONFIG_MAPPING_NAMES.items():
        config_cls = getattr(transformers, config_name, None)
        has_plan = bool(getattr(config_cls, "base_model_tp_plan", None)) or model_type in TABLES
        causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        seq2seq = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        for row, model_name in ((model_type, causal), (model_type + SEQ2SEQ if causal else model_type, seq2seq)):
            if has_plan and model_name:
                found[row] = model_name if isinstance(model_name, str) else model_name[0]
    return dict(sorted(found.items()))


def tiny(model_type: str) -> torch.nn.Module:
    """The family's causal LM at tiny size: 2 layers, hidden 32, 4 heads (2 KV heads) of 8, vocab 64. Layer types
    are re-derived by the config for 2 layers where it can, else cut from the full depth (see :func:`_tiny_config`)."""
    try:
        return _tiny_model(model_type, cut_layer_types=False)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as error:
        if "at the tiny size" in str(error):
            raise
    return _tiny_model(model_type, cut_layer_types=True)


# vision / audio towers built inside a causal LM (Phi-4-multimodal's encoders), at tiny size
_TOWER_SIZES = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_blocks=1, num_attention_heads=4, image_size=28,
    crop_size=28, patch_size=14, ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32,
    depthwise_multiplier=1,
)  # fmt: skip
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_PER_LAYER_INPUTS = {"vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8}
_INKLING2 = {"unpadded_vocab_size": 64, "swa_head_dim": 8, "rel_extent": 16}
# families whose sizes the generic keys miss: Gemma-3n / Gemma-4 embed per-layer inputs from full-size vocabularies;
# Cohere-Compass keeps rotary parameters per layer type and ships none by default (its checkpoints do); LongCat-Flash
# counts layers of two sublayers (``num_layers``; its ``num_hidden_layers`` is twice that) and defaults to 256
# identity experts, which would take nearly every route (here 8 routed and 4 identity experts, its checkpoints' 2:1,
# each count split evenly over the 4 ranks of ep2 x tp2); LFM2-MoE's config has no layer types by default (its
# checkpoints list them): one convolution, one attention layer
_FAMILY_SIZES = {
    "gemma4_text": _PER_LAYER_INPUTS,
    "gemma3n_text": {**_PER_LAYER_INPUTS, "num_kv_shared_layers": 0},
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": _ROPE, "full_attention": _ROPE},
    },
    "longcat_flash": {"num_layers": 2, "n_routed_experts": 8, "zero_expert_num": 4},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "inkling2_text": _INKLING2,
    "inkling2_loop_text": _INKLING2,
    "dory": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
    },
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_d_state": 16, "mamba_chunk_size": 16},
}


# encoder-decoders name their sizes per stack (BART's kin) or T5's way
_ENCODER_DECODER_SIZES = dict(
    d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=48, decoder_ffn_dim=48, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8, d_ff=48,
    dropout=0.0, dropout_rate=0.0, attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=0,
    decoder_vocab_size=64,
)  # fmt: skip


def _tiny_config(model_type: str, *, cut_layer_types: bool) -> object:
    from transformers import AutoConfig

    model_type = _model_type(model_type)
    config = AutoConfig.for_model(model_type)
    sizes = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, ffn_dim=48, moe_intermediate_size=16, num_local_experts=4,
        num_experts=4, num_experts_per_tok=2, use_cache=False, rotary_dim=4,
        # multi-head latent attention (DeepSeek-V2/V3 and kin) at the same tiny size
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16,
        first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1,
        mamba_n_heads=4, mamba_d_head=16,
    )  # fmt: skip
    family = _FAMILY_SIZES.get(model_type, {})
    sizes.update(family)
    if getattr(config, "is_encoder_decoder", False):
        sizes.update(_ENCODER_DECODER_SIZES)
    text = config.get_text_config()
    # configs with per-layer sub-configs (Gemma-4, dots3): the tiny sizes are set globally, as the keys' defaults are
    with contextlib.suppress(AttributeError):
        text.allow_global_per_layer_attribute_access = True
    depth = getattr(text, "num_hidden_layers", None)
    # per-layer lists (mlp types, head counts; layer types where the config cannot re-derive them) for the full
    # depth: keep the first and the last layer's entries, so both kinds (dense and MoE, sliding and full) stay
    per_layer = {
        key: [value[0], value[-1]]
        for key, value in vars(text).items()
        if isinstance(value, list | tuple) and depth and depth > 2 and len(value) == depth
        and (cut_layer_types or key != "layer_types")
    }  # fmt: skip
    if hasattr(text, "kv_lora_rank"):  # latent attention: as many key/value heads as heads
        sizes.update(num_key_value_heads=4, qk_head_dim=16)
    for key, value in {**sizes, **per_layer}.items():
        if hasattr(text, key) or key in inspect.signature(type(text).__init__).parameters:
            try:
                setattr(text, key, value)
            except AttributeError:  # a derived property
                continue
    if getattr(config, "is_encoder_decoder", False) and getattr(text, "decoder_start_token_id", None) is None:
        text.decoder_start_token_id = 0  # T5's config has no such key, its checkpoints' configs do
    if hasattr(text, "layer_types") and "layer_types" not in per_layer and "layer_types" not in family:
        with contextlib.suppress(AttributeError):  # a derived property
            text.layer_types = None  # re-derived for 2 layers below
    for name, tower in list(vars(text).items()):  # towers a text model still builds (Phi-4-multimodal's encoders)
        if name.endswith("_config") and hasattr(tower, "to_dict"):
            for key, value in _TOWER_SIZES.items():
                if key in tower.to_dict():
                    setattr(tower, key, value)
    values = text.to_dict()
    overrides = values.get("per_layer_config")  # per-layer sub-configs by layer index (Gemma-4): the same cut
    if isinstance(overrides, dict) and depth and depth > 2:
        by_index = {int(k): v for k, v in overrides.items()}
        values["per_layer_config"] = {new: by_index[old] for new, old in ((0, 0), (1, depth - 1)) if old in by_index}
    text = type(text)(**values)  # re-run the config's own derivations (layer types, head dims)
    text._attn_implementation = "eager"
    return text


def head_classes(model_type: str) -> dict[str, str]:
    """kind -> the family's head class name, for the heads transformers has for this model type (on its first row
    only: none for an encoder-decoder row after a causal-LM one)."""
    from transformers.models.auto import modeling_auto

    found = {}
    if model_type.endswith(SEQ2SEQ):
        return found
    for kind, mapping in HEAD_MAPPINGS.items():
        name = getattr(modeling_auto, mapping).get(_model_type(model_type))
        if name:
            found[kind] = name if isinstance(name, str) else name[0]
    return found


def _tiny_model(model_type: str, *, cut_layer_types: bool, head: str | None = None) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    text = _tiny_config(model_type, cut_layer_types=cut_layer_types)
    if head is not None:
        text.num_labels = 2 if head == "qa" else 3
        return getattr(transformers, head_classes(model_type)[head])(text).eval()
    model_cls = getattr(transformers, _families()[model_type])
    with torch.device("meta"):  # count first: some families keep full-size towers (vision, audio) in any config
        size = sum(p.numel() for p in model_cls(text).parameters())
    if size > _MAX_PARAMETERS:
        raise ValueError(f"{size:,} parameters at the tiny size")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_cls(text).eval()
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()  # the dense model itself runs at this size
    model.zero_grad(set_to_none=True)
    return model


def _refused(error: Exception) -> str:
    """A refusal's verdict: its first sentence."""
    return "refused: " + str(error).split(". ")[0][:160]


def _step_verdict(
    model: torch.nn.Module,
    dense: torch.nn.Module,
    optimizer: object,
    loss: torch.Tensor,
    expected: torch.Tensor,
    *,
    what: str = "",
    param_floor: float = 0.0,
) -> str:
    """ "OK" when the step's loss, this rank's grads and, after ``optimizer.step()`` (the dense model already
    stepped), its parameters equal the dense model's within 1e-4 relative, else "FAIL: ..." (``what`` first). A grad
    whose norm is ~0 in exact arithmetic (a router that barely matters) holds rounding noise: judged against 1% of
    the largest grad norm, as meshpar's plan verification does; parameters against ``param_floor`` x that floor
    (at least 1e-6)."""
    from meshpar._compat import local_tensor
    from meshpar._shards import in_parameter_layout, local_slice

    worst = abs(loss.item() - expected.item()) / max(abs(expected.item()), 1e-6)
    floor = 1e-2 * max(p.grad.norm().item() for p in dense.parameters() if p.grad is not None)
    for module in model.local_modules():
        for name, param in module.named_parameters():
            want, got = dense.get_parameter(name).grad, param.grad
            if want is None or got is None:  # unused here (an expert no token was routed to)
                if (want is None) != (got is None) and (want if got is None else got).abs().max() > 0:
                    return f"FAIL: {what}grad of {name} missing on one side"
                continue
            want = local_slice(in_parameter_layout(want, module, name), param)
            worst = max(worst, ((local_tensor(got) - want).norm() / want.norm().clamp_min(floor)).item())
    optimizer.step()
    for module in model.local_modules():
        for name, param in module.named_parameters():
            want = local_slice(in_parameter_layout(dense.get_parameter(name).detach(), module, name), param)
            scale = want.norm().clamp_min(max(1e-6, param_floor * floor))
            worst = max(worst, ((local_tensor(param) - want).norm() / scale).item())
    return "OK" if worst < 1e-4 else f"FAIL: {what}max relative error {worst:.1e}"


def _case(model_type: str, tp: int, pp: int, sp: bool = False, ep: int = 1, cp: int = 1) -> str:
    import meshpar
    from meshpar.optim import DistributedOptimizer
    from meshpar.testing import setup_parallel

    setup_parallel(tp=tp, pp=pp, ep=ep, cp=cp)
    dense = tiny(model_type)
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "num_microbatches": 2 * pp}
    config["sequence_parallel"] = sp
    config["expert_parallel_size"] = ep
    config["context_parallel_size"] = cp
    try:
        model = meshpar.parallelize(copy.deepcopy(dense), config)
    except (ValueError, NotImplementedError) as error:
        message = str(error)
        if "has no experts module" in message:
            return "-: no experts (expert parallelism is for mixture-of-experts families)"
        if "not so for: " in message:  # sequence parallelism: what stands in the way, by kind, not by family
            blocking = message.split("not so for: ", 1)[1].split(". Turn", 1)[0].split("; ")
            kinds = sorted(
                {
                    "what follows the layers" if part.startswith("after ") else part.split(": ", 1)[-1].split(" (")[0]
                    for part in blocking
                }
            )
            return "refused: sequence parallelism blocked by " + "; ".join(kinds)[:160]
        return _refused(error)
    ids = torch.randint(3, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    expected = dense(input_ids=ids, labels=ids)
    expected.loss.backward()
    torch.optim.SGD(dense.parameters(), lr=0.1).step()
    optimizer = DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    dims = model.dims
    rows = 4 // dims.dp
    mine = ids[dims.dp_rank * rows : (dims.dp_rank + 1) * rows]
    loss = model.train_step(input_ids=mine, labels=mine)
    return _step_verdict(model, dense, optimizer, loss, expected.loss)


def _head_batch(kind: str, rows: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (rows, 12), generator=generator)
    if kind == "qa":
        start, end = (
            torch.randint(0, 12, (rows,), generator=generator),
            torch.randint(0, 12, (rows,), generator=generator),
        )
        start[0] = 40  # outside the sequence: unscored
        return {"input_ids": ids, "start_positions": start, "end_positions": end}
    if kind == "token":
        labels = torch.randint(0, 3, (rows, 12), generator=generator)
        labels[0, 4:] = -100  # the first replica's rows mostly unscored
        return {"input_ids": ids, "labels": labels}
    labels = torch.randint(0, 3, (rows,), generator=generator)
    labels[1] = -100
    ids[:, -1] = 2  # the tiny configs' eos token: BART-style classifiers pool each row's last eos
    return {"input_ids": ids, "labels": labels}


def _head_case(model_type: str, kind: str, tp: int, pp: int) -> str:
    """One SGD step of the family's ``kind`` head against the dense one (4 rows: 3 + 1 over dp=2)."""
    import meshpar
    from meshpar.optim import DistributedOptimizer
    from meshpar.testing import setup_parallel

    setup_parallel(tp=tp, pp=pp)
    try:
        dense = _tiny_model(model_type, cut_layer_types=False, head=kind)
    except Exception:
        dense = _tiny_model(model_type, cut_layer_types=True, head=kind)
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "num_microbatches": 2 * pp}
    try:
        model = meshpar.parallelize(copy.deepcopy(dense), config)
    except (ValueError, NotImplementedError) as error:
        return _refused(error)
    data = _head_batch(kind, 4)
    expected = dense(**data)
    expected.loss.backward()
    torch.optim.SGD(dense.parameters(), lr=0.1).step()
    optimizer = DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    dims = model.dims
    start, stop = ((0, 3), (3, 4))[dims.dp_rank] if dims.dp == 2 else (0, 4)
    try:
        loss = model.train_step(**{k: v[start:stop] for k, v in data.items()})
    except (ValueError, NotImplementedError) as error:
        return _refused(error)
    # a parameter near zero (a classifier's bias, whose grad is ~0 in exact arithmetic) moved by lr x rounding noise:
    # judged against lr x the grads' floor, as its grad is against the floor
    return _step_verdict(model, dense, optimizer, loss, expected.loss, what=f"{kind} head: ", param_floor=0.1)


def _heads(model_type: str) -> str:
    """The family's heads at every head layout: "OK n/n", else the first failure (before any refusal)."""
    from meshpar.testing import run_distributed

    verdicts = []
    for kind in head_classes(model_type):
        for layout, (tp, pp, world) in HEAD_LAYOUTS.items():
            try:
                results = run_distributed(_head_case, world, model_type, kind, tp, pp, timeout=300)
            except AssertionError as error:
                lines = [line for line in str(error).splitlines() if line.strip() and "Error" in line]
                results = ["FAIL: " + (lines[-1].strip()[:150] if lines else "crash")]
            verdict = sorted(set(results))[0] if len(set(results)) == 1 else "FAIL: ranks disagree"
            verdicts.append(
                verdict
                if verdict == "OK"
                else f"{verdict.split(': ')[0]}: {kind} at {layout}: {verdict.split(': ', 1)[-1]}"
            )
    if not verdicts:
        return "-"
    failed = [v for v in verdicts if v.startswith("FAIL")]
    refused = [v for v in verdicts if v.startswith("refused")]
    ok = sum(v == "OK" for v in verdicts)
    if failed or refused:
        return (failed or refused)[0].replace(": ", f" ({ok}/{len(verdicts)} OK): ", 1)
    return f"OK {ok}/{len(verdicts)}"


def _check_case(model_type: str, check: str, directory: str) -> str:
    """One of :data:`CHECKS` at tp=2."""
    from transformers.utils import logging as hf_logging

    import meshpar
    from meshpar._compat import DTensor
    from meshpar.testing import setup_parallel

    hf_logging.disable_progress_bar()
    setup_parallel(tp=2)
    dense = tiny(model_type)
    try:
        model = meshpar.parallelize(copy.deepcopy(dense), {"tensor_parallel_size": 2})
    except (ValueError, NotImplementedError) as error:
        return _refused(error)
    if check == "per-rank":
        return model.plan_summary().splitlines()[-1].rsplit("(", 1)[-1].rstrip(")")
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    if check == "gen":
        prompt, kwargs = ids[:, :5], {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        try:
            got = model.generate(prompt, **kwargs)
        except (ValueError, NotImplementedError) as error:
            return _refused(error)
        return "OK" if torch.equal(got, dense.generate(prompt, **kwargs)) else "FAIL: greedy tokens differ from dense"
    with torch.no_grad():  # merged: trained-looking weights, saved whole, loaded by transformers
        for param in model.parameters():
            (param.to_local() if isinstance(param, DTensor) else param).add_(0.01)
    model.save_parallelized(directory, merge_checkpoints=True)
    loss = model.eval_loss(input_ids=ids, labels=ids).item()
    torch.distributed.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = type(dense).from_pretrained(directory).eval()
    with torch.no_grad():
        want = plain(input_ids=ids, labels=ids).loss.item()
    error = abs(want - loss) / abs(want)
    return "OK" if error < 1e-5 else f"FAIL: from_pretrained loss off by {error:.1e}"


def run(model_type: str, layout: str) -> str:
    import tempfile

    from meshpar.testing import run_distributed

    try:
        tiny(model_type)
    except Exception as error:
        reason = str(error) if "at the tiny size" in str(error) else type(error).__name__
        return f"-: not built ({reason})"
    if layout == "heads":
        return _heads(model_type)
    try:
        if layout in CHECKS:
            with tempfile.TemporaryDirectory() as directory:
                results = run_distributed(_check_case, 2, model_type, layout, directory, timeout=300)
        else:
            tp, pp, world, sp, ep, cp = LAYOUTS[layout]
            results = run_distributed(_case, world, model_type, tp, pp, sp, ep, cp, timeout=300)
    except AssertionError as error:
        lines = [line for line in str(error).splitlines() if line.strip() and "Error" in line]
        return "FAIL: " + (lines[-1].strip()[:160] if lines else "crash")
    verdicts = sorted(set(results))
    return verdicts[0] if len(verdicts) == 1 else "FAIL: ranks disagree " + " | ".join(verdicts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: all with a plan)")
    parser.add_argument("--layouts", default="tp2,dp2,pp2,tp2pp2")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = parser.parse_args()
    families = _families()
    types = args.types.split(",") if args.types else list(families)
    layouts = args.layouts.split(",")
    rows, reasons = [], {}
    start = time.time()
    for model_type in types:
        cells = []
        for layout in layouts:
            verdict = run(model_type, layout)
            head, _, why = verdict.partition(": ")
            if why:
                key = f"{head}: {why}"
                reasons.setdefault(key, len(reasons) + 1)
                cells.append(f"{head} [{reasons[key]}]")
            else:
                cells.append(head)
        rows.append((model_type, cells))
        print(f"{model_type:24s} " + "  ".join(f"{c:14s}" for c in cells), flush=True)
    counts = {layout: {} for layout in layouts}
    for _, cells in rows:
        for layout, cell in zip(layouts, cells, strict=True):
            kind = cell.split(" ")[0].split("(")[0]
            counts[layout][kind] = counts[layout].get(kind, 0) + 1
    print(f"\n{len(rows)} families in {time.time() - start:.0f} s")
    for layout in layouts:
        if layout != "per-rank":  # a share per family, not a verdict
            print(f"{layout}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts[layout].items())))
    if args.markdown:
        print("\n| model type | " + " | ".join(layouts) + " |\n|---|" + "---|" * len(layouts))
        for model_type, cells in rows:
            print(f"| {model_type} | " + " | ".join(cells) + " |")
    print("\nreasons:")
    for key, number in reasons.items():
        print(f"[{number}] {key}")


if __name__ == "__main__":
    main()
