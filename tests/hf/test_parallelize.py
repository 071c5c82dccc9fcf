"""meshpar.parallelize on GPT-2, Llama and BERT vs the original model: logits, loss, one optimizer step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import meshpar
from meshpar._compat import DTensor
from meshpar._shards import local_slice
from meshpar.hf import load_config
from meshpar.optim import DistributedOptimizer
from meshpar.testing import SavedForBackward, run_distributed, setup_parallel
from tests.hf._configs import batch, build


def _expected_param(dense: torch.nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
    full = dense.get_parameter(name).detach()
    return local_slice(full.reshape(param.shape), param) if isinstance(param, DTensor) else full


def equivalence_case(
    family: str,
    tp: int,
    pp: int,
    sp: bool = False,
    compile: bool = False,
    checkpointing: bool = False,
    schedule: str = "1f1b",
    microbatches: int = 2,
    fused_kernels: bool = False,
) -> None:
    setup_parallel(tp=tp, pp=pp)
    dense = build(family)
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "num_microbatches": microbatches}
    config |= {"sequence_parallel": sp, "compile": compile, "activation_checkpointing": checkpointing}
    config |= {"pipeline_schedule": schedule, "fused_kernels": fused_kernels}
    torch._dynamo.utils.counters.clear()
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    data = batch(family)
    expected = dense(**data)
    expected.loss.backward()
    torch.optim.SGD(dense.parameters(), lr=0.5).step()
    optimizer = DistributedOptimizer(model, torch.optim.SGD, lr=0.5)
    if pp == 1:
        out = model(**data)
        torch.testing.assert_close(out.loss, expected.loss.detach(), atol=1e-5, rtol=1e-5)
        logits = expected.logits.detach()
        if family != "bert_cls" and tp > 1:
            logits = logits.chunk(tp, -1)[model.dims.tp_rank]
        torch.testing.assert_close(out.logits, logits, atol=1e-5, rtol=1e-5)
        out.loss.backward()
    else:
        logits = model.eval_logits(**data)
        if logits is not None:  # the ranks holding the last stage
            want = expected.logits.detach()
            want = want.chunk(tp, -1)[model.dims.tp_rank] if tp > 1 else want
            torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
        loss = model.train_step(**data)
        torch.testing.assert_close(loss, expected.loss.detach(), atol=1e-5, rtol=1e-5)
    optimizer.step()
    assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0) == compile  # the blocks really ran compiled
    fused = [m for module in model.local_modules() for m in module.modules() if "Fused" in type(m).__name__]
    assert bool(fused) == fused_kernels
    for module in model.local_modules():
        for name, param in module.named_parameters():
            got = param.to_local() if isinstance(param, DTensor) else param
            torch.testing.assert_close(got, _expected_param(dense, name, param), atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "bert_cls"])
def test_tensor_parallel_matches_dense(family: str) -> None:
    run_distributed(equivalence_case, 2, family, 2, 1)


def test_compiled_tensor_parallel_layers_match_dense() -> None:
    """``compile: true`` compiles each transformer block (meshpar's traceable TP nodes inside HF's GPT-2 block)."""
    run_distributed(equivalence_case, 2, "gpt2", 2, 1, False, True, timeout=600)


def test_compiled_and_checkpointed_layers_match_dense() -> None:
    """``compile`` with ``activation_checkpointing``: the blocks run compiled (dynamo's counters show graphs; the
    checkpoint wraps each compiled block) and equal dense. Llama builds a KV cache unless told not to, which the
    recompute would extend a second time."""
    run_distributed(equivalence_case, 2, "llama", 2, 1, False, True, True, timeout=600)


@pytest.mark.slow  # torch.compile in fresh workers
def test_compiled_sequence_parallel_matches_dense() -> None:
    """``compile`` with sequence parallelism: the norms run their own forward in DTensor on sequence shards, which the
    compiler traces through (their grads still summed over tp as each is accumulated), and equal dense."""
    run_distributed(equivalence_case, 2, "llama", 2, 1, True, True, timeout=600)


def fsdp_sequence_parallel_case() -> tuple[float, float]:
    """tp=2 x dp=2 with FSDP2 and sequence parallelism: the norms' replicated parameters are FSDP's, whose grads FSDP
    reduces into their placement itself (the partial grads of the sequence shards summed over tp)."""
    dims = setup_parallel(tp=2)
    dense = build("llama")
    config = {"tensor_parallel_size": 2, "fsdp": True, "sequence_parallel": True}
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    data = batch("llama", rows=4)
    expected = dense(**data)
    expected.loss.backward()
    torch.optim.SGD(dense.parameters(), lr=0.5).step()
    optimizer = DistributedOptimizer(model, torch.optim.SGD, lr=0.5)
    mine = {k: v.chunk(dims.dp)[dims.dp_rank] for k, v in data.items()}
    loss = model.train_step(**mine)
    optimizer.step()
    worst = max(
        (p.full_tensor() - dense.get_parameter(n).detach()).abs().max().item()
        for n, p in model.module.named_parameters()
    )
    return abs(loss.item() - expected.loss.item()), worst


@pytest.mark.slow  # four workers
def test_fsdp_with_sequence_parallelism_matches_dense() -> None:
    for loss_error, param_error in run_distributed(fsdp_sequence_parallel_case, 4, timeout=600):
        assert loss_error < 1e-5 and param_error < 1e-5, (loss_error, param_error)


def kv_cache_case() -> tuple[bool, bool, bool]:
    setup_parallel(tp=2)
    model = meshpar.parallelize(build("llama"), {"tensor_parallel_size": 2})
    data = batch("llama")
    with torch.no_grad():
        generating = model(**data).past_key_values is not None
    return model(**data).past_key_values is None, model(**data, use_cache=True).past_key_values is not None, generating


def test_training_forward_builds_no_kv_cache_unless_asked() -> None:
    assert run_distributed(kv_cache_case, 2) == [(True, True, True)] * 2


def deep_compile_case(checkpointing: bool) -> int:
    setup_parallel(tp=2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    config = {"tensor_parallel_size": 2, "compile": True, "activation_checkpointing": checkpointing}
    model = meshpar.parallelize(build("gpt2", layers=10), config)
    model(**batch("gpt2")).loss.backward()
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_blocks_share_one_graph_however_deep(checkpointing: bool) -> None:
    """Ten compiled blocks, one graph: a training forward builds no KV cache, whose per-layer slot would make each
    block recompile until dynamo's recompile limit (8) and leave the deeper blocks eager."""
    assert run_distributed(deep_compile_case, 2, checkpointing, timeout=600) == [1, 1]


