"""Recognize MLP blocks by what they compute, not by what their attributes are called.

Design note — the probe
-----------------------
A module is a candidate when two to four of its direct children are Linear-like (``nn.Linear``,
Hugging Face ``Conv1D``, a peft LoRA-wrapped linear) and two of them chain ``hidden -> inter ->
hidden`` (``inter`` or ``2 * inter`` for a fused gate/up projection). The names do not matter.
For a candidate, the probe runs the module's own forward on a few random tokens, with random weights of
its projections' shapes (so that what it finds does not depend on how the weights were initialized: a
zero-initialized projection matches every candidate), and compares it with every fast form its children
allow:

* three projections: ``down(act(gate(x)) * up(x))`` for both gate/up assignments;
* two projections: ``down(act(up(x)))``, and ``down(act(u[:I]) * u[I:])`` for ``u = up(x)`` of
  twice the down projection's input width (fused gate/up);

each with SiLU, GELU (exact and tanh), ReLU and squared ReLU. The probe computes in float32 with
full-precision matmuls (float32 copies of 16-bit weights, for the probe only), on inputs scaled
so the pre-activations span the range where the activations differ (GELU and its tanh
approximation differ by ~1e-4 relative there, float32 rounding ~1e-7). Exactly one candidate
must match within ``PROBE_RTOL``; none or several means generic. The probe also checks that the
forward is per-token (two halves of the probe tokens computed apart give the whole, which is what
tiling relies on; attention fails it) and that training mode computes the same thing (no
dropout): a module that mixes tokens is never tiled, one that differs in training mode gets the
generic form, which replays it exactly.

Sharded parameters — FSDP2's or a tensor-parallel plan's DTensors — are gathered for the probe
(``full_tensor()``: one all-gather per parameter, at enable time, in the same order on every rank,
as ``enable_tiling`` runs on all of them). The children's hooks are suspended while it runs (the
probe's tokens are not the user's data; ``parallelize_module``'s would redistribute), so it sees what
the module computes on one device; a module whose children carry hooks of their own then takes the
generic form, which calls them (``tiledmlp.hooks``).

A peft LoRA-wrapped projection in its plain state (one active adapter, unmerged, no adapter dropout:
``tiledmlp.lora``) is a projection with an adapter; the probe then computes with random adapter
weights (peft initializes ``B`` to zero, which would hide the adapter's term), so the match checks
the adapter's computation and scale as well.

What the fast forms do not compute makes a candidate generic, with the reason in
``Recognized.reason``: parameters or buffers outside the projections (a learned scale), a LoRA
layer in another state (adapter dropout, merged, several adapters, DoRA), dropout, a forward that
matches no candidate (a residual inside, a squared output, a third gating input). The probe cannot
run on meta tensors, FSDP1's flat-parameter views or shards, or FSDP2 units inside the module; there
a module named like a Hugging Face GLU (``gate_proj``/``up_proj``/``down_proj`` or
``gate_up_proj``/``down_proj``, activation in ``act_fn``/``activation_fn``) gets the GLU form on its
structure alone, as before the probe existed, and other MLP-named modules the generic form.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .distributed.deepspeed import gathered
from .distributed.detect import fsdp2_units_below, is_dtensor
from .hooks import hooked_children, silenced_hooks
from .forms import Slot, is_plain_linear, swapped
from .lora import Adapter, LowRank, is_peft_lora, lora_adapter
from .mlp_form import MLPForm, MLPLayout, Proj
from .quant import QuantizedLinear, dequantizable, dequantize, quant_state_of, quantized_linear
from .runtime import dedupe

__all__ = ["Recognized", "LinearLike", "hidden_sizes", "linear_like", "recognize_mlp", "activation_name",
           "PROBE_RTOL", "PROBE_ACTIVATIONS", "MLP_NAMES"]

PROBE_RTOL = 1e-5  # largest relative max-error of a matching candidate (float32, full-precision matmuls)
PROBE_TOKENS = 16
PROBE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")
_PRE_ACTIVATION_STD = 2.0  # the probe's pre-activations: where GELU and its tanh form differ most
#: child-name sets that mark a module as an MLP where the probe cannot run (sharded parameters); the
#: first two (Hugging Face GLUs) also where the projections are not Linear-like (quantized layers)
MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj"), ("up_proj", "down_proj"),
             ("w1", "w2", "w3"), ("fc1", "fc2"), ("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"),
             ("wi", "wo"), ("fc_in", "fc_out"), ("linear_fc1", "linear_fc2"))
_ACT_ATTRS = ("act_fn", "activation_fn", "act", "activation")


@dataclass
class Recognized:
    """What tiling a module means: its form, its parameter slots and, for a fast form, its layout
    (over slot indices). ``reason``: why a module that looks like an MLP got the generic form;
    ``warn``: whether that deserves a warning (not for a generic form the user asked for)."""

    kind: str  # "glu", "mlp", "moe" (fast forms), "generic", "norm" (the generic form, ``tiledmlp.norms``)
    slots: tuple[Slot, ...]
    layout: Optional[Any] = None  # an MLPLayout, or an ExpertsLayout for "moe"
    reason: str = ""
    warn: bool = False
    computes: str = ""  # what the fast form computes, in the children's names
    moe_block: bool = False  # a whole MoE block on the generic form (its router runs per shard)
    adapters: tuple[Adapter, ...] = ()  # the fast form's LoRA adapters, whose state each call checks
    quantized: tuple[tuple[int, QuantizedLinear], ...] = ()  # the fast form's 4-bit weights: (slot index, layer)


@dataclass(frozen=True)
class LinearLike:
    """A child that computes ``x @ W.T + b``: its name, dimensions, and where its weight and bias
    live. ``transposed``: the weight is stored ``[in, out]`` (``Conv1D``); ``adapter``: a peft LoRA
    adapter the fast forms compute; ``wrapper``: what wraps the base linear that they do not (a LoRA
    layer in another state, and why); ``quant``: the weight is 4-bit (bitsandbytes ``Linear4bit``)."""

    name: str
    in_features: int
    out_features: int
    weight: Slot
    bias: Optional[Slot]
    transposed: bool = False
    adapter: Optional[Adapter] = None
    wrapper: str = ""
    quant: Optional[QuantizedLinear] = None  # a 4-bit base weight (``tiledmlp.quant``), dequantized per call


def _is_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2 family): ``addmm(bias, x, weight)`` with weight ``[in, out]``."""
    cls = type(m)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and hasattr(m, "nf")


