"""A walk of one tiled MLP call through the package, as ``shared/house``'s walk figure draws it: where control is
(the package of the running ``tiledmlp`` frame) from the call's start to its end, one call of a tiled MLP after a
first one has planned and decided what can be decided. Counted:

* **folders**: the packages the walk enters;
* **moves**: changes of package (a call into another package, or a return to the caller's);
* **climbs**: moves to a package on a higher floor (docs/design.md's table) — returns up the layers, and calls up;
* **entered**: per package, how many times control came into it from another one;
* **up-calls**: calls (not returns) into a higher floor: a lower room asking a higher one.

    python3 benchmarks/walk_one_call.py            # a tiny Llama's MLP on the CPU, the table printed
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import tiledmlp  # noqa: E402

PACKAGE = Path(tiledmlp.__file__).resolve().parent


def floors() -> dict[str, int]:
    """``{package: floor}`` from docs/design.md's table."""
    text = (REPO_ROOT / "docs" / "design.md").read_text()
    return {pkg: int(n) for n, pkg in re.findall(r"^\| (\d+) \| `(\w+)/` \|", text, re.M)}


def module_of(filename: str) -> str:
    """``package/module`` of a file inside ``tiledmlp`` ("" outside it)."""
    path = Path(filename)
    try:
        return str(path.resolve().relative_to(PACKAGE).with_suffix(""))
    except ValueError:
        return ""


def walk(call: Any) -> tuple[list[str], list[tuple[str, str]]]:
    """While ``call()`` runs: the packages control is in, in order (consecutive repeats merged), and the
    ``(caller, callee)`` packages of every call between two packages."""
    where: list[str] = []
    calls: list[tuple[str, str]] = []

    def package(frame: Any) -> str:
        return module_of(frame.f_code.co_filename).split("/")[0] if frame is not None else ""

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        here = package(frame) if event == "call" else package(frame.f_back)
        if event == "call" and here and package(frame.f_back) and package(frame.f_back) != here:
            calls.append((package(frame.f_back), here))
        if here and (not where or where[-1] != here):
            where.append(here)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return where, calls


def summary(where: list[str], calls: list[tuple[str, str]]) -> dict[str, Any]:
    floor = floors()
    steps = list(zip(where, where[1:]))
    return {"folders": len(set(where)), "moves": len(steps),
            "climbs": sum(floor.get(b, 0) > floor.get(a, 0) for a, b in steps),
            "entered": dict(Counter(b for _, b in steps)),
            "up-calls": dict(Counter((a, b) for a, b in calls if floor.get(b, 0) > floor.get(a, 0))),
            "walk": " > ".join(where)}


def main() -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=88, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    tiledmlp.enable_tiling(model, loss=False, num_shards=2)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 16, 32, requires_grad=True)
    mlp(x).sum().backward()  # the first call plans what it can: the walk is of a call after it
    result = summary(*walk(lambda: mlp(x)))
    for key, value in result.items():
        print(f"{key}: {value}")
    return result


if __name__ == "__main__":
    main()
