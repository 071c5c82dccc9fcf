"""DCP checkpoints: resharding across layouts, resume equivalence, crash safety, mismatch and corruption errors,
consolidated export/import."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import parallelize_module

from meshpar import checkpoint
from meshpar.compat.nxd.pipeline import NxDPPModel
from meshpar.data_parallel import allreduce_gradients
from meshpar.optim import DistributedOptimizer
from meshpar.parallel_dims import get_parallel
from meshpar.testing import DistributedPool, run_distributed, setup_parallel
from meshpar.testing.faults import KILL_POINTS
from meshpar.testing.faults import kill_at as kill_at_point
from tests._models import Block, PipeGPT, lm_loss, pipe_gpt_plan

GLOBAL_BATCH, SEQ, LAYERS = 8, 8, 4


def _batch(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return {
        "ids": torch.randint(0, 32, (GLOBAL_BATCH, SEQ), generator=generator),
        "labels": torch.randint(0, 32, (GLOBAL_BATCH, SEQ), generator=generator),
    }


def _build(tp: int, pp: int, zero1: bool) -> tuple[NxDPPModel, DistributedOptimizer]:
    dims = setup_parallel(tp=tp, pp=pp)
    torch.manual_seed(0)
    model = NxDPPModel(
        PipeGPT(layers=LAYERS),
        transformer_layer_cls=Block,
        num_microbatches=2,
        input_names=["ids"],
        broadcast_and_average_loss=True,
        loss_fn=lambda logits, ids, labels: lm_loss(logits, labels),
    )
    if tp > 1:
        for chunk in model.chunks:
            parallelize_module(chunk.stage, dims.tp_mesh, pipe_gpt_plan())
    optimizer = DistributedOptimizer(
        list(model.local_named_parameters()), torch.optim.AdamW, zero1=zero1, dims=dims, lr=1e-2, eps=1e-4
    )
    return model, optimizer


def _train(model: NxDPPModel, optimizer: DistributedOptimizer, steps: range) -> list[float]:
    dims = get_parallel()
    losses = []
    for step in steps:
        batch = _batch(step)
        rows = slice(dims.dp_rank * GLOBAL_BATCH // dims.dp, (dims.dp_rank + 1) * GLOBAL_BATCH // dims.dp)
        optimizer.zero_grad()
        loss = model.run_train(**{k: v[rows] for k, v in batch.items()})
        allreduce_gradients(model.local_parameters(), dims.dp_mesh)
        optimizer.step()
        if dims.dp > 1:
            dist.all_reduce(loss, group=dims.dp_mesh.get_group())
            loss /= dims.dp
        losses.append(loss.item())
    return losses


def train_case(tp: int, pp: int, start: int, stop: int, load_dir: str | None, save_dir: str | None) -> list[float]:
    model, optimizer = _build(tp, pp, zero1=True)
    if load_dir is not None:
        meta = checkpoint.load(load_dir, model.local_modules(), optimizer)
        assert meta["step"] == start and meta["extra"] == {"note": "hello"}
    losses = _train(model, optimizer, range(start, stop))
    if save_dir is not None:
        checkpoint.save(save_dir, model.local_modules(), optimizer, step=stop, extra={"note": "hello"})
    return losses


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    return run_distributed(train_case, 1, 1, 1, 0, 4, None, None)[0]


def test_save_at_tp2_pp2_then_load_at_three_other_layouts(tmp_path: Path, uninterrupted: list[float]) -> None:
    first = run_distributed(train_case, 4, 2, 2, 0, 2, None, str(tmp_path))[0]
    assert first == pytest.approx(uninterrupted[:2], abs=1e-5)
    for world, tp, pp in [(4, 4, 1), (4, 1, 2), (1, 1, 1)]:  # (tp=4), (pp=2, dp=2), one process
        resumed = run_distributed(train_case, world, tp, pp, 2, 4, str(tmp_path), None)[0]
        assert resumed == pytest.approx(uninterrupted[2:], abs=1e-5), (world, tp, pp)


def final_params_case(tmp: str) -> dict[str, torch.Tensor]:
    model, optimizer = _build(2, 1, zero1=True)
    checkpoint.load(tmp, model.local_modules(), optimizer)
    return {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in checkpoint.model_state_dict(model.local_modules()).items()
    }


@pytest.mark.slow  # fresh processes
def test_resume_in_new_processes_equals_uninterrupted_training(tmp_path: Path) -> None:
    straight, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    full = run_distributed(train_case, 4, 2, 1, 0, 10, None, str(straight))[0]
    first = run_distributed(train_case, 4, 2, 1, 0, 5, None, str(resumed_dir))[0]
    fresh = DistributedPool(4)  # brand-new processes for the second half
    try:
        second = fresh.run(train_case, 2, 1, 5, 10, str(resumed_dir), str(resumed_dir))[0]
    finally:
        fresh.close()
    assert first + second == pytest.approx(full, abs=1e-6)
    a = run_distributed(final_params_case, 4, str(straight))[0]
    b = run_distributed(final_params_case, 4, str(resumed_dir))[0]
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-6, msg=name)


def mismatch_case(tmp: str, layers: int, hidden: int) -> None:
    setup_parallel(tp=2)
    torch.manual_seed(0)
    model = parallelize_module(PipeGPT(layers=layers, hidden=hidden), get_parallel().tp_mesh, pipe_gpt_plan())
    checkpoint.load(tmp, model)


def save_small_case(tmp: str) -> None:
    setup_parallel(tp=2)
    torch.manual_seed(0)
    model = parallelize_module(PipeGPT(layers=2), get_parallel().tp_mesh, pipe_gpt_plan())
    checkpoint.save(tmp, model, step=1)


def test_mismatched_model_names_the_keys(tmp_path: Path) -> None:
    run_distributed(save_small_case, 2, str(tmp_path))
    with pytest.raises(AssertionError, match=r"missing keys \['layers.2.fc1.bias'"):
        run_distributed(mismatch_case, 2, str(tmp_path), 3, 16)
    with pytest.raises(AssertionError, match=r"unexpected keys \['layers.1.fc1.bias'"):
        run_distributed(mismatch_case, 2, str(tmp_path), 1, 16)
    with pytest.raises(
        AssertionError, match=r"shape mismatches \['tok.weight: checkpoint \(32, 16\) vs model \(32, 24\)"
    ):
        run_distributed(mismatch_case, 2, str(tmp_path), 2, 24)


def test_corrupt_or_incomplete_checkpoints_raise_clear_errors(tmp_path: Path) -> None:
    run_distributed(save_small_case, 2, str(tmp_path))
    step_dir = checkpoint.latest_checkpoint(tmp_path)
    data_file = next(p for p in step_dir.iterdir() if p.suffix == ".distcp")
    original = data_file.read_bytes()
    data_file.write_bytes(original[: len(original) // 2])
    with pytest.raises(AssertionError, match="is corrupt"):
        run_distributed(mismatch_case, 2, str(tmp_path), 2, 16)
    data_file.write_bytes(original)
    (step_dir / checkpoint.MANIFEST).unlink()
    with pytest.raises(AssertionError, match="is incomplete"):
        run_distributed(mismatch_case, 2, str(tmp_path), 2, 16)
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.load(tmp_path / "nowhere", PipeGPT(layers=2))


def _killable_saver(rank: int, port: int, root: str, ready: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    setup_parallel(tp=2)
    big = torch.nn.Linear(2048, 2048)  # ~16 MiB per save, slow enough to be killed mid-write
    torch.manual_seed(0)
    torch.nn.init.constant_(big.weight, 1.0)
    checkpoint.save(root, big, step=1)
    Path(ready).touch()
    for step in range(2, 1000):
        torch.nn.init.constant_(big.weight, float(step))
        checkpoint.save(root, big, step=step)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # fresh processes killed at random times
# seed 0 kills rank 0, seed 1 rank 1, each at a random time; a kill at each step of a save is a test of its own below
@pytest.mark.parametrize("seed", [0, 1])
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path: Path, seed: int) -> None:
    ready = tmp_path / "ready"
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_killable_saver, args=(r, port, str(tmp_path), str(ready))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.time() + 900  # minutes: a loaded machine starts processes slowly
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert ready.exists(), "the first checkpoint was never written"
    time.sleep(random.Random(seed).uniform(0.0, 1.5))
    os.kill(procs[seed % 2].pid, signal.SIGKILL)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    latest = checkpoint.latest_checkpoint(tmp_path)
    assert latest is not None
    assert checkpoint._verify_manifest(latest) is None
    step = int(latest.name.split("_")[1])
    model = torch.nn.Linear(2048, 2048)
    checkpoint.load(tmp_path, model)  # one process, no mesh: a plain load of the last complete checkpoint
    assert torch.equal(model.weight, torch.full_like(model.weight, float(step)))


def export_case(tmp: str, out: str) -> None:
    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    model = parallelize_module(PipeGPT(layers=2), dims.tp_mesh, pipe_gpt_plan())
    checkpoint.save(tmp, model, step=3)
    if dist.get_rank() == 0:
        checkpoint.export_consolidated(checkpoint.latest_checkpoint(tmp), out, config={"layers": 2})
    dist.barrier()
    reloaded = parallelize_module(PipeGPT(layers=2), dims.tp_mesh, pipe_gpt_plan())
    checkpoint.load_consolidated(out, reloaded)
    ids = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(reloaded(ids), model(ids))


def test_export_merged_safetensors_loads_into_dense_and_sharded_models(tmp_path: Path) -> None:
    out = tmp_path / "merged"
    run_distributed(export_case, 2, str(tmp_path / "ckpt"), str(out))
    from safetensors.torch import load_file

    dense = PipeGPT(layers=2)
    dense.load_state_dict(load_file(str(out / "model.safetensors")))
    torch.manual_seed(0)
    reference = PipeGPT(layers=2)
    ids = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(dense(ids), reference(ids))
    assert (out / "config.json").exists()


def _resave_and_die(root: str, value: float, kill_at: str) -> None:
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, value)
    with kill_at_point(kill_at):
        checkpoint.save(root, model, step=0)


def _loaded_weight(root: Path, **kwargs: int) -> float:
    model = torch.nn.Linear(4, 4)
    checkpoint.load(root, model, **kwargs)
    assert torch.all(model.weight == model.weight[0, 0])
    return model.weight[0, 0].item()


@pytest.mark.slow  # fresh processes killed at each step of the protocol
@pytest.mark.parametrize("kill_at", KILL_POINTS)
def test_a_kill_at_each_step_of_a_resave_keeps_a_complete_checkpoint(tmp_path: Path, kill_at: str) -> None:
    """Re-saving the same step (what save_parallelized's default step does) and dying by SIGKILL at each step of
    the protocol: ``latest`` always names a complete copy, the old one until the flip and the new one after it; the
    next save clears what the crash left."""
    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, 1.0)
    checkpoint.save(tmp_path, model, step=0)
    proc = mp.get_context("spawn").Process(target=_resave_and_die, args=(str(tmp_path), 2.0, kill_at))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == -signal.SIGKILL, proc.exitcode
    latest = checkpoint.latest_checkpoint(tmp_path)
    assert latest is not None and checkpoint._verify_manifest(latest) is None
    flipped = kill_at in ("pointed", "retired")
    assert _loaded_weight(tmp_path) == _loaded_weight(tmp_path, step=0) == (2.0 if flipped else 1.0)
    torch.nn.init.constant_(model.weight, 3.0)
    checkpoint.save(tmp_path, model, step=0)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and left[0] == "latest" and left[1].startswith("step_00000000"), left
    assert _loaded_weight(tmp_path) == _loaded_weight(tmp_path, step=0) == 3.0


def test_the_path_save_returns_loads(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, 5.0)
    path = checkpoint.save(tmp_path, model, step=7)
    assert _loaded_weight(path) == 5.0


def test_a_malformed_manifest_is_refused_on_every_rank(tmp_path: Path) -> None:
    run_distributed(save_small_case, 2, str(tmp_path))
    (checkpoint.latest_checkpoint(tmp_path) / checkpoint.MANIFEST).write_text("{}")
    with pytest.raises(AssertionError) as error:
        run_distributed(mismatch_case, 2, str(tmp_path), 2, 16)
    message = str(error.value)
    assert "no answer" not in message and message.count("has a malformed MANIFEST.json (KeyError") == 2, message


# -- the README's objects: meshpar.parallelize + DistributedOptimizer(model, ...) + checkpoint.save(dir, model, opt) --
HF_ROWS = 4


def _hf_batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (HF_ROWS, 12), generator=torch.Generator().manual_seed(500 + step))
    return {"input_ids": ids, "labels": ids}


def hf_train_case(
    layout: dict, optimizer_kw: dict, start: int, stop: int, load_dir: str | None, save_dir: str | None
) -> list[float]:
    """GPT-2 (tied embedding and LM head) trained with the README's calls; optionally resumed from / saved to a
    checkpoint of model and optimizer together."""
    import meshpar
    from tests.hf._configs import build

    model = meshpar.parallelize(build("gpt2", layers=2), {"num_microbatches": 2, **layout})
    optimizer = DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-4, **optimizer_kw)
    if load_dir is not None:
        assert checkpoint.load(load_dir, model, optimizer)["step"] == start
    dims = model.dims
    rows = slice(dims.dp_rank * HF_ROWS // dims.dp, (dims.dp_rank + 1) * HF_ROWS // dims.dp)
    losses = []
    for step in range(start, stop):
        optimizer.zero_grad()
        losses.append(model.train_step(**{k: v[rows] for k, v in _hf_batch(step).items()}).item())
        optimizer.step()
    if save_dir is not None:
        checkpoint.save(save_dir, model, optimizer, step=stop)
    return losses


def test_model_and_optimizer_reshard_together_from_the_readme_objects(tmp_path: Path) -> None:
    """Saved at tp2 x pp2 (pipeline stages, tied copies on two stages); resumed at tp4 (the pp=1 wrapper), at
    pp2 x dp2 with ZeRO-1, at tp2 x dp2 with FSDP and in one process: the next losses equal the continued run."""
    straight = run_distributed(hf_train_case, 1, {}, {}, 0, 4, None, None)[0]
    first = run_distributed(hf_train_case, 4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, {}, 0, 2,
                            None, str(tmp_path))[0]  # fmt: skip
    assert first == pytest.approx(straight[:2], abs=1e-5)
    for world, layout, optimizer_kw in [
        (4, {"tensor_parallel_size": 4}, {}),
        (4, {"pipeline_parallel_size": 2}, {"zero1": True}),
        (4, {"tensor_parallel_size": 2, "fsdp": True}, {}),
        (1, {}, {}),
    ]:
        resumed = run_distributed(hf_train_case, world, layout, optimizer_kw, 2, 4, str(tmp_path), None)[0]
        assert resumed == pytest.approx(straight[2:], abs=1e-5), (layout, optimizer_kw)


def optimizer_mismatch_case(directory: str, lr_groups: int) -> None:
    dims = setup_parallel(tp=2)
    torch.manual_seed(0)
    model = parallelize_module(PipeGPT(layers=2), dims.tp_mesh, pipe_gpt_plan())
    checkpoint.load(directory, model, DistributedOptimizer(model, torch.optim.AdamW, dims=dims, lr=1e-3))


def test_optimizer_state_is_checked_before_dcp_and_dcp_errors_are_exceptions(tmp_path: Path) -> None:
    run_distributed(save_small_case, 2, str(tmp_path))  # a model-only checkpoint
    with pytest.raises(AssertionError, match=r"no optimizer state \(it was saved without an optimizer\)"):
        run_distributed(optimizer_mismatch_case, 2, str(tmp_path), 1)
    model = torch.nn.Linear(4, 4)
    path = checkpoint.save(tmp_path / "one", model, step=1)
    next(p for p in path.iterdir() if p.suffix == ".distcp").write_bytes(b"garbage")
    (path / checkpoint.MANIFEST).unlink()  # no manifest to catch it: DCP itself fails
    try:
        checkpoint.load(path.parent, model, step=1)
    except Exception as error:
        assert isinstance(error, checkpoint.CheckpointError), type(error)
    else:
        raise AssertionError("a garbage checkpoint loaded")
