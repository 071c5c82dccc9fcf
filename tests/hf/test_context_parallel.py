"""Context parallelism through ``parallelize``: HF causal LMs with ``context_parallel_size`` equal the dense model
(loss, every grad, the parameters after an AdamW step), padding falling unevenly over replicas and chunks, sliding
windows and Gemma-2's logit soft-capping, both attention implementations, composed with tp and dp; what it cannot do
is refused."""

from __future__ import annotations

import copy

import pytest
import torch

import meshpar
from meshpar._compat import DTensor
from meshpar._shards import in_parameter_layout, local_slice
from meshpar.testing import run_distributed, setup_parallel
from tests.hf._configs import adamw_for, batch, build

S = 16


def _slow(*values: object) -> object:
    """A parametrization left out of ``make test-fast`` (the full suite runs it)."""
    return pytest.param(*values, marks=pytest.mark.slow)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _dense(family: str, window: int | None) -> torch.nn.Module:
    model = build(family)
    if window is not None:  # a window shorter than the sequence, so that it cuts across chunks
        model.config.sliding_window = window
        for module in model.modules():
            if getattr(module, "sliding_window", None):
                module.sliding_window = window
    return model


def _mine(
    tensor: torch.Tensor, full: torch.Tensor, module: torch.nn.Module, name: str, param: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's ``tensor``, the dense ``full`` one to compare it with): local shards, or whole tensors for a
    parameter FSDP shards over dp x cp on top of tp (two shardings of one dim)."""
    if isinstance(tensor, DTensor) and len(tensor.placements) > 1:
        return tensor.full_tensor(), in_parameter_layout(full, module, name)
    return _local(tensor), local_slice(in_parameter_layout(full, module, name), param)


def context_parallel_case(
    family: str,
    cp: int,
    tp: int,
    implementation: str,
    window: int | None,
    zero1: str = "",
    fsdp: bool = False,
    sequence_parallel: bool = False,
    pp: int = 1,
) -> float:
    dims = setup_parallel(tp=tp, cp=cp, pp=pp)
    dense = _dense(family, window)
    config = {
        "tensor_parallel_size": tp,
        "context_parallel_size": cp,
        "context_parallel_implementation": implementation,
        "fsdp": fsdp,
        "sequence_parallel": sequence_parallel,
        "pipeline_parallel_size": pp,
        "num_microbatches": 2 if pp > 1 else None,
    }
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    data = batch(family, rows=4, seq=S)
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    data["attention_mask"][0, 11:] = 0  # right padding: one replica's row, across a chunk border
    data["labels"][0, 11:] = -100
    data["labels"][2, :5] = -100
    expected = dense(**data)
    expected.loss.backward()
    # Adam's first step divides by |grad| + eps: eps above the grads' fp32 noise (1e-8 on grads of 1e-5)
    adamw = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-4}
    torch.optim.AdamW(dense.parameters(), **adamw).step()
    share = 4 // dims.dp
    mine = {k: v[dims.dp_rank * share : (dims.dp_rank + 1) * share] for k, v in data.items()}
    optimizer = adamw_for(model, zero1, **adamw)  # "reduce_scatter": raw grads, so they are not compared
    loss = model.train_step(**mine, sync_dp_grads=zero1 != "reduce_scatter")
    torch.testing.assert_close(loss, expected.loss.detach(), atol=1e-5, rtol=1e-5)
    local = [(module, name, param) for module in model.local_modules() for name, param in module.named_parameters()]
    for module, name, param in local if zero1 != "reduce_scatter" else ():
        dense_grad = dense.get_parameter(name).grad
        if dense_grad is None:
            continue
        got, want = _mine(param.grad, dense_grad, module, name, param)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=f"grad of {name}")
    optimizer.step()
    for module, name, param in local:
        got, want = _mine(param, dense.get_parameter(name).detach(), module, name, param)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():
        evaluated = model.eval_loss(**mine)
        dense_out = dense.eval()(**data)
        logits = model.eval_logits(**mine)  # every position's, gathered over cp (the last stage's ranks)
    torch.testing.assert_close(evaluated, dense_out.loss, atol=1e-5, rtol=1e-5)
    if pp == 1 or dims.pp_rank == pp - 1:
        rows = slice(dims.dp_rank * share, (dims.dp_rank + 1) * share)
        want = (
            dense_out.logits[rows].chunk(tp, -1)[dims.tp_rank]
            if logits.shape[-1] != dense_out.logits.shape[-1]
            else dense_out.logits[rows]
        )
        real = mine["attention_mask"].bool()  # a padded query's logits are no model's business
        torch.testing.assert_close(logits[real], want[real], atol=1e-5, rtol=1e-4)
    else:
        assert logits is None
    return float(loss)


@pytest.mark.parametrize(
    "family,window,implementation",
    [("llama", None, "all_gather"), ("mistral", 6, "ring"), ("gemma2", 5, "ring"), ("bart_causal", None, "ring"),
     _slow("llama", None, "ring"),
     _slow("qwen3", None, "all_gather"), _slow("qwen3", None, "ring"), _slow("mistral", 6, "all_gather"),
     _slow("gemma2", 5, "all_gather")],
    ids=str,
)  # fmt: skip
def test_context_parallel_matches_dense(family: str, window: int | None, implementation: str) -> None:
    """cp2 x dp2 on 4 ranks: each replica's rows split over 2 cp ranks. BART's causal LM counts its learned
    positions from its input's length: each chunk gets its tokens' positions in the whole sequence."""
    run_distributed(context_parallel_case, 4, family, 2, 1, implementation, window)


@pytest.mark.parametrize(
    "family,cp,tp,implementation",
    [("gpt_oss", 2, 1, "ring"), _slow("gpt_oss", 2, 1, "all_gather"), _slow("gpt_oss", 2, 2, "ring"),
     _slow("granite_swa", 2, 1, "all_gather")],
    ids=str,
)  # fmt: skip
def test_attention_sinks_under_context_parallelism_match_dense(family: str, cp: int, tp: int, implementation: str):
    """GPT-OSS's attention sinks (one logit per head in every softmax, its value zero; sliding and full layers in
    turn) and Granite-SWA's: the ring starts each query's softmax from the sink, the all-gather scales each output by
    ``sigmoid(lse - sink)``; under tp each rank's sinks are its heads'. Loss, grads (the sinks' too), the AdamW step,
    eval loss and logits equal dense."""
    run_distributed(context_parallel_case, 4, family, cp, tp, implementation, None)


@pytest.mark.parametrize("cp,tp", [(2, 2), _slow(4, 1)])
def test_context_parallel_composes_with_tp(cp: int, tp: int) -> None:
    run_distributed(context_parallel_case, 4, "qwen3", cp, tp, "ring", None)


@pytest.mark.parametrize(
    "family,window,implementation",
    [("qwen3", None, "all_gather"), _slow("mistral", 6, "ring"), _slow("bart_causal", None, "all_gather")],
)  # fmt: skip
def test_context_parallel_composes_with_pipelines(family: str, window: int | None, implementation: str) -> None:
    """cp2 x pp2 (two microbatches): each microbatch's rows keep their chunks' positions, padding and document
    masks on every stage; loss, every grad, the AdamW step and eval equal dense."""
    run_distributed(context_parallel_case, 4, family, 2, 1, implementation, window, "", False, False, 2)


@pytest.mark.parametrize(
    "family,window,implementation",
    [("qwen3", None, "all_gather"), _slow("gemma2", 5, "ring")],
)
def test_context_parallel_composes_with_sequence_parallelism(family: str, window: int | None, implementation: str):
    """cp2 x tp2 with sequence parallelism (Megatron-Core's CP + SP): each cp rank's chunks split again over tp in
    the norms and residuals, all-gathered for attention: loss, grads, the AdamW step and eval equal dense."""
    run_distributed(context_parallel_case, 4, family, 2, 2, implementation, window, "", False, True)


@pytest.mark.parametrize(
    "tp,implementation,sp,pp",
    [(2, "ring", False, 1), _slow(1, "all_gather", False, 2), _slow(2, "all_gather", True, 1)],
)
def test_latent_attention_under_context_parallelism_composes_with_tp_pp_and_sp(
    tp: int, implementation: str, sp: bool, pp: int
) -> None:
    """DeepSeek-V3's latent attention (values narrower than keys, a shared rope key) at cp2 x tp2 with the ring,
    cp2 x pp2 and cp2 x tp2 with sequence parallelism: loss, every grad, the AdamW step and eval equal dense."""
    run_distributed(context_parallel_case, 4, "deepseek_v3", 2, tp, implementation, None, "", False, sp, pp)


def refusal_case(family: str, config: dict, seq: int = S, forward_raises: bool = False) -> str:
    import importlib

    module = importlib.import_module("meshpar.hf.parallelize")  # the module (meshpar.hf.parallelize: a function)
    verify = module.verify_context_parallel
    if forward_raises:  # a family whose forward cannot run with its sequence split (the probe's own verdict)
        module.verify_context_parallel = lambda *args, **kwargs: "its forward raises RuntimeError: no split here"
    try:
        model = meshpar.parallelize(build(family), config)
        data = batch(family, rows=4, seq=seq)
        model.train_step(**data)
    except (ValueError, RuntimeError) as error:
        return str(error)
    finally:  # the worker processes serve later tests
        module.verify_context_parallel = verify
    return "accepted"


@pytest.mark.parametrize(
    "family,config,seq,says",
    [
        ("qwen3", {"context_parallel_size": 2}, 18, "pad the sequences to a multiple of 4"),
        ("t5", {"context_parallel_size": 2}, S, "T5ForConditionalGeneration is a seq2seq lm model"),
        ("inkling2_text", {"context_parallel_size": 2}, S, "does not compute ['sinks'"),  # per-token sinks
        # Llama-4's chunks of 8 tokens: a 16-token row crosses one (the probe of 4 cp tokens once did not, and the
        # chunked mask was silently taken for a causal one)
        ("llama4_text", {"context_parallel_size": 2}, S, "chunked local attention (attention_chunk_size)"),
    ],
)
def test_what_context_parallelism_cannot_do_is_refused(family: str, config: dict, seq: int, says: str) -> None:
    messages = run_distributed(refusal_case, 4, family, config, seq)
    assert all(says in m for m in messages), messages


def test_a_forward_that_raises_under_the_split_is_refused_as_such() -> None:
    """The refusal names what happened: a forward that raised is not said to compute something else."""
    messages = run_distributed(refusal_case, 4, "qwen3", {"context_parallel_size": 2}, S, True)
    for message in messages:
        assert "its forward raises RuntimeError: no split here" in message and "sinks" not in message, message
        assert "does not run with its sequence split over cp ranks; use context_parallel_size 1" in message


@pytest.mark.parametrize(
    "family,window,cp,length",
    [("llama", None, 2, 8), ("mistral", 6, 2, 16), ("gemma2", 5, 4, 16), ("llama4_text", None, 2, 20),
     ("mistral", 4096, 2, 64), ("gpt2", None, 2, 8)],
)  # fmt: skip
def test_the_probe_reaches_past_every_window(family: str, window: int | None, cp: int, length: int) -> None:
    """The probe that proves a family under cp runs past twice its longest window or chunk (capped at 128 tokens and
    the model's positions: 64 in the tiny Mistral), in 2 cp equal chunks, so a mask cut at a window is part of what
    it proves."""
    from meshpar.hf.context_parallel import probe_length

    assert probe_length(_dense(family, window), cp) == length
    # under sequence parallelism each cp rank's part splits over tp too: a multiple of 2 cp tp, past the windows
    for tp in (2, 8):
        longer = probe_length(_dense(family, window), cp, tp)
        assert longer % (2 * cp * tp) == 0 and longer >= length, (tp, longer)


def merged_case(directory: str) -> float | None:
    """A cp2 model's merged checkpoint is a plain HF directory: transformers loads it with its own attention and
    gives the parallel model's evaluation loss."""
    setup_parallel(cp=2)
    model = meshpar.parallelize(build("llama"), {"context_parallel_size": 2})
    data = batch("llama", rows=2, seq=S)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01)
    loss = model.eval_loss(**data)
    model.save_parallelized(directory, merge_checkpoints=True)
    return float(loss) if torch.distributed.get_rank() == 0 else None


def test_a_merged_checkpoint_loads_without_meshpar(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    loss = run_distributed(merged_case, 2, str(tmp_path / "merged"))[0]
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert plain.config._attn_implementation != "meshpar_context_parallel"
    with torch.no_grad():
        want = plain(**batch("llama", rows=2, seq=S)).loss
    assert abs(float(want) - loss) < 1e-5 * abs(loss), (float(want), loss)


def packed_case(implementation: str) -> None:
    """Documents packed into each row (``document_ids``, positions restarting at every document): each attends
    within its own document, across chunk borders, as the dense model given the block-diagonal causal mask does."""
    setup_parallel(cp=2)
    dense = build("llama")
    model = meshpar.parallelize(copy.deepcopy(dense), {"context_parallel_size": 2,
                                                       "context_parallel_implementation": implementation})  # fmt: skip
    data = batch("llama", rows=2, seq=S)
    lengths = [[5, 7, 4], [3, 13]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    documents = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])
    same = torch.tril(torch.ones(S, S, dtype=torch.bool))[None, None] & (
        documents[:, None, :, None] == documents[:, None, None, :]
    )
    mask = torch.zeros(2, 1, S, S).masked_fill(~same, float("-inf"))
    expected = dense(input_ids=data["input_ids"], labels=data["labels"], position_ids=positions, attention_mask=mask)
    expected.loss.backward()
    loss = model.train_step(**data, position_ids=positions, document_ids=documents)
    torch.testing.assert_close(loss, expected.loss.detach(), atol=1e-5, rtol=1e-5)
    for name, param in model.module.named_parameters():
        torch.testing.assert_close(param.grad, dense.get_parameter(name).grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("implementation", [_slow("all_gather"), "ring"])
def test_packed_documents_attend_within_themselves(implementation: str) -> None:
    run_distributed(packed_case, 2, implementation)


def test_an_unknown_context_parallel_implementation_is_refused_by_the_config() -> None:
    from meshpar.hf.config import load_config

    with pytest.raises(ValueError, match=r"'all_gather' or 'ring'"):
        load_config({"context_parallel_size": 2, "context_parallel_implementation": "ulysses"})


def test_a_mask_the_model_builds_itself_is_refused() -> None:
    """transformers' mask functions hand the context-parallel attention no mask; a model that builds one of its own
    (Doge's dynamic masks) would have it ignored, so the attention refuses (and parallelize's probe with it)."""
    from meshpar.hf.context_parallel import ContextParallelInputs, _attention

    q = k = v = torch.zeros(1, 2, 4, 8)
    inputs = ContextParallelInputs(mesh=None, implementation="all_gather")
    with pytest.raises(ValueError, match="a mask the model builds itself"):
        _attention(torch.nn.Module(), q, k, v, torch.zeros(1, 1, 4, 8), meshpar_context=inputs)


def generation_case(family: str, cp: int, tp: int, pp: int = 1) -> None:
    """After a training step at cp (the context-parallel attention in use), greedy decoding of left-padded prompts:
    every cp rank decodes the whole prompt with the model's own attention and gets the dense model's tokens; the next
    training step runs context-parallel again."""
    dims = setup_parallel(tp=tp, cp=cp, pp=pp)
    dense = build(family)
    config = {"tensor_parallel_size": tp, "context_parallel_size": cp, "pipeline_parallel_size": pp}
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    data = batch(family, rows=2 * dims.dp, seq=S)
    share = 2
    mine = {k: v[dims.dp_rank * share : (dims.dp_rank + 1) * share] for k, v in data.items()}
    first = model.train_step(**mine)
    prompt = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(dims.dp_rank))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    torch.testing.assert_close(model.generate(prompt, **kwargs), dense.generate(prompt, **kwargs), rtol=0, atol=0)
    torch.testing.assert_close(model.train_step(**mine), first, atol=1e-6, rtol=1e-6)  # same weights: same loss


@pytest.mark.parametrize(
    "family,cp,tp,pp",
    [("qwen3", 2, 1, 1), ("bart_causal", 2, 1, 1), _slow("llama", 2, 2, 1), _slow("qwen3", 2, 1, 2)],
)
def test_generation_under_context_parallelism_matches_dense(family: str, cp: int, tp: int, pp: int) -> None:
    """BART's causal LM too: its positions are the whole sequence's under cp only, the prompt's when decoding."""
    run_distributed(generation_case, 4, family, cp, tp, pp)


@pytest.mark.parametrize("cp,zero1", [(2, "zero1"), (2, "reduce_scatter"), _slow(4, "reduce_scatter")])
def test_zero1_owns_state_over_dp_and_cp(cp: int, zero1: str) -> None:
    """ZeRO-1 under context parallelism: every weight is replicated over dp x cp, so owners spread over both and the
    optimizer's reduce-scatter sums the cp ranks' shares of each sequence (cp4: dp = 1, cp alone); equal to dense."""
    run_distributed(context_parallel_case, 4, "qwen3", cp, 1, "all_gather", None, zero1)


def unequal_replicas_case() -> None:
    """Every rank builds its model from its own seed (the first rank's values are taken, over dp and cp alike): the
    step equals the first rank's dense model. Before, the cp ranks kept their own weights, and the context-parallel
    probe refused the model blaming its attention."""
    dims = setup_parallel(cp=2)
    own = build("qwen3")  # build() seeds 0 itself: perturb after, from each rank's own seed
    torch.manual_seed(100 + torch.distributed.get_rank())
    with torch.no_grad():
        for param in own.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    first = copy.deepcopy(own)
    for param in first.parameters():
        torch.distributed.broadcast(param.data, src=0)
    model = meshpar.parallelize(own, {"context_parallel_size": 2})
    data = batch("qwen3", rows=2 * dims.dp, seq=S)
    mine = {k: v[2 * dims.dp_rank : 2 * dims.dp_rank + 2] for k, v in data.items()}
    expected = first(**data)
    torch.testing.assert_close(model.train_step(**mine), expected.loss.detach(), atol=1e-5, rtol=1e-5)


def test_cp_replicas_take_the_first_ranks_weights() -> None:
    run_distributed(unequal_replicas_case, 4)


@pytest.mark.parametrize("cp,tp", [(2, 1), _slow(4, 1), _slow(2, 2)])
def test_fsdp_shards_over_dp_and_cp(cp: int, tp: int) -> None:
    """FSDP2 under context parallelism (torchtitan's dp_shard_cp): the weights sharded over dp x cp, whose ranks all
    hold every weight and a share of each grad, the reduce-scatter's sum divided by dp (cp4: dp = 1, cp alone; with
    tp inside: 2-D DTensors); loss, every grad and the step equal dense."""
    run_distributed(context_parallel_case, 4, "qwen3", cp, tp, "all_gather", None, "", True)


def fsdp_cp_checkpoint_case(directory: str, save_cp: int) -> None:
    """A checkpoint of a model FSDP shards over dp x cp loads into a model FSDP shards over dp alone, and back (DCP
    reshards the shards): a step of the loaded model equals the saved weights' dense loss."""
    load_cp = 1 if save_cp > 1 else 2
    setup_parallel(cp=save_cp)
    model = meshpar.parallelize(build("qwen3"), {"fsdp": True, "context_parallel_size": save_cp})
    with torch.no_grad():
        for param in model.parameters():
            _local(param).add_(0.01)
    model.save_parallelized(directory)
    dims = setup_parallel(cp=load_cp)
    fresh = meshpar.parallelize(build("qwen3"), {"fsdp": True, "context_parallel_size": load_cp})
    fresh.from_parallelized(directory)
    reference = build("qwen3")
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.01)
    data = batch("qwen3", rows=2 * dims.dp, seq=S)
    mine = {k: v[2 * dims.dp_rank : 2 * dims.dp_rank + 2] for k, v in data.items()}
    loss = fresh.train_step(**mine)
    torch.testing.assert_close(loss.detach(), reference(**data).loss.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("save_cp", [2, _slow(1)])
def test_fsdp_over_dp_and_cp_checkpoints_reshard(tmp_path, save_cp: int) -> None:
    run_distributed(fsdp_cp_checkpoint_case, 4, str(tmp_path / "ckpt"), save_cp)