def linear_like(name: str, m: nn.Module) -> Optional[LinearLike]:
    """``m`` as a :class:`LinearLike`, or None."""
    quant = quantized_linear(m)  # a 4-bit Linear4bit: plain but for its packed weight
    if is_plain_linear(m) or quant is not None:
        bias = Slot(m, "bias") if m.bias is not None else None
        return LinearLike(name, m.in_features, m.out_features, Slot(m, "weight"), bias, quant=quant)
    if _is_conv1d(m):
        weight = m.__dict__.get("_parameters", {}).get("weight")
        n_in = getattr(m, "nx", None) or (weight.shape[0] if weight is not None and weight.dim() == 2 else None)
        if n_in is None:
            return None
        bias = Slot(m, "bias") if getattr(m, "bias", None) is not None else None
        return LinearLike(name, n_in, m.nf, Slot(m, "weight"), bias, transposed=True)
    if is_peft_lora(m):
        inner = linear_like(name, m.base_layer)
        if inner is not None and inner.adapter is None and not inner.wrapper:
            adapter = lora_adapter(m)
            if isinstance(adapter, str):
                return replace(inner, wrapper=f"LoRA adapters (peft): {adapter}")
            return replace(inner, adapter=replace(adapter, child=name))
    return None


def activation_name(act: Any) -> Optional[str]:
    """The fused-kernel name of an activation module/function, or None if it is not one we fuse.

    Used only where the probe cannot run (sharded parameters); the probe identifies activations by
    computation. Hugging Face's ``NewGELUActivation`` writes the tanh approximation out by hand and
    matches ``gelu_tanh`` to rounding.
    """
    if act is F.silu or isinstance(act, nn.SiLU):
        return "silu"
    if act is F.gelu:
        return "gelu"
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if isinstance(act, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    return {
        "SiLUActivation": "silu",
        "GELUActivation": "gelu",
        "GELUTanh": "gelu_tanh",
        "PytorchGELUTanh": "gelu_tanh",
        "NewGELUActivation": "gelu_tanh",
        "FastGELUActivation": "gelu_tanh",
        "ReLUSquaredActivation": "relu2",
    }.get(type(act).__name__)


# ----------------------------------------------------------------------------------------------
# Candidate layouts


def _index(slot: Slot, where: dict[tuple[int, str], int]) -> int:
    return where[(id(slot.owner), slot.name)]


def _proj(lin: LinearLike, where: dict[tuple[int, str], int]) -> Proj:
    bias = None if lin.bias is None else _index(lin.bias, where)
    adapter = lin.adapter and LowRank(_index(lin.adapter.a, where), _index(lin.adapter.b, where), lin.adapter.scale)
    return Proj(_index(lin.weight, where), bias, lin.transposed, adapter)


def _candidates(linears: Sequence[LinearLike], where: dict[tuple[int, str], int],
                hidden: int) -> list[tuple[str, MLPLayout]]:
    """``(description, layout without activation)`` for every fast form over ``hidden``-wide inputs
    that the children's shapes allow. The activation field holds a placeholder; the probe tries each."""
    out: list[tuple[str, MLPLayout]] = []
    for down in (lin for lin in linears if lin.out_features == hidden):
        others = [lin for lin in linears if lin is not down]
        inter = down.in_features
        ins = [lin for lin in others if lin.in_features == hidden]
        if len(others) == 2 and len(ins) == 2 and all(lin.out_features == inter for lin in ins):
            for gate, up in itertools.permutations(ins):
                out.append((f"{down.name}(act({gate.name}(x)) * {up.name}(x))",
                            MLPLayout("", _proj(up, where), _proj(down, where), gate=_proj(gate, where))))
        elif len(others) == 1 and len(ins) == 1:
            (up,) = ins
            if up.out_features == inter:
                out.append((f"{down.name}(act({up.name}(x)))", MLPLayout("", _proj(up, where), _proj(down, where))))
            elif up.out_features == 2 * inter:
                out.append((f"{down.name}(act(gate) * up) with [gate; up] = {up.name}(x)",
                            MLPLayout("", _proj(up, where), _proj(down, where), fused=True)))
    return out


def hidden_sizes(linears: Sequence[LinearLike]) -> list[int]:
    """Hidden sizes for which two children chain ``hidden -> inter -> hidden`` (``inter`` or ``2 * inter``
    wide). Two for a plain ``H -> I -> H`` MLP read either way round: the probe tries both."""
    return list(dict.fromkeys(b.out_features for a in linears for b in linears
                              if a is not b and b.out_features == a.in_features
                              and a.out_features in (b.in_features, 2 * b.in_features)))


# ----------------------------------------------------------------------------------------------
# The probe


@contextlib.contextmanager
def _mode(module: nn.Module, training: bool) -> Iterator[None]:
    """Every submodule's ``training`` flag set (not through ``train()``, which a module may
    override), restored on exit."""
    saved = [(m, m.training) for m in module.modules()]
    try:
        for m, _ in saved:
            m.training = training
        yield
    finally:
        for m, flag in saved:
            m.training = flag


@contextlib.contextmanager
def _exact_float32() -> Iterator[None]:
    """Full-precision float32 matmuls (no TF32), restored on exit."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def _rel_max_err(got: Any, ref: torch.Tensor) -> float:
    """Largest error relative to ``ref``'s largest magnitude; infinite for anything but a tensor of ``ref``'s
    shape (a forward that returned something else)."""
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape:
        return float("inf")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class _Probe:
    """The module's forward on probe tokens, with float32 copies of its parameters swapped in (made
    once, whatever input widths are tried); ``projections``: the Linear-like children, whose copies are random
    instead (see :meth:`_randomize_projection`). A 4-bit child (``tiledmlp.quant``) is replaced by a plain linear
    of its shape, computing with such a copy, while the forward runs: its packed weight cannot be swapped."""

    def __init__(self, forward: Callable[..., Any], module: nn.Module, slots: Sequence[Slot],
                 adapters: Sequence[LowRank] = (), weights: Sequence[int] = (),
                 projections: Sequence[tuple[LinearLike, int, Optional[int]]] = ()) -> None:
        self.forward, self.module, self.slots = forward, module, slots
        full = [p.detach().full_tensor() if is_dtensor(p) else p.detach() for p in (s.get() for s in slots)]
        self.proxies = [p.float() if p.dtype in (torch.bfloat16, torch.float16) else p for p in full]
        gen = torch.Generator(device=self.proxies[0].device if self.proxies else "cpu").manual_seed(2)
        for lin, weight, bias in projections:
            self._randomize_projection(lin, weight, bias, gen)
        for adapter, weight in zip(adapters, weights):
            self._randomize(adapter, weight)
        self._unique, self._index = dedupe(self.proxies)
        self.stand_ins = {lin.weight.owner: _StandIn(self.proxies[weight], None if bias is None else self.proxies[bias])
                          for lin, weight, bias in projections if lin.quant is not None}
        self.x = torch.empty(0)
        self.hidden = 0

    def _randomize_projection(self, lin: LinearLike, weight: int, bias: Optional[int], gen: torch.Generator) -> None:
        """Random weights (and bias) of the projection's shapes: the probe identifies what the forward computes,
        whatever the values are. With the real ones, a zero-initialized ``down_proj`` (weights not loaded yet)
        makes every candidate match, and a zero bias hides whether the forward adds it."""
        shape = (lin.in_features, lin.out_features) if lin.transposed else (lin.out_features, lin.in_features)
        for index, size, scale in ((weight, shape, lin.in_features ** -0.5), (bias, (lin.out_features,), 1.0)):
            if index is not None:
                t = self.proxies[index]
                dtype = t.dtype if t.is_floating_point() and lin.quant is None else torch.float32
                self.proxies[index] = torch.randn(size, generator=gen, device=t.device, dtype=dtype) * scale

    def _randomize(self, adapter: LowRank, weight: int) -> None:
        """Random ``A`` and ``B`` for a LoRA adapter (on the base weight at ``weight``), scaled so its term is
        as large as the base projection's: peft's zero-initialized ``B`` would hide what the adapter computes."""
        a, b = self.proxies[adapter.a], self.proxies[adapter.b]
        gen = torch.Generator(device=a.device).manual_seed(1)
        w_std = float(self.proxies[weight].std().clamp_min(1e-6))
        b_std = 1.0 / (max(abs(adapter.scale), 1e-6) * b.shape[1] ** 0.5)
        self.proxies[adapter.a] = torch.randn(a.shape, generator=gen, device=a.device, dtype=a.dtype) * w_std
        self.proxies[adapter.b] = torch.randn(b.shape, generator=gen, device=b.device, dtype=b.dtype) * b_std

    def tokens(self, hidden: int, reader: LinearLike, where: dict[tuple[int, str], int]) -> None:
        """Draw ``hidden``-wide probe tokens, scaled so ``reader`` (a child reading the input) gives
        pre-activations of standard deviation ``_PRE_ACTIVATION_STD``."""
        w = self.proxies[where[(id(reader.weight.owner), reader.weight.name)]]
        dtype = w.dtype if w.dtype in (torch.float32, torch.float64) else torch.float32
        gen = torch.Generator(device=w.device).manual_seed(0)
        x = torch.randn(1, PROBE_TOKENS, hidden, generator=gen, device=w.device, dtype=dtype)
        pre = x @ (w if reader.transposed else w.t())
        self.x = x * (_PRE_ACTIVATION_STD / pre.std().clamp_min(1e-12))
        self.hidden = hidden

    def given(self, x: torch.Tensor) -> None:
        """Use ``x`` (``[1, tokens, hidden]``) as the probe tokens."""
        self.x, self.hidden = x, x.shape[-1]

    def reference(self) -> Optional[torch.Tensor]:
        """The forward on the probe tokens, or None if it is not a per-token map from hidden states to
        hidden states: tiling computes token shards independently, so two halves of the tokens
        computed apart must give the whole. Raises what the forward raises."""
        half = PROBE_TOKENS // 2
        ref = self.run(self.x, training=False)
        parts = [self.run(self.x[:, :half], training=False), self.run(self.x[:, half:], training=False)]
        if (isinstance(ref, torch.Tensor) and ref.shape == self.x.shape and all(isinstance(p, torch.Tensor) for p in parts)
                and _rel_max_err(torch.cat(parts, dim=1), ref) <= PROBE_RTOL):
            return ref
        return None

    def run(self, *inputs: torch.Tensor, training: bool) -> Any:
        """The forward on ``inputs`` (the probe tokens, and for MoE experts their routing)."""
        with (torch.no_grad(), _exact_float32(), _mode(self.module, training), swapped(self.slots, self.proxies),
              silenced_hooks(self.module), _standing_in(self.module, self.stand_ins)):
            return self.forward(*inputs)

    def candidate(self, layout: MLPLayout) -> torch.Tensor:
        with torch.no_grad(), _exact_float32():
            return MLPForm(layout.remap(self._index)).forward_shard(self.x[0], self._unique)[0]


class _StandIn(nn.Module):
    """A plain linear computing with a probe's copy of a 4-bit child's weight, in that child's place."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


