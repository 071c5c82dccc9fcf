"""The OSLO pipeline tutorial, ported (imports changed, a tiny GPT-2 from a config), against one dense process:
the tutorial's config dict, the generator forward, ``save_parallelized``
with ``save_pretrained``'s argument name, ``from_parallelized``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.optim import Adam
from transformers import GPT2Config, GPT2LMHeadModel

from meshpar.compat import oslo
from meshpar.testing import run_distributed
from tests.seeds._dense import full


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def tutorial_case(config: dict, tmp: str) -> None:
    model = _gpt2()
    dense = copy.deepcopy(model)
    optimizer = Adam(model.parameters(), lr=3e-3)  # as the tutorial: before initialize
    model = oslo.initialize(model, config=config)
    torch.manual_seed(1)
    input_batch = {"input_ids": torch.randint(0, 64, (4, 8)), "attention_mask": torch.ones(4, 8, dtype=torch.long)}
    for _ in range(2):
        optimizer.zero_grad()
        for out in model(**input_batch, labels=input_batch["input_ids"]):
            loss = out.loss
            loss.backward()
        optimizer.step()
    dense_optimizer = Adam(dense.parameters(), lr=3e-3)
    for _ in range(2):
        dense_optimizer.zero_grad()
        dense_loss = dense(**input_batch, labels=input_batch["input_ids"]).loss
        dense_loss.backward()
        dense_optimizer.step()
    torch.testing.assert_close(loss.detach(), dense_loss.detach(), atol=1e-5, rtol=1e-5)
    reference = dict(dense.named_parameters(remove_duplicate=False))  # lm_head.weight: on the last stage
    for module in model.local_modules():
        for name, param in module.named_parameters():
            value = full(param.detach())
            torch.testing.assert_close(value.reshape(reference[name].shape), reference[name], atol=1e-4, rtol=1e-4)
    model.save_parallelized(save_directory=f"{tmp}/parallel_ckpt")
    again = oslo.initialize(_gpt2(), config=config).from_parallelized(f"{tmp}/parallel_ckpt")
    torch.testing.assert_close(again.eval_loss(labels=input_batch["input_ids"], **input_batch),
                               dense(**input_batch, labels=input_batch["input_ids"]).loss.detach(),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [
        {"model_parallelism": {"enable": True, "pipeline_parallel_size": 2}},  # the tutorial's dict: pp2 x dp2
        {"model_parallelism": {"enable": True, "tensor_parallel_size": 2}},  # tp2 x dp2
        {"model_parallelism": {"enable": True, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}},
    ],
)
def test_tutorial_training_matches_dense(config: dict, tmp_path) -> None:
    run_distributed(tutorial_case, 4, config, str(tmp_path))


def generate_case(config: dict) -> list[list[int]]:
    """The tutorial's ``generate`` calls: greedy, beam search (num_beams=3) and sampling, against the dense model
    (the same seed for sampling), and greedy from a single prompt."""
    dense = _gpt2().eval()
    model = oslo.initialize(_gpt2().eval(), config=config)
    prompt = torch.randint(0, 63, (2, 5), generator=torch.Generator().manual_seed(3))  # 63: the pad token
    for kwargs in ({}, {"num_beams": 3}, {"do_sample": True, "top_k": 8}):
        torch.manual_seed(7)
        expected = dense.generate(prompt, max_new_tokens=6, pad_token_id=63, **kwargs)
        torch.manual_seed(7)
        got = model.generate(prompt, max_new_tokens=6, pad_token_id=63, **kwargs)
        assert torch.equal(got.cpu(), expected), (kwargs, got, expected)
    # one prompt: fewer rows than pipeline stages (the tutorial's config sets no microbatch count)
    single = model.generate(prompt[:1], max_new_tokens=4, pad_token_id=63)
    assert torch.equal(single.cpu(), dense.generate(prompt[:1], max_new_tokens=4, pad_token_id=63)), single
    return got.tolist()


@pytest.mark.parametrize(
    "config",
    [
        {"model_parallelism": {"enable": True, "pipeline_parallel_size": 2}},
        {"model_parallelism": {"enable": True, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}},
    ],
)
def test_generate_across_pipeline_stages_matches_dense(config: dict) -> None:
    results = run_distributed(generate_case, 4, config)
    assert all(r == results[0] for r in results)  # every rank returns the driver's sequences
