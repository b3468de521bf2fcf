"""The per-module tiling state: the plan of one tiled module (:class:`TilingState`: its call spec, form, strategy
choice, the forward it replaced, how compiled code reaches it, the submodules it was planned for and the options to
plan it again), kept in the module's ``__dict__`` under :data:`STATE_ATTR`. The strategy is picked by its
:class:`~tiledmlp.distributed.selection.StrategyChoice`, the calls run by ``forwards.py`` (eager, traced, and the
compiled operator's body). Imported by the planning (which makes states), the patched forwards (which read them) and
the installer; imports none of them.

[Note: a module that changed since it was planned]
A state is a plan for the module as it was: which children compute what (``spec.slots``' owners, the layout, the
LoRA adapters), never the parameter tensors themselves, which every call reads through the slots (so a parameter
replaced on its module — ``load_state_dict(assign=True)``, ``to_empty()``, an optimizer wrapper, FSDP2's unsharded
parameters — is followed by construction). What a call cannot follow is a submodule replaced, added or removed:
peft's ``get_peft_model`` or ``add_adapter`` after ``enable_tiling`` (TRL's ``SFTTrainer(peft_config=...)``),
``merge_and_unload()``, a projection assigned anew. So the state keeps the module's subtree as it was planned
(:attr:`TilingState.members`, ``named_modules()``: the modules themselves) and every call that would tile checks
it by identity (:meth:`TilingState.changes`: one walk of the module's few submodules); a module that changed is
planned again, with the options ``enable_tiling`` was given (:class:`PlanOptions`), before the call runs
(``tiledmlp.patching.planning.replan``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..core.compiled import STATE_ATTR
from ..core.sharding import ShardPolicy
from ..distributed.selection import StrategyChoice
from ..forms.base import read_slots
from ..forms.kind import Kind
from .call_spec import TiledCallSpec

__all__ = ["STATE_ATTR", "PlanOptions", "TilingState", "TracedCall"]


@dataclass(frozen=True)
class PlanOptions:
    """What ``enable_tiling`` asked of the modules it planned: kept by each state, so that a module that changed
    since is planned again as it would be now (``planning.replan``)."""

    strategy: str
    policy: ShardPolicy
    extra_types: tuple[type, ...] = ()
    include_moe: bool = True
    form: str = "auto"
    grad_accum_dtype: Optional[torch.dtype] = None
    norms: bool = False
    projections: bool = False


@dataclass
class TilingState:
    """Everything the patched forward of one module needs: its plan."""

    spec: TiledCallSpec
    kind: Kind  # the form
    input_name: str
    # The instance forward before patching; None when the instance had none (a value, not a sentinel
    # object, so that copies and pickles of the model still recognize it).
    saved_forward: Any
    choice: StrategyChoice  # its strategy: forced, or ``auto``'s (``distributed/selection.py``)
    reason: str = ""  # why a module that looks like an MLP got the generic form
    warn: bool = False  # whether that reason is worth a warning (not for a form the user asked for)
    computes: str = ""  # what a fast form computes, in the module's own names
    # The MoE form's token inputs beside the hidden states: the routing indices' and weights' names
    token_input_names: tuple = ()
    # How a compiled call reaches this module's tensors (None: compiled calls take the eager path)
    traced: Optional[TracedCall] = None
    adapters: tuple = ()  # the fast form's LoRA adapters (tiledmlp.forms.lora), whose state every call checks
    key: Optional[torch.Tensor] = None  # names this module to the compiled call's operators (set by install)
    fallback: str = ""  # calls seen at run time that took the untiled path, and why (describe(); said once in a log)
    # a normalization layer's outputs are remembered for projections that keep its input (attention=True sets it)
    remembers_output: bool = False
    # The module's subtree when it was planned (``named_modules()``, itself first), checked by identity at every
    # call (:meth:`changes`), and the options to plan it again; a loss head has neither (its owner follows a new head)
    members: tuple = ()
    options: Optional[PlanOptions] = None
    untiled: str = ""  # why a module that changed since enable_tiling runs its own forward ("" while it is tiled)

    def changes(self, module: nn.Module) -> str:
        """What was replaced, added or removed below ``module`` since it was planned ("" if nothing): an identity
        walk of its submodules; the names are worked out only when something changed."""
        if self.options is None:
            return ""
        now = module.modules()
        if all(next(now, None) is m for _, m in self.members) and next(now, None) is None:
            return ""
        then, now = dict(self.members), dict(module.named_modules())

        def outermost(names: list[str], above: list[str] = ()) -> list[str]:  # not below another one listed
            return [n for n in names if not any(n.startswith(o + ".") for o in [*names, *above] if o != n)]

        replaced = outermost([n for n in now if n in then and now[n] is not then[n]])
        added = outermost([n for n in now if n not in then], replaced)
        removed = outermost([n for n in then if n not in now], replaced)
        return "; ".join(
            [f"{', '.join(f'{n} ({type(now[n]).__name__})' for n in replaced)} replaced"] * bool(replaced)
            + [f"new: {', '.join(added)}"] * bool(added) + [f"removed: {', '.join(removed)}"] * bool(removed))

    def params(self) -> Optional[list[torch.Tensor]]:
        """The module's parameter tensors as its slots hold them now (None where a wrapper keeps them
        elsewhere outside forward, e.g. FSDP1 flat parameters)."""
        try:
            return read_slots(self.spec.slots)
        except AttributeError:
            return None


@dataclass(frozen=True)
class TracedCall:
    """What traced code needs to call a fast form's operator (``core/compiled.py``): each parameter slot as a path
    from the module (``"gate_proj.weight"``; getattr from the module, so Dynamo guards nothing per layer)
    and where the output's width is read (``params[out_slot].shape[out_axis]``; -1: the input's width)."""

    slot_paths: tuple[str, ...]
    out_slot: int
    out_axis: int
    # The generic form: the input widths the module maps back to themselves (its output is sized like its
    # input, checked when it runs); empty for the fast forms.
    widths: tuple[int, ...] = ()


def original_forward(module: nn.Module):
    saved = saved_forward(module)
    # A partial, not types.MethodType: Dynamo traces through it (no graph break under torch.compile).
    return saved if saved is not None else functools.partial(type(module).forward, module)


def saved_forward(module: nn.Module) -> Any:
    """The instance forward ``module`` had before tiling (kept by its state when it is tiled), or None."""
    previous = module.__dict__.get(STATE_ATTR)
    return previous.saved_forward if previous is not None else module.__dict__.get("forward")
