"""apex get_forward_backward_func and NxD NxDPPModel on meshpar's executor vs the dense model."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from meshpar.compat.apex import parallel_state as apex_state
from meshpar.compat.apex.pipeline_parallel import get_forward_backward_func
from meshpar.compat.nxd.pipeline import NxDPPModel
from meshpar.data_parallel import apply_fsdp
from meshpar.parallel_dims import get_parallel
from meshpar.pipeline import StageChunk, split_model
from meshpar.testing import assert_matches_dense, run_distributed, setup_parallel
from tests._models import Block, PipeGPT, lm_loss, pipe_gpt_plan


def _batch(m: int, seq: int = 8, per_mb: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {"ids": torch.randint(0, 32, (m * per_mb, seq)), "labels": torch.randint(0, 32, (m * per_mb, seq))}


def _dense(layers: int, microbatches: list[dict]) -> tuple[PipeGPT, list[torch.Tensor]]:
    torch.manual_seed(0)
    dense = PipeGPT(layers=layers)
    losses = [lm_loss(dense(mb["ids"]), mb["labels"]) for mb in microbatches]
    torch.stack(losses).mean().backward()
    return dense, [loss.detach() for loss in losses]


def _check_grads(modules, dense: PipeGPT) -> None:
    dense_params = dict(dense.named_parameters())
    for module in modules:
        for name, param in module.named_parameters():
            assert_matches_dense(param.grad, dense_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)


class PerChunkMicrobatches:
    """apex hands a batch that is not a list of tensors to every forward_step_func call unchanged: here one source
    of variable-length microbatches, drawn in order per model chunk (as Megatron's per-chunk data iterators)."""

    def __init__(self, microbatches: list[dict]) -> None:
        self.microbatches, self.drawn = microbatches, {}

    def next_for(self, chunk: StageChunk) -> dict:
        index = self.drawn.get(chunk.stage_index, 0)
        self.drawn[chunk.stage_index] = index + 1
        return self.microbatches[index]


def forward_step(microbatch, model: StageChunk):
    if isinstance(microbatch, PerChunkMicrobatches):
        microbatch = microbatch.next_for(model)
    ids, labels = (microbatch["ids"], microbatch["labels"]) if isinstance(microbatch, dict) else microbatch
    out = model(ids=ids)
    return out, lambda logits: lm_loss(logits, labels)


def apex_case(pp: int, tp: int, v: int, m: int, layers: int, variable_seq: bool, deallocate: bool) -> None:
    dims = setup_parallel(tp=tp, pp=pp)
    if v > 1:
        dims.virtual_pipeline_size = v
        apex_state.set_virtual_pipeline_model_parallel_rank(0)
    microbatches = (
        [_batch(1, seq=4 + 2 * (i % 3)) for i in range(m)]
        if variable_seq
        else [{k: t.chunk(m)[i] for k, t in _batch(m).items()} for i in range(m)]
    )
    dense, expected = _dense(layers, microbatches)
    torch.manual_seed(0)
    stages, _ = split_model(
        PipeGPT(layers=layers), dims.pp_rank, pp, transformer_layer_cls=Block, virtual_pipeline_size=v
    )
    if tp > 1:
        stages = [(i, parallelize_module(s, dims.tp_mesh, pipe_gpt_plan())) for i, s in stages]
    chunks = [StageChunk(s, i, ["ids"]) for i, s in stages]
    fn = get_forward_backward_func(v if v > 1 else None, pp)
    model = chunks if v > 1 else chunks[0]
    if variable_seq:
        batch = PerChunkMicrobatches(microbatches)
    else:  # apex's minibatch: a list of tensors the schedule splits into m microbatches
        batch = [torch.cat([mb["ids"] for mb in microbatches]), torch.cat([mb["labels"] for mb in microbatches])]
    losses = fn(
        forward_step, batch, model, forward_only=False, deallocate_pipeline_outputs=deallocate, num_microbatches=m
    )
    if apex_state.is_pipeline_last_stage(ignore_virtual=True):
        torch.testing.assert_close(torch.stack(losses), torch.stack(expected), atol=1e-5, rtol=1e-5)
    else:
        assert losses == []
    _check_grads([c.stage for c in chunks], dense)


@pytest.mark.parametrize(
    ("pp", "tp", "v", "m", "layers", "variable_seq", "deallocate"),
    [
        (1, 1, 1, 3, 2, False, False),  # no pipelining
        (2, 1, 1, 4, 3, False, False),
        (4, 1, 1, 4, 4, False, True),
        (2, 1, 2, 4, 4, False, False),
        (2, 1, 2, 3, 4, False, True),  # interleaved with m % pp != 0
        (4, 1, 2, 6, 8, False, False),
        (2, 2, 2, 4, 4, False, False),  # pp x tp
        (2, 1, 2, 5, 4, True, False),  # variable sequence lengths, no tensor_shape
        (4, 1, 1, 6, 4, True, True),
    ],
)
def test_apex_schedules_match_dense(pp, tp, v, m, layers, variable_seq, deallocate) -> None:
    run_distributed(apex_case, 4, pp, tp, v, m, layers, variable_seq, deallocate)


def apex_low_precision_case(pp: int, tp: int, v: int, dtype: torch.dtype) -> None:
    """A bf16 / fp16 model through apex's schedules (fp16 with a grad scaler, as apex's tests run it): losses and
    grads equal the same model's dense run in that dtype, to that dtype's precision."""
    dims = setup_parallel(tp=tp, pp=pp)
    if v > 1:
        dims.virtual_pipeline_size = v
        apex_state.set_virtual_pipeline_model_parallel_rank(0)
    m, layers = 4, 2 * pp * v
    microbatches = [{k: t.chunk(m)[i] for k, t in _batch(m).items()} for i in range(m)]
    torch.manual_seed(0)
    dense = PipeGPT(layers=layers).to(dtype)
    expected = [lm_loss(dense(mb["ids"]).float(), mb["labels"]) for mb in microbatches]
    torch.stack(expected).mean().backward()
    torch.manual_seed(0)
    stages, _ = split_model(
        PipeGPT(layers=layers).to(dtype), dims.pp_rank, pp, transformer_layer_cls=Block, virtual_pipeline_size=v
    )
    if tp > 1:
        stages = [(i, parallelize_module(s, dims.tp_mesh, pipe_gpt_plan())) for i, s in stages]
    chunks = [StageChunk(s, i, ["ids"]) for i, s in stages]
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0) if dtype == torch.float16 else None

    def step(microbatch, model):
        ids, labels = microbatch
        return model(ids=ids), lambda logits: lm_loss(logits.float(), labels)

    batch = [torch.cat([mb["ids"] for mb in microbatches]), torch.cat([mb["labels"] for mb in microbatches])]
    losses = get_forward_backward_func(v if v > 1 else None, pp)(
        step, batch, chunks if v > 1 else chunks[0], forward_only=False, num_microbatches=m, dtype=dtype,
        grad_scaler=scaler, disable_autocast=True,
    )  # fmt: skip
    tol = {"atol": 2e-2, "rtol": 2e-2}
    if apex_state.is_pipeline_last_stage(ignore_virtual=True):
        torch.testing.assert_close(torch.stack(losses), torch.stack(expected).detach(), **tol)
    dense_params = dict(dense.named_parameters())
    for chunk in chunks:
        for name, param in chunk.stage.named_parameters():
            assert param.dtype == dtype, name
            grad = param.grad.float() / (scaler.get_scale() if scaler is not None else 1.0)
            assert_matches_dense(grad, dense_params[name].grad.float(), msg=name, **tol)


