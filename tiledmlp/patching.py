"""Find MLP blocks, patch their forwards per instance, and undo it.

Recognized (outermost match wins, so experts inside a tiled MoE block are not tiled again):

* MLPs, by what they compute (``tiledmlp.recognize``): a module whose two to four Linear-like
  children chain ``hidden -> inter -> hidden`` and whose forward a numerical probe identifies as
  ``down(act(gate(x)) * up(x))`` (split or fused gate/up) or ``down(act(up(x)))`` gets the fast
  form (``"glu"`` or ``"mlp"``, ``tiledmlp.mlp_form``), whatever its children are called; one
  that is per-token but computes something else (LoRA adapters, dropout, a residual inside) gets
  the generic form, with the reason recorded and logged.
* MoE layers: an experts module (two 3-D expert weights, ``forward(hidden, top_k_index, top_k_weights)``)
  that the probe identifies (``tiledmlp.recognize_moe``) gets the MoE form: only the experts call is
  tiled, its block (router, shared expert) runs as usual and a shared expert is recognized on its own.
  A MoE block (an ``experts`` submodule next to a ``gate`` or ``router``) whose experts the form cannot
  compute is tiled whole with the generic form, with the reason recorded and logged.
* Types registered with :func:`register_mlp` or passed as ``mlp_types=``.
* With ``loss=True``, the LM head of every Hugging Face causal LM (``heads.py``): the tiled loss.
* With ``norms=True``, normalization layers, by what they compute (``tiledmlp.norms``): the generic form,
  shards sized by their float32 copies.

Patching sets an instance attribute ``forward`` (the class is never touched) and keeps the previous
instance forward, if any (e.g. accelerate's hooks), to restore it exactly.
"""

from __future__ import annotations

import copyreg
import functools
import inspect
import logging
import types
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.profiler import record_function

from .distributed.deepspeed import check_deepspeed_module, is_zero_managed
from .distributed.detect import (Wrapping, detect_wrapping, fsdp2_units_below, is_dtensor, is_fsdp1_wrapper,
                                 module_path)
from .distributed.sequence_parallel import split_of
from .distributed.strategies import Strategy, owning_units, strategy_for, validate_forced
from .distributed.tensor_parallel import TPPlan, tp_plan
from .forms import Slot
from .attention import reduce_layer_method, remember_norm_output
from .compiled import autocast_name, module_key, tiled_call
from .function import backward_shards, forward_shards, in_shard
from .heads import (OWNER_ATTR, HeadSpec, LossOptions, LossOwner, TiledHeadForward, check_causal_lm,
                    find_causal_lms, labels_position, patch_owner, unpatch_owner)
from .hooks import HOOK_TABLES, hooked_children
from .logs import warn_once, warn_once_traced
from .lora import changed_adapters
from .mlp_form import MLPLayout
from .norms import recognize_norm
from .projections import recognize_projection
from .quant import quantized_linear, quantized_problem
from .recognize import Recognized, hidden_sizes, linear_like, recognize_mlp
from .recognize_moe import experts_interface, recognize_experts
from .runtime import TiledCallSpec
from .sharding import ShardPolicy

__all__ = ["register_mlp", "recognize", "param_slots", "plan", "install", "uninstall", "tiled_names", "tiled_states",
           "STATE_ATTR"]

STATE_ATTR = "_tiledmlp_state"
_REGISTERED: list[type] = []
log = logging.getLogger("tiledmlp")


