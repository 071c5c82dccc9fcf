"""Smoke runs of the benchmark scripts at toy sizes: they must keep working as the library changes. Timings here
mean nothing (and are not checked); the scripts' own printed tables are checked for the rows they promise.

Every script runs once, all of them in one fresh process (``benchmarks/_smoke.py``: imports and worker pools are
paid once, not per script); each test reads its script's section of that output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from meshpar.testing._harness import shutdown_pools

pytestmark = pytest.mark.slow  # not in make test-fast: each runs a benchmark script in fresh processes

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


_GPU_STEP = "--device cpu --layers 1 --hidden 32 --heads 2 --seq 16 --batch 1 --rounds 1 --passes 1"

# every smoke run, by name: the script and its command line; the tests below read their sections
RUNS = {
    "tp": "bench_tp.py --no-compile --rounds 1 --layers 1 --hidden 32 --seq 16 --batch 1",
    "gpu_step": f"bench_gpu_step.py {_GPU_STEP} --cprofile meshpar:eager",
    # the isolated run's fresh processes time the eager variants only (compiling in each costs CI ~40 s)
    "gpu_step_isolated": f"bench_gpu_step.py {_GPU_STEP} --isolate --variants dense:eager meshpar:eager",
    "launch": "bench_launch.py --no-compile --rounds 1 --calls 2",
    "sp": "bench_sp.py --rounds 1 --layers 1 --hidden 32 --seq 16 --batch 2",
    "dp": "bench_dp.py --rounds 2 --layers 1 --hidden 32 --seq 16 --vocab 64 --bucket-mb 25 0.01",
    "zero": "bench_zero.py --rounds 1 --layers 1 --hidden 32 --seq 16 --vocab 64",
    "checkpoint": "bench_checkpoint.py --rounds 1 --layers 2 --hidden 32 --seq 16 --batch 2 --vocab 64",
    "coverage": "hf_coverage.py --types qwen3,hrm_text --layouts tp2,pp2 --markdown",
    "pipeline_runtime": "bench_pipeline_runtime.py --rounds 1 --batch 8 --seq 8",
    "peers": "bench_peers.py --layers 2 --hidden 64 --heads 2 --seq 16 --batch 2 --vocab 128 --rounds 1",
    "ep": "bench_ep.py --layers 1 --hidden 32 --seq 16 --batch 4 --rounds 1",
    "cp": "bench_cp.py --layers 1 --hidden 32 --seq 16 --rounds 1",
    "ring_step": "bench_ring_step.py --device cpu --heads 2 --kv-heads 1 --seq 32 --head-dim 8 --rounds 1",
    "projection": "bench_projection.py --deepseek-layers 2 --llama-layers 1 --layouts tp8 ep8 cp1 cp8",
}


@cache
def _sections() -> dict[str, str]:
    shutdown_pools()  # idle worker pools still poll their gloo groups: leave the cores to the benchmarks
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "_smoke.py"), json.dumps([line.split() for line in RUNS.values()])],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    by_line = {}
    for chunk in done.stdout.split("=== ")[1:]:
        header, _, body = chunk.partition("\n")
        by_line[header.strip()] = body
    assert by_line, done.stderr[-3000:]
    return {name: by_line.get(" ".join(line.split()), "") for name, line in RUNS.items()}


def _run(name: str) -> str:
    """The output of the smoke run ``name`` (see :data:`RUNS`)."""
    out = _sections()[name]
    assert out, f"no output for {RUNS[name]}"
    assert "!!! FAILED" not in out, out[-3000:]
    return out


def test_bench_tp_prints_every_variant_and_the_collective_ratios() -> None:
    out = _run("tp")
    for variant in ("dense", "meshpar", "torch DTensor", "Megatron-style"):
        assert f"{variant} " in out
    assert "(ratio to minimum 1.00 | 1.00)" in out
    ideal = re.search(r"row biases replicated: (\d\.\d+)", out).group(1)
    meshpar_fraction = re.search(r"^meshpar\s+[\d,]+ \((\d\.\d+) of dense\)", out, re.MULTILINE).group(1)
    assert meshpar_fraction == ideal  # meshpar's parameters per rank at the ideal fraction


@pytest.mark.parametrize("isolate", [False, True])
def test_bench_gpu_step_runs_on_cpu(isolate: bool) -> None:
    out = _run("gpu_step_isolated" if isolate else "gpu_step")
    assert out.count("compile ") == (0 if isolate else 2) and out.count("eager ") >= 2
    if not isolate:
        assert "host syncs" in out
        assert "host profile of meshpar:eager" in out


def test_bench_launch_compares_the_dispatched_op_and_the_fast_path() -> None:
    out = _run("launch")
    for row in ("meshpar::rms_norm_fwd op, fwd+bwd", "meshpar.ops.rms_norm (eager fast path), fwd+bwd"):
        assert row in out


def test_bench_sp_moves_the_same_bytes_as_tp() -> None:
    out = _run("sp")
    assert out.count("(ratio 1.00 | 1.00)") == 2  # TP and SP both at the Megatron minimum
    assert "SP: {'all_gather_into_tensor': 2.0, 'reduce_scatter_tensor': 2.0}" in out


def test_bench_dp_prints_every_variant() -> None:
    out = _run("dp")
    for variant in ("no sync", "after backward", "overlapped 25 MiB", "overlapped 0.01 MiB", "torch DDP"):
        assert f"{variant} " in out
    buckets = re.search(r"^overlapped 0\.01 MiB\s+(\d+)", out, re.MULTILINE).group(1)
    assert int(buckets) > 1


def test_bench_zero_reduce_scatter_moves_the_minimum_bytes() -> None:
    out = _run("zero")
    ratios = {
        name: float(re.search(rf"^{name}\s+[\d.]+\s+([\d.]+)x", out, re.MULTILINE).group(1))
        for name in ("replicated", "ZeRO-1 all-reduce", "ZeRO-1 reduce-scatter")
    }
    assert ratios["replicated"] == 1.0 and ratios["ZeRO-1 all-reduce"] == 1.5
    assert 1.0 <= ratios["ZeRO-1 reduce-scatter"] < 1.05  # the minimum, plus the padding of the owners' segments
    assert "{'reduce_scatter_tensor': 1, 'all_gather_into_tensor': 1}" in out


def test_bench_checkpoint_compiles_checkpointed_blocks_and_drops_activations() -> None:
    out = _run("checkpoint")
    row = re.compile(
        r"^(eager|compile|eager \+ checkpointing|compile \+ checkpointing)\s+(\d+)\s+[\d.]+\s+([\d.]+)\s+([\d.]+)$"
    )
    rows = {
        m.group(1): (int(m.group(2)), float(m.group(3)), float(m.group(4)))
        for m in (row.match(line) for line in out.splitlines())
        if m
    }
    assert set(rows) == {"eager", "compile", "eager + checkpointing", "compile + checkpointing"}
    assert rows["compile + checkpointing"][0] > 0 and rows["eager + checkpointing"][0] == 0  # graphs
    assert rows["compile + checkpointing"][1] < rows["compile"][1]  # saved MiB
    assert len({loss for _, _, loss in rows.values()}) == 1  # every variant trains the same model


def test_hf_coverage_prints_the_verdicts_and_counts() -> None:
    out = _run("coverage")
    assert re.search(r"^qwen3\s+OK\s+OK\s*$", out, re.MULTILINE), out
    # HRM's recurrent modules are not the layer list its transformers pipeline plan names: refused, reason listed
    assert re.search(r"^hrm_text\s+OK\s+refused \[1\]\s*$", out, re.MULTILINE), out
    assert "[1] refused: HrmTextForCausalLM: the pipeline plan" in out, out
    assert "tp2: OK 2" in out and "pp2: OK 1, refused 1" in out and "| qwen3 | OK | OK |" in out


def test_bench_pipeline_runtime_receives_as_many_messages_as_torchs_runtime() -> None:
    """One extra receive per stage per step (the first activation's shape header), no more: the count is what makes
    the executor level with torch's runtime."""
    out = _run("pipeline_runtime")
    counts = dict(re.findall(r"^\s*(\d+ \w+\s+\w+)\s.*x (\S+)$", out, re.MULTILINE))
    counts = {" ".join(key.split()): value for key, value in counts.items()}
    assert counts == {
        "4 1f1b torch_1f1b": "4:4/5:4",
        "4 interleaved_1f1b torch_interleaved_1f1b": "13:12/14:12",
        "4 zero_bubble 1f1b": "4:4/5:5",  # the same messages as meshpar's 1F1B
        "4 zero_bubble torch_interleaved_zero_bubble": "4:4/5:4",
        "8 1f1b torch_1f1b": "8:8/9:8",
        "8 interleaved_1f1b torch_interleaved_1f1b": "25:24/26:24",
        "8 zero_bubble 1f1b": "8:8/9:9",
        "8 zero_bubble torch_interleaved_zero_bubble": "8:8/9:8",
    }, out


def test_bench_peers_runs_every_row_and_counts_megatron_collectives() -> None:
    """A tiny 2-layer Llama: meshpar's tp=2 step issues Megatron's count (2 all-reduces forward + 2 backward per layer,
    plus the vocab-parallel embedding's and the loss's, and the loss's one small all-gather) and one more small
    all-reduce, of the tp ranks' batch fingerprints (meshpar._same_batch), fewer than torch-native TP; GPT-2 has no
    torch-native or HF row, and the report says why."""
    out = _run("peers")
    llama_tp2 = out.split("llama, tp=2")[1].split("gpt2, tp=1")[0]
    meshpar_line = next(line for line in llama_tp2.splitlines() if line.strip().startswith("meshpar "))
    native_line = next(line for line in llama_tp2.splitlines() if line.strip().startswith("torch-native "))
    assert "11 all_reduce" in meshpar_line and "1 all_gather_into_tensor" in meshpar_line, out  # 10 + the check
    assert int(re.search(r"(\d+) all_reduce", native_line).group(1)) > 8, out
    assert "meshpar tp=1 / plain HF" in out and "meshpar / torch-native" in out, out
    assert "no tp_plan for this family" in out.split("gpt2, tp=2")[1], out


def test_bench_ep_prints_every_layout_with_its_bytes() -> None:
    """Expert parallelism at equal world size: every layout's row; tp4 sends no all-to-all, the ep layouts do, and
    each layout holds the same share of the experts (2 of 8 per rank; with expert_tensor_parallel_size 1, 4); under
    FSDP2 fewer parameters than ep4 (the dense weights sharded), gathered and reduce-scattered, not all-reduced."""
    out = _run("ep")
    number = r"\s+([\d,]+)"
    names = ("tp4", "ep4", "ep2 x tp2", "ep2 tp2 etp1", "ep2 fsdp")
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(rf"^({'|'.join(names)}){number * 5}", out, re.M)}
    assert set(rows) == set(names), out
    assert rows["tp4"][3] == "0" and all(rows[k][3] != "0" for k in names[1:])
    experts = {k: int(r[1].replace(",", "")) for k, r in rows.items()}
    assert len({v for k, v in experts.items() if k != "ep2 tp2 etp1"}) == 1
    assert experts["ep2 tp2 etp1"] == 2 * experts["tp4"]  # whole on both tp ranks
    held = {k: int(r[0].replace(",", "")) for k, r in rows.items()}
    assert held["ep2 fsdp"] < held["ep4"] and rows["ep2 fsdp"][4] != "0" and rows["ep4"][4] == "0", out


