"""Heads other than LM heads at dp=2 with padding that falls unevenly across replicas: token classifiers are
normalised over the global batch's scored tokens (loss, every grad, parameters after AdamW equal dense); heads that
keep the model's own per-row mean are exact with equal rows and refused otherwise, never averaged per replica."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    Qwen2Config,
    Qwen2ForTokenClassification,
)

import meshpar
from meshpar._compat import DTensor
from meshpar.testing import run_distributed

LR = 1e-2


def _bert(cls: type) -> torch.nn.Module:
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5,
    )  # fmt: skip
    return cls(config)


def _qwen2() -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_labels=5, classifier_dropout=0.0,
    )  # fmt: skip
    return Qwen2ForTokenClassification(config)


BUILDERS = {
    "bert_token": lambda: _bert(BertForTokenClassification),
    "qwen2_token": _qwen2,
    "bert_sequence": lambda: _bert(BertForSequenceClassification),
}


def _token_batch() -> dict[str, torch.Tensor]:
    """8 rows; the first replica's rows are mostly padding (-100), the second's mostly scored."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (8, 12), generator=generator)
    labels = torch.randint(0, 5, (8, 12), generator=generator)
    for row in range(4):
        labels[row, 2 + row :] = -100
    return {"input_ids": ids, "labels": labels}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def head_case(name: str, layout: dict) -> dict:
    torch.manual_seed(0)
    dense = BUILDERS[name]()
    parallel = meshpar.parallelize(copy.deepcopy(dense), layout)
    data = _token_batch()
    dims = parallel.dims
    mine = {k: v.chunk(dims.dp)[dims.dp_rank] for k, v in data.items()}
    optimizer = meshpar.DistributedOptimizer(parallel, torch.optim.AdamW, lr=LR)
    loss = parallel.train_step(**mine)
    grads = {n: _full(p.grad) for m in parallel.local_modules() for n, p in m.named_parameters() if p.grad is not None}
    optimizer.step()
    dense_loss = dense(**data).loss
    dense_loss.backward()
    worst_grad = max((g - dense.get_parameter(n).grad).abs().max().item() for n, g in grads.items())
    torch.optim.AdamW(dense.parameters(), lr=LR).step()
    worst_param = max(
        (_full(p) - dense.get_parameter(n)).abs().max().item()
        for m in parallel.local_modules()
        for n, p in m.named_parameters()
    )
    return {"loss": loss.item(), "dense": dense_loss.item(), "grad": worst_grad, "param": worst_param, "n": len(grads)}


@pytest.mark.parametrize("name", ["bert_token", "qwen2_token"])
@pytest.mark.parametrize("layout", [{"data_parallel_size": 2}, {"tensor_parallel_size": 2, "data_parallel_size": 2}])
def test_token_classification_at_dp2_equals_dense(name: str, layout: dict) -> None:
    world = layout.get("tensor_parallel_size", 1) * 2
    for result in run_distributed(head_case, world, name, layout):
        assert result["n"] > 0
        assert abs(result["loss"] - result["dense"]) < 1e-5, result
        assert result["grad"] < 1e-5, result
        assert result["param"] < 1e-4, result  # AdamW's first step: sign-like, rounding shows at 1e-5


def sequence_case(rows: tuple[int, int]) -> dict:
    torch.manual_seed(0)
    dense = _bert(BertForSequenceClassification)
    parallel = meshpar.parallelize(copy.deepcopy(dense), {"data_parallel_size": 2})
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (sum(rows), 10), generator=generator)
    labels = torch.randint(0, 5, (sum(rows),), generator=generator)
    start = 0 if parallel.dims.dp_rank == 0 else rows[0]
    stop = start + rows[parallel.dims.dp_rank]
    try:
        loss = parallel.train_step(input_ids=ids[start:stop], labels=labels[start:stop]).item()
    except ValueError as error:
        return {"refused": str(error)}
    return {"loss": loss, "dense": dense(input_ids=ids, labels=labels).loss.item()}


def test_sequence_classification_is_exact_with_equal_rows_and_refused_otherwise() -> None:
    for result in run_distributed(sequence_case, 2, (3, 3)):
        assert abs(result["loss"] - result["dense"]) < 1e-5, result
    for result in run_distributed(sequence_case, 2, (4, 2)):
        assert "replicas hold [4, 2] rows" in result["refused"], result


def pipelined_head_case(name: str) -> str:
    try:
        meshpar.parallelize(BUILDERS[name](), {"pipeline_parallel_size": 2, "num_microbatches": 2})
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_pipelines_refuse_classifier_heads_naming_the_head(name: str) -> None:
    for message in run_distributed(pipelined_head_case, 2, name):
        assert "causal and masked LM heads only" in message and "head" in message, message
