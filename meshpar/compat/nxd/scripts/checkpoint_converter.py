"""``neuronx_distributed.scripts.checkpoint_converter``: NxD's converter between one full (HF-style) state dict and
NxD's per-rank model files, ``CheckpointConverterBase``, with its command line and the hooks NxD's Llama, Mixtral and
DBRX examples subclass (partition dims, ``attribute_map``, ``layer_name_pattern``, the pre / post processing of the
full state).

    python convert_checkpoints.py --convert_from_full_state --input_dir full.pt --config config.json \\
        --output_dir ckpt/pretrained_weight --tp_size 8 --pp_size 4 --qkv_linear True --kv_size_multiplier 4 \\
        --hw_backend trn2
    python convert_checkpoints.py --convert_to_full_state --input_dir ckpt/step_100/model --config config.json \\
        --output_dir full/ --tp_size 8 --pp_size 4 --qkv_linear True --kv_size_multiplier 4 --hw_backend trn2

From a full state (``--input_dir``: a ``torch.save`` file or a ``.safetensors`` file; or ``--hf_model_name``, loaded
with transformers) it writes ``output_dir/model/dp_rank_00[_ep_rank_EE]_tp_rank_TT_pp_rank_PP.pt``, plain state dicts
that ``load_checkpoint(ckpt, tag="pretrained_weight", model=model, strict=False)`` loads (meshpar's view and NxD
alike). The other way it reads every rank's file (NxD's three namings; files written by meshpar's view too) and
writes ``output_dir/checkpoint.pt``.

What happens to a parameter is decided by its name, as in NxD: embeddings (``embed_tokens`` / ``wte``) and
``lm_head`` are cut along ``embedding_partition_dim``; with ``--qkv_linear`` the q / k / v weights become
``GQAQKVColumnParallelLinear``'s ``qkv_proj.weight_q|k|v`` (or one ``weight_qkv`` with ``--fuse_qkv``): key / value
heads repeated ``--kv_size_multiplier`` times as the layer holds them on ``--hw_backend`` (trn1: the whole set
repeated; trn2: each head repeated in place) and the query heads (and ``o_proj``'s columns) placed on the rank whose
key / value heads they read; otherwise q / k / v, ``o_proj`` and ``down_proj`` are cut along their partition dims;
``gate_proj`` and ``up_proj`` are cut and joined per rank into ``gate_up_proj`` (gate first: a stride-2
``ColumnParallelLinear``); ``expert_mlps`` weights are cut over ep along their first dim, then over tp like the rest;
everything else is whole on every rank. Layers go to pipeline ranks as NxD's ``create_partitions`` cuts them
(``--virtual_pp_size`` stages round the ranks); embeddings on the first, ``lm_head`` and the final norm on the last;
parameters other than experts on ep rank 0 only.

Where this differs from NxD's converter (each a case NxD's gets wrong or leaves unfinished; docs/nxd-migration.md):

- ``--hw_backend trn2`` repeats each key / value head in place (``repeat_interleave``), as NxD's trn2
  ``GQAQKVColumnParallelLinear`` (and meshpar's) holds them; NxD's converter repeats the whole set for both backends,
  which pairs trn2's query order with key / value heads of other groups.
- Under ep each ep rank's file holds its own experts (NxD's cuts the tp part out of every expert, so every ep rank
  gets them all).
- A fused ``weight_qkv`` is split by the configured q and key / value sizes (NxD's thirds need as many key / value
  heads as query heads); biases of q / k / v convert like their weights (``bias_q`` / ``bias_k`` / ``bias_v``).
- Boolean flags read "False", "0" and "no" as false (NxD's ``type=bool`` reads any word as true).
- torch_xla's split-tensor files are read (``--load_xser``, ``--convert_from_xser``) and written (``--save_xser``,
  ``--convert_to_xser``) without torch_xla; ``--convert_to_xser`` converts every ep rank's file (NxD's calls its
  loaders without an ep rank). ``--pad_attn_heads`` is refused by name.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from meshpar.compat.nxd import _xser
from meshpar.compat.nxd.pipeline.partition import create_partitions, stage_to_pipeline_parallel_rank
from meshpar.compat.nxd.scripts.yaml_converter import convert_yaml_to_json


def _flag(value: str | bool) -> bool:
    """A boolean command-line value: "False", "0", "no" and "" are false (NxD's ``type=bool`` takes them as true)."""
    if isinstance(value, bool):
        return value
    return value.strip().lower() not in ("false", "0", "no", "n", "off", "")


def _narrow(tensor: torch.Tensor, dim: int, rank: int, parts: int, name: str) -> torch.Tensor:
    """Part ``rank`` of ``parts`` equal parts of ``tensor`` along ``dim`` (refused where they are not equal)."""
    if tensor.shape[dim] % parts:
        raise ValueError(f"{name}: dim {dim} of {tuple(tensor.shape)} does not split into {parts} equal parts")
    size = tensor.shape[dim] // parts
    return tensor.narrow(dim, rank * size, size).clone()


def _halves(tensor: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = tensor.chunk(2, dim)
    return first, second


class CheckpointConverterBase:
    """NxD's checkpoint converter (see the module docstring). Subclasses override the partition dims, the layer
    pattern, ``attribute_map`` and the ``*_process_full_state_*`` hooks, as NxD's examples do."""

    # standard config key -> the model's own (dotted for nested dicts), for configs that name them differently
    attribute_map: ClassVar[dict[str, str]] = {}
    embedding_partition_dim = 0  # ParallelEmbedding, and the vocab-parallel lm_head
    qkv_partition_dim = 0  # ColumnParallelLinear / GQAQKVColumnParallelLinear
    gate_up_proj_partition_dim = 0  # ColumnParallelLinear
    down_proj_partition_dim = 1  # RowParallelLinear
    o_proj_partition_dim = 1  # RowParallelLinear
    layer_name = "layers"
    layer_name_pattern = r"^(model\.layers\.\d+)"

    # ---------------------------------------------------------------- config and names

    def _get_config_value(self, config: dict[str, Any], key: str) -> Any:
        """``config[key]``, else the value under ``attribute_map[key]`` (a dotted path into nested dicts)."""
        if key in config:
            return config[key]
        mapped = self.attribute_map.get(key)
        if mapped is not None:
            value: Any = config
            for part in mapped.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                return value
            if mapped in config:
                return config[mapped]
        raise KeyError(f"Could not find {key} or its mapped name in config")

    def get_partition_dim(self, name: str) -> int:
        if "embed_tokens" in name or "lm_head" in name or "wte" in name:
            return self.embedding_partition_dim
        if self.is_qkv_weight(name):
            return self.qkv_partition_dim
        if "gate_proj" in name or "up_proj" in name:
            return self.gate_up_proj_partition_dim
        if "down_proj" in name:
            return self.down_proj_partition_dim
        if "o_proj" in name:
            return self.o_proj_partition_dim
        raise AssertionError(f"Unknown partition_dim for {name}")

    def is_qkv_weight(self, name: str) -> bool:
        return any(part in name for part in ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value"))

    def get_fused_qkv_key(self) -> str:
        return "qkv_proj.weight_qkv"

    def get_hf_to_nxd_model_keys(self, qkv_linear: bool = True, is_gqa: bool = True) -> tuple[dict, dict]:
        """The last two name parts of q / k / v (HF) and their names in NxD's layer, both ways."""
        if qkv_linear:
            hf_to_nxd = {f"{p}_proj.{kind}": f"qkv_proj.{kind}_{p}" for p in "qkv" for kind in ("weight", "bias")}
        else:
            hf_to_nxd = {f"{p}_proj.{kind}": f"{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")}
        return hf_to_nxd, {nxd: hf for hf, nxd in hf_to_nxd.items()}

    def get_weight_key(self, keys_hf_to_nxd: dict, keys_nxd_to_hf: dict, name: str, hf_to_nxd: bool) -> str:
        if not self.is_qkv_weight(name):
            return name
        keys = keys_hf_to_nxd if hf_to_nxd else keys_nxd_to_hf
        head, tail = name.rsplit(".", 2)[0], ".".join(name.split(".")[-2:])
        return f"{head}.{keys[tail]}" if tail in keys else name

    _MEGATRON_TO_HF = (
        ("language_model.embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("language_model.encoder.final_layernorm.weight", "model.norm.weight"),
        ("language_model.encoder.", "model."),
        ("self_attention.", "self_attn."),
        ("core_attention.rotary_emb.inv_freq", "rotary_emb.inv_freq"),
        ("dense.weight", "o_proj.weight"),
        ("dense_h_to_4h.weight", "gate_up_proj.weight"),
        ("dense_4h_to_h.weight", "down_proj.weight"),
        ("language_model.output_layer.weight", "lm_head.weight"),
        ("query_key_value.weight", "qkv_proj.weight"),
    )

    def rename_keys_for_megatron(self, key: str, model_style: str, hf_to_nxdt: bool = False) -> str:
        """A Megatron-LM name as the HF one (or back, ``hf_to_nxdt``); other styles unchanged. The whole-name
        entries (embedding, final norm) end the renaming."""
        if model_style != "megatron":
            return key
        for megatron, hf in self._MEGATRON_TO_HF:
            before = key
            key = key.replace(hf, megatron) if hf_to_nxdt else key.replace(megatron, hf)
            if key != before and any(word in megatron + hf for word in ("embed", "final_layernorm", "model.norm")):
                break
        return key

    def is_q_or_o_for_megatron(self, args: argparse.Namespace, name: str) -> bool:
        """Megatron-style attention keeps its query heads in order (no regrouping around replicated kv heads)."""
        return args.model_style == "megatron" and ("q" in name or "o_proj" in name)

    def modify_qkv_for_megatron(self, partial_state: dict[str, torch.Tensor], args: argparse.Namespace) -> None:
        """Megatron-LM's attention weights: one ``query_key_value`` (without ``--qkv_linear``) or ``query`` and
        ``key_value`` (with it), to and from the per-part names, in place."""
        if args.model_style != "megatron":
            return
        to_megatron = bool(args.convert_from_full_state)
        for key in list(partial_state):
            if key not in partial_state:
                continue
            if not args.qkv_linear:
                if to_megatron and "q_proj" in key:
                    parts = [partial_state.pop(key.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
                    partial_state[key.replace("q_proj", "query_key_value")] = torch.cat(parts, 0)
            elif to_megatron:
                if "query_key_value.weight_q" in key:
                    partial_state[key.replace("query_key_value.weight_q", "query.weight")] = partial_state.pop(key)
                elif key.endswith("query_key_value.weight_k"):
                    v_key = key.replace("weight_k", "weight_v")
                    kv = torch.cat([partial_state.pop(key), partial_state.pop(v_key)], 0)
                    partial_state[key.replace("query_key_value.weight_k", "key_value.weight")] = kv
            elif "query.weight" in key:
                partial_state[key.replace("query.weight", "qkv_proj.weight_q")] = partial_state.pop(key)
            elif "key_value.weight" in key:
                k, v = _halves(partial_state.pop(key), 0)
                partial_state[key.replace("key_value.weight", "qkv_proj.weight_k")] = k
                partial_state[key.replace("key_value.weight", "qkv_proj.weight_v")] = v

    # ---------------------------------------------------------------- fused q / k / v

    def coalesce_qkv(self, state_dict: dict[str, torch.Tensor], config: dict, tp_degree: int) -> dict:
        """Each layer's q, k, v weights as one ``qkv_proj.weight`` whose contiguous tp parts are ``[q_r | k_r |
        v_r]`` (a stride-3 ``ColumnParallelLinear``; as many kv heads as query heads)."""
        for i in range(self._get_config_value(config, "num_hidden_layers")):
            prefix = f"model.layers.{i}.self_attn."
            q, k, v = (state_dict.pop(f"{prefix}{p}_proj.weight") for p in "qkv")
            per_rank = [
                torch.cat([_narrow(t, 0, rank, tp_degree, prefix) for t in (q, k, v)], self.qkv_partition_dim)
                for rank in range(tp_degree)
            ]
            state_dict[f"{prefix}qkv_proj.weight"] = torch.cat(per_rank, self.qkv_partition_dim)
        return state_dict

    def find_size(self, size_total: int) -> int:
        """A third of a fused q / k / v size (when no configured sizes are known)."""
        return int(size_total / 3)

    def convert_partial_state_to_non_fused_qkv(
        self, partial_state: dict, keys_nxd_to_hf: dict, kv_size_multiplier: int, num_hidden_layers: int
    ) -> dict:
        """Each ``weight_qkv`` / ``bias_qkv`` of one rank split into its q, k and v rows (by the configured sizes
        where :meth:`merge_tp_checkpoints` knows them)."""
        fused = self.get_fused_qkv_key()
        for key in [k for k in partial_state if k.endswith(fused) or k.endswith(fused.replace("weight", "bias"))]:
            tensor = partial_state.pop(key)
            sizes = getattr(self, "_qkv_rows", None) or [self.find_size(tensor.shape[0])] * 3
            head = key[: -len("_qkv")]
            for part, piece in zip("qkv", torch.split(tensor, sizes, 0), strict=True):
                partial_state[f"{head}_{part}"] = piece
        return partial_state

    def convert_partial_state_to_fused_qkv(
        self, partial_state: dict, keys_nxd_to_hf: dict, num_hidden_layers: int
    ) -> dict:
        """Each rank's ``weight_q`` / ``weight_k`` / ``weight_v`` (and biases) as one ``weight_qkv`` (q, k, v rows)."""
        for key in [k for k in partial_state if re.search(r"qkv_proj\.(weight|bias)_q$", k)]:
            head = key[: -len("_q")]
            partial_state[f"{head}_qkv"] = torch.cat([partial_state.pop(f"{head}_{p}") for p in "qkv"], 0)
        return partial_state

    # ---------------------------------------------------------------- layouts

    def _attention(self, config: dict, args: argparse.Namespace) -> dict[str, int]:
        q_heads = self._get_config_value(config, "num_attention_heads")
        try:
            kv_heads = self._get_config_value(config, "num_key_value_heads")
        except KeyError:  # a config from before grouped-query attention: as many as query heads
            kv_heads = q_heads
        head_dim = config.get("head_dim") or self._get_config_value(config, "hidden_size") // q_heads
        multiplier = args.kv_size_multiplier
        if args.qkv_linear and (kv_heads * multiplier) % args.tp_size:
            raise ValueError(
                f"{kv_heads} key/value heads x kv_size_multiplier {multiplier} do not split over tp={args.tp_size}"
            )
        if args.qkv_linear and q_heads % args.tp_size:
            raise ValueError(f"{q_heads} query heads do not split over tp={args.tp_size}")
        return {"q": q_heads, "kv": kv_heads, "head_dim": head_dim, "m": multiplier}

    def _query_heads(self, rank: int, args: argparse.Namespace, attn: dict[str, int], name: str) -> list[int]:
        """The query heads rank ``rank`` holds, in its order: each next to the key / value head it reads. trn2 (and
        Megatron style, and without replicas) keeps them in order; trn1's replicas of the whole key / value set give
        each rank a share of one group."""
        tp, q, kv, m = args.tp_size, attn["q"], attn["kv"], attn["m"]
        per_rank = q // tp
        if m == 1 or args.hw_backend != "trn1" or self.is_q_or_o_for_megatron(args, name):
            return list(range(rank * per_rank, (rank + 1) * per_rank))
        group = q // kv
        if group % m:
            raise ValueError(f"{group} query heads per key/value head do not split over kv_size_multiplier {m}")
        slots_per_rank, share = kv * m // tp, group // m
        heads: list[int] = []
        for slot in range(rank * slots_per_rank, (rank + 1) * slots_per_rank):
            start = (slot % kv) * group + (slot // kv) * share
            heads += range(start, start + share)
        return heads

    def _replicated_kv(self, full: torch.Tensor, args: argparse.Namespace, attn: dict[str, int]) -> torch.Tensor:
        """Key / value rows with each head present ``kv_size_multiplier`` times, as the layer holds them."""
        m = attn["m"]
        if m == 1:
            return full
        heads = full.reshape(attn["kv"], -1, *full.shape[1:])
        if args.hw_backend == "trn1":  # the whole set, m times
            repeated = heads.repeat(m, *([1] * (heads.dim() - 1)))
        else:  # each head m times in place
            repeated = heads.repeat_interleave(m, 0)
        return repeated.reshape(-1, *full.shape[1:])

    def _unreplicated_kv(self, full: torch.Tensor, args: argparse.Namespace, attn: dict[str, int]) -> torch.Tensor:
        m = attn["m"]
        if m == 1:
            return full
        heads = full.reshape(attn["kv"] * m, -1, *full.shape[1:])
        kept = heads[: attn["kv"]] if args.hw_backend == "trn1" else heads[::m]
        return kept.reshape(-1, *full.shape[1:]).clone()

    def _heads_of(self, full: torch.Tensor, heads: list[int], dim: int, attn: dict[str, int]) -> torch.Tensor:
        """The rows (``dim`` 0) or columns (``dim`` 1) of ``full`` that belong to ``heads``, in that order."""
        index = torch.tensor(heads)[:, None] * attn["head_dim"] + torch.arange(attn["head_dim"])
        return full.index_select(dim, index.reshape(-1)).clone()

    def _stage_of(self, name: str, partitions: list[str], pp_size: int) -> int | None:
        """The pp rank holding ``name`` (``None``: every rank)."""
        if self.layer_name not in name:
            return None
        layer = int(name.split(".")[2])
        stage = next((s for s, cut in enumerate(partitions) if layer <= int(cut.split(".")[2])), len(partitions))
        return stage_to_pipeline_parallel_rank(stage, pp_size=pp_size)

    # ---------------------------------------------------------------- full -> per rank

    def convert_full_state_to_tp(
        self,
        full_state: dict[str, torch.Tensor],
        args: argparse.Namespace,
        tp_rank: int,
        pp_rank: int,
        ep_rank: int,
        partitions: list[str],
        config: dict,
    ) -> dict[str, torch.Tensor]:
        """The state dict of rank (``tp_rank``, ``pp_rank``, ``ep_rank``) cut from the full state."""
        pp, ep = args.pp_size, args.ep_size
        attn = self._attention(config, args)
        hf_to_nxd, _ = self.get_hf_to_nxd_model_keys(args.qkv_linear, attn["q"] != attn["kv"])
        partial: dict[str, torch.Tensor] = {}
        for name, full in full_state.items():
            if pp_rank != 0 and ("embed_tokens" in name or "wte" in name):
                continue
            last_only = ("lm_head", "model.norm.weight", "norm_f.weight")
            if pp_rank != pp - 1 and any(word in name for word in last_only):
                continue
            stage = self._stage_of(name, partitions, pp)
            if stage is not None and stage != pp_rank:
                continue
            expert = "expert_mlps" in name
            if ep_rank != 0 and not expert:
                continue
            if expert:
                if full.shape[0] % ep:
                    raise ValueError(f"{name}: {full.shape[0]} experts do not split over ep={ep}")
                full = _narrow(full, 0, ep_rank, ep, name)
            for key, part in self._tp_part(name, full, args, tp_rank, attn, config).items():
                key = self.get_weight_key(hf_to_nxd, {}, key, True) if args.qkv_linear else key
                if key in partial:  # gate_proj and up_proj meet in gate_up_proj, gate first
                    first, second = (part, partial[key]) if "gate_proj" in name else (partial[key], part)
                    part = torch.cat([first, second], self.get_partition_dim(key))
                partial[key] = part
        for key in list(partial):
            partial[self.rename_keys_for_megatron(key, args.model_style, hf_to_nxdt=True)] = partial.pop(key)
        self.modify_qkv_for_megatron(partial, args)
        if args.fuse_qkv:
            partial = self.convert_partial_state_to_fused_qkv(partial, {}, args.n_layers)
        return partial

    def _i_tp(self, config: dict, args: argparse.Namespace) -> int:
        return self._get_config_value(config["ffn_config"], "ffn_hidden_size") // args.tp_size

    def _padded(self, part: torch.Tensor, dim: int, config: dict, args: argparse.Namespace) -> torch.Tensor:
        """``--i_tp_round_factor``: the intermediate features of a rank padded with zeros to a multiple of it."""
        if args.i_tp_round_factor <= 0:
            return part
        size = self._i_tp(config, args)
        target = -(-size // args.i_tp_round_factor) * args.i_tp_round_factor
        shape = list(part.shape)
        shape[dim] = target
        padded = part.new_zeros(shape)
        padded.narrow(dim, 0, part.shape[dim]).copy_(part)
        return padded

    def _tp_part(
        self, name: str, full: torch.Tensor, args: argparse.Namespace, rank: int, attn: dict, config: dict
    ) -> dict[str, torch.Tensor]:
        """``{name: part}`` of rank ``rank`` (gate_proj / up_proj come back under ``gate_up_proj``)."""
        tp = args.tp_size
        if self._row_bias(name):  # a row-parallel layer's bias is added once, after the sum over tp: whole
            return {name: full}
        qkv = self.is_qkv_weight(name) and not any(w in name for w in ("qkv_proj", "query_key_value"))
        if args.qkv_linear and (qkv or "o_proj" in name):
            if "k_proj" in name or "v_proj" in name:
                return {name: _narrow(self._replicated_kv(full, args, attn), 0, rank, tp, name)}
            heads = self._query_heads(rank, args, attn, name)
            return {name: self._heads_of(full, heads, 1 if "o_proj" in name else 0, attn)}
        if "gate_proj" in name or "up_proj" in name:
            dim = self.get_partition_dim(name)
            if "gate_up_proj" in name:  # already [gate | up]: each half cut, then joined
                parts = [_narrow(half, dim, rank, tp, name) for half in _halves(full, dim)]
                return {name: torch.cat([self._padded(p, dim, config, args) for p in parts], dim)}
            token = "gate_proj" if "gate_proj" in name else "up_proj"
            part = self._padded(_narrow(full, dim, rank, tp, name), dim, config, args)
            return {name.replace(token, "gate_up_proj"): part}
        column = ("embed_tokens", "wte", "lm_head", "o_proj", "down_proj")
        if self.is_qkv_weight(name) or any(word in name for word in column):
            dim = self.get_partition_dim(name)
            part = _narrow(full, dim, rank, tp, name)
            return {name: self._padded(part, dim, config, args) if "down_proj" in name else part}
        return {name: full}

    # ---------------------------------------------------------------- per rank -> full

    def _read_rank(self, args: argparse.Namespace, tp_rank: int, pp_rank: int, ep_rank: int) -> dict:
        if args.load_xser:
            return self.load_partial_xser(args, tp_rank, pp_rank, ep_rank)
        state = self.load_partial_no_xser(args, tp_rank, pp_rank, ep_rank)
        if isinstance(state, dict) and "layout" in state and "state" in state:  # written by meshpar's NxD view
            state = state["state"]
        if args.model_key is not None and args.model_key in state:
            state = state[args.model_key]
        state = {self.rename_keys_for_megatron(k, args.model_style): v.cpu() for k, v in state.items()}
        self.modify_qkv_for_megatron(state, args)
        if args.fuse_qkv:
            state = self.convert_partial_state_to_non_fused_qkv(state, {}, args.kv_size_multiplier, args.n_layers)
        return state

    def merge_tp_checkpoints(self, args: argparse.Namespace) -> dict[str, torch.Tensor]:
        """The full state put back together from every rank's file."""
        with open(args.config) as file:
            config = json.load(file)
        attn = self._attention(config, args)
        tp, pp, ep = args.tp_size, args.pp_size, args.ep_size
        q_rows = attn["q"] * attn["head_dim"] // tp
        kv_rows = attn["kv"] * attn["m"] * attn["head_dim"] // tp
        self._qkv_rows = [q_rows, kv_rows, kv_rows]
        _, nxd_to_hf = self.get_hf_to_nxd_model_keys(args.qkv_linear, attn["q"] != attn["kv"])
        # name -> tp rank -> ep rank -> part
        parts: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
        for tp_rank in range(tp):
            for pp_rank in range(pp):
                for ep_rank in range(ep):
                    for name, tensor in self._read_rank(args, tp_rank, pp_rank, ep_rank).items():
                        parts.setdefault(name, {}).setdefault(tp_rank, {})[ep_rank] = tensor
        full: dict[str, torch.Tensor] = {}
        for name, by_tp in parts.items():
            if len(by_tp) != tp and self._is_split(name, args):
                raise ValueError(f"{name}: found on tp ranks {sorted(by_tp)} of {tp}")
            per_tp = [torch.cat([by_ep[e] for e in sorted(by_ep)], 0) if "expert_mlps" in name else by_ep[min(by_ep)]
                      for _, by_ep in sorted(by_tp.items())]  # fmt: skip
            hf_name = self.get_weight_key({}, nxd_to_hf, name, False) if args.qkv_linear else name
            full.update(self._merged(hf_name, per_tp, args, attn, config))
        return self.post_process_full_state_after_tp_conversion(full, args)

    def _row_bias(self, name: str) -> bool:
        return name.endswith(".bias") and ("o_proj" in name or "down_proj" in name)

    def _is_split(self, name: str, args: argparse.Namespace) -> bool:
        column = ("embed_tokens", "wte", "lm_head", "o_proj", "down_proj", "gate_proj", "up_proj")
        return not self._row_bias(name) and (self.is_qkv_weight(name) or any(word in name for word in column))

    def _unpadded(self, part: torch.Tensor, dim: int, config: dict, args: argparse.Namespace) -> torch.Tensor:
        if args.i_tp_round_factor <= 0:
            return part
        return part.narrow(dim, 0, self._i_tp(config, args))

    def _merged(
        self, name: str, per_tp: list[torch.Tensor], args: argparse.Namespace, attn: dict, config: dict
    ) -> dict[str, torch.Tensor]:
        """``{hf name: full}`` from the tp ranks' parts of ``name`` (``gate_up_proj`` back into gate and up)."""
        qkv = self.is_qkv_weight(name) and not any(w in name for w in ("qkv_proj", "query_key_value"))
        if self._row_bias(name):
            return {name: per_tp[0]}
        if args.qkv_linear and (qkv or "o_proj" in name):
            if "k_proj" in name or "v_proj" in name:
                return {name: self._unreplicated_kv(torch.cat(per_tp, 0), args, attn)}
            dim = 1 if "o_proj" in name else 0
            heads = [h for rank in range(args.tp_size) for h in self._query_heads(rank, args, attn, name)]
            order = torch.tensor(heads)[:, None] * attn["head_dim"] + torch.arange(attn["head_dim"])
            together = torch.cat(per_tp, dim)
            merged = torch.empty_like(together)
            merged.index_copy_(dim, order.reshape(-1), together)
            return {name: merged}
        if not args.qkv_linear and name.endswith("qkv_proj.weight"):  # a stride-3 [q_r | k_r | v_r] per rank
            dim = self.get_partition_dim(name)
            rows = [attn[key] * attn["head_dim"] // args.tp_size for key in ("q", "kv", "kv")]
            split = [part.split(rows, dim) for part in per_tp]
            return {
                name.replace("qkv_proj", f"{p}_proj"): torch.cat([pieces[i] for pieces in split], dim)
                for i, p in enumerate("qkv")
            }
        if "gate_up_proj" in name:
            dim = self.get_partition_dim(name)
            halves = [_halves(part, dim) for part in per_tp]
            merged = {}
            for i, token in enumerate(("gate_proj", "up_proj")):
                merged[name.replace("gate_up_proj", token)] = torch.cat(
                    [self._unpadded(h[i], dim, config, args) for h in halves], dim
                )
            return merged
        if self._is_split(name, args):
            dim = self.get_partition_dim(name)
            if "down_proj" in name:
                per_tp = [self._unpadded(part, dim, config, args) for part in per_tp]
            return {name: torch.cat(per_tp, dim)}
        return {name: per_tp[0]}

    # ---------------------------------------------------------------- hooks for subclasses

    def pre_process_full_state_before_tp_conversion(self, full_state: dict, args: argparse.Namespace) -> dict:
        """Subclasses reshape the full state before it is cut (e.g. stack experts)."""
        return full_state

    def post_process_full_state_after_tp_conversion(self, full_state: dict, args: argparse.Namespace) -> dict:
        """Subclasses reshape the merged full state (e.g. unstack experts)."""
        return full_state

    # ---------------------------------------------------------------- files

    def download_and_save_hf_model(self, model_identifier: str, config_path: str | None = None) -> dict:
        """The state dict of a Hub model, loaded with transformers (a token from ``HF_TOKEN`` if one is needed; NxD
        asks for it on the terminal)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(config_path) if config_path else None
        model = AutoModelForCausalLM.from_pretrained(model_identifier, config=config, token=os.environ.get("HF_TOKEN"))
        return model.state_dict()

    def load_full_state(self, args: argparse.Namespace) -> dict[str, torch.Tensor]:
        if args.input_dir:
            if str(args.input_dir).endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(args.input_dir)
            return torch.load(args.input_dir, map_location="cpu", weights_only=False)
        if args.hf_model_name:
            return self.download_and_save_hf_model(args.hf_model_name, args.config)
        raise ValueError("Error: Please provide either HuggingFace model name or input path to consolidated statedict")

    def get_input_filename(self, args: argparse.Namespace, tp_rank: int, pp_rank: int, ep_rank: int, xser: bool) -> str:
        """The rank's file under ``--input_dir`` in any of NxD's namings: ``tp_rank_TT_pp_rank_PP/checkpoint.pt``
        (``parallel_layers.save``), ``dp_rank_00_tp_rank_TT_pp_rank_PP.pt`` and ``dp_rank_00_ep_rank_EE_...``."""
        rank = f"tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}"
        candidates = [
            os.path.join(args.input_dir, rank) if xser else os.path.join(args.input_dir, rank, "checkpoint.pt"),
            os.path.join(args.input_dir, f"dp_rank_00_{rank}.pt"),
            os.path.join(args.input_dir, f"dp_rank_00_ep_rank_{ep_rank:02d}_{rank}.pt"),
        ]
        for candidate in candidates:
            if os.path.exists(candidate):
                return candidate
        raise RuntimeError(f"Error: none of {candidates} exist")

    def get_output_filename(
        self, args: argparse.Namespace, tp_rank: int, pp_rank: int, ep_rank: int, xser: bool
    ) -> str:
        ep = f"_ep_rank_{ep_rank:02d}" if args.ep_size > 1 else ""
        return os.path.join(args.output_dir, "model", f"dp_rank_00{ep}_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt")

    def load_partial_xser(self, args: argparse.Namespace, tp_rank: int, pp_rank: int, ep_rank: int) -> dict:
        """A rank's file in torch_xla's split-tensor format, read without torch_xla (:mod:`..._xser`)."""
        state = _xser.load(self.get_input_filename(args, tp_rank, pp_rank, ep_rank, True))
        self.prune_state(state, ep_rank)
        return state

    def prune_state(self, state: dict, ep_rank: int) -> None:
        """Drop the entries an ep rank's file leaves empty (``None``)."""
        if ep_rank > 0:
            for key in [k for k, v in state.items() if v is None]:
                state.pop(key)

    def load_partial_no_xser(self, args: argparse.Namespace, tp_rank: int, pp_rank: int, ep_rank: int) -> dict:
        return torch.load(self.get_input_filename(args, tp_rank, pp_rank, ep_rank, False), weights_only=False)

    def save_full(self, args: argparse.Namespace, full_state: dict) -> None:
        path = Path(args.output_dir)
        path.mkdir(parents=True, exist_ok=True)
        target = path / "checkpoint.pt"
        print(f"Saving full checkpoint to {target}")
        torch.save(full_state, target)

    def save_partial_xser(
        self, args: argparse.Namespace, partial_state: dict, tp_rank: int, pp_rank: int, ep_rank: int
    ) -> None:
        """A rank's file in torch_xla's split-tensor format (:mod:`..._xser`), under NxD's name for it."""
        self._save_partial(self.get_output_filename(args, tp_rank, pp_rank, ep_rank, True), partial_state, True)

    def save_partial_no_xser(
        self, args: argparse.Namespace, partial_state: dict, tp_rank: int, pp_rank: int, ep_rank: int
    ) -> None:
        self._save_partial(self.get_output_filename(args, tp_rank, pp_rank, ep_rank, False), partial_state, False)

    @staticmethod
    def _save_partial(filename: str, partial_state: dict, xser: bool) -> None:
        os.makedirs(os.path.dirname(filename), exist_ok=True)
        print(f"Saving to {filename}")
        (_xser.save if xser else torch.save)(partial_state, filename)

    @staticmethod
    def _ranks(args: argparse.Namespace) -> Iterator[tuple[int, int, int]]:
        """Every (tp, pp, ep) rank's file, in NxD's order."""
        return itertools.product(range(args.tp_size), range(args.pp_size), range(args.ep_size))

    def convert_from_xser(self, args: argparse.Namespace) -> None:
        """Every rank's split-tensor file rewritten as a plain torch file (``output_dir/model/...``)."""
        for ranks in self._ranks(args):
            self.save_partial_no_xser(args, self.load_partial_xser(args, *ranks), *ranks)

    def convert_to_xser(self, args: argparse.Namespace) -> None:
        """Every rank's plain torch file rewritten in the split-tensor format (``output_dir/model/...``)."""
        for ranks in self._ranks(args):
            self.save_partial_xser(args, self.load_partial_no_xser(args, *ranks), *ranks)

    def convert_from_full_state(self, args: argparse.Namespace) -> None:
        full_state = self.load_full_state(args)
        layer_names = sorted(
            {m.group(1) for key in full_state if (m := re.match(self.layer_name_pattern, key))},
            key=lambda layer: int(re.search(r"\d+", layer).group()),
        )
        partitions = create_partitions(args.pp_size * args.virtual_pp_size, layer_names) if layer_names else []
        print(f"pipeline_cuts {partitions}")
        with open(args.config) as file:
            config = json.load(file)
        if args.coalesce_qkv:
            full_state = self.coalesce_qkv(full_state, config, args.tp_size)
        full_state = self.pre_process_full_state_before_tp_conversion(full_state, args)
        for tp_rank in range(args.tp_size):
            for pp_rank in range(args.pp_size):
                for ep_rank in range(args.ep_size):
                    partial = self.convert_full_state_to_tp(
                        full_state, args, tp_rank, pp_rank, ep_rank, partitions, config
                    )
                    if args.save_xser:
                        self.save_partial_xser(args, partial, tp_rank, pp_rank, ep_rank)
                    else:
                        self.save_partial_no_xser(args, partial, tp_rank, pp_rank, ep_rank)

    def convert_to_full_state(self, args: argparse.Namespace) -> None:
        self.save_full(args, self.merge_tp_checkpoints(args))

    # ---------------------------------------------------------------- command line

    def get_arg_parser(self) -> argparse.ArgumentParser:
        """NxD's arguments (subclasses add their own)."""
        parser = argparse.ArgumentParser()
        add = parser.add_argument
        add("--input_dir", type=str, default=None, help="full state file (from), or the per-rank files' folder (to)")
        add("--hf_model_name", type=str, default=None, help="a Hub model to convert from")
        add("--output_dir", type=str, required=True, help="where to write")
        add("--hw_backend", type=str, required=True, help="trn1 or trn2: how replicated key/value heads are laid out")
        add("--config", type=str, help="the model's config.json")
        add("--model_key", type=str, default="model", help="the state dict's key inside a rank's file, if wrapped")
        add("--tp_size", type=int, default=1)
        add("--pp_size", type=int, default=1)
        add("--ep_size", type=int, default=1)
        add("--virtual_pp_size", type=int, default=1)
        add("--n_layers", type=int, default=0)
        add("--coalesce_qkv", type=_flag, default=False, help="join q, k, v into one stride-3 qkv_proj.weight")
        add("--kv_size_multiplier", type=int, default=1, help="how many times the key/value heads are replicated")
        add("--qkv_linear", type=_flag, default=False, help="q, k, v as GQAQKVColumnParallelLinear's weights")
        add("--fuse_qkv", type=_flag, default=False, help="GQAQKVColumnParallelLinear's fused weight_qkv")
        add("--i_tp_round_factor", type=int, default=0, help="pad each rank's ffn features to a multiple of this")
        add("--pad_attn_heads", type=_flag, default=False, help="not provided")
        add("--load_xser", type=_flag, default=False, help="read torch_xla's split-tensor files")
        add("--save_xser", type=_flag, default=False, help="write torch_xla's split-tensor files")
        add("--convert_from_xser", action="store_true", help="torch_xla's split-tensor files -> plain torch files")
        add("--convert_to_xser", action="store_true", help="plain torch files -> torch_xla's split-tensor files")
        add("--convert_from_full_state", action="store_true", help="full state -> per-rank files")
        add("--convert_to_full_state", action="store_true", help="per-rank files -> full state")
        add("--model_style", type=str, choices=["hf", "megatron"], default="hf", help="the names of the full state")
        add("--nxdt_yaml_config", type=str, help="an NxDT YAML config instead of --config")
        return parser

    def run(self, args: argparse.Namespace) -> None:
        flags = ["convert_from_full_state", "convert_to_full_state", "convert_from_xser", "convert_to_xser"]
        if sum(bool(getattr(args, flag)) for flag in flags) != 1:
            raise ValueError("Exactly one '--convert_*' flag must be specified")
        if args.pad_attn_heads:
            raise NotImplementedError("--pad_attn_heads is not provided (NxD's converter leaves trn2's unfinished)")
        if (args.convert_to_full_state or args.convert_from_xser or args.convert_to_xser) and not args.input_dir:
            raise ValueError("--input_dir must name the folder of the per-rank files to read")
        if args.hw_backend not in ("trn1", "trn2"):
            raise ValueError(f"--hw_backend must be trn1 or trn2, not {args.hw_backend!r}")
        if args.nxdt_yaml_config:
            args.config = convert_yaml_to_json(args.nxdt_yaml_config)
        if args.convert_from_full_state:
            self.convert_from_full_state(args)
        elif args.convert_to_full_state:
            self.convert_to_full_state(args)
        elif args.convert_from_xser:
            self.convert_from_xser(args)
        else:
            self.convert_to_xser(args)
