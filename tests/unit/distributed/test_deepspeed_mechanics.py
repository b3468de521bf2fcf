"""The DeepSpeed strategy's single-process mechanics that need no engine (the engine cases are the ``zero*`` rows of
``tests/distributed/matrix.py``): reading parameters without ZeRO-3's gathering getter, telling ZeRO-3's hooks from a
user's, and refusing AutoTP projections before anything is patched."""

from __future__ import annotations

import types
from collections import OrderedDict

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp.distributed.deepspeed import is_zero_hook
from tiledmlp.forms.base import Slot
from tiledmlp.distributed.hooks import hooked_children, silenced_hooks

from unit_helpers import llama_mlp


class GatheringDict(OrderedDict):
    """Like ZeRO-3's ``ZeROOrderedDict``: item access has a side effect (there: an all-gather)."""

    def __getitem__(self, key):
        raise AssertionError("item access would all-gather")


def test_slot_reads_without_the_parameter_mapping_getter():
    lin = nn.Linear(4, 4)
    weight = lin.weight
    lin._parameters = GatheringDict(lin._parameters)
    assert Slot(lin, "weight").get() is weight


def _zero_hook():
    def hook(module, args):  # stands for ZeRO-3's fetch hook (a closure of that module)
        return None

    hook.__module__ = "deepspeed.runtime.zero.parameter_offload"
    return hook


def test_zero_hooks_are_hidden_and_restored_user_hooks_kept():
    mlp = llama_mlp()
    calls = []
    mlp.gate_proj.register_forward_pre_hook(_zero_hook())
    assert hooked_children(mlp) == [], "ZeRO-3's hooks are the strategy's job, not a reason for the generic form"
    mlp.up_proj.register_forward_pre_hook(lambda m, a: calls.append("user"))
    assert hooked_children(mlp) == ["up_proj"]
    with silenced_hooks(mlp, is_zero_hook):
        assert len(mlp.gate_proj._forward_pre_hooks) == 0
        mlp(torch.randn(2, 32))
    assert calls == ["user"] and len(mlp.gate_proj._forward_pre_hooks) == 1


def test_autotp_projections_refused_before_patching(monkeypatch):
    class LinearAllreduce(nn.Linear):  # DeepSpeed AutoTP's row-parallel linear
        pass

    monkeypatch.setitem(__import__("sys").modules, "deepspeed.module_inject.layers",
                        types.SimpleNamespace(LinearAllreduce=LinearAllreduce))
    model = nn.Sequential(llama_mlp())
    model[0].down_proj = LinearAllreduce(88, 32, bias=False)
    for p in model.parameters():
        p._hp_mapping = None  # what ZeRO-1/2's optimizer leaves on every trainable parameter
    with pytest.raises(ValueError, match="AutoTP"):
        tiledmlp.enable_tiling(model)
    assert tiledmlp.tiled_modules(model) == {} and "forward" not in model[0].__dict__


def test_loss_without_deepspeed_installed(monkeypatch):
    """Plain tensors never reach DeepSpeed: the functional loss works where DeepSpeed cannot be imported."""
    monkeypatch.setitem(__import__("sys").modules, "deepspeed.runtime.zero.partition_parameters", None)
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 7, 16, requires_grad=True), torch.randn(24, 16, requires_grad=True)
    labels = torch.randint(24, (2, 7))
    got = tiledmlp.tiled_linear_cross_entropy(hidden, weight, labels)
    ref = torch.nn.functional.cross_entropy((hidden @ weight.t()).flatten(0, 1), labels.flatten())
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