def _saved_bytes_and_grads(dense: torch.nn.Module, config: dict) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd saves for backward outside checkpointed regions in one forward, and the grads after it."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    torch.manual_seed(3)  # the same dropout masks in every variant
    with SavedForBackward() as saved:
        loss = model(**batch("gpt2")).loss
    loss.backward()
    grads = {n: (p.grad.to_local() if isinstance(p, DTensor) else p.grad) for n, p in model.module.named_parameters()}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    return saved.bytes, grads


def compiled_checkpoint_dropout_case() -> tuple[float, float]:
    setup_parallel(tp=2)
    dense = build("gpt2", layers=4).train()
    for module in dense.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    config = {"tensor_parallel_size": 2, "compile": True}
    plain_bytes, plain = _saved_bytes_and_grads(dense, config)
    checkpointed_bytes, recomputed = _saved_bytes_and_grads(dense, config | {"activation_checkpointing": True})
    worst = max(float((plain[n] - recomputed[n]).abs().max()) for n in plain)
    return checkpointed_bytes / plain_bytes, worst


def test_compile_with_checkpointing_replays_dropout_and_drops_activations() -> None:
    """Dropout in compiled, checkpointed blocks: the recompute draws the masks of the forward (grads bit-equal to
    the compiled run without checkpointing), and the blocks' activations are really dropped."""
    for ratio, worst in run_distributed(compiled_checkpoint_dropout_case, 2, timeout=600):
        assert worst == 0.0
        assert ratio < 0.3, ratio  # 0.13 at 4 layers: only block inputs, embedding and head stay saved


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize(("world", "tp", "pp"), [(2, 1, 2), (4, 2, 2)])
def test_pipeline_and_tp_x_pp_match_dense(family: str, world: int, tp: int, pp: int) -> None:
    run_distributed(equivalence_case, world, family, tp, pp)


@pytest.mark.parametrize(
    ("family", "world", "tp", "pp", "sp", "checkpointing"),
    [("llama", 2, 1, 2, False, False), ("llama", 4, 2, 2, False, True), ("gpt2", 4, 2, 2, True, False)],
)
def test_zero_bubble_pipeline_matches_dense(
    family: str, world: int, tp: int, pp: int, sp: bool, checkpointing: bool
) -> None:
    """ZB-H1 (input grads first, weight grads later) with tp, sequence parallelism and activation checkpointing:
    logits, loss and the parameters after a step equal the dense model's."""
    run_distributed(equivalence_case, world, family, tp, pp, sp, False, checkpointing, "zero_bubble", 4)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize(("world", "tp", "pp"), [(2, 2, 1), (4, 2, 2)])
def test_sequence_parallel_matches_dense(family: str, world: int, tp: int, pp: int) -> None:
    run_distributed(equivalence_case, world, family, tp, pp, True)


def test_sequence_parallel_for_bert_classification() -> None:
    run_distributed(equivalence_case, 2, "bert_cls", 2, 1, True)


