"""``build_optimizer`` / ``make_optimizer``: each name and placement builds the optimizer it says, and a host-placed
optimizer's hooks (torchao's ``CPUOffloadOptimizer`` registers them on the parameters) go with it."""

from __future__ import annotations

import gc
import sys
import types
import weakref

import pytest
import torch
from torch import nn

from tiledmlp.optimizers import build_optimizer
from tiledmlp.optimizers.in_backward import is_stepped_in_backward


class HostStandIn(torch.optim.Optimizer):
    """What torchao's CPUOffloadOptimizer does to the parameters (it runs on CUDA only): a post-accumulate-grad hook
    on each, holding the optimizer, that takes the gradient away (copied to the host, freed on the device)."""

    def __init__(self, params, optimizer_class, *, offload_gradients: bool, **kwargs) -> None:
        self.params, self.taken = list(params), 0
        assert offload_gradients and optimizer_class is torch.optim.AdamW and kwargs.pop("fused")

        def take(p: torch.Tensor) -> None:
            self.taken += 1
            p.grad = None

        for p in self.params:
            p.register_post_accumulate_grad_hook(take)


def test_a_host_optimizers_hooks_go_with_it(monkeypatch):
    """Before, the parameters kept torchao's optimizer and its hooks alive: every later optimizer of the model (a
    benchmark's next row, a resumed run's new one) found no gradient."""
    torchao = types.ModuleType("torchao")
    torchao.optim = types.SimpleNamespace(CPUOffloadOptimizer=HostStandIn)
    monkeypatch.setitem(sys.modules, "torchao", torchao)
    monkeypatch.setitem(sys.modules, "torchao.optim", torchao.optim)
    lin = nn.Linear(8, 8)
    host = build_optimizer(lin, "adamw", "host", lr=1e-3)
    lin(torch.randn(2, 8)).sum().backward()
    assert host.taken == 2 and lin.weight.grad is None  # alive: its hooks act
    gone = weakref.ref(host)
    del host
    gc.collect()
    assert gone() is None
    lin(torch.randn(2, 8)).sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None  # dropped: nothing takes the gradients


@pytest.mark.parametrize("name, placement, flags", [
    ("adamw", "gpu", {"fused": True}), ("adamw_torch_fused", "gpu", {"fused": True}),
    ("adamw-foreach", "gpu", {"foreach": True}), ("adamw_torch", "backward", {"foreach": True}),
])
def test_torch_adamw_by_name(name, placement, flags):
    optimizer = build_optimizer(nn.Linear(4, 4), name, placement, lr=1e-3, weight_decay=0.1)
    assert type(optimizer) is torch.optim.AdamW and all(optimizer.param_groups[0][k] == v for k, v in flags.items())
    assert optimizer.param_groups[0]["weight_decay"] == 0.1 and is_stepped_in_backward(optimizer) == (
        placement == "backward")


def test_8bit_adamw_by_name():
    bnb = pytest.importorskip("bitsandbytes")
    assert type(build_optimizer(nn.Linear(64, 64), "adamw8bit", "gpu")) is bnb.optim.AdamW8bit
    assert type(build_optimizer(nn.Linear(64, 64), "paged_adamw_8bit", "gpu")) is bnb.optim.PagedAdamW8bit
    with pytest.raises(ValueError, match="placement 'host' runs torch's AdamW"):
        build_optimizer(nn.Linear(64, 64), "adamw8bit", "host")


def test_refusals():
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(nn.Linear(2, 2).requires_grad_(False))
    with pytest.raises(ValueError, match="tiledmlp plans"):
        build_optimizer(nn.Linear(2, 2), "sgd")
