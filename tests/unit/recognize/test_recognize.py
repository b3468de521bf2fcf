"""MLPs recognized by what they compute (``tiledmlp.recognize``), and ``describe``/log lines.

Every style is checked against the untiled module: float32 tight, bf16 within the untiled bf16
error against float64.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from transformers import GPT2Config, PhiConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.phi.modeling_phi import PhiMLP

import tiledmlp
from tiledmlp.core.accumulate import GradAccumulator
from tiledmlp.patching.state import STATE_ATTR
from mlp_styles import H, I, STYLES, InlineGLU, TwoLayer, biased
from unit_helpers import assert_bf16_within_untiled, build, check_against_untiled, llama_mlp, pair

TOL = 2e-6

def check_exact(tiled, ref):
    check_against_untiled(tiled, ref, torch.randn(2, 23, H), TOL,
                          grad=lambda y: torch.linspace(-1, 1, y.numel()).view_as(y))


def state(module):
    return module.__dict__[STATE_ATTR]


#: what each style's fast form computes, in its children's names (``{act}``: the style's activation); a child named
#: like "contract" once had its "act(" taken for the activation's ("contrgelu(gelu(expand(x)))")
COMPUTES = {
    "inline": "down_proj({act}(gate_proj(x)) * up_proj(x))",
    "inline-gelu-bias": "down_proj({act}(gate_proj(x)) * up_proj(x))",
    "act_fn": "down_proj({act}(gate_proj(x)) * up_proj(x))",
    "torchtitan": "w2({act}(w1(x)) * w3(x))",
    "phi3-fused": "down_proj({act}(gate) * up) with [gate; up] = gate_up_proj(x)",
    "plain-gelu": "contract({act}(expand(x)))",
    "plain-gelu-tanh": "contract({act}(expand(x)))",
    "plain-relu": "contract({act}(expand(x)))",
    "plain-relu2": "contract({act}(expand(x)))",
    "gpt2-conv1d": "c_proj({act}(c_fc(x)))",
    "phi2": "fc2({act}(fc1(x)))",
}


@pytest.mark.parametrize("style", list(STYLES))
def test_style_gets_its_fast_form_and_is_exact(style):
    factory, form, activation = STYLES[style]
    torch.manual_seed(0)
    tiled, ref = pair(factory())
    tiledmlp.enable_tiling(tiled, num_shards=3)
    info = tiledmlp.describe(tiled)[""]
    assert (info.form, state(tiled).spec.layout.activation, info.reason) == (form, activation, "")
    assert info.computes == COMPUTES[style].replace("{act}", activation), info.computes
    check_exact(tiled, ref)


@pytest.mark.parametrize("style", ["inline", "torchtitan", "plain-gelu", "gpt2-conv1d"])
def test_style_bf16_within_untiled_error(style):
    torch.manual_seed(0)
    x = torch.randn(1, 256, H, generator=torch.Generator().manual_seed(7))
    assert_bf16_within_untiled(STYLES[style][0](), lambda m: tiledmlp.enable_tiling(m, num_shards=8), x)


def test_conv1d_gradients_in_blocks_of_the_intermediate_dimension():
    """A transposed (Conv1D) weight gets its intermediate blocks as columns of its gradient."""
    torch.manual_seed(0)
    tiled, ref = pair(biased(GPT2MLP(I, GPT2Config(n_embd=H, resid_pdrop=0.0))))
    tiledmlp.enable_tiling(tiled, num_shards=3, inter_chunks=3)
    check_exact(tiled, ref)


@pytest.mark.parametrize("style, option, dtype", [("plain-gelu", None, torch.float32), ("inline", None, None),
                                                  ("plain-gelu", torch.bfloat16, torch.bfloat16)])
def test_plain_form_sums_in_float32_unless_told(monkeypatch, style, option, dtype):
    """A plain MLP's shard gradients point one way (its activations have a nonzero mean): float32 sums
    by default; a GLU keeps the block-scaled default; an explicit grad_accum_dtype wins."""
    seen = []
    real = GradAccumulator.__init__
    monkeypatch.setattr(GradAccumulator, "__init__", lambda self, *a, **k: seen.append(a[3]) or real(self, *a, **k))
    mlp = STYLES[style][0]()
    tiledmlp.enable_tiling(mlp, num_shards=2, grad_accum_dtype=option)
    mlp(torch.randn(1, 8, H)).sum().backward()
    assert seen == [dtype]


def test_plain_form_frozen_parts_get_no_gradient():
    torch.manual_seed(0)
    tiled, ref = pair(biased(TwoLayer("gelu")))
    for m in (tiled, ref):
        m.expand.weight.requires_grad_(False)
        m.contract.bias.requires_grad_(False)
    tiledmlp.enable_tiling(tiled, num_shards=3, inter_chunks=2)
    check_exact(tiled, ref)
    assert tiled.expand.weight.grad is None and tiled.contract.bias.grad is None


class Squared(InlineGLU):
    def forward(self, x):
        return super().forward(x).square()


class Residual(InlineGLU):
    def forward(self, x):
        return x + super().forward(x)


class ThreeInputGate(InlineGLU):
    """A gate of three projections: ``down(act(gate(x)) * up(x) * extra(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.extra_proj = nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x) * self.extra_proj(x))