def data_parallel_case(
    tp: int, pp: int, vpp: int, overlap: bool | None, accumulate: bool, fsdp: bool = False, schedule: str = "1f1b"
) -> int:
    dims = setup_parallel(tp=tp, pp=pp)  # world 4: dp = 4 / (tp * pp) = 2
    dense = build("gpt2", layers=2 * pp * vpp)
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "virtual_pipeline_size": vpp}
    config |= {"num_microbatches": 2 * pp, "overlap_grad_reduce": overlap, "fsdp": fsdp, "pipeline_schedule": schedule}
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    data = batch("gpt2", rows=8)
    if not accumulate:  # dp rank 0 (and its first microbatch) scores fewer tokens: train_step weighs every token alike
        data["labels"][0, :9] = -100
    dense(**data).loss.backward()
    torch.optim.SGD(dense.parameters(), lr=0.5).step()
    optimizer = DistributedOptimizer(model, torch.optim.SGD, lr=0.5)
    mine = {k: v[dims.dp_rank * 4 : (dims.dp_rank + 1) * 4] for k, v in data.items()}
    in_flight = []  # per sync: were all its buckets started by backward itself, before finish()?
    for sync in model.grad_syncs:
        finish = sync.finish
        sync.finish = lambda s=sync, f=finish: (in_flight.append(s.launched == s.num_buckets), f())[-1]
    if accumulate:  # two microbatches of 2 rows; the first only accumulates
        with model.no_sync():
            (model(**{k: v[:2] for k, v in mine.items()}).loss / 2).backward()
        (model(**{k: v[2:] for k, v in mine.items()}).loss / 2).backward()
        model.allreduce_gradients()
    else:
        model.train_step(**mine)
    optimizer.step()
    for module in model.local_modules():
        for name, param in module.named_parameters():
            if fsdp:  # (dp, tp)-sharded: compare whole tensors
                assert isinstance(param, DTensor) and "dp" in param.device_mesh.mesh_dim_names, name
                want = dense.get_parameter(name).detach().reshape(param.shape)
                torch.testing.assert_close(param.full_tensor(), want, atol=1e-5, rtol=1e-4, msg=name)
                continue
            got = param.to_local() if isinstance(param, DTensor) else param
            torch.testing.assert_close(got, _expected_param(dense, name, param), atol=1e-5, rtol=1e-4, msg=name)
    assert all(in_flight) and len(in_flight) == len(model.grad_syncs), in_flight
    return len(model.grad_syncs)


@pytest.mark.parametrize("overlap", [True, False, None])
@pytest.mark.parametrize("accumulate", [False, True])
def test_tp_x_dp_step_matches_dense(overlap: bool | None, accumulate: bool) -> None:
    """dp=2 x tp=2: grads averaged over dp during backward or after it (the default on CPU), with gradient
    accumulation."""
    assert run_distributed(data_parallel_case, 4, 2, 1, 1, overlap, accumulate) == [int(bool(overlap))] * 4


@pytest.mark.parametrize(("tp", "pp", "accumulate"), [(2, 1, False), (2, 1, True), (1, 2, False)])
def test_fsdp_over_dp_matches_dense(tp: int, pp: int, accumulate: bool) -> None:
    """``fsdp: true``: FSDP2 shards each layer (and the root) over dp on top of tp, or inside each pipeline stage
    (GPT-2's tied embedding summed over the first and last stage's dp shards)."""
    assert run_distributed(data_parallel_case, 4, tp, pp, 1, None, accumulate, True) == [0] * 4


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("vpp", [1, 2])
def test_pp_x_dp_step_matches_dense(overlap: bool, vpp: int) -> None:
    """dp=2 x pp=2 with GPT-2's tied embedding: each chunk's dp all-reduces start in its last backward."""
    assert run_distributed(data_parallel_case, 4, 1, 2, vpp, overlap, False) == [vpp * overlap] * 4


def test_zero_bubble_x_dp_starts_the_grad_all_reduces_in_the_last_weight_pass() -> None:
    """dp=2 x pp=2, ZB-H1, overlapped grad sync: the buckets fill from the weight passes (no grads in input passes),
    all launched before finish(); GPT-2's tied embedding summed over the first and last stage; equal to dense."""
    assert run_distributed(data_parallel_case, 4, 1, 2, 1, True, False, False, "zero_bubble") == [1] * 4


def clipped_step_case(tp: int, pp: int, reduce_scatter: bool) -> None:
    """A clipped step on dp=2: the global grad norm counts GPT-2's tied embedding once although the first and last
    pipeline stage each hold a copy, with grads all-reduced by ``train_step`` or reduce-scattered by a ZeRO-1
    optimizer (``sync_dp_grads=False``)."""
    dims = setup_parallel(tp=tp, pp=pp)  # world 4: dp = 4 / (tp * pp) = 2
    dense = build("gpt2", layers=2 * pp)
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "num_microbatches": 2 * pp}
    model = meshpar.parallelize(copy.deepcopy(dense), config | {"overlap_grad_reduce": False})
    data = batch("gpt2", rows=8)
    dense(**data).loss.backward()
    dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1)
    torch.optim.SGD(dense.parameters(), lr=0.5).step()
    optimizer = DistributedOptimizer(model, torch.optim.SGD, zero1=True, reduce_scatter_grads=reduce_scatter, lr=0.5)
    model.train_step(
        **{k: v[dims.dp_rank * 4 : (dims.dp_rank + 1) * 4] for k, v in data.items()}, sync_dp_grads=not reduce_scatter
    )
    norm = optimizer.clip_grad_norm(0.1)
    torch.testing.assert_close(norm, dense_norm, atol=1e-5, rtol=1e-5)
    optimizer.step()
    for module in model.local_modules():
        for name, param in module.named_parameters():
            got = param.to_local() if isinstance(param, DTensor) else param
            torch.testing.assert_close(got, _expected_param(dense, name, param), atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("tp", "pp", "reduce_scatter"), [(1, 2, False), (1, 2, True), (2, 1, True)])