def test_bench_cp_prints_every_layout() -> None:
    """Context parallelism at the same tokens per rank: cp1 exchanges no K/V, both cp2 implementations do (the
    same bytes: K and V of the local tokens to the other rank, and their grads back), over twice the sequence."""
    out = _run("cp")
    rows = {
        m.group(1): (int(m.group(2)), m.group(4))
        for m in re.finditer(r"^(cp1|cp2 all_gather|cp2 ring)\s+(\d+)\s+([\d,]+)\s+([\d,]+)", out, re.M)
    }
    assert set(rows) == {"cp1", "cp2 all_gather", "cp2 ring"}, out
    assert rows["cp1"][1] == "0" and rows["cp2 all_gather"][1] == rows["cp2 ring"][1] != "0"
    assert rows["cp2 ring"][0] == 2 * rows["cp1"][0]


def test_bench_ring_step_times_both_paths() -> None:
    """One ring step on the fused kernels and on plain matmuls, the ratio against the plain one printed."""
    out = _run("ring_step")
    rows = dict(re.findall(r"^(plain \(fp32 matmuls\)|fused kernel)\s+[\d.]+\s+([\d.]+)x", out, re.M))
    assert set(rows) == {"plain (fp32 matmuls)", "fused kernel"} and rows["plain (fp32 matmuls)"] == "1.00", out


