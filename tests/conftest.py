import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA")
    config.addinivalue_line("markers", "triton_interpret: runs Triton kernels in interpreter mode on CPU")
    config.addinivalue_line("markers", "slow: slower than a few seconds")
