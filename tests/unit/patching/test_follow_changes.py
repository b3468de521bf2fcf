"""What a user changes after ``enable_tiling`` is followed, never silently ignored (``patching/state.py``'s design
note): LoRA added after tiling (``get_peft_model``, TRL's ``SFTTrainer(peft_config=...)``), adapters added and
switched, projections replaced, parameters replaced. Each case trains as the untiled model does, over three steps:
losses, every trainable gradient (the new parameters' included) and the parameters after; or, where the module can
no longer be tiled, runs it untiled and says so."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import tiledmlp
from tiledmlp.core import logs
from unit_helpers import batch, build, train_side_by_side

MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]
ALL_TARGETS = [*MLP_TARGETS, "q_proj", "v_proj"]


def _lora(model: nn.Module, targets: list[str], name: str = "default") -> nn.Module:
    """peft LoRA on ``targets``, with random B (peft's zero B would hide a missed adapter)."""
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    if hasattr(model, "peft_config"):
        model.add_adapter(name, config)
        return model
    return get_peft_model(model, config, adapter_name=name)


@pytest.fixture(autouse=True)
def _say_again():
    """Each test sees the lines said once per process."""
    logs._SAID.clear()


def _forms(model: nn.Module) -> set[str]:
    return {i.form for i in tiledmlp.describe(model).values() if i.form != "loss"}


@pytest.mark.parametrize("targets", [MLP_TARGETS, ALL_TARGETS], ids=["mlp", "mlp+attention"])
def test_lora_added_after_tiling_trains_as_untiled(targets, caplog):
    """Before: the MLPs computed their base weights only — the loss off (6.919215 vs 6.921282), and backward raised
    ("element 0 of tensors does not require grad") or left every MLP adapter's gradient None."""
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3)
    tiled, ref = _lora(tiled, targets), _lora(ref, targets)
    info = tiledmlp.describe(tiled)["base_model.model.model.layers.0.mlp"]
    assert "changed since enable_tiling (gate_proj (Linear), up_proj (Linear), down_proj (Linear) replaced)" in \
        info.fallback and "planned again at its next call" in info.fallback, info.fallback
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        train_side_by_side(tiled, ref)
    assert "planned again: the glu form" in caplog.text, caplog.text
    info = tiledmlp.describe(tiled)["base_model.model.model.layers.0.mlp"]
    assert (info.form, info.fallback) == ("glu", "") and "with LoRA adapters on gate_proj, up_proj, down_proj" in \
        info.computes, info


@pytest.mark.parametrize("targets, save", [(["lm_head"], []), ([*ALL_TARGETS, "lm_head"], []), (ALL_TARGETS, ["lm_head"])],
                         ids=["head", "head+mlp+attention", "mlp+attention+saved_head"])
def test_lora_on_the_head_added_after_tiling_trains_untiled_as_said(targets, save, caplog):
    """LoRA (or ``modules_to_save``) on the tiled head: the loss falls back untiled, as the warning says, and the model
    trains as untiled, adapters beside it included. Before: the warning, then the forward raised ("the model applies
    aten.add.Tensor to its logits ... Enable tiling with loss=False"): the old head, called as the LoRA layer's base,
    still returned a placeholder."""
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3)
    config = dict(r=4, lora_alpha=8, target_modules=targets, modules_to_save=save)
    tiled, ref = (torch.manual_seed(3) and get_peft_model(model, LoraConfig(**config)) for model in (tiled, ref))
    for model in (tiled, ref):  # random B, small enough that three steps of lr 0.5 do not amplify rounding
        torch.manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(p, std=0.02)
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        train_side_by_side(tiled, ref)
    said = [r.getMessage() for r in caplog.records if "its output layer was replaced" in r.getMessage()]
    assert len(said) == 1 and "computed untiled (full logits) from now on" in said[0], said
    heads = [(name, i.fallback) for name, i in tiledmlp.describe(tiled).items() if i.form == "loss"]
    assert len(heads) == 1 and "that the tiled loss cannot compute: full logits, untiled loss" in heads[0][1], heads
    if len(targets) > 1:  # the MLPs' adapters take the fast LoRA form
        assert "with LoRA adapters on" in tiledmlp.describe(tiled)["base_model.model.model.layers.0.mlp"].computes


