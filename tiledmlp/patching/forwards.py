"""The forwards installed on tiled modules: the eager tiled call (``_tiled_forward``: the module's input cut into
shards by its :class:`~tiledmlp.patching.state.TilingState`'s spec, or its own forward where tiling cannot help or would
skip code), what Dynamo traces instead (``_traced_forward``: one ``tiledmlp::tiled_call`` operator), and that
operator's body (:class:`CompiledCall`: the eager call cut at the autograd node, which the operators run through each
module's key). Bound to each module as a method (:func:`tiled_forward_of`), which copies and pickles rebuild.
"""

from __future__ import annotations

import copyreg
import functools
import logging
import types
from typing import Any, Iterable, Optional

import torch
from torch import nn
from torch.profiler import record_function

from ..attention.layers import reduce_layer_method
from ..attention.norm_outputs import remember_norm_output
from ..core.compiled import OperatorImpl, autocast_name, tiled_call
from ..core.function import SHARD_DEPTH, backward_shards, forward_shards
from ..core.logs import warn_once, warn_once_traced
from ..distributed.detect import is_dtensor
from ..distributed.hooks import HOOK_TABLES, hooked_children
from ..forms.kind import Kind
from ..forms.lora import changed_adapters
from ..forms.quant import quantized_problem
from .planning import replan
from .state import STATE_ATTR, TilingState, original_forward


__all__ = ["COMPILED_CALL", "CompiledCall", "replan_if_changed", "tiled_forward_of"]


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
    return state.spec.policy.one_shard(tokens) if fast else state.spec.form.generic_rows(tokens, hidden) >= tokens


#: Said when a fast-form module's children carry hooks (the fast form would skip them).
_HOOKS_TAKE_GENERIC = ("%s: hooks are registered on %s; the fast %s form does not call the children, so these calls "
                       "take the generic form, which calls them (per shard)")

#: Said when a fast-form module's LoRA adapters changed state since enable_tiling (the fast form computes the old one).
_ADAPTERS_TAKE_GENERIC = ("%s: its LoRA layers changed since enable_tiling (%s); these calls take the generic form, "
                          "which runs peft's own forward. Call enable_tiling again for the fast %s form")


def _children_with_hooks(module: nn.Module) -> list[str]:
    """Names of ``module``'s submodules (itself excluded) with any hook, counted plainly: read here, without a step
    into ``distributed/``. The eager call asks ``hooked_children``, which discounts tensor parallel's and ZeRO-3's
    hooks, only where this finds some (no hook at all: nothing to discount); traced code counts only this way."""
    return [name for name, m in module.named_modules()
            if name and any(len(getattr(m, table, None) or ()) for table in HOOK_TABLES)]


def _hooked_children(module: nn.Module) -> list[str]:
    """``hooked_children`` (hooks a fast form would skip), asked only where :func:`_children_with_hooks` finds any."""
    return hooked_children(module) if _children_with_hooks(module) else []


def _has_tensor(values: Iterable[Any]) -> bool:
    return any(isinstance(v, torch.Tensor) for v in values)


def replan_if_changed(module: nn.Module, state: TilingState) -> TilingState:
    """``module``'s state, planned again (and installed) where its submodules changed since it was planned
    (``state.py``, [Note: a module that changed since it was planned]): a call never computes with children the module
    no longer has, nor misses new ones. Said once per kind of change: at INFO where the module is tiled again, as a
    warning where it now takes the generic form or runs untiled."""
    changes = state.changes(module)
    if not changes:
        return state
    again = replan(module, state, changes)
    module.__dict__[STATE_ATTR] = again
    # said once per change and outcome, naming the first module (a change made to every layer is one line)
    name = f"{again.spec.name} (and any module with the same change)"
    if again.untiled:
        again.fallback = again.untiled
        warn_once(("untiled", changes), "%s: %s", name, again.untiled)
    elif again.warn:
        warn_once(("planned again", changes, again.reason), "%s: its submodules changed since enable_tiling (%s); "
                  "planned again, it takes the generic form: %s", name, changes, again.reason)
    else:
        warn_once(("planned again", changes, again.kind), "%s: its submodules changed since enable_tiling (%s); "
                  "planned again: the %s form, %s", name, changes, again.kind, again.computes or again.reason,
                  level=logging.INFO)
    return again


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
    """A tiled module's call as Dynamo traces it: one ``tiledmlp::tiled_call`` operator (``core/compiled.py``), the
    untiled forward where one shard would do, else the eager call (one graph break, said once)."""
    state: TilingState = module.__dict__[STATE_ATTR]
    if state.changes(module):
        return _replan_and_call(module, args, kwargs)
    if state.traced is None:
        reason = ("its generic form's output cannot be sized before it runs (children that are not Linear-like, "
                  "or a whole MoE block)" if state.spec.layout is None else "its parameters do not all live under it")
        return _eager_call(module, reason, args, kwargs)
    generic = state.spec.layout is None
    original = original_forward(module)
    if state.kind == Kind.MOE:
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
    if state.kind == Kind.NORM and (autocast_name(x.device.type) or any(p.dtype != x.dtype for p in params)):
        # The operator's output is typed like its input (or autocast's dtype): a norm under autocast or with
        # parameters of another dtype may return another one (LayerNorm runs in float32 under autocast).
        return _eager_call(module, "it is a normalization layer called under autocast or with parameters of "
                           "another dtype than its input, whose output dtype is known only when it runs", args, kwargs)
    # Submodules with hooks (the generic form calls them, hooks and all). Counted plainly: the hooks that
    # hooked_children discounts (tensor parallel's, ZeRO-3's) come with DTensor or ZeRO-3 parameters, which took
    # the eager call above; and reading hooks' closures, as it does, is not traceable.
    hooked = [] if generic else _children_with_hooks(module)
    if len(hooked) > 0 and state.kind == Kind.MOE:
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


