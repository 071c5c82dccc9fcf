"""``neuronx_distributed.optimizer.convert_zero_checkpoints``: NxD's converter of ZeRO-1 optimizer states between
dp sizes, for the view's checkpoints (``save_checkpoint`` with a ZeRO-1 optimizer).

A ZeRO-1 state is split by parameter over the dp ranks, one file each (``optim/dp_rank_DD_tp_rank_XX_pp_rank_YY.pt``).
``--convert_to_full`` writes, per (tp, pp) rank, ``optim/full_tp_rank_XX_pp_rank_YY.pt`` holding every parameter's
entry; ``--convert_to_sharded --dp_size N`` writes N dp files from a full or sharded state (each holding every entry:
a rank's optimizer takes the parameters it owns at that dp size). ``load_checkpoint`` already reads a ZeRO-1 state
saved at another dp size directly; converting is for tools that want one file, or a fixed dp layout on disk. Run as
``python -m meshpar.compat.nxd.optimizer.convert_zero_checkpoints --input_dir TAG --output_dir OUT ...`` (``TAG``
the checkpoint's tag directory, the one holding ``optim/``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

_SHARDED = re.compile(r"dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
_FULL = re.compile(r"full_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")


def _optim(directory: str) -> Path:
    return Path(directory) / "optim"


def is_full(args: Any) -> bool:
    """Whether ``args.input_dir`` holds full (converted) optimizer states."""
    return any(_FULL.search(p.name) for p in _optim(args.input_dir).iterdir())


def is_xser(args: Any) -> bool:
    """Whether the states are in torch_xla's split-tensor format: never for the view's checkpoints."""
    return any(p.is_dir() and p.name.endswith(".tensors") for p in _optim(args.input_dir).iterdir())


def get_parallel_info(args: Any) -> tuple[int, int, int]:
    """``(dp, tp, pp)`` sizes of the saved states (dp is 0 for full states: they have no dp split)."""
    dp = tp = pp = 0
    for path in _optim(args.input_dir).iterdir():
        if match := _SHARDED.search(path.name):
            d, t, p = map(int, match.groups())
            dp, tp, pp = max(dp, d + 1), max(tp, t + 1), max(pp, p + 1)
        elif match := _FULL.search(path.name):
            t, p = map(int, match.groups())
            tp, pp = max(tp, t + 1), max(pp, p + 1)
    return dp, tp, pp


def read_full_state(
    optim_dir: Path, tp_rank: int, pp_rank: int, map_location: Any = "cpu", ep_rank: int | None = None
) -> dict[str, Any]:
    """One (tp, pp) rank's ZeRO-1 state with every parameter's entry, ``{"layout", "state": {"state",
    "param_groups"}}``: the full file if there is one, else the union of the dp files (each dp rank owned whole
    parameters). Every file read must have been written at the same tp / pp / ep sizes (``layout``, dp set to 0).
    A state saved under expert parallelism has different experts' entries under one index on the dp ranks of an ep
    group (dp rank ``d`` is ep rank ``d % ep``): ``ep_rank`` picks whose, by reading that ep rank's files last (they
    hold every entry of its experts; dense entries are the same in every file); without it such a state is refused."""
    full = optim_dir / f"full_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt"
    files = (
        [full] if full.exists() else sorted(optim_dir.glob(f"dp_rank_*_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt"))
    )
    if not files:
        raise FileNotFoundError(f"{optim_dir} holds no ZeRO-1 state of tp rank {tp_rank}, pp rank {pp_rank}")
    payloads = []
    for file in files:
        payload = torch.load(file, map_location=map_location, weights_only=False)
        match = _SHARDED.search(file.name)
        payloads.append((int(match.group(1)) if match else 0, payload))
    layouts = {(p["layout"]["tp"], p["layout"]["pp"], p["layout"].get("ep", 1)) for _, p in payloads}
    if len(layouts) != 1:
        raise ValueError(f"{optim_dir}: files of tp rank {tp_rank}, pp rank {pp_rank} from different layouts {layouts}")
    ((tp, pp, ep),) = layouts
    if ep > 1:
        if ep_rank is None:
            raise ValueError(
                f"{optim_dir}: a ZeRO-1 state saved at expert-parallel size {ep} has one set of expert entries per ep "
                "rank; it is read by load_checkpoint at the same ep size, not merged into one state"
            )
        payloads.sort(key=lambda item: item[0] % ep == ep_rank)  # this ep rank's files last (a stable sort)
    merged: dict[str, Any] = {"state": {}, "param_groups": None}
    for _, payload in payloads:
        merged["state"].update(payload["state"]["state"])
        merged["param_groups"] = payload["state"]["param_groups"]
    return {"layout": {"tp": tp, "pp": pp, "dp": 0, "ep": ep}, "state": merged}


def merge_optim_dp_checkpoints(args: Any, tp_rank: int, pp_rank: int) -> dict[str, Any]:
    """One (tp, pp) rank's full state, put together from ``args.input_dir``'s dp files."""
    return read_full_state(_optim(args.input_dir), tp_rank, pp_rank)


def split_and_save_ckpts(args: Any, merged_ckpt: dict[str, Any], tp_rank: int, pp_rank: int) -> None:
    """Write ``args.new_dp_size`` dp files of one (tp, pp) rank from its full state (renamed into place)."""
    if not args.new_dp_size or args.new_dp_size < 1:
        raise ValueError("--convert_to_sharded needs --dp_size (the new dp size)")
    layout = {**merged_ckpt["layout"], "dp": args.new_dp_size}
    for dp_rank in range(args.new_dp_size):
        name = f"dp_rank_{dp_rank:02d}_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt"
        _save(_optim(args.output_dir) / name, {"layout": layout, "state": merged_ckpt["state"]})


def _save(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    torch.save(payload, temporary)
    temporary.replace(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input_dir", type=str, required=True, help="a checkpoint tag directory (holding optim/)")
    parser.add_argument("--output_dir", type=str, required=True, help="where to write optim/")
    parser.add_argument("--num_workers", type=int, default=1, help="accepted; conversion runs in this process")
    parser.add_argument("--dp_size", type=int, default=None, help="the new dp size (--convert_to_sharded)")
    choice = parser.add_mutually_exclusive_group(required=True)
    choice.add_argument("--convert_to_full", action="store_true", help="write one full state per (tp, pp) rank")
    choice.add_argument("--convert_to_sharded", action="store_true", help="write --dp_size dp files")
    args, _ = parser.parse_known_args(argv)
    args.is_xser = is_xser(args)
    if args.is_xser:
        raise ValueError(f"{args.input_dir} holds torch_xla split-tensor files, which the view does not read")
    args.new_dp_size = args.dp_size
    args.dp_size, args.tp_size, args.pp_size = get_parallel_info(args)
    if args.convert_to_full and is_full(args):
        raise ValueError("Invalid inputs: convert full optim states to full optim states")
    for tp_rank in range(args.tp_size):
        for pp_rank in range(args.pp_size):
            full = read_full_state(_optim(args.input_dir), tp_rank, pp_rank)
            if args.convert_to_full:
                _save(_optim(args.output_dir) / f"full_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt", full)
            else:
                split_and_save_ckpts(args, full, tp_rank, pp_rank)


if __name__ == "__main__":
    main()


__all__ = [
    "get_parallel_info",
    "is_full",
    "is_xser",
    "main",
    "merge_optim_dp_checkpoints",
    "read_full_state",
    "split_and_save_ckpts",
]
