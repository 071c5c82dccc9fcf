"""The NxD tensor-parallel developer guide and API guide, ported (imports changed), against one dense process."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshpar.compat import nxd
from meshpar.compat.nxd import parallel_layers, parallel_state
from meshpar.compat.nxd.parallel_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from meshpar.compat.nxd.parallel_layers.loss_functions import parallel_cross_entropy
from meshpar.compat.nxd.parallel_layers.pad import get_number_of_extra_heads, pad_model
from meshpar.compat.nxd.parallel_layers.utils import divide
from meshpar.compat.nxd.pipeline import NxDPPModel
from meshpar.testing import run_distributed
from tests.seeds._dense import apex_shard, assert_params_match, copy_dense_into

H, HEADS, V, SEQ = 16, 4, 24, 5


class SelfAttention(nn.Module):
    """A BERT-style attention (query/key/value, output dense) written as the guide's model is."""

    def __init__(self, heads: int = HEADS, parallel: bool = False) -> None:
        super().__init__()
        self.num_attention_heads, self.head_size = heads, H // HEADS
        self.all_head_size = heads * self.head_size
        if parallel:
            # the guide's ParallelSelfAttention: positional sizes, gather_output=False, heads divided by tp
            self.query = ColumnParallelLinear(H, self.all_head_size, gather_output=False)
            self.key = ColumnParallelLinear(H, self.all_head_size, gather_output=False)
            self.value = ColumnParallelLinear(H, self.all_head_size, gather_output=False)
            self.dense = RowParallelLinear(self.all_head_size, H, input_is_parallel=True)
            tp_size = parallel_state.get_tensor_parallel_size()
            self.num_attention_heads = self.num_attention_heads // tp_size
            self.all_head_size = self.all_head_size // tp_size
        else:
            self.query, self.key, self.value = (nn.Linear(H, self.all_head_size) for _ in range(3))
            self.dense = nn.Linear(self.all_head_size, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.num_attention_heads, self.head_size).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)))
        return self.dense(out.transpose(1, 2).reshape(b, s, self.all_head_size))