def test_adapter_added_and_switched_after_tiling_trains_as_untiled():
    """A model tiled with one adapter, then ``add_adapter`` + ``set_adapter``: the new adapter's MLP gradients
    (before: None) and its loss."""
    ref = _lora(build("llama"), MLP_TARGETS)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3)
    for model in (tiled, ref):
        _lora(model, ALL_TARGETS, name="second").set_adapter("second")
    train_side_by_side(tiled, ref)
    info = tiledmlp.describe(tiled)["base_model.model.model.layers.0.mlp"]
    assert (info.form, info.fallback) == ("glu", ""), info  # the fast form of the new adapter, not a fallback


def test_generic_form_follows_new_adapters():
    """A module on the generic form (adapter dropout) hands gradients to the parameters it was planned with: an
    adapter added since is planned again, so its parameters get theirs."""
    torch.manual_seed(3)
    ref = get_peft_model(build("llama"), LoraConfig(r=4, target_modules=MLP_TARGETS, lora_dropout=0.0,
                                                    init_lora_weights=False))
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3, form="generic")
    for model in (tiled, ref):
        _lora(model, MLP_TARGETS, name="second").set_adapter("second")
    train_side_by_side(tiled, ref)
    assert _forms(tiled) == {"generic"}


def test_projection_replaced_after_tiling_gets_its_gradient():
    """``mlp.down_proj = nn.Linear(...)``: before, the old weight was used and the new one got no gradient while
    describe() still said the old form."""
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3)
    torch.manual_seed(5)
    new = nn.Linear(72, 32, bias=True)
    for model in (tiled, ref):
        model.model.layers[1].mlp.down_proj = copy.deepcopy(new)
    train_side_by_side(tiled, ref)
    info = tiledmlp.describe(tiled)["model.layers.1.mlp"]
    assert info.form == "glu" and info.fallback == "" and "down_proj" in info.computes


class _Scaled(nn.Module):
    """A projection computed by a child that is not Linear-like: the module still maps each token on its own."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.inner = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 0.5


class _Mixing(_Scaled):
    """A projection that mixes tokens (a running sum): the module can no longer be tiled."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).cumsum(dim=-2) * 0.1


def _up_proj_replaced(kind: type, caplog) -> nn.Module:
    """A tiled Llama and its untiled twin, the first layer's ``up_proj`` replaced by ``kind`` in both, trained side by
    side (warnings captured); the tiled one."""
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3)
    for model in (tiled, ref):
        torch.manual_seed(5)
        model.model.layers[0].mlp.up_proj = kind(nn.Linear(32, 72, bias=False))
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        train_side_by_side(tiled, ref)
    return tiled


def test_projection_replaced_by_another_module_takes_the_generic_form(caplog):
    tiled = _up_proj_replaced(_Scaled, caplog)
    assert "model.layers.0.mlp (and any module with the same change): its submodules changed since enable_tiling " \
        "(up_proj (_Scaled) replaced); planned again, it takes the generic form: it has parameters or buffers " \
        "outside its projections" in caplog.text, caplog.text
    assert tiledmlp.describe(tiled)["model.layers.0.mlp"].form == "generic"


def test_module_no_longer_recognized_runs_untiled_and_says_so(caplog):
    tiled = _up_proj_replaced(_Mixing, caplog)
    assert "model.layers.0.mlp (and any module with the same change): its submodules changed since enable_tiling " \
        "(up_proj (_Mixing) replaced) and it is no longer recognized" in caplog.text, caplog.text
    assert caplog.text.count("no longer recognized") == 1, caplog.text
    assert "runs its own forward, untiled" in tiledmlp.describe(tiled)["model.layers.0.mlp"].fallback


def _assign(model: nn.Module, state: dict) -> None:
    model.load_state_dict(state, assign=True)


def _to_empty(model: nn.Module, state: dict) -> None:
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # the rotary inverse frequencies: not saved
    model.to_empty(device="cpu")
    model.load_state_dict(state)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])


