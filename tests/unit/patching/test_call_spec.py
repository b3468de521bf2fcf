"""One tiled call takes one step into each package it needs (``patching/call_spec.py``): the strategy's
(``Strategy.opened``: its forward context, the slots' tensors read, checked and made local), the form's
(``FormSpec.tile_call``: the form and its cut), then the tiled function; and what follows from fixed facts (the
slots' index map, the layout over the unique tensors) is decided once per identity pattern of the slots' tensors
(``forms/spec.py``, design note), made again when a parameter is replaced or tied after ``enable_tiling``."""

from __future__ import annotations

import copy
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import tiledmlp
from tiledmlp.core.compiled import STATE_ATTR
from tiledmlp.forms.mlp import MLPLayout
from unit_helpers import check_against_untiled, llama_mlp

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from walk_one_call import walk  # noqa: E402


def moves(call: Callable[[], Any]) -> Counter:
    """``{(package, package): times}``: how often control went from one ``tiledmlp`` package to another (a call, or a
    return to its caller) while ``call()`` ran (``benchmarks/walk_one_call.py``'s walk)."""
    packages = [package for package, _ in walk(call)[0]]
    return Counter(zip(packages, packages[1:]))


def test_a_call_takes_one_step_into_the_strategy_and_one_into_the_form():
    """From the call spec: into ``distributed/`` for the strategy's step and its context's exit (before, also for
    the parameter check, the local tensors and the backward context, one trip each, and for a finish that had
    nothing to do without tensor parallelism), and into ``forms/`` once to read the slots (from the strategy's step)
    and once to build the form (before, once per slot read, the deduplication, the layout's remap and each size it
    asked of the layout)."""
    mlp = tiledmlp.enable_tiling(llama_mlp(), num_shards=2)
    state = mlp.__dict__[STATE_ATTR]
    x = torch.randn(1, 16, 32, requires_grad=True)
    mlp(x)  # the first call decides what can be decided
    strategy = state.strategy(mlp)
    went = moves(lambda: state.spec(strategy.opened, mlp, None, x))
    assert went[("patching", "distributed")] == 2
    assert went[("distributed", "forms")] == 1
    assert went[("patching", "forms")] == 1


def test_a_patched_call_enters_distributed_once():
    """The whole patched call (``forwards._tiled_forward``): ``auto``'s cached choice and the strategy's step are one
    trip into ``distributed/`` (``StrategyChoice.opened``), whose context's exit is the only other one; the
    hooked-children check takes none while no child has a hook (before: five trips, for the hooks check, the choice,
    the step, the finish and the exit). A hook registered later is still seen, and the call takes the generic form."""
    mlp = tiledmlp.enable_tiling(llama_mlp(), num_shards=2)
    x = torch.randn(1, 16, 32, requires_grad=True)
    mlp(x)
    went = moves(lambda: mlp(x))
    assert went[("patching", "distributed")] == 2
    seen = []
    mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(1))
    mlp(x)
    assert len(seen) == 2  # per shard: the generic form calls the children


def test_the_index_map_and_layout_are_made_once_per_identity_pattern(monkeypatch):
    """Repeated calls remap the layout over the unique tensors no more; tying two weights after ``enable_tiling``
    (a new identity pattern) makes it again, once, and the call computes with the tied weight."""
    remaps = []
    real = MLPLayout.remap
    monkeypatch.setattr(MLPLayout, "remap", lambda self, index: remaps.append(tuple(index)) or real(self, index))
    ref = llama_mlp()
    mlp = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=2)
    x = torch.randn(1, 16, 32)
    mlp(x)
    remaps.clear()
    mlp(x)
    mlp(x)
    assert remaps == []
    for module in (mlp, ref):
        module.up_proj.weight = module.gate_proj.weight  # tied: three slots, two tensors
    check_against_untiled(mlp, ref, x)
    mlp(x)
    assert remaps == [(0, 0, 1)]
    mlp.up_proj.weight = nn.Parameter(mlp.gate_proj.weight.detach().clone())  # untied again: followed
    ref.up_proj.weight = nn.Parameter(ref.gate_proj.weight.detach().clone())
    check_against_untiled(mlp, ref, x)
    assert remaps == [(0, 0, 1), (0, 1, 2)]
