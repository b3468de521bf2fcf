"""``benchmarks/bench_ddp.py --quick`` under torchrun for every wrapping (gloo on CPU here; the GPU rows come
from ``launch/gpu_x2_session.sh``): the script runs end to end, writes its CSV, and the tiled row agrees with
the untiled one — same first loss and gradient norm, no more collectives per step."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import LAUNCH_TIMEOUT_S

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


def _counts(text: str) -> dict[str, int]:
    return {} if text == "none" else {k: int(v) for k, v in (item.split("=") for item in text.split(";"))}


def _quick_rows(out: Path, nproc: int, *options: str) -> list[dict[str, str]]:
    """``bench_ddp.py --quick`` under torchrun on ``nproc`` CPU processes; the rows of its CSV."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "benchmarks/bench_ddp.py", "--quick", *options, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (path,) = out.glob("bench_ddp_*_quick.csv")
    with path.open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("wrap, nproc", [("ddp", 2), ("fsdp2", 2), ("tp", 2), ("fsdp2_tp", 4)])
def test_bench_ddp_quick(tmp_path, wrap, nproc):
    rows = _quick_rows(tmp_path, nproc, "--wrap", wrap)
    assert len(rows) == 2 * nproc and {r["status"] for r in rows} == {"ok"}, rows
    assert {r["tp"] for r in rows} == {"1" if wrap in ("ddp", "fsdp2") else "2"}
    for rank in range(nproc):
        untiled, tiled = (next(r for r in rows if r["rank"] == str(rank) and r["variant"] == v)
                          for v in ("untiled", "tiled"))
        assert int(tiled["tiled_mlps"]) == 2 and int(untiled["tiled_mlps"]) == 0
        for key in ("loss0", "grad_norm0"):
            assert abs(float(tiled[key]) - float(untiled[key])) <= 1e-4 * abs(float(untiled[key])), (key, tiled, untiled)
        got, ref = _counts(tiled["collectives_per_step"]), _counts(untiled["collectives_per_step"])
        assert ref and set(got) == set(ref) and all(got[k] <= ref[k] for k in ref), (got, ref)


def test_bench_zero3_quick(tmp_path):
    """``--wrap zero3``: DeepSpeed ZeRO-3, untiled vs DeepSpeed's TiledMLP vs tiledmlp, same first loss and
    gradient norm on every rank."""
    pytest.importorskip("deepspeed", reason="the 'deepspeed' test extra")
    rows = _quick_rows(tmp_path, 2, "--wrap", "zero3", "--variants", "untiled,deepspeed_tiled,tiled")
    assert len(rows) == 6 and {r["status"] for r in rows} == {"ok"} and {r["wrap"] for r in rows} == {"zero3"}, rows
    for rank in range(2):
        by = {r["variant"]: r for r in rows if r["rank"] == str(rank)}
        assert int(by["tiled"]["tiled_mlps"]) == int(by["deepspeed_tiled"]["tiled_mlps"]) == 2
        for variant in ("tiled", "deepspeed_tiled"):
            for key in ("loss0", "grad_norm0"):
                ref = float(by["untiled"][key])
                assert abs(float(by[variant][key]) - ref) <= 1e-4 * abs(ref), (variant, key, by)


@pytest.mark.parametrize("shard", ["none", "fsdp2"])
def test_bench_sp_smoke(tmp_path, shard):
    """``benchmarks/bench_sp.py --smoke`` on 2 CPU processes (Ulysses over gloo): every variant runs and writes its
    row; the same loss for all; tiledmlp's gradients are untiled's, and the ALST stack's head gradient is off by
    about the ranks' valid-label count (its loss computes it with an incoming gradient of 1). With the weights
    sharded by FSDP2 (no ALST stack there) the same, from the units' full gradients."""
    pytest.importorskip("deepspeed", reason="Ulysses is DeepSpeed's: pip install -e '.[test,deepspeed]'")
    variants = ["untiled", "tiled", "tiled+offload+norms", "tiled+offload+norms+attn", "tiled+auto+norms+attn"]
    variants += ["alst"] if shard == "none" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "benchmarks/bench_sp.py",
           "--smoke", "--out", str(tmp_path), "--shard", shard, "--variants", ",".join(variants)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with (tmp_path / "bench_sp_cpu_smoke.csv").open() as handle:
        rows = {r["variant"]: r for r in csv.DictReader(handle)}
    assert set(rows) == set(variants) and all(r["shard"] == shard for r in rows.values())
    losses = [float(r["loss"]) for r in rows.values()]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), losses
    assert all(float(rows[v]["grad_rel"]) <= 1e-5 for v in variants if v.startswith("tiled")), rows
    # offload="auto" planned per rank: the smoke model's layer inputs are too small to send anywhere but the device
    assert rows["tiled+auto+norms+attn"]["placement"].startswith("2 kept on the device"), rows["tiled+auto+norms+attn"]
    assert all(float(r["host_gib"]) == 0 and float(r["host_rss_gib"]) > 0 for r in rows.values()), rows
    if shard == "none":
        assert float(rows["alst"]["grad_rel"]) > 10, rows["alst"]


