"""pytest side of the distributed suite: one torchrun launch per cases module, results per case.

A launch runs ``worker.py`` on N processes — one per GPU with NCCL when CUDA is available, else N CPU
processes with gloo — and every case's per-rank result comes back as JSON. :meth:`Suite.metrics`
turns a case's result into either its per-rank metrics or a failure whose message carries each
failing rank's traceback (or, when the launch itself died or timed out, the tail of torchrun's
output).

Environment:
    TILEDMLP_TEST_NPROC     processes per launch (default: the GPU count, else 2)
    TILEDMLP_TEST_DEVICE    ``cpu`` forces gloo on a GPU machine
    TILEDMLP_TEST_TIMEOUT   seconds per launch (default 300)
    TILEDMLP_TEST_COLLECTIVE_TIMEOUT  seconds a rank waits in one collective (default 60, worker.py)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .common import device_type

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
LAUNCH_TIMEOUT_S = float(os.environ.get("TILEDMLP_TEST_TIMEOUT", "300"))
#: every case's result, in run order, for the summary printed at the end of the session (conftest.py)
REPORT: list[tuple[str, str, list[dict[str, Any]]]] = []


def on_gpu() -> bool:
    return device_type() == "cuda"


def default_nproc() -> int:
    if "TILEDMLP_TEST_NPROC" in os.environ:
        return int(os.environ["TILEDMLP_TEST_NPROC"])
    return torch.cuda.device_count() if on_gpu() else 2


def _tail(text: str, lines: int = 80) -> str:
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Suite:
    """The outcome of one launch: per-rank JSON results and torchrun's combined output."""

    module: str
    nproc: int
    ranks: list[dict[str, Any]]
    output: str
    returncode: Optional[int]  # None: killed at the launch timeout
    _reported: set = field(default_factory=set)

    def metrics(self, case: str) -> list[dict[str, Any]]:
        """Per-rank metrics of ``case``; fails the calling test with the ranks' tracebacks if it failed."""
        results = [r.get(case) for r in self.ranks]
        if len(self.ranks) < self.nproc or any(r is None for r in results):
            why = "timed out" if self.returncode is None else f"exited with {self.returncode}"
            raise AssertionError(
                f"{self.module}: no result for case {case!r} from every rank (the launch {why}).\n"
                f"torchrun output (tail):\n{_tail(self.output)}"
            )
        self._report(case, results)
        errors = [(rank, r["traceback"]) for rank, r in enumerate(results) if r["status"] == "error"]
        if errors:
            raise AssertionError(f"{self.module}.{case} failed:\n" + "\n".join(
                f"--- rank {rank} ---\n{tb}" for rank, tb in errors))
        if any(r["status"] == "not_run" for r in results):
            raise AssertionError(f"{self.module}.{case} not run: {results[0]['reason']}")
        return [r["metrics"] for r in results]

    def _report(self, case: str, results: list[dict[str, Any]]) -> None:
        if case not in self._reported:
            self._reported.add(case)
            REPORT.append((self.module, case, results))


#: torchrun processes of the launches running now: ended with this process on SIGTERM or SIGINT (a CI timeout, ^C)
_RUNNING: set[int] = set()


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, their children, ... (from ``/proc``: torchrun starts each rank in a session of its own,
    which killing torchrun's process group does not reach)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _kill_launch(pid: int) -> None:
    """SIGKILL to torchrun ``pid`` and every process below it."""
    for p in [pid, *_descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _end_launches_then(previous: Any) -> Any:
    """A signal handler that kills the running launches (torchrun and its ranks, in sessions of their own, which a
    signal to this process's group does not reach), then does what ``previous`` (the handler it replaces) did."""
    def handler(signum: int, frame: Any) -> None:
        for pid in list(_RUNNING):
            _kill_launch(pid)
        _RUNNING.clear()
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: die of the signal, as without this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
    return handler


def _install_signal_handlers() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        current = signal.getsignal(signum)
        if getattr(current, "__qualname__", "").startswith(_end_launches_then.__name__):
            continue  # already ours
        if current is not signal.SIG_IGN:
            signal.signal(signum, _end_launches_then(current))


def launch(module: str, nproc: Optional[int] = None, cases: tuple[str, ...] = (),
           device: Optional[str] = None, timeout_s: float = LAUNCH_TIMEOUT_S) -> Suite:
    """torchrun ``worker.py module`` on ``nproc`` processes (all its cases, or ``cases``). ``device="cpu"`` on a GPU
    machine (more processes than GPUs): gloo, with the GPUs hidden from the ranks (DeepSpeed would otherwise put
    several ranks on one GPU, whose collectives then never complete)."""
    nproc = nproc or default_nproc()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if device is not None:
        env["TILEDMLP_TEST_DEVICE"] = device
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    _install_signal_handlers()
    with tempfile.TemporaryDirectory(prefix=f"tiledmlp-{module}-") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKER), module, out, *cases]
        # A session of its own: a signal to pytest's group reaches it only through the handlers above.
        proc = subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        _RUNNING.add(proc.pid)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            returncode: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_launch(proc.pid)
            output, _ = proc.communicate()
            output += f"\n[harness] killed after {timeout_s:.0f} s"
            returncode = None
        finally:
            _RUNNING.discard(proc.pid)
        files = sorted(Path(out).glob("rank*.json"), key=lambda p: int(p.stem.removeprefix("rank")))
        ranks = [json.loads(p.read_text()) for p in files]
    return Suite(module, nproc, ranks, output, returncode)