def register_mlp(module_type: type) -> type:
    """Tile every instance of ``module_type`` (any per-token module) with the generic form.

    Usable as a decorator. The module's forward must map ``[..., tokens, hidden]`` to outputs whose
    leading dims are the tokens' (each token computed independently of the others).
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_mlp takes an nn.Module subclass, got {module_type!r}")
    if module_type not in _REGISTERED:
        _REGISTERED.append(module_type)
    return module_type


# ----------------------------------------------------------------------------------------------
# Recognition


def param_slots(module: nn.Module) -> list[Slot]:
    """Every parameter slot in ``module``'s subtree (where the parameter is registered).

    FSDP1 flat parameters are left out: the module computes with views of them, read through the
    original parameters' slots (see :func:`_flatparam_slots`).
    """
    return [
        Slot(owner, pname)
        for _, owner in module.named_modules()
        for pname, p in owner._parameters.items()
        if p is not None and not getattr(p, "_is_flat_param", False)
    ]


def _flatparam_slots(module: nn.Module, root: nn.Module) -> list[Slot]:
    """FSDP1 with flat parameters: the original parameters' (module, name) inside ``module``.

    FSDP1 registers a flat parameter on the module it wraps — often an ancestor of the MLP (the
    decoder layer, the root) — so the flat parameters are searched from ``root``.
    """
    inside = {id(m) for m in module.modules()}
    return [
        Slot(info.module, info.param_name)
        for p in root.parameters()
        for info in getattr(p, "_param_infos", ())
        if id(info.module) in inside
    ]


def _is_moe(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.Module) and any(
        isinstance(getattr(module, n, None), nn.Module) for n in ("gate", "router"))


def recognize(module: nn.Module, extra_types: tuple[type, ...] = (), include_moe: bool = True,
              form: str = "auto", root: Optional[nn.Module] = None,
              experts_seen: Optional[dict[int, Recognized]] = None, norms: bool = False,
              projections: bool = False) -> Optional[Recognized]:
    """What tiling ``module`` (inside ``root``, default itself) means, or None if it is not a
    recognized MLP block (or, with ``norms``, normalization layer; with ``projections``, LoRA-adapted
    projection). A MoE block with ``include_moe=False`` is
    ``"excluded"``: neither it nor anything inside it (its experts) is tiled. ``experts_seen``: experts modules a
    MoE block's recognition already probed (by ``id``), so that a later call for the experts module itself does
    not probe again."""
    experts_seen = {} if experts_seen is None else experts_seen
    if is_fsdp1_wrapper(module):
        # FSDP1 forwards attribute reads to the module it wraps, so it looks like that module; the
        # wrapped module is tiled instead (tiling the wrapper would gather parameters per shard).
        return None
    slots = param_slots(module) or _flatparam_slots(module, root if root is not None else module)
    if isinstance(module, tuple(_REGISTERED) + tuple(extra_types)):
        return Recognized("generic", tuple(slots), reason="registered (register_mlp or mlp_types): generic by request")
    if _is_moe(module):
        if not include_moe:
            return Recognized("excluded", tuple(slots))
        experts = module.experts
        if form == "auto" and experts_interface(experts, _original_forward(experts)):
            rec = experts_seen[id(experts)] = recognize_experts(experts, _original_forward(experts),
                                                                 param_slots(experts))
            if rec.kind == "moe":
                return None  # the block runs as is; its experts (and a shared expert) are recognized below
            reason = f"its experts ({type(experts).__name__}) cannot take the MoE form: {rec.reason}"
        elif form == "auto":
            reason = (f"its experts ({type(experts).__name__}) do not have the experts interface (two 3-D expert "
                      "weights, forward(hidden_states, top_k_index, top_k_weights))")
        else:
            reason = "form='generic' was asked for"
        return Recognized("generic", tuple(slots), reason=f"MoE block: {reason}; the whole block, router included, "
                          "is recomputed per shard", warn=form == "auto", moe_block=True)
    forward = _original_forward(module)
    if norms:
        rec = recognize_norm(module, forward, slots)
        if rec is not None:
            return rec
    if projections:
        rec = recognize_projection(module, slots)
        if rec is not None:
            return rec
    if form == "auto" and experts_interface(module, forward):
        rec = experts_seen.pop(id(module), None) or recognize_experts(module, forward, slots)
        return rec if rec.kind == "moe" else None  # outside a MoE block, experts are tiled by the MoE form only
    return recognize_mlp(module, forward, slots, fast=form == "auto")


# ----------------------------------------------------------------------------------------------
# Per-instance state and the patched forward


@dataclass
class TilingState:
    """Everything the patched forward of one module needs."""

    spec: TiledCallSpec
    kind: str  # the form: "glu", "mlp", "generic", "moe", "norm", "proj" or "loss"
    input_name: str
    # The instance forward before patching; None when the instance had none (a value, not a sentinel
    # object, so that copies and pickles of the model still recognize it).
    saved_forward: Any
    forced: Optional[Strategy]  # a forced (or enable-time-wrapped) strategy; None: detect per call
    # Weak references to the modules from the root to this one, for run-time detection when tiling
    # was enabled before wrapping (fully_shard changes those modules' classes in place). Weak, so a
    # deep copy of one MLP does not drag the whole model along.
    path: list = field(default_factory=list)
    reason: str = ""  # why a module that looks like an MLP got the generic form
    warn: bool = False  # whether that reason is worth a warning (not for a form the user asked for)
    computes: str = ""  # what a fast form computes, in the module's own names
    # The MoE form's token inputs beside the hidden states: the routing indices' and weights' names
    token_input_names: tuple = ()
    # How a compiled call reaches this module's tensors (None: compiled calls take the eager path)
    traced: Optional[TracedCall] = None
    adapters: tuple = ()  # the fast form's LoRA adapters (tiledmlp.lora), whose state every call checks
    key: Optional[torch.Tensor] = None  # names this module to the compiled call's operators (set by install)
    fallback: str = ""  # calls seen at run time that took the untiled path, and why (describe(); said once in a log)
    _auto: dict = field(default_factory=dict)  # (Wrapping, TPPlan) → Strategy, for strategy="auto"

    def strategy(self, module: nn.Module) -> Strategy:
        if self.forced is not None:
            return self.forced
        path = [m for m in (ref() for ref in self.path) if m is not None]
        if not path or path[-1] is not module:
            path = [module]
        return self.detected(path)

    def detected(self, path: list[nn.Module]) -> Strategy:
        """The strategy ``auto`` picks for this module at the end of ``path`` (root first), as wrapped now."""
        key = _parallelism_of(path, self.spec.slots, getattr(self.spec, "layout", None), self.spec.name, self.reason,
                              head=self.kind == "loss")
        if key not in self._auto:
            self._auto[key] = strategy_for(key[0], owning_units(path, key[0]), key[1])
        return self._auto[key]

    def __getstate__(self):  # picklable: weak references and run-time caches are dropped
        return {**self.__dict__, "path": [], "_auto": {}}

    # The implementations of the compiled call's operators (``compiled.py``): the eager call, cut at the
    # autograd node, on the tensors the compiled graph passes.

    def op_forward(self, module: nn.Module, x: torch.Tensor, params: list[torch.Tensor],
                   token_inputs: list[torch.Tensor], generic: bool) -> torch.Tensor:
        strategy = self.strategy(module)
        with record_function("tiledmlp::call"), strategy.forward_context(module):
            run = self.spec.prepare(strategy, module, _original_forward(module), x, params, not generic, token_inputs)
            with record_function("tiledmlp::forward"):
                outs = forward_shards(run.call, run.x, run.params, run.token_inputs)
        # A fast form's output has the input's tokens and the width its weight says (a projection's may differ).
        shaped = len(outs) == 1 and outs[0] is not None and (
            outs[0].shape == x.shape if generic else outs[0].shape[:-1] == x.shape[:-1])
        if run.call.form.returned_tuple or not shaped:
            # Only a generic-form module can get here: its outputs were sized (in the graph) like its input.
            raise RuntimeError(
                f"{self.spec.name}: under torch.compile the tiled call of a generic-form module must return one "
                f"tensor shaped like its input {tuple(x.shape)}; this one returned "
                f"{[None if o is None else tuple(o.shape) for o in outs]}. Call it outside the compiled region, "
                "or tiledmlp.disable_tiling(module).")
        return outs[0]

    def op_backward(self, module: nn.Module, grad: torch.Tensor, x: torch.Tensor, params: list[torch.Tensor],
                    token_inputs: list[torch.Tensor], needs: list[bool], generic: bool) -> list[Optional[torch.Tensor]]:
        """``[dx, d token inputs..., d params...]`` (None where not needed; a tensor given twice gets its
        gradient at its first position only, as autograd sums the positions)."""
        run = self.spec.prepare(self.strategy(module), module, _original_forward(module), x, params, not generic,
                                token_inputs)
        n = len(token_inputs)
        need_params = needs[1 + n:]
        unique_needs = [any(need for need, u in zip(need_params, run.index) if u == j) for j in range(len(run.params))]
        dx, d_tokens, unique_grads = backward_shards(run.call, run.x, run.params, run.token_inputs,
                                                     [grad.reshape(run.x.shape[0], -1)], needs[0],
                                                     [*needs[1:1 + n], *unique_needs])
        first = {u: i for i, u in reversed(list(enumerate(run.index)))}
        param_grads = [unique_grads[u] if need and first[u] == i else None
                       for i, (u, need) in enumerate(zip(run.index, need_params))]
        return [None if dx is None else dx.view(x.shape),
                *[None if d is None else d.view(t.shape) for d, t in zip(d_tokens, token_inputs)], *param_grads]


@dataclass(frozen=True)
class TracedCall:
    """What traced code needs to call a fast form's operator (``compiled.py``): each parameter slot as a path
    from the module (``"gate_proj.weight"``; getattr from the module, so Dynamo guards nothing per layer)
    and where the output's width is read (``params[out_slot].shape[out_axis]``; -1: the input's width)."""

    slot_paths: tuple[str, ...]
    out_slot: int
    out_axis: int
    # The generic form: the input widths the module maps back to themselves (its output is sized like its
    # input, checked when it runs); empty for the fast forms.
    widths: tuple[int, ...] = ()


def _parallelism_of(path: list[nn.Module], slots: Iterable[Slot], layout: Optional[Any], label: str,
                    reason: str = "", head: bool = False) -> tuple[Wrapping, Optional[TPPlan]]:
    """The data-parallel wrapping of ``path[-1]`` and its tensor-parallel plan (None: not TP); raises
    ValueError for a TP plan tiling cannot keep exact (``tensor_parallel.tp_plan``; ``head``: a tiled LM
    head, which must not be tensor parallel)."""
    slots = list(slots)
    params = [s.get() for s in slots]
    wrapping = detect_wrapping(path, flat_param_views=any(not isinstance(p, nn.Parameter) for p in params),
                               zero_params=any(is_zero_managed(p) for p in params))
    return wrapping, tp_plan(label, path[-1], layout, slots, params, fsdp2_owned=wrapping is Wrapping.FSDP2,
                             reason=reason, head=head)


def _original_forward(module: nn.Module):
    saved = _saved_forward(module)
    # A partial, not types.MethodType: Dynamo traces through it (no graph break under torch.compile).
    return saved if saved is not None else functools.partial(type(module).forward, module)


def _saved_forward(module: nn.Module) -> Any:
    """The instance forward ``module`` had before tiling (kept by its state when it is tiled), or None."""
    previous = module.__dict__.get(STATE_ATTR)
    return previous.saved_forward if previous is not None else module.__dict__.get("forward")


def _split_input(state: TilingState, args: tuple, kwargs: dict):
    """``(x, rebuild)``: the MLP input and a function that rebuilds the call with a shard in its place.

    ``rebuild`` holds the other arguments, never ``x``: the generic form keeps it (in its autograd node) until
    backward, and a reference to ``x`` there would keep the input alive where nothing else does — inside a
    checkpointed region, where the checkpoint drops what the node saves, and after the region's backward."""
    if args:
        rest = args[1:]
        return args[0], lambda xs: ((xs, *rest), kwargs)
    if state.input_name in kwargs:
        rest = {k: v for k, v in kwargs.items() if k != state.input_name}
        return kwargs[state.input_name], lambda xs: ((), {state.input_name: xs, **rest})
    return None, None


