"""NxD's runtime helpers in the view: ``parallel_layers.comm`` (collectives with torch_xla's signatures over process
groups and replica-group lists), ``parallel_layers.layers_utils`` (composed into a column-parallel linear autograd
function, equal to dense with sequence parallelism and with the asynchronous input-grad all-reduce),
``trainer.checkpoint_storage`` (the file-system backend, S3 refused) and the pipeline timeline
(``NxDPPModel(trace_file_path=...)`` writes a Chrome trace of every stage's steps)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from meshpar.testing import run_distributed
from tests.compat.test_nxd_trainer import Block, Net, S, V
from tests.seeds._dense import copy_dense_into


def comm_case() -> None:
    import torch.distributed as dist

    from meshpar.compat.nxd.parallel_layers import comm

    rank = dist.get_rank()
    pairs = [[0, 1], [2, 3]]
    mine = pairs[rank // 2]
    x = torch.arange(8.0).reshape(2, 4) + 10 * rank
    # all_reduce: in place, over the pair holding this rank
    bucket = [x.clone(), x.clone() * 2]
    comm.all_reduce("sum", bucket, groups=pairs)
    expected = sum(torch.arange(8.0).reshape(2, 4) + 10 * r for r in mine)
    torch.testing.assert_close(bucket[0], expected)
    torch.testing.assert_close(bucket[1], 2 * expected)
    peak = x.clone()
    comm.all_reduce("max", peak, groups=None)
    torch.testing.assert_close(peak, torch.arange(8.0).reshape(2, 4) + 30)
    # all_gather along dim 1 into a given output
    out = torch.empty(2, 8)
    comm.all_gather(x, dim=1, groups=pairs, output=out)
    torch.testing.assert_close(out, torch.cat([torch.arange(8.0).reshape(2, 4) + 10 * r for r in mine], dim=1))
    # reduce_scatter along dim 1 over the world, scaled
    world = torch.arange(16.0).reshape(2, 8) * (rank + 1)
    piece = comm.reduce_scatter("sum", world, scale=0.5, scatter_dim=1, shard_count=4, groups=None)
    full = torch.arange(16.0).reshape(2, 8) * 10 * 0.5
    torch.testing.assert_close(piece, full[:, 2 * rank : 2 * rank + 2])
    group = dist.new_group([0, 1, 2, 3])
    given = torch.empty(2, 2)
    comm.cpu_reduce_scatter("sum", world, 1, 1, None, group, given)
    torch.testing.assert_close(given, full[:, 2 * rank : 2 * rank + 2] * 2)
    with pytest.raises(ValueError, match="shard_count"):
        comm.reduce_scatter("sum", world, 1, 1, 2, None)
    with pytest.raises(RuntimeError, match="Cannot reduce"):
        comm.reduce_scatter("sum", torch.ones(3, 3), 1, 0, 4, None)


def test_nxd_comm_collectives() -> None:
    run_distributed(comm_case, 4)


def layers_utils_case(sequence_parallel: bool) -> None:
    """A column-parallel linear built from NxD's autograd steps equals dense: output, input grad, weight grad."""
    from meshpar.compat.nxd.parallel_layers import layers_utils as lu
    from meshpar.compat.nxd.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = parallel_state.get_tensor_model_parallel_rank()

    class Column(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            total = lu._linear_autograd_base_setup_fwd(ctx, x, weight, None, not sequence_parallel, sequence_parallel)
            return total @ weight.t()

        @staticmethod
        def backward(ctx, grad):
            total, weight, grad = lu._linear_autograd_base_setup_bwd(ctx, (grad,))
            grad_input = grad @ weight
            handle = lu._linear_autograd_bwd_grad_reduce(ctx, grad_input, grad_input.dtype)
            grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ total.reshape(-1, total.shape[-1])
            shard, grad_input = lu._linear_autograd_bwd_input_grad(ctx, grad_input, handle, grad_input.dtype)
            return (shard if sequence_parallel else grad_input), grad_weight

    torch.manual_seed(0)
    x, weight = torch.randn(8, 2, 6), torch.randn(10, 6)
    xd, wd = x.clone().requires_grad_(), weight.clone().requires_grad_()
    local_x = (x.chunk(2, dim=0)[rank] if sequence_parallel else x).clone().requires_grad_()
    local_w = weight.chunk(2, dim=0)[rank].clone().requires_grad_()
    out = Column.apply(local_x, local_w)
    ref = xd @ wd.t()
    torch.testing.assert_close(out, ref.chunk(2, dim=-1)[rank])
    grad = torch.randn_like(ref)
    out.backward(grad.chunk(2, dim=-1)[rank])
    ref.backward(grad)
    torch.testing.assert_close(local_x.grad, xd.grad.chunk(2, dim=0)[rank] if sequence_parallel else xd.grad)
    torch.testing.assert_close(local_w.grad, wd.grad.chunk(2, dim=0)[rank])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_nxd_layers_utils_compose_a_column_parallel_linear(sequence_parallel: bool) -> None:
    run_distributed(layers_utils_case, 2, sequence_parallel)


def test_nxd_filesystem_checkpoint_storage(tmp_path) -> None:
    from meshpar.compat.nxd.trainer import checkpoint_storage as cs

    storage = cs.create_checkpoint_storage(str(tmp_path))
    assert isinstance(storage, cs.FilesysCheckpointStorage) and storage.dirname() == str(tmp_path)
    storage.create_dir("step1/model")
    storage.save_object({"w": torch.ones(2)}, "step1/model/dp_rank_00.pt")
    storage.save_text("step1", "step1/done")
    storage.save_object({"w": torch.zeros(2)}, "step2/model/dp_rank_00.pt")  # parents made as needed
    os.utime(tmp_path / "step1" / "done", (1, 1))  # step1 completed first
    storage.save_text("step2", "step2/done")
    assert not any(name.startswith(".") for name in os.listdir(tmp_path / "step1" / "model"))  # no temporaries left
    torch.testing.assert_close(storage.load_object("step1/model/dp_rank_00.pt")["w"], torch.ones(2))
    assert storage.file_exists("step1/done") and storage.dir_exists("step2") and not storage.file_exists("step3/done")
    assert storage.list_completed_checkpoint_tags() == ["step1", "step2"]
    assert not storage.is_checkpoint_xser("step1")
    storage.remove_files(["step1/done", "missing"])
    storage.remove_dirs(["step2"])
    assert storage.list_completed_checkpoint_tags() == [] and not storage.dir_exists("step2")
    with pytest.raises(NotImplementedError, match="boto3"):
        cs.create_checkpoint_storage("s3://bucket/run")
    assert cs.MB == 1024**2

    class SlowDownError(Exception):
        def __init__(self) -> None:
            super().__init__("throttled")
            self.response = {"Error": {"Code": "SlowDown"}}

    assert cs.is_slow_down_error(SlowDownError()) and not cs.is_slow_down_error(ValueError("disk full"))
    assert cs.is_slow_down_error(RuntimeError("<Error><Code>RequestTimeout</Code></Error>"))
    wait = cs.wait_decrementing_with_jitter(max_sleep=10)
    assert all(1 <= wait(type("State", (), {"attempt_number": n})()) <= -(-10 // n) for n in (1, 3, 10))


def timeline_case(path: str) -> None:
    import meshpar.compat.nxd as nxd

    pipeline_config = {"transformer_layer_cls": Block, "num_microbatches": 2, "output_loss_value_spec": True,
                       "input_names": ["ids", "labels"], "trace_file_path": path}  # fmt: skip
    config = nxd.neuronx_distributed_config(tensor_parallel_size=2, pipeline_parallel_size=2,
                                            pipeline_config=pipeline_config)  # fmt: skip
    model = nxd.initialize_parallel_model(config, lambda: Net(parallel=True, layers=2))
    for _ in range(2):
        model.run_train(ids=torch.randint(0, V, (4, S)), labels=torch.randint(0, V, (4, S)))
    model.run_eval(ids=torch.randint(0, V, (4, S)), labels=torch.randint(0, V, (4, S)))


def test_nxd_pipeline_timeline(tmp_path) -> None:
    path = tmp_path / "trace.json"
    run_distributed(timeline_case, 4, str(path))
    events = json.loads(path.read_text().rstrip().rstrip(",") + "]")
    spans = [(e["pid"], e["name"], e["ph"]) for e in events]
    for stage in (0, 1):  # each pipeline stage's rank at tp rank 0, dp rank 0: two train steps and an eval step
        mine = [(name, phase) for pid, name, phase in spans if pid == stage]
        assert mine.count(("train_step", "B")) == 2 and mine.count(("train_step", "E")) == 2
        assert mine.count(("eval_step", "B")) == 1 and mine.count(("eval_step", "E")) == 1
    assert {pid for pid, _, _ in spans} == {0, 1}


def _zero1_setup(tmp: str):
    import meshpar.compat.nxd as nxd

    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=2, optimizer_config={"zero_one_enabled": True, "grad_clipping": False}
    )
    dense = Net(parallel=False, layers=2)

    def build() -> torch.nn.Module:
        module = Net(parallel=True, layers=2)
        copy_dense_into(module, dict(dense.named_parameters()))
        return module

    model = nxd.initialize_parallel_model(config, build)
    optimizer = nxd.initialize_parallel_optimizer(config, torch.optim.AdamW, model.parameters(), lr=1e-2)
    dense_optimizer = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    return nxd, model, optimizer, dense, dense_optimizer


def _step(model, optimizer, dense, dense_optimizer, seed: int) -> None:
    from meshpar.compat.nxd.parallel_layers import parallel_state

    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    torch.manual_seed(seed)
    ids, labels = torch.randint(0, V, (4, S)), torch.randint(0, V, (4, S))
    rows = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
    model.run_train(ids[rows], labels[rows])
    optimizer.step()
    optimizer.zero_grad()
    torch.stack([dense(ids[r * 4 // dp : (r + 1) * 4 // dp], labels[r * 4 // dp : (r + 1) * 4 // dp])
                 for r in range(dp)]).mean().backward()  # fmt: skip
    dense_optimizer.step()
    dense_optimizer.zero_grad()


def zero1_save_case(tmp: str) -> None:
    """tp 2 x dp 2 with ZeRO-1: two steps equal to dense, then an NxD checkpoint and the dense state beside it."""
    from tests.seeds._dense import assert_params_match

    nxd, model, optimizer, dense, dense_optimizer = _zero1_setup(tmp)
    for seed in (1, 2):
        _step(model, optimizer, dense, dense_optimizer, seed)
    assert_params_match(model, dict(dense.named_parameters()), atol=2e-5)
    nxd.save_checkpoint(tmp, "s2", model=model, optimizer=optimizer)
    if torch.distributed.get_rank() == 0:
        torch.save({"model": dense.state_dict(), "optimizer": dense_optimizer.state_dict()}, f"{tmp}/dense.pt")
    torch.distributed.barrier()


def zero1_resume_case(tmp: str, tag: str) -> None:
    """The checkpoint loads at another dp size and the next step equals the dense run's third."""
    from tests.seeds._dense import assert_params_match

    nxd, model, optimizer, dense, dense_optimizer = _zero1_setup(tmp)
    saved = torch.load(f"{tmp}/dense.pt", weights_only=False)
    dense.load_state_dict(saved["model"])
    dense_optimizer.load_state_dict(saved["optimizer"])
    nxd.load_checkpoint(tmp, tag=tag, model=model, optimizer=optimizer)
    assert_params_match(model, dict(dense.named_parameters()), atol=2e-5)
    _step(model, optimizer, dense, dense_optimizer, 3)
    assert_params_match(model, dict(dense.named_parameters()), atol=2e-5)


def test_nxd_zero1_checkpoint_loads_at_another_dp_size_and_converts(tmp_path) -> None:
    from meshpar.compat.nxd.optimizer import convert_zero_checkpoints as convert

    run_distributed(zero1_save_case, 4, str(tmp_path))  # tp 2 x dp 2
    run_distributed(zero1_resume_case, 2, str(tmp_path), "s2")  # tp 2 x dp 1: both dp ranks' shares read back
    tag = tmp_path / "s2"
    args = type("Args", (), {"input_dir": str(tag)})()
    assert convert.get_parallel_info(args) == (2, 2, 1) and not convert.is_full(args) and not convert.is_xser(args)
    full = tmp_path / "full"
    convert.main(["--input_dir", str(tag), "--output_dir", str(full), "--convert_to_full"])
    assert sorted(p.name for p in (full / "optim").iterdir()) == [f"full_tp_rank_0{t}_pp_rank_00.pt" for t in (0, 1)]
    merged = convert.merge_optim_dp_checkpoints(args, 0, 0)["state"]["state"]
    assert set(merged) == set(torch.load(full / "optim" / "full_tp_rank_00_pp_rank_00.pt",
                                         weights_only=False)["state"]["state"])  # fmt: skip
    # the full states in place of the dp files: the checkpoint still loads (and resumes) at dp 1
    for old in (tag / "optim").iterdir():
        old.unlink()
    for new in (full / "optim").iterdir():
        new.rename(tag / "optim" / new.name)
    run_distributed(zero1_resume_case, 2, str(tmp_path), "s2")
    with pytest.raises(ValueError, match="full optim states to full"):
        convert.main(["--input_dir", str(tag), "--output_dir", str(full), "--convert_to_full"])
    resharded = tmp_path / "dp4"
    convert.main(["--input_dir", str(tag), "--output_dir", str(resharded), "--convert_to_sharded", "--dp_size", "4"])
    assert len(list((resharded / "optim").iterdir())) == 8  # 4 dp x 2 tp files
