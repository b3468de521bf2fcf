"""Checkpointed layer inputs recomputed from the previous layer's (``placement "recompute"``).

[Note: a recompute chain]
With non-reentrant checkpointing a layer keeps only its input (``tokens x hidden``) from its forward to its
backward. Where neither the device nor the host has room for that input, it need not be kept at all: in a stack,
layer ``i``'s input is what layer ``i - 1`` returned, and layer ``i - 1``'s own input is kept (on the device or the
host) or is itself recomputed. So:

1. forward: layer ``i``'s input is cloned into a tensor only its checkpoint holds (as ``host.py`` does), the layer
   runs, and the clone's storage is freed (``resize_(0)``). What layer ``i - 1`` was called with (its function, its
   arguments, the RNG and autocast state it ran under) is remembered by weak reference: layer ``i - 1``'s own
   checkpoint holds those objects as long as the graph lives, and nothing here may outlive it;
2. backward: a hook on layer ``i``'s outputs fires when their first gradient arrives, before its recompute:
   layer ``i - 1``'s input is made present (copied back from the host and waited for, or rebuilt the same way one
   layer further down), layer ``i - 1`` runs forward once more under the RNG and autocast state of its first
   forward, with a gradient enabled (the very code path of its forward, so bit-identical values) but nothing saved
   for backward, and its output is written into the clone's storage. Then layer ``i``'s checkpoint recomputes as
   usual.

A chain of ``k`` recomputed layers above a kept one costs ``k (k + 1) / 2`` extra layer forwards; the planner
spreads them (one kept layer, one recomputed: one extra forward per recomputed layer). Memory: the recomputed
layer's input and the previous layer's, on the device during the rebuild (the previous one would be there for its
own backward next). Layer ``i``'s input must be the tensor layer ``i - 1`` returned (checked by identity in
forward); where it is not (a model that transforms the hidden states between layers), the layer is offloaded to
the host instead, said once. Results are bit-identical to keeping the input.
Communication: whatever the previous layer's forward does (a wrapper's all-gather), once more.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.profiler import record_function

from ..core.regions import outside_regions
from .storage import fresh_alias, tensors_in

__all__ = ["LayerCall", "recompute_run", "rng_state"]


def _weak(value: Any) -> Callable[[], Any]:
    """A reference that does not keep ``value`` (a tensor or a function) alive; other values are kept."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def _strong(ref: Callable[[], Any], what: str) -> Any:
    value = ref()
    if value is None:
        raise RuntimeError(f"tiledmlp: offload='auto' recomputes a layer's input from the previous layer, whose {what} "
                           "is gone (its checkpoint no longer holds it); this is a bug, please report it")
    return value


@dataclass
class LayerCall:
    """What one checkpointed layer was called with in forward, held weakly (see [Note: a recompute chain]), and how to
    make its input present on the device again (``present``: nothing, a copy back from the host, or a rebuild)."""

    function: Callable[[], Any]
    args: tuple[Callable[[], Any], ...]
    kwargs: dict[str, Callable[[], Any]]
    output: Callable[[], Any]  # the output tensor (the next layer's input, when the identity check holds)
    rng: tuple[torch.Tensor, Optional[torch.Tensor]]
    autocast: Optional[tuple[str, torch.dtype]]
    present: Callable[[], None]

    @staticmethod
    def record(function: Callable[..., Any], args: tuple, kwargs: dict[str, Any], output: Any,
               rng: tuple[torch.Tensor, Optional[torch.Tensor]], present: Callable[[], None]) -> "LayerCall":
        first = next(iter(tensors_in(output)), None)
        device_type = first.device.type if first is not None else "cpu"
        autocast = ((device_type, torch.get_autocast_dtype(device_type))
                    if torch.is_autocast_enabled(device_type) else None)
        return LayerCall(_weak(function), tuple(_weak(a) for a in args), {k: _weak(v) for k, v in kwargs.items()},
                         _weak(first) if first is not None else (lambda: None), rng, autocast, present)

    def feeds(self, value: Any) -> bool:
        """Whether ``value`` is the tensor this call returned, or a view of it with the same layout (FSDP2 hands the
        next layer a ``view_as`` of it): the next layer's input may then be rebuilt from this call."""
        out = self.output()
        if out is None or not isinstance(value, torch.Tensor):
            return False
        return value is out or (value.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
                                and value.storage_offset() == out.storage_offset() and value.dtype == out.dtype
                                and value.shape == out.shape and value.stride() == out.stride())

    def forward_again(self) -> torch.Tensor:
        """This layer's output, computed again from its (present) inputs as its first forward did, saving nothing."""
        self.present()
        function = _strong(self.function, "function")
        args = [_strong(a, "input") for a in self.args]
        kwargs = {k: _strong(v, f"argument {k!r}") for k, v in self.kwargs.items()}
        device = next((t.device for t in tensors_in(args) if t.device.type != "cpu"), None)
        # outside any checkpoint region: this extra forward neither keeps nor takes what a region keeps for its
        # recompute (tiledmlp.core.regions)
        with _rng_as(self.rng, device), _autocast_as(self.autocast), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(_drop, _dropped), _unsharded(function), outside_regions():
            out = function(*args, **kwargs)
        return tensors_in(out)[0].detach()


