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
