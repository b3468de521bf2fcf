"""enable_tiling / disable_tiling / tiled_modules: recognition, idempotence, exact undo, errors."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import tiledmlp
import tiledmlp.patching.planning as planning
from tiledmlp.patching.state import STATE_ATTR
from unit_helpers import assert_close_rel, check_against_untiled, llama_mlp


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, head_dim=8)
    return LlamaForCausalLM(cfg)


def test_returns_same_object_and_names_every_mlp():
    model = tiny_llama()
    assert tiledmlp.enable_tiling(model) is model
    assert tiledmlp.tiled_modules(model) == {**{f"model.layers.{i}.mlp": "plain" for i in range(3)}, "lm_head": "plain"}


def test_root_module_is_tiled_too():
    """The module given, tiled itself: named, and computing what it computed (several shards)."""
    mlp, ref = llama_mlp(), llama_mlp()
    tiledmlp.enable_tiling(mlp, num_shards=3)
    assert tiledmlp.tiled_modules(mlp) == {"": "plain"}
    check_against_untiled(mlp, ref, torch.randn(2, 23, 32))


def test_patches_instances_never_the_class():
    model = tiny_llama()
    cls_forward = type(model.model.layers[0].mlp).forward
    tiledmlp.enable_tiling(model)
    assert type(model.model.layers[0].mlp).forward is cls_forward
    assert "forward" in model.model.layers[0].mlp.__dict__
    other = llama_mlp()
    assert "forward" not in other.__dict__


def test_disable_restores_original_forwards_bit_for_bit():
    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 33))
    before = model(input_ids=ids).logits
    tiledmlp.enable_tiling(model, num_shards=4)
    tiled = model(input_ids=ids).logits
    tiledmlp.disable_tiling(model)
    assert all("forward" not in m.__dict__ and STATE_ATTR not in m.__dict__ for m in model.modules())
    assert torch.equal(model(input_ids=ids).logits, before)
    assert_close_rel(tiled, before, 1e-5, "tiled logits")


def test_enable_twice_reconfigures_without_double_wrapping():
    mlp = llama_mlp()
    tiledmlp.enable_tiling(mlp, num_shards=2)
    tiledmlp.enable_tiling(mlp, num_shards=5)
    state = mlp.__dict__[STATE_ATTR]
    assert state.saved_forward is None  # the class forward, not our first patch
    assert state.spec.policy.num_shards == 5
    tiledmlp.disable_tiling(mlp)
    assert "forward" not in mlp.__dict__


def test_an_existing_instance_forward_is_kept_and_restored():
    """Libraries such as accelerate install their own instance forward; tiling wraps and restores it."""
    mlp = llama_mlp()
    calls = []
    original = mlp.forward

    def hooked(x):
        calls.append(x.shape)
        return original(x)

    mlp.forward = hooked
    tiledmlp.enable_tiling(mlp, num_shards=3, form="generic")
    mlp(torch.randn(1, 9, 32))
    assert calls == [(1, 3, 32)] * 3  # the hooked forward computes each shard
    tiledmlp.disable_tiling(mlp)
    assert mlp.forward is hooked


def test_failed_call_leaves_the_model_untouched(monkeypatch):
    model = tiny_llama()
    real = planning.recognize
    seen = []

    def fail_on_second_mlp(module, *a, **k):
        rec = real(module, *a, **k)
        if rec is not None:
            seen.append(module)
            if len(seen) == 2:
                raise ValueError("boom")
        return rec

    monkeypatch.setattr(planning, "recognize", fail_on_second_mlp)
    with pytest.raises(ValueError, match="boom"):
        tiledmlp.enable_tiling(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_deepcopy_and_pickle_keep_tiling():
    model = tiledmlp.enable_tiling(tiny_llama(), num_shards=3)
    ids = torch.randint(0, 64, (1, 17))
    want = model(input_ids=ids).logits
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert tiledmlp.tiled_modules(clone) == tiledmlp.tiled_modules(model)
        assert torch.equal(clone(input_ids=ids).logits, want)


def test_state_dict_is_unchanged():
    """Tiling adds, renames and changes no entry: the same keys, each the same tensor with the same values; and a
    tiled model's state dict loads into an untiled one, which then computes the same logits."""
    model = tiny_llama()
    before = {k: (v, v.clone()) for k, v in model.state_dict().items()}
    tiledmlp.enable_tiling(model, num_shards=3)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k] is v or (after[k].data_ptr() == v.data_ptr() and torch.equal(after[k], old))
               for k, (v, old) in before.items())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # loaded below: the untiled model must compute with these
    untiled = tiny_llama(seed=1)
    untiled.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 17))
    assert_close_rel(model(input_ids=ids).logits, untiled(input_ids=ids).logits, 1e-6, "logits")


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"strategy": "zero3"}, ValueError, "unknown strategy 'zero3'"),
    ({"num_shards": 0}, ValueError, "num_shards must be >= 1"),
    ({"num_shards": "4"}, TypeError, "num_shards must be an int"),
    ({"form": "fast"}, ValueError, "unknown form"),
    ({"tile_tokens": 64, "num_shards": 2}, ValueError, "not both"),
    ({"shards": 2}, TypeError, "unknown options"),
    ({"grad_accum_dtype": torch.int32}, TypeError, "grad_accum_dtype"),
    ({"mlp_types": (int,)}, TypeError, "mlp_types"),
    ({"strategy": "fsdp2"}, ValueError, "use strategy='plain'"),
    ({"strategy": "ddp"}, ValueError, "use strategy='plain'"),
    ({"strategy": "fsdp1"}, ValueError, "use strategy='plain'"),
    ({"strategy": "no_sync"}, ValueError, "needs a wrapper that synchronizes"),
])
def test_bad_arguments_raise_and_leave_model_untouched(kwargs, exc, match):
    model = tiny_llama()
    with pytest.raises(exc, match=match):
        tiledmlp.enable_tiling(model, **kwargs)
    assert tiledmlp.tiled_modules(model) == {}


