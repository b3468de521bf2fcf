"""The first training steps of a long-context model, as a new user meets them: each variant in a fresh process
(fresh CUDA context; by default a fresh, empty Triton cache), timing the model build, ``enable_tiling``, and
each step, with what the first step spends that later ones do not.

Model and variants as ``bench_longctx.py`` (``--model 1b|8b``, ``untiled``, ``loss+norms+offload``, ...). Per
variant and step the script records the step's wall time and, inside it, the time spent compiling Triton
kernels (Triton's JIT hooks) and waiting for pinned host buffers for ``offload="cpu"`` (``--profile`` also
prints, per function, what the first step spends beyond the second: cProfile). The first step's
overhead is ``first - steady`` (steady: the median of the later steps); the target (issue 30) is a tiled
first-step overhead within 3 s of the untiled model's, measured in the same run.

    python3 benchmarks/bench_first_step.py --model 8b --seq-len 131072 --variants loss+norms+offload
    python3 benchmarks/bench_first_step.py --model 8b --seq-len 32768 --variants untiled,loss+norms+offload
    python3 benchmarks/bench_first_step.py --smoke        # tiny model on a CPU: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_longctx import MODEL_NAMES, MODELS, SMOKE, VARIANTS, build_model, configure, loss_of, sync  # noqa: E402
from bench_mlp import bench_device, parse_variants  # noqa: E402
from reporting import fmt, gpu_name, gpu_slug, package_version, print_rows, write_csv_rows  # noqa: E402

COLUMNS = ("variant", "model", "layers", "T", "triton_cache", "build_s", "enable_s", "first_s", "steady_s",
           "overhead_s", "first_compile_s", "compiles", "first_host_alloc_s", "host_buffers", "peak_gib", "gpu_name",
           "torch", "triton", "transformers", "tiledmlp", "date")


class _Clock:
    """Seconds spent in Triton compilation and pinned host allocation, between two readings."""

    def __init__(self) -> None:
        self.compile_s = self.host_s = 0.0
        self.compiles = self.host_buffers = 0
        self._start: Optional[float] = None
        self._hook_triton()
        self._hook_host_buffers()

    def _hook_triton(self) -> None:
        try:
            from triton import knobs
        except ImportError:
            return
        runtime = knobs.runtime

        def before(*args: Any, **kwargs: Any) -> bool:
            self._start = time.perf_counter()
            return False  # compile as usual

        def after(*args: Any, **kwargs: Any) -> None:
            if self._start is not None:
                self.compile_s += time.perf_counter() - self._start
                self.compiles += 1
                self._start = None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after

    def _hook_host_buffers(self) -> None:
        from tiledmlp.offload.host import HostOffload

        original = HostOffload._host_buffer

        def timed(offloader: Any, nbytes: int) -> torch.Tensor:
            begin, count = time.perf_counter(), offloader.stats["host_buffers"]
            buf = original(offloader, nbytes)
            self.host_s += time.perf_counter() - begin
            self.host_buffers += offloader.stats["host_buffers"] - count
            return buf

        HostOffload._host_buffer = timed

    def read(self) -> tuple[float, int, float, int]:
        values = (self.compile_s, self.compiles, self.host_s, self.host_buffers)
        self.compile_s = self.host_s = 0.0
        self.compiles = self.host_buffers = 0
        return values


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this (fresh) process."""
    clock = _Clock()
    device, dtype = bench_device(args.smoke)
    size = dict(SMOKE if args.smoke else MODELS[args.model])
    if args.layers:
        size["layers"] = args.layers
    begin = time.perf_counter()
    model = build_model(size, args.seq_len, device, dtype)
    sync(device)
    build_s = time.perf_counter() - begin
    begin = time.perf_counter()
    configure(model, args.variant)
    enable_s = time.perf_counter() - begin
    gen = torch.Generator(device=device).manual_seed(args.seq_len)
    ids = torch.randint(model.config.vocab_size, (1, args.seq_len), generator=gen, device=device)
    clock.read()
    steps, profiles = [], []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        sync(device)
        profiler = cProfile.Profile() if args.profile and len(profiles) < 2 else None
        begin = time.perf_counter()
        with profiler or contextlib.nullcontext():
            loss_of(model, args.variant, {"input_ids": ids, "labels": ids}).backward()
            sync(device)
        steps.append((time.perf_counter() - begin, *clock.read()))
        if profiler is not None:
            profiles.append(pstats.Stats(profiler).stats)
    if len(profiles) == 2:
        print(_first_step_extra(*profiles), flush=True)
    first, compile_s, compiles, host_s, buffers = steps[0]
    steady = statistics.median(s[0] for s in steps[1:]) if len(steps) > 1 else float("nan")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"variant": args.variant, "model": "smoke" if args.smoke else args.model, "layers": size["layers"],
            "T": args.seq_len, "build_s": build_s, "enable_s": enable_s, "first_s": first, "steady_s": steady,
            "overhead_s": first - steady, "first_compile_s": compile_s,
            "compiles": compiles + sum(s[2] for s in steps[1:]), "first_host_alloc_s": host_s,
            "host_buffers": buffers + sum(s[4] for s in steps[1:]), "peak_gib": peak, "gpu_name": gpu_name(device)}


