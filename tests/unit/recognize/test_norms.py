"""Normalization layers tiled over tokens (``enable_tiling(norms=True)``, ``tiledmlp.recognize.norms``): recognized by what
they compute, exact against the untiled model (float32 tight, bf16 within the untiled error against float64),
keeping only their input for backward, under checkpointing with host offload, compiled, and reported."""

from __future__ import annotations

import copy
import logging
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import tiledmlp
import tiledmlp.patching.call_spec
from tiledmlp.core.compat import enable_checkpointing
from tiledmlp.recognize.norms import recognize_norm
from tiledmlp.recognize.modules import param_slots
from tiledmlp.core.sharding import ShardPolicy
from tiledmlp.forms.base import norm_scratch_per_token
from unit_helpers import (assert_close_rel, assert_compiled_layers_train_like_eager, batch, bf16_signal, build,
                          rel_err)

H = 48


class InlineRMSNorm(nn.Module):
    """An RMSNorm under another name, written inline: recognized by its computation."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Scale(nn.Module):
    """A learned per-channel scale: per token and shape-preserving, but not a normalization."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


class SequenceNorm(nn.Module):
    """Normalizes over the tokens, not the features: mixes tokens, never tiled."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + 1e-6)


class DroppedNorm(LlamaRMSNorm):
    """An RMSNorm followed by dropout: differs in training mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(super().forward(x), 0.1, self.training)


