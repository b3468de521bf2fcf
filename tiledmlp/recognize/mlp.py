"""Recognize MLP blocks by what they compute, not by what their attributes are called: the candidates and their
layouts are in ``candidates.py``, the probe and [Note: the probe] in ``probe.py``; this module decides.

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

import logging
from typing import Any, Callable, Optional, Sequence

from torch import nn

from ..core.logs import warn_once
from ..distributed.deepspeed import gathered
from ..distributed.hooks import hooked_children
from ..forms.base import Slot, is_plain_linear
from ..forms.kind import Kind
from ..forms.mlp import MLPLayout
from .candidates import (ACT_ATTRS, MLP_NAMES, LinearLike, Recognized, activation_name, candidate_layouts,
                         hidden_sizes, linear_like, proj_of, registered, slot_index)
from .probe import (PROBE_ACTIVATIONS, PROBE_RTOL, Probe, dequantized_linear_problem, probe_unavailable,
                    rel_max_err)

__all__ = ["recognize_mlp"]


def _structural_glu(module: nn.Module, where: dict[tuple[int, str], int]) -> Optional[MLPLayout]:
    """A Hugging Face-named GLU with a known activation attribute, on structure alone (no probe)."""
    act = next((getattr(module, a) for a in ACT_ATTRS if hasattr(module, a)), None)
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
        return MLPLayout(activation, proj_of(lins[0], where), proj_of(lins[1], where), fused=True)
    return MLPLayout(activation, proj_of(lins[1], where), proj_of(lins[2], where), gate=proj_of(lins[0], where))


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


def _not_tiled(module: nn.Module, why: str) -> None:
    """A module whose Linear-like children chain ``hidden -> inter -> hidden`` like an MLP's but that is not tiled:
    said once per type and reason, at DEBUG (attention blocks chain their projections too)."""
    warn_once(("not tiled", type(module).__name__, why), "%s looks like an MLP (Linear-like children chaining hidden "
              "-> inter -> hidden) but is not tiled: %s", type(module).__name__, why, level=logging.DEBUG)
    return None


def recognize_mlp(module: nn.Module, forward: Callable[..., Any], slots: Sequence[Slot],
                  fast: bool = True) -> Optional[Recognized]:
    """Recognize ``module`` as an MLP by computation (see ``probe.py``, [Note: the probe]), or None if it does not
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
        return Recognized(Kind.GENERIC, tuple(slots), warn=fast, reason=(
            f"its projections ({', '.join(kinds)}) are not Linear-like; the fast forms compute nn.Linear, "
            "transformers' Conv1D and LoRA-wrapped linears") if fast else "form='generic' was asked for")
    where = {(id(s.owner), s.name): i for i, s in enumerate(slots)}
    if named and not fast:  # the generic form asked for: the names suffice, no need to run the forward
        return Recognized(Kind.GENERIC, tuple(slots), reason="form='generic' was asked for")
    # ZeRO-3: whole parameters while the probe runs (a collective: every rank enables tiling, in order)
    with gathered([s.get() for s in slots]):
        return _recognize_by_probe(module, forward, slots, linears, hiddens, named, where, fast)


