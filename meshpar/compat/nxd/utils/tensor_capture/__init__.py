"""``neuronx_distributed.utils.tensor_capture``: capture intermediate tensors of a model's forward for debugging and
accuracy checks (the outputs, optionally the inputs, of named modules, and tensors registered by hand)."""

from meshpar.compat.nxd.utils.tensor_capture.api import (
    disable_tensor_capture,
    enable_tensor_capture,
    get_available_modules,
    get_captured_tensors_dict,
    register_tensor,
)

__all__ = [
    "disable_tensor_capture",
    "enable_tensor_capture",
    "get_available_modules",
    "get_captured_tensors_dict",
    "register_tensor",
]
