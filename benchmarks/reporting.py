"""How the benchmarks report: the GPU's name and the package versions every CSV row carries, cell formatting, CSV
files, aligned text tables, and the matplotlib helpers of their plots (headless). Shared by every script in
``benchmarks/``; nothing here measures anything.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import importlib.metadata
import math
import re
from pathlib import Path
from typing import Any

import torch

VERSION_DISTRIBUTIONS = {
    "torch": "torch", "triton": "triton", "transformers": "transformers", "liger": "liger-kernel",
    "deepspeed": "deepspeed", "tiledmlp": "tiledmlp", "cce": "cut-cross-entropy", "bitsandbytes": "bitsandbytes",
    "peft": "peft",
}
VERSION_MODULES = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}


def gpu_name(device: torch.device) -> str:
    """The accelerator's marketing name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def gpu_slug(device: torch.device) -> str:
    """A file-name friendly form of :func:`gpu_name`, e.g. ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name(device).lower()).strip("-")


def package_version(key: str) -> str:
    """Installed version of a package, or "n/a"."""
    try:
        return importlib.metadata.version(VERSION_DISTRIBUTIONS[key])
    except importlib.metadata.PackageNotFoundError:  # e.g. tiledmlp used from the checkout, not installed
        try:
            module = importlib.import_module(VERSION_MODULES.get(key, key))
        except ImportError:
            return "n/a"
        return str(getattr(module, "__version__", "n/a"))


def package_versions() -> dict[str, str]:
    """Versions of every package the CSV reports."""
    versions = {key: package_version(key) for key in VERSION_DISTRIBUTIONS if key != "cce"}
    versions["torch"] = torch.__version__
    return versions


def fmt(value: Any) -> str:
    """Compact cell text: 4 significant digits for floats, text as is."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_csv_rows(path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    """Write rows with ``columns`` first, then any other keys (sorted); floats as :func:`fmt` writes them."""
    extra = sorted({key for row in rows for key in row} - set(columns))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*columns, *extra], restval="n/a")
        writer.writeheader()
        writer.writerows({key: fmt(value) if isinstance(value, float) else value for key, value in row.items()}
                         for row in rows)


def save_results(name: str, rows: list[dict[str, Any]], device: torch.device, args: argparse.Namespace,
                 columns: tuple[str, ...], printed: tuple[str, ...], packages: tuple[str, ...],
                 show: bool = True) -> list[dict[str, Any]]:
    """Rows with the device, versions of ``packages`` and date, written to ``args.out/<name>_<gpu>[_tag][_smoke].csv``
    and printed (``printed`` columns; ``show=False``: written only, as a long run does after every row so that a run
    cut short keeps what it measured); returns them."""
    meta = {"gpu_name": gpu_name(device), "torch": torch.__version__, **{key: package_version(key) for key in packages},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    rows = [{**meta, **row} for row in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{gpu_slug(device)}" + (f"_{args.tag}" if args.tag else "") + ("_smoke" if args.smoke else "")
    write_csv_rows(args.out / f"{stem}.csv", rows, columns)
    if show:
        print_rows(rows, printed)
        print(f"wrote {args.out / stem}.csv")
    return rows


def subplots(rows: int, cols: int, size: tuple[float, float]) -> tuple[Any, Any]:
    """A matplotlib figure (headless backend) and its ``[rows][cols]`` axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=size, squeeze=False)


def save_figure(fig: Any, path: Path, title: str, dpi: int = 110) -> None:
    """Title, lay out, write and close ``fig``."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_lines(axis: Any, rows: list[dict[str, Any]], metric: str, series: str) -> None:
    """One line of ``metric`` against ``T`` per value of ``rows[series]``; OOM/error/NaN points left out."""
    for name in dict.fromkeys(row[series] for row in rows):
        points = [(r["T"], r[metric]) for r in rows
                  if r[series] == name and isinstance(r[metric], float) and math.isfinite(r[metric])]
        if points:
            axis.plot(*zip(*points), marker="o", label=name)


def format_tokens_axis(axis: Any, tokens: list[int], xlabel: str, ylabel: str, log_y: bool) -> None:
    """A log2 token axis labelled 8K, 32K, ...; grid; legend when there are lines."""
    axis.set_xscale("log", base=2)
    if log_y:
        axis.set_yscale("log")
    axis.set_xticks(tokens, [f"{t // 1024}K" if t % 1024 == 0 else str(t) for t in tokens])
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.grid(True, which="both", alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)


def print_rows(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    """Print ``columns`` of ``rows`` as an aligned text table."""
    cells = [[fmt(row.get(c, "n/a")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    for line in ([*columns], *cells):
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