def test_bench_sp_scaled_training_step_smoke(tmp_path):
    """``bench_sp.py --scale-to N --optimizer adamw`` on 2 CPU processes under FSDP2: the run's budgets are the whole
    model's less the missing layers' weights, gradients and AdamW states (sharded over the ranks), the whole model's
    plan is beside the row, and the optimizer steps (the second step's loss differs from the first's)."""
    pytest.importorskip("deepspeed", reason="Ulysses is DeepSpeed's: pip install -e '.[test,deepspeed]'")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "benchmarks/bench_sp.py",
           "--smoke", "--out", str(tmp_path), "--shard", "fsdp2", "--optimizer", "adamw", "--scale-to", "6",
           "--gpu-mib", "600", "--host-mib", "2048", "--steps", "2", "--variants", "tiled+auto+norms+attn"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with (tmp_path / "bench_sp_cpu_smoke.csv").open() as handle:
        rows = {r["variant"]: r for r in csv.DictReader(handle)}
    row = rows["tiled+auto+norms+attn"]
    # the 4 missing layers of the smoke shape (hidden 64, 4 heads and 2 KV heads of 16, intermediate 176, float32):
    # each rank's halves of their weights, gradients and AdamW's two states
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176 + 2 * 64  # q, o; k, v; gate, up, down; two norms
    missing_mib = 4 * (layer * 4 // 2) * (1 + 1 + 2) / 2**20
    assert float(row["gpu_mib"]) == pytest.approx(600 - missing_mib, abs=0.06), row  # the CSV's 4 digits
    assert int(row["scale_to"]) == 6 and float(row["full_gpu_mib"]) == 600 and float(row["full_plan_gib"]) > 0, row
    assert float(row["host_mib"]) <= float(row["full_host_mib"]) == 2048, row
    losses = [float(v) for v in row["losses"].split(";")]
    assert len(losses) == 2 and losses[0] != losses[1], row


#: Rows run through benchmarks/row_outcomes.py on 2 gloo ranks. Row 0: both ranks run out of memory before any
#: collective (both leave the row: agreed, the run goes on). Row 1: rank 1 runs out of memory while rank 0 waits in an
#: all-reduce rank 1 never joins (rank 0 is blocked: it writes the row and the run ends).
_ROWS = """
import sys, time
import torch, torch.distributed as dist
sys.path.insert(0, "benchmarks")
from row_outcomes import RowOutcomes

dist.init_process_group("gloo")
rank, out = dist.get_rank(), sys.argv[1]
outcomes = RowOutcomes(grace_s=3)

def both_out_of_memory():
    raise torch.OutOfMemoryError("simulated")

def one_out_of_memory_in_a_collective():
    if rank == 1:
        raise torch.OutOfMemoryError("simulated")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return "measured"

def write(line):
    with open(f"{out}/rank{rank}.txt", "a") as handle:
        handle.write(line + "\\n")

write("row0 " + outcomes.run(both_out_of_memory, lambda why: write("stuck " + why))[1])
write("row1 " + outcomes.run(one_out_of_memory_in_a_collective, lambda why: write("stuck " + why))[1])
write("never")
"""


def test_rank_out_of_memory_ends_the_blocked_ranks(tmp_path):
    """bench_sp.py on 2 x H200 at 3,145,728 tokens: one rank ran out of memory, the other waited 9 minutes in a
    collective. Now every rank learns it within the grace time and records it; a blocked rank ends the run."""
    script = tmp_path / "rows.py"
    script.write_text(_ROWS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout[-2000:]
    rank0 = (tmp_path / "rank0.txt").read_text().splitlines()
    rank1 = (tmp_path / "rank1.txt").read_text().splitlines()
    assert rank0[0] == rank1[0] == "row0 oom", (rank0, rank1)
    assert rank0[1] == "stuck rank 1 ran out of memory; rank 0 is blocked in a collective it will not join", rank0
    assert "never" not in rank0 + rank1, (rank0, rank1)