def test_bench_projection_shards_at_scale_on_the_fake_process_group() -> None:
    """DeepSeek-V3-shaped layers on 64 fake ranks and Llama-3-8B-shaped ones at cp8, sharded by meshpar's real plans
    on meta: ep8 holds expert weights over ep, tp8 none; at top-8 over ep8 an MoE layer moves as many bytes as tp8's
    all-reduces for the same global batch; cp shards no weight, splits the tokens, and exchanges K/V."""
    out = _run("projection")
    ds = {
        m.group(1): m.groups()[1:]
        for m in re.finditer(r"^(tp8|ep8)\s+([\d.]+) B\s+(\d+)%\s+(\d+)\s+(\d+)\s+(\d+)", out, re.M)
    }
    assert set(ds) == {"tp8", "ep8"}, out
    assert ds["tp8"][1] == "0" and int(ds["ep8"][1]) > 0
    assert ds["tp8"][4] == ds["ep8"][4]  # MiB per MoE layer: k = 8 rows per token over ep8 = tp8's all-reduces
    ll = {
        m.group(1): m.groups()[1:]
        for m in re.finditer(r"^(cp1|cp8)\s+([\d.]+) B\s+([\d,]+)\s+(\d+)\s+(\d+)", out, re.M)
    }
    assert set(ll) == {"cp1", "cp8"}, out
    assert ll["cp1"][0] == ll["cp8"][0] and ll["cp1"][3] == "0" and ll["cp8"][3] != "0"
    assert int(ll["cp1"][1].replace(",", "")) == 8 * int(ll["cp8"][1].replace(",", ""))