@contextlib.contextmanager
def _standing_in(module: nn.Module, stand_ins: dict[nn.Module, nn.Module]) -> Iterator[None]:
    """Each key of ``stand_ins`` (a child somewhere below ``module``) replaced by its value, restored on exit."""
    places = [(parent, name, child) for parent in module.modules() for name, child in parent._modules.items()
              if child in stand_ins]
    try:
        for parent, name, child in places:
            parent._modules[name] = stand_ins[child]
        yield
    finally:
        for parent, name, child in places:
            parent._modules[name] = child


def _dequantized_linear_problem(lin: LinearLike) -> str:
    """What a 4-bit child's GEMM computes, checked once on random float32 tokens: bitsandbytes' ``matmul_4bit``
    (what ``Linear4bit.forward``, its class's own, calls) against ``F.linear`` with the weight dequantized. The
    weight is read whole (an FSDP2 shard gathered; ZeRO-3 gathered it for the probe). "" if it matches, else
    what differs."""
    import bitsandbytes as bnb

    m = lin.weight.owner
    problem = dequantizable(m)
    if problem:
        return f"cannot be dequantized: {problem}"
    state = quant_state_of(m)
    packed = m.weight.detach()
    packed = packed.full_tensor() if is_dtensor(packed) else packed
    device = state.absmax.device
    tokens = torch.randn(PROBE_TOKENS, lin.in_features, device=device,
                         generator=torch.Generator(device=device).manual_seed(3))
    bias = None if getattr(m, "bias", None) is None else m.bias.detach().float()
    bias = bias.full_tensor() if bias is not None and is_dtensor(bias) else bias
    with torch.no_grad(), _exact_float32():
        got = bnb.matmul_4bit(tokens, packed, quant_state=state, bias=bias)
        want = F.linear(tokens, dequantize(packed, state, torch.float32), bias)
    err = _rel_max_err(got, want)
    if err > PROBE_RTOL:
        return f"does not compute F.linear with its dequantized weight here (max relative error {err:.1e})"
    return ""


