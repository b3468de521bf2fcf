"""The tiled autograd function against the untiled module: shapes, gradients, grad modes, memory.

Every case runs for both forms: the fast GLU form (``form="auto"`` on a Llama MLP) and the generic
form (the module's own forward, ``form="generic"``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp.core.function import TiledMLPFunction
from unit_helpers import assert_close_rel, assert_grads_match, leaf_like, llama_mlp, pair

FORMS = ["auto", "generic"]
TOL = 2e-6  # fp32: tiling only changes the order of the weight-gradient sums


def tiled_pair(form: str, num_shards: int = 3, **kw):
    tiled, ref = pair(llama_mlp(**kw))
    tiledmlp.enable_tiling(tiled, num_shards=num_shards, form=form)
    return tiled, ref


def check(tiled, ref, x: torch.Tensor, x_requires_grad: bool = True) -> None:
    xt, xr = leaf_like(x, x_requires_grad)
    yt, yr = tiled(xt), ref(xr)
    assert_close_rel(yt, yr, TOL, "output")
    g = torch.randn_like(yr)
    yt.backward(g)
    yr.backward(g)
    if x_requires_grad:
        assert_close_rel(xt.grad, xr.grad, TOL, "input grad")
    assert_grads_match(tiled, ref, TOL)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "shape, shards",
    [
        ((2, 37, 32), 3),  # B > 1, T not divisible by the shard count
        ((45, 32), 4),  # [T, H] (MoE experts' layout)
        ((1, 3, 32), 8),  # T smaller than the shard count
        ((3, 1, 32), 2),  # one token per sequence
        ((2, 5, 7, 32), 4),  # extra leading dims
    ],
)
def test_shapes_match_untiled(form, shape, shards):
    tiled, ref = tiled_pair(form, shards)
    check(tiled, ref, torch.randn(shape))


@pytest.mark.parametrize("form", FORMS)
def test_non_contiguous_input(form):
    tiled, ref = tiled_pair(form)
    base = torch.randn(32, 40, 2)
    x = base[..., 0].t().unsqueeze(0)  # [1, 40, 32], strided
    assert not x.is_contiguous()
    check(tiled, ref, x)


@pytest.mark.parametrize("form", FORMS)
def test_biases(form):
    tiled, ref = tiled_pair(form, bias=True)
    check(tiled, ref, torch.randn(2, 29, 32))


@pytest.mark.parametrize("form", FORMS)
def test_frozen_parameters_get_no_grad(form):
    tiled, ref = tiled_pair(form, bias=True)
    for m in (tiled, ref):
        m.up_proj.weight.requires_grad_(False)
        m.gate_proj.bias.requires_grad_(False)
    check(tiled, ref, torch.randn(2, 29, 32))
    assert tiled.up_proj.weight.grad is None and tiled.gate_proj.bias.grad is None


@pytest.mark.parametrize("form", FORMS)
def test_input_without_grad_still_trains_weights(form):
    """Frozen upstream / LoRA: the input needs no grad, the weights do. The anchors crash or drop
    the weights' gradients here, because their output has no grad_fn."""
    tiled, ref = tiled_pair(form)
    x = torch.randn(2, 29, 32)
    y = tiled(x)
    assert y.grad_fn is not None
    check(tiled, ref, x, x_requires_grad=False)


@pytest.mark.parametrize("form", FORMS)
def test_frozen_weights_input_needs_grad(form):
    tiled, ref = tiled_pair(form)
    for m in (tiled, ref):
        m.requires_grad_(False)
    check(tiled, ref, torch.randn(2, 29, 32))
    assert all(p.grad is None for p in tiled.parameters())


@pytest.mark.parametrize("form", FORMS)
def test_gradient_accumulation_onto_existing_grad(form):
    """Several backward passes add onto ``.grad``; a user's existing gradient is never zeroed."""
    tiled, ref = tiled_pair(form)
    for m in (tiled, ref):
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.25)
    for step in range(3):
        x = torch.randn(2, 20 + step, 32)
        check(tiled, ref, x)


