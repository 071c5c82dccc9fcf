"""The tp, cp and pp ranks of one dp replica must be handed the same batch (each computes its part of it): a batch
that differs between them is refused on every rank, before anything runs, and the job stays usable; dp replicas
differ, as they should."""

from __future__ import annotations

import pytest
import torch

import meshpar
from meshpar._same_batch import batch_fingerprint
from meshpar.testing import run_distributed, setup_parallel
from tests.hf._configs import batch, build


def test_fingerprints_see_every_element_name_shape_and_dtype() -> None:
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.bool)
    embeds = torch.randn(2, 8, 4, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    base = batch_fingerprint({"input_ids": ids, "attention_mask": mask, "inputs_embeds": embeds})
    assert base == batch_fingerprint({"inputs_embeds": embeds.clone(), "attention_mask": mask, "input_ids": ids + 0})
    swapped = ids.clone()
    swapped[0, 1], swapped[0, 2] = ids[0, 2], ids[0, 1]
    changed = mask.clone()
    changed[1, 7] = False
    nudged = embeds.clone()
    nudged.view(torch.int16)[1, 3, 2] += 1  # the next bf16 value
    variants = [
        {"input_ids": swapped, "attention_mask": mask, "inputs_embeds": embeds},  # same values, another order
        {"input_ids": ids, "attention_mask": changed, "inputs_embeds": embeds},
        {"input_ids": ids, "attention_mask": mask, "inputs_embeds": nudged},  # one bf16 element, one ulp
        {"input_ids": ids.reshape(4, 4), "attention_mask": mask, "inputs_embeds": embeds},
        {"input_ids": ids.int(), "attention_mask": mask, "inputs_embeds": embeds},
        {"labels": ids, "attention_mask": mask, "inputs_embeds": embeds},
    ]
    fingerprints = [batch_fingerprint(v) for v in variants]
    assert all(f != base for f in fingerprints), fingerprints
    assert 0 <= int(base) < 2**61


def mismatched_batch_case(tp: int, cp: int, pp: int, skew: str) -> str:
    """One train_step where ``skew`` names the ranks handed a changed batch; returns what happened, then checks the
    job still trains with equal batches."""
    dims = setup_parallel(tp=tp, cp=cp, pp=pp)
    config = {"tensor_parallel_size": tp, "context_parallel_size": cp, "pipeline_parallel_size": pp}
    model = meshpar.parallelize(build("llama"), config)
    data = batch("llama", rows=2 * dims.dp)
    mine = {k: v[2 * dims.dp_rank : 2 * dims.dp_rank + 2].clone() for k, v in data.items()}
    ranks = {"tp": dims.tp_rank, "cp": dims.cp_rank, "dp": dims.dp_rank, "pp": dims.pp_rank}
    if skew != "none" and ranks[skew] == 1:
        mine["labels"][1, 5] = -100
    try:
        model.train_step(**mine)
        outcome = "ran"
    except ValueError as error:
        outcome = str(error)
    equal = {k: v[2 * dims.dp_rank : 2 * dims.dp_rank + 2] for k, v in data.items()}
    assert torch.isfinite(model.train_step(**equal))  # a refusal every rank shares leaves the job usable
    return outcome


@pytest.mark.parametrize(
    "tp,cp,pp,skew,refused",
    [(2, 1, 1, "tp", True), (1, 2, 1, "cp", True), (1, 1, 2, "pp", True), (2, 1, 1, "dp", False),
     (2, 2, 1, "none", False), (2, 1, 2, "none", False)],
    ids=["tp2-tp-ranks-differ", "cp2-cp-ranks-differ", "pp2-stages-differ", "tp2xdp2-replicas-differ",
         "tp2xcp2-equal", "tp2xpp2-equal"],
)  # fmt: skip
def test_a_batch_that_differs_inside_a_replica_is_refused_on_every_rank(
    tp: int, cp: int, pp: int, skew: str, refused: bool
) -> None:
    outcomes = run_distributed(mismatched_batch_case, 4, tp, cp, pp, skew)
    if refused:
        assert all("were given different batches" in o and "shard the data over dp only" in o for o in outcomes)
        assert all("(dp rank 0)" in o or "(dp rank 0, dp rank 1)" in o for o in outcomes), outcomes
    else:
        assert outcomes == ["ran"] * 4, outcomes


def test_fingerprints_of_tensors_larger_than_a_chunk_see_every_element_and_the_chunks_order(monkeypatch) -> None:
    import meshpar._same_batch as same_batch

    monkeypatch.setattr(same_batch, "_CHUNK", 8)  # 29 elements: four chunks, the last one short
    ids = torch.arange(29) * 7 % 11
    base = batch_fingerprint({"input_ids": ids})
    assert base == batch_fingerprint({"input_ids": ids.clone()})
    last = ids.clone()
    last[-1] += 1
    swapped_chunks = torch.cat([ids[8:16], ids[:8], ids[16:]])
    assert batch_fingerprint({"input_ids": last}) != base
    assert batch_fingerprint({"input_ids": swapped_chunks}) != base
