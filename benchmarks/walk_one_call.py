"""A walk of one tiled MLP call through the package, as ``shared/house``'s walk figure draws it: where control is
(the package of the running ``tiledmlp`` frame) from the call's start to its end, one call of a tiled MLP after a
first one has planned and decided what can be decided. Counted:

* **folders**: the packages the walk enters;
* **moves**: changes of package (a call into another package, or a return to the caller's);
* **climbs**: moves to a package on a higher floor (docs/design.md's table) — returns up the layers, and calls up;
* **entered**: per package, how many times control came into it from another one;
* **up-calls**: calls (not returns) into a higher floor: a lower package asking a higher one.

Counted twice: in full, and **folded** as the drawing draws a loop (an edge walked N times is one arrow, "xN"): where
the same run of moves, arriving in the same functions, repeats back to back (a form's shards, one per loop turn; one
read per parameter slot), it is counted once and written ``(a > b) xN``. Moves that pass through the same packages
but arrive in other functions (a context's entry and its exit) are not a loop and are not folded.

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


def walk(call: Any) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """While ``call()`` runs: where control arrives each time it changes package, in order, as ``(package,
    module:function)``, and the ``(caller, callee)`` packages of every call between two packages."""
    where: list[tuple[str, str]] = []
    calls: list[tuple[str, str]] = []

    def module(frame: Any) -> str:
        return module_of(frame.f_code.co_filename) if frame is not None else ""

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        here = frame if event == "call" else frame.f_back  # where control is after the event
        package, caller = module(here).split("/")[0], module(frame.f_back).split("/")[0]
        if event == "call" and package and caller and caller != package:
            calls.append((caller, package))
        if package and (not where or where[-1][0] != package):
            where.append((package, f"{module(here)}:{here.f_code.co_name}"))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return where, calls


def folded(where: list[tuple[str, str]]) -> list[tuple[list[tuple[str, str]], int]]:
    """``where`` as runs ``(arrivals, times)``: a run of arrivals repeated back to back (the same packages and
    functions: one loop's turns) is kept once with its count; every other arrival is a run of one, once. Of the
    repeats starting at one place, the one covering most arrivals wins (the shortest on a tie)."""
    runs: list[tuple[list[tuple[str, str]], int]] = []
    i = 0
    while i < len(where):
        best_period, best_times = 1, 1
        for period in range(1, (len(where) - i) // 2 + 1):
            times = 1
            while where[i + times * period:i + (times + 1) * period] == where[i:i + period]:
                times += 1
            if times > 1 and times * period > best_times * best_period:
                best_period, best_times = period, times
        runs.append((where[i:i + best_period], best_times))
        i += best_period * best_times
    return runs


def summary(where: list[str], calls: list[tuple[str, str]]) -> dict[str, Any]:
    floor = floors()
    steps = list(zip(where, where[1:]))
    return {"folders": len(set(where)), "moves": len(steps),
            "climbs": sum(floor.get(b, 0) > floor.get(a, 0) for a, b in steps),
            "entered": dict(Counter(b for _, b in steps)),
            "up-calls": dict(Counter((a, b) for a, b in calls if floor.get(b, 0) > floor.get(a, 0))),
            "walk": " > ".join(where)}


def folded_summary(where: list[tuple[str, str]]) -> dict[str, Any]:
    """:func:`summary`'s counts with each loop's turns counted once (:func:`folded`), and the walk drawn with them."""
    runs = folded(where)
    once = [package for arrivals, _ in runs for package, _ in arrivals]
    counts = {k: v for k, v in summary(once, []).items() if k not in ("up-calls", "walk")}
    drawn = [" > ".join(p for p, _ in arrivals) if times == 1 else f"({' > '.join(p for p, _ in arrivals)}) x{times}"
             for arrivals, times in runs]
    return {**counts, "walk": " > ".join(drawn)}


def main() -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=88, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    tiledmlp.enable_tiling(model, loss=False, num_shards=2)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 16, 32, requires_grad=True)
    mlp(x).sum().backward()  # the first call plans what it can: the walk is of a call after it
    where, calls = walk(lambda: mlp(x))
    result = summary([package for package, _ in where], calls)
    result["folded"] = folded_summary(where)
    for key, value in result.items():
        if key != "folded":
            print(f"{key}: {value}")
    print("folded (a loop's turns counted once):")
    for key, value in result["folded"].items():
        print(f"  {key}: {value}")
    return result


if __name__ == "__main__":
    main()