@pytest.mark.parametrize("form", FORMS)
def test_no_grad_inference(form):
    tiled, ref = tiled_pair(form)
    x = torch.randn(2, 37, 32, requires_grad=True)
    with torch.no_grad():
        y = tiled(x)
    assert y.grad_fn is None and not y.requires_grad
    assert_close_rel(y, ref(x).detach(), TOL, "output")


@pytest.mark.parametrize("form", FORMS)
def test_single_autograd_node_and_one_accumulation_per_parameter(form):
    """One TiledMLPFunction node; each parameter's AccumulateGrad runs once per backward."""
    tiled, _ = tiled_pair(form, num_shards=5)
    x = torch.randn(2, 37, 32, requires_grad=True)
    y = tiled(x)
    # The node returns the [B, T, H] output itself, not a view of a [tokens, H] buffer (FSDP2 warns
    # about views returned by a unit).
    assert type(y.grad_fn).__name__ == "TiledMLPFunctionBackward" and y._base is None
    calls = {name: 0 for name, _ in tiled.named_parameters()}
    handles = [
        p.register_post_accumulate_grad_hook(lambda p, n=name: calls.__setitem__(n, calls[n] + 1))
        for name, p in tiled.named_parameters()
    ]
    y.sum().backward()
    for h in handles:
        h.remove()
    assert set(calls.values()) == {1}, calls