def _probe_unavailable(module: nn.Module, params: Sequence[torch.Tensor], linears: Sequence[LinearLike]) -> str:
    """Why the probe cannot compute with these parameters outside the wrapper's forward ("" if it can)."""
    if any(p.device.type == "meta" for p in params):
        return "its parameters are on the meta device"
    if any(is_dtensor(p) for p in params) and fsdp2_units_below(module):
        return "FSDP2 units inside it own its parameters"
    if any(not isinstance(p, nn.Parameter) for p in params):
        return "its parameters are views of an FSDP1 flat parameter"
    for lin in linears:
        shape = (lin.in_features, lin.out_features) if lin.transposed else (lin.out_features, lin.in_features)
        if lin.quant is None and tuple(lin.weight.get().shape) != shape:
            return "its parameters are shards (FSDP1 with use_orig_params=True)"
    return ""


def _structural_glu(module: nn.Module, where: dict[tuple[int, str], int]) -> Optional[MLPLayout]:
    """A Hugging Face-named GLU with a known activation attribute, on structure alone (no probe)."""
    act = next((getattr(module, a) for a in _ACT_ATTRS if hasattr(module, a)), None)
    activation = activation_name(act)
    if activation is None:
        return None
    fused = hasattr(module, "gate_up_proj")
    names = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    children = [getattr(module, n, None) for n in names]
    if not all(is_plain_linear(c) for c in children):
        return None
    lins = [linear_like(n, c) for n, c in zip(names, children)]
    if any((id(lin.weight.owner), "weight") not in where for lin in lins):
        return None
    if fused:
        return MLPLayout(activation, _proj(lins[0], where), _proj(lins[1], where), fused=True)
    return MLPLayout(activation, _proj(lins[1], where), _proj(lins[2], where), gate=_proj(lins[0], where))