class CompiledCall(OperatorImpl):
    """The compiled call's operators' body (``core/compiled.py``), as their contract OperatorImpl says: the eager
    call, cut at the autograd node, on the tensors the compiled graph passes, for the module's tiling state now."""

    def op_forward(self, module: nn.Module, x: torch.Tensor, params: list[torch.Tensor],
                   token_inputs: list[torch.Tensor], generic: bool) -> torch.Tensor:
        state = _operated_state(module)
        read = functools.partial(state.spec.form.given, params, not generic)
        with record_function("tiledmlp::call"), state.choice.prepare_call(module, state.spec.name, x, read) as local:
            run = state.spec.prepare(local, module, original_forward(module), token_inputs)
            with record_function("tiledmlp::forward"):
                outs = forward_shards(run.call, run.x, local.params, run.token_inputs)
        # A fast form's output has the input's tokens and the width its weight says (a projection's may differ).
        shaped = len(outs) == 1 and outs[0] is not None and (
            outs[0].shape == x.shape if generic else outs[0].shape[:-1] == x.shape[:-1])
        if run.call.form.returned_tuple or not shaped:
            # Only a generic-form module can get here: its outputs were sized (in the graph) like its input.
            raise RuntimeError(
                f"{state.spec.name}: under torch.compile the tiled call of a generic-form module must return one "
                f"tensor shaped like its input {tuple(x.shape)}; this one returned "
                f"{[None if o is None else tuple(o.shape) for o in outs]}. Call it outside the compiled region, "
                "or tiledmlp.disable_tiling(module).")
        return outs[0]

    def op_backward(self, module: nn.Module, grad: torch.Tensor, x: torch.Tensor, params: list[torch.Tensor],
                    token_inputs: list[torch.Tensor], needs: list[bool], generic: bool) -> list[Optional[torch.Tensor]]:
        """``[dx, d token inputs..., d params...]`` (None where not needed; a tensor given twice gets its
        gradient at its first position only, as autograd sums the positions)."""
        state = _operated_state(module)
        local = state.choice.strategy(module).local_call(state.spec.name, x, state.spec.form.given(params, not generic),
                                                         module)
        run = state.spec.prepare(local, module, original_forward(module), token_inputs)
        n = len(token_inputs)
        need_params = needs[1 + n:]
        unique_needs = [any(need for need, u in zip(need_params, local.index) if u == j)
                        for j in range(len(local.params))]
        dx, d_tokens, unique_grads = backward_shards(run.call, run.x, local.params, run.token_inputs,
                                                     [grad.reshape(run.x.shape[0], -1)], needs[0],
                                                     [*needs[1:1 + n], *unique_needs])
        first = {u: i for i, u in reversed(list(enumerate(local.index)))}
        param_grads = [unique_grads[u] if need and first[u] == i else None
                       for i, (u, need) in enumerate(zip(local.index, need_params))]
        return [None if dx is None else dx.view(x.shape),
                *[None if d is None else d.view(t.shape) for d, t in zip(d_tokens, token_inputs)], *param_grads]


#: What the operators run for every tiled module: each module's key carries it (``patch.add``).
COMPILED_CALL = CompiledCall()


