"""An optimizer built by name with a placement (``tiledmlp.optimizers.spec``, [Note: what an optimizer holds, and
when]): torch's AdamW (fused or foreach) or bitsandbytes' 8-bit AdamW on the device; the same stepped in backward;
torch's fused AdamW on the host through torchao's ``CPUOffloadOptimizer``. No optimizer of our own: the placement is
torch's hooks or torchao's."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator, Union

import torch
from torch import nn

from .in_backward import step_in_backward
from .spec import BACKWARD, HOST, spec_named

__all__ = ["build_optimizer"]

Params = Union[nn.Module, Iterable[Any]]


def _params(params: Params) -> list[Any]:
    if isinstance(params, nn.Module):
        return [p for p in dict.fromkeys(params.parameters()) if p.requires_grad]
    return list(params)


def _optimizer_class(algorithm: str, implementation: str) -> tuple[type, dict[str, Any]]:
    if algorithm == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as error:
            raise ImportError("8-bit AdamW is bitsandbytes': pip install bitsandbytes") from error
        return (bnb.optim.PagedAdamW8bit if implementation == "paged 8-bit" else bnb.optim.AdamW8bit), {}
    return torch.optim.AdamW, {"fused": True} if implementation == "fused" else {"foreach": True}


def build_optimizer(params: Params, name: str = "adamw", placement: str = "gpu", **hyperparameters: Any
                    ) -> torch.optim.Optimizer:
    """The optimizer ``name`` (``tiledmlp.optimizers.spec.NAMES``: ``"adamw"`` is torch's fused AdamW, the
    Trainer's ``optim`` names too) over ``params`` (a module's trainable parameters, or parameters / groups) with
    ``hyperparameters`` (``lr``, ``weight_decay``, ...), placed: ``"gpu"`` as built, ``"backward"`` stepped in
    backward (:func:`tiledmlp.optimizers.step_in_backward`), ``"host"`` torchao's ``CPUOffloadOptimizer`` with
    ``offload_gradients=True`` (AdamW only, one CUDA device). Memory per placement: ``tiledmlp.optimizers.spec``."""
    spec = spec_named(name, placement)
    groups = _params(params)
    if not groups:
        raise ValueError("build_optimizer got no trainable parameters")
    cls, flags = _optimizer_class(spec.algorithm, spec.implementation)
    if spec.placement != HOST:
        optimizer = cls(groups, **flags, **hyperparameters)
        if spec.placement == BACKWARD:
            step_in_backward(optimizer)
        return optimizer
    if spec.algorithm != "adamw":
        raise ValueError(f"placement 'host' runs torch's AdamW on the CPU (torchao's CPUOffloadOptimizer); "
                         f"{name!r} has no host step: use 'adamw', or the placement 'gpu' or 'backward'")
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as error:
        raise ImportError("the optimizer placement 'host' uses torchao's CPUOffloadOptimizer: pip install torchao "
                          "(or place the optimizer 'gpu' or 'backward')") from error
    with _owned_hooks() as owned:
        optimizer = CPUOffloadOptimizer(groups, torch.optim.AdamW, offload_gradients=True, fused=True,
                                        **hyperparameters)
    owned.hand_to(optimizer)
    return optimizer


class _OwnedHooks:
    """The post-accumulate-grad hooks an optimizer registers while it is built, made its own: torchao's hold the
    optimizer itself, so the parameters would keep it (and its hooks, moving every later gradient to its host
    copies and freeing it) for as long as they live, also after the optimizer is dropped and another one built.
    Here each hook is re-registered as one that calls it only while the optimizer lives (the optimizer holds the
    hooks; the parameters refer to them weakly), and the parameters' hooks are removed with the optimizer."""

    def __init__(self) -> None:
        self.registered: list[tuple[torch.Tensor, Any, Any]] = []

    def record(self, register: Any) -> Any:
        def recording(tensor: torch.Tensor, hook: Any) -> Any:
            handle = register(tensor, hook)
            self.registered.append((tensor, hook, handle))
            return handle

        return recording

    def hand_to(self, optimizer: Any) -> None:
        hooks, handles = [], []
        for tensor, hook, handle in self.registered:
            handle.remove()
            hooks.append(hook)
            handles.append(tensor.register_post_accumulate_grad_hook(_calling_while_alive(weakref.ref(hook))))
        self.registered.clear()
        optimizer.__dict__["_tiledmlp_owned_hooks"] = hooks
        weakref.finalize(optimizer, _remove_all, handles)


def _calling_while_alive(hook: "weakref.ref[Any]") -> Any:
    def call(tensor: torch.Tensor) -> None:
        alive = hook()
        if alive is not None:
            alive(tensor)

    return call


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


@contextlib.contextmanager
def _owned_hooks() -> Iterator[_OwnedHooks]:
    owned = _OwnedHooks()
    register = torch.Tensor.register_post_accumulate_grad_hook
    torch.Tensor.register_post_accumulate_grad_hook = owned.record(register)
    try:
        yield owned
    finally:
        torch.Tensor.register_post_accumulate_grad_hook = register
