"""``eval_loss`` evaluates without dropout and restores the mode; inputs meshpar cannot use get their own message on
every rank (float token ids, a batch with fewer rows than microbatches)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import meshpar
from meshpar.testing import run_distributed


def _gpt2_with_dropout() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)  # dropout 0.1 everywhere
    return GPT2LMHeadModel(config)


def eval_mode_case(layout: dict) -> dict:
    dense = _gpt2_with_dropout()
    parallel = meshpar.parallelize(copy.deepcopy(dense), layout)
    parallel.train()
    ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(2))
    losses = [parallel.eval_loss(input_ids=ids, labels=ids).item() for _ in range(2)]
    still_training = all(m.training for local in parallel.local_modules() for m in local.modules())
    dense.eval()
    return {"losses": losses, "dense": dense(input_ids=ids, labels=ids).loss.item(), "training": still_training}


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2, "num_microbatches": 2}])
def test_eval_loss_runs_without_dropout_and_restores_the_mode(layout: dict) -> None:
    for result in run_distributed(eval_mode_case, 2, layout):
        assert result["losses"][0] == result["losses"][1], result  # no dropout: the same loss twice
        assert abs(result["losses"][0] - result["dense"]) < 1e-5, result
        assert result["training"], "the model's training mode was not restored"


def bad_input_case(layout: dict, what: str) -> None:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    parallel = meshpar.parallelize(GPT2LMHeadModel(config), layout)
    ids = torch.randint(0, 64, (3, 8))
    if what == "float":
        parallel.train_step(input_ids=ids.float(), labels=ids)
    elif what == "unread":  # a tensor no pipeline stage is handed: refused, never dropped
        parallel.train_step(input_ids=ids[:2], labels=ids[:2], head_mask=torch.ones(2, 4))
    else:
        parallel.train_step(input_ids=ids, labels=ids)  # 3 rows, 4 microbatches


@pytest.mark.parametrize(
    ("layout", "what", "message"),
    [
        ({"tensor_parallel_size": 2}, "float", "input_ids must hold integer token ids"),
        ({"pipeline_parallel_size": 2, "num_microbatches": 4}, "rows", "fewer than num_microbatches=4"),
        ({"pipeline_parallel_size": 2}, "unread", "['head_mask']: pipeline stages are handed"),
    ],
)
def test_unusable_inputs_get_their_own_message_on_every_rank(layout: dict, what: str, message: str) -> None:
    with pytest.raises(AssertionError) as caught:
        run_distributed(bad_input_case, 2, layout, what)
    report = str(caught.value)
    for rank_report in report.split("\nrank ")[1:]:
        assert message in rank_report, report


def indivisible_sequence_case() -> str:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    parallel = meshpar.parallelize(GPT2LMHeadModel(config), {"tensor_parallel_size": 2, "sequence_parallel": True})
    ids = torch.randint(0, 64, (2, 17))
    try:
        parallel.train_step(input_ids=ids, labels=ids)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_sequence_parallelism_refuses_an_indivisible_sequence_naming_the_remedy() -> None:
    for message in run_distributed(indivisible_sequence_case, 2):
        assert "sequence length 17 is not a multiple of 2" in message and "pad_to_multiple_of=2" in message, message