class TrainingDropout(TwoLayer):
    """Functional dropout: nothing in the module tree shows it, only training mode does."""

    def forward(self, hidden):
        return F.dropout(super().forward(hidden), 0.5, self.training)


def _lora_glu(dropout: float) -> nn.Module:
    config = LoraConfig(r=4, lora_dropout=dropout, target_modules=["gate_proj", "up_proj", "down_proj"])
    mlp = inject_adapter_in_model(config, llama_mlp())
    with torch.no_grad():  # adapters that matter (peft starts lora_B at zero)
        for name, p in mlp.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return mlp


DECOYS = {
    # name: (factory, words of the reason, eval mode for the comparison)
    "squared": (Squared, "matches no fast form", False),
    "residual": (Residual, "matches no fast form", False),
    "three-input-gate": (ThreeInputGate, "matches no fast form", False),
    "layernorm-inside": (lambda: _WithNorm(), "outside its projections (norm.weight, norm.bias)", False),
    # (a LoRA GLU without adapter dropout takes the fast form: tests/unit/forms/test_lora.py)
    "lora-dropout": (lambda: _lora_glu(0.1), "set lora_dropout=0 for the fast form", True),
    "dropout-module": (lambda: GPT2MLP(I, GPT2Config(n_embd=H, resid_pdrop=0.1)), "dropout (dropout: p=0.1)", True),
    "functional-dropout": (TrainingDropout, "differently in training mode", True),
}


class _WithNorm(TwoLayer):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(I)

    def forward(self, hidden):
        return self.contract(F.gelu(self.norm(self.expand(hidden))))


@pytest.mark.parametrize("decoy", list(DECOYS))
def test_decoys_stay_generic_with_a_reason_and_exact(decoy, caplog):
    factory, words, evaluate = DECOYS[decoy]
    torch.manual_seed(0)
    tiled, ref = pair(factory())
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        tiledmlp.enable_tiling(tiled, num_shards=3)
    info = tiledmlp.describe(tiled)[""]
    assert info.form == "generic" and words in info.reason, info.reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "generic form" in warnings[0] and words in warnings[0]
    if evaluate:  # stochastic in training: compared in eval mode (the generic form's replay is tested elsewhere)
        tiled.eval(), ref.eval()
    check_exact(tiled, ref)


class _Double(nn.Module):
    def forward(self, weight):
        return 2 * weight


def _weight_norm(mlp):
    nn.utils.parametrizations.weight_norm(mlp.down_proj)
    return "down_proj: parametrized (weight by _WeightNorm)"


def _doubled_up(mlp):
    nn.utils.parametrize.register_parametrization(mlp.up_proj, "weight", _Double())
    return "up_proj: parametrized (weight by _Double)"


def _conv1d_weight_norm(mlp):
    nn.utils.parametrizations.weight_norm(mlp.c_fc)
    return "c_fc: parametrized (weight by _WeightNorm)"


def _lora_a_weight_norm(mlp):
    nn.utils.parametrizations.weight_norm(mlp.gate_proj.lora_A["default"])
    return "its adapter's A or B is parametrized (weight by _WeightNorm)"


def _lora_glu_with_b():
    return _lora_glu(0.0)


