"""peft LoRA-wrapped MLPs in the fast forms (``tiledmlp.forms.lora``), against the untiled peft module.

float32 tight; bf16 (adapters in float32 as peft keeps them, in bf16, and under autocast) within the untiled
error against float64; the state a layer is in checked at every call; the probe checks the adapters' term.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from transformers import GPT2Config, Phi3Config
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

import tiledmlp
import tiledmlp.forms.lora
from tiledmlp.core.accumulate import GradAccumulator
from tiledmlp.forms.lora import is_peft_lora
from tiledmlp.forms.mlp import MLPForm
from mlp_styles import TwoLayer, biased
from unit_helpers import assert_close_rel, check_against_untiled, llama_mlp, rel_err

H, I = 96, 200  # wide enough for several adapter column blocks (ADAPTER_BLOCK is patched to 64)
TOL = 2e-6


@pytest.fixture(autouse=True)
def _narrow_adapter_blocks(monkeypatch):
    monkeypatch.setattr(tiledmlp.forms.lora, "ADAPTER_BLOCK", 64)


def _with_lora(mlp: nn.Module, targets: list[str], frozen_base: bool = True, **config) -> nn.Module:
    """``mlp`` with LoRA adapters on ``targets``, their ``B`` random (peft starts it at zero, which hides the
    adapters' term), the base weights frozen as peft's ``get_peft_model`` leaves them."""
    mlp = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=targets, **config), mlp)
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
            elif frozen_base and "lora_" not in name:
                p.requires_grad_(False)
    return mlp


class Sized(TwoLayer):
    def __init__(self) -> None:
        super().__init__("gelu")
        self.expand, self.contract = nn.Linear(H, I), nn.Linear(I, H)


LORA_STYLES = {
    # name: (factory, form, projections with adapters)
    "glu": (lambda: _with_lora(llama_mlp(H, I), ["gate_proj", "up_proj", "down_proj"]), "glu",
            ["gate_proj", "up_proj", "down_proj"]),
    "glu-down-only": (lambda: _with_lora(llama_mlp(H, I), ["down_proj"]), "glu", ["down_proj"]),
    "glu-full-finetune": (lambda: _with_lora(llama_mlp(H, I, bias=True), ["gate_proj", "up_proj", "down_proj"],
                                             frozen_base=False), "glu", ["gate_proj", "up_proj", "down_proj"]),
    "phi3-fused": (lambda: _with_lora(Phi3MLP(Phi3Config(hidden_size=H, intermediate_size=I, hidden_act="silu")),
                                      ["gate_up_proj", "down_proj"]), "glu", ["gate_up_proj", "down_proj"]),
    "plain-biased": (lambda: _with_lora(biased(Sized()), ["expand", "contract"], frozen_base=False), "mlp",
                     ["expand", "contract"]),
    "gpt2-conv1d": (lambda: _with_lora(biased(GPT2MLP(I, GPT2Config(n_embd=H, resid_pdrop=0.0))), ["c_fc", "c_proj"],
                                       fan_in_fan_out=True), "mlp", ["c_fc", "c_proj"]),
}


def _grad(y: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1, 1, y.numel()).view_as(y)


@pytest.mark.parametrize("inter_chunks", [1, 2])
@pytest.mark.parametrize("style", list(LORA_STYLES))
def test_lora_mlp_gets_the_fast_form_and_is_exact(style, inter_chunks):
    factory, form, adapted = LORA_STYLES[style]
    torch.manual_seed(0)
    tiled, ref = factory(), None
    ref = copy.deepcopy(tiled)
    tiledmlp.enable_tiling(tiled, num_shards=3, inter_chunks=inter_chunks)
    info = tiledmlp.describe(tiled)[""]
    assert (info.form, info.reason) == (form, "")
    assert info.computes.endswith("with LoRA adapters on " + ", ".join(adapted)), info.computes
    check_against_untiled(tiled, ref, torch.randn(2, 23, H), TOL, grad=_grad)
    trained = {n for n, p in tiled.named_parameters() if p.grad is not None}
    assert trained == {n for n, p in ref.named_parameters() if p.requires_grad}


def _signal(module: nn.Module, x: torch.Tensor, g: torch.Tensor, autocast: bool = False) -> dict:
    xx = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = module(xx)
    y.backward(g.to(y.dtype))
    return {"output": y.detach(), "input grad": xx.grad,
            **{n: p.grad for n, p in module.named_parameters() if p.requires_grad}}


def _cast(module: nn.Module, base: torch.dtype, adapters: torch.dtype) -> nn.Module:
    module = copy.deepcopy(module)
    for name, p in module.named_parameters():
        p.data = p.data.to(adapters if "lora_" in name else base)
    return module


@pytest.mark.parametrize("adapters", ["float32", "bfloat16", "autocast"])
@pytest.mark.parametrize("style", ["glu", "phi3-fused", "plain-biased"])
def test_lora_bf16_within_untiled_error(style, adapters):
    """A bf16 model with float32 adapters (peft's default, ``autocast_adapter_dtype=True``), with bf16 adapters,
    and a float32 model under bf16 autocast: output and every gradient as close to float64 as untiled's."""
    torch.manual_seed(0)
    base = LORA_STYLES[style][0]()
    x = torch.randn(1, 256, H, generator=torch.Generator().manual_seed(7))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(100))
    want = _signal(_cast(base, torch.float64, torch.float64), x.double(), g.double())
    if adapters == "autocast":
        make, xin, autocast = (lambda: _cast(base, torch.float32, torch.float32)), x, True
    else:
        make, xin, autocast = (lambda: _cast(base, torch.bfloat16, getattr(torch, adapters))), x.bfloat16(), False
    untiled = _signal(make(), xin, g, autocast)
    tiled = _signal(tiledmlp.enable_tiling(make(), num_shards=8), xin, g, autocast)
    for key, ref in want.items():
        e_untiled, e_tiled = rel_err(untiled[key], ref), rel_err(tiled[key], ref)
        assert e_untiled > 1e-5, f"{key}: implausible untiled error {e_untiled:.2e}"
        assert e_tiled <= 1.1 * e_untiled, f"{key}: tiled {e_tiled:.3e} vs untiled {e_untiled:.3e}"


@pytest.mark.parametrize("adapters", [torch.float32, torch.bfloat16])
def test_adapter_gradients_are_summed_in_float32_whatever_grad_accum_dtype_says(adapters, monkeypatch):
    """``float32_sums``: the adapters' shard gradients in float32 even when 2-byte sums are asked for (the base
    weights' follow ``grad_accum_dtype``)."""
    accumulators = []
    real = GradAccumulator.__init__
    monkeypatch.setattr(GradAccumulator, "__init__",
                        lambda self, *a, **k: accumulators.append(self) or real(self, *a, **k))
    mlp = _cast(LORA_STYLES["glu-full-finetune"][0](), torch.bfloat16, adapters)
    tiledmlp.enable_tiling(mlp, num_shards=3, grad_accum_dtype=torch.bfloat16)
    mlp(torch.randn(1, 24, H, dtype=torch.bfloat16)).sum().backward()
    (acc,) = accumulators
    rank = 4
    dtypes = {("adapter" if rank in p.shape else "base", acc._dtypes[i])
              for i, p in enumerate(acc._params) if p.dim() == 2}
    assert dtypes == {("adapter", torch.float32), ("base", torch.bfloat16)}


def _layers(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if is_peft_lora(m)]


def _two_adapters() -> nn.Module:
    mlp = _with_lora(llama_mlp(H, I), ["gate_proj", "up_proj", "down_proj"])
    mlp = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=6, target_modules=["gate_proj", "up_proj", "down_proj"]),
                                  mlp, adapter_name="other")
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            if "lora_B.other" in name:
                p.normal_(std=0.3)
    for layer in _layers(mlp):
        layer.set_adapter("default")
    return mlp