def _hooks_reason(hooked: Sequence[str]) -> str:
    return (f"hooks are registered on {', '.join(hooked)}; the fast forms do not call the children, so they would "
            "skip them. The generic form calls them (per shard)")


def _named_mlp(children: dict[str, nn.Module]) -> bool:
    return any(all(n in children for n in names) for names in MLP_NAMES)


def _outside_projections(module: nn.Module, linears: Sequence[LinearLike]) -> list[str]:
    """Parameters and buffers of ``module`` that no projection's weight, bias or adapter is (a LoRA layer's
    inactive adapters count as its own: its forward does not use them, and each call checks that it still does not)."""
    inside = {(id(s.owner), s.name) for lin in linears for s in (lin.weight, lin.bias) if s is not None}
    inside |= {(id(m), pn) for lin in linears if lin.adapter
               for m in lin.adapter.layer.modules() for pn in m._parameters}
    params = [f"{mn}.{pn}".lstrip(".") for mn, m in module.named_modules() for pn, p in m._parameters.items()
              if p is not None and (id(m), pn) not in inside]
    return params + [n for n, _ in module.named_buffers()]


def _dropouts(module: nn.Module) -> list[str]:
    return [f"{n}: p={m.p}" for n, m in module.named_modules()
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]


def recognize_mlp(module: nn.Module, forward: Callable[..., Any], slots: Sequence[Slot],
                  fast: bool = True) -> Optional[Recognized]:
    """Recognize ``module`` as an MLP by computation (see the design note), or None if it does not
    look like one. ``forward``: its original forward; ``fast=False``: the generic form was asked for."""
    children = dict(module.named_children())
    linears = [lin for lin in (linear_like(n, c) for n, c in children.items()) if lin is not None]
    hiddens = hidden_sizes(linears) if 2 <= len(linears) <= 4 else []
    named = _named_mlp(children)
    if not hiddens:
        hf_glu = any(all(isinstance(children.get(n), nn.Module) for n in names) for names in MLP_NAMES[:2])
        if not hf_glu:
            return None
        # Named like a Hugging Face GLU, but its projections are not Linear-like (quantized layers, a
        # custom Linear subclass): tiled by its names, as always, with its own forward.
        kinds = sorted({type(c).__name__ for n, c in children.items() if n.endswith("proj")})
        return Recognized("generic", tuple(slots), warn=fast, reason=(
            f"its projections ({', '.join(kinds)}) are not Linear-like; the fast forms compute nn.Linear, "
            "transformers' Conv1D and LoRA-wrapped linears") if fast else "form='generic' was asked for")
    where = {(id(s.owner), s.name): i for i, s in enumerate(slots)}
    if named and not fast:  # the generic form asked for: the names suffice, no need to run the forward
        return Recognized("generic", tuple(slots), reason="form='generic' was asked for")
    # ZeRO-3: whole parameters while the probe runs (a collective: every rank enables tiling, in order)
    with gathered([s.get() for s in slots]):
        return _recognize_by_probe(module, forward, slots, linears, hiddens, named, where, fast)


