"""The tiled call as one operator for ``torch.compile``: no graph break, no recompile per layer.

[Note: why an operator pair, and what crosses it]
Eagerly, a tiled call is a Python loop over shards inside one autograd node (``function.py``), with a
strategy around it (``distributed/strategies.py``). Dynamo cannot trace that loop usefully (it would
unroll the shards, specialize on their count and trace the strategies' hooks), and a
``torch.compiler.disable``d call costs one graph break per MLP. Here the call is a pair of
``torch.library`` custom operators, ``tiledmlp::tiled_call`` and ``tiledmlp::tiled_call_backward``,
joined by ``register_autograd``: Dynamo and AOTAutograd see one opaque node per call in forward and one
in backward, with registered fake (meta) implementations, and at run time the operators execute the
same eager code — strategy, form, shards, gradient accumulators — as an uncompiled call.

What crosses the operator boundary:

* tensors: the tokens ``x``, every parameter tensor the form reads (explicit inputs, as in eager: the
  backward operator's outputs are their gradients, which autograd accumulates once, so every wrapper's
  hook fires once per backward), and the MoE form's routing tensors;
* the module's *key*: an empty CPU tensor, one per tiled module, that carries the module and what the operators
  run for it as Python attributes (:func:`module_key`). To Dynamo it is one more tensor input — guarded on its
  metadata, which every layer shares, never on its identity — so the decoder layers of a model share one compiled graph
  (no recompile per layer), and AOTAutograd saves it for backward (and for a checkpointed region's
  recompute) like any tensor. Copies and pickles of a tensor copy its attributes, so a copied model's
  keys name the copied modules. (torch's opaque reference objects would say the same more directly,
  but AOTAutograd does not yet save them from a checkpointed region, and torch 2.11 has none.)
* constants equal for every layer (where the output width is read, the autocast dtype), so they cause
  no recompile either. Autocast is passed explicitly and re-entered inside the operators: compiled
  code may run the operator outside the autocast region it was traced in.

Memory and communication are those of the eager call: the operators run it. Under compile the
parameters are saved for backward by AOTAutograd (references, like any op that reads a weight).
The generic form is an operator too: its implementation calls the module's own forward per shard (hooks on
the children run, at run time), and its backward operator differentiates that forward per shard, with
autograd recording switched back on inside the operator (:func:`_autograd_inside`). Its random draws
(dropout) come from a seed the graph draws and hands to both operators, so the recompute sees the forward's
masks. Its output is sized like its input, which the graph can only assume for a module whose Linear-like
children map that width back to itself (checked when it runs).

A fast-form module whose children carry hooks uses the generic operator, as its eager call uses the generic
form. Where the operator cannot be exact (parameters still sharded as DTensors or ZeRO-3 partitions, extra
arguments, a generic module the graph cannot size, hooks on a MoE experts module's children) the call keeps
the eager path and one graph break, said once in a log line (``patching/forwards.py``).

What the operators run is not here: they call the :class:`OperatorImpl` the key carries, which the top layer
implements (``tiledmlp.patching.forwards.CompiledCall``, beside the traced forward; it reads the module's tiling
state from its ``__dict__``, :data:`STATE_ATTR`). :class:`OperatorImpl` is that contract, declared here so that the
dependency shows in an import and is checked: the implementation subclasses it, and :func:`_impl` refuses a key
whose object does not satisfy it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["STATE_ATTR", "OperatorImpl", "autocast_name", "module_key", "tiled_call"]

#: Where a tiled module keeps its tiling state (``tiledmlp.patching.state.TilingState``), in its ``__dict__``: the
#: operators' implementation finds a module's state there, and everything that patches or reads a tiled module uses
#: this name.
STATE_ATTR = "_tiledmlp_state"

_MODULE_ATTR = "_tiledmlp_module"
_IMPL_ATTR = "_tiledmlp_impl"


@runtime_checkable
class OperatorImpl(Protocol):
    """What the operators call for the module a key names (the object the key carries): the eager call, cut at the
    autograd node, on the tensors the compiled graph passes (``tiledmlp.patching.forwards.CompiledCall``)."""

    def op_forward(self, module: torch.nn.Module, x: torch.Tensor, params: list[torch.Tensor],
                   token_inputs: list[torch.Tensor], generic: bool) -> torch.Tensor:
        """``module``'s output for ``x`` (no autograd graph), computed by the generic form when ``generic``."""
        ...

    def op_backward(self, module: torch.nn.Module, grad: torch.Tensor, x: torch.Tensor, params: list[torch.Tensor],
                    token_inputs: list[torch.Tensor], needs: list[bool],
                    generic: bool) -> list[Optional[torch.Tensor]]:
        """``[dx, d token inputs..., d params...]`` for ``grad`` of the output, None where ``needs`` is False."""
        ...


