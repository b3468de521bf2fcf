"""Modules added to a tiled model after ``enable_tiling``: tiled at the model's next training call, as if they had been
there. A tiled module follows what changes below it itself (``state.py``, [Note: a module that changed since it was
planned]); what appears elsewhere — peft's LoRA layers on the attention projections with ``projections=True``, a
replaced MLP or normalization layer — has no tiled module above it to notice. So ``enable_tiling`` leaves a forward
pre-hook on the model it was given (:class:`FollowAdded`), which keeps that model's modules (``modules()`` order) and,
at each call with a gradient, compares them by identity: a walk of the model's modules (about a millisecond for an 8B
model with LoRA adapters); inference, generation and compiled calls skip it. When they changed, the new modules are
planned with the options ``enable_tiling`` was given (``planning.plan_added``) and patched, said once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..attention.layers import attention_layers
from ..core.logs import warn_once
from ..forms.kind import Kind
from .patch import add
from .planning import plan_added
from .state import PlanOptions

__all__ = ["FollowAdded", "install_follower", "uninstall_follower"]

_FOLLOW_ATTR = "_tiledmlp_follow_added"


class FollowAdded:
    """Forward pre-hook on the model ``enable_tiling`` was given (copies and pickles of the model keep it: it holds
    the model's own modules and the options)."""

    def __init__(self, model: nn.Module, options: PlanOptions) -> None:
        self.options = options
        self.members = tuple(model.modules())

    def __call__(self, model: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        now = model.modules()
        if all(next(now, None) is m for m in self.members) and next(now, None) is None:
            return
        known = {id(m) for m in self.members}
        self.members = tuple(model.modules())
        states = plan_added(model, self.options, known)
        if not states:
            return
        remembers = bool(attention_layers(model))  # a new norm's output is remembered where attention=True reads it
        for state in states.values():
            state.remembers_output = state.kind == Kind.NORM and remembers
        add(model, states)
        kinds = sorted({s.kind for s in states.values()})
        warn_once(("added", tuple(states)), "%d module(s) added since enable_tiling are tiled now (%s: %s)",
                  len(states), ", ".join(kinds), ", ".join(list(states)[:4]) + (", ..." if len(states) > 4 else ""),
                  level=logging.INFO)


def install_follower(model: nn.Module, options: PlanOptions) -> None:
    """The pre-hook on ``model`` (one: an earlier ``enable_tiling``'s is replaced)."""
    uninstall_follower(model)
    hook = FollowAdded(model, options)
    model.__dict__[_FOLLOW_ATTR] = (hook, model.register_forward_pre_hook(hook))


def uninstall_follower(model: nn.Module) -> None:
    installed = model.__dict__.pop(_FOLLOW_ATTR, None)
    if installed is not None:
        installed[1].remove()
