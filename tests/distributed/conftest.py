"""Distributed suite: a header with the launch configuration, the tests of one launch kept together under pytest-xdist,
and a per-case table at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .harness import REPORT, default_nproc, on_gpu


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """pytest-xdist's ``--dist loadgroup`` keeps the tests of one launch on one worker: a matrix launch's
    (``test_matrix.py``), else a test file's (each launches its cases once). A matrix test answers ``-k`` to its
    launch too, ``launch_<name>`` (``-k launch_zero_2proc``: the DeepSpeed cases on two ranks)."""
    import pytest

    for item in [item for item in items if Path(item.path).is_relative_to(Path(__file__).parent)]:
        params = getattr(getattr(item, "callspec", None), "params", {})
        launch = params.get("launch")
        item.add_marker(pytest.mark.xdist_group(launch.name if hasattr(launch, "name") else item.path.stem))
        if hasattr(launch, "name"):
            item.extra_keyword_matches.add("launch_" + launch.name.replace("-", "_"))


def pytest_report_header(config: Any) -> str:
    device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (NCCL)" if on_gpu() else "CPU (gloo)"
    return f"tiledmlp distributed suite: {default_nproc()} processes per launch on {device}, torch {torch.__version__}"


#: case-specific metrics printed under a case's row when present
_EXTRA = ("bf16_noise", "tiled_error", "accumulated_grad_rel")


def _worst(results: list[dict[str, Any]], key: str) -> str:
    values = [r["metrics"].get(key) for r in results if r["status"] == "ok" and r["metrics"].get(key) is not None]
    return f"{max(values):.1e}" if values else "-"


def _same_collectives(results: list[dict[str, Any]]) -> str:
    ok = [r["metrics"] for r in results if r["status"] == "ok" and "collectives_tiled" in r["metrics"]]
    if not ok:
        return "-"
    return "same" if all(m["collectives_tiled"] == m["collectives_untiled"] for m in ok) else "DIFFER"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not REPORT:
        return
    tr = terminalreporter
    tr.section("tiledmlp distributed cases (worst over ranks)")
    tr.write_line(f"{'case':<44} {'status':<8} {'param_rel':>9} {'update_rel':>10} {'collectives':>11} "
                  f"{'shards/step (rank 0)':>22} {'s':>6}")
    for module, case, results in REPORT:
        status = ",".join(sorted({r["status"] for r in results}))
        shards = results[0].get("metrics", {}).get("shards_per_step", "-") if results[0]["status"] == "ok" else "-"
        seconds = max(r.get("seconds", 0.0) for r in results)
        tr.write_line(f"{case:<44} {status:<8} {_worst(results, 'param_rel'):>9} {_worst(results, 'update_rel'):>10} "
                      f"{_same_collectives(results):>11} {str(shards):>22} {seconds:>6.1f}")
        extra = [f"{key} {_worst(results, key)}" for key in _EXTRA if _worst(results, key) != "-"]
        if extra:
            tr.write_line(f"{'':<44} {', '.join(extra)}")