class Net(nn.Module):
    def __init__(self, parallel: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = ParallelEmbedding(V, H) if parallel else nn.Embedding(V, H)
        self.attn = SelfAttention(parallel=parallel)
        self.head = (
            ColumnParallelLinear(H, V, bias=False, gather_output=False) if parallel else nn.Linear(H, V, bias=False)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.attn(h))


def developer_guide_case(tmp: str) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    assert parallel_state.get_tensor_model_parallel_size() == 2 == parallel_state.get_tensor_parallel_size()
    dense = Net()
    model = Net(parallel=True)
    copy_dense_into(model, dense.state_dict())
    parallel_layers.move_model_to_device(model, "cpu")
    weight = model.attn.query.weight
    assert (weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride) == (True, 0, 1)
    assert model.attn.dense.weight.partition_dim == 1 and not getattr(
        model.attn.dense.bias, "tensor_model_parallel", False
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dense_optimizer = torch.optim.SGD(dense.parameters(), lr=0.1)
    torch.manual_seed(1 + parallel_state.get_data_parallel_rank())
    ids, labels = torch.randint(0, V, (2, SEQ)), torch.randint(0, V, (2, SEQ))
    everything = [torch.empty_like(ids) for _ in range(2)]
    torch.distributed.all_gather(everything, ids, group=parallel_state.get_data_parallel_group())
    all_labels = [torch.empty_like(labels) for _ in range(2)]
    torch.distributed.all_gather(all_labels, labels, group=parallel_state.get_data_parallel_group())

    output = model(ids)
    loss = parallel_cross_entropy(output, labels).mean()
    loss.backward()
    for p in model.parameters():  # xm.optimizer_step(groups=dp group): grads averaged over dp
        torch.distributed.all_reduce(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad,
                                     group=parallel_state.get_data_parallel_group())  # fmt: skip
        p.grad /= parallel_state.get_data_parallel_size()
    norm = parallel_layers.clip_grad_norm(model.parameters(), 1.0)
    optimizer.step()

    dense_loss = F.cross_entropy(dense(torch.cat(everything)).reshape(-1, V), torch.cat(all_labels).reshape(-1))
    dense_loss.backward()
    dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
    dense_optimizer.step()
    torch.testing.assert_close(norm, dense_norm, atol=1e-5, rtol=1e-5)
    assert_params_match(model, dense.state_dict())

    parallel_layers.save({"epoch": 3, "model": model.state_dict(), "loss": loss.detach()}, tmp)
    fresh = Net(parallel=True)
    checkpoint = parallel_layers.load(tmp, fresh, model_key="model")
    assert checkpoint["epoch"] == 3
    assert_params_match(fresh, dense.state_dict())


def test_developer_guide_tp2_dp2(tmp_path) -> None:
    run_distributed(developer_guide_case, 4, str(tmp_path))


def load_other_layout_case(tmp: str) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=4)
    parallel_layers.load(tmp, Net(parallel=True))


def test_nxd_load_at_another_layout_fails_on_every_rank(tmp_path) -> None:
    run_distributed(developer_guide_case, 4, str(tmp_path))
    with pytest.raises(AssertionError, match=r"saved at .*this run is tp=4") as info:
        run_distributed(load_other_layout_case, 4, str(tmp_path))
    assert str(info.value).count("ValueError: parallel_layers.load failed on rank 0") == 4


class PaddedAttention(SelfAttention):
    """The API guide's padding recipe: heads per rank computed with get_number_of_extra_heads."""

    def __init__(self, heads: int) -> None:
        super().__init__(heads=heads, parallel=True)
        tp = parallel_state.get_tensor_model_parallel_size()
        self.num_attention_heads = divide(heads + get_number_of_extra_heads(heads, tp), tp)
        self.all_head_size = self.num_attention_heads * self.head_size


def pad_case() -> None:
    """The API guide's recipe, NxD's 1-axis padding: every rank's query / key / value shard grows from 2 to 4 rows
    (zeros at its end) and the output dense's input columns likewise, so the projections chained through the padded
    dims compute what they computed before; the hook gets the ratio."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=4)
    torch.manual_seed(0)
    model = PaddedAttention(heads=2)  # 2 heads of size 4 at tp=4: half a head per rank before padding
    before = model.query.weight.detach().clone()
    x = torch.randn(2, SEQ, H)
    chained = model.dense(model.value(x)).detach()
    seen = []
    model = pad_model(model, 4, 2, wrapped_classes=[PaddedAttention], pad_hook_fn=lambda m, r: seen.append(r))
    assert seen == [2.0] and model.query.weight.shape == (16 // 4, H) and model.query.output_size == 16
    torch.testing.assert_close(model.query.weight[:2], before)
    assert not model.query.weight[2:].any() and not model.dense.weight[:, 2:].any()
    assert model.query.weight.tensor_model_parallel and model.dense.weight.partition_dim == 1
    torch.testing.assert_close(model.dense(model.value(x)), chained, atol=1e-6, rtol=1e-5)
    model(x)  # the recipe's heads per rank (1 padded head of 4) run through attention


def test_pad_model_api_guide_recipe() -> None:
    run_distributed(pad_case, 4)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.head = nn.Linear(H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) if self.embed is not None else ids
        for layer in self.layers:
            h = layer(h)
        return self.head(h) if self.head is not None else h


def init_own(module: nn.Module) -> None:
    """param_init_fn: this module's own parameters only (seeded by shape, so every rank agrees)."""
    for name, param in module.named_parameters(recurse=False):
        torch.manual_seed(sum(param.shape) + len(name))
        nn.init.normal_(param, std=0.1)


def pipeline_case(meta: bool) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    dense = Stack()
    for module in dense.modules():
        init_own(module)
    if meta:
        with torch.device("meta"):
            module = Stack()
    else:
        module = Stack()
        module.load_state_dict(dense.state_dict())
    torch.manual_seed(2 + parallel_state.get_data_parallel_rank())
    ids, labels = torch.randint(0, V, (4, SEQ)), torch.randint(0, V, (4, SEQ))
    model = nxd.pipeline.NxDPPModel(
        module, transformer_layer_cls=Layer, num_microbatches=2, output_loss_value_spec=None,
        broadcast_and_average_loss=True, input_names=["ids"], param_init_fn=init_own if meta else None,
        loss_fn=lambda logits, ids, labels: F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1)),
    )  # fmt: skip
    loss = model.run_train(ids=ids, labels=labels)
    both_ids = [torch.empty_like(ids) for _ in range(2)]
    both_labels = [torch.empty_like(labels) for _ in range(2)]
    group = parallel_state.get_data_parallel_group()
    torch.distributed.all_gather(both_ids, ids, group=group)
    torch.distributed.all_gather(both_labels, labels, group=group)
    dense_losses = [F.cross_entropy(dense(i).reshape(-1, V), lab.reshape(-1)) for i, lab in
                    zip(torch.cat(both_ids).chunk(4), torch.cat(both_labels).chunk(4), strict=True)]  # fmt: skip
    dense_loss = torch.stack(dense_losses).mean()
    dense_loss.backward()
    torch.testing.assert_close(loss, dense_loss.detach(), atol=1e-5, rtol=1e-5)  # every rank: pp and dp
    grads = {n: p.grad for n, p in dense.named_parameters()}
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param.grad, grads[name], atol=1e-5, rtol=1e-4, msg=name)
        # the model's own view (model.parameters(), as NxD's optimizer takes it) holds the stage's tensors, also
        # where the stage was materialised from meta
        assert model.original_torch_module.get_parameter(name) is param, name