def test_clipped_zero1_step_matches_dense(tp: int, pp: int, reduce_scatter: bool) -> None:
    run_distributed(clipped_step_case, 4, tp, pp, reduce_scatter)


def overlap_with_reduce_scatter_case() -> str:
    setup_parallel(tp=1)
    model = meshpar.parallelize(build("gpt2"), {"overlap_grad_reduce": True})
    try:
        model.train_step(**batch("gpt2", rows=2), sync_dp_grads=False)
    except ValueError as error:
        return str(error)
    return ""


def test_sync_dp_grads_false_refuses_overlapped_all_reduce() -> None:
    assert all("already all-reduces" in m for m in run_distributed(overlap_with_reduce_scatter_case, 2))


def masked_pipeline_case(family: str, tp: int = 1, sp: bool = False) -> None:
    """Padded batches through the pipeline: every stage must mask what the HF model masks."""
    setup_parallel(tp=tp, pp=2)
    dense = build(family)
    data = batch(family)
    mask = torch.ones_like(data["input_ids"])
    if family == "bert":
        mask[0, -5:] = 0  # right padding: bidirectional attention must not see it
    else:
        mask[1, :5] = 0  # left padding: causal attention alone would still see it
    data["attention_mask"] = mask  # only the first microbatch is padded: its tokens must not weigh more
    data["labels"] = data["labels"].masked_fill(mask == 0, -100)
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": 2, "num_microbatches": 2, "sequence_parallel": sp}
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    expected = dense(**data)
    expected.loss.backward()
    torch.optim.SGD(dense.parameters(), lr=0.5).step()
    logits = model.eval_logits(**data)
    if logits is not None:
        want = expected.logits.detach()
        want = want.chunk(tp, -1)[model.dims.tp_rank] if tp > 1 else want
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    optimizer = DistributedOptimizer(model, torch.optim.SGD, lr=0.5)
    torch.testing.assert_close(model.train_step(**data), expected.loss.detach(), atol=1e-5, rtol=1e-5)
    optimizer.step()
    for module in model.local_modules():
        for name, param in module.named_parameters():
            got = param.to_local() if isinstance(param, DTensor) else param
            torch.testing.assert_close(got, _expected_param(dense, name, param), atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_pipeline_applies_the_attention_mask_on_every_stage(family: str) -> None:
    run_distributed(masked_pipeline_case, 2, family)
    run_distributed(masked_pipeline_case, 4, family, 2, True)  # tp x pp with sequence-sharded stage inputs


def _replicas_agree(model) -> None:
    """Every rank holding the same piece of a parameter (dp replicas, tp-replicated tensors, both copies of a tied
    embedding) holds the same values."""
    ties = model.tied_parameters
    mine = {}
    for module in model.local_modules():
        for name, param in module.named_parameters():
            sharded = isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)
            key = (ties.get(name, name), model.dims.tp_rank if sharded else None)
            mine[key] = (param.to_local() if isinstance(param, DTensor) else param).detach().clone()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for theirs in everyone:
        for key, value in theirs.items():
            if key in mine:
                torch.testing.assert_close(value, mine[key], atol=0, rtol=0, msg=str(key))


def meta_case(directory: str, family: str, tp: int, pp: int) -> None:
    """A model built on "meta" is allocated shard by shard, initialised consistently, and loads checkpoints."""
    setup_parallel(tp=tp, pp=pp)
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "num_microbatches": pp}
    data = batch(family)
    saved = meshpar.parallelize(build(family), config)
    with torch.no_grad():
        for p in saved.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).add_(0.01)
    saved.save_parallelized(directory)
    want = saved.eval_loss(**data)
    with torch.device("meta"):
        skeleton = build(family)
    torch.manual_seed(dist.get_rank())  # ranks seeded apart (as for data order): the init must still agree
    model = meshpar.parallelize(skeleton, config)
    for module in model.local_modules():
        assert not any(t.is_meta for t in (*module.parameters(), *module.buffers()))
    _replicas_agree(model)
    assert torch.isfinite(model.eval_loss(**data))
    model.from_parallelized(directory)
    torch.testing.assert_close(model.eval_loss(**data), want)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize(("world", "tp", "pp"), [(2, 2, 1), (2, 1, 2), (4, 2, 1)])
