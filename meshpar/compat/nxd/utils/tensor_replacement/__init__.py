"""``neuronx_distributed.utils.tensor_replacement``: replace (teacher-force) the outputs of named modules with given
tensors where a mask says so, during one forward."""

from meshpar.compat.nxd.utils.tensor_replacement.model_modification import (
    modify_model_for_tensor_replacement,
    patch_forward_with_additional_args,
)

__all__ = ["modify_model_for_tensor_replacement", "patch_forward_with_additional_args"]
