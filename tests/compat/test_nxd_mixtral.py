"""A Mixtral-style model written the way NxD's Mixtral pretraining example builds its MoE layers (``RouterTopK``,
``ExpertMLPs`` with a gated MLP and renormalised top-2 affinities, ``MoE`` returning the router logits; vocab-parallel
embedding and head, ``parallel_cross_entropy`` inside ``forward``), trained through NxD's trainer API with
``expert_parallel_size`` 2 as the example drives it, at tp1 x ep2 (dp 4), tp2 x ep2 (dp 2) and pp2 x ep2 (dp 2, the
model traced and cut into stages, each stage's experts over its own ep groups), against the same model built from
plain torch layers in one process: the loss of every step and every parameter after every step (ZeRO-1 at dp > 1,
clipping active). Attention is left out: the example's attention is the Llama one ``test_nxd_llama`` covers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshpar.testing import run_distributed
from tests.compat.test_nxd_layers import _shard
from tests.compat.test_nxd_llama import (  # its model, vocabulary, width and sequence length
    H,
    Llama,
    train_step_like_dense,
)

E, TOP_K, INTER, LAYERS = 4, 2, 12, 2


class DenseExperts(nn.Module):
    """The dense twin of ``ExpertMLPs``' parameters: ``mlp_op.gate_up_proj.weight`` ``[E, H, 2I]`` (gate columns
    then up columns) and ``mlp_op.down_proj.weight`` ``[E, I, H]``."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp_op = nn.Module()
        self.mlp_op.gate_up_proj = nn.Module()
        self.mlp_op.down_proj = nn.Module()
        self.mlp_op.gate_up_proj.weight = nn.Parameter(torch.randn(E, H, 2 * INTER) * 0.2)
        self.mlp_op.down_proj.weight = nn.Parameter(torch.randn(E, INTER, H) * 0.2)


class DenseMoE(nn.Module):
    """Dropless top-2 routing by softmax affinities renormalised over the chosen experts."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Module()
        self.router.linear_router = nn.Linear(H, E, bias=False)
        self.expert_mlps = DenseExperts()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, H)
        logits = self.router.linear_router(tokens)
        affinities = F.softmax(logits, dim=1, dtype=torch.float64).to(x.dtype)
        chosen = torch.zeros_like(affinities).scatter(1, logits.topk(TOP_K, dim=1).indices, 1.0)
        weights = affinities * chosen
        weights = weights / weights.sum(dim=1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e in range(E):
            h = tokens @ self.expert_mlps.mlp_op.gate_up_proj.weight[e]
            h = F.silu(h[:, :INTER]) * h[:, INTER:]
            out = out + (h @ self.expert_mlps.mlp_op.down_proj.weight[e]) * weights[:, e : e + 1]
        return out.view(x.shape), logits


def _moe_layer() -> nn.Module:
    from meshpar.compat.nxd.modules.moe import ExpertMLPs, MoE, RouterTopK

    router = RouterTopK(num_experts=E, top_k=TOP_K, hidden_size=H)
    experts = ExpertMLPs(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=INTER, hidden_act="silu",
                         glu_mlp=True, capacity_factor=None, normalize_top_k_affinities=True)  # fmt: skip
    return MoE(router=router, expert_mlps=experts, return_router_logits=True, return_expert_index=False)


class DecoderLayer(nn.Module):
    def __init__(self, parallel: bool) -> None:
        super().__init__()
        from meshpar.compat.nxd.modules.rms_norm import RMSNorm

        self.post_attention_layernorm = RMSNorm(H, eps=1e-5)
        self.mlp = _moe_layer() if parallel else DenseMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))[0]


def Mixtral(parallel: bool) -> nn.Module:  # noqa: N802 - a model class's name, as the Llama test's
    """The Llama test's model (vocab-parallel embedding and head, ``parallel_cross_entropy`` inside ``forward``) with
    these MoE decoder layers."""
    return Llama(parallel, DecoderLayer, LAYERS)


def _local_part(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """This rank's part of a dense value, read off NxD's attributes: its ep rank's block of experts, then its tp
    shard (strided as the layer cuts it)."""
    from meshpar.compat.nxd.parallel_layers import parallel_state as ps

    if getattr(param, "expert_model_parallel", False):
        ep, ep_rank = ps.get_expert_model_parallel_size(), ps.get_expert_model_parallel_rank()
        value = value.chunk(ep)[ep_rank]
    if getattr(param, "tensor_model_parallel", False):
        tp, tp_rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
        value = _shard(value, param.partition_dim, tp, tp_rank, getattr(param, "partition_stride", 1))
    return value


def _stage_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters this rank holds, by their original names (a pipeline's local stages keep them)."""
    named = getattr(model, "local_named_parameters", None)
    return dict(named()) if callable(named) else dict(model.named_parameters())


def mixtral_case(tp: int, pp: int, ep: int = 2) -> None:
    import meshpar.compat.nxd as nxd
    from meshpar.compat.nxd.parallel_layers import parallel_state

    pipeline_config = {"transformer_layer_cls": DecoderLayer, "num_microbatches": 2, "output_loss_value_spec": True,
                       "input_names": ["input_ids", "labels"], "auto_partition": True,
                       "leaf_module_cls": ["RMSNorm"], "broadcast_and_average_loss": True}  # fmt: skip
    dp = 4 // (tp * pp)
    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, expert_parallel_size=ep,
        pipeline_config=pipeline_config if pp > 1 else None,
        optimizer_config={"zero_one_enabled": dp > 1, "grad_clipping": True, "max_grad_norm": 0.5},
    )  # fmt: skip
    try:
        torch.manual_seed(0)
        dense = Mixtral(parallel=False)
        dense_params = dict(dense.named_parameters())

        def build() -> nn.Module:
            torch.manual_seed(1)
            module = Mixtral(parallel=True)
            with torch.no_grad():
                for name, param in module.named_parameters():
                    param.copy_(_local_part(param, dense_params[name]))
            return module

        model = nxd.initialize_parallel_model(config, build)
        optimizer = nxd.initialize_parallel_optimizer(config, torch.optim.AdamW, model.parameters(), lr=3e-3)
        dense_optimizer = torch.optim.AdamW(dense.parameters(), lr=3e-3)
        for step in range(3):
            train_step_like_dense(model, optimizer, dense, dense_optimizer, step, rows=2, max_norm=0.5)
            held = _stage_params(model)
            experts = [name for name in held if ".expert_mlps." in name]  # every stage holds a MoE layer
            assert experts and all(getattr(held[name], "expert_model_parallel", False) for name in experts)
            for name, param in held.items():
                expected = _local_part(param, dense_params[name].detach())
                torch.testing.assert_close(param.detach(), expected, atol=3e-5, rtol=1e-4, msg=f"{name}, step {step}")
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["ep2_dp4", "tp2_ep2", "pp2_ep2"])
def test_nxd_mixtral_example_model_trains_like_dense_under_expert_parallelism(tp: int, pp: int) -> None:
    run_distributed(mixtral_case, 4, tp, pp)
