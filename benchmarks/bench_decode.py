"""Decode with a tiled model: Hugging Face ``generate`` on a Llama-3.2-1B-shaped model, tiled vs untiled.

Tiling cannot help decode (one token per step), so a tiled model must cost nothing there: under
``no_grad`` a call that fits one shard calls the module's original forward. Variants, on the same model
object: ``untiled``; ``tiled`` (``enable_tiling(model, loss=True)``). Each generates ``--new-tokens``
tokens greedily after a ``--prompt``-token prompt (prefill included). The variants alternate, round by
round (``--reps`` timed rounds after an untimed one; tiling enabled and disabled each round), so that
neither is timed on a colder GPU; reported: the median time per generated token and the ratio to untiled
(target: within 2%), and whether the tiled tokens equal the same round's untiled tokens. On a GPU in bf16
the untiled model itself may generate other tokens from one run to the next (kernel choices depend on
memory alignment, and greedy decoding amplifies a last-bit difference): ``untiled_runs_agree`` says
whether its rounds agreed among themselves, the baseline ``same_tokens`` is to be read against.

    python3 benchmarks/bench_decode.py                 # GPU: bf16, 1B shape, 256 new tokens
    python3 benchmarks/bench_decode.py --smoke         # a tiny model on a CPU: checks the script
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import tiledmlp  # noqa: E402
from bench_longctx import FULL, SMOKE, build_model, sync  # noqa: E402
from bench_mlp import bench_device  # noqa: E402
from reporting import fmt, gpu_name, gpu_slug, package_version, print_rows, write_csv_rows  # noqa: E402

COLUMNS = ("variant", "prompt", "new_tokens", "ms_per_token", "ratio_vs_untiled", "same_tokens", "untiled_runs_agree",
           "gpu_name",
           "torch", "transformers", "tiledmlp", "date")


def generate_ms(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int,
                device: torch.device) -> tuple[float, torch.Tensor]:
    """Milliseconds per generated token of one greedy ``generate``, and the tokens."""
    sync(device)
    begin = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    sync(device)
    return (time.perf_counter() - begin) * 1e3 / new_tokens, out


def alternate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, reps: int,
              device: torch.device) -> dict[str, list]:
    """``{variant: [(ms per token, tokens) per timed round]}``, untiled and tiled alternating each round."""
    runs: dict[str, list] = {"untiled": [], "tiled": []}
    for round_ in range(reps + 1):
        untiled = generate_ms(model, ids, new_tokens, device)
        tiledmlp.enable_tiling(model, loss=True)
        tiled = generate_ms(model, ids, new_tokens, device)
        tiledmlp.disable_tiling(model)
        if round_:  # the first round warms both up
            runs["untiled"].append(untiled)
            runs["tiled"].append(tiled)
    return runs


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; smoke 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 256; smoke 8)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, float32 on a CPU: checks the script")
    args = parser.parse_args(argv)
    args.prompt = args.prompt or (16 if args.smoke else 512)
    args.new_tokens = args.new_tokens or (8 if args.smoke else 256)
    if args.smoke:
        args.reps = min(args.reps, 2)
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device, dtype = bench_device(args.smoke)
    model = build_model(SMOKE if args.smoke else FULL, args.prompt + args.new_tokens, device, dtype).eval()
    model.gradient_checkpointing_disable()
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (1, args.prompt), generator=gen, device=device)
    print(f"{gpu_name(device)}: Llama-3.2-1B-shaped model, {dtype}, prompt {args.prompt}, {args.new_tokens} new tokens",
          flush=True)
    runs = alternate(model, ids, args.new_tokens, args.reps, device)
    meta = {"prompt": args.prompt, "new_tokens": args.new_tokens, "gpu_name": gpu_name(device),
            "torch": torch.__version__, "transformers": package_version("transformers"),
            "tiledmlp": package_version("tiledmlp"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    ms = {variant: statistics.median(t for t, _ in rounds) for variant, rounds in runs.items()}
    untiled_tokens = [tokens for _, tokens in runs["untiled"]]
    agree = all(torch.equal(untiled_tokens[0], t) for t in untiled_tokens)
    same = all(torch.equal(u, t) for u, (_, t) in zip(untiled_tokens, runs["tiled"]))
    rows = [{**meta, "variant": "untiled", "ms_per_token": ms["untiled"], "ratio_vs_untiled": 1.0, "same_tokens": True,
             "untiled_runs_agree": agree},
            {**meta, "variant": "tiled", "ms_per_token": ms["tiled"], "ratio_vs_untiled": ms["tiled"] / ms["untiled"],
             "same_tokens": same, "untiled_runs_agree": agree}]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_decode_{gpu_slug(device)}" + ("_smoke" if args.smoke else "")
    write_csv_rows(args.out / f"{stem}.csv", rows, COLUMNS)
    print_rows(rows, ("variant", "ms_per_token", "ratio_vs_untiled", "same_tokens", "untiled_runs_agree"))
    print(f"tiled decode {fmt(rows[1]['ratio_vs_untiled'])}x untiled; wrote {args.out / stem}.csv")
    return rows


if __name__ == "__main__":
    main()