def test_forced_plain_on_bare_model():
    model = tiledmlp.enable_tiling(tiny_llama(), strategy="plain")
    assert set(tiledmlp.tiled_modules(model).values()) == {"plain"}


def test_no_recognizable_mlp_says_what_is_recognized():
    with pytest.raises(ValueError) as err:
        tiledmlp.enable_tiling(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    msg = str(err.value)
    for needle in ("by what they compute", "Linear-like", "Conv1D", "LoRA", "experts", "register_mlp", "mlp_types", "apply_tiled_mlp"):
        assert needle in msg
    with pytest.raises(TypeError, match="nn.Module"):
        tiledmlp.enable_tiling("model")
    with pytest.raises(TypeError, match="nn.Module subclass"):
        tiledmlp.register_mlp(int)


def test_extra_tensor_arguments_are_refused():
    class MaskedMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, scale=None):
            return self.fc(x) if scale is None else self.fc(x) * scale

    mlp = tiledmlp.enable_tiling(MaskedMLP(), mlp_types=(MaskedMLP,), num_shards=2)
    x = torch.randn(1, 6, 8)
    # non-tensor extras pass through, to the module's own forward (which takes them: the output is scaled)
    assert_close_rel(mlp(x, scale=2.0), 2.0 * mlp.fc(x), 1e-6, "scaled output")
    with pytest.raises(ValueError, match="extra tensor arguments"):
        mlp(torch.randn(1, 6, 8), scale=torch.ones(1, 6, 1))


def test_input_by_keyword_and_empty_input():
    mlp = tiledmlp.enable_tiling(llama_mlp(), num_shards=3)
    ref = llama_mlp()
    x = torch.randn(1, 10, 32)
    assert_close_rel(mlp(x=x), ref(x), 1e-6, "keyword input")
    assert mlp(torch.randn(1, 0, 32)).shape == (1, 0, 32)


@pytest.mark.parametrize("form", ["auto", "generic"])
def test_copies_of_a_tiled_mlp_can_be_disabled_and_reconfigured(form):
    """The 'no instance forward before tiling' mark survives deepcopy and pickle (it is None, not a
    sentinel object that a copy would duplicate)."""
    mlp = tiledmlp.enable_tiling(llama_mlp(), num_shards=2, form=form)
    x = torch.randn(2, 9, 32)
    want = mlp(x)
    for clone in (copy.deepcopy(mlp), pickle.loads(pickle.dumps(mlp))):
        assert_close_rel(clone(x), want, 1e-6, "copy")
        tiledmlp.enable_tiling(clone, num_shards=3, form=form)
        assert_close_rel(clone(x), want, 1e-6, "reconfigured copy")
        tiledmlp.disable_tiling(clone)
        assert "forward" not in clone.__dict__
        assert_close_rel(clone(x), want, 1e-6, "untiled copy")
