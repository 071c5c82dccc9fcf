"""HF models' own weight initialisation, for modules meshpar materialises from ``meta`` (:mod:`meshpar.materialize`)."""

from __future__ import annotations

import warnings

import torch
from torch import nn


def init_hf_weights(model: nn.Module) -> None:
    """Run the HF model's own initialisation on whatever ``model`` holds now (a whole model or a pipeline stage)."""
    for module in model.modules():
        if hasattr(module, "_is_hf_initialized"):
            del module._is_hf_initialized
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators")  # CPU meshes: replicas are synced
        if hasattr(model, "initialize_weights"):
            model.initialize_weights()
        else:  # older transformers
            model.apply(model._init_weights)
