"""Forms: the fast GLU form (recognized by structure, verified by a probe) and the generic form."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3MLP

import tiledmlp
from tiledmlp.core import sharding
from tiledmlp.core.accumulate import GradAccumulator
from tiledmlp.forms.mlp import MLPForm, MLPLayout, Proj
from tiledmlp.patching.state import STATE_ATTR
from unit_helpers import assert_close_rel, assert_grads_match, check_against_untiled, leaf_like, llama_mlp, pair

TOL = 2e-6


def kind_of(module: nn.Module) -> str:
    return module.__dict__[STATE_ATTR].kind


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "gelu_new"])
@pytest.mark.parametrize("bias", [False, True])
def test_split_glu_fast_form(act, bias):
    tiled, ref = pair(llama_mlp(act=act, bias=bias))
    tiledmlp.enable_tiling(tiled, num_shards=3)
    assert kind_of(tiled) == "glu"
    check_against_untiled(tiled, ref, tol=TOL, x=torch.randn(2, 23, 32))


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_fused_gate_up_fast_form(act):
    torch.manual_seed(0)
    tiled, ref = pair(Phi3MLP(Phi3Config(hidden_size=32, intermediate_size=72, hidden_act=act)))
    tiledmlp.enable_tiling(tiled, num_shards=4)
    assert kind_of(tiled) == "glu"
    check_against_untiled(tiled, ref, tol=TOL, x=torch.randn(2, 23, 32))


@pytest.mark.parametrize("bias", [False, True])
def test_glu_forward_computes_into_the_output_rows(bias):
    """Given its destination rows, the GLU form's down projection writes there (no temporary, no
    copy) and returns that tensor, bit-identical to the allocating path; a destination of another
    dtype is left alone."""
    mlp = llama_mlp(bias=bias)
    params = [p for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj) for p in (m.weight, m.bias) if p is not None]
    gate, up, down = (Proj(2 * i, 2 * i + 1) if bias else Proj(i) for i in range(3))
    form = MLPForm(MLPLayout("silu", up, down, gate=gate))
    x = torch.randn(7, 32)
    with torch.no_grad():
        (ref,) = form.forward_shard(x, params)
        dest = torch.full_like(ref, float("nan"))
        (got,) = form.forward_shard(x, params, (dest,))
        (other,) = form.forward_shard(x, params, (torch.empty(ref.shape, dtype=torch.float64),))
    assert got is dest and torch.equal(got, ref)
    assert other.dtype == ref.dtype and torch.equal(other, ref)


class _Copies(TorchDispatchMode):
    """Records the shape of every ``copy_`` destination."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "copy_":
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_tiled_glu_forward_copies_only_the_first_shard():
    """The tiled forward hands every later shard its output rows, and the GLU form computes into
    them: of three shards' outputs only the first is copied; the result matches the untiled MLP."""
    tiled, ref = pair(llama_mlp())
    tiledmlp.enable_tiling(tiled, num_shards=3)
    x = torch.randn(1, 30, 32)
    with torch.no_grad(), _Copies() as copies:
        y = tiled(x)
    assert copies.shapes.count((10, 32)) == 1, copies.shapes
    with torch.no_grad():
        assert_close_rel(y, ref(x), TOL, "output")


