"""Expert parallelism through ``parallelize``: HF mixture-of-experts families with ``expert_parallel_size`` equal the
dense model (logits, loss, every grad and the parameters after an AdamW step), the dp batch split unevenly in scored
tokens; composed with tp and pp; the all-to-all counts per MoE layer pinned; bad sizes refused before any group."""

from __future__ import annotations

import copy

import pytest
import torch

import meshpar
from meshpar import checkpoint
from meshpar._compat import DTensor
from meshpar._shards import in_model_layout, in_parameter_layout, local_slice
from meshpar.grad_clip import total_grad_norm
from meshpar.optim import DistributedOptimizer
from meshpar.testing import run_distributed, setup_parallel
from meshpar.testing.dispatch import AtenOps
from tests.hf._configs import adamw_for, batch, build


def _slow(*values: object) -> object:
    """A parametrization left out of ``make test-fast`` (the full suite runs it)."""
    return pytest.param(*values, marks=pytest.mark.slow)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def expert_parallel_case(
    family: str,
    ep: int,
    tp: int = 1,
    pp: int = 1,
    rows: int = 4,
    implementation: str | None = None,
    extra: dict | None = None,
    zero1: str = "",
    cp: int = 1,
    experts: int | None = None,
) -> dict[str, object]:
    """One AdamW step at (ep, tp, pp) on ``rows`` rows split over dp, against the dense model on all of them
    (``implementation``: transformers' experts implementation, e.g. ``"grouped_mm"``, in both). ``zero1``: the step
    by meshpar's ZeRO-1 optimizer (``"reduce_scatter"``: reducing the raw grads itself, so they are not compared)."""
    dims = setup_parallel(tp=tp, pp=pp, ep=ep, cp=cp)
    dense = build(family)
    if experts is not None:  # Mixtral with another number of experts
        config = copy.deepcopy(dense.config)
        config.num_local_experts = experts
        torch.manual_seed(0)
        dense = type(dense)(config)
    if implementation is not None:
        dense.config._experts_implementation = implementation
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "expert_parallel_size": ep,
              "context_parallel_size": cp, **(extra or {})}  # fmt: skip
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    data = batch(family, rows=rows)
    data["labels"][0, :7] = -100  # dp rank 0 scores fewer tokens: the step weighs every token alike
    expected = dense(**data)
    expected.loss.backward()
    dense_grads = {n: p.grad.clone() for n, p in dense.named_parameters() if p.grad is not None}
    # eps well above the grads' rounding noise (1e-10 on grads as small as 1e-9): Adam's first step divides by |g|
    adamw = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}
    torch.optim.AdamW(dense.parameters(), **adamw).step()
    share = rows // dims.dp
    mine = {k: v[dims.dp_rank * share : (dims.dp_rank + 1) * share] for k, v in data.items()}
    optimizer = adamw_for(model, zero1, **adamw)
    loss = model.train_step(**mine, sync_dp_grads=zero1 != "reduce_scatter")
    torch.testing.assert_close(loss, expected.loss.detach(), atol=1e-5, rtol=1e-5)
    modules = model.local_modules()
    checked = 0
    for module in modules if zero1 != "reduce_scatter" else ():
        for name, param in module.named_parameters():
            dense_grad = dense_grads.get(name)
            if dense_grad is None:
                assert param.grad is None or not _local(param.grad).any(), name
                continue
            want = local_slice(in_parameter_layout(dense_grad, module, name), param)
            torch.testing.assert_close(_local(param.grad), want, atol=1e-5, rtol=1e-4, msg=f"grad of {name}")
            checked += 1
    if zero1 != "reduce_scatter":  # every expert and dense grad counted once, however it is sharded
        norm = total_grad_norm([p for m in modules for p in m.parameters()], dims=model.dims)
        dense_norm = torch.stack([g.norm() for g in dense_grads.values()]).norm()
        torch.testing.assert_close(norm, dense_norm, rtol=1e-5, atol=0)
    optimizer.step()
    experts, layouts = 0, set()
    for module in modules:
        for name, param in module.named_parameters():
            full = dense.get_parameter(name).detach()
            want = local_slice(in_parameter_layout(full, module, name), param)
            torch.testing.assert_close(_local(param), want, atol=1e-5, rtol=1e-4, msg=name)
            if isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ()):
                experts += 1
                layouts.add(tuple(type(p).__name__ for p in param.placements[-2:]))
    return {"checked": checked, "expert_params": experts, "expert_layouts": layouts}


