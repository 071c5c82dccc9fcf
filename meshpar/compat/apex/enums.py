"""``apex.transformer.enums``: the kinds apex's models and schedules are told about, with apex's values."""

import enum


class LayerType(enum.Enum):
    encoder = 1
    decoder = 2


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2


class ModelType(enum.Enum):
    """One stack of layers, or an encoder and a decoder (pipelines split at ``pipeline_model_parallel_split_rank``)."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2


__all__ = ["AttnMaskType", "AttnType", "LayerType", "ModelType"]