def _other_args(state: TilingState, args: tuple, kwargs: dict) -> list:
    """The arguments of an MLP's call besides its input."""
    return list(args[1:]) + [v for k, v in kwargs.items() if k != state.input_name]


def _experts_args(state: TilingState, args: tuple, kwargs: dict) -> tuple[Optional[tuple], list]:
    """An experts module's call: ``((hidden_states, top_k_index, top_k_weights) or None where they are not a routed
    call's tensors, the other arguments)``."""
    names = (state.input_name, *state.token_input_names)
    values = list(args[:3]) + [kwargs.get(n) for n in names[len(args[:3]):]]
    rest = list(args[3:]) + [v for k, v in kwargs.items() if k not in names]
    x, index, weights = values
    routed = (all(isinstance(t, torch.Tensor) for t in values) and index.shape[:-1] == x.shape[:-1]
              and weights.shape == index.shape)
    return (x, index, weights) if routed else None, rest


def _one_shard_inference(state: TilingState, x: torch.Tensor, fast: bool) -> bool:
    """Decode and short inference calls: one shard is the untiled computation, so the module's own forward runs."""
    if torch.is_grad_enabled():
        return False
    tokens, hidden = x.numel() // x.shape[-1], x.shape[-1]
    return state.spec.policy.one_shard(tokens) if fast else state.spec.generic_rows(tokens, hidden) >= tokens


