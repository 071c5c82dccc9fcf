"""``apex.transformer._data``: apex's Megatron-style batch samplers (:mod:`._batchsampler`)."""

from meshpar.compat.apex._data._batchsampler import MegatronPretrainingRandomSampler, MegatronPretrainingSampler

__all__ = ["MegatronPretrainingRandomSampler", "MegatronPretrainingSampler"]
