"""Dropout in replicated vs sharded tp regions, reproducibility and activation checkpointing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import meshpar
from meshpar import get_rng_tracker
from meshpar.testing import run_distributed, setup_parallel


def dropout_case() -> dict:
    setup_parallel(tp=2, seed=7)
    x = torch.ones(64)
    replicated = F.dropout(x, 0.5)
    with get_rng_tracker().fork():
        sharded = F.dropout(x, 0.5)
    replicated_after = F.dropout(x, 0.5)
    setup_parallel(tp=2, seed=7)
    again = F.dropout(x, 0.5)
    with get_rng_tracker().fork():
        sharded_again = F.dropout(x, 0.5)
    return {
        "replicated": replicated,
        "sharded": sharded,
        "replicated_after": replicated_after,
        "reproducible": torch.equal(again, replicated) and torch.equal(sharded_again, sharded),
    }


def test_replicated_regions_agree_sharded_regions_differ_and_seed_reproduces() -> None:
    r0, r1 = run_distributed(dropout_case, 2)
    assert torch.equal(r0["replicated"], r1["replicated"])
    assert torch.equal(r0["replicated_after"], r1["replicated_after"])  # the fork does not disturb the default stream
    assert not torch.equal(r0["sharded"], r1["sharded"])
    assert r0["reproducible"] and r1["reproducible"]


def checkpoint_case() -> bool:
    setup_parallel(tp=2, seed=3)
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(4, 32)

    def block(inp: torch.Tensor) -> torch.Tensor:
        h = F.dropout(inp @ w, 0.3)
        with get_rng_tracker().fork():
            h = F.dropout(h, 0.3)
        return h.tanh()

    states = get_rng_tracker().get_states()
    cpu_state = torch.get_rng_state()
    block(x).sum().backward()
    plain = w.grad.clone()
    w.grad = None
    get_rng_tracker().set_states(states)
    torch.set_rng_state(cpu_state)
    meshpar.activation_checkpoint(block, x).sum().backward()
    return torch.equal(plain, w.grad)


def test_activation_checkpointing_replays_tp_dropout_masks() -> None:
    assert run_distributed(checkpoint_case, 2) == [True, True]
