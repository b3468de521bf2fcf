"""The per-module tiling state: what the patched forward of one tiled module needs (:class:`TilingState`: its call spec,
form, strategy, the forward it replaced, how compiled code reaches it, the submodules it was planned for and the
options to plan it again), kept in the module's ``__dict__`` under :data:`STATE_ATTR`, and the operators'
implementations the compiled call runs on it (:class:`~tiledmlp.core.compiled.OperatorImpl`). Imported by the
planning (which makes states), the patched forwards (which read them) and the installer; imports none of them.

Design note — a module that changed since it was planned
--------------------------------------------------------
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
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn
from torch.profiler import record_function

from ..core.compiled import STATE_ATTR, OperatorImpl
from ..core.function import backward_shards, forward_shards
from ..core.sharding import ShardPolicy
from ..distributed.detect import Wrapping
from ..distributed.selection import StrategyChoice, owning_units, validate_forced, wrapping_of
from ..distributed.strategies import Strategy
from ..distributed.tensor_parallel import Localized
from ..forms.base import read_slots
from ..forms.kind import Kind
from ..forms.spec import Reading
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
class TilingState(OperatorImpl):
    """Everything the patched forward of one module needs, and the compiled call's operators (``core/compiled.py``)
    through :class:`~tiledmlp.core.compiled.OperatorImpl`, which it implements."""

    spec: TiledCallSpec
    kind: Kind  # the form
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
    # a strategy the user forced while the module was unwrapped: checked against the wrapping at the first call that
    # finds one (as a strategy forced on a wrapped module is checked when tiling is enabled)
    recheck: bool = False
    _choice: StrategyChoice = field(default_factory=StrategyChoice)  # strategy="auto": the last decision

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

    def _path_to(self, module: nn.Module) -> list[nn.Module]:
        """The modules from the root to ``module`` (``module`` alone where the path is gone or is another's)."""
        path = [m for m in (ref() for ref in self.path) if m is not None]
        return path if path and path[-1] is module else [module]

    def strategy(self, module: nn.Module) -> Strategy:
        return self.strategy_at(self._path_to(module))

    def opened(self, module: nn.Module, module_name: str, x: torch.Tensor,
               read: Callable[[], Reading]) -> ContextManager[Localized]:
        """The strategy's part of one call of ``module`` (``Strategy.opened``), with ``auto``'s choice in the same
        step (``StrategyChoice.opened``): the call goes into ``distributed/`` once for both."""
        if self.forced is not None:
            return self.strategy(module).opened(module, module_name, x, read)
        return self._choice.opened(self._path_to(module), module=module, x=x, read=read, **self._wrapping_facts())

    def strategy_at(self, path: list[nn.Module]) -> Strategy:
        """The strategy of the module at the end of ``path`` (root first), as wrapped now."""
        if self.forced is not None:
            if self.recheck:
                self._check_forced(path)
            return self.forced
        return self.detected(path)

    def _check_forced(self, path: list[nn.Module]) -> None:
        """A forced strategy against the wrapping the module has now; ValueError naming the fitting one when it does
        not match (``strategy="plain"`` given before DDP or FSDP wrapped the model)."""
        wrapping, tp = wrapping_of(path, **self._wrapping_facts())
        if wrapping is not Wrapping.NONE:
            self.forced = validate_forced(self.forced.name, wrapping, self.spec.name, owning_units(path, wrapping), tp)
            self.recheck = False

    def detected(self, path: list[nn.Module]) -> Strategy:
        """The strategy ``auto`` picks for this module at the end of ``path`` (root first), as wrapped now: decided
        once per wrapping (``distributed.selection``, design note "decided once, checked cheaply")."""
        return self._choice.choose(path, **self._wrapping_facts())

    def _wrapping_facts(self) -> dict[str, Any]:
        """What reading this module's wrapping takes besides its path (``distributed.selection``): its slots, fast
        layout, name, why it takes the generic form, and whether it is an LM head."""
        return dict(slots=self.spec.slots, layout=getattr(self.spec, "layout", None), label=self.spec.name,
                    reason=self.reason, head=self.kind == Kind.LOSS)

    def __getstate__(self):  # picklable: weak references and run-time caches are dropped
        return {**self.__dict__, "path": [], "_choice": StrategyChoice()}

    # The compiled call's operators (``core/compiled.py``), as their contract OperatorImpl says: the eager call, cut
    # at the autograd node, on the tensors the compiled graph passes.

    def op_forward(self, module: nn.Module, x: torch.Tensor, params: list[torch.Tensor],
                   token_inputs: list[torch.Tensor], generic: bool) -> torch.Tensor:
        read = functools.partial(self.spec.form.given, params, not generic)
        with record_function("tiledmlp::call"), self.opened(module, self.spec.name, x, read) as local:
            run = self.spec.prepare(local, module, original_forward(module), token_inputs)
            with record_function("tiledmlp::forward"):
                outs = forward_shards(run.call, run.x, local.params, run.token_inputs)
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
        local = self.strategy(module).local_call(self.spec.name, x, self.spec.form.given(params, not generic), module)
        run = self.spec.prepare(local, module, original_forward(module), token_inputs)
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
