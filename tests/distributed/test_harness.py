"""The harness ends what it started: SIGTERM (a CI timeout) or SIGINT to the test process kills the torchrun launch
running then and all its ranks, which live in a session of their own (before: a 4-rank launch still ran 10 minutes
after its pytest was killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
MARKER = "cases_harness"


def _ranks() -> list[int]:
    """Processes running this test's cases module (torchrun and its ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if MARKER.encode() in cmdline:
                found.append(int(entry.name))
    return found


def _wait(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_ends_the_running_launch(signum):
    # Python's own SIGINT handler, as in a terminal: a shell that starts a job in the background (CI) leaves SIGINT
    # ignored, which the harness respects
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"from tests.distributed.harness import launch; launch({MARKER!r}, nproc=2, device='cpu')")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert _wait(lambda: len(_ranks()) >= 3, 120), "torchrun and its 2 ranks did not start"
        parent.send_signal(signum)
        parent.wait(timeout=30)
        assert _wait(lambda: not _ranks(), 10), f"still running after the signal: {_ranks()}"
        assert parent.returncode != 0
    finally:
        parent.kill()
        for pid in _ranks():
            os.kill(pid, signal.SIGKILL)