def _randomized(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(0.5, 1.5)
    return module


NORMS = {
    "llama_rmsnorm": lambda: LlamaRMSNorm(H),
    "gemma_rmsnorm": lambda: GemmaRMSNorm(H),  # (1 + weight)
    "layernorm": lambda: nn.LayerNorm(H),
    "layernorm_no_bias": lambda: nn.LayerNorm(H, bias=False),
    "torch_rmsnorm": lambda: nn.RMSNorm(H),
    "inline_rmsnorm": lambda: InlineRMSNorm(H),
}
NOT_NORMS = {
    "scale": lambda: Scale(H),
    "sequence_norm": lambda: SequenceNorm(H),
    "dropout_after_norm": lambda: DroppedNorm(H),
    "linear": lambda: nn.Linear(H, H),
    "layernorm_without_parameters": lambda: nn.LayerNorm(H, elementwise_affine=False),
    "a_parent_of_a_norm": lambda: nn.Sequential(LlamaRMSNorm(H)),
}


def _recognize(module: nn.Module):
    return recognize_norm(module, module.forward, param_slots(module))


@pytest.mark.parametrize("name", list(NORMS))
def test_normalization_layers_are_recognized_by_what_they_compute(name):
    rec = _recognize(_randomized(NORMS[name]()))
    assert rec is not None and rec.kind == "norm" and rec.layout is None
    assert f"per-token normalization of {H} features" in rec.computes


@pytest.mark.parametrize("name", list(NOT_NORMS))
def test_other_modules_are_not_normalization_layers(name):
    assert _recognize(_randomized(NOT_NORMS[name]())) is None


def test_the_probe_runs_no_hooks_and_changes_nothing():
    norm = _randomized(LlamaRMSNorm(H))
    before = copy.deepcopy(norm.state_dict())
    seen = []
    norm.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    tiledmlp.enable_tiling(norm, norms=True)
    assert seen == []
    for key, value in norm.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("name", list(NORMS))
def test_a_tiled_norm_is_exact_in_float32(name):
    base = _randomized(NORMS[name]())
    tiled = tiledmlp.enable_tiling(copy.deepcopy(base), norms=True, tile_tokens=7)
    x = torch.randn(3, 20, H, generator=torch.Generator().manual_seed(0)) * 2 + 0.3
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for module in (tiled, base):
        xx = x.clone().requires_grad_()
        y = module(xx)
        y.backward(g)
        results.append((y.detach(), xx.grad, [p.grad for p in module.parameters()]))
    (yt, dxt, gt), (yr, dxr, gr) = results
    assert torch.equal(yt, yr)  # per token, the module's own computation
    assert_close_rel(dxt, dxr, 1e-6, "input grad")
    for a, b in zip(gt, gr):
        assert_close_rel(a, b, 1e-6, "parameter grad")  # a sum over tokens, summed per shard


#: A 1-D parameter's gradient is a sum over tokens that the generic form gets per shard already rounded to the
#: parameter's dtype (autograd's reduction for that shard), then sums in float32 and rounds again. The shard
#: partials of a norm's weight gradient cancel like a random walk (|partial| ~ |total| / sqrt(N)), so their N
#: roundings add the variance of one rounding of the total: at most sqrt(2) times the untiled error, which
#: rounds once (measured 1.05-1.35x for RMSNorms, 0.3-0.5x for LayerNorm, whose untiled backward rounds more).
PARAMETER_FACTOR = 2 ** 0.5


@pytest.mark.parametrize("name", ["llama_rmsnorm", "layernorm", "gemma_rmsnorm"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_within_the_untiled_error_against_float64(name, seed):
    """Output and input gradient: the module's own computation per token (1.00x the untiled error); parameter
    gradients within PARAMETER_FACTOR."""
    torch.manual_seed(seed)
    base = _randomized(NORMS[name]())
    x = torch.randn(2, 96, H, generator=torch.Generator().manual_seed(2 + seed))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + seed))
    want = bf16_signal(copy.deepcopy(base).double(), x, g, torch.float64)
    untiled = bf16_signal(copy.deepcopy(base).bfloat16(), x, g, torch.bfloat16)
    tiled = bf16_signal(tiledmlp.enable_tiling(copy.deepcopy(base).bfloat16(), norms=True, tile_tokens=16), x, g,
                        torch.bfloat16)
    for key, ref in want.items():
        e_untiled, e_tiled = rel_err(untiled[key], ref), rel_err(tiled[key], ref)
        assert 1e-4 < e_untiled < 5e-2, f"{key}: implausible untiled bf16 error {e_untiled:.2e}"
        factor = 1.0 if key in ("output", "input grad") else PARAMETER_FACTOR
        assert e_tiled <= factor * e_untiled, f"{key}: tiled {e_tiled:.3e} vs untiled {e_untiled:.3e}"


class LargestMade(TorchDispatchMode):
    """The largest tensor any op makes while active, in elements, per dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.numel())
        return out


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    saved = []

    def pack(t: torch.Tensor):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()}
    return sum(storages.values()), y


def test_a_tiled_norm_keeps_only_its_input_and_computes_one_shard_at_a_time():
    """bf16 LlamaRMSNorm: untiled, it saves a float32 copy of its input and a bf16 normalized copy (3x the
    input's bytes besides the input) and its backward makes float32 tensors of the input's size; tiled, it
    saves nothing besides its input, and no op in its forward or backward makes a float32 tensor larger than a
    shard (bf16 ones: the output and the input gradient, the input's size)."""
    tokens, tile = 64, 8
    base = _randomized(LlamaRMSNorm(H)).bfloat16()
    tiled = tiledmlp.enable_tiling(copy.deepcopy(base), norms=True, tile_tokens=tile)
    x = torch.randn(tokens, H, dtype=torch.bfloat16).requires_grad_()
    untiled_saved, _ = _saved_bytes(base, x)
    assert untiled_saved >= 3 * x.numel() * x.element_size()
    tiled_saved, y = _saved_bytes(tiled, x)
    assert tiled_saved <= 64  # bookkeeping only (e.g. an RNG state), no activation
    with LargestMade() as made:
        base(x).backward(torch.ones_like(y))
    assert made.largest[torch.float32] == x.numel()
    with LargestMade() as made:
        tiled(x).backward(torch.ones_like(y))
    assert made.largest[torch.float32] == tile * H and made.largest[torch.bfloat16] == x.numel()


@pytest.mark.parametrize("positional", [True, False])
def test_a_checkpointed_region_keeps_no_input_of_a_tiled_call_alive(positional):
    """Inside a non-reentrant checkpointed region the checkpoint drops what the tiled node saves; nothing else
    may keep the node's input alive until backward (a generic-form call's recompute closure once did: a decoder
    layer's residual sum, 16 of them at once, which cost 2 GiB each at 512K tokens)."""
    ref = _randomized(LlamaRMSNorm(H))
    norm = tiledmlp.enable_tiling(copy.deepcopy(ref), norms=True, tile_tokens=4)
    inner = []

    def region(h: torch.Tensor) -> torch.Tensor:
        h2 = h * 2
        inner.append(weakref.ref(h2))
        return norm(h2) if positional else norm(hidden_states=h2)

    x = torch.randn(16, H, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False)
    assert inner[0]() is None
    y.sum().backward()
    xr = x.detach().requires_grad_()
    ref(xr * 2).sum().backward()
    assert_close_rel(x.grad, xr.grad, 1e-6)


def test_shards_are_sized_by_the_float32_copies():
    policy = ShardPolicy()
    assert norm_scratch_per_token(2048) == 8 * 4 * 2048
    assert policy.norm_rows(131072, norm_scratch_per_token(2048)) == 8192  # 512 MiB of float32 copies
    assert policy.norm_rows(1000, norm_scratch_per_token(2048)) == 1000
    assert ShardPolicy(scratch_mib=128).norm_rows(131072, norm_scratch_per_token(2048)) == 2048
    assert ShardPolicy(num_shards=4).norm_rows(100, norm_scratch_per_token(2048)) == 25


# ----------------------------------------------------------------------------------------------
# In models

#: family: normalization layers per decoder layer (and the final one)
FAMILY_NORMS = {"llama": 2, "gemma": 2, "qwen3": 4, "olmo2": 4, "gemma3_text": 6}


@pytest.mark.parametrize("family", list(FAMILY_NORMS))
def test_hf_models_with_norms_tiled_train_like_untiled(family):
    """Every decoder norm (Qwen3's and OLMo2's q/k norms, Gemma3's four layer norms included) tiled, with the MLPs
    and the loss: loss and every gradient as untiled, in float32."""
    ref = build(family)
    model = tiledmlp.enable_tiling(copy.deepcopy(ref), loss=True, norms=True, tile_tokens=9)
    infos = tiledmlp.describe(model)
    layers = ref.config.num_hidden_layers
    assert sum(i.form == "norm" for i in infos.values()) == FAMILY_NORMS[family] * layers + 1
    ids = batch()
    losses = [m(input_ids=ids, labels=ids).loss for m in (model, ref)]
    for loss in losses:
        loss.backward()
    assert_close_rel(losses[0], losses[1], 1e-6, "loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_rel(p.grad, q.grad, 2e-5, name)


def test_with_checkpointing_and_host_offload_bit_for_bit_like_without_offload():
    """The million-token configuration: checkpointed layers, loss, norms and offload, against the same model
    without offload (bit for bit) and against the untiled model."""
    from tiledmlp.offload.checkpointing import offloaded_layers

    ref = build("llama", use_cache=False)
    enable_checkpointing(ref)
    ref.train()
    runs = []
    for options in ({}, {"offload": "cpu"}):
        model = tiledmlp.enable_tiling(copy.deepcopy(ref), loss=True, norms=True, tile_tokens=9, **options)
        ids = batch()
        model(input_ids=ids, labels=ids).loss.backward()
        runs.append([p.grad for p in model.parameters()])
    assert offloaded_layers(model)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    ids = batch()
    ref(input_ids=ids, labels=ids).loss.backward()
    for a, q in zip(runs[1], ref.parameters()):
        assert_close_rel(a, q.grad, 2e-5)


def test_decode_calls_the_norm_itself(monkeypatch):
    """Under no_grad, a call no longer than one shard runs the module's own forward (no tiled call)."""
    model = tiledmlp.enable_tiling(build("llama"), norms=True)
    calls = []
    run_tiled = tiledmlp.patching.call_spec.run_tiled
    monkeypatch.setattr(tiledmlp.patching.call_spec, "run_tiled", lambda *a, **k: calls.append(1) or run_tiled(*a, **k))
    with torch.no_grad():
        model(input_ids=batch(t=1))
    assert calls == []


def test_reported_and_undone(caplog):
    model = build("llama")
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        tiledmlp.enable_tiling(model, norms=True)
    assert "tiled 2 MLPs: 2 glu, 5 normalization layers" in caplog.text
    assert "WARNING" not in caplog.text
    info = tiledmlp.describe(model, seq_len=131072)["model.layers.0.input_layernorm"]
    assert (info.form, info.reason, info.num_shards, info.under_compile) == ("norm", "", 8, "operator")
    assert info.scratch_bytes == 16384 * norm_scratch_per_token(32)  # 16384-token shards (the cap)
    tiledmlp.enable_tiling(model)  # re-configured without norms: their forwards restored
    assert sorted(i.form for i in tiledmlp.describe(model).values()) == ["glu", "glu", "loss"]
    assert not any("forward" in m.__dict__ for n, m in model.named_modules() if n.endswith("norm"))
    tiledmlp.disable_tiling(model)
    assert tiledmlp.tiled_modules(model) == {}


def test_norms_must_be_a_bool():
    with pytest.raises(TypeError, match="norms must be True or False"):
        tiledmlp.enable_tiling(build("llama"), norms="yes")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_layers_keep_one_graph_and_train_like_eager(backend):
    """Per-layer compile with ``fullgraph=True``: a tiled norm is an operator too, and training matches eager."""
    eager = tiledmlp.enable_tiling(build("llama", use_cache=False), norms=True, num_shards=3)
    model = copy.deepcopy(eager)
    assert_compiled_layers_train_like_eager(eager, model, model.model.layers, backend, lr=0.1)


def test_under_autocast_a_compiled_norm_keeps_the_eager_call_and_says_so(caplog):
    model = tiledmlp.enable_tiling(build("llama", use_cache=False), norms=True, num_shards=3)
    ref = copy.deepcopy(model)
    tiledmlp.core.logs._SAID.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model.model.layers[0], backend="aot_eager")
    x = torch.randn(2, 17, 32)
    pos = torch.arange(17)[None]
    emb = model.model.rotary_emb(x, pos)
    with caplog.at_level(logging.WARNING, logger="tiledmlp"), torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(x, position_embeddings=emb)
        want = ref.model.layers[0](x, position_embeddings=emb)
    assert "normalization layer called under autocast" in caplog.text
    assert torch.equal(got, want)
    torch._dynamo.reset()
