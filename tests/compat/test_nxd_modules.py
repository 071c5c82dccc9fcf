"""NxD's module paths under meshpar.compat.nxd are real modules, and what they add over meshpar's core behaves as
NxD's does: initialize_model_parallel's signature (context / expert sizes accepted at 1, refused above it), the
replica-group getters, the tracing leaf lists, the logger and cumsum."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from meshpar.testing import run_distributed

MODULES = [
    "parallel_layers",
    "parallel_layers.layers",
    "parallel_layers.parallel_state",
    "parallel_layers.mappings",
    "parallel_layers.random",
    "parallel_layers.grads",
    "parallel_layers.loss_functions",
    "parallel_layers.pad",
    "parallel_layers.utils",
    "parallel_layers.checkpointing",
    "pipeline",
    "pipeline.model",
    "pipeline.trace",
    "utils",
    "utils.logger",
    "utils.tensor_utils",
]


@pytest.mark.parametrize("module", MODULES)
def test_nxd_module_paths_are_modules(module: str) -> None:
    imported = importlib.import_module(f"meshpar.compat.nxd.{module}")
    assert imported.__name__ == f"meshpar.compat.nxd.{module}"


def state_case() -> dict:
    import torch.distributed as dist

    from meshpar.compat.nxd.parallel_layers import parallel_state

    refused = []
    refusals = ({"context_parallel_size": 2, "expert_model_parallel_size": 2}, {"expert_model_parallel_size": 4},
                {"lnc_size": 2})  # fmt: skip
    for kwargs in refusals:
        try:
            parallel_state.initialize_model_parallel(2, 1, **kwargs)
        except (NotImplementedError, ValueError) as error:  # ep 4 does not divide dp 2
            refused.append(str(error))
    parallel_state.initialize_model_parallel(2, 1, context_parallel_size=1, expert_model_parallel_size=1)
    result = {
        "refused": refused,
        "tp": parallel_state.get_tensor_model_parallel_replica_groups(),
        "dp": parallel_state.get_data_parallel_replica_groups(),
        "cp": (parallel_state.get_context_model_parallel_size(), parallel_state.get_context_model_parallel_rank()),
        "ep": (parallel_state.get_expert_model_parallel_size(), parallel_state.get_expert_data_parallel_size()),
        "message": parallel_state.rmsg("hello"),
        "objects": parallel_state.gather_python_object(dist.get_rank() * 10, parallel_state.get_world_group()),
    }
    parallel_state.destroy_model_parallel()
    return result


def test_nxd_parallel_state_signature_and_getters() -> None:
    results = run_distributed(state_case, 4)
    for rank, result in enumerate(results):
        assert len(result["refused"]) == 3 and "context and expert parallelism" in result["refused"][0], result[
            "refused"
        ]
        assert (
            "expert parallel size 4 does not divide" in result["refused"][1] and "lnc_size" in result["refused"][2]
        ), result["refused"]
        assert "parallelize(model" in result["refused"][0]  # where both run together
        assert result["tp"] == [[0, 1], [2, 3]] and result["dp"] == [[0, 2], [1, 3]]
        assert result["cp"] == (1, 0) and result["ep"] == (1, 2)
        assert result["message"].endswith(" hello") and f"rank_{rank}" in result["message"]
        assert result["objects"] == [0, 10, 20, 30]


def test_tracing_leaves_name_meshpars_parallel_modules_and_functions() -> None:
    from meshpar.compat.nxd import parallel_layers
    from meshpar.compat.nxd.parallel_layers.loss_functions import parallel_cross_entropy

    assert parallel_layers.ColumnParallelLinear in parallel_layers.PARALLEL_MODULES
    assert parallel_cross_entropy in parallel_layers.PARALLEL_FUNCTIONS


def test_cumsum_and_logger_behave_as_nxds(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshpar.compat.nxd.utils import logger, tensor_utils

    x = torch.randint(0, 5, (7, 3))
    torch.testing.assert_close(tensor_utils.cumsum(x), x.cumsum(0))
    with pytest.raises(NotImplementedError, match="dimension-0"):
        tensor_utils.cumsum(x, dim=1)
    monkeypatch.setenv("NXD_LOG_LEVEL", "warning")
    logger.get_log_level.cache_clear()  # read once and cached, as NxD's
    log = logger.get_logger("meshpar-nxd-test")
    assert log.level == logging.WARNING and log.name == "meshpar-nxd-test[0]" and not log.propagate
    monkeypatch.setenv("NXD_LOG_LEVEL", "loud")
    assert logger.get_log_level() == logging.WARNING
    logger.get_log_level.cache_clear()
    with pytest.raises(ValueError, match="NXD_LOG_LEVEL"):
        logger.get_log_level()
    monkeypatch.setenv("NXD_LOG_LEVEL", "off")
    logger.get_log_level.cache_clear()
    assert logger.get_logger("meshpar-nxd-test-off").disabled
    logger.get_log_level.cache_clear()


def test_nxd_logger_writes_on_global_rank_zero_alone_naming_the_caller(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Without a process group the launcher's RANK decides; the line names this file (the caller), not the
    wrapper; ``rank0_only=False`` writes on every rank."""
    from meshpar.compat.nxd.utils import logger

    monkeypatch.setenv("NXD_LOG_LEVEL", "info")
    logger.get_log_level.cache_clear()
    try:
        once, everywhere = logger.get_logger("meshpar-nxd-rank-test"), logger.get_logger("meshpar-nxd-rank-test", False)
        monkeypatch.setenv("RANK", "1")
        once.info("from rank one")
        everywhere.info("every rank")
        monkeypatch.setenv("RANK", "0")
        once.warning("from rank zero")
    finally:
        logger.get_log_level.cache_clear()
    out = capsys.readouterr().out
    assert "from rank one" not in out and "every rank" in out and "from rank zero" in out
    assert "test_nxd_modules.py" in out.splitlines()[-1]