@pytest.mark.parametrize("meta", [False, True])
def test_nxd_pipeline_pp2_dp2(meta: bool) -> None:
    run_distributed(pipeline_case, 4, meta)


def conflicting_arguments_case(kind: str) -> None:
    parallel_state.initialize_model_parallel(1, 2)
    kwargs = {"return_mb_loss": True, "broadcast_and_average_loss": True, "loss_fn": lambda out, **_: out.sum()}
    if kind == "cut":  # the embedding output is used again after the last layer: two values cross every cut
        kwargs = {"input_names": ["ids", "labels"], "output_loss_value_spec": (True, False)}
        NxDPPModel(LossInside(skip=True), transformer_layer_cls=Layer, num_microbatches=2, **kwargs)
    if kind == "untraceable":  # data-dependent control flow: no cuts nor input names, so traced at the first step
        model = NxDPPModel(Branchy(), transformer_layer_cls=Layer, num_microbatches=2,
                           output_loss_value_spec=(True, False))  # fmt: skip
        ids = torch.randint(0, V, (4, SEQ))
        model.run_train(ids=ids, labels=ids)
    if kind == "meta":
        kwargs = {"input_names": ["ids"], "param_init_fn": init_own}
    NxDPPModel(Stack(), transformer_layer_cls=Layer, num_microbatches=2, **kwargs)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("loss", "broadcast_and_average_loss=True requires return_mb_loss=False"),
        ("cut", r"stage 1 is crossed by \['mul', 'layers_1'\]: meshpar's pipeline sends one activation"),
        ("meta", "a traced pipeline .* takes no param_init_fn"),
        ("untraceable", r"could not trace Branchy.forward with torch.fx .*leaf_module_cls"),
    ],
)
def test_nxd_pipeline_refuses_what_it_cannot_honour(kind: str, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        run_distributed(conflicting_arguments_case, 2, kind)


class TPLayer(nn.Module):
    """A block written with the guide's layers (column then row parallel), for NxDPPModel at tp2 x pp2."""

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        if parallel:
            self.fc1 = ColumnParallelLinear(H, 2 * H, gather_output=False)
            self.fc2 = RowParallelLinear(2 * H, H, input_is_parallel=True)
        else:
            self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TPStack(Stack):
    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TPLayer(parallel) for _ in range(4))