def _swap_parameters(model: nn.Module, state: dict) -> None:
    """What an optimizer wrapper that keeps its own Parameter objects does."""
    for name, module in model.named_modules():
        for pname, p in [(n, p) for n, p in module._parameters.items() if p is not None]:
            key = f"{name}.{pname}" if name else pname
            module._parameters[pname] = nn.Parameter(state[key].clone(), requires_grad=p.requires_grad)


@pytest.mark.parametrize("replace", [_assign, _to_empty, _swap_parameters], ids=["assign", "to_empty", "swapped"])
def test_parameters_replaced_after_tiling_train_as_untiled(replace):
    """Every call reads the parameters through their slots (the module and name), so new Parameter objects are the
    ones computed with and given gradients."""
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3)
    torch.manual_seed(7)
    state = {k: torch.randn_like(v) * 0.1 for k, v in ref.state_dict().items()}
    for model in (tiled, ref):
        replace(model, state)
    assert torch.equal(tiled.model.layers[0].mlp.gate_proj.weight, state["model.layers.0.mlp.gate_proj.weight"])
    train_side_by_side(tiled, ref)


def test_compiled_layers_follow_lora_added_after_tiling():
    """Layers compiled (and run) before peft wraps their projections: the changed module's first call plans it again
    eagerly, the next ones are traced with the new plan."""
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3)
    torch._dynamo.reset()
    for layer in tiled.model.layers:
        layer.compile(backend="aot_eager")
    ids = batch()
    tiled(input_ids=ids, labels=ids).loss.backward()
    tiled.zero_grad(set_to_none=True)
    try:
        train_side_by_side(_lora(tiled, ALL_TARGETS), _lora(ref, ALL_TARGETS))
    finally:
        torch._dynamo.reset()


def test_unchanged_module_is_not_planned_again(monkeypatch):
    """The check is an identity walk: a module whose submodules did not change never runs the probe again."""
    from tiledmlp.patching import forwards

    model = tiledmlp.enable_tiling(build("llama"), num_shards=3)
    monkeypatch.setattr(forwards, "replan", lambda *a: pytest.fail("planned again without a change"))
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()


def test_lora_projections_added_after_tiling_are_tiled(caplog):
    """``projections=True``, then peft on q/v as well: the new LoRA projections have no tiled module above them; the
    model's next training call finds them (the model's forward pre-hook) and tiles them in the fast proj form."""
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3, projections=True)
    tiled, ref = _lora(tiled, ALL_TARGETS), _lora(ref, ALL_TARGETS)
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        train_side_by_side(tiled, ref)
    assert "4 module(s) added since enable_tiling are tiled now (proj:" in caplog.text, caplog.text
    forms = {name.rsplit(".", 1)[-1]: i.form for name, i in tiledmlp.describe(tiled).items()}
    assert forms["q_proj"] == forms["v_proj"] == "proj" and forms["mlp"] == "glu", forms


def test_replaced_mlp_and_norm_are_tiled():
    """A whole MLP and a normalization layer (norms=True) replaced by new modules: tiled at the next training call,
    trained as untiled; inference calls do not look."""
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3, norms=True)
    torch.manual_seed(5)
    mlp = copy.deepcopy(ref.model.layers[0].mlp)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.05)
    norm = copy.deepcopy(ref.model.layers[1].input_layernorm)
    torch.nn.init.normal_(norm.weight)
    for model in (tiled, ref):
        model.model.layers[0].mlp = copy.deepcopy(mlp)
        model.model.layers[1].input_layernorm = copy.deepcopy(norm)
    with torch.no_grad():
        tiled(input_ids=batch())
    assert "model.layers.0.mlp" not in tiledmlp.tiled_modules(tiled)
    train_side_by_side(tiled, ref)
    names = tiledmlp.tiled_modules(tiled)
    assert "model.layers.0.mlp" in names and "model.layers.1.input_layernorm" in names, names


def test_disable_tiling_removes_the_follower():
    model = tiledmlp.enable_tiling(build("llama"))
    tiledmlp.disable_tiling(model)
    assert not model._forward_pre_hooks
    model.model.layers[0].mlp = copy.deepcopy(model.model.layers[1].mlp)
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()
    assert tiledmlp.tiled_modules(model) == {}