def _recognize_by_probe(module: nn.Module, forward: Callable[..., Any], slots: Sequence[Slot],
                        linears: Sequence[LinearLike], hiddens: Sequence[int], named: bool,
                        where: dict[tuple[int, str], int], fast: bool) -> Optional[Recognized]:
    """The part of :func:`recognize_mlp` that reads the parameters: the probe, or the structure when the
    probe cannot run."""
    params = [s.get() for s in slots]
    unavailable = _probe_unavailable(module, params, linears) if params else "it has no parameters"
    hooked = hooked_children(module)
    if unavailable:
        if not named:
            return None  # not provably an MLP (nor per-token) without the probe
        layout = _structural_glu(module, where)
        if layout is not None and hooked:
            return Recognized("generic", tuple(slots), reason=_hooks_reason(hooked), warn=True)
        if layout is not None:
            return Recognized(layout.form, tuple(slots), layout,
                              computes=f"Hugging Face GLU ({layout.activation}), by structure: the probe could not run "
                                       f"({unavailable})")
        return Recognized("generic", tuple(slots), reason=f"the probe could not run ({unavailable}); enable tiling "
                          "before sharding the model to let it identify the fast form", warn=True)
    failure: Optional[Exception] = None
    adapted = [lin for lin in linears if lin.adapter is not None]
    projections = [(lin, _index(lin.weight, where), None if lin.bias is None else _index(lin.bias, where))
                   for lin in linears]
    probe = _Probe(forward, module, slots, [_proj(lin, where).adapter for lin in adapted],
                   [_index(lin.weight, where) for lin in adapted], projections)
    for hidden in hiddens:  # the input width the forward accepts
        probe.tokens(hidden, next(lin for lin in linears if lin.in_features == hidden), where)
        try:
            ref = probe.reference()
        except Exception as exc:  # the other width, or a forward that needs more than hidden states
            failure = exc
            continue
        if ref is None:
            return None  # mixes tokens (or returns something else): never tiled on a guess
        break
    else:
        return None if not named else Recognized(
            "generic", tuple(slots), reason=f"its forward failed on probe tokens ({type(failure).__name__}: "
                                            f"{failure})", warn=True)

    def generic(reason: str, warn: bool = True) -> Recognized:
        return Recognized("generic", tuple(slots), reason=reason, warn=warn)

    if not fast:
        return generic("form='generic' was asked for", warn=False)
    if hooked:
        return generic(_hooks_reason(hooked))
    wrapped = sorted({f"{lin.name}: {lin.wrapper}" for lin in linears if lin.wrapper})
    if wrapped:
        return generic(f"its projections are wrapped ({'; '.join(wrapped)}); the fast forms compute plain "
                       "weights and plain LoRA adapters only, the generic form runs the wrapper's own forward")
    outside = _outside_projections(module, linears)
    if outside:
        return generic(f"it has parameters or buffers outside its projections ({', '.join(outside[:4])}), which "
                       "the fast forms do not compute with")
    for lin in (lin for lin in linears if lin.quant is not None):
        problem = _dequantized_linear_problem(lin)
        if problem:
            return generic(f"its 4-bit projection {lin.name} {problem}; the generic form runs bitsandbytes' forward")
    dropouts = _dropouts(module)
    if dropouts:
        return generic(f"it applies dropout ({', '.join(dropouts)}); the generic form replays it exactly. Set the "
                       "dropout probability to 0 for the fast form")
    train = [probe.run(probe.x, training=True) for _ in range(2)]
    if any(_rel_max_err(t, ref) > PROBE_RTOL for t in train):
        return generic("its forward computes differently in training mode (dropout or another stochastic or "
                       "mode-dependent step); the generic form replays it exactly")
    matches = []
    for description, shape in _candidates(linears, where, probe.hidden):
        for act in PROBE_ACTIVATIONS:
            layout = MLPLayout(act, shape.up, shape.down, shape.gate, shape.fused)
            if _rel_max_err(probe.candidate(layout), ref[0]) <= PROBE_RTOL:
                matches.append((description.replace("act(", f"{act}("), layout))
    if len(matches) == 1:
        computes = matches[0][0] + (f", with LoRA adapters on {', '.join(l.name for l in adapted)}" if adapted else "")
        quantized = [lin for lin in linears if lin.quant is not None]
        if quantized:
            kinds = sorted({lin.quant.describe() for lin in quantized})
            computes += (f", {' and '.join(kinds)} base weights of {', '.join(lin.name for lin in quantized)} "
                         "dequantized once per pass")
        return Recognized(matches[0][1].form, tuple(slots), matches[0][1], computes=computes,
                          adapters=tuple(lin.adapter for lin in adapted),
                          quantized=tuple((_index(lin.weight, where), lin.quant) for lin in quantized))
    if matches:
        return generic("the probe matched several fast forms (" + "; ".join(d for d, _ in matches) + ")")
    return generic("its forward matches no fast form: neither down(act(gate(x)) * up(x)) nor down(act(up(x))) "
                   f"with any of {', '.join(PROBE_ACTIVATIONS)} over its projections "
                   f"({', '.join(lin.name for lin in linears)}) — a residual, an extra factor or another "
                   "activation inside. The generic form computes it exactly")