def test_meta_built_model_is_materialised_per_rank(tmp_path, family: str, world: int, tp: int, pp: int) -> None:
    run_distributed(meta_case, world, str(tmp_path / "ckpt"), family, tp, pp)


def generation_case() -> bool:
    setup_parallel(tp=2)
    dense = build("gpt2")
    model = meshpar.parallelize(copy.deepcopy(dense), {"tensor_parallel_size": 2})
    prompt = batch("gpt2", rows=2, seq=5)["input_ids"]
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    return torch.equal(model.generate(prompt, **kwargs), dense.generate(prompt, **kwargs))


def test_tp_greedy_generation_matches_dense() -> None:
    assert run_distributed(generation_case, 2) == [True, True]


def roundtrip_case(directory: str, merged: bool) -> None:
    setup_parallel(tp=2)
    dense = build("gpt2")
    model = meshpar.parallelize(copy.deepcopy(dense), {"tensor_parallel_size": 2})
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).add_(0.01)  # make it differ from the seed init
    model.save_parallelized(directory, merge_checkpoints=merged)
    fresh = meshpar.parallelize(build("gpt2"), {"tensor_parallel_size": 2}).from_parallelized(directory)
    data = batch("gpt2")
    torch.testing.assert_close(fresh(**data).loss, model(**data).loss)


def test_save_and_load_parallelized_round_trip(tmp_path) -> None:
    run_distributed(roundtrip_case, 2, str(tmp_path / "dcp"), False)


def fsdp_roundtrip_case(directory: str, save_fsdp: bool, merged: bool) -> None:
    setup_parallel(tp=2)  # world 4: dp=2
    config = {"tensor_parallel_size": 2}
    model = meshpar.parallelize(build("gpt2"), {**config, "fsdp": save_fsdp})
    with torch.no_grad():
        for p in model.parameters():
            p._local_tensor.add_(0.01) if isinstance(p, DTensor) else p.add_(0.01)
    model.save_parallelized(directory, merge_checkpoints=merged)
    fresh = meshpar.parallelize(build("gpt2"), {**config, "fsdp": not save_fsdp}).from_parallelized(directory)
    data = batch("gpt2")
    torch.testing.assert_close(fresh(**data).loss, model(**data).loss)


@pytest.mark.parametrize(("save_fsdp", "merged"), [(True, False), (False, False), (True, True)])
def test_fsdp_checkpoints_load_into_plain_dp_and_back(tmp_path, save_fsdp: bool, merged: bool) -> None:
    run_distributed(fsdp_roundtrip_case, 4, str(tmp_path / "ckpt"), save_fsdp, merged)


def test_merged_checkpoint_loads_with_from_pretrained(tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    run_distributed(roundtrip_case, 2, str(tmp_path / "merged"), True)
    plain = GPT2LMHeadModel.from_pretrained(tmp_path / "merged").eval()
    reference = build("gpt2")
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01)
    data = batch("gpt2")
    torch.testing.assert_close(plain(**data).loss, reference(**data).loss, atol=1e-5, rtol=1e-5)


def summary_case() -> str:
    setup_parallel(tp=2)
    return meshpar.parallelize(build("llama"), {"tensor_parallel_size": 2}).plan_summary()