@contextlib.contextmanager
def _unsharded(function: Callable[..., Any]):
    """The layer behind ``function`` with its parameters gathered when it is an FSDP2 unit: its hooks gathered them
    around its forward, and in backward the unit's own pre-backward hook does, which has not run yet for the layer
    below (its backward comes next). Hugging Face's checkpointing passes ``partial(forward, layer)`` (transformers
    5.24: the hooks stay outside the checkpoint) or ``partial(layer.__call__)`` (before)."""
    inner = getattr(function, "func", function)
    module = getattr(inner, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        module = next((a for a in getattr(function, "args", ()) if isinstance(a, torch.nn.Module)), None)
    fsdp2 = callable(getattr(module, "unshard", None)) and callable(getattr(module, "reshard", None))
    if fsdp2:
        module.unshard()
    try:
        yield
    finally:
        if fsdp2:
            module.reshard()


def _drop(t: torch.Tensor) -> None:
    return None


def _dropped(_: None) -> torch.Tensor:
    raise RuntimeError("tiledmlp: a recompute chain's forward is never differentiated")


def rng_state(device: Optional[torch.device]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The CPU and (CUDA) device RNG states, to run a layer again under the RNG of its first forward."""
    cuda = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _rng_as(state: tuple[torch.Tensor, Optional[torch.Tensor]], device: Optional[torch.device]):
    devices = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
        torch.set_rng_state(state[0])
        if devices and state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _autocast_as(autocast: Optional[tuple[str, torch.dtype]]):
    if autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(autocast[0], dtype=autocast[1])


class _Rebuilt:
    """Layer ``i``'s freed input, and how to compute it again (``previous``: layer ``i - 1``'s call)."""

    def __init__(self, tensor: torch.Tensor, previous: LayerCall, stats: dict[str, int]) -> None:
        self.tensor, self.nbytes, self.previous = tensor, tensor.untyped_storage().nbytes(), previous
        self.stats, self.done = stats, False

    def present(self) -> None:
        if self.done:
            return
        with record_function("tiledmlp::recompute_input"):
            value = self.previous.forward_again()
            self.tensor.untyped_storage().resize_(self.nbytes)
            fresh_alias(self.tensor).copy_(value)
        self.stats["rebuilt"] += 1
        self.done = True
        self.tensor = None  # the checkpoint frees it after the layer's backward, as without a chain


def _before_backward(rebuilt: _Rebuilt, grads: Any) -> None:
    rebuilt.present()


def recompute_run(checkpoint_fn: Callable[..., Any], function: Callable[..., Any], args: tuple, kwargs: dict,
                  position: int, previous: LayerCall, stats: dict[str, int]) -> tuple[Any, tuple, Callable[[], None]]:
    """``checkpoint_fn(function, *args, **kwargs)`` with ``args[position]`` (what ``previous`` returned) freed from
    the end of the forward to the layer's backward, and rebuilt then from ``previous``. Returns the output, the
    arguments as the checkpoint got them, and how to make them present again (for the next layer's chain).
    ``stats``: ``"freed"`` and ``"rebuilt"`` inputs are counted there."""
    args = list(args)
    clone = args[position] = args[position].clone()  # a tensor only the checkpoint holds
    out = checkpoint_fn(function, *args, **kwargs)
    rebuilt = _Rebuilt(clone, previous, stats)
    outs = [t for t in tensors_in(out) if t.requires_grad]
    if not outs or any(t.untyped_storage().data_ptr() == clone.untyped_storage().data_ptr() for t in tensors_in(out)):
        return out, tuple(args), lambda: None  # nothing will recompute it, or an output aliases it: keep it
    clone.untyped_storage().resize_(0)
    stats["freed"] += 1
    torch.autograd.graph.register_multi_grad_hook(outs, functools.partial(_before_backward, rebuilt), mode="any")
    return out, tuple(args), rebuilt.present