def test_nxd_rotary_helpers_match_the_reference_formulations() -> None:
    """NxD's interleaved-pair rotation equals multiplying by e^(i angle) in complex numbers; its Llama 3.1 scaling
    keeps high frequencies, divides low ones by the factor and stays between the two; transformer_overrides'
    half-rotation equals transformers' Llama rotary embedding."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rotary

    from meshpar.compat.nxd.modules.attention.utils import (
        apply_rotary_polar_compatible,
        apply_scaling,
        precompute_freqs_cis,
    )
    from meshpar.compat.nxd.overrides.transformer_overrides import apply_rotary_pos_emb

    torch.manual_seed(0)
    b, s, h, d = 2, 7, 3, 8
    q, k = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    angles = precompute_freqs_cis(d, s, theta=500.0)
    assert angles.shape == (s, d // 2) and angles.dtype == torch.float32
    per_token = angles[torch.arange(s).expand(b, s)]  # [b, s, d / 2]: the table at each token's position
    q_rot, k_rot = apply_rotary_polar_compatible(q, k, per_token)
    torch.testing.assert_close(apply_rotary_polar_compatible(k, q, per_token)[0], k_rot)
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    expected = torch.view_as_real(torch.view_as_complex(q.reshape(b, s, h, d // 2, 2)) * rotation).reshape(q.shape)
    torch.testing.assert_close(q_rot, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        apply_rotary_polar_compatible(q, k, per_token.double())
    freqs = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    scaled = apply_scaling(freqs)
    wavelen = 2 * torch.pi / freqs
    torch.testing.assert_close(scaled[wavelen < 8192 / 4], freqs[wavelen < 8192 / 4])
    torch.testing.assert_close(scaled[wavelen > 8192], freqs[wavelen > 8192] / 8)
    assert bool(((scaled <= freqs) & (scaled >= freqs / 8)).all())
    cos, sin = torch.randn(s, d), torch.randn(s, d)
    positions = torch.arange(s).expand(b, s)
    q4, k4 = q.transpose(1, 2), k.transpose(1, 2)  # [b, h, s, d]
    ours = apply_rotary_pos_emb(q4, k4, cos, sin, positions, flash_attn=False)
    theirs = hf_rotary(q4, k4, cos[positions], sin[positions])
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])
