"""NxD's trainer API through the view against a dense single-process run: ``neuronx_distributed_config``,
``initialize_parallel_model`` (plain and pipelined), ``initialize_parallel_optimizer`` (with and without ZeRO-1,
param groups, clipping, sequence-parallel norms), a few training steps equal to dense (loss, and the parameters after
every step; in two layouts with the blocks recomputed in backward, ``activation_checkpoint_config``), the checkpoint
API (save / has / load / finalize, num_kept_ckpts, a save interrupted before its ``done`` marker, a layout mismatch
refused on every rank), and the GQA QKV layer against dense grouped-query attention projections."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshpar.testing import run_distributed
from tests.seeds._dense import assert_params_match, copy_dense_into

H, FF, V, S = 16, 32, 24, 8


class Block(nn.Module):
    def __init__(self, parallel: bool, sequence_parallel: bool = False) -> None:
        super().__init__()
        from meshpar.compat.nxd.modules.rms_norm import RMSNorm
        from meshpar.compat.nxd.parallel_layers import ColumnParallelLinear, RowParallelLinear

        self.sp = sequence_parallel
        self.norm = RMSNorm(H, sequence_parallel_enabled=sequence_parallel) if parallel else nn.RMSNorm(H, eps=1e-5)
        if parallel:
            self.up = ColumnParallelLinear(H, FF, gather_output=False, sequence_parallel_enabled=sequence_parallel,
                                           sequence_dimension=1 if sequence_parallel else None)  # fmt: skip
            self.down = RowParallelLinear(FF, H, input_is_parallel=True, sequence_parallel_enabled=sequence_parallel,
                                          sequence_dimension=1 if sequence_parallel else None)  # fmt: skip
        else:
            self.up, self.down = nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    """Embedding, blocks, head and the loss inside forward (NxD's model convention)."""

    def __init__(self, parallel: bool, layers: int = 4, sequence_parallel: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Block(parallel, sequence_parallel) for _ in range(layers))
        self.head = nn.Linear(H, V)
        self.sp = sequence_parallel

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.sp:
            from meshpar.compat.nxd.parallel_layers import mappings

            h = mappings.scatter_to_sequence_parallel_region(h, 1)
        for layer in self.layers:
            h = layer(h)
        if self.sp:
            from meshpar.compat.nxd.parallel_layers import mappings

            h = mappings.gather_from_sequence_parallel_region(h, 1, to_model_parallel=False)
        return F.cross_entropy(self.head(h).reshape(-1, V), labels.reshape(-1))


def _dense(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The dense model, its AdamW with the two decay groups and the step-decayed lr the parallel run uses."""
    dense = Net(parallel=False).to(device)
    decay = [p for n, p in dense.named_parameters() if "norm" not in n and "bias" not in n]
    no_decay = [p for n, p in dense.named_parameters() if "norm" in n or "bias" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2)  # fmt: skip
    return dense, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def _groups(model: nn.Module) -> list[dict]:
    return [{"params": [p for n, p in model.named_parameters() if "norm" not in n and "bias" not in n],
             "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if "norm" in n or "bias" in n],
             "weight_decay": 0.0}]  # fmt: skip


def _batch(seed: int, dp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Four sequences per dp rank (two microbatches of two at pp > 1)."""
    torch.manual_seed(seed)
    return torch.randint(0, V, (4 * dp, S)).to(device), torch.randint(0, V, (4 * dp, S)).to(device)


def _dense_step(dense: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                ids: torch.Tensor, labels: torch.Tensor, dp: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One dense step on the mean loss over the dp replicas and (at pp > 1) the two microbatches of each:
    ``(loss, grad norm before clipping)``."""
    pieces = [(ids[r * 4 + k * 2 : r * 4 + k * 2 + 2], labels[r * 4 + k * 2 : r * 4 + k * 2 + 2])
              for r in range(dp) for k in range(2)]  # fmt: skip
    loss = torch.stack([dense(i, lab) for i, lab in pieces]).mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.05)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.detach(), norm


def _config(tp: int, pp: int, zero1: bool, sequence_parallel: bool, checkpoint: bool = False) -> dict:
    """NxD's config for the run; ``checkpoint``: the blocks recomputed in backward (``"full"``: the pipeline's
    transformer layers, else named by class)."""
    import meshpar.compat.nxd as nxd

    pipeline_config = {"transformer_layer_cls": Block, "num_microbatches": 2, "output_loss_value_spec": True,
                       "input_names": ["ids", "labels"], "broadcast_and_average_loss": True,
                       "use_zero1_optimizer": zero1}  # fmt: skip
    return nxd.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_config=pipeline_config if pp > 1 else None,
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": True, "max_grad_norm": 0.05},
        sequence_parallel=sequence_parallel,
        activation_checkpoint_config=("full" if pp > 1 else [Block]) if checkpoint else None,
    )  # fmt: skip


def _train_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, pp: int) -> torch.Tensor:
    """This dp rank's four sequences through ``run_train``: the loss averaged over dp."""
    from meshpar.compat.nxd.parallel_layers import parallel_state

    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    mine = slice(4 * dp_rank, 4 * dp_rank + 4)
    if pp > 1:
        return model.run_train(ids=ids[mine], labels=labels[mine])
    loss = model.run_train(ids[mine], labels[mine]).detach().clone()
    torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss / dp


def train_case(tp: int, pp: int, zero1: bool, sequence_parallel: bool, tmp: str | None, dcp: bool = False,
               checkpoint: bool = False) -> None:  # fmt: skip
    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd import xla
    from meshpar.compat.nxd.parallel_layers import parallel_state
    from meshpar.compat.nxd.utils.activation_checkpoint import NxDCheckpointWrapper

    config = _config(tp, pp, zero1, sequence_parallel, checkpoint)
    device = xla.xla_device()  # the process's GPU where it has one (tests/compat/test_nxd_cuda.py), else the CPU
    dense, dense_optimizer, dense_scheduler = _dense(device)

    def build() -> nn.Module:
        module = Net(parallel=True, sequence_parallel=sequence_parallel)
        copy_dense_into(module, dict(dense.named_parameters()))
        return module

    model = nxd.initialize_parallel_model(config, build)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert blocks and all(isinstance(m, NxDCheckpointWrapper) == checkpoint for m in blocks)
    assert ("NxDCheckpointWrapperBlock(" in str(model)) == checkpoint  # a printed model shows the recomputed blocks
    optimizer = nxd.initialize_parallel_optimizer(config, torch.optim.AdamW, _groups(model), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    dp = parallel_state.get_data_parallel_size()
    for step in range(3):
        ids, labels = _batch(100 + step, dp, device)
        loss = _train_step(model, ids, labels, pp)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        dense_loss, dense_norm = _dense_step(dense, dense_optimizer, dense_scheduler, ids, labels, dp)
        torch.testing.assert_close(loss.reshape(()).cpu(), dense_loss.cpu(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(optimizer.grad_norm.reshape(()).cpu(), dense_norm.cpu(), atol=1e-5, rtol=1e-4)
        assert_params_match(model, dict(dense.named_parameters()), atol=2e-5)
    if tmp is None:
        return
    nxd.save_checkpoint(tmp, "step3", model=model, optimizer=optimizer, scheduler=scheduler, user_content={"step": 3},
                        use_zero1_dcp=dcp)  # fmt: skip
    assert nxd.has_checkpoint(tmp)
    assert os.path.isfile(os.path.join(tmp, "step3", "optim", ".metadata")) == dcp
    _resume_and_step(config, tmp, pp, sequence_parallel, dcp, dense, dense_optimizer, dense_scheduler, device)


def _resume_and_step(config: dict, tmp: str, pp: int, sequence_parallel: bool, dcp: bool, dense: nn.Module,
                     dense_optimizer: torch.optim.Optimizer, dense_scheduler: torch.optim.lr_scheduler.LRScheduler,
                     device: torch.device) -> None:  # fmt: skip
    """A fresh model / optimizer / scheduler loaded from ``tmp``'s step3 equal the dense ones, and one more step
    from there equals one more dense step."""
    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.parallel_layers import parallel_state

    fresh = nxd.initialize_parallel_model(config, lambda: Net(parallel=True, sequence_parallel=sequence_parallel))
    fresh_optimizer = nxd.initialize_parallel_optimizer(config, torch.optim.AdamW, _groups(fresh), lr=1e-2)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda step: 1.0 / (1 + step))
    content = nxd.load_checkpoint(tmp, model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler,
                                  use_zero1_dcp=dcp)  # fmt: skip
    nxd.finalize_checkpoint()
    assert content == {"step": 3} and fresh_scheduler.last_epoch == 3
    assert_params_match(fresh, dict(dense.named_parameters()), atol=2e-5)
    dp = parallel_state.get_data_parallel_size()
    ids, labels = _batch(7, dp, device)
    _train_step(fresh, ids, labels, pp)
    fresh_optimizer.step()
    _dense_step(dense, dense_optimizer, dense_scheduler, ids, labels, dp)
    assert_params_match(fresh, dict(dense.named_parameters()), atol=2e-5)


@pytest.mark.parametrize(
    "tp,pp,zero1,sequence_parallel,checkpoint",
    [(2, 1, False, False, False), (2, 1, False, True, True), (2, 2, False, False, True), (1, 2, True, False, False)],
)  # (2, 1, True, False) is the ZeRO-1 DCP test below; checkpoint: activation checkpointing of the blocks
def test_nxd_trainer_trains_like_dense_and_resumes(tp: int, pp: int, zero1: bool, sequence_parallel: bool,
                                                   checkpoint: bool, tmp_path) -> None:  # fmt: skip
    run_distributed(train_case, 4, tp, pp, zero1, sequence_parallel, str(tmp_path), checkpoint=checkpoint)


def zero1_dcp_other_dp_case(tmp: str) -> str:
    """A ZeRO-1 state saved with ``use_zero1_dcp`` at tp2 x dp2 (4 ranks): refused at tp1, loaded at tp2 x dp1 (2
    ranks), where one more step equals the dense run's fourth step. Returns the refusal."""
    from meshpar.checkpoint import CheckpointError
    from meshpar.compat.nxd import xla
    from meshpar.compat.nxd.parallel_layers import parallel_state

    device = xla.xla_device()
    dense, dense_optimizer, dense_scheduler = _dense(device)
    for step in range(3):  # the saving run's steps, at its dp size
        _dense_step(dense, dense_optimizer, dense_scheduler, *_batch(100 + step, 2, device), 2)
    import meshpar.compat.nxd as nxd

    config = _config(1, 1, True, False)
    model = nxd.initialize_parallel_model(config, lambda: Net(parallel=True))
    optimizer = nxd.initialize_parallel_optimizer(config, torch.optim.AdamW, _groups(model), lr=1e-2)
    with pytest.raises(CheckpointError, match="reshards across dp only") as refused:
        nxd.load_checkpoint(tmp, model=model, optimizer=optimizer, use_zero1_dcp=True)
    parallel_state.destroy_model_parallel()
    _resume_and_step(_config(2, 1, True, False), tmp, 1, False, True, dense, dense_optimizer, dense_scheduler, device)
    return str(refused.value)


def test_nxd_zero1_dcp_checkpoint_trains_resumes_and_loads_at_another_dp_size(tmp_path) -> None:
    run_distributed(train_case, 4, 2, 1, True, False, str(tmp_path), True)
    refusal = run_distributed(zero1_dcp_other_dp_case, 2, str(tmp_path))[0]
    assert "saved at tp 2, pp 1; this run is tp 1, pp 1" in refusal


def checkpoint_bookkeeping_case(tmp: str) -> list[str]:
    import os

    import meshpar.compat.nxd as nxd

    config = nxd.neuronx_distributed_config(tensor_parallel_size=2)
    model = nxd.initialize_parallel_model(config, lambda: Net(parallel=True, layers=1))
    assert not nxd.has_checkpoint(tmp)
    for step in range(3):
        nxd.save_checkpoint(tmp, f"step{step}", model=model, num_kept_ckpts=2)
    kept = sorted(d for d in os.listdir(tmp) if d.startswith("step"))
    with open(os.path.join(tmp, "newest")) as newest:
        assert kept == ["step1", "step2"] and newest.read() == "step2"
    # a save that died before its done marker: the newest complete tag still loads
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        os.makedirs(os.path.join(tmp, "step3", "model"))
    torch.distributed.barrier()
    assert nxd.load_checkpoint(tmp, model=model) is None
    errors = []
    for tag in ("step3", "missing"):
        try:
            nxd.load_checkpoint(tmp, tag=tag, model=model)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_nxd_checkpoint_bookkeeping(tmp_path) -> None:
    errors = run_distributed(checkpoint_bookkeeping_case, 4, str(tmp_path))[0]
    assert len(errors) == 2 and all("not a complete checkpoint" in e for e in errors)


def async_save_case(tmp: str) -> dict[str, object]:
    """NxD's asynchronous saving: a tag completes only at the next save / load / finalize, holds the state as it was
    when save_checkpoint returned (the parameters changed in place right after), a write failing on one rank raises
    on every rank (asynchronous and synchronous saves), and exit leaves a pending tag incomplete."""
    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.trainer import checkpoint

    rank = torch.distributed.get_rank()
    config = nxd.neuronx_distributed_config(tensor_parallel_size=2)
    model = nxd.initialize_parallel_model(config, lambda: Net(parallel=True, layers=1))
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen: dict[str, object] = {}
    nxd.save_checkpoint(tmp, "a", model=model, user_content={"step": 1}, async_save=True)
    seen["complete after async a"] = nxd.has_checkpoint(tmp)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next step changes the weights in place while "a" may still be writing
    nxd.save_checkpoint(tmp, "b", model=model, user_content={"step": 2}, async_save=True)
    seen["complete after async b"] = [t for t in ("a", "b") if os.path.exists(os.path.join(tmp, t, "done"))]
    nxd.finalize_checkpoint()
    seen["complete after finalize"] = [t for t in ("a", "b") if os.path.exists(os.path.join(tmp, t, "done"))]
    seen["user content of a"] = nxd.load_checkpoint(tmp, tag="a", model=model)
    seen["a holds the weights at its save"] = all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
    original = checkpoint._write

    def failing(path: object, payload: object) -> None:
        if torch.distributed.get_rank() == 1:
            raise OSError("disk full")
        original(path, payload)

    checkpoint._write = failing
    try:
        for tag, asynchronous in (("c", True), ("d", False)):
            try:
                nxd.save_checkpoint(tmp, tag, model=model, async_save=asynchronous)
                nxd.finalize_checkpoint()
            except RuntimeError as error:
                seen[f"error of {tag}"] = str(error)
    finally:
        checkpoint._write = original
    with open(os.path.join(tmp, "newest")) as newest:
        seen["newest after the failures"] = newest.read()
    nxd.save_checkpoint(tmp, "e", model=model, async_save=True)
    checkpoint.g_iostate.finalize_shutdown()  # what interpreter exit runs
    seen["interpreter active after exit"] = checkpoint.is_interpreter_active
    seen["e complete after exit"] = os.path.exists(os.path.join(tmp, "e", "done"))
    checkpoint.is_interpreter_active = True  # (this worker process runs other tests)
    torch.distributed.barrier()
    return seen if rank == 0 else {k: v for k, v in seen.items() if k.startswith("error")}


def test_nxd_asynchronous_saves_complete_later_and_fail_on_every_rank(tmp_path) -> None:
    results = run_distributed(async_save_case, 4, str(tmp_path))
    first = results[0]
    assert first["complete after async a"] is False
    assert first["complete after async b"] == ["a"] and first["complete after finalize"] == ["a", "b"]
    assert first["user content of a"] == {"step": 1} and first["a holds the weights at its save"]
    assert first["newest after the failures"] == "b"
    assert first["interpreter active after exit"] is False and first["e complete after exit"] is False
    for seen in results:  # every rank raised, naming the rank whose write failed
        for tag in ("c", "d"):
            assert "failed on rank 1: OSError: disk full" in seen[f"error of {tag}"], (tag, seen)


def other_layout_case(tmp: str, tp: int) -> None:
    import meshpar.compat.nxd as nxd

    config = nxd.neuronx_distributed_config(tensor_parallel_size=tp)
    model = nxd.initialize_parallel_model(config, lambda: Net(parallel=True, layers=1))
    if tp == 2:
        nxd.save_checkpoint(tmp, "t", model=model)
    else:
        nxd.load_checkpoint(tmp, model=model)


def test_nxd_checkpoint_at_another_layout_is_refused_on_every_rank(tmp_path) -> None:
    run_distributed(other_layout_case, 4, str(tmp_path), 2)
    with pytest.raises(AssertionError, match="reshard across dp only") as info:
        run_distributed(other_layout_case, 4, str(tmp_path), 4)
    assert str(info.value).count("ValueError: load_checkpoint failed on rank") == 4


def _kv_blocks(rank: int, tp: int, kv_heads: int, platform: str) -> list[int]:
    """The dense kv heads tp rank ``rank`` holds: its own share, or, replicated, one head: on Trn2 a head's copies
    sit on adjacent ranks, on Trn1 the whole set of heads is repeated (rank r holds head r % kv_heads)."""
    multiplier = max(1, tp // kv_heads)
    if multiplier == 1:
        per_rank = kv_heads // tp
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    return [rank % kv_heads] if platform == "trn1" else [rank // multiplier]


def gqa_case(fuse_qkv: bool, kv_heads: int, platform: str) -> None:
    """:func:`_gqa_case` with the platform that selects the kv replica layout (restored after: pooled workers serve
    later tests)."""
    with mock.patch.dict(os.environ, {"NEURON_PLATFORM_TARGET_OVERRIDE": platform}):
        _gqa_case(fuse_qkv, kv_heads, platform)


def _gqa_case(fuse_qkv: bool, kv_heads: int, platform: str) -> None:
    """q / k / v of GQAQKVColumnParallelLinear at tp=4 equal the dense projections' heads each rank holds in the
    platform's layout, and after a backward through a per-rank grouped product of them (each rank's query heads
    with its own kv heads: the model the layout trains, dense, pairs them the same way) the input grad, the weight
    grads and the bias grads are the dense ones of each rank's heads, on every replica of a kv head."""
    import torch.distributed as dist

    from meshpar.compat.nxd.modules.qkv_linear import GQAQKVColumnParallelLinear
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=4)
    rank, tp = parallel_state.get_tensor_model_parallel_rank(), 4
    group = parallel_state.get_tensor_model_parallel_group()
    heads, d = 8, 4
    multiplier = max(1, tp // kv_heads)
    torch.manual_seed(5)
    layer = GQAQKVColumnParallelLinear(
        H, [heads * d, kv_heads * d], bias=True, gather_output=False, keep_master_weight=True,
        kv_size_multiplier=multiplier, fuse_qkv=fuse_qkv,
    )  # fmt: skip
    if fuse_qkv:
        wq, wk, wv = layer.master_weight_qkv.split([heads * d, kv_heads * d, kv_heads * d])
    else:
        wq, wk, wv = layer.master_weight_q, layer.master_weight_k, layer.master_weight_v
    x = torch.randn(2, S, H, requires_grad=True)
    q, k, v = layer(x)
    my_kv = _kv_blocks(rank, tp, kv_heads, platform)
    q_rows, kv_rows = heads * d // tp, len(my_kv) * d
    biases = (
        layer.bias_qkv.split([q_rows, kv_rows, kv_rows]) if fuse_qkv else (layer.bias_q, layer.bias_k, layer.bias_v)
    )
    # the dense biases: q's gathered over tp, each kv head's from a rank holding it
    gathered = [[torch.empty_like(b) for _ in range(tp)] for b in biases]
    for parts, b in zip(gathered, biases, strict=True):
        dist.all_gather(parts, b.detach().contiguous(), group=group)
    holder = {h: (r, i) for r in reversed(range(tp)) for i, h in enumerate(_kv_blocks(r, tp, kv_heads, platform))}
    dense_bias = [torch.cat(gathered[0])] + [
        torch.cat([gathered[j][holder[h][0]][holder[h][1] * d : (holder[h][1] + 1) * d] for h in range(kv_heads)])
        for j in (1, 2)
    ]
    kv_cols = torch.cat([torch.arange(h * d, (h + 1) * d) for h in my_kv])
    with torch.no_grad():
        dense_q, dense_k, dense_v = (x @ w.t() + b for w, b in zip((wq, wk, wv), dense_bias, strict=True))
    torch.testing.assert_close(q, dense_q[..., rank * q_rows : (rank + 1) * q_rows])
    torch.testing.assert_close(k, dense_k[..., kv_cols])
    torch.testing.assert_close(v, dense_v[..., kv_cols])
    group_size = heads // tp // len(my_kv)
    k_heads = k.view(2, S, -1, d).repeat_interleave(group_size, dim=2)
    v_heads = v.view(2, S, -1, d).repeat_interleave(group_size, dim=2)
    (q.view(2, S, heads // tp, d) * k_heads * v_heads).sum().backward()
    # dense: query head h (on rank h // (heads / tp)) pairs with the kv head its rank holds for it
    q_per_rank = heads // tp
    kv_of_q = torch.tensor(
        [_kv_blocks(h // q_per_rank, tp, kv_heads, platform)[h % q_per_rank // group_size] for h in range(heads)]
    )
    x_d = x.detach().clone().requires_grad_()
    dense = [t.clone().requires_grad_() for t in (wq, wk, wv, *dense_bias)]
    qd, kd, vd = (x_d @ w.t() + b for w, b in zip(dense[:3], dense[3:], strict=True))
    kd = kd.view(2, S, kv_heads, d).index_select(2, kv_of_q)
    vd = vd.view(2, S, kv_heads, d).index_select(2, kv_of_q)
    (qd.view(2, S, heads, d) * kd * vd).sum().backward()
    torch.testing.assert_close(x.grad, x_d.grad, atol=1e-4, rtol=1e-4)
    if fuse_qkv:
        w_grads, b_grads = layer.weight_qkv.grad.split([q_rows, kv_rows, kv_rows]), layer.bias_qkv.grad.split(
            [q_rows, kv_rows, kv_rows])  # fmt: skip
    else:
        w_grads = (layer.weight_q.grad, layer.weight_k.grad, layer.weight_v.grad)
        b_grads = (layer.bias_q.grad, layer.bias_k.grad, layer.bias_v.grad)
    rows = [torch.arange(rank * q_rows, (rank + 1) * q_rows), kv_cols, kv_cols]
    for got_w, got_b, want_w, want_b, r in zip(w_grads, b_grads, dense[:3], dense[3:], rows, strict=True):
        torch.testing.assert_close(got_w, want_w.grad[r], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_b, want_b.grad[r], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "fuse_qkv,kv_heads,platform",
    [(True, 2, "trn2"), (False, 2, "trn2"), (True, 4, "trn2"), (False, 8, "trn2"), (True, 2, "trn1"),
     (False, 2, "trn1")],
)  # fmt: skip
def test_nxd_gqa_qkv_linear_equals_dense_heads(fuse_qkv: bool, kv_heads: int, platform: str) -> None:
    run_distributed(gqa_case, 4, fuse_qkv, kv_heads, platform)


class _QKV(nn.Module):
    """One GQAQKVColumnParallelLinear with 2 kv heads at tp 4 (each replicated on 2 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        from meshpar.compat.nxd.modules.qkv_linear import GQAQKVColumnParallelLinear

        self.qkv = GQAQKVColumnParallelLinear(H, [8 * 4, 2 * 4], bias=True, gather_output=False, kv_size_multiplier=2)


def kv_layout_checkpoint_case(tmp: str, saved_on: str, loaded_on: str, api: str) -> None:
    """Save the layer's shards with the ``saved_on`` platform's kv replica layout, load them with ``loaded_on``'s
    (through the trainer's or parallel_layers' checkpoints)."""
    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.parallel_layers import checkpointing

    for platform, save in ((saved_on, True), (loaded_on, False)):
        with mock.patch.dict(os.environ, {"NEURON_PLATFORM_TARGET_OVERRIDE": platform}):
            nxd.parallel_layers.parallel_state.destroy_model_parallel()
            config = nxd.neuronx_distributed_config(tensor_parallel_size=4)
            torch.manual_seed(3)
            model = nxd.initialize_parallel_model(config, _QKV)
            if api == "trainer":
                (nxd.save_checkpoint if save else nxd.load_checkpoint)(tmp, "t", model=model)
            elif save:
                checkpointing.save({"model": model.state_dict()}, tmp)
            else:
                checkpointing.load(tmp, model.module if hasattr(model, "module") else model)


@pytest.mark.parametrize("api", ["trainer", "parallel_layers"])
def test_nxd_checkpoint_of_another_kv_replica_layout_is_refused_on_every_rank(tmp_path, api: str) -> None:
    """The same keys and shapes, other heads: a Trn2-cut checkpoint loaded on Trn1's layout (and back) is refused on
    every rank, naming the variable that selects the layout; the same layout loads."""
    run_distributed(kv_layout_checkpoint_case, 4, str(tmp_path / "same"), "trn1", "trn1", api)
    for saved_on, loaded_on in (("trn2", "trn1"), ("trn1", "trn2")):
        with pytest.raises(AssertionError, match="NEURON_PLATFORM_TARGET_OVERRIDE=trn1") as info:
            run_distributed(kv_layout_checkpoint_case, 4, str(tmp_path / saved_on), saved_on, loaded_on, api)
        assert str(info.value).count("key / value replicas of GQAQKVColumnParallelLinear #0") >= 4, info.value


def kv_group_refusal_case(platform: str, sequential: bool, multiplier: int) -> None:
    from meshpar.compat.nxd.modules.qkv_linear import GQAQKVColumnParallelLinear
    from meshpar.compat.nxd.parallel_layers import parallel_state

    with mock.patch.dict(os.environ, {"NEURON_PLATFORM_TARGET_OVERRIDE": platform}):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=4)
        parallel_state.initialize_kv_group(multiplier, sequential_ranks_in_group=sequential)
        groups = parallel_state.get_kv_shared_replica_groups()
        GQAQKVColumnParallelLinear(H, [8 * 4, 4 // multiplier * 4], gather_output=False, kv_size_multiplier=multiplier)
        return groups


def test_nxd_kv_groups_follow_the_platform_and_other_groups_are_refused() -> None:
    """kv-shared groups of the platform's layout (as NxD's ``arrange_kv_groups``); adjacent groups made on Trn1 by
    ``sequential_ranks_in_group`` would sum different heads' grads in a layer's backward: refused on every rank; an
    unknown platform and one NxD lays no replicas out for are refused."""
    assert run_distributed(kv_group_refusal_case, 4, "trn1", False, 2)[0] == [[0, 2], [1, 3]]
    assert run_distributed(kv_group_refusal_case, 4, "trn2", False, 2)[0] == [[0, 1], [2, 3]]
    assert run_distributed(kv_group_refusal_case, 4, "trn2", True, 2)[0] == [[0, 1], [2, 3]]
    with pytest.raises(AssertionError, match="the kv-shared groups were made as") as info:
        run_distributed(kv_group_refusal_case, 4, "trn1", True, 2)
    assert str(info.value).count("ValueError: the kv-shared groups were made as") == 4
    with pytest.raises(AssertionError, match=r"NEURON_PLATFORM_TARGET_OVERRIDE='trn9'"):
        run_distributed(kv_group_refusal_case, 4, "trn9", False, 2)
    with pytest.raises(AssertionError, match=r"NotImplementedError: .* on trn3"):
        run_distributed(kv_group_refusal_case, 4, "trn3", False, 2)
    assert run_distributed(kv_group_refusal_case, 4, "trn3", False, 1)[0] == [[0], [1], [2], [3]]


def _init_own(module: nn.Module, device: torch.device) -> None:
    """NxD's param_init_fn(module, device): this module's own parameters, seeded by name and shape."""
    for name, param in module.named_parameters(recurse=False):
        generator = torch.Generator().manual_seed(len(name) * 31 + sum(param.shape))
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def meta_init_case() -> None:
    """model_init_config's meta_device_init: the model is built on meta, then every module re-initialised by
    param_init_fn on CPU, NxD's parallel attributes kept; without a param_init_fn a meta model is refused."""
    import meshpar.compat.nxd as nxd

    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=2, model_init_config={"meta_device_init": True, "param_init_fn": _init_own}
    )
    model = nxd.initialize_parallel_model(config, lambda: Net(parallel=True, layers=2))
    for name, param in model.named_parameters():
        assert not param.is_meta, name
        expected = torch.randn(param.shape, generator=torch.Generator().manual_seed(
            len(name.rsplit(".", 1)[-1]) * 31 + sum(param.shape))) * 0.1  # fmt: skip
        torch.testing.assert_close(param.detach(), expected, msg=name)
    assert model.module.layers[0].up.weight.tensor_model_parallel
    loss = model.run_train(torch.randint(0, V, (2, S)), torch.randint(0, V, (2, S)))
    assert torch.isfinite(loss)
    nxd.parallel_state.destroy_model_parallel()
    bare = nxd.neuronx_distributed_config(tensor_parallel_size=2)
    bare["model_init_config"]["meta_device_init"] = True
    with pytest.raises(ValueError, match="param_init_fn"):
        nxd.initialize_parallel_model(bare, lambda: Net(parallel=True, layers=1))


def test_nxd_meta_device_init() -> None:
    run_distributed(meta_init_case, 2)
