"""What a candidate MLP looks like before the probe runs: its Linear-like children (``nn.Linear``, Hugging Face
``Conv1D``, a peft LoRA-wrapped linear, a 4-bit layer), its activation, the fast-form layouts its children allow,
and :class:`Recognized`, the answer recognition gives the planner (``tiledmlp.patching.planning``).
"""


from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch.nn.functional as F
from torch import nn

from ..forms.base import Slot, is_plain_linear, is_quantized, parametrized
from ..forms.kind import Kind
from ..forms.lora import Adapter, LowRank, is_peft_lora, lora_adapter
from ..forms.mlp import MLPLayout, Proj
from ..forms.quant import QuantizedLinear, quantized_linear

__all__ = ["Recognized", "LinearLike", "linear_like", "activation_name", "slot_index", "registered", "proj_of",
           "candidate_layouts", "hidden_sizes", "MLP_NAMES", "ACT_ATTRS"]

#: child-name sets that mark a module as an MLP where the probe cannot run (sharded parameters); the
#: first two (Hugging Face GLUs) also where the projections are not Linear-like (quantized layers)
MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj"), ("up_proj", "down_proj"),
             ("w1", "w2", "w3"), ("fc1", "fc2"), ("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"),
             ("wi", "wo"), ("fc_in", "fc_out"), ("linear_fc1", "linear_fc2"))
ACT_ATTRS = ("act_fn", "activation_fn", "act", "activation")


@dataclass
class Recognized:
    """What tiling a module means: its form, its parameter slots and, for a fast form, its layout
    (over slot indices). ``reason``: why a module that looks like an MLP got the generic form;
    ``warn``: whether that deserves a warning (not for a generic form the user asked for)."""

    kind: Kind  # a fast form (GLU, MLP, MOE, PROJ) or the generic one (GENERIC, NORM, PROJ); EXCLUDED: not tiled
    slots: tuple[Slot, ...]
    layout: Optional[Any] = None  # an MLPLayout, an ExpertsLayout for Kind.MOE, a ProjLayout for a fast Kind.PROJ
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
    quant: Optional[QuantizedLinear] = None  # a 4-bit base weight (``tiledmlp.forms.quant``), dequantized per call


def _is_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2 family): ``addmm(bias, x, weight)`` with weight ``[in, out]``; parametrized
    too (``torch.nn.utils.parametrize`` makes its class a subclass of it)."""
    cls = type(m).__bases__[0] if parametrized(m) else type(m)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and hasattr(m, "nf")


def linear_like(name: str, m: nn.Module) -> Optional[LinearLike]:
    """``m`` as a :class:`LinearLike`, or None."""
    quant = quantized_linear(m)  # a 4-bit Linear4bit: plain but for its packed weight
    # A parametrized linear (weight_norm, ...) computes its weight from other parameters at each read: a projection,
    # wrapped (its weight slot is no parameter), so its MLP takes the generic form, which runs its forward
    wrapper = parametrized(m)
    # A Linear subclass with a forward of its own (Falcon's FalconLinear) is a candidate too: the probe checks that
    # the module computes what the fast form does with its weights (else: the generic form). Quantized weights
    # (bitsandbytes' 8-bit Linear) are not: the probe cannot swap them.
    if is_plain_linear(m) or quant is not None or (isinstance(m, nn.Linear) and not is_quantized(m.weight)):
        bias = Slot(m, "bias") if m.bias is not None else None
        return LinearLike(name, m.in_features, m.out_features, Slot(m, "weight"), bias, quant=quant, wrapper=wrapper)
    if _is_conv1d(m):
        weight = m.__dict__.get("_parameters", {}).get("weight")
        n_in = getattr(m, "nx", None) or (weight.shape[0] if weight is not None and weight.dim() == 2 else None)
        if n_in is None:
            return None
        bias = Slot(m, "bias") if getattr(m, "bias", None) is not None else None
        return LinearLike(name, n_in, m.nf, Slot(m, "weight"), bias, transposed=True, wrapper=wrapper)
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


def slot_index(slot: Slot, where: dict[tuple[int, str], int]) -> int:
    return where[(id(slot.owner), slot.name)]


def registered(lin: LinearLike, where: dict[tuple[int, str], int]) -> bool:
    """Whether ``lin``'s weight and bias are parameters among ``where``'s slots (not a parametrized tensor, nor one a
    hook or the user set as a plain attribute): the probe and the fast forms read only those."""
    return all((id(s.owner), s.name) in where for s in (lin.weight, lin.bias) if s is not None)


def proj_of(lin: LinearLike, where: dict[tuple[int, str], int]) -> Proj:
    bias = None if lin.bias is None else slot_index(lin.bias, where)
    adapter = lin.adapter and LowRank(slot_index(lin.adapter.a, where), slot_index(lin.adapter.b, where),
                                      lin.adapter.scale)
    return Proj(slot_index(lin.weight, where), bias, lin.transposed, adapter)


def candidate_layouts(linears: Sequence[LinearLike], where: dict[tuple[int, str], int],
                      hidden: int) -> list[tuple[str, MLPLayout]]:
    """``(description, layout without activation)`` for every fast form over ``hidden``-wide inputs
    that the children's shapes allow. The activation field holds a placeholder; the probe tries each, and puts its
    name for the description's ``{act}``."""
    out: list[tuple[str, MLPLayout]] = []
    for down in (lin for lin in linears if lin.out_features == hidden):
        others = [lin for lin in linears if lin is not down]
        inter = down.in_features
        ins = [lin for lin in others if lin.in_features == hidden]
        if len(others) == 2 and len(ins) == 2 and all(lin.out_features == inter for lin in ins):
            for gate, up in itertools.permutations(ins):
                out.append((f"{down.name}({{act}}({gate.name}(x)) * {up.name}(x))",
                            MLPLayout("", proj_of(up, where), proj_of(down, where), gate=proj_of(gate, where))))
        elif len(others) == 1 and len(ins) == 1:
            (up,) = ins
            if up.out_features == inter:
                out.append((f"{down.name}({{act}}({up.name}(x)))",
                            MLPLayout("", proj_of(up, where), proj_of(down, where))))
            elif up.out_features == 2 * inter:
                out.append((f"{down.name}({{act}}(gate) * up) with [gate; up] = {up.name}(x)",
                            MLPLayout("", proj_of(up, where), proj_of(down, where), fused=True)))
    return out


def hidden_sizes(linears: Sequence[LinearLike]) -> list[int]:
    """Hidden sizes for which two children chain ``hidden -> inter -> hidden`` (``inter`` or ``2 * inter``
    wide). Two for a plain ``H -> I -> H`` MLP read either way round: the probe tries both."""
    return list(dict.fromkeys(b.out_features for a in linears for b in linears
                              if a is not b and b.out_features == a.in_features
                              and a.out_features in (b.in_features, 2 * b.in_features)))


# ----------------------------------------------------------------------------------------------
# The probe