@pytest.mark.parametrize(
    "family",
    ["mixtral", "qwen2_moe", *(_slow(f) for f in ("qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "olmoe")),
     _slow("glm4_moe_qk_norm")],
)  # fmt: skip
def test_expert_parallel_matches_dense(family: str) -> None:
    results = run_distributed(expert_parallel_case, 4, family, 2)
    assert all(r["expert_params"] > 0 and r["checked"] > 0 for r in results), results


@pytest.mark.parametrize("ep,tp,extra", [(2, 1, {}), _slow(2, 2, {}), _slow(4, 1, {"fsdp": True})])
def test_experts_handed_blocks_of_tokens_route_their_live_rows(ep: int, tp: int, extra: dict) -> None:
    """Llama-4's experts take one block of (already weighted) tokens per expert, every token in every block: under
    ep each row with a non-zero weight travels as a route, the zero rows stay (their output and grads are zero, as
    proven on the forward); equal dense at ep2, ep2 x tp2 and ep4 under FSDP2."""
    results = run_distributed(expert_parallel_case, 4, "llama4_text", ep, tp, 1, 4, None, extra)
    assert all(r["expert_params"] > 0 and r["checked"] > 0 for r in results), results


def test_a_blocks_forward_whose_zero_rows_are_not_inert_is_refused() -> None:
    """A blocks-per-expert forward that gives a zero row an output (a bias) cannot leave the unrouted rows out."""
    from meshpar.hf.experts import _zero_rows_inert

    experts = build("llama4_text").model.layers[0].feed_forward.experts
    assert _zero_rows_inert(experts)

    class Biased(type(experts)):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states) + 1.0

    experts.__class__ = Biased
    assert not _zero_rows_inert(experts)


@pytest.mark.parametrize("implementation", ["grouped_mm", _slow("batched_mm")])
def test_expert_parallel_with_transformers_grouped_experts(implementation: str) -> None:
    """transformers' grouped (one grouped matmul per rank: torch._grouped_mm, its fallback on CPU) and batched
    experts forwards run on the rows each rank receives, as the eager one does."""
    run_distributed(expert_parallel_case, 4, "mixtral", 2, 2, 1, 4, implementation)


@pytest.mark.parametrize(
    "extra",
    [{"overlap_grad_reduce": True}, _slow({"activation_checkpointing": True}), _slow({"sequence_parallel": True})],
    ids=["overlapped-dp-grads", "activation-checkpointing", "sequence-parallel"],
)
def test_expert_parallel_composes_with_the_step_options(extra: dict) -> None:
    """Overlapped dp grad all-reduces (the CUDA default: dense grads bucketed during backward, expert grads over edp
    after it), recomputed blocks (their all-to-alls run again in backward) and sequence parallelism (tokens gathered
    over tp before routing) at ep2 x tp2."""
    run_distributed(expert_parallel_case, 4, "mixtral", 2, 2, 1, 4, None, extra)


@pytest.mark.parametrize("ep,tp,pp", [_slow(4, 1, 1), (2, 2, 1), _slow(2, 1, 2)])
def test_expert_parallel_composes_with_tp_and_pp(ep: int, tp: int, pp: int) -> None:
    results = run_distributed(expert_parallel_case, 4, "mixtral", ep, tp, pp)
    assert all(r["expert_params"] > 0 for r in results), results


@pytest.mark.parametrize(
    "family,ep,cp,tp,pp,zero1",
    [("mixtral", 2, 2, 1, 1, ""), _slow("mixtral", 2, 2, 2, 1, ""), _slow("mixtral", 2, 2, 1, 2, ""),
     _slow("qwen2_moe", 4, 2, 1, 1, "zero1")],
)  # fmt: skip
def test_expert_parallel_carved_from_dp_and_cp(family: str, ep: int, cp: int, tp: int, pp: int, zero1: str) -> None:
    """ep carved from dp x cp (Megatron-Core's layout): at cp2 with ep2 the ep groups are the cp pairs of each dp
    rank (dp2), at ep4 they span both dp and cp, under pp they stay within a stage; each cp rank routes its chunks'
    tokens by all-to-all, expert grads summed over the ranks holding the same experts and divided by dp; loss, grads
    and the AdamW step equal dense."""
    results = run_distributed(expert_parallel_case, 4, family, ep, tp, pp, 4, None, None, zero1, cp)
    assert all(r["expert_params"] > 0 for r in results), results


@pytest.mark.parametrize(
    "family,ep,tp,pp,cp",
    [("mixtral", 2, 1, 1, 1), ("qwen2_moe", 4, 1, 1, 2), _slow("gpt_oss", 2, 2, 1, 1), _slow("mixtral", 2, 1, 2, 1)],
)
def test_expert_parallel_composes_with_fsdp(family: str, ep: int, tp: int, pp: int, cp: int) -> None:
    """FSDP2 with expert parallelism (torchtitan's layout): each experts module its own unit over the edp ranks
    holding the same experts, the dense weights over dp (x cp); the expert grads' sum divided by dp like the dense
    ones, also where edp is one rank (ep4 x cp2: each rank the only holder of its experts). Loss, every grad shard and
    the AdamW step equal dense, at ep2 (edp2), with shared experts, with tp (expert biases) and pp."""
    results = run_distributed(expert_parallel_case, 4, family, ep, tp, pp, 4, None, {"fsdp": True}, "", cp)
    assert all(r["expert_params"] > 0 and r["checked"] > 0 for r in results), results


@pytest.mark.parametrize(
    "family,ep,tp,extra,experts",
    [("mixtral", 2, 2, {}, 2), _slow("qwen2_moe", 2, 2, {"sequence_parallel": True}, None),
     _slow("gpt_oss", 2, 2, {"fsdp": True}, None), _slow("mixtral", 1, 2, {}, None)],
    ids=["2-experts-at-ep2xtp2", "shared-experts-sp", "expert-biases-fsdp", "tp-only"],
)  # fmt: skip
def test_expert_tensor_parallel_size_one_keeps_experts_whole_on_every_tp_rank(
    family: str, ep: int, tp: int, extra: dict, experts: int | None
) -> None:
    """Megatron-Core's ``expert_tensor_parallel_size: 1``: each ep rank's experts whole on every one of its tp ranks,
    each tp rank routing every tp-th token, the experts' grads summed over tp in backward; so only ep need divide the
    experts (2 experts at ep2 x tp2, which whole experts per rank cannot split). Loss, every grad (the experts'
    replicated over tp), the AdamW step equal dense; with shared experts under SP, with expert biases under FSDP2,
    and at tp2 without ep (every expert on every rank)."""
    config = {**extra, "expert_tensor_parallel_size": 1}
    results = run_distributed(expert_parallel_case, 4, family, ep, tp, 1, 4, None, config, "", 1, experts)
    assert all(r["checked"] > 0 for r in results), results
    if ep > 1:
        assert all(r["expert_layouts"] == {("Shard", "Replicate")} for r in results), results


@pytest.mark.parametrize(
    "ep,tp,pp,cp,extra",
    [(2, 1, 1, 1, {}), (2, 2, 1, 1, {"expert_tensor_parallel_size": 1}), _slow(2, 1, 2, 1, {}),
     _slow(2, 1, 1, 1, {"fsdp": True}), _slow(2, 1, 1, 2, {}),
     _slow(2, 2, 1, 1, {"expert_tensor_parallel_size": 1, "sequence_parallel": True})],
    ids=["ep2", "ep2xtp2-etp1", "ep2xpp2", "ep2-fsdp", "ep2-from-dp-x-cp", "ep2xtp2-etp1-sp"],
)  # fmt: skip
def test_identity_experts_under_expert_parallelism(ep: int, tp: int, pp: int, cp: int, extra: dict) -> None:
    """LongCat-Flash's identity ("zero-computation") experts under expert parallelism: the real experts split over
    ep (the fused gate/up weight as one group per ep rank: its experts' rows and an equal share of the identity
    rows, which nothing reads), the identity experts' routes run on the rank their tokens are on (never sent);
    loss, every grad and the AdamW step equal dense, with each tp rank routing every tp-th token
    (``expert_tensor_parallel_size: 1``, with sequence parallelism too), under pp, FSDP2 and with ep carved from
    dp x cp."""
    results = run_distributed(expert_parallel_case, 4, "longcat_flash", ep, tp, pp, 4, None, extra, "", cp)
    assert all(r["expert_params"] > 0 and r["checked"] > 0 for r in results), results


def save_case(
    directory: str, ep: int, tp: int, zero1: bool = False, fsdp: bool = False, family: str = "mixtral"
) -> dict[str, torch.Tensor] | None:
    """One AdamW step at (ep, tp), saved; the whole parameters and Adam moments (rank 0; under ZeRO-1 the moments
    it owns)."""
    setup_parallel(tp=tp, ep=ep)
    config = {"tensor_parallel_size": tp, "expert_parallel_size": ep, "fsdp": fsdp}
    model = meshpar.parallelize(build(family), config)
    optimizer = DistributedOptimizer(model, torch.optim.AdamW, lr=0.01, zero1=zero1)
    dims = model.dims
    share = 4 // dims.dp
    data = {k: v[dims.dp_rank * share : (dims.dp_rank + 1) * share] for k, v in batch(family).items()}
    model.train_step(**data)
    optimizer.step()
    checkpoint.save(directory, model, optimizer, step=1)
    return _whole(model, optimizer)


def load_case(
    directory: str, ep: int, tp: int, zero1: bool = False, fsdp: bool = False, family: str = "mixtral"
) -> dict[str, torch.Tensor] | None:
    setup_parallel(tp=tp, ep=ep)
    config = {"tensor_parallel_size": tp, "expert_parallel_size": ep, "fsdp": fsdp}
    model = meshpar.parallelize(build(family), config)
    optimizer = DistributedOptimizer(model, torch.optim.AdamW, lr=0.01, zero1=zero1)
    checkpoint.load(directory, model, optimizer)
    return _whole(model, optimizer)


def _whole(model: torch.nn.Module, optimizer: DistributedOptimizer) -> dict[str, torch.Tensor] | None:
    """Every parameter and Adam moment whole, in the model's own shapes (whatever layout this run keeps it in)."""
    module = model.local_modules()[0]

    def whole_of(t: torch.Tensor, name: str) -> torch.Tensor:
        return in_model_layout(t.full_tensor() if isinstance(t, DTensor) else t, module, name)

    whole = {n: whole_of(p, n) for n, p in module.named_parameters()}
    for name, entry in optimizer.state_dict()["state"].items():
        whole[f"{name}.exp_avg"] = whole_of(entry["exp_avg"], name)
    return {k: v.detach().clone() for k, v in whole.items()} if torch.distributed.get_rank() == 0 else None


def test_expert_parallel_checkpoints_reshard(tmp_path) -> None:
    """Saved at ep2 x tp2 (one expert per rank), loaded at ep1 x tp4 and in one process: every parameter and Adam
    moment equals the saved one (the experts are stored in the model's own [experts, ...] shapes)."""
    saved = run_distributed(save_case, 4, str(tmp_path), 2, 2)[0]
    assert any("experts" in name for name in saved)
    for world, ep, tp in [(4, 1, 4), (1, 1, 1), (4, 4, 1)]:
        loaded = run_distributed(load_case, world, str(tmp_path), ep, tp)[0]
        assert loaded.keys() == saved.keys()
        for name, value in loaded.items():
            torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=f"{name} at ep={ep} tp={tp}")


