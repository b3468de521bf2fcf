"""Copies of tiled models — ``copy.deepcopy``, ``pickle`` and ``torch.save``/``torch.load`` round trips —
of every form keep computing the same loss and gradients, and ``disable_tiling``/``enable_tiling`` on a
copy behave as on the original."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import tiledmlp
from unit_helpers import batch, build


def _save_load(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)), "torch.save": _save_load}
TILINGS = {  # name: (family, enable_tiling options, form of every tiled MLP)
    "glu": ("llama", {}, "glu"),
    "generic": ("llama", {"form": "generic"}, "generic"),
    "moe": ("mixtral", {}, "moe"),
    "loss": ("llama", {"loss": True, "loss_scratch_mib": 0.01}, "glu"),
}


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("tiling", list(TILINGS))
def test_copies_compute_the_same_and_reconfigure(tiling, how):
    family, options, form = TILINGS[tiling]
    untiled = build(family)
    model = tiledmlp.enable_tiling(copy.deepcopy(untiled), num_shards=3, **options)
    ids = batch()
    loss, grads = _step(model, ids)
    clone = COPIES[how](model)
    assert tiledmlp.tiled_modules(clone) == tiledmlp.tiled_modules(model)
    assert {i.form for i in tiledmlp.describe(clone).values() if i.form != "loss"} == {form}
    got_loss, got_grads = _step(clone, ids)
    assert torch.equal(got_loss, loss) and all(torch.equal(a, b) for a, b in zip(got_grads, grads))
    tiledmlp.disable_tiling(clone)
    assert tiledmlp.tiled_modules(clone) == {}
    ref_loss, _ = _step(untiled, ids)
    torch.testing.assert_close(_step(clone, ids)[0], ref_loss, rtol=1e-6, atol=1e-6)
    tiledmlp.enable_tiling(clone, num_shards=2, **options)
    torch.testing.assert_close(_step(clone, ids)[0], ref_loss, rtol=1e-6, atol=1e-6)