#: Said when a fast-form module's children carry hooks (the fast form would skip them).
_HOOKS_TAKE_GENERIC = ("%s: hooks are registered on %s; the fast %s form does not call the children, so these calls "
                       "take the generic form, which calls them (per shard)")
#: Said when a fast-form module's LoRA adapters changed state since enable_tiling (the fast form computes the old one).
_ADAPTERS_TAKE_GENERIC = ("%s: its LoRA layers changed since enable_tiling (%s); these calls take the generic form, "
                          "which runs peft's own forward. Call enable_tiling again for the fast %s form")


def _has_tensor(values: Iterable[Any]) -> bool:
    return any(isinstance(v, torch.Tensor) for v in values)


def _tiled_method(module: nn.Module, *args, **kwargs):
    """The ``forward`` installed on a tiled module, as a method bound to it (:func:`tiled_forward_of`).

    A bound method, not a callable object or a partial: Dynamo guards a patched ``forward`` by identity
    unless it is a method, whose function it guards instead — the same for every layer, so compiled layers
    share graphs. Copies of a method rebind it to the copied module; pickles go through
    :func:`_reduce_method`."""
    if torch.compiler.is_compiling():
        return _traced_forward(module, args, kwargs)
    return _tiled_forward(module, *args, **kwargs)


def tiled_forward_of(module: nn.Module) -> types.MethodType:
    """The tiled ``forward`` of ``module``: :func:`_tiled_method` bound to it."""
    return types.MethodType(_tiled_method, module)


def _reduce_method(method: types.MethodType):
    """Pickles a tiled forward as "the tiled forward of this module" (a bound method otherwise pickles as
    ``getattr(module, name)``, which an unpickled module cannot answer yet); any other method as usual."""
    if method.__func__ is _tiled_method:
        return (tiled_forward_of, (method.__self__,))
    return reduce_layer_method(method) or method.__reduce__()


copyreg.pickle(types.MethodType, _reduce_method)


