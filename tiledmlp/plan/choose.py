"""The options a length picks: ``enable_tiling(model, seq_len=T)`` plans each combination of the memory options not
given (:data:`CHOICES`) and takes the fastest that fits, by the plan's estimate of a step's time
(``tiledmlp.plan.timing``, [Note: what differs between the options])."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from ..offload.checkpointing import checkpointing_modules
from .plans import MemoryPlan, plan_for_shape, refusal
from .shapes import model_shape
from .timing import step_seconds

__all__ = ["CHOICES", "options_for_length"]

#: the memory options ``enable_tiling(model, seq_len=T)`` chooses among where they are not given: of the combinations
#: that fit, the fastest by the plan's estimate (``tiledmlp.plan.timing``, [Note: what differs between the options]),
#: the fewest options on a tie;
#: ``offload`` is ``"auto"`` wherever the layers checkpoint (every placement of None or ``"cpu"`` is one of its own,
#: and it places each step's inputs again at run time, so a longer step than planned is placed, not run out of memory)
CHOICES = {"norms": (False, True), "attention": (False, True)}


@dataclass(frozen=True)
class _Candidate:
    options: dict[str, Any]
    checkpointing: bool  # the model's layers checkpoint (turned on where they did not)
    plan: MemoryPlan
    seconds: float

    def said(self) -> str:
        on = [f"{k}={v!r}" for k, v in self.options.items() if k in (*CHOICES, "offload") and v not in (False, None)]
        return ", ".join(on + (["checkpointing"] if self.checkpointing else [])) or "no option"


def options_for_length(model: nn.Module, seq_len: int, given: dict[str, Any], gpu_mib: Optional[float] = None,
                       host_mib: Optional[float] = None) -> tuple[dict[str, Any], MemoryPlan, str]:
    """The options of ``enable_tiling`` for steps of ``seq_len`` tokens: those ``given``, and of the others
    (:data:`CHOICES`) those with which the step fits the budgets and is fastest by the plan's estimate
    (``tiledmlp.plan.timing``), an optimizer given by name placed the fastest way that fits (:func:`plan_memory`); a
    model that does not checkpoint is planned as it is, and with its layers checkpointed where it must be. Returns the
    options (``checkpointing=True`` where it must be turned on; ``optimizer_placement`` where one was placed), their
    plan, and why, with the runner-up, in one phrase. ValueError, with the longest length any of them fits and with
    which options, when none fits."""
    free = {key: values for key, values in CHOICES.items() if key not in given}
    fixed = {"loss": given.get("loss") is not False, "projections": given.get("projections", False),
             **{key: given[key] for key in (*CHOICES, "offload") if key in given}}
    optimizer = {key: given[key] for key in ("optimizer", "optimizer_placement") if given.get(key) is not None}
    checkpointed = bool(checkpointing_modules(model))
    candidates = []
    for checkpointing in (True,) if checkpointed else (False, True):
        shape = model_shape(model, checkpointed=checkpointing)
        for values in itertools.product(*free.values()):
            options = {"offload": "auto" if checkpointing else None, **fixed, **dict(zip(free, values))}
            if options["offload"] is not None and not checkpointing:
                continue  # offload moves checkpointed inputs
            plan = plan_for_shape(model, shape, seq_len, 1, 1, gpu_mib, host_mib, optimizer, options)
            candidates.append(_Candidate(options, checkpointing and not checkpointed, plan,
                                         step_seconds(shape, plan.options, plan.tokens, plan.placement,
                                                      plan.attention_kept)))
    fitting = sorted((c for c in candidates if c.plan.fits), key=lambda c: c.seconds)
    if not fitting:
        longest = max(candidates, key=lambda c: c.plan.longest_seq_len)
        shape = model_shape(model, checkpointed=longest.checkpointing or checkpointed)
        raise ValueError(f"enable_tiling(seq_len={seq_len}): {refusal(longest.plan, shape)} (with {longest.said()})")
    best = fitting[0]
    if len(fitting) == 1:
        why = (f"the only one of {len(candidates)} configurations that fits, about {best.seconds:.1f} s a step by the "
               "plan's estimate")
    else:
        why = (f"the fastest of {len(fitting)} configurations that fit, about {best.seconds:.1f} s a step by the "
               f"plan's estimate; the runner-up, {fitting[1].said()}, about {fitting[1].seconds:.1f} s")
    chosen = dict(best.options, **({"checkpointing": True} if best.checkpointing else {}))
    if best.plan.optimizer.spec is not None and given.get("optimizer") is not None:
        chosen["optimizer_placement"] = best.plan.optimizer.spec.placement
    return chosen, best.plan, why
