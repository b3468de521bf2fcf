"""The optimizer step fused into backward (``tiledmlp.optimizers.in_backward``) against the same optimizer stepping
after backward: bit for bit on the same model, within float32 rounding on a tiled model against the untiled one; the
gradients freed as they complete; what cannot be exact refused."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp.optimizers import GradientAccumulationError, step_in_backward
from tiledmlp.optimizers.in_backward import is_stepped_in_backward

from unit_helpers import batch, checkpointed_llama, rel_err

IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def groups(model: nn.Module) -> list[dict]:
    """Two groups, as the Trainer builds them: weight decay on matrices, none on vectors."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


def adamw(model: nn.Module, **flags) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(groups(model), lr=3e-3, **flags)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, steps: int = 3) -> list[torch.Tensor]:
    losses = []
    for step in range(steps):
        ids = batch(vocab=128, t=33 + step, seed=step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_bit_identical_to_stepping_after_backward(implementation, tied):
    """Each parameter stepped once per backward with its whole gradient (a tied weight's two uses summed first),
    with its group's hyperparameters and the scheduler's learning rate of the moment."""
    after = checkpointed_llama(layers=2)
    if tied:
        after.lm_head.weight = after.model.embed_tokens.weight
    inside = copy.deepcopy(after)
    optimizer, scheduler = adamw(after, **IMPLEMENTATIONS[implementation])
    losses = train(after, optimizer, scheduler)
    optimizer, scheduler = adamw(inside, **IMPLEMENTATIONS[implementation])
    step_in_backward(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(losses, train(inside, optimizer, scheduler), strict=True))
    assert all(torch.equal(p, q) for p, q in zip(after.parameters(), inside.parameters(), strict=True))
    assert rel_err(next(inside.parameters()), next(checkpointed_llama(layers=2).parameters())) > 0  # it trained


def _bitsandbytes_steps_on_cpu(bnb) -> bool:
    """bitsandbytes' 8-bit optimizers step CPU tensors from 0.48 on (0.47, the lowest claimed, refuses them)."""
    weight = nn.Parameter(torch.ones(64, 128))
    weight.grad = torch.ones_like(weight)
    try:
        bnb.optim.AdamW8bit([weight]).step()
    except RuntimeError as why:
        if "GPU" in str(why):
            return False
        raise
    return True


def test_bitsandbytes_8bit_adamw_in_backward_is_bit_identical():
    bnb = pytest.importorskip("bitsandbytes")
    if not _bitsandbytes_steps_on_cpu(bnb):
        pytest.skip(f"bitsandbytes {bnb.__version__} has no CPU 8-bit optimizer (test_cuda runs it on a GPU)")
    after = checkpointed_llama(layers=2)
    inside = copy.deepcopy(after)
    runs = []
    for model, fuse in ((after, False), (inside, True)):
        optimizer = bnb.optim.AdamW8bit(groups(model), lr=3e-3)
        if fuse:
            step_in_backward(optimizer)
        runs.append(train(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(after.parameters(), inside.parameters(), strict=True))


def test_tiled_model_stepping_in_backward_trains_like_the_untiled_stepping_after():
    """The tiled loss, MLPs, norms, attention and offload='cpu' hand each parameter its gradient once: stepped there
    and then, the training is the untiled one's."""
    untiled = checkpointed_llama(layers=3)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(untiled), norms=True, attention=True, offload="cpu", tile_tokens=8)
    optimizer = torch.optim.AdamW(untiled.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    reference = train(untiled, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1)))
    optimizer = tiledmlp.make_optimizer(tiled, "adamw", "backward", lr=3e-3, weight_decay=0.1)
    assert is_stepped_in_backward(optimizer) and optimizer.param_groups[0]["fused"]
    losses = train(tiled, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1)))
    for got, want in zip(losses, reference, strict=True):
        assert rel_err(got, want) < 1e-5
    for (name, p), q in zip(tiled.named_parameters(), untiled.parameters(), strict=True):
        assert rel_err(p, q) < 1e-4, name


def test_gradients_are_freed_as_they_complete():
    """When a parameter's gradient is complete, every other parameter's is gone (stepped and freed) or not made yet;
    after backward none is left."""
    model = tiledmlp.enable_tiling(checkpointed_llama(layers=2), tile_tokens=8)
    params = [p for p in model.parameters() if p.requires_grad]
    alive = []
    for p in params:  # registered before the optimizer's own hooks: they run first, and see the others
        p.register_post_accumulate_grad_hook(lambda q: alive.append(sum(r.grad is not None for r in params)))
    optimizer = torch.optim.AdamW(params, lr=1e-3)  # held: a dropped optimizer steps nothing
    step_in_backward(optimizer)
    ids = batch(vocab=128)
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(alive) == len(params) and max(alive) == 1, alive
    assert all(p.grad is None for p in params)


def test_state_dict_is_the_optimizers_own():
    """Saved while stepping in backward, loaded into a plain AdamW: both continue the same."""
    model = checkpointed_llama(layers=2)
    optimizer, scheduler = adamw(model, fused=True)
    step_in_backward(optimizer)
    train(model, optimizer, scheduler, steps=2)
    plain = copy.deepcopy(model)
    resumed, resumed_scheduler = adamw(plain, fused=True)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    resumed_scheduler.load_state_dict(scheduler.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(train(model, optimizer, scheduler, steps=2),
                                                  train(plain, resumed, resumed_scheduler, steps=2), strict=True))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters(), strict=True))


def test_gradient_accumulation_is_refused():
    model = checkpointed_llama(layers=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_in_backward(optimizer)
    ids = batch(vocab=128)
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(GradientAccumulationError, match="gradient accumulation over micro-batches"):
        model(input_ids=ids, labels=ids).loss.backward()


def test_a_dropped_optimizer_stops_stepping_and_remove_restores():
    lin = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(lin.parameters(), lr=0.1)
    handle = step_in_backward(optimizer)
    handle.remove()
    lin(torch.randn(2, 8)).sum().backward()
    assert lin.weight.grad is not None and not is_stepped_in_backward(optimizer)  # removed: after backward again
    lin.zero_grad(set_to_none=True)
    step_in_backward(optimizer)
    del optimizer, handle
    gc.collect()
    before = lin.weight.detach().clone()
    lin(torch.randn(2, 8)).sum().backward()
    assert torch.equal(before, lin.weight) and lin.weight.grad is not None


def test_refusals_name_the_fix(monkeypatch):
    lin = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(lin.parameters(), lr=0.1)
    step_in_backward(optimizer)
    with pytest.raises(ValueError, match="already steps in backward"):
        step_in_backward(optimizer)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        step_in_backward(lin)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="1 peer.*DeepSpeed offload_optimizer, FSDP2 CPUOffloadPolicy"):
        step_in_backward(torch.optim.AdamW(nn.Linear(2, 2).parameters()))