class _GemmFlops(TorchDispatchMode):
    """Counts 2·m·n·k for every matrix product dispatched, in-place and out= variants included
    (FlopCounterMode skips ``addmm_`` and ``mm.out``)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_", "bmm", "baddbmm"):
            a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
            self.total += 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
        return func(*args, **(kwargs or {}))


def _flops(module, x) -> int:
    xx = x.detach().clone().requires_grad_()
    with _GemmFlops() as counter:
        module(xx).sum().backward()
    return counter.total


def test_glu_forward_cuts_its_own_shards_within_the_budget(monkeypatch):
    """The forward keeps gate and up of a whole intermediate, so it may cut a backward shard into
    equal parts (a tiny budget here: 256-token backward shards, forward shards of 64 tokens)."""
    calls = []
    real = MLPForm.forward_shard
    monkeypatch.setattr(MLPForm, "forward_shard", lambda self, x, *a: calls.append(x.shape[0]) or real(self, x, *a))
    tiled, ref = pair(llama_mlp(intermediate=2048))
    tiledmlp.enable_tiling(tiled, tile_tokens=256, scratch_mib=1)  # 1 MiB: 64 tokens of float32 gate and up
    calls.clear()  # enable_tiling's own probe
    check_against_untiled(tiled, ref, tol=TOL, x=torch.randn(1, 500, 32))
    assert calls == [64] * 7 + [52]


def test_glu_backward_recomputes_gate_and_up_only():
    """FLOP per token: untiled 18·H·I; GLU form 22·H·I (only gate and up recomputed); generic 24·H·I."""
    hidden, inter, tokens = 32, 96, 60
    x = torch.randn(1, tokens, hidden)
    unit = tokens * hidden * inter
    untiled = _flops(llama_mlp(hidden, inter), x)
    glu = _flops(tiledmlp.enable_tiling(llama_mlp(hidden, inter), num_shards=4), x)
    generic = _flops(tiledmlp.enable_tiling(llama_mlp(hidden, inter), num_shards=4, form="generic"), x)
    assert (untiled, glu, generic) == (18 * unit, 22 * unit, 24 * unit)


class ScaledGLU(nn.Module):
    """GLU-shaped but with an extra scale: structure alone would be wrong, the probe catches it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return 0.5 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_probe_rejects_glu_structure_with_a_different_forward(caplog):
    torch.manual_seed(0)
    tiled, ref = pair(ScaledGLU())
    with caplog.at_level("WARNING", logger="tiledmlp"):
        tiledmlp.enable_tiling(tiled, num_shards=3)
    assert kind_of(tiled) == "generic"
    assert "generic form" in caplog.text
    check_against_untiled(tiled, ref, tol=TOL, x=torch.randn(2, 23, 32))


class TwoLayerMLP(nn.Module):
    """A custom per-token module the library has never seen."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 80)
        self.out = nn.Linear(80, 32)
        self.norm = nn.LayerNorm(80)

    def forward(self, hidden_states):
        return self.out(torch.tanh(self.norm(self.inp(hidden_states))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(32, 32)
        self.mlp = TwoLayerMLP()

    def forward(self, x):
        h = x + self.attn(x)
        return h + self.mlp(h)


def test_glu_shards_are_sized_by_hand_counted_scratch():
    """The shards a GLU call runs, and describe()'s, against bytes counted by hand with hidden (32) and intermediate
    (88) apart, float32, a 2 MiB budget: in one intermediate block a token's backward scratch is gate and up rows and
    a dh block as wide as the block, 3 x 88 x 4 = 1056 bytes, 1985 tokens, rounded down to 1024; in two blocks of
    64 and 24 columns (64-aligned), 3 x 64 x 4 = 768 bytes, 2730 tokens, 2048. 4096 tokens: two shards of 2048 in
    two blocks (four in one); the forward's gate and up rows, 704 bytes a token, fit 2978, so it runs the backward's
    shards. Scratch: 2048 x 768 bytes. Sizes swapped (hidden for intermediate) give one shard of 4096."""
    mlp = tiledmlp.enable_tiling(llama_mlp(hidden=32, intermediate=88), scratch_mib=2)
    seen = {"forward": [], "backward": []}
    forward_shard, backward_shard = MLPForm.forward_shard, MLPForm.backward_shard

    def forward(self, x, *args, **kwargs):
        seen["forward"].append(x.shape[0])
        return forward_shard(self, x, *args, **kwargs)

    def backward(self, x, *args, **kwargs):
        seen["backward"].append((x.shape[0], self.inter_chunks))
        return backward_shard(self, x, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MLPForm, "forward_shard", forward)
        patch.setattr(MLPForm, "backward_shard", backward)
        mlp(torch.randn(1, 4096, 32, requires_grad=True)).sum().backward()
    assert seen == {"forward": [2048, 2048], "backward": [(2048, 2), (2048, 2)]}, seen
    info = tiledmlp.describe(mlp, seq_len=4096)[""]
    assert (info.num_shards, info.shard_tokens, info.inter_chunks, info.scratch_bytes) == (2, 2048, 2, 2048 * 768)


def test_custom_module_via_mlp_types_generic_form():
    torch.manual_seed(0)
    tiled, ref = pair(Block())
    tiledmlp.enable_tiling(tiled, num_shards=3, mlp_types=(TwoLayerMLP,))
    assert tiledmlp.tiled_modules(tiled) == {"mlp": "plain"}
    assert kind_of(tiled.mlp) == "generic"
    check_against_untiled(tiled, ref, tol=TOL, x=torch.randn(2, 23, 32))


def test_generic_form_releases_each_shard_gradient_once_accumulated(monkeypatch):
    """A parameter's shard gradient is added and freed before the next one arrives, so the generic
    form never holds every parameter's gradient at once (for an MoE block: every expert's)."""
    seen: list[weakref.ref] = []
    add = GradAccumulator.add

    def checked_add(self, i, grad, rows=slice(None)):
        assert all(ref() is None for ref in seen), "an earlier shard gradient is still alive"
        add(self, i, grad, rows)
        seen.append(weakref.ref(grad))

    monkeypatch.setattr(GradAccumulator, "add", checked_add)
    torch.manual_seed(0)
    tiled, ref = pair(Block())
    tiledmlp.enable_tiling(tiled, num_shards=3, mlp_types=(TwoLayerMLP,))
    check_against_untiled(tiled, ref, tol=TOL, x=torch.randn(2, 23, 32))
    assert len(seen) == 3 * len(list(tiled.mlp.parameters()))


class OneLayer(nn.Module):
    """Per-token, but no hidden -> intermediate -> hidden chain: not recognizable by computation."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        return torch.tanh(self.proj(x))


