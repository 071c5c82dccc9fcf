"""``apex.transformer.amp``: apex's model-parallel grad scaler."""

from meshpar.compat.apex.amp.grad_scaler import GradScaler

__all__ = ["GradScaler"]