def assert_same_training(metrics: list[dict[str, Any]], tol: float = 1e-4, update_tol: float = 1e-3) -> None:
    """On every rank: ``max|tiled - untiled| / max|untiled| <= tol`` for every parameter, the training
    updates agree within ``update_tol`` (relative, per parameter), and training moved something."""
    for rank, m in enumerate(metrics):
        assert m["moved_params"] > 0, f"rank {rank}: training moved no parameter, the comparison is vacuous"
        assert m["param_rel"] <= tol, f"rank {rank}: parameters differ by {m['param_rel']:.3g} (relative) > {tol}"
        assert m["update_rel"] <= update_tol, f"rank {rank}: updates differ by {m['update_rel']:.3g} > {update_tol}"


def assert_tiled_like_untiled(metrics: list[dict[str, Any]], strategy: Optional[str],
                              collectives: bool = True) -> None:
    """How the tiled run ran, on every rank:

    * every tiled module reports ``strategy`` (None: no module is patched — ``apply_tiled_mlp``);
    * every tiled call was cut into at least 2 shards, every step;
    * no tiled module or FSDP unit was called during backward (no hook re-entry);
    * it issued exactly the untiled run's collectives, micro-batch by micro-batch (``collectives=False``
      where the untiled reference runs under different wrapper options).
    """
    for rank, m in enumerate(metrics):
        where = f"rank {rank}"
        expected = set() if strategy is None else {strategy}
        assert set(m["strategies"].values()) == expected, f"{where}: strategies {m['strategies']}, want {expected}"
        calls, shards = m["tiled_calls_per_step"], m["shards_per_step"]
        assert all(c > 0 and s >= 2 * c for c, s in zip(calls, shards)), (
            f"{where}: tiling did not split every call (calls {calls}, shards {shards} per step)")
        assert m["calls_in_backward"] == 0, f"{where}: {m['calls_in_backward']} module calls during backward"
        if collectives:
            assert any(m["collectives_untiled"]), f"{where}: no collective counted; the counter is blind"
            assert m["collectives_tiled"] == m["collectives_untiled"], (
                f"{where}: collectives per micro-batch differ: tiled {m['collectives_tiled']} vs untiled "
                f"{m['collectives_untiled']}")


def assert_matches_untiled(metrics: list[dict[str, Any]], strategy: Optional[str], collectives: bool = True) -> None:
    """The standard check of a case: same training (fp32 tolerances) and same execution shape."""
    assert_same_training(metrics)
    assert_tiled_like_untiled(metrics, strategy, collectives)


def assert_within_bf16_noise(metrics: list[dict[str, Any]], strategy: str) -> None:
    """bf16 mixed precision (``common.mixed_precision_metrics``): the tiled bf16 run is no further from an
    fp32 run than the untiled bf16 run is (``bf16_noise``), with a 1.5x margin; and it ran like untiled."""
    assert_tiled_like_untiled(metrics, strategy)
    for rank, m in enumerate(metrics):
        assert m["bf16_noise"] > 0, f"rank {rank}: bf16 run identical to fp32: mixed precision is not on"
        assert m["tiled_error"] <= 1.5 * m["bf16_noise"], (
            f"rank {rank}: tiled bf16 is {m['tiled_error']:.3g} from fp32, untiled bf16 {m['bf16_noise']:.3g}")


def assert_syncs_only_on_last_micro_batch(metrics: list[dict[str, Any]], sync_collective: str) -> None:
    """Gradient accumulation: ``sync_collective`` (the one that reduces gradients) runs on the last
    micro-batch of every step and on no other; where the wrapper keeps local gradients in ``.grad``
    (DDP, FSDP1), those accumulated over the non-syncing micro-batches match untiled's."""
    for rank, m in enumerate(metrics):
        micro = len(m["collectives_tiled"]) // len(m["shards_per_step"])
        assert micro > 1, f"rank {rank}: one micro-batch per step, nothing accumulates"
        for i, counts in enumerate(m["collectives_tiled"]):
            syncing = i % micro == micro - 1
            assert (counts.get(sync_collective, 0) > 0) == syncing, (
                f"rank {rank}, micro-batch {i}: collectives {counts} (syncing: {syncing})")
        if "accumulated_grad_rel" in m:
            assert m["accumulated_grad_rel"] <= 1e-5, (
                f"rank {rank}: local accumulated gradients differ by {m['accumulated_grad_rel']:.3g}")


def assert_all_checked(suite: Suite, checked: set[str]) -> None:
    """Every case the launch ran is asserted by some test of the file."""
    ran = set().union(*(r.keys() for r in suite.ranks)) if suite.ranks else set()
    assert ran - checked == set(), f"cases run but never checked: {sorted(ran - checked)}"


def assert_compiled_like_untiled(metrics: list[dict[str, Any]]) -> None:
    """A compiled case (``runs.with_graph_counts``): on every rank the tiled blocks compiled into as many
    graphs as the untiled ones (tiling adds no graph break) and their graphs hold the tiled operator."""
    for rank, m in enumerate(metrics):
        untiled, tiled = m["compiled_graphs"]
        assert tiled == untiled, f"rank {rank}: {tiled} compiled graphs tiled, {untiled} untiled (a graph break)"
        assert m["tiled_ops"][0] == 0 and m["tiled_ops"][1] > 0, f"rank {rank}: tiled operators {m['tiled_ops']}"