PARAMETRIZED = {  # name: (module, parametrize it (returns what the reason names))
    "weight_norm": (llama_mlp, _weight_norm),
    "register_parametrization": (llama_mlp, _doubled_up),
    "conv1d_weight_norm": (STYLES["gpt2-conv1d"][0], _conv1d_weight_norm),
    "lora_adapter_weight_norm": (_lora_glu_with_b, _lora_a_weight_norm),
}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("case", list(PARAMETRIZED))
def test_a_parametrized_projection_takes_the_generic_form_and_is_exact(case, when, caplog):
    """A projection whose weight a parametrization computes (``weight_norm``, ``register_parametrization``), before
    ``enable_tiling`` or after it: the generic form (the module's own forward, which computes the weight), with the
    parametrization named; same outputs and gradients as untiled, the parametrizations' parameters included. Before:
    ``KeyError: (<id>, 'weight')`` (recognition looked the weight up among the parameters)."""
    factory, parametrize = PARAMETRIZED[case]
    torch.manual_seed(0)
    tiled, ref = pair(factory())
    words = parametrize(ref)
    if when == "before":
        parametrize(tiled)
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        tiledmlp.enable_tiling(tiled, num_shards=3)
        if when == "after":
            parametrize(tiled)
        check_exact(tiled, ref)
    info = tiledmlp.describe(tiled)[""]
    assert info.form == "generic" and words in info.reason, info.reason
    assert any(p.grad is not None and "parametrizations" in n for n, p in tiled.named_parameters())


def test_a_projection_whose_weight_is_an_attribute_takes_the_generic_form():
    """A weight set as a plain tensor attribute (no parameter to swap): generic, said why, exact."""
    tiled, ref = pair(llama_mlp())
    for mlp in (tiled, ref):
        weight = mlp.down_proj.weight.detach().clone()
        del mlp.down_proj.weight
        mlp.down_proj.weight = weight
    tiledmlp.enable_tiling(tiled, num_shards=3)
    info = tiledmlp.describe(tiled)[""]
    assert info.form == "generic" and "weights of down_proj are not its parameters" in info.reason, info.reason
    check_exact(tiled, ref)


class SelfAttention(nn.Module):
    """Four projections chaining hidden -> hidden, and a forward that mixes tokens: never an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))

    def forward(self, x):
        return self.o(F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x)))


def test_a_module_that_mixes_tokens_is_never_tiled():
    """Bidirectional attention is permutation-equivariant; the probe's halves check still catches it."""
    with pytest.raises(ValueError, match="no MLP block recognized"):
        tiledmlp.enable_tiling(nn.Sequential(SelfAttention()))


class _Mixing(nn.Module):
    """A projection, then something over the tokens (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = nn.Linear(H, H)

    def forward(self, x):
        y = self.proj(x)
        if self.how == "mean":
            return y + y.mean(dim=-2, keepdim=True)
        if self.how == "causal":  # later tokens see earlier ones: changing the first half shows it
            return y.cumsum(dim=-2)
        return y.flip(-2).cumsum(dim=-2).flip(-2)  # earlier tokens see later ones


class _Mean(_Mixing):
    def __init__(self):
        super().__init__("mean")


class _Causal(_Mixing):
    def __init__(self):
        super().__init__("causal")


class _Anticausal(_Mixing):
    def __init__(self):
        super().__init__("anticausal")


@pytest.mark.parametrize("how", ["mlp_types", "register_mlp"])
@pytest.mark.parametrize("mixing", [_Mean, _Causal, _Anticausal, SelfAttention], ids=lambda c: c.__name__)
def test_a_registered_module_that_mixes_tokens_is_refused(mixing, how, monkeypatch):
    """``register_mlp``/``mlp_types`` promise a per-token module; one that mixes tokens (a mean over them, a causal
    or an anti-causal sum, attention) is refused by the probe, the model left untiled. Before: tiled, and silently
    wrong (each shard computes over its own tokens only)."""
    monkeypatch.setattr("tiledmlp.recognize.modules._REGISTERED", [])
    torch.manual_seed(0)
    model = nn.Sequential(mixing())
    if how == "register_mlp":
        tiledmlp.register_mlp(mixing)
    with pytest.raises(ValueError, match=f"{mixing.__name__} is registered for tiling .* mixes tokens"):
        tiledmlp.enable_tiling(model, num_shards=3, **({"mlp_types": (mixing,)} if how == "mlp_types" else {}))
    assert tiledmlp.tiled_modules(model) == {} and "forward" not in model[0].__dict__


class _MaskedPerToken(nn.Module):
    """Per token, with a random mask drawn at every call whatever the mode (the probe's runs draw the same one)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(h * (torch.rand_like(h) > 0.3))


class _NeedsMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H)

    def forward(self, x, mask):
        return self.proj(x) * mask