def test_identity_expert_checkpoints_reshard(tmp_path) -> None:
    """LongCat-Flash saved at ep2 (the fused gate/up weight kept as one group per ep rank of its two experts and its
    identity expert's row), loaded at tp4 (2 identity experts over 4 ranks: every expert split by features
    instead), at tp2 (the groups over tp) and in one process: every parameter and Adam moment equals the saved one,
    in the model's own shapes."""
    saved = run_distributed(save_case, 4, str(tmp_path), 2, 1, False, False, "longcat_flash")[0]
    assert saved["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == 6  # 4 experts and 2 identity experts
    for world, ep, tp in [(4, 1, 4), (2, 1, 2), (1, 1, 1)]:
        loaded = run_distributed(load_case, world, str(tmp_path), ep, tp, False, False, "longcat_flash")[0]
        assert loaded.keys() == saved.keys()
        for name, value in loaded.items():
            torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=f"{name} at ep={ep} tp={tp}")


def test_zero1_expert_checkpoints_reshard(tmp_path) -> None:
    """Saved under ZeRO-1 at ep2 (each expert's Adam moments on one of the two dp ranks holding it), loaded in one
    process and again at ep2 under ZeRO-1: the same parameters and moments as the same step saved without ZeRO-1."""
    plain, sharded = str(tmp_path / "plain"), str(tmp_path / "zero1")
    run_distributed(save_case, 4, plain, 2, 1)
    run_distributed(save_case, 4, sharded, 2, 1, True)
    want = run_distributed(load_case, 1, plain, 1, 1)[0]
    got = run_distributed(load_case, 1, sharded, 1, 1)[0]
    assert got.keys() == want.keys() and any("experts" in name and "exp_avg" in name for name in got)
    resumed = run_distributed(load_case, 4, sharded, 2, 1, True)[0]  # rank 0: its parameters, the moments it owns
    assert any("experts" in name and "exp_avg" in name for name in resumed)
    for loaded in (got, resumed):
        for name, value in loaded.items():
            torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-7, msg=name)