@pytest.mark.parametrize(("pp", "tp", "v"), [(2, 2, 1), (2, 1, 2), (4, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_apex_schedules_in_low_precision_match_dense(pp: int, tp: int, v: int, dtype: torch.dtype) -> None:
    run_distributed(apex_low_precision_case, 4, pp, tp, v, dtype)


def changing_shape_case(v: int) -> None:
    """A declared tensor_shape fixes one activation shape per step: a microbatch whose output differs is refused by
    the sending stage (only the step's first activation per stage carries a header), and every rank stops."""
    dims = setup_parallel(pp=2)
    if v > 1:
        dims.virtual_pipeline_size = v
        apex_state.set_virtual_pipeline_model_parallel_rank(0)
    microbatches = [_batch(1, seq=4 + 2 * (i % 2)) for i in range(4)]
    stages, _ = split_model(PipeGPT(layers=4), dims.pp_rank, 2, transformer_layer_cls=Block, virtual_pipeline_size=v)
    chunks = [StageChunk(s, i, ["ids"]) for i, s in stages]
    get_forward_backward_func(v if v > 1 else None, 2)(
        forward_step, PerChunkMicrobatches(microbatches), chunks if v > 1 else chunks[0], forward_only=False,
        tensor_shape=(2, 4, 16), num_microbatches=4,
    )  # fmt: skip


@pytest.mark.parametrize("v", [1, 2])
def test_an_activation_shape_changing_under_a_declared_tensor_shape_is_refused(v: int) -> None:
    with pytest.raises(AssertionError) as caught:
        run_distributed(changing_shape_case, 2, v)
    text = str(caught.value)
    assert "no answer" not in text, text
    assert "PipelineShapeError: pipeline stage 0 output [2, 6, 16]" in text and "[2, 4, 16]" in text, text
    assert "for the step's first" in text and "PeerFailedError" in text, text


def apex_forward_only_case() -> None:
    dims = setup_parallel(pp=2)
    microbatches = [{k: t.chunk(2)[i] for k, t in _batch(2).items()} for i in range(2)]
    torch.manual_seed(0)
    dense = PipeGPT(layers=2)
    with torch.no_grad():
        expected = [lm_loss(dense(mb["ids"]), mb["labels"]) for mb in microbatches]
    (stage,), _ = split_model(dense, dims.pp_rank, 2, transformer_layer_cls=Block)
    fn = get_forward_backward_func(None, 2)
    losses = fn(forward_step, _batch(2), StageChunk(stage[1], stage[0], ["ids"]), forward_only=True, num_microbatches=2)
    if dims.pp_rank == 1:
        torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    assert all(p.grad is None for p in stage[1].parameters())


def test_apex_forward_only() -> None:
    run_distributed(apex_forward_only_case, 2)


def nxd_case(pp: int, v: int, m: int, broadcast: bool) -> None:
    setup_parallel(pp=pp)
    batch = _batch(m)
    microbatches = [{k: t.chunk(m)[i] for k, t in batch.items()} for i in range(m)]
    dense, expected = _dense(5, microbatches)
    torch.manual_seed(0)
    model = NxDPPModel(
        PipeGPT(layers=5),
        transformer_layer_cls=Block,
        num_microbatches=m,
        virtual_pipeline_size=v,
        input_names=["ids"],
        broadcast_and_average_loss=broadcast,
        loss_fn=lambda logits, ids, labels: lm_loss(logits, labels),
    )
    stages = pp * v  # NxD's placement: 5 layers evenly, the remainder on the last stages
    sizes = [5 // stages + (1 if s >= stages - 5 % stages else 0) for s in range(stages)]
    for chunk in model.chunks:
        held = {n.split(".")[1] for n, _ in chunk.stage.named_parameters() if n.startswith("layers.")}
        first = sum(sizes[: chunk.stage_index])
        assert held == {str(i) for i in range(first, first + sizes[chunk.stage_index])}, (chunk.stage_index, held)
    loss = model.run_train(**batch)
    if broadcast or model.is_last_stage_rank:
        torch.testing.assert_close(loss, torch.stack(expected).mean(), atol=1e-5, rtol=1e-5)
    _check_grads([c.stage for c in model.chunks], dense)
    names = [n for n, _ in model.local_named_parameters()]
    assert set(names) <= set(dict(dense.named_parameters())) and names
    eval_loss = model.run_eval(**batch)
    if broadcast or model.is_last_stage_rank:
        torch.testing.assert_close(eval_loss, torch.stack(expected).mean(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("pp", "v", "m", "broadcast"), [(2, 1, 2, False), (2, 2, 4, True), (4, 1, 5, True)])
def test_nxd_pipeline_model_matches_dense(pp: int, v: int, m: int, broadcast: bool) -> None:
    run_distributed(nxd_case, 4, pp, v, m, broadcast)


def bad_inputs_case(kind: str) -> None:
    setup_parallel(pp=2)
    model = PipeGPT(layers=2)
    loss = {"loss_fn": lambda out, **_: out.sum()}  # the structural split (without a loss_fn NxDPPModel traces)
    if kind == "few_microbatches":
        NxDPPModel(model, transformer_layer_cls=Block, num_microbatches=1, virtual_pipeline_size=2, **loss)
    elif kind == "indivisible_batch":
        pm = NxDPPModel(model, transformer_layer_cls=Block, num_microbatches=3, input_names=["ids"], **loss)
        pm.run_train(ids=torch.zeros(4, 8, dtype=torch.long), labels=torch.zeros(4, 8, dtype=torch.long))
    elif kind == "too_many_stages":
        NxDPPModel(model, transformer_layer_cls=Block, num_microbatches=4, virtual_pipeline_size=2, **loss)
    elif kind == "chunks_vs_virtual_size":
        get_parallel().virtual_pipeline_size = 2
        stages, _ = split_model(PipeGPT(layers=6), get_parallel().pp_rank, 2, transformer_layer_cls=Block,
                                virtual_pipeline_size=3)  # fmt: skip
        chunks = [StageChunk(stage, i, ["ids"]) for i, stage in stages]
        get_forward_backward_func(2, 2)(forward_step, _batch(4), chunks, forward_only=True, tensor_shape=None)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("few_microbatches", "num_microbatches=1 must be >= pp=2 with virtual_pipeline_size > 1"),
        ("indivisible_batch", "batch size 4 is not divisible into 3 microbatches"),
        ("too_many_stages", "2 layers cannot fill 4 pipeline stages"),
        ("chunks_vs_virtual_size", "3 model chunks on this rank, but .* virtual_pipeline_model_parallel_size=2"),
    ],
)
def test_bad_pipeline_inputs_raise_on_every_rank_without_hanging(kind: str, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        run_distributed(bad_inputs_case, 2, kind)


def pp_x_dp_case(v: int, sync: str) -> int:
    """pp=2 x dp=2: each dp replica runs the pipeline on its half of the batch; grads must be the dense grads of the
    whole batch after the dp sync (FSDP2 on each chunk, or meshpar's overlapped all-reduce per chunk)."""
    dims = setup_parallel(pp=2)
    m = 4
    batch = _batch(2 * m)  # m microbatches of 2 rows per dp rank
    everything = [{k: t.chunk(2 * m)[i] for k, t in batch.items()} for i in range(2 * m)]
    dense, _ = _dense(4, everything)
    mine = {k: t.chunk(2)[dims.dp_rank] for k, t in batch.items()}
    torch.manual_seed(0)
    model = NxDPPModel(
        PipeGPT(layers=4),
        transformer_layer_cls=Block,
        num_microbatches=m,
        virtual_pipeline_size=v,
        input_names=["ids"],
        loss_fn=lambda logits, ids, labels: lm_loss(logits, labels),
        overlap_grad_reduce=sync == "overlap",
    )
    if sync == "fsdp":
        for chunk in model.chunks:
            apply_fsdp(chunk.stage, dims.dp_mesh, block_cls=Block)
    model.run_train(**mine)
    model.finish_grad_sync()
    dense_params = dict(dense.named_parameters())
    for chunk in model.chunks:
        for name, param in chunk.stage.named_parameters():
            grad = param.grad.full_tensor() if sync == "fsdp" else param.grad
            torch.testing.assert_close(grad, dense_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    return len(model.grad_syncs or ())


@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("sync", ["overlap", "fsdp"])
def test_pipeline_model_with_data_parallel_matches_dense(v: int, sync: str) -> None:
    assert run_distributed(pp_x_dp_case, 4, v, sync) == [v if sync == "overlap" else 0] * 4


def no_pipelining_sync_case() -> list[str]:
    """apex's pp = 1 loop: every microbatch but the last runs forward and backward inside the sync context."""
    setup_parallel()
    model = PipeGPT(layers=2)
    chunk = StageChunk(model, 0, ["ids"])
    events: list[str] = []

    @contextlib.contextmanager
    def handler():
        events.append("enter")
        yield
        events.append("exit")

    def step(microbatch, chunk):
        events.append("forward")
        return forward_step(microbatch, chunk)

    get_forward_backward_func(None, 1)(
        step, _batch(3), chunk, forward_only=False, custom_sync_context_handler=handler, num_microbatches=3
    )
    return events


def test_no_pipelining_runs_all_but_the_last_microbatch_inside_the_sync_context() -> None:
    events = run_distributed(no_pipelining_sync_case, 1)[0]
    assert events == ["enter", "forward", "exit", "enter", "forward", "exit", "forward"]


def user_sync_case() -> dict:
    """apex's custom_sync_context_handler under 1F1B at pp2: the context is entered as the step starts and left where
    apex leaves it: on the first stage right before its last backward (so that backward's grads are the ones kept),
    elsewhere after the schedule, where custom_grad_sync_func then runs. The handler takes the dp reduction over."""
    dims = setup_parallel(pp=2)
    stages, _ = split_model(PipeGPT(layers=2), dims.pp_rank, 2, transformer_layer_cls=Block)
    (chunk,) = [StageChunk(stage, i, ["ids"]) for i, stage in stages]
    events: list[str] = []

    @contextlib.contextmanager
    def handler():
        events.append("enter")
        yield
        events.append("exit")
        for param in chunk.parameters():
            param.grad = None

    get_forward_backward_func(None, 2)(
        forward_step, _batch(4), chunk, forward_only=False, num_microbatches=4,
        custom_sync_context_handler=handler, custom_grad_sync_func=lambda: events.append("grad sync"),
    )  # fmt: skip
    grads = [p.grad is not None for p in chunk.parameters()]
    return {"events": events, "all_grads": all(grads), "any_grads": any(grads)}


def test_a_custom_sync_context_is_left_where_apex_leaves_it() -> None:
    first, last = run_distributed(user_sync_case, 2)
    assert first == {"events": ["enter", "exit"], "all_grads": True, "any_grads": True}
    assert last == {"events": ["enter", "exit", "grad sync"], "all_grads": False, "any_grads": False}


def interleaved_user_sync_case(with_sync_func: bool) -> dict:
    """Interleaved (pp2, two chunks per rank): the context is left around (or, with custom_grad_sync_func, after)
    each chunk's last backward and entered again, then left once more after the schedule; the function gets each
    chunk's parameters once."""
    dims = setup_parallel(pp=2)
    dims.virtual_pipeline_size = 2
    apex_state.set_virtual_pipeline_model_parallel_rank(0)
    stages, _ = split_model(PipeGPT(layers=4), dims.pp_rank, 2, transformer_layer_cls=Block, virtual_pipeline_size=2)
    chunks = [StageChunk(stage, i, ["ids"]) for i, stage in stages]
    counts = {"enter": 0, "exit": 0, "synced": []}

    @contextlib.contextmanager
    def handler():
        counts["enter"] += 1
        yield
        counts["exit"] += 1

    def sync_func(params) -> None:
        counts["synced"].append(sum(p.numel() for p in params))

    get_forward_backward_func(2, 2)(
        forward_step, _batch(4), chunks, forward_only=False, num_microbatches=4, custom_sync_context_handler=handler,
        custom_grad_sync_func=sync_func if with_sync_func else None,
    )  # fmt: skip
    counts["chunk_sizes"] = [sum(p.numel() for p in c.parameters()) for c in chunks]
    return counts


@pytest.mark.parametrize("with_sync_func", [False, True])
def test_interleaved_schedules_leave_the_custom_context_once_per_chunk_and_at_the_end(with_sync_func: bool) -> None:
    for counts in run_distributed(interleaved_user_sync_case, 2, with_sync_func):
        assert counts["enter"] == counts["exit"] == 3, counts  # two chunks + the end
        assert sorted(counts["synced"]) == (sorted(counts["chunk_sizes"]) if with_sync_func else []), counts


# -- apex encoder-decoder pipelines ----------------------------------------------------------------------------------
HID, ENC_SEQ, DEC_SEQ = 8, 6, 4


class ToySeq2Seq(nn.Module):
    """A dense encoder-decoder: encoder layers over the source, then decoder layers that each mix the decoder hidden
    states with the encoder's output (a stand-in for cross-attention), a head on top. [seq, batch, hidden], as apex."""

    def __init__(self, encoder_layers: int, decoder_layers: int) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(HID, HID) for _ in range(encoder_layers))
        self.decoder = nn.ModuleList(nn.Linear(HID, HID) for _ in range(decoder_layers))
        self.cross = nn.ModuleList(nn.Linear(HID, HID) for _ in range(decoder_layers))
        self.head = nn.Linear(HID, 1)

    @staticmethod
    def mix(cross: nn.Module, encoded: torch.Tensor) -> torch.Tensor:
        return cross(encoded).mean(0, keepdim=True)  # every decoder position sees the whole source

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        encoded = source
        for layer in self.encoder:
            encoded = torch.tanh(layer(encoded))
        hidden = target
        for layer, cross in zip(self.decoder, self.cross, strict=True):
            hidden = torch.tanh(layer(hidden) + self.mix(cross, encoded))
        return self.head(hidden)


class Seq2SeqStage(nn.Module):
    """One pipeline rank's piece of :class:`ToySeq2Seq` (one encoder or decoder layer), built by apex's
    ``build_model`` keywords and reading its inputs as apex hands them (a list on decoder stages)."""

    def __init__(self, dense: ToySeq2Seq, *, pre_process: bool, post_process: bool, add_encoder: bool,
                 add_decoder: bool) -> None:  # fmt: skip
        super().__init__()
        assert add_encoder != add_decoder
        rank, split = apex_state.get_pipeline_model_parallel_rank(), apex_state.get_pipeline_model_parallel_split_rank()
        self.pre_process, self.add_decoder = pre_process, add_decoder
        self.index = rank - split if add_decoder else rank
        self.layer = copy.deepcopy((dense.decoder if add_decoder else dense.encoder)[self.index])
        self.cross = copy.deepcopy(dense.cross[self.index]) if add_decoder else None
        self.head = copy.deepcopy(dense.head) if post_process and add_decoder else None
        self.received: list = [None]

    def set_input_tensor(self, tensor) -> None:
        self.received = tensor if isinstance(tensor, list) else [tensor]

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not self.add_decoder:
            return torch.tanh(self.layer(source if self.pre_process else self.received[0]))
        hidden, encoded = (target, self.received[0]) if self.pre_process else self.received
        hidden = torch.tanh(self.layer(hidden) + ToySeq2Seq.mix(self.cross, encoded))
        return self.head(hidden) if self.head is not None else hidden

    def dense_grads(self, dense: ToySeq2Seq) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs = [((dense.decoder if self.add_decoder else dense.encoder)[self.index], self.layer)]
        pairs += [(dense.cross[self.index], self.cross)] if self.cross is not None else []
        pairs += [(dense.head, self.head)] if self.head is not None else []
        return [(m.grad, r.grad) for d, o in pairs for m, r in zip(o.parameters(), d.parameters(), strict=True)]


def encoder_decoder_case(split: int, m: int, deallocate: bool, forward_only: bool) -> None:
    from meshpar.compat.apex.enums import ModelType
    from meshpar.compat.apex.pipeline_parallel import build_model

    apex_state.initialize_model_parallel(1, 4, None, split)
    torch.manual_seed(0)
    dense = ToySeq2Seq(split, 4 - split)
    source, target = torch.randn(2 * m, ENC_SEQ, HID), torch.randn(2 * m, DEC_SEQ, HID)  # apex splits rows
    chunks = build_model(lambda **roles: Seq2SeqStage(dense, **roles), False, None, ModelType.encoder_and_decoder)
    assert chunks[0].model_type == ModelType.encoder_and_decoder

    def step(microbatch, model):
        rows_first = [x.transpose(0, 1) for x in microbatch]  # [s, b, h] inside
        return model(*rows_first), lambda out: (out.square().mean(), {"out": out.detach().sum()})

    fn = get_forward_backward_func(None, 4)
    reported = fn(
        step, [source, target], chunks, forward_only=forward_only, num_microbatches=m, tensor_shape=(ENC_SEQ, 2, HID),
        decoder_sequence_length=DEC_SEQ, deallocate_pipeline_outputs=deallocate,
    )  # fmt: skip
    outs = [dense(s.transpose(0, 1), t.transpose(0, 1)) for s, t in zip(source.chunk(m), target.chunk(m), strict=True)]
    if apex_state.is_pipeline_last_stage():
        torch.testing.assert_close(torch.stack([r["out"] for r in reported]), torch.stack([o.sum() for o in outs]))
    if not forward_only:
        (torch.stack([o.square().mean() for o in outs]).sum() / m).backward()
        for mine, ref in chunks[0].dense_grads(dense):
            torch.testing.assert_close(mine, ref, atol=1e-6, rtol=1e-5)
    apex_state.destroy_model_parallel()


@pytest.mark.parametrize(
    ("split", "m", "deallocate", "forward_only"), [(2, 4, False, False), (1, 5, True, False), (3, 4, False, True)]
)
def test_apex_encoder_decoder_pipeline_matches_dense(split: int, m: int, deallocate: bool, forward_only: bool) -> None:
    """apex's split-rank layout: the encoder on the ranks before the split, the decoder after it, the encoder's
    output carried to every decoder stage; losses and every stage's grads equal the dense model's."""
    run_distributed(encoder_decoder_case, 4, split, m, deallocate, forward_only)


def encoder_decoder_refusals_case() -> None:
    from meshpar.compat.apex.enums import ModelType
    from meshpar.compat.apex.pipeline_parallel import build_model

    apex_state.initialize_model_parallel(1, 2)  # no split rank
    with pytest.raises(RuntimeError, match="pipeline_model_parallel_split_rank_"):
        build_model(lambda **roles: nn.Linear(2, 2), False, None, ModelType.encoder_and_decoder)
    apex_state.destroy_model_parallel()


def test_an_encoder_decoder_without_a_split_rank_is_refused() -> None:
    run_distributed(encoder_decoder_refusals_case, 2)
