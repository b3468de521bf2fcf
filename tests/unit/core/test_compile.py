"""torch.compile of tiled models (``tiledmlp/core/compiled.py``): a tiled call (fast or generic form) is one
``tiledmlp::tiled_call`` operator in the graph — no graph break, ``fullgraph=True`` works, no recompile beyond
the untiled model's — and training matches the eager tiled model; what cannot be an operator keeps the eager
call and says so.

``aot_eager`` in most tests (AOTAutograd's forward/backward split, no codegen), inductor in a few.
"""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp.core.compat import enable_checkpointing
from tiledmlp.patching.state import STATE_ATTR
from tiledmlp.loss.heads import COMPILED_HEAD
from mlp_styles import H, STYLES
from unit_helpers import batch, build, llama_mlp

OP = "tiledmlp.tiled_call"


class Counter:
    """A Dynamo backend that counts frames and records whether each graph holds the tiled operator."""

    def __init__(self, backend: str = "aot_eager") -> None:
        from torch._dynamo.backends.registry import lookup_backend
        self.inner = lookup_backend(backend)
        self.frames = 0
        self.ops: list[int] = []  # tiled operator calls per graph

    def __call__(self, gm, example_inputs):
        self.frames += 1
        self.ops.append(sum(OP in str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return self.inner(gm, example_inputs)


def _train(model: nn.Module, run, inputs, steps_lr: float = 0.1) -> list[float]:
    """SGD steps, one per input; the losses."""
    losses = []
    opt = torch.optim.SGD(model.parameters(), lr=steps_lr)
    for x in inputs:
        opt.zero_grad()
        loss = run(x)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_same_params(a: nn.Module, b: nn.Module, tol: float = 1e-6) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=tol, atol=tol, msg=name)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("style, backend", [(s, "aot_eager") for s in STYLES]
                         + [("act_fn", "inductor"), ("gpt2-conv1d", "inductor")])
def test_fast_form_compiles_fullgraph_and_trains_like_eager(style, backend):
    """Every recognized style, ``fullgraph=True``: the graph holds one tiled operator per call, and three SGD
    steps at changing lengths (dynamic shapes after the first) give the eager tiled model's parameters."""
    torch.manual_seed(0)
    eager = tiledmlp.enable_tiling(STYLES[style][0](), num_shards=3)
    compiled_model = copy.deepcopy(eager)
    counter = Counter(backend)
    compiled = torch.compile(compiled_model, backend=counter, fullgraph=True)
    xs = [torch.randn(2, t, H, generator=torch.Generator().manual_seed(t)) for t in (23, 17, 31)]
    losses = [_train(m, lambda x, m=m: m(x).square().mean(), xs) for m in (eager, compiled)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    _assert_same_params(eager, compiled_model)
    assert counter.ops and all(n == 1 for n in counter.ops)


def test_hf_layers_compile_fullgraph_without_recompiles_per_layer():
    """A 6-layer HF Llama compiled per decoder layer (torchtitan's way) with ``fullgraph=True``: as many
    compiled frames as untiled (the layers share graphs: nothing is guarded per layer), and training equals
    the eager tiled model."""
    counts = {}
    params = {}
    for tiled in (False, True):
        model = build("llama", num_hidden_layers=6, use_cache=False)
        if tiled:
            tiledmlp.enable_tiling(model, num_shards=3)
            eager = copy.deepcopy(model)
        torch._dynamo.reset()
        counter = Counter()
        for layer in model.model.layers:
            layer.compile(backend=counter, fullgraph=True)
        ids = [batch(t=t, seed=t) for t in (41, 29, 53)]
        _train(model, lambda i, m=model: m(input_ids=i, labels=i).loss, ids)
        counts[tiled] = counter.frames
        params[tiled] = model
        if tiled:
            assert all(n == 1 for n in counter.ops)
            _train(eager, lambda i: eager(input_ids=i, labels=i).loss, ids)
            _assert_same_params(eager, model)
    assert counts[True] == counts[False]


@pytest.mark.parametrize("loss", [False, True])
def test_whole_model_has_no_more_graph_breaks_than_untiled(loss, caplog):
    """Whole-model compile: no graph break added. A tiled loss inside the compiled region runs untiled (its
    placeholder cannot be traced), exactly, and says so once."""
    untiled = build("llama", use_cache=False)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(untiled), num_shards=3, loss=loss)
    ids = batch()
    breaks = [torch._dynamo.explain(m)(input_ids=ids, labels=ids).graph_break_count for m in (untiled, tiled)]
    assert breaks[1] == breaks[0]
    torch._dynamo.reset()
    tiledmlp.core.logs._SAID.clear()
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        losses = [torch.compile(m, backend="aot_eager")(input_ids=ids, labels=ids).loss for m in (untiled, tiled)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    assert ("the tiled loss runs untiled" in caplog.text) == loss
    assert {i.form: i.under_compile.split(" ")[0] for i in tiledmlp.describe(tiled).values()} == \
        {"glu": "operator", **({"loss": "untiled"} if loss else {})}
    if loss:  # what the compiled call did, in the head's row and the summary line
        assert tiledmlp.describe(tiled)["lm_head"].fallback == COMPILED_HEAD
        assert f"loss tiled at lm_head (untiled: {COMPILED_HEAD})" in tiledmlp.describe(tiled).summary()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_experts_compile_fullgraph(family):
    """The MoE form's experts call (hidden states plus routing as token inputs) is one operator too; the
    routing weights' gradient reaches the router."""
    eager = tiledmlp.enable_tiling(build(family, use_cache=False), num_shards=3)
    model = copy.deepcopy(eager)
    counter = Counter()
    for layer in model.model.layers:
        layer.compile(backend=counter, fullgraph=True)
    ids = [batch(t=t, seed=t) for t in (41, 29)]
    for m in (eager, model):
        _train(m, lambda i, m=m: m(input_ids=i, labels=i).loss, ids)
    _assert_same_params(eager, model, tol=1e-5)
    assert all(n == 1 for n in counter.ops)


def test_checkpointed_layers_compile_fullgraph():
    """Non-reentrant checkpointing, then compile per layer: the operator is recomputed like any op."""
    model = build("llama", use_cache=False)
    enable_checkpointing(model)
    model.train()
    eager = tiledmlp.enable_tiling(model, num_shards=3)
    compiled = copy.deepcopy(eager)
    for layer in compiled.model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    ids = [batch(t=t, seed=t) for t in (41, 29)]
    for m in (eager, compiled):
        _train(m, lambda i, m=m: m(input_ids=i, labels=i).loss, ids)
    _assert_same_params(eager, compiled)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_autocast_is_passed_into_the_operator(backend):
    """Under CPU autocast the operator computes in bf16 as the eager tiled call does (inductor runs the
    operator outside the autocast region it was traced in: the dtype travels as an argument)."""
    eager = tiledmlp.enable_tiling(llama_mlp(), num_shards=3)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(2, 23, H)
    outs = []
    for m in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        y.float().square().mean().backward()
        outs.append(y)
    assert outs[1].dtype == outs[0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_decode_compiles_the_untiled_forward():
    """Under no_grad, a call that fits one shard is the module's own forward in the graph, not the operator."""
    model = tiledmlp.enable_tiling(llama_mlp())
    counter = Counter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        compiled(torch.randn(1, 1, H))
        compiled(torch.randn(1, 5000, H))  # more than one shard: tiled inference, the operator
    assert counter.ops == [0, 1]


class SquareMLP(nn.Module):
    """A per-token module with no Linear-like children (tiled through ``mlp_types``): the generic form, whose
    output the graph cannot size before it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, H) / H**0.5)

    def forward(self, x):
        return (x @ self.w).square()


def test_a_generic_module_the_graph_cannot_size_keeps_the_eager_call_and_says_so(caplog):
    """A generic module without Linear-like children mapping its width back: the graph cannot size its output,
    so it runs the eager tiled call from compiled code — a graph break, exact — with one warning naming why."""
    torch.manual_seed(0)
    ref = SquareMLP()
    model = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3, mlp_types=(SquareMLP,))
    x = torch.randn(2, 23, H, requires_grad=True)
    tiledmlp.core.logs._SAID.clear()
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        got = torch.compile(model, backend="aot_eager")(x)
    torch.testing.assert_close(got, ref(x), rtol=1e-6, atol=1e-6)
    assert "graph break" in caplog.text and "output cannot be sized" in caplog.text
    assert tiledmlp.describe(model)[""].under_compile.startswith("eager call")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="disable|graph break|Unsupported"):
        torch.compile(model, backend="aot_eager", fullgraph=True)(x)


@pytest.mark.parametrize("form", ["generic", "auto"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_generic_form_is_an_operator_too(form, backend, caplog):
    """The generic form — forced, or taken by a fast-form module because a child carries a hook (the fast form
    would skip it) — is one operator: the module's own forward runs per shard inside it, hooks and all, and its
    backward differentiates that forward per shard."""
    seen = []
    ref = llama_mlp()
    model = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3, form=form)
    for m in (ref, model):
        m.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    counter = Counter(backend)
    x = torch.randn(2, 23, H)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    tiledmlp.core.logs._SAID.clear()
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        outs = [ref(xs[0]), torch.compile(model, backend=counter, fullgraph=True)(xs[1])]
    for out in outs:
        out.square().sum().backward()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert counter.ops == [1] and len(seen) == 1 + 3 + 3  # reference; three shards forward, three recomputed
    assert ("take the generic form" in caplog.text) == (form == "auto")


@pytest.mark.parametrize("form", ["auto", "generic"])
def test_peft_lora_layers_compile_fullgraph(form):
    """A PEFT-LoRA model (its MLPs take the fast GLU form with their adapters, or the generic form that runs
    peft's forward) compiled per decoder layer with fullgraph=True trains like the eager tiled model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    eager = get_peft_model(build("llama", use_cache=False),
                           LoraConfig(r=4, lora_dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():  # peft starts lora_B at zero: make the adapters' terms count
        for name, p in eager.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    tiledmlp.enable_tiling(eager, num_shards=3, form=form)
    assert {i.form for i in tiledmlp.describe(eager).values()} == {"glu" if form == "auto" else "generic", "loss"}
    model = copy.deepcopy(eager)
    counter = Counter()
    for layer in model.base_model.model.model.layers:
        layer.compile(backend=counter, fullgraph=True)
    ids = [batch(t=t, seed=t) for t in (41, 29)]
    for m in (eager, model):
        _train(m, lambda i, m=m: m(input_ids=i, labels=i).loss, ids)
    _assert_same_params(eager, model)
    assert counter.ops and all(n == 1 for n in counter.ops)
    assert {i.under_compile for i in tiledmlp.describe(model).values() if i.form != "loss"} == {"operator"}


class DropoutMLP(nn.Module):
    """fc2(relu(fc1(x)) * mask) with a random mask it records: the generic form (dropout is stochastic)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.masks: list[torch.Tensor] = []

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        mask = (torch.rand_like(h) > 0.3).to(h.dtype)
        self.masks.append(mask)
        return self.fc2(h * mask)


def test_generic_operator_recomputes_with_the_forward_random_draws():
    """Random draws inside the generic form: the backward operator recomputes each shard with the draws of its
    forward (a seed drawn in the graph is an input of both), so the gradients are those of the forward's
    masks (checked against an untiled computation with the recorded masks)."""
    torch.manual_seed(0)
    model = tiledmlp.enable_tiling(DropoutMLP(), num_shards=3, mlp_types=(DropoutMLP,))
    assert tiledmlp.describe(model)[""].form == "generic"
    model.masks.clear()  # the probe's (enable_tiling checks that a registered module is per-token)
    x = torch.randn(2, 24, H, requires_grad=True)
    y = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    y.square().sum().backward()
    forward_masks, recomputed = model.masks[:3], model.masks[3:]
    assert len(recomputed) == 3 and all(torch.equal(a, b) for a, b in zip(forward_masks, recomputed))
    ref = copy.deepcopy(model)
    tiledmlp.disable_tiling(ref)
    ref.zero_grad()
    xr = x.detach().clone().requires_grad_()
    mask = torch.cat([m.reshape(-1, 2 * H) for m in forward_masks]).view(2, 24, 2 * H)
    yr = ref.fc2(torch.relu(ref.fc1(xr)) * mask)
    yr.square().sum().backward()
    torch.testing.assert_close(y, yr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_copies_compile_against_their_own_modules():
    """The operator's key names the module it belongs to: a deep copy or a pickle round trip of a tiled
    model computes with its own weights, compiled."""
    original = tiledmlp.enable_tiling(llama_mlp(), num_shards=3)
    for copied in (copy.deepcopy(original), pickle.loads(pickle.dumps(original))):
        assert copied.__dict__[STATE_ATTR].key._tiledmlp_module is copied
        with torch.no_grad():
            copied.down_proj.weight.mul_(2)
        x = torch.randn(2, 23, H)
        torch._dynamo.reset()
        y = torch.compile(copied, backend="aot_eager", fullgraph=True)(x)
        torch.testing.assert_close(y, tiledmlp.disable_tiling(copy.deepcopy(copied))(x))