def test_fsdp_expert_checkpoints_reshard(tmp_path) -> None:
    """Saved under FSDP2 at ep2 (expert weights and moments sharded over edp inside each ep rank, the dense ones
    over dp), loaded in one process, at ep4 without FSDP and at ep2 x tp2 under FSDP: every parameter and Adam moment
    equals the same step saved without FSDP."""
    plain, sharded = str(tmp_path / "plain"), str(tmp_path / "fsdp")
    run_distributed(save_case, 4, plain, 2, 1)
    saved = run_distributed(save_case, 4, sharded, 2, 1, False, True)[0]
    want = run_distributed(load_case, 1, plain, 1, 1)[0]
    for value, name in ((saved[n], n) for n in want):
        torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-7, msg=f"{name} as trained under FSDP")
    for world, ep, tp, fsdp in [(1, 1, 1, False), (4, 4, 1, False), (4, 2, 2, True)]:
        loaded = run_distributed(load_case, world, sharded, ep, tp, False, fsdp)[0]
        assert loaded.keys() == want.keys() and any("experts" in name and "exp_avg" in name for name in loaded)
        for name, value in loaded.items():
            torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-7, msg=f"{name} at ep={ep} tp={tp}")


def collectives_case(ep: int, tp: int) -> dict[str, int]:
    setup_parallel(tp=tp, ep=ep)
    config = {"tensor_parallel_size": tp, "expert_parallel_size": ep}
    model = meshpar.parallelize(build("mixtral"), config)
    dims = model.dims
    share = 4 // dims.dp
    data = {k: v[dims.dp_rank * share : (dims.dp_rank + 1) * share] for k, v in batch("mixtral").items()}
    with AtenOps() as ops:
        model.train_step(**data)
    return dict(ops.collective_names)


@pytest.mark.parametrize("ep,tp", [(2, 1), (2, 2)])
def test_all_to_alls_per_moe_layer_are_pinned(ep: int, tp: int) -> None:
    """Per MoE layer: forward, one exchange of the row counts per (rank, local expert), one of the rows with their
    routing weights (dispatch), one of the outputs (combine); backward, the two row exchanges reversed."""
    counts = run_distributed(collectives_case, 4, ep, tp)
    layers = build("mixtral").config.num_hidden_layers
    assert all(c["all_to_all_single"] == 5 * layers for c in counts), counts


def exchange_case(weights_dtype: torch.dtype) -> dict[str, object]:
    """dispatch + combine of fixed routes at ep2 against the same arithmetic done in one process on the whole
    batch: outputs and the grads of the rows and of the routing weights."""
    import torch.distributed as dist

    from meshpar.expert_parallel import combine, dispatch
    from meshpar.parallel_dims import get_parallel

    setup_parallel(ep=2)
    dims = get_parallel()
    experts, tokens, k = 4, 6, 2
    gen = torch.Generator().manual_seed(0)
    hidden_all = torch.randn(2 * tokens, 8, generator=gen, dtype=torch.float64)
    index_all = torch.randint(0, experts, (2 * tokens, k), generator=gen)
    weights_all = torch.rand(2 * tokens, k, generator=gen, dtype=torch.float64).to(weights_dtype)
    scale = torch.arange(1.0, experts + 1, dtype=torch.float64)  # expert e multiplies its rows by e + 1

    def reference() -> tuple[torch.Tensor, ...]:
        hidden, weights = hidden_all.clone().requires_grad_(), weights_all.clone().requires_grad_()
        out = (hidden[:, None, :] * scale[index_all][..., None] * weights[..., None].to(hidden.dtype)).sum(1)
        (out * out).sum().backward()
        return out, hidden.grad, weights.grad

    mine = slice(dims.ep_rank * tokens, (dims.ep_rank + 1) * tokens)
    hidden, weights = hidden_all[mine].clone().requires_grad_(), weights_all[mine].clone().requires_grad_()
    with AtenOps() as ops:
        rows, local_index, row_weights, routes = dispatch(
            hidden, index_all[mine], weights, num_experts=experts, ep_mesh=dims.ep_mesh
        )
        held = scale[dims.ep_rank * 2 : dims.ep_rank * 2 + 2]
        out = combine(rows * held[local_index][:, None] * row_weights[:, None].to(rows.dtype), routes, dims.ep_mesh)
        (out * out).sum().backward()
    want = reference()
    dist.barrier()
    return {
        "exchanges": ops.collective_names["all_to_all_single"],
        "errors": [  # relative to the largest value
            ((got - ref[mine]).abs().max() / ref[mine].abs().max()).item()
            for got, ref in zip((out, hidden.grad, weights.grad), want, strict=True)
        ],
        "weights_dtype": str(row_weights.dtype),
    }