def test_registered_per_token_modules_pass_the_probe_and_one_it_cannot_run_is_said(caplog):
    """A per-token module drawing random numbers is per-token to the probe (tiled); one whose forward needs more
    than the hidden states cannot be probed: tiled as registered, said once."""
    model = tiledmlp.enable_tiling(nn.Sequential(_MaskedPerToken()), num_shards=3, mlp_types=(_MaskedPerToken,))
    assert tiledmlp.tiled_modules(model) == {"0": "plain"}
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        model = tiledmlp.enable_tiling(nn.Sequential(_NeedsMask()), mlp_types=(_NeedsMask,))
    assert tiledmlp.tiled_modules(model) == {"0": "plain"}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "could not check that it is per-token" in said[0] and "mask" in said[0], said


@pytest.mark.parametrize("style", ["plain-gelu", "inline"])
def test_several_matching_fast_forms_take_the_generic_form(style, monkeypatch):
    """Where the probe cannot tell two fast forms apart — here GELU and its tanh approximation, under a tolerance
    coarser than their difference (what a table with two near-identical rows would be), the approximation tried
    first — no form is guessed: the generic form, the candidates named, exact. Taking the first match would
    compute the tanh approximation, off by ~1e-4, which the comparison with the untiled module fails."""
    module = STYLES[style][0]()
    if style == "inline":  # a GELU GLU (the style's own activation is SiLU)
        module.act = "gelu"
    monkeypatch.setattr("tiledmlp.recognize.mlp.PROBE_RTOL", 1e-2)
    monkeypatch.setattr("tiledmlp.recognize.mlp.PROBE_ACTIVATIONS", ("gelu_tanh", "gelu", "relu"))
    tiled, ref = pair(module)
    tiledmlp.enable_tiling(tiled, num_shards=3)
    info = tiledmlp.describe(tiled)[""]
    assert info.form == "generic" and "the probe matched several fast forms" in info.reason, info
    assert "gelu_tanh(" in info.reason and "gelu(" in info.reason and "relu(" not in info.reason, info.reason
    check_exact(tiled, ref)


@pytest.mark.parametrize("zeroed", [("down_proj",), ("gate_proj", "down_proj"), ("gate_proj", "up_proj", "down_proj")])
def test_zero_initialized_projections_get_their_fast_form(zeroed):
    """Weights not loaded yet: with zero projections every candidate form would match (before: the generic form,
    with a warning listing the candidates). The probe computes with random weights of the projections' shapes."""
    tiled, ref = pair(llama_mlp(H, I))
    for module in (tiled, ref):
        for name in zeroed:
            nn.init.zeros_(getattr(module, name).weight)
    tiledmlp.enable_tiling(tiled, num_shards=3)
    info = tiledmlp.describe(tiled)[""]
    assert (info.form, info.reason) == ("glu", "")
    assert info.computes == "down_proj(silu(gate_proj(x)) * up_proj(x))"
    check_exact(tiled, ref)


def test_a_forward_that_drops_its_bias_is_not_taken_for_one_that_adds_it():
    """A zero bias hides whether the forward adds it; the probe's random bias does not."""

    class NoBias(TwoLayer):
        def forward(self, x):
            return F.linear(F.gelu(F.linear(x, self.expand.weight)), self.contract.weight) + self.contract.bias

    tiled, ref = pair(NoBias("gelu"))
    for module in (tiled, ref):
        nn.init.zeros_(module.expand.bias)
    tiledmlp.enable_tiling(tiled, num_shards=3)
    assert tiledmlp.describe(tiled)[""].form == "generic"
    check_exact(tiled, ref)


def test_probe_leaves_the_module_as_it_found_it():
    torch.manual_seed(0)
    mlp = biased(TwoLayer("gelu")).bfloat16()
    mlp.train()
    mlp.expand.eval()
    before = {n: p.clone() for n, p in mlp.state_dict().items()}
    precision = torch.get_float32_matmul_precision()
    tiledmlp.enable_tiling(mlp)
    assert (mlp.training, mlp.expand.training, mlp.contract.training) == (True, False, True)
    assert all(torch.equal(before[n], p) for n, p in mlp.state_dict().items())
    assert all(p.dtype == torch.bfloat16 for p in mlp.parameters())
    assert torch.get_float32_matmul_precision() == precision