def test_register_mlp_makes_a_type_recognizable(monkeypatch):
    monkeypatch.setattr("tiledmlp.recognize.modules._REGISTERED", [])
    torch.manual_seed(0)
    model = nn.Sequential(OneLayer())
    with pytest.raises(ValueError, match="register_mlp"):
        tiledmlp.enable_tiling(model)
    tiledmlp.register_mlp(OneLayer)
    tiledmlp.enable_tiling(model, num_shards=2)
    assert tiledmlp.tiled_modules(model) == {"0": "plain"}
    assert tiledmlp.describe(model)["0"].reason.startswith("registered")


def test_multi_output_module_keeps_every_output_exact():
    """A module returning (hidden, per-token logits), like older MoE blocks returning router logits:
    each output is tiled and differentiable, so a loss on the second output stays exact."""

    class TwoOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(32, 4)
            self.proj = nn.Linear(32, 32)

        def forward(self, x):
            b, t, h = x.shape
            logits = self.router(x).view(b * t, 4)
            return self.proj(x) * logits.softmax(-1).view(b, t, 4)[..., :1], logits

    torch.manual_seed(0)
    tiled, ref = pair(TwoOutputs())
    tiledmlp.enable_tiling(tiled, num_shards=3, mlp_types=(TwoOutputs,))
    x = torch.randn(2, 19, 32)
    xt, xr = leaf_like(x)
    outs = []
    for m, xx in ((tiled, xt), (ref, xr)):
        y, logits = m(xx)
        (y.pow(2).mean() + logits.logsumexp(-1).mean()).backward()
        outs.append((y, logits))
    assert outs[0][1].shape == (38, 4)
    assert_close_rel(outs[0][0], outs[1][0], TOL, "hidden")
    assert_close_rel(outs[0][1], outs[1][1], TOL, "logits")
    assert_close_rel(xt.grad, xr.grad, TOL, "input grad")
    assert_grads_match(tiled, ref, TOL)


def test_non_per_token_module_is_refused():
    class Pool(nn.Module):
        def forward(self, x):
            return x.mean(dim=-2)

    with pytest.raises(ValueError, match="not per-token"):
        tiledmlp.apply_tiled_mlp(lambda m, x: m(x), Pool(), torch.randn(1, 10, 8), num_shards=2)


# --- apply_tiled_mlp (Liger/DeepSpeed call) -------------------------------------------------------


@pytest.mark.parametrize("ddp_safe", [False, True])
@pytest.mark.parametrize("num_shards", [None, 1, 4])
def test_apply_tiled_mlp_exact(ddp_safe, num_shards):
    mlp, ref = pair(llama_mlp())
    x = torch.randn(2, 45, 32)
    xt, xr = leaf_like(x)
    y = tiledmlp.apply_tiled_mlp(lambda m, s: m(s), mlp, xt, num_shards=num_shards,
                                 compute_params=list(mlp.parameters()), ddp_safe=ddp_safe)
    y.backward(torch.ones_like(y))
    yr = ref(xr)
    yr.backward(torch.ones_like(yr))
    assert_close_rel(y, yr, TOL, "output")
    assert_close_rel(xt.grad, xr.grad, TOL, "input grad")
    assert_grads_match(mlp, ref, TOL)