def module_key(module: torch.nn.Module, impl: OperatorImpl) -> torch.Tensor:
    """A new key naming ``module`` to the operators, which run ``impl`` for it (see [Note: why an operator pair, and
    what crosses it])."""
    key = torch.empty(0)
    setattr(key, _MODULE_ATTR, module)
    setattr(key, _IMPL_ATTR, impl)
    return key


def _module(key: torch.Tensor) -> torch.nn.Module:
    return getattr(key, _MODULE_ATTR)


def _impl(key: torch.Tensor) -> OperatorImpl:
    """What the operators run for the module ``key`` names; TypeError if it is not an :class:`OperatorImpl` (an
    ``isinstance`` against the protocol: a few microseconds per operator call)."""
    impl = getattr(key, _IMPL_ATTR, None)
    if not isinstance(impl, OperatorImpl):
        raise TypeError(
            f"tiledmlp::tiled_call: the key of the {type(_module(key)).__name__} it was traced for carries "
            f"{type(impl).__name__}, not an OperatorImpl (op_forward, op_backward; tiledmlp.core.compiled): make keys "
            "with module_key(module, impl); tiledmlp.enable_tiling makes them")
    return impl


def autocast_name(device_type: str) -> str:
    """The autocast dtype's name on ``device_type`` (``""``: autocast off), as the operators take it."""
    if not torch.is_autocast_enabled(device_type):
        return ""
    return str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")


def _autocast(x: torch.Tensor, name: str) -> contextlib.AbstractContextManager:
    if not name:
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, dtype=getattr(torch, name))


@contextlib.contextmanager
def _seeded(seed: Optional[torch.Tensor], device: torch.device) -> Iterator[None]:
    """The CPU generator and ``device``'s seeded with ``seed`` for the block, their states restored after (the
    graph drew the seed from the global stream, which the block leaves untouched otherwise)."""
    if seed is None:
        yield
        return
    devices = [device] if device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        value = int(seed.item())
        torch.default_generator.manual_seed(value)
        for d in devices:
            torch.get_device_module(d).default_generators[d.index or 0].manual_seed(value)
        yield


#: What the dispatcher excludes below an operator's autograd kernel, so that its implementation records
#: no graph; the generic form's backward needs a graph for its recompute (it differentiates the module's
#: own forward), so :func:`_autograd_inside` includes them again for that block.
_AUTOGRAD_KEYS = (torch._C.DispatchKey.ADInplaceOrView, torch._C.DispatchKey.AutogradFunctionality,
                  torch._C.DispatchKey.AutogradOther, torch._C.DispatchKey.AutogradNestedTensor)


@contextlib.contextmanager
def _autograd_inside() -> Iterator[None]:
    """Autograd recording inside an operator's implementation (see :data:`_AUTOGRAD_KEYS`); restored on exit."""
    before = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in _AUTOGRAD_KEYS]
    try:
        for k in _AUTOGRAD_KEYS:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        yield
    finally:
        for k, excluded in zip(_AUTOGRAD_KEYS, before):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, excluded)


