"""Patch the planned modules' forwards per instance, and undo it; which modules are tiled, with which strategy.

Patching sets an instance attribute ``forward`` (the class is never touched) and keeps the previous
instance forward, if any (e.g. accelerate's hooks), to restore it exactly. The plan is ``tiledmlp.patching.planning``'s,
the patched forwards ``tiledmlp.patching.forwards``'s, the state they share ``tiledmlp.patching.state``'s.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Iterator, Optional

from torch import nn

from ..core.compiled import module_key
from ..core.logs import warn_once
from ..forms.kind import Kind
from ..distributed.detect import module_path
from ..distributed.sequence_parallel import split_of
from ..loss.heads import OWNER_ATTR, LossOwner, TiledHeadForward, check_causal_lm, patch_owner, unpatch_owner
from .forwards import COMPILED_CALL, tiled_forward_of
from .planning import head_slots
from .state import STATE_ATTR, TilingState, original_forward

log = logging.getLogger("tiledmlp")

__all__ = ["install", "add", "uninstall", "tiled_names", "tiled_states", "check_model"]


def check_model(model: object, call: str) -> None:
    """TypeError, naming what ``call`` takes, unless ``model`` is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call} takes the model (a torch.nn.Module, bare or wrapped), got {type(model).__name__}")


def install(model: nn.Module, states: dict[str, TilingState]) -> None:
    """Patch the planned modules. A module (a head and its model's loss patches, a normalization layer) that an
    earlier call tiled and this plan does not is restored: the last ``enable_tiling`` call says what is tiled."""
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if STATE_ATTR in module.__dict__ and name not in states:
            _restore(module)
        owner = module.__dict__.get(OWNER_ATTR)
        if owner is not None and not any(s.kind == Kind.LOSS and s.spec.owner.module_name == name
                                         for s in states.values()):
            unpatch_owner(module)
    add(model, states, modules)


def add(model: nn.Module, states: dict[str, TilingState], modules: Optional[dict[str, nn.Module]] = None) -> None:
    """Patch the planned modules, leaving every other one as it is."""
    modules = dict(model.named_modules()) if modules is None else modules
    for name, state in states.items():
        module = modules[name]
        module.__dict__[STATE_ATTR] = state
        if state.kind == Kind.LOSS:
            module.forward = TiledHeadForward(state, original_forward(module))
            state.spec.owner.on_new_head = _follow_new_head
            patch_owner(modules[state.spec.owner.module_name], state.spec.owner, state)
        else:
            state.key = module_key(module, COMPILED_CALL)
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
        # The old head may still be called (a LoRA wrapper's base layer): it computes its logits from now on, and the
        # loss is the untiled one on them
        warn_once(("new head", owner.name), "%s: its output layer was replaced since enable_tiling and the new one "
                  "cannot be tiled, so its loss is computed untiled (full logits) from now on: %s", owner.name, exc)
        owner.on_new_head = None
        owner.untiled = state.fallback = (f"its output layer was replaced by a {type(new).__name__} that the tiled "
                                          "loss cannot compute: full logits, untiled loss")
        for module in new.modules():  # copies of the tiled head in it (peft's modules_to_save): plain heads now
            if module is not old and getattr(module.__dict__.get(STATE_ATTR), "kind", None) == Kind.LOSS:
                _restore(module)
        return
    slots = head_slots(new)
    moved = replace(state, spec=replace(state.spec, slots=slots), saved_forward=new.__dict__.get("forward"),
                    choice=state.choice.moved_to(new, slots))
    _restore(old)
    owner.head = new
    new.__dict__[STATE_ATTR] = moved
    new.forward = TiledHeadForward(moved, original_forward(new))
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
        strategy = state.choice.strategy_at(module_path(model, module))
        yield name, module, state, strategy.name + suffix


def tiled_names(model: nn.Module) -> dict[str, str]:
    """Qualified name → strategy name (see :func:`tiled_states`)."""
    return {name: strategy for name, _, _, strategy in tiled_states(model)}