@pytest.mark.parametrize("form", FORMS)
def test_writes_into_preallocated_buffers_without_cat(form, monkeypatch):
    """Outputs and the input gradient are filled shard by shard: no torch.cat doubling."""
    tiled, ref = tiled_pair(form, num_shards=4)

    def no_cat(*a, **k):
        raise AssertionError("torch.cat called inside the tiled MLP")

    x = torch.randn(2, 37, 32)
    xt, xr = leaf_like(x)
    monkeypatch.setattr(torch, "cat", no_cat)
    yt = tiled(xt)
    yt.backward(torch.ones_like(yt))
    monkeypatch.undo()
    yr = ref(xr)
    yr.backward(torch.ones_like(yr))
    assert_close_rel(xt.grad, xr.grad, TOL, "input grad")


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of every tensor autograd saves for backward during ``module(x)``, parameters excluded."""
    params = {p.data_ptr() for p in module.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return total


@pytest.mark.parametrize("form", FORMS)
def test_memory_saved_for_backward_is_order_tokens_times_hidden(form):
    """The tiled MLP saves exactly its input (T·H); the untiled one saves several T·I tensors."""
    hidden, inter, tokens = 32, 256, 96
    tiled, ref = pair(llama_mlp(hidden, inter))
    tiledmlp.enable_tiling(tiled, num_shards=6, form=form)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    x_bytes = x.numel() * x.element_size()
    assert _saved_bytes(tiled, x) == x_bytes
    assert _saved_bytes(ref, x) >= 3 * tokens * inter * 4
    # It scales with T·H only: twice the tokens, twice the bytes.
    x2 = torch.randn(1, 2 * tokens, hidden, requires_grad=True)
    assert _saved_bytes(tiled, x2) == 2 * x_bytes


def test_function_is_exported_for_inspection():
    """The exported ``TiledMLPFunction`` is the node a tiled call's output hangs from, and applying it is the tiled
    call (a name check alone passes for any class so named)."""
    tiled, ref = tiled_pair("auto")
    x = torch.randn(1, 9, 32, requires_grad=True)
    y = tiled(x)
    assert type(y.grad_fn) is TiledMLPFunction._backward_cls
    assert_close_rel(y, ref(x), 1e-6, "output")


class DropoutMLP(nn.Module):
    """A per-token MLP with dropout: the recompute must draw the same mask as the forward did."""

    def __init__(self, hidden: int = 32, inter: int = 64, p: float = 0.3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inter)
        self.fc2 = nn.Linear(inter, hidden)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def test_dropout_uses_the_same_mask_in_recompute():
    torch.manual_seed(0)
    tiled, ref = pair(DropoutMLP())
    tiledmlp.enable_tiling(tiled, num_shards=4, mlp_types=(DropoutMLP,))
    x = torch.randn(2, 37, 32)
    xt, xr = leaf_like(x)
    torch.manual_seed(123)
    yt = tiled(xt)
    yt.backward(torch.ones_like(yt))
    state_after_tiled = torch.get_rng_state()
    torch.manual_seed(123)
    # The untiled module draws the masks of all tokens at once; the tiled one shard by shard, so
    # compare against the untiled module run shard by shard with the same generator stream.
    yr = torch.cat([ref(s) for s in xr.reshape(-1, 32).split(19)]).view_as(yt)
    yr.backward(torch.ones_like(yr))
    assert_close_rel(yt, yr.detach(), TOL, "output")
    assert_close_rel(xt.grad, xr.grad, TOL, "input grad")
    assert_grads_match(tiled, ref, TOL)
    # Backward replays the RNG in a forked state: the caller's stream continues as after forward.
    torch.manual_seed(123)
    tiled(x)
    assert torch.equal(state_after_tiled, torch.get_rng_state())


@pytest.mark.parametrize("form", FORMS)
def test_autocast_recompute_matches_forward(form):
    """Under autocast the recompute runs with the forward's autocast state (bf16 on CPU)."""
    tiled, ref = tiled_pair(form)
    x = torch.randn(2, 29, 32)
    xt, xr = leaf_like(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yt, yr = tiled(xt), ref(xr)
    assert yt.dtype == yr.dtype == torch.bfloat16
    g = torch.randn_like(yr)
    yt.backward(g)
    yr.backward(g)
    assert_close_rel(yt, yr, 2e-2, "output")
    assert_close_rel(xt.grad, xr.grad, 2e-2, "input grad")
    assert_grads_match(tiled, ref, 2e-2)


def test_a_stochastic_form_cannot_cut_its_forward_differently():
    """Its backward replays the forward's random numbers shard by shard."""
    from tiledmlp.forms.base import ModuleForm
    from tiledmlp.core.form import TileCall

    form = ModuleForm(lambda x: x, [], [], 2)
    with pytest.raises(ValueError, match="leave forward_rows None"):
        TileCall(form=form, shard_rows=8, lead_shape=(16,), forward_rows=4)


class _DotForm:
    """A minimal form that finishes its gradients in forward: ``out_t = x_t . w`` (one number per
    token); for an upstream gradient of ones, ``dx_t = w`` and ``dw = sum_t x_t``."""

    stochastic = False
    grads_in_forward = True
    float32_sums = ()
    leading_outputs = (True,)
    returned_tuple = False

    def forward_shard(self, x, params, out=None, side=(), dx_out=None, grads=None):
        (w,) = params
        if grads is not None:
            if dx_out is not None:
                dx_out.copy_(w.expand_as(x))
            grads.add(0, x.sum(0))
        return (x @ w,)


def _dot_call(x: torch.Tensor, w: torch.Tensor):
    from tiledmlp.core.form import TileCall
    from tiledmlp.core.function import run_tiled

    call = TileCall(form=_DotForm(), shard_rows=5, lead_shape=(x.shape[0],))
    (out,) = run_tiled(call, x, [w])
    return out


def test_gradients_finished_in_forward_are_scaled_by_the_upstream_gradient():
    x, w = torch.randn(17, 6, requires_grad=True), torch.randn(6, requires_grad=True)
    (2.5 * _dot_call(x, w).sum()).backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (2.5 * (xr @ wr).sum()).backward()
    assert_close_rel(x.grad, xr.grad, 1e-6, "input grad")
    assert_close_rel(w.grad, wr.grad, 1e-6, "weight grad")


def test_gradients_finished_in_forward_refuse_unequal_upstream_gradients():
    """They were computed for one upstream value on every output; anything else is an error, not a guess."""
    x, w = torch.randn(17, 6, requires_grad=True), torch.randn(6, requires_grad=True)
    with pytest.raises(RuntimeError, match="different upstream gradients.*needs its outputs summed"):
        (_dot_call(x, w) * torch.arange(17.0)).sum().backward()


def test_a_form_with_gradients_in_forward_cannot_cut_its_forward_differently():
    from tiledmlp.core.form import TileCall

    with pytest.raises(ValueError, match="finishes its gradients in forward has one cut"):
        TileCall(form=_DotForm(), shard_rows=8, lead_shape=(16,), forward_rows=4)
