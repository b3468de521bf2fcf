"""Strategy choice decided once per wrapping (``tiledmlp.distributed.selection``,
[Note: a strategy decided once, checked cheaply]): a tiled call reads the wrapping again only when what it depends on changed, and the functional calls
pick in the same module."""

from __future__ import annotations

import pickle

import torch
from torch import nn

import tiledmlp
from tiledmlp.distributed import selection
from tiledmlp.distributed.strategies import FSDP2Strategy, NoSyncStrategy, PlainStrategy, Strategy
from unit_helpers import build


def counted_mlp(monkeypatch) -> tuple[nn.Module, nn.Module, torch.Tensor, list[int]]:
    """A tiled Llama, its first MLP, an input for it, and the wrapping reads (``detect_wrapping`` calls) made from
    now on."""
    model = tiledmlp.enable_tiling(build("llama"), loss=False, num_shards=3)
    calls: list[int] = []
    real = selection.detect_wrapping
    monkeypatch.setattr(selection, "detect_wrapping", lambda *a, **k: calls.append(1) or real(*a, **k))
    return model, model.model.layers[0].mlp, torch.randn(1, 9, model.config.hidden_size), calls


def test_the_wrapping_is_read_once_then_again_when_a_parameter_is_replaced(monkeypatch):
    model, mlp, x, calls = counted_mlp(monkeypatch)
    mlp(x)
    mlp(x)
    assert len(calls) == 0  # decided when it was planned (enable_tiling names each module's strategy)
    # a parameter replaced on its module (as fully_shard and parallelize_module do): decided again, once
    mlp.up_proj.weight = nn.Parameter(mlp.up_proj.weight.detach().clone())
    mlp(x)
    mlp(x)
    assert len(calls) == 1
    copy = pickle.loads(pickle.dumps(model))  # a copy decides for itself
    copy.model.layers[0].mlp(x)
    assert len(calls) == 2


def test_ddp_running_is_part_of_the_decision(monkeypatch):
    """DDP is seen from torch's global flag set while its forward runs: a flag that changes decides again."""
    _, mlp, x, calls = counted_mlp(monkeypatch)
    mlp(x)
    monkeypatch.setattr(nn.parallel.DistributedDataParallel, "_active_ddp_module", mlp)
    mlp(x)
    assert len(calls) == 1


def test_functional_calls_pick_in_the_same_room():
    linear = nn.Linear(4, 4)
    assert isinstance(selection.strategy_of_call(list(linear.parameters()), linear), PlainStrategy)


def test_has_forward_context_says_whether_a_strategy_has_one():
    """A strategy without a forward context reads its call's tensors before its step and has nothing to exit
    (``Strategy.prepare_call``): the flag must say which strategies override ``forward_context``. A layered
    strategy's is its inner one's."""
    for cls in selection.STRATEGIES.values():
        if cls.__init__ is Strategy.__init__:
            assert cls.has_forward_context == (cls.forward_context is not Strategy.forward_context), cls.name
    assert sorted(c.name for c in selection.STRATEGIES.values() if c.has_forward_context) == ["deepspeed", "fsdp2"]
    assert NoSyncStrategy(FSDP2Strategy()).has_forward_context
    assert not NoSyncStrategy(PlainStrategy()).has_forward_context