def _recognize_by_probe(module: nn.Module, forward: Callable[..., Any], slots: Sequence[Slot],
                        linears: Sequence[LinearLike], hiddens: Sequence[int], named: bool,
                        where: dict[tuple[int, str], int], fast: bool) -> Optional[Recognized]:
    """The part of :func:`recognize_mlp` that reads the parameters: the probe, or the structure when the
    probe cannot run."""
    params = [s.get() for s in slots]
    unavailable = probe_unavailable(module, params, linears) if params else "it has no parameters"
    hooked = hooked_children(module)
    if unavailable:
        if not named:  # not provably an MLP (nor per-token) without the probe
            return _not_tiled(module, f"the probe could not run ({unavailable}) and its children are not named like "
                                      "a Hugging Face MLP's; enable tiling before sharding the model")
        layout = _structural_glu(module, where)
        if layout is not None and hooked:
            return Recognized(Kind.GENERIC, tuple(slots), reason=_hooks_reason(hooked), warn=True)
        if layout is not None:
            return Recognized(layout.form, tuple(slots), layout,
                              computes=f"Hugging Face GLU ({layout.activation}), by structure: the probe could not run "
                                       f"({unavailable})")
        return Recognized(Kind.GENERIC, tuple(slots), reason=f"the probe could not run ({unavailable}); enable tiling "
                          "before sharding the model to let it identify the fast form", warn=True)
    failure: Optional[Exception] = None
    adapted = [lin for lin in linears if lin.adapter is not None]
    # A projection whose weight is no parameter of the module (parametrized) keeps it: the probe's random weights
    # are swapped in through the parameters' slots
    slotted = [lin for lin in linears if registered(lin, where)]
    projections = [(lin, slot_index(lin.weight, where), None if lin.bias is None else slot_index(lin.bias, where))
                   for lin in slotted]
    probe = Probe(forward, module, slots, [proj_of(lin, where).adapter for lin in adapted],
                  [slot_index(lin.weight, where) for lin in adapted], projections)
    for hidden in hiddens:  # the input width the forward accepts
        probe.tokens(hidden, next((lin for lin in slotted if lin.in_features == hidden), None), where)
        try:
            ref = probe.reference()
        except Exception as exc:  # the other width, or a forward that needs more than hidden states
            failure = exc
            continue
        if ref is None:  # never tiled on a guess
            return _not_tiled(module, "its forward mixes tokens or does not map hidden states to hidden states")
        break
    else:
        why = f"its forward failed on probe tokens ({type(failure).__name__}: {failure})"
        return Recognized(Kind.GENERIC, tuple(slots), reason=why, warn=True) if named else _not_tiled(module, why)

    def generic(reason: str, warn: bool = True) -> Recognized:
        return Recognized(Kind.GENERIC, tuple(slots), reason=reason, warn=warn)

    if not fast:
        return generic("form='generic' was asked for", warn=False)
    if hooked:
        return generic(_hooks_reason(hooked))
    wrapped = sorted({f"{lin.name}: {lin.wrapper}" for lin in linears if lin.wrapper})
    if wrapped:
        return generic(f"its projections are wrapped ({'; '.join(wrapped)}); the fast forms compute plain "
                       "weights and plain LoRA adapters only, the generic form runs the wrapper's own forward")
    unregistered = [lin.name for lin in linears if lin not in slotted]
    if unregistered:
        return generic(f"the weights of {', '.join(unregistered)} are not its parameters (tensors set as attributes), "
                       "which the fast forms do not read; the generic form runs its forward")
    outside = _outside_projections(module, linears)
    if outside:
        return generic(f"it has parameters or buffers outside its projections ({', '.join(outside[:4])}), which "
                       "the fast forms do not compute with")
    for lin in (lin for lin in linears if lin.quant is not None):
        problem = dequantized_linear_problem(lin)
        if problem:
            return generic(f"its 4-bit projection {lin.name} {problem}; the generic form runs bitsandbytes' forward")
    dropouts = _dropouts(module)
    if dropouts:
        return generic(f"it applies dropout ({', '.join(dropouts)}); the generic form replays it exactly. Set the "
                       "dropout probability to 0 for the fast form")
    train = [probe.run(probe.x, training=True) for _ in range(2)]
    if any(rel_max_err(t, ref) > PROBE_RTOL for t in train):
        return generic("its forward computes differently in training mode (dropout or another stochastic or "
                       "mode-dependent step); the generic form replays it exactly")
    matches = []
    for description, shape in candidate_layouts(linears, where, probe.hidden):
        for act in PROBE_ACTIVATIONS:
            layout = MLPLayout(act, shape.up, shape.down, shape.gate, shape.fused)
            if rel_max_err(probe.candidate(layout), ref[0]) <= PROBE_RTOL:
                matches.append((description.replace("{act}", act), layout))
    if len(matches) == 1:
        computes = matches[0][0] + (f", with LoRA adapters on {', '.join(l.name for l in adapted)}" if adapted else "")
        quantized = [lin for lin in linears if lin.quant is not None]
        if quantized:
            kinds = sorted({lin.quant.describe() for lin in quantized})
            computes += (f", {' and '.join(kinds)} base weights of {', '.join(lin.name for lin in quantized)} "
                         "dequantized once per pass")
        return Recognized(matches[0][1].form, tuple(slots), matches[0][1], computes=computes,
                          adapters=tuple(lin.adapter for lin in adapted),
                          quantized=tuple((slot_index(lin.weight, where), lin.quant) for lin in quantized))
    if matches:
        return generic("the probe matched several fast forms (" + "; ".join(d for d, _ in matches) + ")")
    return generic("its forward matches no fast form: neither down(act(gate(x)) * up(x)) nor down(act(up(x))) "
                   f"with any of {', '.join(PROBE_ACTIVATIONS)} over its projections "
                   f"({', '.join(lin.name for lin in linears)}) — a residual, an extra factor or another "
                   "activation inside. The generic form computes it exactly")