def _first_step_extra(first: dict, second: dict, top: int = 25) -> str:
    """The functions whose time (own, and cumulative) the first step spends beyond the second's (cProfile)."""
    lines = []
    for column, label in ((2, "own"), (3, "cumulative")):
        extra = sorted(((stat[column] - second.get(key, (0, 0, 0.0, 0.0))[column], key) for key, stat in first.items()),
                       reverse=True)[:top]
        lines.append(f"first step's extra {label} time (s), by function:")
        lines += [f"  {seconds:8.3f}  {Path(key[0]).name}:{key[1]} {key[2]}" for seconds, key in extra]
    return "\n".join(lines)


def run_child(args: argparse.Namespace, variant: str, cache_dir: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--model", args.model, "--seq-len",
           str(args.seq_len), "--steps", str(args.steps)] + (["--layers", str(args.layers)] if args.layers else []) \
        + (["--smoke"] if args.smoke else []) + (["--profile"] if args.profile else [])
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if args.profile:
        print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("RESULT ")), flush=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        return {"variant": variant, "T": args.seq_len, "first_s": f"failed (exit {done.returncode})", "error": tail}
    return json.loads(lines[-1].removeprefix("RESULT "))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="untiled,loss+norms+offload")
    parser.add_argument("--model", choices=sorted(MODELS), default="8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None, help="tokens of the one sequence (default 32768)")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant (the first is the one measured)")
    parser.add_argument("--triton-cache", choices=("cold", "warm"), default="cold",
                        help="cold: every variant starts with an empty Triton cache (a first run on a machine); "
                             "warm: one cache for the whole run, filled beforehand by a tiny smoke step")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--profile", action="store_true",
                        help="print the functions (cProfile) on which the first step spends more than the second")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, float32 on a CPU")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 256 if args.smoke else 32768
    args.variants = parse_variants(args.variants, VARIANTS)
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the overhead is the first step against the later ones")
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return []
    device, _ = bench_device(args.smoke)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tiledmlp-triton-") as shared:
        if args.triton_cache == "warm":
            run_child(argparse.Namespace(**{**vars(args), "seq_len": 256, "steps": 2, "smoke": True}),
                      "loss+norms+offload", shared)
        for variant in args.variants:
            cache = shared if args.triton_cache == "warm" else tempfile.mkdtemp(prefix="tiledmlp-triton-", dir=shared)
            row = {**run_child(args, variant, cache), "triton_cache": args.triton_cache}
            rows.append(row)
            print(f"  {variant:<20} first_s={fmt(row.get('first_s'))} steady_s={fmt(row.get('steady_s'))} "
                  f"compile_s={fmt(row.get('first_compile_s'))} host_alloc_s={fmt(row.get('first_host_alloc_s'))}",
                  flush=True)
            if "error" in row:
                print(row.pop("error"), flush=True)
    meta = {"torch": torch.__version__, **{k: package_version(k) for k in ("triton", "transformers", "tiledmlp")},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    rows = [{**meta, **row} for row in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = (f"bench_first_step_{gpu_slug(device)}_{'smoke' if args.smoke else args.model}"
            + (f"_{args.tag}" if args.tag else ""))
    write_csv_rows(args.out / f"{stem}.csv", rows, COLUMNS)
    print_rows(rows, ("variant", "T", "enable_s", "first_s", "steady_s", "overhead_s", "first_compile_s",
                      "first_host_alloc_s", "peak_gib"))
    shape = "smoke" if args.smoke else MODEL_NAMES[args.model]
    print(f"{gpu_name(device)}, {shape} shape; wrote {args.out / stem}.csv")
    return rows


if __name__ == "__main__":
    main()