def _operated_state(module: nn.Module) -> TilingState:
    """``module``'s tiling state, for the operator traced for it; TypeError where its tiling was undone or replaced
    since the graph was traced."""
    state = module.__dict__.get(STATE_ATTR)
    if not isinstance(state, TilingState):
        raise TypeError(
            f"tiledmlp::tiled_call: the {type(module).__name__} it was traced for holds "
            f"{'no tiling state' if state is None else type(state).__name__} under {STATE_ATTR!r}, not a TilingState "
            "(tiledmlp.patching.state): its tiling was undone or replaced after the graph was traced. Run a compiled "
            "forward's backward before tiledmlp.disable_tiling, and tile modules with tiledmlp.enable_tiling rather "
            "than by setting that attribute")
    return state


@torch.compiler.disable
def _replan_and_call(module: nn.Module, args: tuple, kwargs: dict):
    """The eager call of a module whose submodules changed since it was planned: it plans the module again
    (:func:`replan_if_changed`); the new state fails the guards of the graph that called this, so the next call is
    traced with the new plan."""
    return _tiled_forward(module, *args, **kwargs)


@torch.compiler.disable
def _eager_call(module: nn.Module, reason: str, args: tuple, kwargs: dict):
    """The eager tiled call from compiled code (a graph break), said once per reason."""
    warn_once(("compile", reason), "%s (and any other tiled module for this reason): under torch.compile its "
              "tiled call runs eagerly, one graph break per call, because %s", module.__dict__[STATE_ATTR].spec.name,
              reason)
    return _tiled_forward(module, *args, **kwargs)


def _tiled_forward(module: nn.Module, *args, **kwargs):  # eager only: compiled code takes _traced_forward
    state: TilingState = module.__dict__[STATE_ATTR]
    original = original_forward(module)
    if state.kind == Kind.MOE:
        return _tiled_experts(module, state, original, args, kwargs)
    x, rebuild = _split_input(state, args, kwargs)
    if SHARD_DEPTH.depth > 0 or not isinstance(x, torch.Tensor) or x.dim() < 2 or x.numel() == 0:
        return original(*args, **kwargs)
    if _one_shard_inference(state, x, state.spec.layout is not None):
        return original(*args, **kwargs)
    state = replan_if_changed(module, state)
    if state.untiled:
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
    hooked = _hooked_children(module) if fast and state.spec.layout is not None else []
    if hooked:  # registered after enable_tiling: the fast form would skip them
        fast = False
        state.fallback = f"hooks on {', '.join(hooked)}: calls take the generic form"
        warn_once(("hooks", state.spec.name, tuple(hooked)), _HOOKS_TAKE_GENERIC, state.spec.name, ", ".join(hooked),
                  state.kind)
    changed = changed_adapters(state.adapters) if fast and state.adapters else []
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
    out = state.spec(state.choice.prepare_call, module, shard_forward, x, fast_allowed=fast)
    if state.remembers_output and not extra:
        remember_norm_output(out, x, functools.partial(_norm_again, module))
    return out


def _norm_again(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A tiled norm's output computed again from its input: its tiled forward (the same shards, so the same bits),
    without its hooks (they ran in the forward)."""
    return module.forward(x)


def _tiled_experts(module: nn.Module, state: TilingState, original, args: tuple, kwargs: dict):
    """An experts module's call: ``(hidden_states, top_k_index, top_k_weights)``, the routing tiled with the
    hidden states as token inputs. Runs the module's own forward where tiling cannot help (inside a shard,
    one shard of inference) or would skip code (hooks on its children)."""
    routed, rest = _experts_args(state, args, kwargs)
    if SHARD_DEPTH.depth > 0 or routed is None or routed[0].numel() == 0 or _has_tensor(rest):
        return original(*args, **kwargs)
    x, index, weights = routed
    if _one_shard_inference(state, x, True):
        return original(*args, **kwargs)
    state = replan_if_changed(module, state)
    if state.untiled:
        return original(*args, **kwargs)
    if state.kind != Kind.MOE:  # planned again as another form: its own call
        return _tiled_forward(module, *args, **kwargs)
    hooked = _hooked_children(module)
    if hooked:
        warn_once(("hooks", state.spec.name, tuple(hooked)), "%s: hooks are registered on %s; the MoE form does not "
                  "call the children, so these calls run the experts untiled", state.spec.name, ", ".join(hooked))
        return original(*args, **kwargs)
    return state.spec(state.choice.prepare_call, module, None, x, token_inputs=(index, weights))
