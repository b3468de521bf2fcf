"""What is tiled: recognition of each module (``recognize``: MLPs, MoE experts and blocks, registered types,
normalization layers, LoRA projections) and the plan of one ``enable_tiling`` call (``plan``: a
:class:`~tiledmlp.patching.state.TilingState` per module to patch, its strategy forced or left to detection, the heads'
tiled loss), made without changing the model.

Recognized (outermost match wins, so experts inside a tiled MoE block are not tiled again):

* MLPs, by what they compute (``tiledmlp.recognize``): a module whose two to four Linear-like
  children chain ``hidden -> inter -> hidden`` and whose forward a numerical probe identifies as
  ``down(act(gate(x)) * up(x))`` (split or fused gate/up) or ``down(act(up(x)))`` gets the fast
  form (``"glu"`` or ``"mlp"``, ``tiledmlp.forms.mlp``), whatever its children are called; one
  that is per-token but computes something else (LoRA adapters, dropout, a residual inside) gets
  the generic form, with the reason recorded and logged.
* MoE layers: an experts module (two 3-D expert weights, ``forward(hidden, top_k_index, top_k_weights)``)
  that the probe identifies (``tiledmlp.recognize.moe``) gets the MoE form: only the experts call is
  tiled, its block (router, shared expert) runs as usual and a shared expert is recognized on its own.
  A MoE block (an ``experts`` submodule next to a ``gate`` or ``router``) whose experts the form cannot
  compute is tiled whole with the generic form, with the reason recorded and logged.
* Types registered with :func:`register_mlp` or passed as ``mlp_types=``.
* With ``loss=True``, the LM head of every Hugging Face causal LM (``loss/heads.py``): the tiled loss.
* With ``norms=True``, normalization layers, by what they compute (``tiledmlp.recognize.norms``): the generic form,
  shards sized by their float32 copies.
* With ``projections=True``, LoRA-adapted projections outside the MLPs and heads (``tiledmlp.recognize.projections``).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Optional

from torch import nn

from ..core.logs import warn_once
from ..distributed.detect import fsdp2_units_below, module_path
from ..distributed.selection import StrategyChoice, WrappingQuery
from ..forms.base import Slot
from ..forms.kind import Kind
from ..forms.mlp import MLPLayout
from ..forms.quant import quantized_linear
from ..loss.heads import HeadSpec, LossOptions, LossOwner, check_causal_lm, find_causal_lms, labels_position
from ..recognize.candidates import Recognized, hidden_sizes, linear_like
from ..recognize.modules import recognize
from .call_spec import TiledCallSpec
from .state import STATE_ATTR, PlanOptions, TilingState, TracedCall, original_forward, saved_forward

__all__ = ["plan", "plan_added", "replan"]

def _input_names(forward) -> list[str]:
    return [p.name for p in inspect.signature(forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _choice_of(model: nn.Module, module: nn.Module, slots: tuple[Slot, ...], strategy: str, label: str,
               rec: Optional[Recognized] = None) -> StrategyChoice:
    """The strategy choice of a tiled module (``rec``: how it was recognized, for its tensor-parallel plan; None for
    an LM head), checked against its wrapping now (``StrategyChoice.planned``)."""
    query = WrappingQuery(slots, rec and rec.layout, label, rec.reason if rec else "", head=rec is None)
    return StrategyChoice.planned(module_path(model, module), query, strategy)


def plan(model: nn.Module, options: PlanOptions, loss: Optional[LossOptions] = None,
         loss_required: bool = True) -> dict[str, TilingState]:
    """Recognize and validate every MLP (with ``options.norms``, every normalization layer; with
    ``options.projections``, every LoRA-adapted projection outside them and outside the heads; with ``loss``, every
    causal-LM head) of ``model`` without changing anything. ``loss_required``: a head that cannot be
    tiled (or none) is an error; otherwise (``enable_tiling``'s default) it is logged and left as it is.
    ValueError, naming what was found, when nothing would be tiled."""
    projections = options.projections
    states: dict[str, TilingState] = {}
    covered: list[str] = []  # names of recognized modules: their subtrees are not tiled again
    excluded: list[str] = []  # MoE blocks that include_moe=False leaves untiled
    experts_seen: dict[int, Recognized] = {}  # MoE blocks' experts, probed once
    # A causal LM's output embeddings belong to its loss (tiled or not), never to a projection's tiling.
    heads = {id(lm.get_output_embeddings()) for _, lm in find_causal_lms(model)} if projections else set()
    for name, module in model.named_modules():
        if any(c == "" or name == c or name.startswith(c + ".") for c in covered):
            continue
        rec = recognize(module, original_forward, options.extra_types, options.include_moe, options.form, root=model,
                        experts_seen=experts_seen, norms=options.norms,
                        projections=projections and id(module) not in heads)
        if rec is None:
            continue
        label = name or type(module).__name__
        if rec.kind == Kind.EXCLUDED:  # the block (router included) and its experts; a shared expert is an MLP of its own
            excluded.append(label)
            covered.append(f"{name}.experts" if name else "experts")
            continue
        covered.append(name)
        states[name] = _module_state(model, module, label, rec, options)
    if loss is not None:
        states.update(_plan_heads(model, options.strategy, loss, loss_required))
    if not states:
        raise ValueError(_nothing_recognized(model, excluded, loss is not None))
    return states


def plan_added(model: nn.Module, options: PlanOptions, known: set[int]) -> dict[str, TilingState]:
    """The states of modules of ``model`` that are new (their ``id`` not in ``known``) and would have been tiled had
    they been there at ``enable_tiling`` (``plan``'s recognition, outermost first): what is inside a tiled module is
    left to that module, which plans itself again (``replan``), and the causal LMs' output layers to their tiled
    loss. Only new modules are probed (the probe of a module with ZeRO-3 parameters is a collective)."""
    heads = {id(lm.get_output_embeddings()) for _, lm in find_causal_lms(model)}
    tiled = [name for name, m in model.named_modules() if STATE_ATTR in m.__dict__]
    states: dict[str, TilingState] = {}
    for name, module in model.named_modules():
        if (id(module) in known or id(module) in heads
                or any(c == "" or name == c or name.startswith(c + ".") for c in [*tiled, *states])):
            continue
        rec = recognize(module, original_forward, options.extra_types, options.include_moe, options.form, root=model,
                        norms=options.norms, projections=options.projections)
        if rec is not None and rec.kind != Kind.EXCLUDED:
            states[name] = _module_state(model, module, name or type(module).__name__, rec, options)
    return states


def _module_state(model: nn.Module, module: nn.Module, label: str, rec: Recognized,
                  options: PlanOptions) -> TilingState:
    """The tiling state of ``module`` (``label`` in ``model``), recognized as ``rec``; ValueError where its wrapping
    cannot be tiled exactly."""
    nested = fsdp2_units_below(module)
    if nested:
        raise ValueError(
            f"{label}: fully_shard was applied to {nested} inside this MLP; tiling recomputes the "
            "MLP without calling those units' hooks. Apply fully_shard to the MLP or a module "
            "above it (e.g. the decoder layer) instead."
        )
    choice = _choice_of(model, module, rec.slots, options.strategy, label, rec)
    spec = TiledCallSpec(name=label, slots=rec.slots, policy=options.policy, layout=rec.layout,
                         is_moe=rec.moe_block, sized_by_copies=rec.kind in (Kind.NORM, Kind.PROJ),
                         grad_accum_dtype=options.grad_accum_dtype, quantized=rec.quantized)
    names = _input_names(original_forward(module))
    return TilingState(spec, rec.kind, names[0] if names else "hidden_states", saved_forward(module), choice,
                       reason=rec.reason, warn=rec.warn, computes=rec.computes,
                       token_input_names=tuple(names[1:3]) if rec.kind == Kind.MOE else (),
                       traced=traced_call_of(module, rec), adapters=rec.adapters, members=tuple(module.named_modules()),
                       options=options)


def replan(module: nn.Module, state: TilingState, changes: str) -> TilingState:
    """``module``'s state planned again because its submodules changed since (``changes``, from
    :meth:`TilingState.changes`), with the options ``enable_tiling`` was given, inside the model it was planned in
    (the outermost module of its path still alive; past a peft wrapper that may since have been unloaded). A module
    that is no longer recognized (or excluded) keeps its state with ``untiled`` set: its calls run its own forward.
    Runs the recognition probe: under ZeRO-3 or tensor parallelism a collective, which every rank reaches at the
    same call, as the same change was made on all of them."""
    options = state.options
    path = [m for m in (ref() for ref in state.choice.path) if m is not None] or [module]
    model = next((m for m in path if not type(m).__module__.startswith("peft")), path[0])
    if not any(m is module for m in model.modules()):
        model = module
    name = next(n for n, m in model.named_modules() if m is module)
    label = name or type(module).__name__
    kind = state.kind
    rec = recognize(module, original_forward, options.extra_types, options.include_moe, options.form, root=model,
                    norms=options.norms and kind == Kind.NORM, projections=options.projections and kind == Kind.PROJ)
    if rec is None or rec.kind == Kind.EXCLUDED:
        return replace(state, members=tuple(module.named_modules()), untiled=(
            f"its submodules changed since enable_tiling ({changes}) and it is no longer recognized as a module "
            "tiling can compute, so it runs its own forward, untiled; call tiledmlp.enable_tiling(model) again "
            "after the change to see why"))
    again = _module_state(model, module, label, rec, options)
    again.key, again.remembers_output = state.key, state.remembers_output
    return again


def _nothing_recognized(model: nn.Module, excluded: list[str], with_loss: bool) -> str:
    """Why ``enable_tiling`` found nothing to tile, naming what it did find and what to do."""
    head = " and no LM head whose loss it can tile" if with_loss else ""
    if excluded:
        return (f"nothing to tile in {type(model).__name__}: include_moe=False leaves its {len(excluded)} MoE "
                f"block{'s' if len(excluded) != 1 else ''} ({', '.join(excluded[:3])}{', ...' if len(excluded) > 3 else ''}) "
                f"untiled, and it has no other MLP block{head}. Drop include_moe=False to tile the experts.")
    return (f"no MLP block recognized in {type(model).__name__}{head}. tiledmlp recognizes, by what they compute, "
            "modules whose 2-4 Linear-like children (nn.Linear, transformers' Conv1D, LoRA-wrapped linears) "
            "chain hidden -> intermediate -> hidden and whose forward maps each token on its own (GLU and "
            "plain MLPs, whatever their names); MoE blocks (an 'experts' submodule beside a 'gate' or "
            "'router'); and registered types. For another per-token module, call "
            "tiledmlp.register_mlp(MyMLP) or pass mlp_types=(MyMLP,); for a single call, use "
            "tiledmlp.apply_tiled_mlp(fn, module, x).")


def traced_call_of(module: nn.Module, rec: Recognized) -> Optional[TracedCall]:
    """How compiled code calls ``module``'s operator; None where it cannot: a parameter that does not live under
    the module, or a generic form whose output cannot be sized before it runs (no Linear-like children mapping
    a width back to itself, or a whole MoE block, whose router's outputs come along)."""
    paths = {m: name for name, m in module.named_modules()}
    if any(slot.owner not in paths for slot in rec.slots):
        return None
    slot_paths = tuple(".".join(filter(None, (paths[slot.owner], slot.name))) for slot in rec.slots)
    if rec.kind == Kind.NORM:  # maps its parameters' width to itself
        return TracedCall(slot_paths, -1, 0, (rec.slots[0].get().shape[0],))
    if rec.kind == Kind.PROJ and rec.layout is not None:  # sized by the weight's output features
        return TracedCall(slot_paths, rec.layout.proj.weight, 1 if rec.layout.proj.transposed else 0)
    if rec.kind == Kind.PROJ:  # generic: the operator's output is sized like its input (a projection that keeps the
        base = module.base_layer  # width), and bitsandbytes' packed 4-bit weight is no tensor an operator can take
        keeps_width = base.in_features == base.out_features and quantized_linear(base) is None
        return TracedCall(slot_paths, -1, 0, (base.in_features,)) if keeps_width else None
    if rec.layout is None:
        widths = hidden_sizes([lin for lin in (linear_like(n, c) for n, c in module.named_children()) if lin])
        return TracedCall(slot_paths, -1, 0, tuple(widths)) if widths and not rec.moe_block else None
    if isinstance(rec.layout, MLPLayout):
        return TracedCall(slot_paths, rec.layout.down.weight, 1 if rec.layout.down.transposed else 0)
    return TracedCall(slot_paths, -1, 0)  # the experts' output has the hidden states' width


def _plan_heads(model: nn.Module, strategy: str, options: LossOptions, required: bool) -> dict[str, TilingState]:
    """The tiled loss of every causal LM in ``model``. ``required`` (``loss=True``): a model without one, or a head
    that cannot be tiled, is a ValueError; otherwise (the default) each such head is logged and left untiled."""
    lms = find_causal_lms(model)
    if not lms and required:
        raise ValueError(
            f"loss=True, but {type(model).__name__} has no recognizable LM head: tiledmlp tiles the loss of "
            "Hugging Face causal LMs (a PreTrainedModel with get_output_embeddings() and transformers' "
            "ForCausalLMLoss). For another model, call tiledmlp.tiled_linear_cross_entropy(hidden, "
            "head.weight, labels) in your loss, or enable tiling with loss=False.")
    states: dict[str, TilingState] = {}
    for lm_name, lm in lms:
        try:
            name, state = _plan_head(model, strategy, options, lm_name, lm)
        except ValueError as exc:
            if required:
                raise
            warn_once(("head not tiled", lm_name, str(exc)), "%s: its loss is not tiled (the model computes its "
                      "T x vocab logits): %s", lm_name or type(lm).__name__, exc)
            continue
        states[name] = state
    return states


def _plan_head(model: nn.Module, strategy: str, options: LossOptions, lm_name: str,
               lm: nn.Module) -> tuple[str, TilingState]:
    """``(the head's qualified name, its tiling state)`` for the causal LM ``lm``; ValueError if it cannot be tiled."""
    head = check_causal_lm(lm_name, lm)
    name = _qualified_name(model, head)
    label = name or type(head).__name__
    slots = head_slots(head)
    choice = _choice_of(model, head, slots, strategy, label)
    owner = LossOwner(lm_name or type(lm).__name__, lm_name, head, labels_position(lm))
    spec = HeadSpec(label, slots, options, owner)
    return name, TilingState(spec, Kind.LOSS, "input", saved_forward(head), choice)


def head_slots(head: nn.Module) -> tuple[Slot, ...]:
    return (Slot(head, "weight"),) + ((Slot(head, "bias"),) if getattr(head, "bias", None) is not None else ())


def _qualified_name(model: nn.Module, module: nn.Module) -> str:
    """``module``'s qualified name in ``model`` (as ``named_modules()`` gives it)."""
    return next(n for n, m in model.named_modules() if m is module)
