"""The speed-memory curve of tiledmlp's tile shape: tokens per shard x intermediate blocks.

For each sequence length: ``eager`` and ``liger_tiled`` as references, then tiledmlp with every
``tile_tokens:inter_chunks`` pair of ``--tiles``. Forward+backward time (median) and peak memory above
inputs, as in ``bench_mlp.py`` (whose helpers this reuses). Writes ``bench_tiles_<gpu>.csv`` and a PNG
of time ratio vs peak memory, one line per sequence length — the data behind the auto shard policy.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

import bench_mlp as bm
from tiledmlp.core import sharding

DEFAULT_DH_SPLIT = sharding.DH_SPLIT

DEFAULT_TILES = "auto,mib=256,mib=384,mib=768,8192:1,16384:1,16384:2,32768:4,16384:2/fp32"


def tile_options(tile: str) -> dict:
    """``auto``, ``mib=N`` (auto with ``scratch_mib=N``) or ``R:C`` (R tokens, C intermediate blocks),
    optionally suffixed ``/fp32`` (float32 gradient accumulators instead of the block-scaled default)
    or ``/dhN`` (``dh`` in N column blocks instead of ``sharding.DH_SPLIT``; sets ``_dh_split``)."""
    shape, _, suffix = tile.partition("/")
    options: dict = {}
    if suffix == "fp32":
        options["grad_accum_dtype"] = torch.float32
    elif suffix.startswith("dh"):
        options["_dh_split"] = int(suffix[2:])
    elif suffix:
        raise SystemExit(f"unknown suffix in {tile!r}; use /fp32, /dhN or nothing")
    if shape.startswith("mib="):
        options["scratch_mib"] = float(shape[4:])
    elif shape != "auto":
        rows_per, chunks = (int(v) for v in shape.split(":"))
        options.update(tile_tokens=rows_per, inter_chunks=chunks)
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="8192,32768,131072")
    parser.add_argument("--tiles", default=DEFAULT_TILES,
                        help="comma-separated; see tile_options()")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--baselines", default="eager,liger_tiled")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    dtype = torch.bfloat16
    shape = bm.Shape(args.hidden, args.intermediate, "silu")
    state = bm.master_state_dict(shape, device, dtype, 0)
    run_args = argparse.Namespace(warmup=2, reps=args.reps, settle_seconds=bm.SETTLE_SECONDS, tiledmlp_options={})
    rows = []
    for tokens in (int(t) for t in args.seq_lens.split(",")):
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = torch.randn(1, tokens, shape.hidden, generator=gen, device=device).to(dtype).requires_grad_()
        g = torch.randn(1, tokens, shape.hidden, generator=gen, device=device).to(dtype)
        variants = [(name, {}) for name in args.baselines.split(",") if name]
        variants += [(f"tiledmlp[{tile}]", tile_options(tile)) for tile in args.tiles.split(",")]
        eager_ms = None
        for label, options in variants:
            options = dict(options)
            sharding.DH_SPLIT = options.pop("_dh_split", DEFAULT_DH_SPLIT)
            run_args.tiledmlp_options = options
            base = label.split("[")[0]
            result = bm.measure_or_record(base, shape, state, x, g, None, run_args)
            if label == "eager" and isinstance(result["time_ms"], float):
                eager_ms = result["time_ms"]
            ratio = result["time_ms"] / eager_ms if eager_ms and isinstance(result["time_ms"], float) else "n/a"
            rows.append({"variant": label, "T": tokens, "time_ms": result["time_ms"], "ratio": ratio,
                         "peak_mib": result["peak_mib"], "gpu_name": bm.gpu_name(device), **bm.package_versions(),
                         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
            print(f"T={tokens:>7} {label:<24} {bm.fmt(result['time_ms'])} ms  ratio {bm.fmt(ratio)}  "
                  f"peak {bm.fmt(result['peak_mib'])} MiB", flush=True)
    out = Path(__file__).parent / "results" / f"bench_tiles_{bm.gpu_slug(device)}.csv"
    out.parent.mkdir(exist_ok=True)
    bm.write_csv(out, rows)
    _plot(out.with_suffix(".png"), rows, bm.gpu_name(device))


def _plot(path: Path, rows: list[dict], gpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for tokens in sorted({r["T"] for r in rows}):
        pts = [r for r in rows if r["T"] == tokens and r["variant"].startswith("tiledmlp") and isinstance(r["ratio"], float)]
        ax.scatter([r["peak_mib"] for r in pts], [r["ratio"] for r in pts], label=f"tiledmlp T={tokens}")
        for r in pts:
            ax.annotate(r["variant"].removeprefix("tiledmlp"), (r["peak_mib"], r["ratio"]), fontsize=6)
        liger = [r for r in rows if r["T"] == tokens and r["variant"] == "liger_tiled" and isinstance(r["ratio"], float)]
        ax.scatter([r["peak_mib"] for r in liger], [r["ratio"] for r in liger], marker="x", color="k")
    ax.set_xscale("log")
    ax.set_xlabel("peak memory above inputs (MiB)")
    ax.set_ylabel("time / eager time")
    ax.set_title(f"{gpu}: tile shape (tokens x intermediate blocks); x = Liger tiled")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
