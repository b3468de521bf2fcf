"""``launch/train.py`` under torchrun: the README's demo command, and the other wrappers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .harness import LAUNCH_TIMEOUT_S, default_nproc

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
#: train.py takes one GPU per process when there are enough (NCCL), else CPU processes (gloo)
_ON_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= default_nproc()


def run_train(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={default_nproc()}",
           "launch/train.py", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


def _check_log(proc: subprocess.CompletedProcess, steps: int = 4) -> str:
    out = proc.stdout
    for label in ("untiled", "tiled"):
        lines = re.findall(rf"^\[{label}\] step \d+/{steps}  loss [\d.]+  [\d,]+ tokens/s  peak \w+ [\d,]+ MiB$",
                           out, re.M)
        assert len(lines) == steps, f"{label}: {len(lines)} step lines\n{out}\n{proc.stderr[-3000:]}"
        assert re.search(rf"^\[{label}\] summary: final loss", out, re.M), out
    return out


def _compared(out: str, steps: int = 4) -> None:
    """Every rank said tiled equals untiled (losses, last gradients but under ZeRO-3, parameters), and so did the
    whole run."""
    for rank in range(default_nproc()):
        assert re.search(rf"^compare, rank {rank}: tiled vs untiled, the losses of the {steps} steps within [\d.e+-]+, "
                         rf"(the gradients of step {steps} within [\d.e+-]+, )?the parameters after it within "
                         r"[\d.e+-]+ \(relative; tolerance [\d.e+-]+\) -> OK$", out, re.M), out
    assert re.search(r"^compare: largest relative difference over \d ranks .* -> OK", out, re.M), out


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_compare_passes(wrap: str) -> None:
    """``--compare`` with the MLPs and the LM head + loss tiled, each call in several shards (a small loss scratch
    budget, so the tiny vocabulary is cut too)."""
    proc = run_train("--wrap", wrap, "--tiling", "auto", "--compare", "--loss-scratch-mib", "0.05")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-5000:]}"
    out = _check_log(proc)
    tiled = re.search(rf"^\[tiled\] tiled 2 MLPs and the LM head \+ loss, strategies \['{wrap}'\], (\d+) shards "
                      r".*; loss in (\d+) shards", out, re.M)
    assert tiled and int(tiled.group(1)) >= 2 and int(tiled.group(2)) >= 2, out
    _compared(out)


@pytest.mark.skipif(_ON_GPUS, reason="the demo's memory line is the host's: it runs on CPU processes")
def test_the_demo_shows_the_memory_tiling_saves_without_a_warning_of_its_own() -> None:
    """``bash launch/demo.sh`` (the README's main job), at a quarter of its length: each rank checks tiled against
    untiled, and the peak resident memory of each run is said, the tiled one below the untiled one; nothing on stderr
    (before: the demo's own --loss-scratch-mib 0.05 logged a scratch warning on each rank, and on CPUs no peak was
    compared)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, PYTHONPATH=str(ROOT), NPROC=str(default_nproc()))
    proc = subprocess.run(["bash", "launch/demo.sh", "--seq-len", "2048"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-5000:]}"
    out = _check_log(proc, steps=2)
    _compared(out, steps=2)
    peak = re.search(r"^peak host memory resident \(VmHWM, reset before each run\), the largest process's, a step "
                     r"being forward \+ backward \+ AdamW: untiled ([\d,]+) MiB, tiled ([\d,]+) MiB \(\d+% less; the "
                     r"process held [\d,]+ and [\d,]+ MiB as each run began\); a step \(steps 2\+\) [\d.]+ s untiled, "
                     r"[\d.]+ s tiled \(\d+% (slower|faster)\)$", out, re.M)
    assert peak and int(peak[2].replace(",", "")) < int(peak[1].replace(",", "")), out
    assert not proc.stderr.strip(), proc.stderr


def test_loss_tiling_can_be_turned_off() -> None:
    proc = run_train("--wrap", "ddp", "--tiling", "auto", "--compare", "--tile-loss", "off")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-5000:]}"
    assert re.search(r"^\[tiled\] tiled 2 MLPs, strategies \['ddp'\], \d+ shards [^;]*$", _check_log(proc), re.M)


def test_compare_fails_above_tolerance() -> None:
    proc = run_train("--wrap", "fsdp1", "--compare", "--tol", "0")
    assert proc.returncode != 0, proc.stdout
    assert re.search(r"^compare: largest relative difference over \d ranks .* -> FAIL", _check_log(proc), re.M), \
        proc.stdout


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2", "zero3"])
def test_sequence_parallel_compare_passes(wrap: str) -> None:
    """``--sp 2``: every sequence split across the 2 ranks by DeepSpeed's Ulysses, the loss
    ``tiledmlp.sequence_loss``; untiled and tiled train alike under DDP, FSDP2 and a ZeRO-3 engine."""
    pytest.importorskip("deepspeed", reason="Ulysses is DeepSpeed's: pip install -e '.[test,deepspeed]'")
    proc = run_train("--wrap", wrap, "--sp", "2", "--compare", "--loss-scratch-mib", "0.05")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-5000:]}"
    out = _check_log(proc)
    expected = {"ddp": "ddp", "fsdp2": "fsdp2", "zero3": "deepspeed"}[wrap]
    assert re.search(rf"^\[tiled\] tiled 2 MLPs and the LM head \+ loss, strategies \['{expected}\+sp'\], \d+ shards "
                     r"of <= \d+ tokens per MLP call of 256;", out, re.M), out
    _compared(out)


def test_sequence_parallel_refuses_what_it_cannot_split() -> None:
    proc = run_train("--wrap", "ddp", "--sp", "2", "--heads", "3", "--hidden", "96")
    assert proc.returncode != 0 and "--heads (3) must be multiples of it" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (("--wrap", "ddp"), "use --wrap fsdp2"),
    (("--wrap", "fsdp2", "--seq-len", "96"), "--seq-len (96) must be a multiple of 128"),
    pytest.param(("--wrap", "fsdp2"), "torch's ring attention has no CPU kernels",
                 marks=pytest.mark.skipif(_ON_GPUS, reason="the launch runs on GPUs here")),
], ids=["not_fsdp2", "chunks", "cpu"])
def test_ring_refuses_what_it_cannot_split(args: tuple[str, ...], message: str) -> None:
    """``--sp-backend ring`` (torch's context parallelism): FSDP2 over a dp_shard x cp mesh, chunks of 32 tokens in
    float32, GPUs; anything else exits naming the fix."""
    proc = run_train(*args, "--sp", "2", "--sp-backend", "ring")
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(not _ON_GPUS, reason="torch's ring attention runs on GPUs only")
def test_ring_compare_passes() -> None:
    """``--sp 2 --sp-backend ring``: each sequence split by torch's ring (load-balanced chunks, KV heads repeated),
    FSDP2 over the dp_shard x cp mesh; untiled and tiled train alike, the tiled modules named fsdp2+cp."""
    proc = run_train("--wrap", "fsdp2", "--sp", "2", "--sp-backend", "ring", "--kv-heads", "2", "--compare",
                     "--loss-scratch-mib", "0.05")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-5000:]}"
    out = _check_log(proc)
    assert re.search(r"^\[tiled\] tiled 2 MLPs and the LM head \+ loss, strategies \['fsdp2\+cp'\]", out, re.M), out
    _compared(out)