def _traced_forward(module: nn.Module, args: tuple, kwargs: dict):
    """A tiled module's call as Dynamo traces it: one ``tiledmlp::tiled_call`` operator (``compiled.py``), the
    untiled forward where one shard would do, else the eager call (one graph break, said once)."""
    state: TilingState = module.__dict__[STATE_ATTR]
    if state.traced is None:
        reason = ("its generic form's output cannot be sized before it runs (children that are not Linear-like, "
                  "or a whole MoE block)" if state.spec.layout is None else "its parameters do not all live under it")
        return _eager_call(module, reason, args, kwargs)
    generic = state.spec.layout is None
    original = _original_forward(module)
    if state.kind == "moe":
        routed, extra = _experts_args(state, args, kwargs)
        if routed is None:
            return original(*args, **kwargs)
        x, *token_inputs = routed
    else:
        x, _ = _split_input(state, args, kwargs)
        token_inputs = []
        extra = _other_args(state, args, kwargs)
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return original(*args, **kwargs)
    if x.numel() == 0 or _one_shard_inference(state, x, not generic):
        return original(*args, **kwargs)
    if extra:
        return _eager_call(module, "it was called with arguments besides its input", args, kwargs)
    if generic and x.shape[-1] not in state.traced.widths:
        return _eager_call(module, "its input width is not one its children map back to", args, kwargs)
    params = [functools.reduce(getattr, path.split("."), module) for path in state.traced.slot_paths]
    if any(is_dtensor(p) or hasattr(p, "ds_id") for p in params):
        return _eager_call(module, "its parameters are sharded (DTensor or ZeRO-3) and its strategy gathers "
                           "them", args, kwargs)
    if len(state.spec.quantized) > 0:
        return _eager_call(module, "its 4-bit weights are bitsandbytes tensor subclasses, dequantized per call "
                           "outside the graph", args, kwargs)
    if state.kind == "norm" and (autocast_name(x.device.type) or any(p.dtype != x.dtype for p in params)):
        # The operator's output is typed like its input (or autocast's dtype): a norm under autocast or with
        # parameters of another dtype may return another one (LayerNorm runs in float32 under autocast).
        return _eager_call(module, "it is a normalization layer called under autocast or with parameters of "
                           "another dtype than its input, whose output dtype is known only when it runs", args, kwargs)
    # Submodules with hooks (the generic form calls them, hooks and all). Counted plainly: the hooks that
    # hooked_children discounts (tensor parallel's, ZeRO-3's) come with DTensor or ZeRO-3 parameters, which took
    # the eager call above; and reading hooks' closures, as it does, is not traceable.
    hooked = [] if generic else [name for name, m in module.named_modules()
                                 if name and any(len(getattr(m, table)) for table in HOOK_TABLES)]
    if len(hooked) > 0 and state.kind == "moe":
        return _eager_call(module, "hooks are registered on its children (the experts then run untiled)", args,
                           kwargs)
    if len(hooked) > 0:  # a fast form would skip them: the generic form's operator, as the eager call does
        warn_once_traced(("hooks", state.spec.name, tuple(hooked)), _HOOKS_TAKE_GENERIC, state.spec.name,
                         ", ".join(hooked), state.kind)
    changed = changed_adapters(state.adapters) if len(state.adapters) > 0 else []
    if len(changed) > 0:
        warn_once_traced(("adapters", state.spec.name, tuple(changed)), _ADAPTERS_TAKE_GENERIC, state.spec.name,
                         "; ".join(changed), state.kind)
    return tiled_call(state.key, x, params, token_inputs, state.traced.out_slot, state.traced.out_axis,
                      generic=generic or len(hooked) > 0 or len(changed) > 0)


@torch.compiler.disable
def _eager_call(module: nn.Module, reason: str, args: tuple, kwargs: dict):
    """The eager tiled call from compiled code (a graph break), said once per reason."""
    warn_once(("compile", reason), "%s (and any other tiled module for this reason): under torch.compile its "
              "tiled call runs eagerly, one graph break per call, because %s", module.__dict__[STATE_ATTR].spec.name,
              reason)
    return _tiled_forward(module, *args, **kwargs)


