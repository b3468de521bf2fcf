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


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_compare_passes(wrap: str) -> None:
    """``--wrap ddp --tiling auto --compare --loss-scratch-mib 0.05`` is the README's main command: the MLPs
    and the LM head + loss tiled, each call in several shards."""
    proc = run_train("--wrap", wrap, "--tiling", "auto", "--compare", "--loss-scratch-mib", "0.05")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-5000:]}"
    out = _check_log(proc)
    tiled = re.search(rf"^\[tiled\] tiled 2 MLPs and the LM head \+ loss, strategies \['{wrap}'\], (\d+) shards "
                      r".*; loss in (\d+) shards", out, re.M)
    assert tiled and int(tiled.group(1)) >= 2 and int(tiled.group(2)) >= 2, out
    assert re.search(r"^compare: max relative parameter difference .* -> OK", out, re.M), out


def test_loss_tiling_can_be_turned_off() -> None:
    proc = run_train("--wrap", "ddp", "--tiling", "auto", "--compare", "--tile-loss", "off")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-5000:]}"
    assert re.search(r"^\[tiled\] tiled 2 MLPs, strategies \['ddp'\], \d+ shards [^;]*$", _check_log(proc), re.M)


def test_compare_fails_above_tolerance() -> None:
    proc = run_train("--wrap", "fsdp1", "--compare", "--tol", "0")
    assert proc.returncode != 0, proc.stdout
    assert re.search(r"^compare: max relative parameter difference .* -> FAIL", _check_log(proc), re.M), proc.stdout


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
    assert re.search(r"^compare: max relative parameter difference .* -> OK", out, re.M), out


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
    assert re.search(r"^compare: max relative parameter difference .* -> OK", out, re.M), out