CHANGES = {
    # name: (change a LoRA layer, its undo, words of the warning)
    "disabled": (lambda m: m.enable_adapters(False), lambda m: m.enable_adapters(True), "disabled"),
    "merged": (lambda m: m.merge(), lambda m: m.unmerge(), "merged"),
    "switched": (lambda m: m.set_adapter("other"), lambda m: m.set_adapter("default"), "'other'"),
    "rescaled": (lambda m: m.set_scale("default", 5.0), lambda m: m.set_scale("default", 1.0), "scale 10.0"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_layer_changed_after_enable_tiling_takes_the_generic_form(change, caplog, monkeypatch):
    """Merged, disabled, switched or rescaled after recognition: the call is generic (peft's own forward) and
    exact, with a warning; undone, the fast form is back."""
    do, undo, words = CHANGES[change]
    fast_shards = []
    real = MLPForm.forward_shard
    monkeypatch.setattr(MLPForm, "forward_shard", lambda self, *a, **k: fast_shards.append(1) or real(self, *a, **k))
    torch.manual_seed(0)
    tiled = _two_adapters()
    ref = copy.deepcopy(tiled)
    tiledmlp.enable_tiling(tiled, num_shards=3)
    assert tiledmlp.describe(tiled)[""].form == "glu"
    fast_shards.clear()  # the probe's
    x = torch.randn(2, 23, H)
    for module in (tiled, ref):
        for layer in _layers(module):
            do(layer)
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        check_against_untiled(tiled, ref, x, 1e-5, grad=_grad)
    assert "changed since enable_tiling" in caplog.text and words in caplog.text, caplog.text
    assert not fast_shards
    fallback = tiledmlp.describe(tiled)[""].fallback  # describe() says it too, not just the form recognized
    assert "changed since enable_tiling" in fallback and "generic form" in fallback and words in fallback, fallback
    for module in (tiled, ref):
        for layer in _layers(module):
            undo(layer)
        module.zero_grad()
    check_against_untiled(tiled, ref, x, 1e-5, grad=_grad)
    assert len(fast_shards) == 3 and tiledmlp.describe(tiled)[""].fallback == ""


def test_merge_and_unload_gives_the_fast_form_of_the_merged_projections(caplog):
    """peft's merge_and_unload() puts the base layers (adapters merged in) where the LoRA layers were: the next call
    takes the fast form without adapters, named by its path in the unloaded model, with no warning (before: the
    generic form every call, warned under the PEFT model's path, while describe() still said glu)."""
    from peft import get_peft_model

    from unit_helpers import assert_grads_match, batch, build

    torch.manual_seed(0)
    peft_model = get_peft_model(build("llama"), LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
    ref = copy.deepcopy(peft_model)
    tiledmlp.enable_tiling(peft_model, num_shards=3)
    merged, ref = peft_model.merge_and_unload(), ref.merge_and_unload()
    for model in (merged, ref):
        model.requires_grad_(True)
    ids = batch()
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        losses = [model(input_ids=ids, labels=ids).loss for model in (merged, ref)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert ("model.layers.0.mlp (and any module with the same change): its submodules changed since enable_tiling "
            "(gate_proj (Linear), up_proj (Linear), down_proj (Linear) replaced); planned again: the glu form"
            in caplog.text), caplog.text
    for loss in losses:
        loss.backward()
    assert_close_rel(losses[0].detach(), losses[1].detach(), 1e-5, "loss")
    assert_grads_match(merged, ref, 1e-5)
    info = tiledmlp.describe(merged)["model.layers.0.mlp"]
    assert (info.form, info.fallback) == ("glu", "") and "LoRA" not in info.computes


def test_layers_a_fast_form_cannot_compute_stay_generic_with_a_reason():
    """Two active adapters, DoRA, adapter dropout, or adapters merged at enable time: the generic form."""
    cases = {
        "2 adapters are active": _two_adapters(),
        "LoRA variant": _with_lora(llama_mlp(H, I), ["gate_proj", "up_proj", "down_proj"], use_dora=True),
        "lora_dropout=0": _with_lora(llama_mlp(H, I), ["gate_proj", "up_proj", "down_proj"], lora_dropout=0.1),
        "merged": _two_adapters(),
    }
    for layer in _layers(cases["2 adapters are active"]):
        layer.set_adapter(["default", "other"])
    for layer in _layers(cases["merged"]):
        layer.merge()
    for words, mlp in cases.items():
        ref = copy.deepcopy(mlp).eval()
        tiledmlp.enable_tiling(mlp, num_shards=3)
        info = tiledmlp.describe(mlp)[""]
        assert info.form == "generic" and words in info.reason, (words, info.reason)
        check_against_untiled(mlp.eval(), ref, torch.randn(2, 23, H), 1e-5, grad=_grad)


class SkipsGateAdapter(nn.Module):
    """A LoRA GLU whose forward calls the gate projection's base layer, not its adapter."""

    def __init__(self) -> None:
        super().__init__()
        inner = _with_lora(llama_mlp(H, I), ["gate_proj", "up_proj", "down_proj"])
        self.gate_proj, self.up_proj, self.down_proj = inner.gate_proj, inner.up_proj, inner.down_proj

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj.base_layer(x)) * self.up_proj(x))


def test_the_probe_checks_what_the_adapters_compute():
    """A forward that skips one adapter matches no fast form (the probe draws random adapters), even with
    peft's zero-initialized B, which would make any adapter term vanish on the real weights."""
    mlp = SkipsGateAdapter()
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            if "lora_B" in name:
                p.zero_()
    ref = copy.deepcopy(mlp)
    tiledmlp.enable_tiling(mlp, num_shards=3)
    info = tiledmlp.describe(mlp)[""]
    assert info.form == "generic" and "matches no fast form" in info.reason
    with torch.no_grad():
        for m in (mlp, ref):
            m.gate_proj.lora_B["default"].weight.normal_()
    check_against_untiled(mlp, ref, torch.randn(2, 23, H), TOL, grad=_grad)


def test_compiled_lora_mlp_follows_the_layers_state():
    """Compiled with ``fullgraph=True``: the fast form's operator; a disabled adapter recompiles into the generic
    form's operator (the state is guarded), and both equal the untiled module."""
    from test_compile import OP, Counter

    torch._dynamo.reset()
    torch.manual_seed(0)
    tiled = _with_lora(llama_mlp(H, I), ["gate_proj", "up_proj", "down_proj"])
    ref = copy.deepcopy(tiled)
    tiledmlp.enable_tiling(tiled, num_shards=3)
    counter = Counter()
    compiled = torch.compile(tiled, backend=counter, fullgraph=True)
    x = torch.randn(2, 23, H)
    for enabled in (True, False, True):
        for module in (tiled, ref):
            for layer in _layers(module):
                layer.enable_adapters(enabled)
        got, want = compiled(x), ref(x)
        assert_close_rel(got, want, 1e-5, f"adapters enabled={enabled}")
    assert counter.frames == 2 and counter.ops == [1, 1] and OP
    torch._dynamo.reset()