@pytest.mark.parametrize("weights_dtype", [torch.float64, torch.float32])
def test_rows_and_weights_travel_together_where_their_dtypes_match(weights_dtype: torch.dtype) -> None:
    """The weights ride as a column of the rows where the dtypes match (counts, rows, outputs; then the two row
    exchanges back: 5), and in an exchange of their own where they do not (7), never rounded to the rows' dtype:
    outputs and both grads equal the one-process arithmetic in either case."""
    for got in run_distributed(exchange_case, 2, weights_dtype):
        assert got["exchanges"] == (5 if weights_dtype == torch.float64 else 7), got
        assert got["weights_dtype"] == str(weights_dtype)
        assert max(got["errors"]) < 1e-6, got


def _refusal(family: str, config: dict) -> str:
    """What ``parallelize`` says before any process group exists: the config's checks, then the plan's."""
    from meshpar.hf import plan_for
    from meshpar.hf.config import load_config

    try:
        plan_for(build(family), load_config(config))
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize(
    "family,config,says",
    [
        ("mixtral", {"expert_parallel_size": 3}, "over ep x tp = 3 x 1"),
        ("mixtral", {"expert_parallel_size": 4, "tensor_parallel_size": 2}, "over ep x tp = 4 x 2"),
        ("mixtral", {"expert_parallel_size": 4, "tensor_parallel_size": 2}, "or expert_tensor_parallel_size 1"),
        (
            "mixtral",
            {"expert_parallel_size": 8, "tensor_parallel_size": 2, "expert_tensor_parallel_size": 1},
            "over ep x tp = 8 x 1",
        ),
        ("mixtral", {"tensor_parallel_size": 2, "expert_tensor_parallel_size": 4}, "must be 1 (experts whole"),
        ("llama4_text", {"expert_parallel_size": 2, "expert_capacity_factor": 1.0}, "leaves no routes to drop"),
        ("llama", {"expert_parallel_size": 2}, "has no experts module"),
        ("mixtral", {"expert_capacity_factor": -1.0}, "must be a positive number"),
        ("mixtral", {"expert_capacity_factor": 1.0, "expert_drop_policy": "random"}, "'probs' or 'position'"),
        ("llama", {"expert_capacity_factor": 1.0}, "expert_capacity_factor: LlamaForCausalLM has no experts module"),
        # LongCat-Flash's identity experts: split evenly per rank with the real ones, and never dropped (was: the
        # capacity factor silently ignored at tp2)
        ("longcat_flash_one_identity", {"expert_parallel_size": 2}, "cannot each be split evenly over 2 ranks"),
        ("longcat_flash", {"expert_parallel_size": 2, "tensor_parallel_size": 2}, "evenly over 4 ranks"),
        ("longcat_flash", {"expert_capacity_factor": 1.0}, "token dropping with identity"),
        ("longcat_flash", {"tensor_parallel_size": 2, "expert_capacity_factor": 1.0}, "token dropping with identity"),
    ],
)
def test_bad_expert_parallel_layouts_are_refused_before_any_group(family: str, config: dict, says: str) -> None:
    """(ep not dividing dp is ParallelDims' refusal: tests/test_parallel_state.py)"""
    assert says in _refusal(family, config)


@pytest.mark.parametrize(
    "ep,tp,zero1", [(2, 1, "zero1"), (2, 1, "reduce_scatter"), _slow(2, 2, "reduce_scatter"), _slow(4, 1, "zero1")]
)
def test_zero1_owns_expert_weights_within_the_expert_data_parallel_group(ep: int, tp: int, zero1: str) -> None:
    """ZeRO-1 over an ep model (Megatron's distributed optimizer): dense weights owned over dp, expert weights over
    the dp ranks holding the same experts (edp = 2 at ep2 on 4 ranks; 1 at ep2 x tp2 and ep4: each rank owns its
    experts), with the grads all-reduced first or reduce-scattered by the optimizer (summed over the group, divided
    by dp): the parameters after the step equal dense."""
    results = run_distributed(expert_parallel_case, 4, "mixtral", ep, tp, 1, 4, None, None, zero1)
    assert all(r["expert_params"] > 0 for r in results), results


def zero1_without_dims_case() -> str:
    setup_parallel(ep=2)
    model = meshpar.parallelize(build("mixtral"), {"expert_parallel_size": 2})
    try:
        DistributedOptimizer(list(model.named_parameters()), torch.optim.AdamW, zero1=True, dp_mesh=model.dims.dp_mesh)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_zero1_of_expert_weights_without_the_expert_group_is_refused() -> None:
    for message in run_distributed(zero1_without_dims_case, 4):
        assert "is sharded over ep, but the optimizer was given no mesh with an expert-data-parallel group" in message


def router_loss_case(family: str, ep: int, tp: int, cp: int = 1, sequence_parallel: bool = False) -> None:
    """With output_router_logits the step's loss and grads include the routers' load-balancing loss of the global
    batch (dp replicas with different token counts; under cp each rank routing its chunks, the padding across a
    chunk border; under sequence parallelism each tp rank routing its shard, the padding in one of them), as the
    dense model's do."""
    dims = setup_parallel(tp=tp, ep=ep, cp=cp)
    dense = build(family)
    dense.config.output_router_logits = True
    dense.router_aux_loss_coef = 0.5  # large enough for its grads to show
    config = {"tensor_parallel_size": tp, "expert_parallel_size": ep, "context_parallel_size": cp,
              "sequence_parallel": sequence_parallel}  # fmt: skip
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    data = batch(family, rows=4)
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    data["attention_mask"][1, 10:] = 0  # padding, on one replica only
    data["labels"][1, 10:] = -100
    expected = dense(**data)
    assert expected.aux_loss is not None
    expected.loss.backward()
    share = 4 // dims.dp
    mine = {k: v[dims.dp_rank * share : (dims.dp_rank + 1) * share] for k, v in data.items()}
    loss = model.train_step(**mine)
    torch.testing.assert_close(loss, expected.loss.detach(), atol=1e-5, rtol=1e-5)
    for module in model.local_modules():
        for name, param in module.named_parameters():
            want = local_slice(in_parameter_layout(dense.get_parameter(name).grad, module, name), param)
            torch.testing.assert_close(_local(param.grad), want, atol=1e-5, rtol=1e-4, msg=f"grad of {name}")