def test_apply_tiled_mlp_on_a_tiled_module_does_not_tile_twice():
    mlp, ref = pair(llama_mlp())
    tiledmlp.enable_tiling(mlp, num_shards=2)
    x = torch.randn(1, 30, 32)
    y = tiledmlp.apply_tiled_mlp(lambda m, s: m(s), mlp, x, num_shards=3)
    assert_close_rel(y, ref(x), TOL, "output")


def test_apply_tiled_mlp_rejects_foreign_compute_params():
    mlp = llama_mlp()
    with pytest.raises(ValueError, match="not parameters of mlp_module"):
        tiledmlp.apply_tiled_mlp(lambda m, s: m(s), mlp, torch.randn(1, 8, 32), compute_params=[nn.Parameter(torch.ones(3))])


def test_apply_tiled_mlp_rejects_bad_arguments():
    mlp = llama_mlp()
    with pytest.raises(TypeError, match="callable"):
        tiledmlp.apply_tiled_mlp(None, mlp, torch.randn(1, 8, 32))
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        tiledmlp.apply_tiled_mlp(lambda m, s: m(s), mlp, torch.randn(1, 8, 32), num_shards=0)
    with pytest.raises(ValueError, match="at least 2 dims"):
        tiledmlp.apply_tiled_mlp(lambda m, s: m(s), mlp, torch.randn(32))


@pytest.mark.parametrize("chunks", [2, 3, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_glu_backward_in_intermediate_blocks(chunks, bias):
    """Blocks of the intermediate dimension (more blocks than columns is fine: fewer are used)."""
    tiled, ref = pair(llama_mlp(intermediate=88, bias=bias))
    tiledmlp.enable_tiling(tiled, num_shards=3, inter_chunks=chunks)
    check_against_untiled(tiled, ref, tol=TOL, x=torch.randn(2, 23, 32))


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_glu_backward_computes_dh_in_column_blocks(monkeypatch, chunks, bias):
    """dh (and h) one column block at a time, the down projection's gradient block by block."""
    monkeypatch.setattr(sharding, "_DH_BLOCK_MIN", 8)
    monkeypatch.setattr(sharding, "_ALIGN", 1)  # these sizes are far below one aligned block
    monkeypatch.setattr(sharding, "_DH_ALIGN", 1)
    assert len(sharding.dh_blocks(88 // chunks)) > 1
    tiled, ref = pair(llama_mlp(intermediate=88, bias=bias))
    tiledmlp.enable_tiling(tiled, num_shards=3, inter_chunks=chunks)
    check_against_untiled(tiled, ref, tol=TOL, x=torch.randn(2, 23, 32))


@pytest.mark.parametrize("shards", [1, 3])
def test_fused_glu_dh_column_blocks(monkeypatch, shards):
    """One shard writes every gradient block directly (no accumulation); several accumulate."""
    monkeypatch.setattr(sharding, "_DH_BLOCK_MIN", 8)
    monkeypatch.setattr(sharding, "_ALIGN", 1)
    monkeypatch.setattr(sharding, "_DH_ALIGN", 1)
    torch.manual_seed(0)
    tiled, ref = pair(Phi3MLP(Phi3Config(hidden_size=32, intermediate_size=72, hidden_act="silu")))
    tiledmlp.enable_tiling(tiled, num_shards=shards)
    check_against_untiled(tiled, ref, tol=TOL, x=torch.randn(2, 23, 32))


def test_fused_glu_backward_in_intermediate_blocks_with_frozen_parts():
    torch.manual_seed(0)
    tiled, ref = pair(Phi3MLP(Phi3Config(hidden_size=32, intermediate_size=72, hidden_act="silu")))
    for m in (tiled, ref):
        m.down_proj.weight.requires_grad_(False)
    tiledmlp.enable_tiling(tiled, num_shards=4, inter_chunks=3)
    check_against_untiled(tiled, ref, tol=TOL, x=torch.randn(2, 23, 32))
    assert tiled.down_proj.weight.grad is None


def test_glu_blocks_under_autocast():
    tiled, ref = pair(llama_mlp())
    tiledmlp.enable_tiling(tiled, num_shards=3, inter_chunks=4)
    x = torch.randn(2, 29, 32)
    xt, xr = leaf_like(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yt, yr = tiled(xt), ref(xr)
    g = torch.randn_like(yr)
    yt.backward(g)
    yr.backward(g)
    assert_close_rel(xt.grad, xr.grad, 2e-2, "input grad")
    assert_grads_match(tiled, ref, 2e-2)