def tp_pipeline_case() -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    torch.manual_seed(0)
    dense = TPStack(parallel=False)
    module = TPStack(parallel=True)
    copy_dense_into(module, dense.state_dict())
    ids, labels = torch.randint(0, V, (4, SEQ)), torch.randint(0, V, (4, SEQ))
    model = NxDPPModel(
        module, transformer_layer_cls=TPLayer, num_microbatches=2, broadcast_and_average_loss=True,
        input_names=["ids"], loss_fn=lambda logits, ids, labels: F.cross_entropy(logits.reshape(-1, V),
                                                                                labels.reshape(-1)),
    )  # fmt: skip
    loss = model.run_train(ids=ids, labels=labels)
    pairs = zip(ids.chunk(2), labels.chunk(2), strict=True)
    dense_loss = torch.stack([F.cross_entropy(dense(i).reshape(-1, V), lab.reshape(-1)) for i, lab in pairs]).mean()
    dense_loss.backward()
    torch.testing.assert_close(loss, dense_loss.detach(), atol=1e-5, rtol=1e-5)
    grads = {n: p.grad for n, p in dense.named_parameters()}
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param.grad, apex_shard(param, grads[name]), atol=1e-5, rtol=1e-4, msg=name)


def test_nxd_pipeline_of_tensor_parallel_layers_tp2_pp2() -> None:
    run_distributed(tp_pipeline_case, 4)


class LossInside(nn.Module):
    """NxD's usual model: the loss is computed inside forward, from the labels; a mask derived from the inputs."""

    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.head = nn.Linear(H, V)
        self.skip = skip

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = (ids % 7 != 0).unsqueeze(-1).float()  # from the inputs alone: recomputed on each stage that needs it
        h0 = self.embed(ids) * keep
        h = h0
        for layer in self.layers:
            h = layer(h) * keep
        logits = self.head(h + h0 if self.skip else h)
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1)), logits