@pytest.mark.parametrize(
    "family,ep,tp,cp,sp",
    [
        ("mixtral", 2, 1, 1, False),
        _slow("qwen2_moe", 2, 2, 1, False),
        _slow("mixtral", 1, 1, 1, False),
        ("mixtral", 2, 1, 2, False),
        ("mixtral", 1, 2, 1, True),  # tp2 x dp2, each tp rank routing its sequence shard
        _slow("qwen2_moe", 2, 2, 1, True),  # shared experts too
        _slow("mixtral", 1, 2, 2, True),  # cp2 x tp2: shards of each cp rank's chunks
    ],
)
def test_router_load_balancing_loss_is_the_global_batchs(family: str, ep: int, tp: int, cp: int, sp: bool) -> None:
    run_distributed(router_loss_case, 4, family, ep, tp, cp, sp)


def router_loss_pipeline_case(
    family: str, pp: int, tp: int, ep: int, microbatches: int, sp: bool = False, cp: int = 1, dp_mode: str = ""
) -> None:
    """Under pipeline parallelism (GPipe) the step's loss and every stage's grads include the routers' load-balancing
    loss of the global batch, counted over every stage, microbatch and replica (the padding in one microbatch of one
    replica; under sequence parallelism in one tp rank's shard, under cp across a chunk border); eval_loss includes
    it as well."""
    dims = setup_parallel(tp=tp, pp=pp, ep=ep, cp=cp)
    dense = build(family)
    dense.config.output_router_logits = True
    dense.router_aux_loss_coef = 0.5
    config = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "expert_parallel_size": ep,
              "num_microbatches": microbatches, "pipeline_schedule": "gpipe", "sequence_parallel": sp,
              "context_parallel_size": cp, **({dp_mode: True} if dp_mode else {})}  # fmt: skip
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    data = batch(family, rows=4)
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    data["attention_mask"][1, 9:] = 0
    data["labels"][1, 9:] = -100
    expected = dense(**data)
    expected.loss.backward()
    share = 4 // dims.dp
    mine = {k: v[dims.dp_rank * share : (dims.dp_rank + 1) * share] for k, v in data.items()}
    for _ in range(2):  # the second step's counts are its own batch's
        model.zero_grad(set_to_none=True)
        loss = model.train_step(**mine)
        torch.testing.assert_close(loss, expected.loss.detach(), atol=1e-5, rtol=1e-5)
    routers = 0
    for module in model.local_modules():
        for name, param in module.named_parameters():
            want = local_slice(in_parameter_layout(dense.get_parameter(name).grad, module, name), param)
            torch.testing.assert_close(_local(param.grad), want, atol=1e-5, rtol=1e-4, msg=f"grad of {name}")
            routers += "gate.weight" in name
    assert routers > 0  # every stage holds routers whose grads were compared
    with torch.no_grad():
        dense.eval()
        torch.testing.assert_close(model.eval_loss(**mine), dense(**data).loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "family,pp,tp,ep,microbatches,sp,cp,dp_mode",
    [
        ("mixtral", 2, 1, 1, 2, False, 1, ""),
        ("mixtral", 2, 1, 2, 2, False, 1, ""),
        ("mixtral", 2, 2, 1, 2, True, 1, ""),
        _slow("qwen2_moe", 2, 2, 1, 4, False, 1, ""),
        _slow("qwen2_moe", 2, 1, 2, 2, False, 1, ""),
        _slow("qwen2_moe", 2, 2, 1, 2, True, 1, ""),
        ("mixtral", 2, 1, 1, 2, False, 2, ""),  # cp2 x pp2
        _slow("mixtral", 2, 1, 1, 2, False, 1, "fsdp"),  # pp2 x dp2, FSDP2
        _slow("mixtral", 2, 1, 1, 2, False, 1, "overlap_grad_reduce"),  # dp all-reduces during the backwards
    ],
)
def test_router_load_balancing_loss_under_pipelines_is_the_global_batchs(
    family: str, pp: int, tp: int, ep: int, microbatches: int, sp: bool, cp: int, dp_mode: str
) -> None:
    run_distributed(router_loss_pipeline_case, 4, family, pp, tp, ep, microbatches, sp, cp, dp_mode)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_router_loss_under_pipelines_other_than_gpipe_is_refused(schedule: str) -> None:
    from meshpar.hf.router_loss import check_router_loss_layout

    model = build("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="only with pipeline_schedule 'gpipe'"):
        check_router_loss_layout(model, 2, schedule)
    check_router_loss_layout(model, 1, schedule)  # one stage: counted in one forward
    check_router_loss_layout(model, 2, "gpipe")
    model.config.output_router_logits = False
    check_router_loss_layout(model, 2, schedule)  # nothing asked for, nothing refused


def test_a_router_loss_meshpar_does_not_reproduce_is_refused_on_the_dense_probe() -> None:
    """Under sequence parallelism the formula is proven on the dense model before any step: a family whose own
    auxiliary loss is another (here: one more expert per token than the formula is told) is refused."""
    from meshpar.hf.router_loss import RouterLoss

    model = build("mixtral")
    model.config.output_router_logits = True
    loss = RouterLoss(model)
    loss.prove(model)
    assert loss.checked
    other = RouterLoss(model)
    other.top_k += 1
    with pytest.raises(ValueError, match="is not the Switch load-balancing loss"):
        other.prove(model)


def _dropping_dense(dense: torch.nn.Module, factor: float, policy: str) -> list[int]:
    """The dense model dropping routes over capacity as the parallel one does, per forward of its experts; returns
    the list the hook appends each forward's count of dropped routes to."""
    from meshpar.expert_parallel import drop_over_capacity

    dropped: list[int] = []

    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        hidden, index, weights = args
        kept_index, kept_weights = drop_over_capacity(index, weights, module.num_experts, factor, policy)
        dropped.append(int((kept_index == module.num_experts).sum()))
        return hidden, index, kept_weights  # a dropped route still runs here, with weight 0: it adds nothing

    for name, module in dense.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(hook)
    return dropped


def capacity_case(
    family: str, ep: int, tp: int, factor: float, policy: str, cp: int = 1, sequence_parallel: bool = False
) -> int:
    """Token dropping per forward of one replica's tokens (Megatron-Core's capacity): the step equals a dense model
    that drops the same routes, run replica by replica on the same rows (its token losses summed over the global
    count); returns the routes the dense reference dropped. Under sequence parallelism the experts get the tp ranks'
    shards, under context parallelism each cp rank two chunks of every sequence: the routes kept are still those the
    dense model keeps over the replica's whole batch, in its order (two rows per replica at least, so that an order
    of the rows' shards would differ)."""
    dims = setup_parallel(tp=tp, ep=ep, cp=cp)
    dense = build(family)
    config = {"tensor_parallel_size": tp, "expert_parallel_size": ep, "expert_capacity_factor": factor,
              "expert_drop_policy": policy, "context_parallel_size": cp,
              "sequence_parallel": sequence_parallel}  # fmt: skip
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    dropped = _dropping_dense(dense, factor, policy)
    data = batch(family, rows=4)
    data["labels"][0, :7] = -100
    share = 4 // dims.dp
    scored = (data["labels"][:, 1:] != -100).sum()
    total = 0.0
    for replica in range(dims.dp):
        rows = {k: v[replica * share : (replica + 1) * share] for k, v in data.items()}
        logits = dense(input_ids=rows["input_ids"]).logits
        total = total + torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), rows["labels"][:, 1:].flatten(), reduction="sum"
        )
    expected = total / scored
    expected.backward()
    mine = {k: v[dims.dp_rank * share : (dims.dp_rank + 1) * share] for k, v in data.items()}
    loss = model.train_step(**mine)
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    for module in model.local_modules():
        for name, param in module.named_parameters():
            dense_grad = dense.get_parameter(name).grad
            want = local_slice(in_parameter_layout(dense_grad, module, name), param)
            torch.testing.assert_close(_local(param.grad), want, atol=1e-5, rtol=1e-4, msg=f"grad of {name}")
    return sum(dropped)  # routes the dense reference dropped: the case must drop some


