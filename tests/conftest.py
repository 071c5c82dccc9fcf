import os

import pytest
import torch

# Triton decides between compiled and interpreted kernels when they are defined, so the interpreter must be chosen
# before meshpar.ops is imported. Without CUDA every Triton kernel test runs interpreted on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA")
    config.addinivalue_line("markers", "triton_interpret: runs Triton kernels in interpreter mode on CPU")
    config.addinivalue_line("markers", "slow: left out of make test-fast (fresh processes, compile, every family)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier leaves out torch.compile: every test whose name or ``compile`` parameter says it compiles is
    slow."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if "compile" in item.originalname or (callspec is not None and callspec.params.get("compile")):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _no_distributed_state_left_behind(request: pytest.FixtureRequest):
    """Fail the test that leaves a process group or meshpar's parallel state in pytest's own process (building an
    NxD or apex parallel layer there sets up a one-process one): later in-process tests would otherwise fail far
    from the cause. The state is torn down first, so that they do not."""
    yield
    import torch.distributed as dist

    from meshpar import parallel_dims

    left = [
        what
        for what, present in (
            ("a torch.distributed process group", dist.is_available() and dist.is_initialized()),
            ("meshpar's parallel state", parallel_dims.is_initialized()),
        )
        if present
    ]
    if left:
        parallel_dims.destroy_parallel(destroy_process_group=True)
        pytest.fail(
            f"{request.node.nodeid} left {' and '.join(left)} in pytest's own process: run what builds parallel "
            "layers or process groups with meshpar.testing.run_distributed, or tear it down at the end of the test"
        )