def _none_if_empty(needed: Sequence[bool], grads: Sequence[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    return [g if need else None for need, g in zip(needed, grads)]


@torch.library.custom_op("tiledmlp::tiled_call", mutates_args=())
def _tiled_call(key: torch.Tensor, x: torch.Tensor, params: list[torch.Tensor], token_inputs: list[torch.Tensor],
                seed: Optional[torch.Tensor], out_slot: int, out_axis: int, autocast: str) -> torch.Tensor:
    """The tiled module's output for ``x`` (no autograd graph: ``register_autograd`` below makes the node); with a
    ``seed``, by the generic form."""
    with _autocast(x, autocast), torch.no_grad(), _seeded(seed, x.device):
        return _impl(key).op_forward(_module(key), x, params, token_inputs, generic=seed is not None)


@_tiled_call.register_fake
def _(key, x, params, token_inputs, seed, out_slot, out_axis, autocast):
    width = x.shape[-1] if out_slot < 0 else params[out_slot].shape[out_axis]
    dtype = getattr(torch, autocast) if autocast else x.dtype
    return x.new_empty((*x.shape[:-1], width), dtype=dtype)


@torch.library.custom_op("tiledmlp::tiled_call_backward", mutates_args=())
def _tiled_call_backward(key: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, params: list[torch.Tensor],
                         token_inputs: list[torch.Tensor], seed: Optional[torch.Tensor], needs: list[bool],
                         autocast: str) -> list[torch.Tensor]:
    """``[dx, d token inputs..., d params...]`` for the needed ones; an empty tensor for the others."""
    generic = seed is not None  # only its backward records a graph (the fast forms compute their gradients)
    with _autocast(x, autocast), _seeded(seed, x.device), _autograd_inside() if generic else contextlib.nullcontext():
        grads = _impl(key).op_backward(_module(key), grad, x, params, token_inputs, needs, generic=generic)
    return [g if g is not None else x.new_empty(0) for g in grads]


@_tiled_call_backward.register_fake
def _(key, grad, x, params, token_inputs, seed, needs, autocast):
    return [t.new_empty(t.shape) if need else x.new_empty(0)
            for t, need in zip((x, *token_inputs, *params), needs)]


def _setup_context(ctx, inputs, output) -> None:
    key, x, params, token_inputs, seed, _, _, autocast = inputs
    ctx.autocast, ctx.n, ctx.seeded = autocast, len(token_inputs), seed is not None
    ctx.save_for_backward(key, x, *token_inputs, *params, *((seed,) if seed is not None else ()))


def _backward(ctx, grad: torch.Tensor):
    key, x, *rest = ctx.saved_tensors
    seed = rest.pop() if ctx.seeded else None
    token_inputs, params = rest[:ctx.n], rest[ctx.n:]
    _, need_x, need_params, need_tokens, *_ = ctx.needs_input_grad
    needs = [bool(need_x), *map(bool, need_tokens), *map(bool, need_params)]
    grads = _none_if_empty(needs, _tiled_call_backward(key, grad.contiguous(), x, list(params),
                                                       list(token_inputs), seed, needs, ctx.autocast))
    return None, grads[0], grads[1 + ctx.n:], grads[1:1 + ctx.n], None, None, None, None


_tiled_call.register_autograd(_backward, setup_context=_setup_context)


def tiled_call(key: torch.Tensor, x: torch.Tensor, params: Sequence[torch.Tensor],
               token_inputs: Sequence[torch.Tensor], out_slot: int, out_axis: int,
               generic: bool = False) -> torch.Tensor:
    """The operator call, as traced code makes it, for the module ``key`` names. The output has ``x``'s
    leading dims and ``params[out_slot].shape[out_axis]`` features (``out_slot`` -1: ``x``'s width).
    ``generic``: computed by the generic form, which may draw random numbers (dropout): a seed drawn in the
    graph is then an input of both operators, so that backward recomputes the shards with the forward's draws
    (the seed's presence is what tells the operators to use the generic form)."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64) if generic else None
    return torch.ops.tiledmlp.tiled_call(key, x, list(params), list(token_inputs), seed, out_slot, out_axis,
                                         autocast_name(x.device.type))