def _tiled_forward(module: nn.Module, *args, **kwargs):  # eager only: compiled code takes _traced_forward
    state: TilingState = module.__dict__[STATE_ATTR]
    original = _original_forward(module)
    if state.kind == "moe":
        return _tiled_experts(module, state, original, args, kwargs)
    x, rebuild = _split_input(state, args, kwargs)
    if in_shard() or not isinstance(x, torch.Tensor) or x.dim() < 2 or x.numel() == 0:
        return original(*args, **kwargs)
    if _one_shard_inference(state, x, state.spec.layout is not None):
        return original(*args, **kwargs)
    extra = _other_args(state, args, kwargs)
    if _has_tensor(extra):
        raise ValueError(
            f"{state.spec.name}: the tiled forward got extra tensor arguments besides its input; tiling "
            "splits only the input's tokens, so per-token extras would be misaligned. Disable tiling "
            "for this module (tiledmlp.disable_tiling) or pass only the hidden states."
        )

    def shard_forward(xs: torch.Tensor):
        a, kw = rebuild(xs)
        return original(*a, **kw)

    fast = not extra
    if not fast and state.spec.layout is not None:
        state.fallback = "calls with extra arguments take the generic form"
        warn_once(("extra arguments", state.spec.name), "%s: called with extra arguments (%s); the fast %s form "
                  "computes forward(x) only, so these calls take the slower generic form", state.spec.name,
                  ", ".join(map(str, kwargs)) or "positional", state.kind)
    hooked = hooked_children(module) if fast and state.spec.layout is not None else []
    if hooked:  # registered after enable_tiling: the fast form would skip them
        fast = False
        state.fallback = f"hooks on {', '.join(hooked)}: calls take the generic form"
        warn_once(("hooks", state.spec.name, tuple(hooked)), _HOOKS_TAKE_GENERIC, state.spec.name, ", ".join(hooked),
                  state.kind)
    changed = changed_adapters(state.adapters) if fast and state.adapters else []
    # merge_and_unload() put plain projections in place of the module's LoRA children (a LoRA projection tiled itself,
    # form proj, is replaced in its parent instead: never called again)
    if changed and all(a.layer is not module and getattr(module, a.child, None) is not a.layer for a in state.adapters):
        state, changed = _adapters_unloaded(module, state), []
    if changed:  # merged, disabled, switched or rescaled: the fast form would compute the recognized adapter
        fast = False
        state.fallback = (f"its LoRA layers changed since enable_tiling ({'; '.join(changed)}): calls take the "
                          "generic form")
        warn_once(("adapters", state.spec.name, tuple(changed)), _ADAPTERS_TAKE_GENERIC, state.spec.name,
                  "; ".join(changed), state.kind)
    problem = quantized_problem(state.spec.quantized, x) if fast and state.spec.quantized else ""
    if problem:  # the fast form would not compute what bitsandbytes does: its own forward, per shard
        fast = False
        state.fallback = f"{problem}: calls take the generic form"
        warn_once(("quantized", state.spec.name, problem), "%s: %s; these calls take the generic form, which runs "
                  "bitsandbytes' own forward per shard", state.spec.name, problem)
    if fast:
        state.fallback = ""  # describe() says what the last call did
    out = state.spec(state.strategy(module), module, shard_forward, x, fast_allowed=fast)
    if state.kind == "norm" and not extra:
        remember_norm_output(out, x, functools.partial(_norm_again, module))
    return out