@pytest.mark.parametrize(
    "family,ep,tp,factor,policy,cp,sp",
    [
        ("mixtral", 2, 1, 1.0, "probs", 1, False),
        ("mixtral", 1, 2, 0.75, "position", 1, True),  # tp2 x dp2: each replica's two rows in tp shards
        ("mixtral", 1, 1, 0.75, "position", 2, False),  # cp2 x dp2
        _slow("mixtral", 2, 2, 0.75, "position", 1, False),
        _slow("qwen2_moe", 1, 2, 1.0, "probs", 1, False),
        _slow("mixtral", 2, 1, 1.0, "probs", 2, False),  # ep2 carved from dp2 x cp2
        _slow("qwen2_moe", 1, 2, 0.75, "probs", 2, True),  # cp2 x tp2 with sequence parallelism, one replica
    ],
)
def test_capacity_factor_drops_the_routes_a_dense_model_dropping_them_drops(
    family: str, ep: int, tp: int, factor: float, policy: str, cp: int, sp: bool
) -> None:
    dropped = run_distributed(capacity_case, 4, family, ep, tp, factor, policy, cp, sp)
    assert all(d > 0 for d in dropped), dropped


def test_drop_over_capacity_keeps_each_experts_best_routes() -> None:
    """Expert 0 gets five routes at capacity ceil(4 tokens * 2 / 2 experts * 0.5) = 2: by weight it keeps the two
    heaviest, by position the two earliest tokens'; expert 1's two routes all fit."""
    from meshpar.expert_parallel import drop_over_capacity

    index = torch.tensor([[0, 1], [0, 0], [0, 1], [0, 0]])  # token 1 and 3 route twice to expert 0 (allowed here)
    weights = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    kept, w = drop_over_capacity(index, weights, 2, 0.5, "probs")
    assert kept.tolist() == [[2, 1], [0, 2], [2, 1], [0, 2]] and w[0, 0] == 0 and w[1, 0] == 0.8
    kept, _ = drop_over_capacity(index, weights, 2, 0.5, "position")
    assert kept.tolist() == [[0, 1], [0, 2], [2, 1], [2, 2]]
    with pytest.raises(ValueError, match="unknown drop policy"):
        drop_over_capacity(index, weights, 2, 0.5, "random")