def test_plan_summary_names_styles_placements_and_params_per_rank() -> None:
    text = run_distributed(summary_case, 2)[0]
    assert "model.layers.0.self_attn.q_proj: ColumnParallel [weight=('Shard(dim=0)',)]" in text
    assert "model.layers.0.self_attn.o_proj: RowParallel [weight=('Shard(dim=1)',)]" in text
    assert "parameters per rank:" in text


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"tensor_parallel_size": 2, "pipline_parallel_size": 2}, r"unknown config keys \['pipline_parallel_size'\]"),
        ({"tensor_parallel_size": 0}, "'tensor_parallel_size' must be a positive int"),
        ({"pipeline_parallel_size": 2, "num_microbatches": 1}, "'num_microbatches' \\(1\\) must be >= 'pipeline_par"),
        ({"virtual_pipeline_size": 2}, "needs 'pipeline_parallel_size' > 1"),
        ({"model_parallelism": {"enable": True, "pipeline_size": 2}}, r"unknown keys \['pipeline_size'\]"),
        ({"compile": "yes"}, "'compile' must be true or false"),
        ({"overlap_grad_reduce": 1}, "'overlap_grad_reduce' must be true, false or null"),
        ({"fsdp": True, "overlap_grad_reduce": True}, "'fsdp' and 'overlap_grad_reduce' exclude each other"),
        ({"pipeline_schedule": "zb"}, "unknown pipeline schedule 'zb'"),
        (
            {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "pipeline_schedule": "zero_bubble"},
            "runs one chunk per rank",
        ),
        (
            {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "pipeline_schedule": "gpipe"},
            "the gpipe schedule runs one chunk per rank",
        ),
        ({"pipeline_schedule": "zero_bubble", "fsdp": True}, "'zero_bubble' and 'fsdp' exclude each other"),
    ],
)
def test_bad_configs_name_the_key_and_the_rule(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(config)


def test_oslo_config_and_json_file(tmp_path) -> None:
    config = load_config({"model_parallelism": {"enable": True, "pipeline_parallel_size": 2}, "num_microbatches": 4})
    assert config.pipeline_parallel_size == 2
    path = tmp_path / "c.json"
    path.write_text('{"tensor_parallel_size": 2}')
    assert load_config(str(path)).tensor_parallel_size == 2


def indivisible_heads_case(family: str) -> None:
    setup_parallel(tp=4)
    meshpar.parallelize(build(family, heads=6), {"tensor_parallel_size": 4})


@pytest.mark.parametrize(
    ("family", "message"),
    [
        ("gpt2", "6 attention heads cannot be split over tp=4"),
        ("llama", "6 attention heads cannot be split over tp=4"),
    ],
)
def test_heads_not_divisible_by_tp_raise(family: str, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        run_distributed(indivisible_heads_case, 4, family)


def gqa_case(tp: int) -> None:
    setup_parallel(tp=tp)
    dense = build("llama", heads=8, kv_heads=2)  # 2 KV heads at tp=4: each replicated twice
    model = meshpar.parallelize(copy.deepcopy(dense), {"tensor_parallel_size": tp})
    data = batch("llama")
    expected = dense(**data)
    expected.loss.backward()
    out = model(**data)
    torch.testing.assert_close(out.loss, expected.loss.detach(), atol=1e-5, rtol=1e-5)
    out.loss.backward()
    for name, param in model.module.named_parameters():
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        want = _expected_param_grad(dense, name, param)
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4, msg=name)


def _expected_param_grad(dense: torch.nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
    full = dense.get_parameter(name).grad
    return local_slice(full.reshape(param.shape), param) if isinstance(param, DTensor) else full


def test_gqa_with_fewer_kv_heads_than_tp_replicates_kv_heads() -> None:
    run_distributed(gqa_case, 4, 4)


def tied_save_case(directory: str, tp: int, pp: int, save: bool) -> float:
    setup_parallel(tp=tp, pp=pp)
    dense = build("gpt2", layers=4)
    model = meshpar.parallelize(
        dense, {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "num_microbatches": 2}
    )
    data = batch("gpt2")
    if save:
        optimizer = DistributedOptimizer(model, torch.optim.SGD, lr=0.5)
        for _ in range(2):
            optimizer.zero_grad()
            model.train_step(**data)
            optimizer.step()
        model.save_parallelized(directory)
    else:
        model.from_parallelized(directory)
    return model.eval_loss(**data).item()


def test_tied_embeddings_across_stages_are_saved_once_and_reload_anywhere(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    saved = run_distributed(tied_save_case, 4, str(tmp_path), 2, 2, True)[0]
    metadata = dcp.FileSystemReader(str(tmp_path / "step_00000000")).read_metadata()
    keys = metadata.state_dict_metadata
    assert "model.transformer.wte.weight" in keys and "model.lm_head.weight" in keys  # both names readable
    # ... stored once: the head's name reads the embedding's chunks
    chunks = {}
    for index, info in metadata.storage_data.items():
        chunks.setdefault(index.fqn, set()).add((info.relative_path, info.offset, info.length))
    assert chunks["model.lm_head.weight"] == chunks["model.transformer.wte.weight"]
    for world, tp, pp in [(4, 2, 2), (2, 1, 2), (2, 2, 1), (1, 1, 1)]:
        assert run_distributed(tied_save_case, world, str(tmp_path), tp, pp, False)[0] == pytest.approx(saved, abs=1e-5)


def uneven_vocab_case(directory: str) -> tuple[bool, float, float]:
    """vocab 61 at tp=4: shards of 16, 16, 16, 13; no padded logits exist, so everything equals the dense model."""
    setup_parallel(tp=4)
    dense = build("gpt2", vocab=61)
    model = meshpar.parallelize(copy.deepcopy(dense), {"tensor_parallel_size": 4})
    data = batch("gpt2", vocab=61)
    prompt = data["input_ids"][:2, :5]
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    same_tokens = torch.equal(model.generate(prompt, **kwargs), dense.generate(prompt, **kwargs))
    model.save_parallelized(directory, merge_checkpoints=True)
    return same_tokens, model(**data).loss.item(), dense(**data).loss.item()


def test_vocab_not_divisible_by_tp_is_exact(tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    for same_tokens, loss, dense_loss in run_distributed(uneven_vocab_case, 4, str(tmp_path)):
        assert same_tokens
        assert loss == pytest.approx(dense_loss, abs=1e-5)
    merged = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert merged.lm_head.weight.shape == (61, 32)  # the merged checkpoint is the unpadded model's
    torch.testing.assert_close(
        merged.state_dict()["transformer.wte.weight"], build("gpt2", vocab=61).transformer.wte.weight
    )


def merged_pipeline_case(directory: str) -> float:
    """A merged HF directory (which stores the tied GPT-2 head once) loads into pp=2, last-stage head included."""
    setup_parallel(pp=2)
    reference = build("gpt2")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # random, not constant: a constant shift of the head leaves the softmax unchanged
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    if torch.distributed.get_rank() == 0:
        reference.save_pretrained(directory)
    torch.distributed.barrier()
    model = meshpar.parallelize(build("gpt2"), {"pipeline_parallel_size": 2, "num_microbatches": 2})
    model.from_parallelized(directory)
    data = batch("gpt2")
    assert model.eval_loss(**data).item() == pytest.approx(reference(**data).loss.item(), abs=1e-5)
    return 0.0


def test_merged_checkpoint_loads_into_pipeline_stages_with_tied_head(tmp_path) -> None:
    run_distributed(merged_pipeline_case, 2, str(tmp_path))


def auto_partition_case() -> int:
    dims = setup_parallel(pp=4)
    dense = build("gpt2", layers=6, vocab=2048)  # embedding and tied head ~5 layers' worth of parameters each
    config = {"pipeline_parallel_size": 4, "num_microbatches": 4, "auto_partition": True}
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    data = batch("gpt2", vocab=2048)
    loss = model.train_step(**data)
    torch.testing.assert_close(loss, dense(**data).loss.detach(), atol=1e-5, rtol=1e-5)
    names = {name for module in model.local_modules() for name, _ in module.named_parameters()}
    assert ("transformer.wte.weight" in names) == (dims.pp_rank == 0)
    return len({name.split(".")[2] for name in names if name.startswith("transformer.h.")})


def test_auto_partition_counts_embedding_and_head_in_the_stage_balance() -> None:
    # an even split would give [2, 2, 1, 1] layers; the end stages also carry the embedding / the tied LM head
    assert run_distributed(auto_partition_case, 4) == [1, 2, 2, 1]


def test_batches_move_to_the_ranks_device() -> None:
    """A data loader's CPU batch goes to the rank's device (found on an H100: ``train_step`` with CPU ``input_ids``
    failed in the embedding); tensors already there and non-tensor inputs pass through untouched."""
    from types import SimpleNamespace

    from meshpar.hf.parallelize import ParallelizedModel

    holder = SimpleNamespace(dims=SimpleNamespace(device=torch.device("meta")))
    ids, on_meta = torch.zeros(2, 3, dtype=torch.long), torch.empty(2, device="meta")
    labels, inputs = ParallelizedModel._on_device(holder, ids, {"input_ids": ids, "mask": on_meta, "flag": True})
    assert labels.device.type == "meta" and inputs["input_ids"].device.type == "meta"
    assert inputs["mask"] is on_meta and inputs["flag"] is True
    assert ParallelizedModel._on_device(holder, None, {})[0] is None


def test_unsharded_parameters_follow_the_shards_in_place() -> None:
    """On a CUDA rank a CPU-built model's embeddings, norms and buffers move to the device after sharding (found on
    an H100). The move is in place: tied parameters stay one object and attributes set on parameters survive
    (``module.to`` would swap DTensor parameters' contents and drop attributes set on them)."""
    from meshpar.data import move_model_to_device

    model = build("gpt2")
    model.lm_head.weight = model.transformer.wte.weight
    model.transformer.wte.weight.marker = (1, 2)
    model.transformer.register_buffer("probe", torch.zeros(2))  # GPT-2 has no buffers of its own here
    move_model_to_device(model, torch.device("meta"))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.transformer.probe.device.type == "meta"
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.wte.weight.marker == (1, 2)


def _dense_adamw_losses(family: str, steps: int) -> list[float]:
    model = build(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**batch(family)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def optimizer_first_case(family: str, layout: dict, steps: int) -> list[float]:
    """OSLO's order: the optimizer is built on the dense model, then the model is parallelized. Stepping it before
    it is rebound is refused on every rank (it would train nothing); rebound, it trains the parallel model."""
    model = build(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    parallel = meshpar.parallelize(model, {"num_microbatches": 2, **layout})
    with pytest.raises(RuntimeError, match=r"Call model.rebind_optimizer\(optimizer\) once"):
        optimizer.step()
    assert parallel.rebind_optimizer(optimizer) is optimizer
    dims = parallel.dims
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        rows = {k: v.chunk(dims.dp)[dims.dp_rank] for k, v in batch(family).items()}
        losses.append(parallel.train_step(**rows).item())
        optimizer.step()
    return losses


@pytest.mark.parametrize(
    "family, layout",
    [
        ("gpt2", {"tensor_parallel_size": 2}),
        ("gpt2", {"pipeline_parallel_size": 2}),  # the tied embedding's copies on both stages
        ("gpt2", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
        ("llama", {"tensor_parallel_size": 2, "fsdp": True}),
        ("llama", {"pipeline_parallel_size": 2, "data_parallel_size": 2}),
    ],
)
def test_an_optimizer_built_before_parallelize_trains_the_parallel_model(family: str, layout: dict) -> None:
    world = 4 if layout.get("fsdp") or layout.get("data_parallel_size") or len(layout) == 2 else 2
    dense = _dense_adamw_losses(family, 3)
    for losses in run_distributed(optimizer_first_case, world, family, layout, 3):
        assert losses == pytest.approx(dense, abs=2e-5)


def collective_count_case(family: str, layers: int, sp: bool = False) -> dict[str, int]:
    from meshpar.testing.dispatch import AtenOps

    model = meshpar.parallelize(build(family, layers=layers), {"tensor_parallel_size": 2, "sequence_parallel": sp})
    with AtenOps() as ops:
        model.train_step(**batch(family))
    return dict(ops.collective_names)


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3"])
def test_megatron_collective_count_per_layer(family: str) -> None:
    """Per transformer layer at tp=2 without SP: 2 all-reduces forward (after the attention output and the MLP
    down projection) and 2 backward (one input grad for q/k/v, one for gate/up: the shared-input groups), as
    Megatron's fused QKV and gate/up layers; nothing else grows with depth. Phi-3 packs q/k/v and gate/up in one
    projection each (transformers' plan gathers their outputs: an all-gather per projection)."""
    two, four = (run_distributed(collective_count_case, 2, family, n)[0] for n in (2, 4))
    per_layer = {name: (four.get(name, 0) - two.get(name, 0)) // 2 for name in set(two) | set(four)}
    assert per_layer.pop("all_reduce") == 4, (two, four)
    assert not any(per_layer.values()), (two, four)


@pytest.mark.parametrize("family", ["llama", "mistral", "phi3"])
def test_sequence_parallel_collective_count_per_layer(family: str) -> None:
    """With SP, per layer at tp=2: attention and MLP each all-gather their input and reduce-scatter their output,
    forward and backward (4 + 4: Megatron's count), and each of the two norms all-reduces its parameters' grads once;
    the same for meshpar's Llama plan and for plans converted from transformers' (Mistral; Phi-3's packed q/k/v and
    gate/up)."""
    two, four = (run_distributed(collective_count_case, 2, family, n, True)[0] for n in (2, 4))
    per_layer = {name: (four.get(name, 0) - two.get(name, 0)) // 2 for name in set(two) | set(four)}
    assert per_layer == {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4, "all_reduce": 2}, (two, four)


def no_process_wide_context_case(pp: int, fsdp: bool) -> list[float]:
    """Once built, the model, the optimizer and clipping use the mesh they were given: with the process-wide
    context forgotten (get_parallel() would raise), a step, clipping and an eval still run."""
    from meshpar.parallel_dims import _set_parallel, get_parallel

    setup_parallel(tp=2, pp=pp)
    config = {"tensor_parallel_size": 2, "pipeline_parallel_size": pp, "num_microbatches": 2, "fsdp": fsdp}
    model = meshpar.parallelize(build("llama"), config)
    optimizer = DistributedOptimizer(model, torch.optim.AdamW, dims=model.dims)
    data = batch("llama")
    context = get_parallel()
    _set_parallel(None)
    try:
        loss = model.train_step(**data)
        norm = optimizer.clip_grad_norm(1.0)
        meshpar.clip_grad_norm(model.parameters(), 1e9, dims=model.dims)
        optimizer.step()
        after = model.eval_loss(**data)
    finally:
        _set_parallel(context)
    return [loss.item(), norm.item(), after.item()]


@pytest.mark.parametrize(("pp", "fsdp"), [(2, False), (1, True)])
def test_built_model_needs_no_process_wide_context(pp: int, fsdp: bool) -> None:
    results = run_distributed(no_process_wide_context_case, 4, pp, fsdp)
    assert all(r == pytest.approx(results[0]) for r in results), results
    assert results[0][2] < results[0][0], "the step trained"


def pipeline_attention_case(family: str, impl: str, padded: bool, sp: bool) -> list[float]:
    setup_parallel(tp=2, pp=2)
    dense = build(family)
    dense.config._attn_implementation = impl
    data = batch(family)
    if padded:  # right padding on two rows: the mask must reach every stage's attention
        mask = torch.ones_like(data["input_ids"])
        mask[1, 11:] = 0
        mask[3, 5:] = 0
        data["attention_mask"] = mask
        data["labels"] = data["labels"].masked_fill(mask == 0, -100)
    config = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "num_microbatches": 2, "sequence_parallel": sp}
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    assert model.hf_config._attn_implementation == impl, "the user's attention implementation is kept"
    return [model.eval_loss(**data).item(), dense(**data).loss.item()]


@pytest.mark.parametrize(
    ("family", "impl", "padded", "sp"),
    [("gpt2", "eager", False, False), ("llama", "eager", True, True), ("bert", "eager", True, False),
     ("llama", "sdpa", True, False)],
)  # fmt: skip
def test_pipeline_stages_keep_the_users_attention_implementation(
    family: str, impl: str, padded: bool, sp: bool
) -> None:
    for got, want in run_distributed(pipeline_attention_case, 4, family, impl, padded, sp):
        assert got == pytest.approx(want, rel=1e-5)