def _norm_again(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A tiled norm's output computed again from its input: its tiled forward (the same shards, so the same bits),
    without its hooks (they ran in the forward)."""
    return module.forward(x)


def _adapters_unloaded(module: nn.Module, state: TilingState) -> TilingState:
    """``module``'s LoRA layers were unloaded since enable_tiling (peft's ``merge_and_unload()`` puts each base
    layer, the adapter merged into its weight, in its LoRA layer's place): recognized again, with the fast form of
    its plain projections, under the name it has below the model peft wrapped. Installed for the next calls."""
    path = [m for m in (ref() for ref in state.path) if m is not None]
    base = next((m for m in path if not type(m).__module__.startswith("peft")), module)
    name = next((n for n, m in base.named_modules() if m is module), state.spec.name) or type(module).__name__
    rec = recognize_mlp(module, _original_forward(module), param_slots(module))
    if rec is None or rec.layout is None or rec.adapters:
        return state  # cannot happen for a module whose projections were plain before they were wrapped
    spec = replace(state.spec, name=name, slots=rec.slots, layout=rec.layout)
    again = replace(state, spec=spec, computes=rec.computes, adapters=(), traced=_traced_call(module, rec), _auto={})
    module.__dict__[STATE_ATTR] = again
    log.info("%s: its LoRA layers were merged and unloaded since enable_tiling; it now takes the fast %s form of its "
             "merged projections", name, again.kind)
    return again


def _tiled_experts(module: nn.Module, state: TilingState, original, args: tuple, kwargs: dict):
    """An experts module's call: ``(hidden_states, top_k_index, top_k_weights)``, the routing tiled with the
    hidden states as token inputs. Runs the module's own forward where tiling cannot help (inside a shard,
    one shard of inference) or would skip code (hooks on its children)."""
    routed, rest = _experts_args(state, args, kwargs)
    if in_shard() or routed is None or routed[0].numel() == 0 or _has_tensor(rest):
        return original(*args, **kwargs)
    x, index, weights = routed
    if _one_shard_inference(state, x, True):
        return original(*args, **kwargs)
    hooked = hooked_children(module)
    if hooked:
        warn_once(("hooks", state.spec.name, tuple(hooked)), "%s: hooks are registered on %s; the MoE form does not "
                  "call the children, so these calls run the experts untiled", state.spec.name, ", ".join(hooked))
        return original(*args, **kwargs)
    return state.spec(state.strategy(module), module, None, x, token_inputs=(index, weights))



# ----------------------------------------------------------------------------------------------
# Install / uninstall


def _input_names(forward) -> list[str]:
    return [p.name for p in inspect.signature(forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _strategy_of(model: nn.Module, module: nn.Module, slots: tuple[Slot, ...], strategy: str,
                 label: str, rec: Optional[Recognized] = None) -> tuple[Optional[Strategy], list]:
    """``(forced strategy or None for run-time detection, weak path from the root)`` of a tiled module
    (``rec``: how it was recognized, for its tensor-parallel plan; None for an LM head)."""
    path = module_path(model, module)
    wrapping, tp = _parallelism_of(path, slots, rec and rec.layout, label, rec.reason if rec else "", head=rec is None)
    if wrapping is Wrapping.DEEPSPEED:
        check_deepspeed_module(label, module)
    units = owning_units(path, wrapping)
    if strategy == "auto":
        # Unwrapped (TP or not): detected again at each call, so wrapping the model later still counts.
        forced = None if wrapping is Wrapping.NONE else strategy_for(wrapping, units, tp)
    else:
        forced = validate_forced(strategy, wrapping, label, units, tp)
    return forced, [weakref.ref(m) for m in path]


def plan(model: nn.Module, strategy: str, policy: ShardPolicy, extra_types: tuple[type, ...],
         include_moe: bool, form: str, grad_accum_dtype: Optional[torch.dtype],
         loss: Optional[LossOptions] = None, norms: bool = False, loss_required: bool = True,
         projections: bool = False) -> dict[str, TilingState]:
    """Recognize and validate every MLP (with ``loss``, every causal-LM head; with ``norms``, every
    normalization layer; with ``projections``, every LoRA-adapted projection outside them and outside the
    heads) of ``model`` without changing anything. ``loss_required``: a head that cannot be
    tiled (or none) is an error; otherwise (``enable_tiling``'s default) it is logged and left as it is.
    ValueError, naming what was found, when nothing would be tiled."""
    states: dict[str, TilingState] = {}
    covered: list[str] = []  # names of recognized modules: their subtrees are not tiled again
    excluded: list[str] = []  # MoE blocks that include_moe=False leaves untiled
    experts_seen: dict[int, Recognized] = {}  # MoE blocks' experts, probed once
    # A causal LM's output embeddings belong to its loss (tiled or not), never to a projection's tiling.
    heads = {id(lm.get_output_embeddings()) for _, lm in find_causal_lms(model)} if projections else set()
    for name, module in model.named_modules():
        if any(c == "" or name == c or name.startswith(c + ".") for c in covered):
            continue
        rec = recognize(module, extra_types, include_moe, form, root=model, experts_seen=experts_seen, norms=norms,
                        projections=projections and id(module) not in heads)
        if rec is None:
            continue
        label = name or type(module).__name__
        if rec.kind == "excluded":  # the block (router included) and its experts; a shared expert is an MLP of its own
            excluded.append(label)
            covered.append(f"{name}.experts" if name else "experts")
            continue
        covered.append(name)
        nested = fsdp2_units_below(module)
        if nested:
            raise ValueError(
                f"{label}: fully_shard was applied to {nested} inside this MLP; tiling recomputes the "
                "MLP without calling those units' hooks. Apply fully_shard to the MLP or a module "
                "above it (e.g. the decoder layer) instead."
            )
        forced, path = _strategy_of(model, module, rec.slots, strategy, label, rec)
        spec = TiledCallSpec(name=label, slots=rec.slots, policy=policy, layout=rec.layout,
                             is_moe=rec.moe_block, sized_by_copies=rec.kind in ("norm", "proj"),
                             grad_accum_dtype=grad_accum_dtype,
                             quantized=rec.quantized)
        names = _input_names(_original_forward(module))
        states[name] = TilingState(spec, rec.kind, names[0] if names else "hidden_states", _saved_forward(module),
                                   forced, path, reason=rec.reason, warn=rec.warn, computes=rec.computes,
                                   token_input_names=tuple(names[1:3]) if rec.kind == "moe" else (),
                                   traced=_traced_call(module, rec), adapters=rec.adapters)
    if loss is not None:
        states.update(_plan_heads(model, strategy, loss, loss_required))
    if not states:
        raise ValueError(_nothing_recognized(model, excluded, loss is not None))
    return states


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


def _traced_call(module: nn.Module, rec: Recognized) -> Optional[TracedCall]:
    """How compiled code calls ``module``'s operator; None where it cannot: a parameter that does not live under
    the module, or a generic form whose output cannot be sized before it runs (no Linear-like children mapping
    a width back to itself, or a whole MoE block, whose router's outputs come along)."""
    paths = {m: name for name, m in module.named_modules()}
    if any(slot.owner not in paths for slot in rec.slots):
        return None
    slot_paths = tuple(".".join(filter(None, (paths[slot.owner], slot.name))) for slot in rec.slots)
    if rec.kind == "norm":  # maps its parameters' width to itself
        return TracedCall(slot_paths, -1, 0, (rec.slots[0].get().shape[0],))
    if rec.kind == "proj" and rec.layout is not None:  # sized by the weight's output features
        return TracedCall(slot_paths, rec.layout.proj.weight, 1 if rec.layout.proj.transposed else 0)
    if rec.kind == "proj":  # generic: the operator's output is sized like its input (a projection that keeps the
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
    slots = _head_slots(head)
    forced, path = _strategy_of(model, head, slots, strategy, label)
    owner = LossOwner(lm_name or type(lm).__name__, lm_name, head, labels_position(lm))
    spec = HeadSpec(label, slots, options, owner)
    return name, TilingState(spec, "loss", "input", _saved_forward(head), forced, path)


def _head_slots(head: nn.Module) -> tuple[Slot, ...]:
    return (Slot(head, "weight"),) + ((Slot(head, "bias"),) if getattr(head, "bias", None) is not None else ())


def _qualified_name(model: nn.Module, module: nn.Module) -> str:
    """``module``'s qualified name in ``model`` (as ``named_modules()`` gives it)."""
    return next(n for n, m in model.named_modules() if m is module)


def install(model: nn.Module, states: dict[str, TilingState]) -> None:
    """Patch the planned modules. A module (a head and its model's loss patches, a normalization layer) that an
    earlier call tiled and this plan does not is restored: the last ``enable_tiling`` call says what is tiled."""
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if STATE_ATTR in module.__dict__ and name not in states:
            _restore(module)
        owner = module.__dict__.get(OWNER_ATTR)
        if owner is not None and not any(s.kind == "loss" and s.spec.owner.module_name == name for s in states.values()):
            unpatch_owner(module)
    for name, state in states.items():
        module = modules[name]
        module.__dict__[STATE_ATTR] = state
        if state.kind == "loss":
            module.forward = TiledHeadForward(state, _original_forward(module))
            state.spec.owner.on_new_head = _follow_new_head
            patch_owner(modules[state.spec.owner.module_name], state.spec.owner, state)
        else:
            state.key = module_key(module)
            module.forward = tiled_forward_of(module)


def _follow_new_head(lm: nn.Module) -> None:
    """``lm``'s output layer was replaced since ``enable_tiling`` (``resize_token_embeddings`` makes a new
    ``nn.Linear`` for an untied head): the tiled loss moves to the new head, with the same options and strategy;
    a new head it cannot tile keeps the loss untiled, said once."""
    owner: LossOwner = lm.__dict__[OWNER_ATTR]
    old, new = owner.head, lm.get_output_embeddings()
    state: TilingState = old.__dict__[STATE_ATTR]
    try:
        check_causal_lm(owner.module_name, lm)
    except ValueError as exc:
        warn_once(("new head", owner.name), "%s: its output layer was replaced since enable_tiling and the new one "
                  "cannot be tiled, so its loss is computed untiled (full logits) from now on: %s", owner.name, exc)
        owner.on_new_head = None
        return
    moved = replace(state, spec=replace(state.spec, slots=_head_slots(new)), saved_forward=new.__dict__.get("forward"),
                    path=[*state.path[:-1], weakref.ref(new)], _auto={})
    _restore(old)
    owner.head = new
    new.__dict__[STATE_ATTR] = moved
    new.forward = TiledHeadForward(moved, _original_forward(new))
    lm.loss_function.head_state = moved
    log.info("%s: its output layer was replaced since enable_tiling (resize_token_embeddings?); the tiled loss "
             "moved to the new one (%d classes)", owner.name, new.out_features)


def _restore(module: nn.Module) -> None:
    """Undo one module's forward patch."""
    state = module.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return
    if state.saved_forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = state.saved_forward


def uninstall(model: nn.Module) -> None:
    for _, module in model.named_modules():
        _restore(module)
        unpatch_owner(module)


def tiled_states(model: nn.Module) -> Iterator[tuple[str, nn.Module, TilingState, str]]:
    """``(qualified name, module, tiling state, strategy name)`` of every tiled module, resolving ``auto``
    against the model given (it may be the wrapper), the strategy named with the model's sequence split if any
    (``ddp+sp``, ``fsdp2+cp``: ``distributed.sequence_parallel``). A causal LM whose head was replaced since is
    followed first (as its next call would)."""
    for module in list(model.modules()):
        owner = module.__dict__.get(OWNER_ATTR)
        if owner is not None:
            owner.follow_head(module)
    split = split_of(model)
    suffix = f"+{split.kind}" if split is not None else ""
    for name, module in model.named_modules():
        state = module.__dict__.get(STATE_ATTR)
        if state is None:
            continue
        strategy = state.forced if state.forced is not None else state.detected(module_path(model, module))
        yield name, module, state, strategy.name + suffix


def tiled_names(model: nn.Module) -> dict[str, str]:
    """Qualified name → strategy name (see :func:`tiled_states`)."""
    return {name: strategy for name, _, _, strategy in tiled_states(model)}
