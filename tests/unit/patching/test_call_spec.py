"""One tiled call takes one call into each package it needs (``patching/call_spec.py``): the strategy's
(``Strategy.prepare_call``: its forward context, the slots' tensors read, checked and made local), the form's
(``FormSpec.tile_call``: the form and its cut), then the tiled function; and what follows from fixed facts (the
slots' index map, the layout over the unique tensors; the cut, from the call's sizes) is decided once per identity
pattern of the slots' tensors or per sizes (``forms/spec.py``, [Note: a form decided once, checked cheaply]), made again when a parameter is replaced
or tied after ``enable_tiling``, or a call's sizes change."""

from __future__ import annotations

import contextlib
import copy
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import tiledmlp
from tiledmlp.core.compiled import STATE_ATTR
from tiledmlp.core.sharding import ShardPolicy
from tiledmlp.distributed import selection
from tiledmlp.distributed.strategies import PlainStrategy
from tiledmlp.forms.mlp import MLPLayout, MLPScratch
from unit_helpers import check_against_untiled, llama_mlp

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from walk_one_call import walk  # noqa: E402


def moves(call: Callable[[], Any]) -> Counter:
    """``{(package, package): times}``: how often control went from one ``tiledmlp`` package to another (a call, or a
    return to its caller) while ``call()`` ran (``benchmarks/walk_one_call.py``'s walk)."""
    packages = [package for package, _ in walk(call)[0]]
    return Counter(zip(packages, packages[1:]))


def test_a_call_takes_one_step_into_the_strategy_and_one_into_the_form():
    """From the call spec: into ``distributed/`` once, for the strategy's step (before, also for its context's exit,
    which a strategy without a forward context no longer has, for the parameter check, the local tensors and the
    backward context, one trip each, and for a finish that had nothing to do without tensor parallelism), and into
    ``forms/`` once to read the slots (from the strategy's step) and once to build the form (before, once per slot
    read, the deduplication, the layout's remap and each size it asked of the layout)."""
    mlp = tiledmlp.enable_tiling(llama_mlp(), num_shards=2)
    state = mlp.__dict__[STATE_ATTR]
    x = torch.randn(1, 16, 32, requires_grad=True)
    mlp(x)  # the first call decides what can be decided
    strategy = state.choice.strategy(mlp)
    went = moves(lambda: state.spec(strategy.prepare_call, mlp, None, x))
    assert went[("patching", "distributed")] == 1
    assert went[("distributed", "forms")] == 1
    assert went[("patching", "forms")] == 1


def test_a_patched_call_enters_each_package_once_besides_the_shards():
    """The whole patched call (``forwards._tiled_forward``), issue 43's "one call walks down once":

    * ``distributed/`` once: ``auto``'s cached choice and the strategy's step are one call
      (``StrategyChoice.prepare_call``), and a strategy without a forward context has none to exit; the
      hooked-children check takes none while no child has a hook (before: five trips, for the hooks check, the
      choice, the step, the finish and the exit; then two);
    * ``forms/`` once from there: the slots read once, for the choice's key and the call (before: twice);
    * ``core/`` once from the patched forward, for the tiled function: the re-entrance check reads ``SHARD_DEPTH``
      (before: a trip to ``in_shard``); and once from the form's step, for its tile call: the cut is remembered per
      sizes (before: a trip for the cut too), besides the shard loop's returns to core, one per shard.

    A hook registered later is still seen, and the call takes the generic form."""
    mlp = tiledmlp.enable_tiling(llama_mlp(), num_shards=2)
    x = torch.randn(1, 16, 32, requires_grad=True)
    mlp(x)
    went = moves(lambda: mlp(x))
    assert went[("patching", "distributed")] == 1
    assert went[("distributed", "forms")] == 1
    assert went[("patching", "core")] == 1
    assert went[("forms", "core")] == 1 + 2  # the tile call, then the two shards' returns to the loop
    assert went[("patching", "forms")] == 1
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


def test_the_cut_is_made_once_per_sizes(monkeypatch):
    """Repeated calls ask the policy for their cut no more; a call of another length is cut for its own sizes (and
    computes like the untiled module), and going back to the first length cuts again (only the last cut is kept)."""
    cuts = []
    real = ShardPolicy.mlp_cut
    monkeypatch.setattr(ShardPolicy, "mlp_cut", lambda self, *sizes: cuts.append(sizes) or real(self, *sizes))
    ref = llama_mlp()
    mlp = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=2)
    cuts.clear()  # enable_tiling's summary line's (describe, at 131072 tokens)
    mlp(torch.randn(1, 16, 32))
    mlp(torch.randn(1, 16, 32))
    assert cuts == [(16, MLPScratch(88, 4))]  # the scratch the MLP form declares: its width, 4-byte elements
    check_against_untiled(mlp, ref, torch.randn(1, 24, 32))
    mlp(torch.randn(1, 24, 32))
    mlp(torch.randn(1, 16, 32))
    assert cuts == [(16, MLPScratch(88, 4)), (24, MLPScratch(88, 4)), (16, MLPScratch(88, 4))]


class _Unsharding(PlainStrategy):
    """A strategy whose forward context puts another tensor in a slot, as FSDP2's unshard puts the unsharded
    parameters on the modules."""

    has_forward_context = True

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    @contextlib.contextmanager
    def forward_context(self, module: nn.Module):
        sharded = module.up_proj.weight
        module.up_proj.weight = self.weight
        try:
            yield
        finally:
            module.up_proj.weight = sharded


def test_a_strategy_with_a_forward_context_reads_inside_it(monkeypatch):
    """The choice's key is read before the strategy's context, the call's tensors inside it: the call computes with
    what the context put in the slots, and the form's index map is made for that pattern once, not again per call
    (a call that took the key's read, outside the context, as its own would alternate between two patterns)."""
    ref = llama_mlp()
    unsharded = nn.Parameter(torch.randn_like(ref.up_proj.weight))
    strategy = _Unsharding(unsharded)
    monkeypatch.setattr(selection, "strategy_for", lambda *args: strategy)
    mlp = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=2)
    ref.up_proj.weight = unsharded
    x = torch.randn(1, 16, 32)
    torch.testing.assert_close(mlp(x), ref(x))
    remaps = []
    real = MLPLayout.remap
    monkeypatch.setattr(MLPLayout, "remap", lambda self, index: remaps.append(tuple(index)) or real(self, index))
    torch.testing.assert_close(mlp(x), ref(x))
    torch.testing.assert_close(mlp(x), ref(x))
    assert remaps == []
    assert mlp.up_proj.weight is not unsharded  # left as it was