def traced_case(vpp: int, leaf: bool, by_hand: bool = False, overlap: bool = False) -> None:
    """``by_hand``: built without cuts, then NxD's trace() / cut_pipeline_stage() / partition() at cuts other than
    the placement it would choose itself (one layer on the first stage); ``overlap``: dp all-reduces during backward
    (the first placement's grad hooks must not stay)."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    dense = LossInside()
    module = LossInside()
    torch.manual_seed(2 + parallel_state.get_data_parallel_rank())
    ids, labels = torch.randint(0, V, (4, SEQ)), torch.randint(0, V, (4, SEQ))
    leaves = [nn.Embedding] if leaf else None
    if by_hand:
        model = NxDPPModel(module, transformer_layer_cls=Layer, num_microbatches=4, virtual_pipeline_size=vpp,
                           output_loss_value_spec=(True, False), broadcast_and_average_loss=True,
                           overlap_grad_reduce=overlap)  # fmt: skip
        assert not model.partitioned
        with pytest.raises(AssertionError, match="after trace"):
            model.cut_pipeline_stage("layers.0")
        model.trace(input_names=["ids", "labels"], leaf_modules=leaves)
        cuts = ["layers.0"] if vpp == 1 else ["layers.0", "layers.1", "layers.2"]
        for cut in cuts:
            model.cut_pipeline_stage(cut)
        with pytest.raises(AssertionError, match="marked already"):
            model.cut_pipeline_stage(cuts[0])
        with mock.patch("meshpar.pipeline.trace.trace", side_effect=AssertionError("traced a second time")):
            model.partition()  # cuts the trace trace() made
        assert model.partitioned and model.pipeline_cuts == cuts
        with pytest.raises(AssertionError, match="partitioned already"):
            model.cut_pipeline_stage("layers.3")
        model.partition()  # a no-op once partitioned, as NxD's
        layers = sorted(
            {name.split(".")[1] for name, _ in model.local_named_parameters() if name.startswith("layers.")}
        )
        rank = parallel_state.get_pipeline_model_parallel_rank()
        want = (["0"] if rank == 0 else ["1", "2", "3"]) if vpp == 1 else (["0", "2"] if rank == 0 else ["1", "3"])
        assert layers == want, layers
    else:
        model = NxDPPModel(
            module, transformer_layer_cls=Layer, num_microbatches=4, virtual_pipeline_size=vpp,
            output_loss_value_spec=(True, False), broadcast_and_average_loss=True, input_names=["ids", "labels"],
            leaf_module_cls=leaves,
        )  # fmt: skip
    loss = model.run_train(ids=ids, labels=labels)
    group = parallel_state.get_data_parallel_group()
    all_ids, all_labels = [torch.empty_like(ids) for _ in range(2)], [torch.empty_like(labels) for _ in range(2)]
    torch.distributed.all_gather(all_ids, ids, group=group)
    torch.distributed.all_gather(all_labels, labels, group=group)
    pairs = zip(torch.cat(all_ids).chunk(8), torch.cat(all_labels).chunk(8), strict=True)
    dense_loss = torch.stack([dense(i, lab)[0] for i, lab in pairs]).mean()
    dense_loss.backward()
    torch.testing.assert_close(loss, dense_loss.detach(), atol=1e-5, rtol=1e-5)
    grads = {n: p.grad for n, p in dense.named_parameters()}
    names = [name for name, _ in model.local_named_parameters()]
    assert names and all(name in grads for name in names), names  # the original FQNs
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param.grad, grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    ("vpp", "leaf", "by_hand", "overlap"),
    [(1, False, False, False), (2, True, False, False), (1, True, True, True), (2, False, True, False)],
)
def test_nxd_pipeline_traces_a_model_with_its_loss_inside_forward(
    vpp: int, leaf: bool, by_hand: bool, overlap: bool
) -> None:
    """No loss_fn: the module is traced (leaf_module_cls honoured), cut after layers; labels reach the last stage
    from the microbatch; pp2 x dp2 (and interleaved) equal to dense; also cut by hand with NxD's trace() /
    cut_pipeline_stage() / partition() after construction."""
    run_distributed(traced_case, 4, vpp, leaf, by_hand, overlap)


def zero1_case() -> None:
    """use_zero1_optimizer=True: NxDPPModel leaves each dp rank's grads un-averaged and meshpar's ZeRO-1 optimizer
    (reduce-scatter of the grads to their owners) averages them; the step equals dense SGD on the global batch."""
    from meshpar.optim import DistributedOptimizer

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    dense = Stack()
    module = Stack()
    module.load_state_dict(dense.state_dict())
    loss_fn = lambda logits, ids, labels: F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))  # noqa: E731
    model = NxDPPModel(module, transformer_layer_cls=Layer, num_microbatches=2, input_names=["ids"],
                       use_zero1_optimizer=True, loss_fn=loss_fn)  # fmt: skip
    # SGD: a step that depends on the grads' scale (AdamW's would hide grads averaged twice)
    optimizer = DistributedOptimizer(model, torch.optim.SGD, zero1=True, reduce_scatter_grads=True, lr=0.5)
    generator = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, V, (8, SEQ), generator=generator), torch.randint(0, V, (8, SEQ), generator=generator)
    mine = slice(parallel_state.get_data_parallel_rank() * 4, (parallel_state.get_data_parallel_rank() + 1) * 4)
    model.run_train(ids=ids[mine], labels=labels[mine])
    grad = next(p for _, p in model.local_named_parameters()).grad
    both = [torch.empty_like(grad) for _ in range(2)]
    torch.distributed.all_gather(both, grad, group=parallel_state.get_data_parallel_group())
    assert not torch.allclose(both[0], both[1]), "use_zero1_optimizer: the grads are the optimizer's to average"
    optimizer.step()
    dense_optimizer = torch.optim.SGD(dense.parameters(), lr=0.5)
    torch.stack(
        [loss_fn(dense(i), i, lab) for i, lab in zip(ids.chunk(4), labels.chunk(4), strict=True)]
    ).mean().backward()
    dense_optimizer.step()
    reference = dict(dense.named_parameters())
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param.detach(), reference[name].detach(), atol=1e-5, rtol=1e-4, msg=name)


def test_nxd_pipeline_with_use_zero1_optimizer_steps_like_dense() -> None:
    run_distributed(zero1_case, 4)


class Branchy(LossInside):
    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ids.sum() > 0:  # a data-dependent branch: symbolic tracing cannot follow it
            ids = ids - 1
        return super().forward(ids, labels)
