"""What is alive at the peak of a long-context training step: every allocation live at the moment the GPU's
allocated bytes peak, grouped by what made it, in bytes per token.

One step (forward + backward) of a Llama-shaped model (``--model 8b``, ``--layers`` of it, bf16, sdpa, non-reentrant
checkpointing per layer, one sequence of ``--tokens``) under a tiling ``--variant`` (the parts of
``bench_longctx.configure``: ``untiled``, ``loss+norms+offload``, ...; ``--qlora``: bench_qlora's 4-bit model with
LoRA, ``--autocast``: under bf16 autocast), recorded with ``torch.cuda.memory._record_memory_history`` (C++ and
Python stacks). The trace is replayed allocation by allocation; at the highest point of the bytes allocated *during
the step* (weights and inputs, allocated before, are left out and reported as ``before``) the live blocks are
grouped by their origin: the innermost frame outside torch (the Hugging Face, peft or tiledmlp line; ``[recompute]``
inside a checkpoint's recompute), else the autograd node whose C++ backward made them (``MmBackward0``, ...), else
the innermost torch frame. The table (``--out``, CSV and Markdown) lists each group's bytes per token and count,
largest first.

    python3 benchmarks/profile_layer_memory.py --model 8b --layers 2 --tokens 65536 --variant loss+norms+offload
    python3 benchmarks/profile_layer_memory.py --smoke     # the replay and grouping on a made-up trace (CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_longctx import MODELS, build_model, configure, free, sync  # noqa: E402
from reporting import gpu_slug  # noqa: E402
from bench_qlora import qlora_model  # noqa: E402

#: Files whose frames name nothing: the first frame outside them is the allocation's author.
PLUMBING = ("torch/", "<frozen", "<string>", "functools.py", "contextlib.py", "profile_layer_memory.py")
#: A C++ autograd node's ``apply`` in a frame's (demangled) name.
BACKWARD_NODE = re.compile(r"(\w+Backward\w*)::apply")


def origin(frames: list[dict[str, Any]]) -> str:
    """What made a block (``frames`` innermost first): the innermost Python frame outside torch
    (``modeling_llama.py:forward:123``; ``via`` the innermost Python frame where torch code allocated; marked
    ``[recompute]`` under a checkpoint's recompute), else the autograd node whose C++ backward allocated it
    (``MmBackward0``), else the innermost Python frame at all."""
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    recompute = any(f["filename"].endswith("checkpoint.py") and "recompute" in f["name"] for f in python)
    for frame in python:
        if not any(part in frame["filename"] for part in PLUMBING):
            where = _where(frame) + ("" if frame is python[0] else f" via {_where(python[0])}")
            return where + (" [recompute]" if recompute else "")
    for frame in frames:
        node = BACKWARD_NODE.search(frame.get("name", ""))
        if node:
            return node.group(1)
    return _where(python[0]) if python else "unknown"


def _where(frame: dict[str, Any]) -> str:
    return f"{Path(frame['filename']).name}:{frame['name']}:{frame['line']}"


def alive_at_peak(events: list[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]]]:
    """Replay a device trace (``alloc``, ``free_completed``): the highest total of blocks allocated during the trace
    and the blocks live at that moment (address -> event). Blocks freed but never seen allocated were there before
    the recording and are ignored."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: dict[int, dict[str, Any]] = {}
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return peak, at_peak


def table(blocks: dict[int, dict[str, Any]], tokens: int) -> list[dict[str, Any]]:
    """Live blocks grouped by :func:`origin`: bytes, KiB per token, count; largest first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for event in blocks.values():
        groups[origin(event.get("frames", []))].append(event["size"])
    rows = [{"origin": name, "bytes": sum(sizes), "kib_per_token": sum(sizes) / tokens / 1024, "count": len(sizes)}
            for name, sizes in groups.items()]
    return sorted(rows, key=lambda r: -r["bytes"])


def record_step(args) -> tuple[list[dict[str, Any]], int, int]:
    """One recorded step on the GPU: its device trace, bytes allocated before it, the step's max allocated."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    if args.qlora:  # bench_qlora's model: 4-bit projections, LoRA r=16 on each
        model = qlora_model(argparse.Namespace(smoke=False, model=args.model, layers=args.layers), device, dtype,
                            args.tokens)
    else:
        model = build_model(dict(MODELS[args.model], layers=args.layers), args.tokens, device, dtype)
    configure(model, args.variant)
    ids = torch.randint(model.config.vocab_size, (1, args.tokens), device=device)
    precision = torch.autocast("cuda", dtype=dtype) if args.autocast else contextlib.nullcontext()
    with precision:
        loss = model(input_ids=ids[:, :4096], labels=ids[:, :4096]).loss
    loss.backward()  # warm-up: kernels, workspaces
    free(model, device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="all", stacks="all")
    with precision:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    sync(device)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot["device_traces"][device.index or 0], before, torch.cuda.max_memory_allocated(device)


def made_up_trace() -> list[dict[str, Any]]:
    """A trace for ``--smoke``: a block freed before the peak, two live at it, one allocated after."""
    py = lambda file, name: [{"filename": file, "name": name, "line": 1}]  # noqa: E731
    backward = [{"filename": "??", "name": "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)",
                 "line": 0}, *py("profile_layer_memory.py", "main")]
    return [{"action": "alloc", "addr": 1, "size": 400, "frames": py("modeling_llama.py", "forward")},
            {"action": "free_completed", "addr": 1, "size": 400},
            {"action": "alloc", "addr": 2, "size": 300, "frames": py("modeling_llama.py", "forward")},
            {"action": "alloc", "addr": 3, "size": 200, "frames": backward},
            {"action": "free_completed", "addr": 3, "size": 200},
            {"action": "free_completed", "addr": 99, "size": 1000},
            {"action": "alloc", "addr": 4, "size": 100, "frames": py("torch/nn/functional.py", "linear")}]


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--variant", default="loss+norms+offload")
    parser.add_argument("--qlora", action="store_true", help="4-bit projections with LoRA r=16 (bench_qlora's model)")
    parser.add_argument("--autocast", action="store_true", help="under bf16 autocast (the Trainer's bf16=True)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--smoke", action="store_true", help="replay a made-up trace (no GPU needed)")
    args = parser.parse_args(argv)
    if args.smoke:
        events, before, max_allocated, args.tokens, name = made_up_trace(), 0, 0, 1, "smoke"
    else:
        events, before, max_allocated = record_step(args)
        name = (f"{gpu_slug(torch.device('cuda'))}_{args.model}{'_qlora' if args.qlora else ''}"
                f"{'_autocast' if args.autocast else ''}_{args.layers}l_{args.tokens}_{args.variant}")
    return write_profile(events, before, max_allocated, args.tokens, args.out / f"profile_layer_memory_{name}")


def write_profile(events: list[dict[str, Any]], before: int, max_allocated: int, tokens: int,
                  stem: Path) -> list[dict[str, Any]]:
    """What was alive at the peak of a recorded step (``events``: a device trace), per ``tokens``, printed and
    written to ``stem``.csv and ``stem``.md (``bench_sp.py --memory-trace`` writes its rank 0's the same way)."""
    peak, blocks = alive_at_peak(events)
    rows = table(blocks, tokens)
    print(f"before the step {before / 2**30:.2f} GiB; peak during it {peak / 2**30:.2f} GiB above that "
          f"({peak / tokens / 1024:.1f} KiB/token); max_memory_allocated {max_allocated / 2**30:.2f} GiB")
    stem.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=("origin", "bytes", "kib_per_token", "count"))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| what made it | KiB/token | blocks |", "|---|---|---|"]
    lines += [f"| `{r['origin']}` | {r['kib_per_token']:.1f} | {r['count']} |" for r in rows]
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    Path(f"{stem}_stacks.txt").write_text(stacks(events, blocks, tokens))
    return rows


def stacks(events: list[dict[str, Any]], blocks: dict[int, dict[str, Any]], tokens: int, depth: int = 10) -> str:
    """The call stacks (Python frames outside torch, innermost first, ``depth`` at most) of the blocks live at the
    peak, largest first, and of the allocation that made the peak: where each was made, and when the peak was."""
    def frames(event: dict[str, Any]) -> str:
        python = [f for f in event.get("frames", []) if f.get("filename", "").endswith(".py")]
        outside = [f for f in python[1:] if not any(part in f["filename"] for part in PLUMBING)]
        return " < ".join(_where(f) for f in python[:1] + outside[:depth - 1])

    order = {id(e): i for i, e in enumerate(events)}
    last = max(blocks.values(), key=lambda e: order[id(e)]) if blocks else None
    lines = [f"the peak came with: {frames(last)}" if last else "no blocks"]
    lines += [f"{e['size'] / tokens / 1024:6.2f} KiB/token  {frames(e)}"
              for e in sorted(blocks.values(), key=lambda e: -e["size"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