def test_generic_form_asked_for():
    tiled, ref = pair(InlineGLU())
    tiledmlp.enable_tiling(tiled, num_shards=3, form="generic")
    info = tiledmlp.describe(tiled)[""]
    assert info.form == "generic" and "asked for" in info.reason
    check_exact(tiled, ref)


def test_without_the_probe_a_hf_glu_is_recognized_by_structure_and_others_by_names_only():
    """Meta parameters (as sharded ones) cannot be probed: a Hugging Face-named GLU gets the GLU form on
    its names and activation attribute; a plain MLP under MLP names the generic form; an unnamed one
    is not tiled."""
    with torch.device("meta"):
        named_glu, unnamed, named_plain = llama_mlp(), nn.Sequential(TwoLayer()), PhiMLP(PhiConfig(hidden_size=H, intermediate_size=I))
    tiledmlp.enable_tiling(named_glu)
    assert tiledmlp.describe(named_glu)[""].form == "glu"
    assert "by structure" in tiledmlp.describe(named_glu)[""].computes
    with pytest.raises(ValueError, match="no MLP block recognized"):
        tiledmlp.enable_tiling(unnamed)
    tiledmlp.enable_tiling(named_plain)
    info = tiledmlp.describe(named_plain)[""]
    assert info.form == "generic" and "the probe could not run (its parameters are on the meta device)" in info.reason


def test_extra_call_arguments_take_the_generic_form_and_say_so(caplog):
    class Kw(InlineGLU):
        def forward(self, x, scale: float = 1.0):
            return super().forward(x) * scale

    torch.manual_seed(0)
    tiled, ref = pair(Kw())
    tiledmlp.enable_tiling(tiled, num_shards=3)
    assert tiledmlp.describe(tiled)[""].form == "glu"
    x = torch.randn(2, 9, H)
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        for _ in range(2):
            torch.testing.assert_close(tiled(x, scale=2.0), ref(x, scale=2.0))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "Kw: called with extra arguments (scale)" in messages[0]  # once, not per call
    assert "slower generic form" in messages[0]


# ----------------------------------------------------------------------------------------------
# describe() and the summary line


def test_describe_a_causal_lm_with_the_loss():
    model = build("llama")
    tiledmlp.enable_tiling(model, loss=True)
    plain = tiledmlp.describe(model)
    names = [n for n in plain if n.endswith("mlp")]
    assert len(names) == model.config.num_hidden_layers and "lm_head" in plain
    assert {plain[n].form for n in names} == {"glu"} and plain["lm_head"].form == "loss"
    assert all(i.strategy == "plain" and i.num_shards is None and i.scratch_bytes is None for i in plain.values())
    sized = tiledmlp.describe(model, seq_len=131072)
    for name in names:
        i = sized[name]
        assert i.num_shards * i.shard_tokens >= 131072 > (i.num_shards - 1) * i.shard_tokens
        assert 0 < i.scratch_bytes <= 512 * 2**20
    head = sized["lm_head"]
    assert head.num_shards >= 1 and head.scratch_bytes >= 256 * 2**20
    text = str(sized)
    assert text.splitlines()[0] == sized.summary()
    assert all(n in text for n in names) and "lm_head" in text and "MiB" in text
    assert sized.summary().startswith(f"tiled {len(names)} MLPs: {len(names)} glu, loss tiled at lm_head, strategy plain, ~")
    assert sized.summary().endswith("MiB scratch at 128K tokens")
    with pytest.raises(ValueError, match="seq_len"):
        tiledmlp.describe(model, seq_len=0)


def test_enable_tiling_logs_one_summary_line(caplog):
    model = build("llama")
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        tiledmlp.enable_tiling(model)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [tiledmlp.describe(model, seq_len=131072).summary()]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_describe_counts_generic_and_fast_forms():
    torch.manual_seed(0)
    model = nn.Sequential(InlineGLU(), Residual(), TwoLayer())
    tiledmlp.enable_tiling(model)
    d = tiledmlp.describe(model, seq_len=4096)
    assert [i.form for i in d.values()] == ["glu", "generic", "mlp"]
    assert d["1"].scratch_bytes is None and d["1"].num_shards == 4096 // H
    assert d.summary().startswith("tiled 3 MLPs: 1 glu, 1 mlp, 1 generic, strategy plain")
    assert "matches no fast form" in str(d)
    assert copy.deepcopy(model) is not None  # describe keeps nothing on the model