class _Mesh:
    """The two things :func:`meshpar.hf.capacity.dense_token_order` asks of a mesh."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def test_dense_token_order_places_sequence_shards_and_cp_chunks() -> None:
    """Rows of a layer input ``[batch, seq]`` as this rank holds it, as indices into the replica's whole batch
    flattened: tp rank 1's shard of 3 tokens is positions 3..5 of each row of 6; under cp2 rank 0 (chunks 0 and 3 of
    a row of 8) tp rank 1 holds the second chunk: positions 6, 7. A layer input that is not the experts' rows is
    refused."""
    from meshpar.hf.capacity import TokenLayout, dense_token_order

    cpu = torch.device("cpu")
    order = dense_token_order(TokenLayout(2, 3, None), 6, _Mesh(2, 1), True, cpu)
    assert order.tolist() == [3, 4, 5, 9, 10, 11]
    order = dense_token_order(TokenLayout(2, 2, _Mesh(2, 0)), 4, _Mesh(2, 1), True, cpu)
    assert order.tolist() == [6, 7, 14, 15]
    order = dense_token_order(TokenLayout(1, 4, _Mesh(2, 1)), 4, _Mesh(2, 0), False, cpu)
    assert order.tolist() == [2, 3, 4, 5]  # cp rank 1: chunks 1 and 2
    for layout in (None, TokenLayout(2, 3, None)):
        with pytest.raises(RuntimeError, match="leave expert_capacity_factor unset"):
            dense_token_order(layout, 5, _Mesh(1, 0), False, cpu)


def test_capacity_keep_decides_in_the_given_order() -> None:
    """The same routes in another row order, with that order given, keep the same routes as in the dense order."""
    from meshpar.expert_parallel import capacity_keep

    generator = torch.Generator().manual_seed(3)
    index = torch.randint(0, 4, (12, 2), generator=generator)
    weights = torch.randint(1, 4, (12, 2), generator=generator) / 4  # many ties, broken by the earlier token
    perm = torch.randperm(12, generator=generator)
    for policy in ("probs", "position"):
        want = capacity_keep(index, weights, 4, 0.5, policy)
        got = capacity_keep(index[perm], weights[perm], 4, 0.5, policy, order=perm)
        assert torch.equal(got, want[perm]), policy
        assert not torch.equal(capacity_keep(index[perm], weights[perm], 4, 0.5, policy), want[perm]), policy


def no_rows_case(ep: int, tp: int) -> None:
    """Every route goes to the first ep rank's experts: the other ep ranks receive no rows at all, yet join every
    all-to-all (forward and backward) and give their experts zero grads, as the dense model's rows of them."""
    dims = setup_parallel(tp=tp, ep=ep)
    dense = build("mixtral")
    first_block = 4 // ep  # the experts of ep rank 0

    def to_first_block(module: torch.nn.Module, args: tuple) -> tuple:
        hidden, index, weights = args
        return hidden, index % first_block, weights

    model = meshpar.parallelize(copy.deepcopy(dense), {"tensor_parallel_size": tp, "expert_parallel_size": ep})
    for root in (dense, *model.local_modules()):
        for name, module in root.named_modules():
            if name.endswith("mlp.experts"):
                module.register_forward_pre_hook(to_first_block)
    data = batch("mixtral", rows=4)
    dense(**data).loss.backward()
    share = 4 // dims.dp
    mine = {k: v[dims.dp_rank * share : (dims.dp_rank + 1) * share] for k, v in data.items()}
    model.train_step(**mine)
    for module in model.local_modules():
        for name, param in module.named_parameters():
            want = local_slice(in_parameter_layout(dense.get_parameter(name).grad, module, name), param)
            torch.testing.assert_close(_local(param.grad), want, atol=1e-5, rtol=1e-4, msg=f"grad of {name}")


@pytest.mark.parametrize("ep,tp", [(2, 1), _slow(2, 2), _slow(4, 1)])
def test_ep_ranks_that_receive_no_rows_join_every_collective(ep: int, tp: int) -> None:
    run_distributed(no_rows_case, 4, ep, tp)


def generate_case(ep: int, tp: int, fsdp: bool = False, pp: int = 1) -> None:
    """Each dp replica decodes its own prompt for its own number of steps; the replicas of an ep group keep
    exchanging tokens until the longest is done (lockstep; under FSDP2 all dp replicas, which gather the weights
    together), and each one's tokens are the dense model's. Under pp the replicas' rows (2 and 3) share no
    microbatch count but one."""
    dims = setup_parallel(tp=tp, ep=ep, pp=pp)
    dense = build("mixtral")
    config = {"tensor_parallel_size": tp, "expert_parallel_size": ep, "fsdp": fsdp, "pipeline_parallel_size": pp}
    model = meshpar.parallelize(copy.deepcopy(dense), config)
    rows = 1 if pp == 1 else 2 + dims.dp_rank
    prompt = torch.randint(3, 64, (rows, 5 + dims.dp_rank), generator=torch.Generator().manual_seed(dims.dp_rank))
    kwargs = {"max_new_tokens": 3 + 2 * dims.dp_rank, "do_sample": False, "pad_token_id": 0}
    got = model.generate(prompt, **kwargs)
    torch.testing.assert_close(got, dense.generate(prompt, **kwargs), rtol=0, atol=0)


@pytest.mark.parametrize(
    "ep,tp,fsdp,pp",
    [(2, 1, False, 1), _slow(2, 2, False, 1), (1, 1, True, 1), _slow(2, 1, True, 1), (2, 1, False, 2), (1, 1, True, 2)],
)
def test_generation_under_expert_parallelism_runs_in_lockstep(ep: int, tp: int, fsdp: bool, pp: int) -> None:
    run_distributed(generate_case, 4, ep, tp, fsdp, pp)
