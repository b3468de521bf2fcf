"""A tiled module behaves like the untiled one where tiling cannot help or cannot be exact: decode calls the
original forward, hooks on children are never skipped (nor run on the probe's data), and double backward /
torch.func fail with an error that names tiling and the fix."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import tiledmlp
from tiledmlp.core import logs
from tiledmlp.core.compat import enable_checkpointing
from tiledmlp.patching.call_spec import TiledCallSpec
from unit_helpers import llama_mlp


@pytest.fixture
def tiled_calls(monkeypatch):
    """Counts the calls that go through the tiled machinery."""
    calls = []
    real = TiledCallSpec.__call__

    def counting(self, *args, **kwargs):
        calls.append(self.name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TiledCallSpec, "__call__", counting)
    return calls


@pytest.mark.parametrize("form, tokens", [("auto", 1), ("auto", 1024), ("generic", 1), ("generic", 32)])
def test_decode_calls_the_original_forward(tiled_calls, form, tokens):
    ref = llama_mlp()
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), form=form)
    x = torch.randn(1, tokens, 32)
    with torch.no_grad():
        assert torch.equal(tiled(x), ref(x))
    assert tiled_calls == []  # one shard: the untiled computation itself
    with torch.no_grad():
        tiled(torch.randn(1, 2048 if form == "auto" else 64, 32))  # more than one shard: tiled
    tiled(x.requires_grad_())  # training: tiled whatever the length
    assert len(tiled_calls) == 2


def test_a_fixed_cut_of_one_token_tiles_even_decode(tiled_calls):
    tiled = tiledmlp.enable_tiling(llama_mlp(), tile_tokens=1)
    with torch.no_grad():
        tiled(torch.randn(1, 1, 32))
        tiled(torch.randn(1, 2, 32))
    assert len(tiled_calls) == 1  # 1 token is one shard of 1; 2 tokens are two


def _doubling(module, args, output):
    return output * 2


def test_hooks_on_children_take_the_generic_form_and_never_see_the_probe():
    seen = []
    ref = llama_mlp()
    ref.gate_proj.register_forward_hook(_doubling)
    ref.up_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), tile_tokens=4)
    assert seen == []  # recognition ran the forward on probe tokens with the hooks suspended
    info = tiledmlp.describe(tiled)[""]
    assert info.form == "generic" and "hooks are registered on gate_proj, up_proj" in info.reason
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(tiled(x), ref(x), rtol=1e-6, atol=1e-6)  # the doubling hook ran
    assert len(seen) == 1 + 5  # untiled once, tiled once per shard (18 tokens / 4)


def test_hooks_added_after_enable_switch_calls_to_the_generic_form(caplog):
    logs._SAID.clear()
    ref = llama_mlp()
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), tile_tokens=4)
    assert tiledmlp.describe(tiled)[""].form == "glu"
    handle = tiled.down_proj.register_forward_hook(_doubling)
    ref.down_proj.register_forward_hook(_doubling)
    x = torch.randn(2, 9, 32, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        out = tiled(x)
    torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-6)
    assert any("hooks are registered on down_proj" in r.getMessage() for r in caplog.records)
    handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), ref(x) / 2, rtol=1e-6, atol=1e-6)  # its own output again


def test_double_backward_names_tiling_and_the_fix():
    tiled = tiledmlp.enable_tiling(llama_mlp(), tile_tokens=4)
    x = torch.randn(2, 9, 32, requires_grad=True)
    (g,) = torch.autograd.grad(tiled(x).square().sum(), x, create_graph=True)  # the first backward works
    with pytest.raises(RuntimeError, match="differentiated twice.*tiledmlp.disable_tiling"):
        g.sum().backward()


def test_torch_func_names_tiling_and_the_fix():
    tiled = tiledmlp.enable_tiling(llama_mlp(), tile_tokens=4)
    x = torch.randn(2, 9, 32)
    with pytest.raises(RuntimeError, match="torch.func transforms.*tiledmlp.disable_tiling"):
        torch.func.grad(lambda t: tiled(t).sum())(x)
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.vmap(tiled)(x.unsqueeze(0).expand(3, -1, -1, -1).reshape(3, 2 * 9, 32))


@pytest.mark.parametrize("per_layer, checkpointing", [(False, False), (False, True), (True, True)])
def test_compiled_model_trains_exactly_like_eager(per_layer, checkpointing):
    """torch.compile (aot_eager here) of a tiled model, whole or per decoder layer (torchtitan's way), with
    and without non-reentrant checkpointing: the same loss and gradients as the eager tiled model. Each
    tiled call is one graph break (``torch.compiler.disable``): Dynamo never traces into the shards."""
    from unit_helpers import batch, build

    ref = build("llama")
    if checkpointing:
        enable_checkpointing(ref)
        ref.train()
    eager = tiledmlp.enable_tiling(ref, num_shards=3, loss=True, loss_scratch_mib=0.01)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    if per_layer:
        for layer in compiled.model.layers:
            layer.compile(backend="aot_eager")
        run = compiled
    else:
        run = torch.compile(compiled, backend="aot_eager")
    ids = batch()
    for model in (eager, run):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)
