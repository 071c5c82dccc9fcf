"""Test utilities: the multi-process gloo harness and dense-reference comparisons."""

from meshpar.testing._harness import DistributedPool, RankCrashedError, run_distributed
from meshpar.testing.memory import SavedForBackward
from meshpar.testing.reference import assert_matches_dense, expected_local, local, setup_parallel, shard_of

__all__ = [
    "DistributedPool",
    "RankCrashedError",
    "SavedForBackward",
    "assert_matches_dense",
    "expected_local",
    "local",
    "run_distributed",
    "setup_parallel",
    "shard_of",
]
