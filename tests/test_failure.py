"""One rank's exception stops every rank (meshpar.failure), in each collective phase: parallelize, a pipeline
schedule, a checkpoint save and a checkpoint load. Each case raises on one rank only; every rank must answer with an
error (the failing one its own, the others PeerFailedError naming it), and the harness must not report a rank that
never answered.

No wall-clock bound: a loaded machine may take any time. What proves the peers were released by the failure path,
not by gloo's timeout (10 minutes in the harness), is what they raise: a PeerFailedError naming the failing rank
comes only from a peer's abort closing the connection; a timeout would surface as gloo's "Timed out" error
instead."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import parallelize_module

import meshpar
from meshpar import checkpoint
from meshpar.compat.nxd.pipeline import NxDPPModel
from meshpar.testing import DistributedPool, RankCrashedError, run_distributed, setup_parallel
from tests._models import Block, PipeGPT, lm_loss, pipe_gpt_plan
from tests.hf._configs import batch, build

pytestmark = pytest.mark.slow  # not in make test-fast: each case rebuilds the process pool after an abort

WORLD = 4


class InjectedError(RuntimeError):
    pass


def _raise_on(rank: int, what: str):
    def side_effect(*args: object, **kwargs: object) -> None:
        raise InjectedError(f"injected failure on rank {rank} in {what}")

    return side_effect


def parallelize_case(failing: int) -> None:
    """tp2 x dp2 Qwen3 (a transformers-plan family: its plan is verified with a collective); one rank fails in the
    verification, the others then train."""
    model = build("qwen3")
    target = "meshpar.hf.parallelize.verify_plan"
    if dist.get_rank() == failing:
        with mock.patch(target, side_effect=_raise_on(failing, "parallelize")):
            meshpar.parallelize(model, {"tensor_parallel_size": 2})
    parallel = meshpar.parallelize(model, {"tensor_parallel_size": 2})
    parallel.train_step(**batch("qwen3"))


def schedule_case(failing: int) -> None:
    """tp2 x pp2 pipeline whose stage raises in its third microbatch on one rank (NxD's failing stage)."""
    dims = setup_parallel(tp=2, pp=2)
    torch.manual_seed(0)
    model = NxDPPModel(
        PipeGPT(layers=4),
        transformer_layer_cls=Block,
        num_microbatches=4,
        input_names=["ids"],
        loss_fn=lambda logits, ids, labels: lm_loss(logits, labels),
    )
    for chunk in model.chunks:
        parallelize_module(chunk.stage, dims.tp_mesh, pipe_gpt_plan())
    if dist.get_rank() == failing:
        calls = 0
        layer = next(m for m in model.chunks[0].stage.modules() if isinstance(m, Block))
        original = layer.forward

        def flaky(x: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise InjectedError(f"injected failure on rank {failing} in its third microbatch")
            return original(x)

        layer.forward = flaky
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    model.run_train(ids=ids, labels=ids)


def _small_model() -> torch.nn.Module:
    setup_parallel(tp=2)
    torch.manual_seed(0)
    return parallelize_module(PipeGPT(layers=2), meshpar.get_parallel().tp_mesh, pipe_gpt_plan())


def save_case(directory: str, failing: int) -> None:
    model = _small_model()
    checkpoint.save(directory, model, step=1)
    if dist.get_rank() == failing:
        with mock.patch("meshpar.checkpoint.dcp.save", side_effect=_raise_on(failing, "dcp.save (disk full)")):
            checkpoint.save(directory, model, step=2)
    else:
        checkpoint.save(directory, model, step=2)


def load_case(directory: str, failing: int) -> None:
    model = _small_model()
    if dist.get_rank() == failing:
        with mock.patch("meshpar.checkpoint.dcp.load", side_effect=_raise_on(failing, "dcp.load (read error)")):
            checkpoint.load(directory, model)
    else:
        checkpoint.load(directory, model)


def after_the_failed_save_case(directory: str) -> int:
    model = _small_model()
    return checkpoint.load(directory, model)["step"]


def _assert_every_rank_stopped(run: object, failing: int) -> None:
    with pytest.raises(AssertionError) as caught:
        run()
    report = str(caught.value)
    assert "no answer" not in report and "process died" not in report, report
    assert "Timed out" not in report, report  # released by gloo's timeout, not by the failure path
    per_rank = report.split("\nrank ")[1:]
    assert len(per_rank) == WORLD, report
    for text in per_rank:
        rank = int(text.split(":", 1)[0])
        if rank == failing:
            assert "InjectedError" in text and "every rank of the job was stopped" in text, text
        else:
            assert "PeerFailedError" in text and f"rank {failing} failed during" in text, text


@pytest.mark.parametrize("failing", [1, 2])
def test_a_failure_in_parallelize_stops_every_rank(failing: int) -> None:
    _assert_every_rank_stopped(lambda: run_distributed(parallelize_case, WORLD, failing), failing)


@pytest.mark.parametrize("failing", [0, 3])
def test_a_failing_stage_stops_every_rank(failing: int) -> None:
    _assert_every_rank_stopped(lambda: run_distributed(schedule_case, WORLD, failing), failing)


def test_a_failure_in_a_save_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    _assert_every_rank_stopped(lambda: run_distributed(save_case, WORLD, str(tmp_path), 2), 2)
    assert run_distributed(after_the_failed_save_case, WORLD, str(tmp_path)) == [1] * WORLD


def test_a_failure_in_a_load_stops_every_rank(tmp_path: Path) -> None:
    run_distributed(save_small_case, WORLD, str(tmp_path))
    _assert_every_rank_stopped(lambda: run_distributed(load_case, WORLD, str(tmp_path), 3), 3)


def save_small_case(directory: str) -> None:
    checkpoint.save(directory, _small_model(), step=1)


def native_abort_case() -> None:
    """Rank 1 dies in native code (an abort, as a heap-corruption check in malloc would); rank 0 returns."""
    if dist.get_rank() == 1:
        os.abort()


def test_a_rank_killed_in_native_code_is_reported_with_its_python_stack(capfd: pytest.CaptureFixture[str]) -> None:
    """The harness names the signal, and faulthandler puts the dead rank's Python stack in the captured stderr, so
    a crash in CI shows where it happened."""
    pool = DistributedPool(2)  # spawned here, so its ranks write to this test's captured stderr
    try:
        with pytest.raises(AssertionError) as caught:
            pool.run(native_abort_case)
    finally:
        pool.close(force=True)
    report = str(caught.value)
    assert "rank 1: the process died (killed by SIGABRT" in report, report
    assert "rank 0" not in report, report
    stderr = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in stderr and "native_abort_case" in stderr, stderr


def abort_once_case(marker: str) -> int:
    """Rank 1 aborts the first time only (the marker file remembers it across processes)."""
    if dist.get_rank() == 1 and not Path(marker).exists():
        Path(marker).touch()
        os.abort()
    return dist.get_rank()


def test_a_rank_crash_runs_once_more_in_fresh_processes_with_a_warning(tmp_path: Path) -> None:
    """A native crash in a long-lived worker reruns once, named in a warning; one that happens every time fails."""
    with pytest.warns(RuntimeWarning, match="rank 1: the process died \\(killed by SIGABRT"):
        assert run_distributed(abort_once_case, 2, str(tmp_path / "crashed")) == [0, 1]
    with pytest.raises(RankCrashedError, match="killed by SIGABRT"), pytest.warns(RuntimeWarning):
        run_distributed(native_abort_case, 2)


def leaky_patch_case() -> None:
    """A stub put in and not taken out: a function of a module and a method of a class."""
    from meshpar import context_parallel

    context_parallel.local_positions = lambda *args: None
    context_parallel._Shift.wait = lambda self: None


def unpatched_case() -> tuple[str, str]:
    from meshpar import context_parallel

    return context_parallel.local_positions.__name__, context_parallel._Shift.wait.__qualname__


def test_a_case_that_leaves_a_stub_in_a_worker_fails_and_the_worker_puts_it_back() -> None:
    """Workers serve many tests: a case that leaves meshpar code replaced fails on every rank, naming what it left,
    and the next case in the same workers sees the originals."""
    left = r"left \['meshpar.context_parallel.local_positions', 'meshpar.context_parallel._Shift.wait'\] replaced"
    with pytest.raises(AssertionError, match=left):
        run_distributed(leaky_patch_case, 2)
    assert run_distributed(unpatched_case, 2) == [("local_positions", "_Shift.wait")] * 2


def many_groups_case(count: int) -> tuple[int, int]:
    """Make ``count`` process groups (each keeps gloo transport threads alive in this worker); this worker's pid
    and thread count."""
    from meshpar.testing import _harness

    for _ in range(count):
        dist.new_group([0, 1])
    return os.getpid(), _harness._thread_count()


def pid_case() -> int:
    return os.getpid()


@pytest.mark.slow  # gloo groups take a while to make on a loaded machine
def test_workers_that_grew_many_threads_are_recycled_and_others_kept() -> None:
    """A case that leaves its workers holding many groups (and so many idle-polling threads) gets fresh workers for
    the next case; a case that makes none keeps its workers."""
    from meshpar.testing import _harness

    first = run_distributed(pid_case, 2)
    assert run_distributed(pid_case, 2) == first  # nothing grew: the same workers
    grown = run_distributed(many_groups_case, 2, _harness._RECYCLE_THREADS // 3 + 1)  # ~3 threads a group
    assert [pid for pid, _ in grown] == first
    assert all(threads > _harness._RECYCLE_THREADS for _, threads in grown), grown
    fresh = run_distributed(pid_case, 2)
    assert set(fresh).isdisjoint(first), (first, fresh)


def silent_peer_case() -> None:
    """Rank 1 fails before sending what rank 0 waits for (a case raising on one rank outside meshpar's failure
    paths: its peer is left in a receive that only gloo's timeout would end)."""
    if dist.get_rank() == 1:
        raise InjectedError("rank 1 failed before sending")
    dist.recv(torch.empty(1), src=1)


def test_a_rank_failing_while_a_lower_rank_waits_on_it_is_reported_without_waiting_out_the_answer_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The harness takes the ranks' answers as they come: rank 1's error is seen while rank 0 still waits in its
    receive, and from then on rank 0 has only the after-failure time (shortened here) to answer, not the answer
    time (an hour here: reading the ranks in order, the harness would wait it out, past pytest's per-test limit).
    The report quotes where rank 0 waits: its Python stacks, which it writes when asked."""
    from meshpar.testing import _harness

    monkeypatch.setattr(_harness, "_AFTER_FAILURE_TIMEOUT_S", 2.0)
    pool = DistributedPool(2)
    try:
        with pytest.raises(AssertionError) as caught:
            pool.run(silent_peer_case, timeout=3600.0)
    finally:
        pool.close(force=True)
    report = str(caught.value)
    assert "InjectedError: rank 1 failed before sending" in report, report
    assert "rank 0: no answer in time (hang or deadlock, after a failure); its Python stacks:" in report, report
    hung = report[report.index("rank 0:") : report.index("rank 1:")]  # reported in rank order
    assert "in silent_peer_case" in hung and "in recv" in hung, hung  # where it waits
